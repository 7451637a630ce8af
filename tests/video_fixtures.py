"""Small videos encoded with PyAV for the tests; frame ``i`` is a flat grey of level ``(i * step) % 256``.

The grey level lets a test recover which frame a decoded JPEG came from. :func:`write_noise_video`
writes textured frames instead, which encoders code with B-frames.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np


def write_video(path: Path, n_frames: int, fps: int = 30, size: tuple[int, int] = (64, 48), fmt: str = "mp4",
                codec: str = "libx264", pts: list[int] | None = None, rotation: int | None = None, step: int = 8,
                time_base: Fraction | None = None, b_frames: int = 0) -> Path:
    """Encode ``n_frames`` frames; ``pts`` (in ``time_base`` units) makes a variable-rate stream;
    ``b_frames``: the most consecutive B-frames libx264 may code (frames then decode out of order)."""
    w, h = size
    with av.open(str(path), "w", format=fmt) as out:
        st = out.add_stream(codec, rate=fps)
        st.width, st.height, st.pix_fmt = w, h, "yuv420p"
        if pts is not None:
            st.codec_context.time_base = time_base or Fraction(1, 1000)
            st.time_base = time_base or Fraction(1, 1000)
        if codec == "libx264":
            st.options = {"preset": "ultrafast", "g": "30", **({"bf": str(b_frames)} if b_frames else {})}
        if rotation is not None:
            st.set_display_rotation(rotation)
        for i in range(n_frames):
            frame = av.VideoFrame.from_ndarray(np.full((h, w, 3), (i * step) % 256, np.uint8), format="rgb24")
            if pts is not None:
                frame.pts = pts[i]
                frame.time_base = time_base or Fraction(1, 1000)
            for p in st.encode(frame):
                out.mux(p)
        for p in st.encode():
            out.mux(p)
    return path


def grey_level(jpeg: bytes) -> float:
    import io

    from PIL import Image

    return float(np.asarray(Image.open(io.BytesIO(jpeg)).convert("L")).mean())


def write_noise_video(path: Path, n_frames: int, fps: int = 10, size: tuple[int, int] = (96, 64), fmt: str = "mp4",
                      codec: str = "libx264", options: dict[str, str] | None = None, pts: list[int] | None = None,
                      time_base: Fraction = Fraction(1, 1000), seed: int = 0,
                      container_options: dict[str, str] | None = None) -> Path:
    """Encode ``n_frames`` frames of a block texture that pans, with a few blocks that change every
    frame: content an encoder codes with B-frames where allowed, and every frame distinct.
    ``pts`` (in ``time_base`` units) makes a variable-rate stream; ``container_options`` go to the
    muxer (``{"movflags": "frag_keyframe+empty_moov"}``)."""
    rng = np.random.default_rng(seed)
    w, h = size
    texture = rng.integers(0, 256, size=(h // 8 + 8, w // 8 + 8, 3), dtype=np.uint8).repeat(8, 0).repeat(8, 1)
    with av.open(str(path), "w", format=fmt, options=container_options or {}) as out:
        st = out.add_stream(codec, rate=fps)
        st.width, st.height, st.pix_fmt = w, h, "yuv420p"
        if pts is not None:
            st.codec_context.time_base = st.time_base = time_base
        st.options = dict(options or {})
        for i in range(n_frames):
            img = texture[i % 32:i % 32 + h, (2 * i) % 64:(2 * i) % 64 + w].copy()
            for _ in range(3):
                y, x = rng.integers(0, h - 8), rng.integers(0, w - 8)
                img[y:y + 8, x:x + 8] = rng.integers(0, 256, 3, dtype=np.uint8)
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            if pts is not None:
                frame.pts, frame.time_base = pts[i], time_base
            for p in st.encode(frame):
                out.mux(p)
        for p in st.encode():
            out.mux(p)
    return path
