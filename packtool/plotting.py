"""One figure of what the packer did: fill histograms, samples per pack, sample lengths.

matplotlib is an optional extra (``pip install packtool[plot]``); it is imported only
when a figure is asked for, with the non-interactive Agg backend.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from .errors import ConfigError
from .stats import StatsData

__all__ = ["plot_stats"]

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


def _fill_hist(ax, fill: np.ndarray | None, title: str, colour: str) -> None:
    if fill is None or len(fill) == 0:
        _empty(ax, title, "no packs")
        return
    top = max(1.0, float(fill.max()))
    ax.hist(fill * 100, bins=np.linspace(0, top * 100, 21), color=colour, edgecolor="white")
    ax.axvline(fill.mean() * 100, color="black", lw=1, ls="--", label=f"mean {fill.mean():.1%}")
    ax.set_title(title)
    ax.set_xlabel("% of capacity")
    ax.set_ylabel("packs")
    ax.legend(loc="upper left", frameon=False, fontsize=8)


def plot_stats(data: StatsData, stats: dict, out: str | Path, dpi: int = 80) -> Path:
    """Write a 2×2 PNG: token fill, vision fill, samples per pack, sample length.

    Args:
        data: the arrays (:func:`packtool.stats.load_stats_data`).
        stats: their summary (:func:`packtool.stats.summarize`), for titles.
        out: the image path; the format follows its suffix (``.png``, ``.svg``, ``.pdf``).

    Raises:
        ConfigError: matplotlib is not installed.
    """
    plt = _pyplot()
    out = Path(out)
    caps = data.capacities or {}
    fig, axes = plt.subplots(2, 2, figsize=(9, 6), dpi=dpi)
    (a_tok, a_vis), (a_spp, a_len) = axes
    max_t, max_u = caps.get("max_tokens"), caps.get("max_vision_units")
    tok_fill = data.pack_tokens / max_t if data.pack_tokens is not None and max_t else None
    vis_fill = data.pack_units / max_u if data.pack_units is not None and max_u else None
    _fill_hist(a_tok, tok_fill, f"token fill ({max_t:,} per pack)" if max_t else "token fill", "#4C72B0")
    unit = stats.get("vision_unit") or "vision units"
    _fill_hist(a_vis, vis_fill, f"vision fill ({max_u:,} {unit} per pack)" if max_u else "vision fill", "#DD8452")
    if data.pack_samples is not None and len(data.pack_samples):
        values, counts = np.unique(data.pack_samples, return_counts=True)
        a_spp.bar(values, counts, color="#55A868", width=0.8)
        a_spp.set_title("samples per pack")
        a_spp.set_xlabel("samples")
        a_spp.set_ylabel("packs")
        a_spp.xaxis.get_major_locator().set_params(integer=True)
    else:
        _empty(a_spp, "samples per pack", "no packs")
    lengths = data.pack_sample_tokens if data.pack_sample_tokens is not None else data.sample_tokens
    if lengths is not None and len(lengths):
        lo, hi = max(1, int(lengths.min())), max(2, int(lengths.max()))
        bins = np.geomspace(lo, hi * 1.001, 25) if hi > 4 * lo else 20
        a_len.hist(lengths, bins=bins, color="#8172B3", edgecolor="white")
        if isinstance(bins, np.ndarray):
            a_len.set_xscale("log")
        a_len.set_title(f"sample length ({len(lengths):,} samples)")
        a_len.set_xlabel("tokens")
        a_len.set_ylabel("samples")
    else:
        _empty(a_len, "sample length", "no samples")
    from matplotlib.ticker import MaxNLocator

    for ax in axes.flat:  # counts are whole numbers (empty panels have no ticks)
        if isinstance(ax.yaxis.get_major_locator(), MaxNLocator):
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    where = stats.get("packed") or stats.get("tokenized") or ""
    head = f"{Path(where).name or where}: {stats['samples']:,} samples"
    if stats.get("packs") is not None:
        head += f" in {stats['packs']:,} packs (lower bound {stats['lower_bound']:,})"
    fig.suptitle(head, fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi, metadata={"Software": None} if out.suffix.lower() == ".png" else None)
    plt.close(fig)
    log.info("wrote %s", out)
    return out
