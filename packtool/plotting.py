"""One figure of what the packer did: fill per pack, samples per pack, padding, drops.

matplotlib is an optional extra (``pip install packtool[plot]``); it is imported only
when a figure is asked for, with the non-interactive Agg backend.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np

from .errors import ConfigError
from .stats import StatsData

__all__ = ["plot_stats", "figure_digest", "write_demo_figure", "COLOURS"]

log = logging.getLogger(__name__)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib, an optional extra: pip install packtool[plot]") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _empty(ax, title: str, why: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


COLOURS = {"tokens": "#4C72B0", "vision": "#DD8452", "samples": "#55A868", "padding": "#8172B3", "drops": "#C44E52"}


def _fill_sorted(ax, data: StatsData, stats: dict) -> None:
    """Each pack's fill, fullest first: the tail of badly filled packs is the right end."""
    title = "fill per pack, sorted"
    caps = data.capacities or {}
    max_t, max_u = caps.get("max_tokens"), caps.get("max_vision_units")
    if data.pack_tokens is None or len(data.pack_tokens) == 0 or not max_t:
        _empty(ax, title, "no packs (a tokenized directory)")
        return
    n = len(data.pack_tokens)
    x = np.arange(1, n + 1)
    tok = np.sort(data.pack_tokens / max_t)[::-1] * 100
    ax.step(x, tok, where="mid", color=COLOURS["tokens"], lw=2.5,
            label=f"tokens of {max_t:,} (mean {tok.mean():.1f}%, min {tok.min():.1f}%)")
    if max_u and data.pack_units is not None:
        vis = np.sort(data.pack_units / max_u)[::-1] * 100
        unit = stats.get("vision_unit") or "vision units"
        ax.step(x, vis, where="mid", color=COLOURS["vision"], lw=2.5,
                label=f"{unit} of {max_u:,} (mean {vis.mean():.1f}%)")
    ax.axhline(100, color="0.6", lw=0.8)
    ax.set_xlim(0.5, n + 0.5)
    ax.set_ylim(0, max(105.0, float(tok.max()) + 5))
    ax.set_title(title)
    ax.set_xlabel("pack (fullest first)")
    ax.set_ylabel("% of capacity")
    ax.legend(loc="lower left", frameon=False, fontsize=7)


def _samples_per_pack(ax, data: StatsData) -> None:
    if data.pack_samples is None or len(data.pack_samples) == 0:
        _empty(ax, "samples per pack", "no packs")
        return
    values, counts = np.unique(data.pack_samples, return_counts=True)
    ax.bar(values, counts, color=COLOURS["samples"], width=0.8)
    ax.set_xlim(values.min() - 0.6, values.max() + 0.6)  # fitted to the data, not to a fixed range
    ax.set_xticks(values if len(values) <= 12 else np.linspace(values.min(), values.max(), 12).round())
    ax.set_title(f"samples per pack (mean {data.pack_samples.mean():.1f})")
    ax.set_xlabel("samples")
    ax.set_ylabel("packs")


def _padding(ax, stats: dict) -> None:
    pad = stats.get("padding")
    if not pad:
        _empty(ax, "padding", "no samples")
        return
    rows = [(f"naive, batch {n['batch_size']}", n["pad_tokens"], n["waste"]) for n in pad["naive"]]
    if pad.get("packtool"):
        p = pad["packtool"]
        rows.append(("packed", p["pad_tokens"], p["waste"]))
    labels = [r[0] for r in rows]
    waste = np.array([r[2] * 100 for r in rows])
    colours = ["0.65"] * len(pad["naive"]) + ([COLOURS["padding"]] if pad.get("packtool") else [])
    y = np.arange(len(rows))[::-1]
    ax.barh(y, waste, color=colours, height=0.6)
    for yi, (_, tokens, w) in zip(y, rows, strict=True):
        ax.text(w * 100 + 1, yi, f"{w:.1%} ({tokens:,} tokens)", va="center", fontsize=8)
    ax.set_yticks(y, labels)
    ax.set_xlim(0, 100)
    ax.set_title("padding: share of token slots wasted")
    ax.set_xlabel("% of slots that are padding")


