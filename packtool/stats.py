"""Statistics of tokenized and packed directories, computed from the length columns.

``compute_stats(dir)`` returns a plain dict (the ``--json`` output); ``render_stats``
formats it as the human table the CLI prints.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from .pipeline import lower_bound
from .shards import iter_shard_tables, read_manifest

__all__ = ["compute_stats", "render_stats", "STATS_VERSION"]

STATS_VERSION = 1


def _dist(x: np.ndarray) -> dict:
    if len(x) == 0:
        return {"mean": 0.0, "p5": 0.0, "p50": 0.0, "min": 0.0, "max": 0.0}
    return {
        "mean": round(float(x.mean()), 4),
        "p5": round(float(np.percentile(x, 5)), 4),
        "p50": round(float(np.percentile(x, 50)), 4),
        "min": round(float(x.min()), 4),
        "max": round(float(x.max()), 4),
    }


def compute_stats(path: str | Path) -> dict:
    """Statistics of a packed (or tokenized) directory.

    For a packed directory: samples, packs, token and vision fill per pack, packs against
    the lower bound of DESIGN.md §4, samples per pack, and what was dropped.
    """
    path = Path(path)
    manifest = read_manifest(path)
    kind = manifest["kind"]
    counts = manifest.get("counts", {})
    if kind == "packed":
        cols = ["n_tokens", "n_vision_units", "sample_ids"]
        tok, units, per_pack = [], [], []
        for t in iter_shard_tables(path, manifest, cols):
            tok.append(t["n_tokens"].to_numpy())
            units.append(t["n_vision_units"].to_numpy())
            per_pack.append(pc.list_value_length(t["sample_ids"]).to_numpy(zero_copy_only=False))
        tok_a = np.concatenate(tok) if tok else np.zeros(0, np.int64)
        units_a = np.concatenate(units) if units else np.zeros(0, np.int64)
        per_a = np.concatenate(per_pack) if per_pack else np.zeros(0, np.int64)
        caps = manifest["capacities"]
        max_tokens, max_units = caps["max_tokens"], caps["max_vision_units"]
        lb = lower_bound(int(tok_a.sum()), int(units_a.sum()), max_tokens, max_units)
        n_packs = len(tok_a)
        return {
            "stats_version": STATS_VERSION,
            "kind": "packed",
            "path": str(path),
            "capacities": caps,
            "samples": int(per_a.sum()),
            "packs": n_packs,
            "lower_bound": lb,
            "packs_over_lower_bound": round(n_packs / lb, 4) if lb else None,
            "tokens": int(tok_a.sum()),
            "vision_units": int(units_a.sum()),
            "token_fill": _dist(tok_a / max_tokens) if max_tokens else _dist(np.zeros(0)),
            "vision_fill": _dist(units_a / max_units) if max_units else _dist(np.zeros(0)),
            "samples_per_pack": _dist(per_a.astype(np.float64)),
            "dropped": int(counts.get("dropped", 0)),
            "alone": int(counts.get("alone", 0)),
            "truncated": int(counts.get("truncated", 0)),
            "rejected_by_reason": counts.get("rejected_by_reason", {}),
        }
    cols = ["n_tokens", "n_vision_units", "n_branches"]
    tok, units, br = [], [], []
    for t in iter_shard_tables(path, manifest, cols):
        tok.append(t["n_tokens"].to_numpy())
        units.append(t["n_vision_units"].to_numpy())
        br.append(t["n_branches"].to_numpy())
    tok_a = np.concatenate(tok) if tok else np.zeros(0, np.int64)
    units_a = np.concatenate(units) if units else np.zeros(0, np.int64)
    br_a = np.concatenate(br) if br else np.zeros(0, np.int64)
    return {
        "stats_version": STATS_VERSION,
        "kind": "tokenized",
        "path": str(path),
        "rows_in": int(counts.get("rows_in", len(tok_a))),
        "samples": len(tok_a),
        "rejected": int(counts.get("rejected", 0)),
        "rejected_by_reason": counts.get("rejected_by_reason", {}),
        "tokens": int(tok_a.sum()),
        "vision_units": int(units_a.sum()),
        "tokens_per_sample": _dist(tok_a.astype(np.float64)),
        "vision_units_per_sample": _dist(units_a.astype(np.float64)),
        "branches_per_sample": _dist(br_a.astype(np.float64)),
    }


def _fmt_dist(d: dict, pct: bool = False) -> str:
    if pct:
        return f"mean {d['mean']:.1%}  p5 {d['p5']:.1%}  p50 {d['p50']:.1%}"
    return f"mean {d['mean']:,.1f}  p5 {d['p5']:,.1f}  p50 {d['p50']:,.1f}  max {d['max']:,.0f}"


def render_stats(s: dict) -> str:
    """The human-readable table of :func:`compute_stats` output."""
    rows: list[tuple[str, str]] = []
    if s["kind"] == "packed":
        caps = s["capacities"]
        ratio = f" ({s['packs_over_lower_bound']:.3f}x)" if s["packs_over_lower_bound"] else ""
        rows += [
            ("capacities", f"{caps['max_tokens']:,} tokens, {caps['max_vision_units']:,} vision units"),
            ("samples", f"{s['samples']:,}"),
            ("packs", f"{s['packs']:,}"),
            ("lower bound", f"{s['lower_bound']:,}{ratio}"),
            ("token fill", _fmt_dist(s["token_fill"], pct=True)),
            ("vision fill", _fmt_dist(s["vision_fill"], pct=True)),
            ("samples per pack", _fmt_dist(s["samples_per_pack"])),
            ("dropped / alone / truncated", f"{s['dropped']:,} / {s['alone']:,} / {s['truncated']:,}"),
        ]
    else:
        rows += [
            ("rows in", f"{s['rows_in']:,}"),
            ("samples", f"{s['samples']:,}"),
            ("rejected", f"{s['rejected']:,}"),
            ("tokens", f"{s['tokens']:,}"),
            ("vision units", f"{s['vision_units']:,}"),
            ("tokens per sample", _fmt_dist(s["tokens_per_sample"])),
            ("branches per sample", _fmt_dist(s["branches_per_sample"])),
        ]
    for reason, n in sorted(s.get("rejected_by_reason", {}).items()):
        rows.append((f"  rejected: {reason}", f"{n:,}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
