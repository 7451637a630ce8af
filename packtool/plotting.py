"""One figure of what the packer did: fill per pack, samples per pack, padding, drops.

matplotlib is an optional extra (``pip install packtool[plot]``); it is imported only
when a figure is asked for, with the non-interactive Agg backend.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import logging
from pathlib import Path

import numpy as np

from .errors import ConfigError, OutputError
from .stats import StatsData

__all__ = ["plot_stats", "figure_digest", "write_demo_figure", "plot_path_problem", "FIGURE_SUFFIXES", "COLOURS"]

log = logging.getLogger(__name__)

#: The figure formats ``--plot`` writes, by file suffix: the ones whose bytes depend only on the
#: data (each is written without a timestamp or software version). Other matplotlib formats are
#: refused: EPS/PS stamp the creation date, PGF needs LaTeX, and JPEG/TIFF/WebP add nothing to PNG.
FIGURE_SUFFIXES = (".png", ".svg", ".pdf")


def plot_path_problem(out: str | Path) -> str | None:
    """Why ``out`` cannot name a figure, or ``None``: its suffix must be one of :data:`FIGURE_SUFFIXES`
    (any case). Needs no matplotlib, so a bad name is refused before anything is computed.

    Example:
        >>> plot_path_problem("stats.png") is None
        True
        >>> plot_path_problem("stats.txt")
        "'stats.txt' ends in .txt, which is not a figure format packtool writes; end the name in .png, .svg or .pdf"
    """
    out = Path(out)
    suffix = out.suffix.lower()
    if suffix in FIGURE_SUFFIXES:
        return None
    what = f"ends in {out.suffix}, which is not a figure format packtool writes" if suffix else \
        "has no suffix to say the figure format"
    return f"{str(out)!r} {what}; end the name in .png, .svg or .pdf"


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


def _whole_numbers():
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


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
    ax.xaxis.set_major_locator(_whole_numbers())  # pack ranks
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
    ax.yaxis.set_major_locator(_whole_numbers())  # counts of packs
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
    # the count of rows in goes under the panel: a title wider than the panel runs off the figure
    title, of = "rejected and dropped rows", f" (of {rows_in:,} rows in)" if rows_in else ""
    if not rows:
        done = "tokenized" if stats.get("kind") == "tokenized" else "packed"  # a tokenized directory has no packs
        _empty(ax, title, f"none: all {rows_in:,} rows were {done}" if rows_in else f"none: every row was {done}")
        return
    y = np.arange(len(rows))[::-1]
    counts = np.array([r[1] for r in rows])
    ax.barh(y, counts, color=COLOURS["drops"], height=0.6)
    for yi, c in zip(y, counts, strict=True):
        ax.text(c, yi, f" {c:,}", va="center", fontsize=8)
    ax.set_yticks(y, [r[0] for r in rows])
    ax.set_xlim(0, counts.max() * 1.25)
    ax.set_title(title)
    ax.set_xlabel("rows" + of)


def figure_digest(data: StatsData, stats: dict) -> str:
    """A digest of everything the figure draws: two renders of equal digests are the same figure."""
    h = hashlib.sha256()
    for arr in (data.pack_tokens, data.pack_units, data.pack_samples):
        h.update(b"-" if arr is None else np.ascontiguousarray(arr, dtype=np.int64).tobytes())
    keep = {k: stats.get(k) for k in ("samples", "packs", "lower_bound", "capacities", "vision_unit", "padding",
                                      "rejected", "alone", "truncated", "rows_in")}
    h.update(json.dumps(keep, sort_keys=True).encode())
    return h.hexdigest()


#: The settings every figure is drawn and saved with (a fixed SVG id salt: the same bytes each time).
FIGURE_RC = {"svg.hashsalt": "packtool", "font.size": 9}


def _figure(plt, data: StatsData, stats: dict, dpi: int):
    """The 2×2 figure of :func:`plot_stats`, laid out, not yet saved (drawn under :data:`FIGURE_RC`)."""
    fig, axes = plt.subplots(2, 2, figsize=(9, 6), dpi=dpi)
    (a_fill, a_spp), (a_pad, a_drop) = axes
    _fill_sorted(a_fill, data, stats)
    _samples_per_pack(a_spp, data)
    _padding(a_pad, stats)
    _drops(a_drop, stats)
    where = stats.get("packed") or stats.get("tokenized") or ""
    head = f"{Path(where).name or where}: {stats['samples']:,} samples"
    if stats.get("packs") is not None:
        head += f" in {stats['packs']:,} packs (lower bound {stats['lower_bound']:,})"
    fig.suptitle(head, fontsize=11)
    fig.tight_layout()
    return fig


def plot_stats(data: StatsData, stats: dict, out: str | Path, dpi: int = 80) -> Path:
    """Write a 2×2 figure a person reads in seconds: each pack's fill sorted (the badly filled
    tail shows), samples per pack (axis fitted to the data), padding against naive batching,
    and rejected or dropped rows by reason.

    The bytes depend only on the data (no timestamps or software versions in the file); a PNG
    records :func:`figure_digest` of what it draws under ``Description``.

    Args:
        data: the arrays (:func:`packtool.stats.load_stats_data`).
        stats: their summary (:func:`packtool.stats.summarize`).
        out: the image path; the format follows its suffix (``.png``, ``.svg``, ``.pdf``);
            missing parent directories are created, as ``-o`` creates an output directory.

    Raises:
        ConfigError: the suffix is not one of :data:`FIGURE_SUFFIXES`, or matplotlib is not installed.
        OutputError: ``out`` is a directory, or the file cannot be written (no permission, a
            read-only file system, disk full); a partly written file is removed.
    """
    problem = plot_path_problem(out)
    if problem:
        raise ConfigError(f"--plot {problem}")
    out = Path(out)
    if out.is_dir():
        raise OutputError(f"cannot write the plot to {str(out)!r}: it is a directory; name a file in it, "
                          f"e.g. {str(out / 'stats.png')!r}")
    plt = _pyplot()
    import matplotlib

    with matplotlib.rc_context(FIGURE_RC):
        fig = _figure(plt, data, stats, dpi)
        suffix = out.suffix.lower()
        # no timestamps or software versions: each backend names them differently
        metadata = {
            ".png": {"Software": None, "Description": f"packtool stats figure, data sha256 {figure_digest(data, stats)}"},
            ".svg": {"Date": None, "Creator": None},
            ".pdf": {"CreationDate": None, "Creator": None, "Producer": None},
        }[suffix]
        try:
            _save(fig, out, dpi, metadata)
        finally:
            plt.close(fig)
    log.info("wrote %s", out)
    return out


def _save(fig, out: Path, dpi: int, metadata: dict) -> None:
    """``fig`` to ``out`` in the format of its suffix; an OSError becomes an OutputError naming the path.

    The figure is rendered in memory and then written, so a failed write is this function's own
    OSError (matplotlib's PDF writer turns a full disk into an AttributeError of its own)."""
    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, metadata=metadata, format=out.suffix[1:].lower())
    existed = out.exists()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(buf.getvalue())
    except OSError as exc:
        if not existed:  # no half-written figure left behind (disk full)
            with contextlib.suppress(OSError):
                out.unlink()
        blocker = next((a for a in out.parents if a.exists() and not a.is_dir()), None)
        reason = f"{str(blocker)!r} is a file, not a folder" if blocker is not None else (exc.strerror or str(exc))
        fix = "free some space or pass --plot another path" if exc.errno == errno.ENOSPC else \
            "pass --plot a path you can write to"
        raise OutputError(f"cannot write the plot to {str(out)!r}: {reason[:1].lower()}{reason[1:]}; {fix}") from None


def write_demo_figure(demo: str | Path, out: str | Path) -> Path:
    """The README's figure: stats of the demo pair ``demo/tokenized`` and ``demo/packed``."""
    from .stats import load_stats_data, summarize

    data = load_stats_data(Path(demo) / "tokenized", Path(demo) / "packed")
    return plot_stats(data, summarize(data), out)
