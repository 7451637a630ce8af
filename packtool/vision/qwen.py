"""Qwen2-VL / Qwen2.5-VL vision accounting, reproduced from the released processor.

Images are resized by :func:`smart_resize` to multiples of 28 px (14-px patches,
2x2 merge); each merged 28x28 block becomes one ``<|image_pad|>`` token, wrapped in
``<|vision_start|>`` ... ``<|vision_end|>``. The vision unit is the 14-px patch
(what the ViT actually runs on), so units = 4 x tokens for images.
"""

from __future__ import annotations

import math

from ..errors import SampleError
from . import VideoMeta, VisionFamily, VisionLayout

__all__ = ["smart_resize", "Qwen2VL", "Qwen25VL"]

MAX_RATIO = 200


def smart_resize(
    height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56, max_pixels: int = 14 * 14 * 4 * 1280
) -> tuple[int, int]:
    """Qwen's resize rule: both sides multiples of ``factor``, pixels in [min, max], aspect kept.

    Rounding is Python's ``round`` (banker's rounding), exactly as the processor does.

    Example:
        >>> smart_resize(1080, 1920, 28, 3136, 12845056)
        (1092, 1932)

    Raises:
        SampleError: ``bad_aspect_ratio`` when the longer side exceeds 200x the shorter.
    """
    if min(height, width) <= 0:
        raise SampleError("corrupt_image", f"image has a zero dimension ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise SampleError(
            "bad_aspect_ratio",
            f"aspect ratio {max(height, width) / min(height, width):.1f} of a {width}x{height} image "
            f"exceeds {MAX_RATIO}, which the Qwen processor rejects",
        )
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


class Qwen2VL(VisionFamily):
    """Qwen2-VL: 14-px patches, 2x2 spatial merge, temporal patch 2."""

    name = "qwen2-vl"
    unit_name = "patches"
    patch = 14
    merge = 2
    temporal_patch = 2
    default_max_vision_units = 65536

    def __init__(self, min_pixels: int = 3136, max_pixels: int = 12845056) -> None:
        self.min_pixels = int(min_pixels)
        self.max_pixels = int(max_pixels)

    @property
    def factor(self) -> int:
        return self.patch * self.merge

    def settings(self) -> dict:
        return {"name": self.name, "min_pixels": self.min_pixels, "max_pixels": self.max_pixels}

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
        raise SampleError("corrupt_video", "video accounting for this family is not available yet")


class Qwen25VL(Qwen2VL):
    name = "qwen2.5-vl"