def _drops(ax, stats: dict) -> None:
    rej = stats.get("rejected") or {"tokenize": {}, "pack": {}}
    rows = [(f"tokenize: {k}", v) for k, v in rej["tokenize"].items()]
    rows += [(f"pack: {k}", v) for k, v in rej["pack"].items()]
    if stats.get("alone"):
        rows.append(("pack: alone (over capacity)", stats["alone"]))
    if stats.get("truncated"):
        rows.append(("pack: truncated", stats["truncated"]))
    rows_in = stats.get("rows_in")
    title = "rejected and dropped rows" + (f" (of {rows_in:,} rows in)" if rows_in else "")
    if not rows:
        _empty(ax, title, "none: every row was packed")
        return
    y = np.arange(len(rows))[::-1]
    counts = np.array([r[1] for r in rows])
    ax.barh(y, counts, color=COLOURS["drops"], height=0.6)
    for yi, c in zip(y, counts, strict=True):
        ax.text(c, yi, f" {c:,}", va="center", fontsize=8)
    ax.set_yticks(y, [r[0] for r in rows])
    ax.set_xlim(0, counts.max() * 1.25)
    ax.set_title(title)
    ax.set_xlabel("rows")


def figure_digest(data: StatsData, stats: dict) -> str:
    """A digest of everything the figure draws: two renders of equal digests are the same figure."""
    h = hashlib.sha256()
    for arr in (data.pack_tokens, data.pack_units, data.pack_samples):
        h.update(b"-" if arr is None else np.ascontiguousarray(arr, dtype=np.int64).tobytes())
    keep = {k: stats.get(k) for k in ("samples", "packs", "lower_bound", "capacities", "vision_unit", "padding",
                                      "rejected", "alone", "truncated", "rows_in")}
    h.update(json.dumps(keep, sort_keys=True).encode())
    return h.hexdigest()


def plot_stats(data: StatsData, stats: dict, out: str | Path, dpi: int = 80) -> Path:
    """Write a 2×2 figure a person reads in seconds: each pack's fill sorted (the badly filled
    tail shows), samples per pack (axis fitted to the data), padding against naive batching,
    and rejected or dropped rows by reason.

    The bytes depend only on the data (no timestamps or software versions in the file); a PNG
    records :func:`figure_digest` of what it draws under ``Description``.

    Args:
        data: the arrays (:func:`packtool.stats.load_stats_data`).
        stats: their summary (:func:`packtool.stats.summarize`).
        out: the image path; the format follows its suffix (``.png``, ``.svg``, ``.pdf``).

    Raises:
        ConfigError: matplotlib is not installed.
    """
    plt = _pyplot()
    import matplotlib

    out = Path(out)
    with matplotlib.rc_context({"svg.hashsalt": "packtool", "font.size": 9}):
        fig, axes = plt.subplots(2, 2, figsize=(9, 6), dpi=dpi)
        (a_fill, a_spp), (a_pad, a_drop) = axes
        _fill_sorted(a_fill, data, stats)
        _samples_per_pack(a_spp, data)
        _padding(a_pad, stats)
        _drops(a_drop, stats)
        from matplotlib.ticker import MaxNLocator

        a_spp.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts are whole numbers
        a_fill.xaxis.set_major_locator(MaxNLocator(integer=True))  # pack ranks too
        where = stats.get("packed") or stats.get("tokenized") or ""
        head = f"{Path(where).name or where}: {stats['samples']:,} samples"
        if stats.get("packs") is not None:
            head += f" in {stats['packs']:,} packs (lower bound {stats['lower_bound']:,})"
        fig.suptitle(head, fontsize=11)
        fig.tight_layout()
        out.parent.mkdir(parents=True, exist_ok=True)
        suffix = out.suffix.lower()
        metadata = {"Software": None, "Description": f"packtool stats figure, data sha256 {figure_digest(data, stats)}"} \
            if suffix == ".png" else {"Date": None, "Creator": None} if suffix in (".svg", ".pdf") else None
        fig.savefig(out, dpi=dpi, metadata=metadata)
        plt.close(fig)
    log.info("wrote %s", out)
    return out


def write_demo_figure(demo: str | Path, out: str | Path) -> Path:
    """The README's figure: stats of the demo pair ``demo/tokenized`` and ``demo/packed``."""
    from .stats import load_stats_data, summarize

    data = load_stats_data(Path(demo) / "tokenized", Path(demo) / "packed")
    return plot_stats(data, summarize(data), out)
