"""Molmo2 vision accounting, reproduced from the released processor (``allenai/Molmo2-*``).

Images (``preprocessor_config.json``: 378-px crops, 14-px patches, overlap margins
(4, 4), ``max_crops`` 8, 2x2 pooling):

* a crop is 27x27 patches; with the margins removed a crop *window* is 19 patches
  (266 px), and the margins add 8 patches (112 px) around the whole tiling;
* the tiling ``(rows, cols)`` is chosen by ``select_tiling`` on the image minus
  112 px: among all ``rows*cols <= max_crops`` (ordered by area, then rows) take the
  one needing the least upscaling, or if every one needs downscaling the one needing
  the least downscaling (float32 arithmetic, as numpy does it there);
* the image is resized to ``(rows*19+8) x (cols*19+8)`` patches and pooled 2x2
  (padded to even), giving ``h = ceil((rows*19+8)/2)`` by ``w = ceil((cols*19+8)/2)``
  tokens; the global crop (27x27 patches) pools to 14x14 = 196 tokens;
* layout: the global crop first, ``<low_res_im_start>`` + 14 rows of 14
  ``<im_patch>`` + ``<im_end>``, then ``<im_start>`` + ``h`` rows of ``w``
  ``<im_patch>`` each followed by an ``<im_col>`` column token + ``<im_end>``.

Vision unit: a crop (global + tiles), so an image costs ``1 + rows*cols`` units.

Videos (``video_preprocessor_config.json``: 3x3 pooling, ``max_fps`` 2, 128 frames,
mode ``uniform_last_frame``; frame times in seconds, last frame always kept):

* if ``(max_frames - 1) / 2 >= duration``: times ``0, 0.5, 1.0, ... < duration`` and
  then ``duration`` itself; else ``linspace(0, duration, max_frames)``;
* every frame is one 378-px crop pooled 3x3: 9x9 = 81 tokens, no column tokens;
* frame ``i`` is laid out as text ``"{t:.1f} "`` (preceded by a space after the
  first frame), ``<frame_start>``, 81 ``<im_patch>``, ``<frame_end>``.

    >>> Molmo2().image(480, 640).units, Molmo2().image(480, 640).n_tokens
    (5, 725)
"""

from __future__ import annotations

import math

import numpy as np

from . import VideoMeta, VisionFamily, VisionLayout, check_video

__all__ = ["Molmo2", "select_tiling", "molmo2_frame_times"]


def select_tiling(h: float, w: float, patch_size: int, max_num_crops: int) -> tuple[int, int]:
    """The processor's ``select_tiling``: ``(rows, cols)`` of crop windows for an ``h x w`` area.

    Example:
        >>> select_tiling(480 - 112, 640 - 112, 266, 8)
        (2, 2)
    """
    tilings = [(i, j) for i in range(1, max_num_crops + 1) for j in range(1, max_num_crops + 1) if i * j <= max_num_crops]
    tilings.sort(key=lambda x: (x[0] * x[1], x[0]))
    cand = np.array(tilings, dtype=np.int32) * patch_size
    size = np.array([h, w], dtype=np.float32)
    with np.errstate(divide="ignore"):
        scale = np.min(cand.astype(np.float32) / size, axis=-1)
    if np.all(scale < 1):
        ix = int(np.argmax(scale))
    else:
        ix = int(np.argmin(np.where(scale < 1.0, 10e9, scale)))
    return tilings[ix]


def molmo2_frame_times(duration_s: float, max_frames: int, max_fps: float) -> list[float]:
    """Frame times of the ``uniform_last_frame`` sampler (seconds from the first frame).

    Example:
        >>> molmo2_frame_times(2.2, 128, 2)
        [0.0, 0.5, 1.0, 1.5, 2.0, 2.2]
    """
    if (max_frames - 1) / max_fps < duration_s:
        return np.linspace(0, duration_s, num=max_frames, endpoint=True, dtype=np.float64).tolist()
    times = np.arange(0.0, stop=duration_s, step=1 / max_fps)
    return np.concatenate([times, [duration_s]], axis=0).tolist()


class Molmo2(VisionFamily):
    """Molmo2: overlapping 378-px crops plus a global crop; 2x2 pooling (images), 3x3 (video frames)."""

    name = "molmo2"
    unit_name = "crops"
    default_max_vision_units = 128
    # Molmo's image loader applies the EXIF orientation before cropping
    exif_default = "apply"
    crop = 378
    patch = 14
    margins = (4, 4)
    pool = 2
    video_pool = 3
    max_fps = 2.0

    def __init__(self, max_crops: int = 8, max_frames: int = 128, single_crop_col_tokens: bool = False) -> None:
        self.max_crops = int(max_crops)
        self.max_frames = int(max_frames)
        self.single_crop_col_tokens = bool(single_crop_col_tokens)

    def settings(self) -> dict:
        return {"name": self.name, "exif": self.exif, "max_crops": self.max_crops, "max_frames": self.max_frames,
                "single_crop_col_tokens": self.single_crop_col_tokens}

    def special_tokens(self) -> tuple[str, ...]:
        return ("<im_patch>", "<im_col>", "<im_start>", "<low_res_im_start>", "<im_end>", "<frame_start>",
                "<frame_end>")

    def image(self, height: int, width: int) -> VisionLayout:
        crop_patches = self.crop // self.patch  # 27
        margin = sum(self.margins)  # 8 patches
        window = (crop_patches - margin) * self.patch  # 266 px
        rows, cols = select_tiling(height - margin * self.patch, width - margin * self.patch, window, self.max_crops)
        hp, wp = rows * (crop_patches - margin) + margin, cols * (crop_patches - margin) + margin
        h, w = math.ceil(hp / self.pool), math.ceil(wp / self.pool)
        g = math.ceil(crop_patches / self.pool)  # 14
        segs: list[tuple[str, str, int]] = [("special", "<low_res_im_start>", 1)]
        for _ in range(g):
            segs.append(("pad", "<im_patch>", g))
            if self.single_crop_col_tokens:
                segs.append(("special", "<im_col>", 1))
        segs += [("special", "<im_end>", 1), ("special", "<im_start>", 1)]
        for _ in range(h):
            segs += [("pad", "<im_patch>", w), ("special", "<im_col>", 1)]
        segs.append(("special", "<im_end>", 1))
        units = 1 + rows * cols
        return VisionLayout("image", g * g + h * w, units, (1, h, w), (hp * self.patch, wp * self.patch), tuple(segs))

    def video(self, meta: VideoMeta) -> VisionLayout:
        check_video(meta, self.name)
        times = molmo2_frame_times(meta.duration_s, self.max_frames, self.max_fps)
        g = math.ceil((self.crop // self.patch) / self.video_pool)  # 9
        n = len(times)
        return VisionLayout("video", n * g * g, n, (n, g, g), (self.crop, self.crop),
                            self.video_segments((n, g, g), tuple(times)), tuple(times))

    def video_segments(self, grid: tuple[int, int, int], timestamps: tuple[float, ...]) -> tuple:
        """Per frame: its time as text, then ``h*w`` ``<im_patch>`` between frame markers."""
        segs: list[tuple[str, str, int]] = []
        for i, t in enumerate(timestamps):
            segs += [("text", (" " if i else "") + f"{t:.1f} ", 1), ("special", "<frame_start>", 1),
                     ("pad", "<im_patch>", grid[1] * grid[2]), ("special", "<frame_end>", 1)]
        return tuple(segs)
