"""Per-file cost of the two things ``pack --media embed`` does to every image file: the
check before planning that the file is the one tokenize counted (a ``stat``), and the read
of its bytes. Each is timed the way it was done before issue 16's last round beside the way
it is done now, alternating, best of three, over a tree of distinct files (as in a real
corpus, where nearly every sample has its own image; the ``qwen-images`` pack bench cycles
through 16 files, which hides the per-file cost of the check)."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from bench.bench_pack import _load


def _best(fn, paths: list[str], passes: int = 3) -> float:
    """Fewest microseconds per path of ``fn`` over ``paths`` in ``passes`` passes."""
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        for p in paths:
            fn(p)
        best = min(best, time.perf_counter() - t0)
    return best / len(paths) * 1e6


def run(quick: bool = False) -> str:
    from packtool.media import MediaPathResolver, resolve_media_path

    n, n_dirs, size = (2_000, 4, 2_000) if quick else (20_000, 20, 20_000)
    root = Path(tempfile.mkdtemp(prefix="bench-media-"))
    try:
        for d in range(n_dirs):
            (root / f"d{d:02d}").mkdir()
        paths = [f"d{i % n_dirs:02d}/img{i:06d}.jpg" for i in range(n)]
        body = os.urandom(size)
        for p in paths:
            (root / p).write_bytes(body)
        resolver = MediaPathResolver(root)
        rows = [("check before planning (`stat`)", lambda p: resolve_media_path(p, root).stat(), resolver.stat),
                ("read the bytes to embed", lambda p: resolver(p).read_bytes(), resolver.read)]
        out = [f"{n:,} distinct files of {size:,} bytes in {n_dirs} directories, page cache warm; "
               f"microseconds per file, best of 3 (load {_load()}):", "",
               "| step | before | now | before / now |", "| --- | ---: | ---: | ---: |"]
        for label, before, now in rows:
            b, a = _best(before, paths), _best(now, paths)
            out.append(f"| {label} | {b:.1f} | {a:.1f} | {b / a:.1f}x |")
        return "\n".join(out)
    finally:
        shutil.rmtree(root, ignore_errors=True)
