"""Media probe throughput: header-only image probe (images/s) and header-only video probe (videos/s),
each against a full-decode baseline measured in the same run (the ratio is the speedup)."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import av
import numpy as np
from PIL import Image

from packtool.media import probe_image, probe_video

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(_ROOT / "tests"))


def _images(root: Path, n: int) -> list[Path]:
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        w, h = [(1280, 720), (640, 480), (1024, 1024), (800, 1200)][i % 4]
        arr = rng.integers(0, 255, (h // 8, w // 8, 3), dtype=np.uint8)
        img = Image.fromarray(arr).resize((w, h))
        p = root / f"img{i:03d}.{'jpg' if i % 2 else 'png'}"
        img.save(p, quality=90) if i % 2 else img.save(p)
        paths.append(p)
    return paths


def _videos(root: Path, n: int) -> list[Path]:
    from video_fixtures import write_video

    return [write_video(root / f"v{i:02d}.mp4", 60, 30, size=(320, 240)) for i in range(n)]


def _rate(fn, items, repeat: int) -> float:
    t0 = time.perf_counter()
    for _ in range(repeat):
        for it in items:
            fn(it)
    return repeat * len(items) / (time.perf_counter() - t0)


def _decode_image(p: Path) -> None:
    with Image.open(p) as im:
        im.load()


def _decode_video(p: Path) -> None:
    with av.open(str(p)) as c:
        for _ in c.decode(video=0):
            pass


def run(quick: bool = False) -> str:
    n_img, n_vid, repeat = (16, 4, 2) if quick else (64, 16, 5)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        imgs, vids = _images(root, n_img), _videos(root, n_vid)
        img_probe = _rate(probe_image, imgs, repeat * 4)
        img_decode = _rate(_decode_image, imgs, repeat)
        vid_probe = _rate(probe_video, vids, repeat * 4)
        vid_decode = _rate(_decode_video, vids, repeat)
    rows = [
        "| what | header probe | full decode (baseline) | ratio |",
        "| --- | ---: | ---: | ---: |",
        f"| images ({n_img} JPEG/PNG, 0.5-1.2 MP) | {img_probe:,.0f} images/s | {img_decode:,.0f} images/s | "
        f"{img_probe / img_decode:.1f}x |",
        f"| videos ({n_vid} MP4, 2 s, 320x240) | {vid_probe:,.0f} videos/s | {vid_decode:,.0f} videos/s | "
        f"{vid_probe / vid_decode:.1f}x |",
    ]
    return "\n".join(rows)
