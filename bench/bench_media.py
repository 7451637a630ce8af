"""Per-file cost of the two things ``pack --media embed`` does to every image file: the
check before planning that the file is the one tokenize counted (a ``stat``), and the read
of its bytes. Each is timed the way it was done before issue 16's last round beside the way
it is done now, alternating, best of three, over a tree of distinct files (as in a real
corpus, where nearly every sample has its own image; the ``qwen-images`` pack bench cycles
through 16 files, which hides the per-file cost of the check).

Then the codec of the embedded bytes (:func:`payload_bench`): ``pack --media embed`` of a
corpus whose every sample has its own photo-like JPEG, with the payload column stored as it is
(what a shard of such files gets now) and zstd-compressed (what every shard got before), the
two alternating in the same run. The ``qwen-images`` corpus cannot show this: its 16 pool
images are one flat colour each, which zstd takes 350:1."""

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
        return "\n".join(out) + "\n\n" + payload_bench(quick)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def photo_like_jpeg(rng, width: int, height: int, quality: int = 90) -> bytes:
    """A JPEG that compresses like a photograph: smooth gradients, texture noise; no two alike."""
    import io

    import numpy as np
    from PIL import Image

    x = np.linspace(0, 1, width)[None, :, None]
    y = np.linspace(0, 1, height)[:, None, None]
    base = 255 * (rng.random(3) * x + rng.random(3) * y) / 2 + rng.integers(0, 128, 3)
    img = (base + rng.normal(0, rng.uniform(5, 30), (height, width, 3))).clip(0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def payload_bench(quick: bool = False, rounds: int = 3) -> str:
    """``pack --media embed`` (one worker, the defaults) of N samples with a distinct photo-like
    JPEG each, the payload column stored as it is (now) or zstd-compressed (before), alternating."""
    import json
    import random

    import numpy as np

    import packtool.shards as shards
    from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset

    n = 300 if quick else 1_500
    root = Path(tempfile.mkdtemp(prefix="bench-payload-"))
    now = shards.writer_options
    try:
        rng = np.random.default_rng(3)
        words = random.Random(3)
        (root / "images").mkdir()
        with open(root / "data.jsonl", "w") as fh:
            for i in range(n):
                w, h = int(rng.integers(320, 800)), int(rng.integers(240, 600))
                (root / "images" / f"{i:05d}.jpg").write_bytes(photo_like_jpeg(rng, w, h))
                q = " ".join(words.choice(["what", "is", "in", "the", "picture", "describe", "colour"]) for _ in range(8))
                fh.write(json.dumps({"id": str(i), "image": f"images/{i:05d}.jpg", "conversations": [
                    {"from": "human", "value": f"<image>\n{q}?"}, {"from": "gpt", "value": q}]}) + "\n")
        image_bytes = sum(p.stat().st_size for p in (root / "images").iterdir())
        tokenize_dataset([root / "data.jsonl"], root / "tok", TokenizeConfig(media_root=str(root)), workers=1)
        modes = {"stored as it is (now)": now, "zstd level 1 (before)": lambda schema, group: shards._WRITE_OPTS}
        best = {m: float("inf") for m in modes}
        size = {}
        for _ in range(rounds):
            for label, options in modes.items():
                shards.writer_options = options
                out = root / "packed"
                shutil.rmtree(out, ignore_errors=True)
                t0 = time.process_time()
                manifest = pack_dataset(root / "tok", out, PackConfig(), workers=1)
                best[label] = min(best[label], time.process_time() - t0)
                size[label] = sum(s["bytes"] for s in manifest["shards"])
        before, after = best["zstd level 1 (before)"], best["stored as it is (now)"]
        lines = [f"`pack --media embed`, {n:,} samples with a distinct photo-like JPEG each ({image_bytes / 1e6:.1f} MB of "
                 f"images), one worker, CPU seconds, best of {rounds} (load {_load()}):", "",
                 "| payload column | CPU s | samples per CPU s | packed MB |", "| --- | ---: | ---: | ---: |"]
        for label in modes:
            lines.append(f"| {label} | {best[label]:.2f} | {n / best[label]:,.0f} | {size[label] / 1e6:.2f} |")
        lines.append(f"\nnow / before: **{before / after:.2f}x** the samples per CPU second, "
                     f"{size['stored as it is (now)'] / size['zstd level 1 (before)']:.4f}x the bytes")
        return "\n".join(lines)
    finally:
        shards.writer_options = now
        shutil.rmtree(root, ignore_errors=True)
