"""``packtool stats`` on a large tokenized + packed pair: seconds and peak memory.

The pair is 1,000,000 generated LLaVA-like samples (``bench/corpus.py``) packed with the
defaults, media by reference; ``packtool stats TOKENIZED PACKED`` then runs as a separate
process (the real CLI) while its memory is sampled from ``/proc``. Stats reads only length
columns and matches sample ids with hash joins, so time and memory grow linearly.

    PACKTOOL_BENCH_DIR=/tmp/b .venv/bin/python -m bench stats
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from bench.bench_scale import measure
from bench.corpus import write_tokenized

CACHE = Path(os.environ.get("PACKTOOL_BENCH_DIR", "build/bench"))


def stats_bench(n: int) -> dict:
    from packtool.config import PackConfig
    from packtool.pipeline import pack_dataset
    from packtool.shards import read_manifest

    tok = CACHE / f"tokenized-llava-{n}"
    write_tokenized(tok, "llava", n, seed=3)
    packed = CACHE / f"packed-stats-llava-{n}"
    try:
        read_manifest(packed, "packed")
    except Exception:  # noqa: BLE001 - not there (or not finished): pack it
        shutil.rmtree(packed, ignore_errors=True)
        t0 = time.perf_counter()
        pack_dataset(tok, packed, PackConfig(media="reference"), workers=2)
        print(f"packed {n:,} samples in {time.perf_counter() - t0:.0f} s", flush=True)
    r = measure(["stats", str(tok), str(packed), "--json"])
    import json

    s = json.loads(r["stdout"])
    return {"samples": s["samples"], "packs": s["packs"], "balanced": s["reconcile"]["balanced"],
            "seconds": r["wall_s"], "cpu_s": r["cpu_s"], "peak_rss": r["rss"], "load": os.getloadavg()[0]}


def run(quick: bool = False) -> str:
    n = 100_000 if quick else 1_000_000
    s = stats_bench(n)
    return "\n".join([
        f"### `packtool stats TOKENIZED PACKED` on {s['samples']:,} samples ({s['packs']:,} packs, "
        f"load average {s['load']:.1f})", "",
        "| samples | packs | reconciled | wall seconds | CPU seconds | peak memory (RSS) |",
        "| ---: | ---: | --- | ---: | ---: | ---: |",
        f"| {s['samples']:,} | {s['packs']:,} | {'ok' if s['balanced'] else 'MISMATCH'} | {s['seconds']:.1f} | "
        f"{s['cpu_s']:.1f} | {s['peak_rss'] / 1e9:.2f} GB |",
    ])
