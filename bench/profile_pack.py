"""Where ``pack`` spends its time on the default family with images.

``python -m bench.profile_pack [N] [--media embed] [--mix llava] [--before]`` generates the
``qwen-images`` corpus (``bench.corpus``; N samples, default 60,000; ``--mix llava``: the
text-heavy LLaVA-like corpus of the throughput row instead), packs it with the defaults on one
worker under cProfile, and prints the split by stage and the top functions by own time. ``--before``
plans with the patch axis quantized to 1,024 cells, as the planner did before issue 16.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import shutil
import sys
import time
from pathlib import Path

from bench.bench_pack import CACHE, _cfg, _load, _quantized_unit_axis
from bench.corpus import write_tokenized

#: Stage -> substrings of the profiled functions whose own time counts for it.
STAGES = {
    "knapsack": ("knapsack.py", "_stream_packs"),  # the buffer loop calls the solve from compiled code
    "Parquet read": ("read_row_group", "core.py:605(read)", "iter_batches"),
    "Parquet write": ("write_table", "ParquetWriter"),
    "gather into packs": ("_gather_runs",),
    "media bytes": ("media.py", "posixpath", "pathlib", "method 'read' of '_io", "io.open"),
}


def main(argv: list[str]) -> int:
    import packtool.packer as packer
    from packtool.config import PackConfig
    from packtool.pipeline import pack_dataset

    nums = [a for a in argv if a.isdigit()]
    n = int(nums[0]) if nums else 60_000
    media = "embed" if "--media" in argv and argv[argv.index("--media") + 1] == "embed" else "reference"
    mix = argv[argv.index("--mix") + 1] if "--mix" in argv else "qwen-images"
    src = CACHE / f"tokenized-{mix}-{n}"
    write_tokenized(src, mix, n, seed=5 if mix == "qwen-images" else 3)
    cfg = _cfg(media=media) if mix == "llava" else PackConfig(media=media)
    pack_dataset(src, CACHE / "warmup", cfg, overwrite=True, workers=1, dry_run=True)  # numba load
    out = CACHE / "profile-pack"
    shutil.rmtree(out, ignore_errors=True)
    if "--before" in argv:
        packer.unit_axis = _quantized_unit_axis
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    manifest = pack_dataset(src, out, cfg, workers=1)
    prof.disable()
    dt = time.perf_counter() - t0
    c = manifest["counts"]
    print(f"{c['samples_in']:,} samples -> {c['packs']:,} packs (lower bound {c['lower_bound']:,}) in {dt:.2f} s under "
          f"cProfile: {c['samples_in'] / dt:,.0f} samples/s, media {media}, load {_load()}")
    stats = pstats.Stats(prof)
    split = dict.fromkeys(STAGES, 0.0)
    for (file, line, name), (_, _, tottime, _, _) in stats.stats.items():
        where = f"{file}:{line}({name})"
        for stage, keys in STAGES.items():
            if any(k in where for k in keys):
                split[stage] += tottime
                break
    rest = stats.total_tt - sum(split.values())
    print(" | ".join(f"{k} {v:.2f} s" for k, v in split.items()) + f" | the rest {rest:.2f} s")
    print(top_functions(prof))
    return 0


def top_functions(prof: cProfile.Profile, n: int = 12) -> str:
    """The profile's ``n`` top functions by own time, as pstats prints them (header on)."""
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(n)
    lines = buf.getvalue().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip().startswith("ncalls"))
    root = str(Path(__file__).resolve().parents[1]) + "/"  # the checkout's own files by their repository path
    return "\n".join(ln.replace(sys.prefix, "<venv>").replace(root, "") for ln in lines[start:] if ln.strip())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
