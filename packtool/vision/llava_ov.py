"""LLaVA-OneVision vision accounting (``llava-hf/llava-onevision-qwen2-*-ov-hf``).

Images (``anyres_max_9``, SigLIP 384 px, 27x27 = 729 tokens per tile):

* the best grid resolution is chosen from the 36 pinpoints ``(384*i, 384*j)``,
  ``i, j`` in 1..6 (``select_best_resolution``: the most effective pixels after
  fitting, then the least waste; first in pinpoint order on ties);
* the tiles' features (``27*rows`` x ``27*cols``) are *unpadded* back to the image's
  aspect ratio; if they exceed 9 tiles' worth by more than 10% they are scaled down by
  ``ratio = sqrt(h*w / (9*27*27))``; one newline token per remaining row;
* tokens = unpadded + newlines + 729 (the base image).

A sample with more than one image (videos not counted) is not tiled: each image is
padded to a square and resized to one 384-px crop, 729 features plus one newline =
730 tokens (``LlavaOnevisionProcessor.replace_image_token``: ``num_image_tokens + 1``
when the sample's ``batch_num_images`` entry is not 1; the model's
``pack_image_features`` appends ``image_newline`` to a single-crop image).

Vision unit: a 384-px tile: ``1 + rows*cols`` per single image, one per image of a
multi-image sample, one per video frame.

Videos: ``min(max_frames, n_frames)`` frames at indices
``linspace(0, n_frames - 1, n).astype(int)`` (the LLaVA-NeXT uniform sampler,
32 frames by default); each frame pools 27x27 to 14x14 = 196 tokens, plus one
newline token per video.

All placeholders are ``<image>`` / ``<video>`` tokens, which the Qwen2 base vocabulary
lacks: pass the checkpoint's tokenizer with ``--tokenizer``.

    >>> LlavaOneVision().image(480, 640).n_tokens
    2929
    >>> LlavaOneVision().image_in_sample(480, 640, n_images=2).n_tokens
    730
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import SampleError
from . import VideoMeta, VisionFamily, VisionLayout, check_video

__all__ = ["LlavaOneVision", "select_best_resolution", "PINPOINTS"]

PINPOINTS: list[tuple[int, int]] = [(384 * i, 384 * j) for i in range(1, 7) for j in range(1, 7)]


def select_best_resolution(height: int, width: int, resolutions: list[tuple[int, int]]) -> tuple[int, int]:
    """The pinpoint ``(h, w)`` that keeps the most pixels after fitting, then wastes the least.

    Example:
        >>> select_best_resolution(480, 640, PINPOINTS)
        (768, 768)
    """
    best = resolutions[0]
    max_eff, min_waste = 0, float("inf")
    for h, w in resolutions:
        scale = min(w / width, h / height)
        dw, dh = int(width * scale), int(height * scale)
        eff = min(dw * dh, width * height)
        waste = w * h - eff
        if eff > max_eff or (eff == max_eff and waste < min_waste):
            max_eff, min_waste, best = eff, waste, (h, w)
    return best


def unpadded_features(height: int, width: int, patches: int, rows: int, cols: int, max_tiles: int = 9) -> tuple[int, int]:
    """``(features, newlines)`` after unpadding the tile grid to the image's aspect ratio.

    Example:
        >>> unpadded_features(480, 640, 27, 2, 2)
        (2160, 40)
    """
    cur_h, cur_w = patches * rows, patches * cols
    if width / height > cur_w / cur_h:
        new_h = int(round(height * (cur_w / width), 7))
        cur_h -= ((cur_h - new_h) // 2) * 2
    else:
        new_w = int(round(width * (cur_h / height), 7))
        cur_w -= ((cur_w - new_w) // 2) * 2
    feats, newlines = cur_h * cur_w, cur_h
    ratio = math.sqrt(cur_h * cur_w / (max_tiles * patches**2))
    if ratio > 1.1:
        feats = int(cur_h // ratio) * int(cur_w // ratio)
        newlines = int(cur_h // ratio)
    return feats, newlines


class LlavaOneVision(VisionFamily):
    """LLaVA-OneVision (SigLIP-384, anyres_max_9)."""

    name = "llava-ov"
    unit_name = "tiles"
    default_max_vision_units = 64
    exif_default = "ignore"  # PIL open + convert("RGB")
    tile = 384
    patches = 27

    def __init__(self, max_frames: int = 32) -> None:
        self.max_frames = int(max_frames)

    def settings(self) -> dict:
        return {"name": self.name, "exif": self.exif, "max_frames": self.max_frames}

    def special_tokens(self) -> tuple[str, ...]:
        return ("<image>", "<video>")

    def image(self, height: int, width: int) -> VisionLayout:
        if min(height, width) <= 0:
            raise SampleError("corrupt_image", f"image has a zero dimension ({width}x{height})")
        bh, bw = select_best_resolution(height, width, PINPOINTS)
        rows, cols = bh // self.tile, bw // self.tile
        feats, newlines = unpadded_features(height, width, self.patches, rows, cols)
        n = feats + newlines + self.patches * self.patches
        return VisionLayout("image", n, 1 + rows * cols, (1, rows * self.patches, cols * self.patches), (bh, bw),
                            (("pad", "<image>", n),))

    def image_in_sample(self, height: int, width: int, n_images: int) -> VisionLayout:
        """One image of a sample holding ``n_images`` images: anyres when alone, else one base crop.

        Example:
            >>> LlavaOneVision().image_in_sample(1080, 1920, 3).units
            1
        """
        if n_images == 1:
            return self.image(height, width)
        if min(height, width) <= 0:
            raise SampleError("corrupt_image", f"image has a zero dimension ({width}x{height})")
        n = self.patches * self.patches + 1  # 729 features + image_newline
        return VisionLayout("image", n, 1, (1, self.patches, self.patches), (self.tile, self.tile),
                            (("pad", "<image>", n),))

    def image_count_key(self, n_images: int) -> bool:
        return n_images == 1

    def video(self, meta: VideoMeta) -> VisionLayout:
        check_video(meta, self.name)
        n = min(self.max_frames, meta.n_frames)
        idx = np.linspace(0, meta.n_frames - 1, n, dtype=int)
        g = math.ceil(self.patches / 2)  # 14
        tokens = n * g * g + 1
        times = tuple(meta.frame_time(int(i)) for i in idx)
        return VisionLayout("video", tokens, n, (n, g, g), (self.tile, self.tile),
                            self.video_segments((n, g, g), times), times)

    def video_segments(self, grid: tuple[int, int, int], timestamps: tuple[float, ...]) -> tuple:
        """One ``<video>`` run: ``t*h*w`` pooled features and one newline feature."""
        return (("pad", "<video>", grid[0] * grid[1] * grid[2] + 1),)
