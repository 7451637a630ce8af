"""The mixture step against pack time (issue 17: under 5 % of pack time at 1M samples).

The mixture step is what ``pack A B C --rates 1.0,2.5,0.2`` does before any task runs:
the rounding rule, the seeded subsets (a ``splitmix64`` key per row) and the interleaving
of the sources into one stream cut into tasks, plus the stream's digest for resume checks
(``mixture.plan_mixture``; pure arithmetic on sample counts). It is timed at 1,000,000
sample ids (three sources of 400,000, 240,000 and 360,000 samples).

Packing a 1M-sample mixture end to end does not fit the shared 2-core bench machine in a
bench run, so pack time is measured on a smaller mixture of generated LLaVA-like tokenized
sources (``bench.corpus``, the same three-way split, media by reference, one worker) and
scaled per sample; in the same run the same sources concatenated are packed as one plain
directory, the baseline for what a mixture task costs beyond ordinary packing.

    PACKTOOL_BENCH_DIR=/tmp/b .venv/bin/python -m bench mixture
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path

from bench.corpus import write_tokenized

CACHE = Path(os.environ.get("PACKTOOL_BENCH_DIR", "build/bench"))
RATES = "1.0,2.5,0.2"
SPLIT = (0.4, 0.24, 0.36)


def mixture_step(n: int, repeats: int = 5) -> dict:
    """Median seconds of ``plan_mixture`` (and the plan's digest) for sources totalling ``n`` samples."""
    from packtool.mixture import Mixture, plan_mixture

    available = [int(n * f) for f in SPLIT]
    mix = Mixture.from_rates(["a", "b", "c"], RATES)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan = plan_mixture(mix, available)
        plan.digest()
        times.append(time.perf_counter() - t0)
    return {"available": sum(available), "entries": sum(plan.requested), "tasks": len(plan.tasks),
            "seconds": statistics.median(times)}


def pack_times(n: int, repeats: int = 2) -> dict:
    """Seconds to pack the three-source mixture of ``n`` samples, and its sources as plain directories."""
    from packtool.config import PackConfig
    from packtool.mixture import Mixture
    from packtool.pipeline import pack_dataset

    sizes = [int(n * f) for f in SPLIT]
    srcs = []
    for i, k in enumerate(sizes):
        d = CACHE / f"tokenized-mix{i}-llava-{k}"
        write_tokenized(d, "llava", k, seed=20 + i)
        srcs.append(d)
    cfg = PackConfig(max_tokens=16384, max_vision_units=128, vision_weight=30, media="reference")
    pack_dataset(srcs[0], CACHE / "warmup", cfg, overwrite=True, workers=1, dry_run=True)  # numba load
    mixed_s, plain_s = [], []
    for _ in range(repeats):  # alternated, best of each: other jobs on the machine slow one run, not both
        out = CACHE / "packed-mixture"
        shutil.rmtree(out, ignore_errors=True)  # a finished run with the same config would be reused
        t0 = time.perf_counter()
        manifest = pack_dataset(Mixture.from_rates([str(s) for s in srcs], RATES), out, cfg, workers=1)
        mixed_s.append(time.perf_counter() - t0)
        # baseline: the same samples at rate 1 each as plain directories, one after the other
        total = 0.0
        plain_samples = 0
        for s in srcs:
            o = CACHE / f"packed-plain-{s.name}"
            shutil.rmtree(o, ignore_errors=True)
            t0 = time.perf_counter()
            m = pack_dataset(s, o, cfg, workers=1)
            total += time.perf_counter() - t0
            plain_samples += m["counts"]["samples_in"]
        plain_s.append(total)
    return {"samples": manifest["counts"]["samples_in"], "packs": manifest["counts"]["packs"], "seconds": min(mixed_s),
            "plain_samples": plain_samples, "plain_seconds": min(plain_s)}


def run(quick: bool = False) -> str:
    n_step = 100_000 if quick else 1_000_000
    n_pack = 10_000 if quick else 100_000
    step = mixture_step(n_step)
    step_small = mixture_step(n_pack)
    p = pack_times(n_pack)
    per_sample = p["seconds"] / p["samples"]
    pack_at_step = per_sample * step["entries"]
    plain_rate = p["plain_samples"] / p["plain_seconds"]
    load = os.getloadavg()[0]
    return "\n".join([
        f"rates {RATES} over three generated LLaVA-like sources (40/24/36 %), one worker, media by reference, "
        f"load average {load:.1f}", "",
        "| what | samples | seconds | per sample |",
        "| --- | ---: | ---: | ---: |",
        f"| mixture step (plan + digest), {step['available']:,} sample ids | {step['entries']:,} | "
        f"{step['seconds']:.3f} | {step['seconds'] / step['entries'] * 1e6:.2f} µs |",
        f"| mixture step, {step_small['available']:,} sample ids | {step_small['entries']:,} | "
        f"{step_small['seconds']:.3f} | {step_small['seconds'] / step_small['entries'] * 1e6:.2f} µs |",
        f"| pack the mixture ({n_pack:,} sample ids), whole stage | {p['samples']:,} | {p['seconds']:.1f} | "
        f"{per_sample * 1e6:.0f} µs |",
        f"| baseline: pack the three sources as plain directories | {p['plain_samples']:,} | {p['plain_seconds']:.1f} | "
        f"{p['plain_seconds'] / p['plain_samples'] * 1e6:.0f} µs |",
        "",
        f"mixture step at {step['available']:,} sample ids: {step['seconds']:.3f} s against {pack_at_step:,.0f} s of "
        f"packing its {step['entries']:,} samples (measured per sample at {n_pack:,}, scaled) = "
        f"**{step['seconds'] / pack_at_step:.3%}** of pack time; measured at {n_pack:,}: "
        f"{step_small['seconds'] / p['seconds']:.3%}. A mixture task packs at "
        f"{p['samples'] / p['seconds'] / plain_rate:.2f}x the plain rate.",
    ])
