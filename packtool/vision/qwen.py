"""Qwen2-VL / Qwen2.5-VL vision accounting, reproduced from the released processor.

Images are resized by :func:`smart_resize` to multiples of 28 px (14-px patches,
2x2 merge); each merged 28x28 block becomes one ``<|image_pad|>`` token, wrapped in
``<|vision_start|>`` ... ``<|vision_end|>``. The vision unit is the 14-px patch
(what the ViT actually runs on), so units = 4 x tokens for images.

Videos follow qwen-vl-utils (``fetch_video`` / ``smart_nframes``): 2 frames per
second, clamped to [4, 768] and to the frame count, floored to an even number;
frame indices ``round(linspace(0, n_frames - 1, n))`` (first and last frame kept);
each frame resized with a per-frame pixel budget
``max(min(768*28*28, 90,316,800 / n * 2), int(128*28*28 * 1.05))`` and floor
``128*28*28``; two frames form one temporal patch, so ``grid_t = n / 2``.

    >>> lay = Qwen25VL().video(VideoMeta(1280, 720, 30.0, 30.0, 900))
    >>> len(lay.timestamps), lay.resized, lay.n_tokens
    (60, (560, 1008), 21600)
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import SampleError
from . import VideoMeta, VisionFamily, VisionLayout, check_video

__all__ = ["smart_resize", "aspect_ratio_error", "smart_nframes", "video_frame_pixels", "uniform_indices", "Qwen2VL",
           "Qwen25VL"]

MAX_RATIO = 200
# qwen-vl-utils video constants (vision_process.py, 0.0.14): per-frame token floor and cap, and the
# sequence length its default clip budget is sized for (its MODEL_SEQ_LEN, 128,000 unless the
# environment variable of that name says otherwise)
VIDEO_MIN_TOKENS = 128
VIDEO_MAX_TOKENS = 768
MODEL_SEQ_LEN = 128000
FRAME_FACTOR = 2
FPS = 2.0
FPS_MIN_FRAMES = 4
FPS_MAX_FRAMES = 768


def smart_resize(
    height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56, max_pixels: int = 14 * 14 * 4 * 1280
) -> tuple[int, int]:
    """Qwen's resize rule: both sides multiples of ``factor``, pixels in [min, max], aspect kept.

    Rounding is Python's ``round`` (banker's rounding), exactly as the processor does.
    As in qwen-vl-utils, a side never rounds below one ``factor`` (the transformers
    copy lets it reach 0 first; the two differ only for sides under ``factor / 2`` px, and
    ``packtool.reader.hf`` resizes such an image to this size before the processor, as
    qwen-vl-utils does).

    Example:
        >>> smart_resize(1080, 1920, 28, 3136, 12845056)
        (1092, 1932)

    Raises:
        SampleError: ``bad_aspect_ratio`` when the longer side exceeds 200x the shorter.
    """
    if min(height, width) <= 0:
        raise SampleError("corrupt_image", f"image has a zero dimension ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise aspect_ratio_error(height, width, "image")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def aspect_ratio_error(height: int, width: int, what: str, ratio: float | None = None) -> SampleError:
    """``bad_aspect_ratio`` for a ``width`` x ``height`` ``what`` (an image, a video) whose longer
    side is more than :data:`MAX_RATIO` times its shorter (``ratio``: as the processor measured it,
    when not from this size). The ratio is shown rounded up, so that one just above the limit
    never reads as the limit itself.

    Example:
        >>> aspect_ratio_error(100, 20001, "image").message
        'aspect ratio 200.01:1 of a 20001x100 image is above 200:1, which the Qwen processor rejects; crop or pad it'
    """
    ratio = math.ceil((ratio or max(height, width) / min(height, width)) * 100) / 100
    return SampleError("bad_aspect_ratio", f"aspect ratio {ratio:g}:1 of a {width}x{height} {what} is above "
                                           f"{MAX_RATIO}:1, which the Qwen processor rejects; crop or pad it")


def smart_nframes(n_frames: int, video_fps: float, fps: float = FPS, min_frames: int = FPS_MIN_FRAMES,
                  max_frames: int = FPS_MAX_FRAMES) -> int:
    """Frames qwen-vl-utils samples from a video of ``n_frames`` at ``video_fps``.

    ``n = n_frames / video_fps * fps`` clamped to ``[ceil2(min_frames), floor2(min(max_frames, n_frames))]``
    and to ``n_frames``, then floored to an even number.

    Example:
        >>> smart_nframes(900, 30.0)   # 30 s at 30 fps -> 2 fps -> 60
        60
        >>> smart_nframes(45, 30.0)    # 1.5 s -> 3 frames -> raised to the minimum 4
        4
    """
    lo = math.ceil(min_frames / FRAME_FACTOR) * FRAME_FACTOR
    hi = math.floor(min(max_frames, n_frames) / FRAME_FACTOR) * FRAME_FACTOR
    n = n_frames / video_fps * fps
    n = min(min(max(n, lo), hi), n_frames)
    return math.floor(n / FRAME_FACTOR) * FRAME_FACTOR


def video_frame_pixels(n: int, factor: int) -> tuple[int, float]:
    """qwen-vl-utils' per-frame pixel floor and cap for a clip of ``n`` sampled frames
    (``fetch_video``), with sides in multiples of ``factor`` (28 for Qwen2/2.5-VL, 32 for Qwen3-VL).

    The floor is 128 tokens a frame; the cap is 768 tokens a frame, lowered when the clip's
    share of a 128,000-token budget, ``0.9 * 128000 * factor**2 / n * 2``, is smaller, but never
    below 1.05 x the floor. Each frame is then sized alone by :func:`smart_resize`.

    Example:
        >>> video_frame_pixels(60, 32)     # 30 s at 2 fps: the 768-token cap
        (131072, 786432)
        >>> video_frame_pixels(768, 32)    # the longest clip: the budget's share, 300 tokens
        (131072, 307200.0)
    """
    lo = VIDEO_MIN_TOKENS * factor * factor
    total = MODEL_SEQ_LEN * factor * factor * 0.9  # a float, as qwen-vl-utils computes it
    return lo, max(min(VIDEO_MAX_TOKENS * factor * factor, total / n * FRAME_FACTOR), int(lo * 1.05))


def uniform_indices(n_frames: int, n: int) -> np.ndarray:
    """``round(linspace(0, n_frames - 1, n))`` with round-half-even, as torch/numpy round.

    Example:
        >>> uniform_indices(10, 4).tolist()
        [0, 3, 6, 9]
    """
    return np.rint(np.linspace(0, n_frames - 1, n)).astype(np.int64)


class Qwen2VL(VisionFamily):
    """Qwen2-VL: 14-px patches, 2x2 spatial merge, temporal patch 2."""

    name = "qwen2-vl"
    unit_name = "patches"
    patch = 14
    merge = 2
    temporal_patch = 2
    default_max_vision_units = 65536
    # qwen-vl-utils opens images with PIL and converts to RGB; no EXIF transpose
    exif_default = "ignore"
    #: the least --max-frames that leaves a video one temporal patch (every video is refused below it)
    min_max_frames = FRAME_FACTOR

    def __init__(self, min_pixels: int = 3136, max_pixels: int = 12845056, max_frames: int = FPS_MAX_FRAMES,
                 fps: float = FPS) -> None:
        self.min_pixels = int(min_pixels)
        self.max_pixels = int(max_pixels)
        self.max_frames = int(max_frames)
        self.fps = float(fps)

    @property
    def factor(self) -> int:
        return self.patch * self.merge

    def settings(self) -> dict:
        return {"name": self.name, "exif": self.exif, "min_pixels": self.min_pixels, "max_pixels": self.max_pixels,
                "max_frames": self.max_frames, "fps": self.fps}

    def special_tokens(self) -> tuple[str, ...]:
        return ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

    def image(self, height: int, width: int) -> VisionLayout:
        """Layout of one image.

        Example:
            >>> Qwen25VL().image(1080, 1920).n_tokens
            2691
        """
        rh, rw = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        gh, gw = rh // self.patch, rw // self.patch
        n = gh * gw // (self.merge * self.merge)
        segs = (("special", "<|vision_start|>", 1), ("pad", "<|image_pad|>", n), ("special", "<|vision_end|>", 1))
        return VisionLayout("image", n, gh * gw, (1, gh, gw), (rh, rw), segs)

    def video(self, meta: VideoMeta) -> VisionLayout:
        """Layout of one video (qwen-vl-utils sampling, then the image processor's grid).

        A video with fewer than 2 frames is refused (``video_too_short``), as
        qwen-vl-utils refuses it.

        Example:
            >>> Qwen25VL().video(VideoMeta(1280, 720, 30.0, 30.0, 900)).grid
            (30, 40, 72)
        """
        idx, (rh, rw) = self.qwen_vl_utils_frames(meta)
        gt = math.ceil(len(idx) / self.temporal_patch)
        gh, gw = rh // self.patch, rw // self.patch
        tokens = gt * gh * gw // (self.merge * self.merge)
        times = tuple(meta.frame_time(int(i)) for i in idx)
        return VisionLayout("video", tokens, gt * gh * gw, (gt, gh, gw), (rh, rw),
                            self.video_segments((gt, gh, gw), times), times)

    def qwen_vl_utils_frames(self, meta: VideoMeta) -> tuple[np.ndarray, tuple[int, int]]:
        """``(frame indices, (height, width))``: the frames qwen-vl-utils' ``fetch_video`` takes
        from a video and the size it resizes each to, with this family's ``--fps`` and
        ``--max-frames`` and its factor (``patch * merge``).

        :func:`smart_nframes` frames (an even count) at :func:`uniform_indices`, every frame
        sized alone by :func:`smart_resize` within :func:`video_frame_pixels`.

        Example:
            >>> idx, size = Qwen25VL().qwen_vl_utils_frames(VideoMeta(1280, 720, 3.0, 10.0, 30))
            >>> idx.tolist(), size
            ([0, 6, 12, 17, 23, 29], (560, 1008))
        """
        check_video(meta, self.name, FRAME_FACTOR)
        n = smart_nframes(meta.n_frames, meta.fps, self.fps, FPS_MIN_FRAMES, self.max_frames)
        if n < FRAME_FACTOR:
            raise SampleError("video_too_short", f"--max-frames {self.max_frames} leaves fewer than 2 frames")
        if max(meta.height, meta.width) / min(meta.height, meta.width) > MAX_RATIO:
            raise aspect_ratio_error(meta.height, meta.width, "video")
        min_pixels, max_pixels = video_frame_pixels(n, self.factor)
        return uniform_indices(meta.n_frames, n), smart_resize(meta.height, meta.width, self.factor, min_pixels,
                                                               max_pixels)

    def video_segments(self, grid: tuple[int, int, int], timestamps: tuple[float, ...]) -> tuple:
        """One ``<|video_pad|>`` run of ``t*h*w/4`` between the vision markers."""
        tokens = grid[0] * grid[1] * grid[2] // (self.merge * self.merge)
        return (("special", "<|vision_start|>", 1), ("pad", "<|video_pad|>", tokens), ("special", "<|vision_end|>", 1))


class Qwen25VL(Qwen2VL):
    name = "qwen2.5-vl"
