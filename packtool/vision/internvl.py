"""InternVL (2.5 / 3) vision accounting, reproduced from the released chat code.

Images (``dynamic_preprocess``: 448-px tiles, ``max_num`` 12, thumbnail on):

* candidate grids ``(cols, rows)`` with ``1 <= cols*rows <= max_num``, ordered by
  area; the grid whose ``cols/rows`` is closest to the image's ``width/height`` wins;
  on an exact tie the later (larger) grid wins only while the image area exceeds half
  of the grid's pixel area;
* the image is cut into ``cols*rows`` tiles, plus a 448-px thumbnail when that is
  more than one tile; each tile becomes 256 tokens (32x32 patches, pixel shuffle 0.5);
* layout: ``<img>`` + 256 x tiles ``<IMG_CONTEXT>`` + ``</img>``.

Vision unit: a 448-px tile (thumbnail included).

Videos (``load_video`` with ``num_segments`` 8 by default, one tile per frame): frame
indices ``int(seg/2 + round(seg*i))`` with ``seg = (n_frames - 1) / n``; each frame is
laid out as ``Frame{i}: <img>`` + 256 ``<IMG_CONTEXT>`` + ``</img>\\n``.

``<img>``, ``</img>``, ``<IMG_CONTEXT>`` are not in the Qwen2 base vocabulary: pass
the checkpoint's tokenizer with ``--tokenizer``.

    >>> InternVL().image(480, 640).units
    13
"""

from __future__ import annotations

import numpy as np

from ..errors import SampleError
from . import VideoMeta, VisionFamily, VisionLayout, check_video

__all__ = ["InternVL", "find_closest_aspect_ratio", "target_ratios", "internvl_frame_indices"]


def target_ratios(min_num: int, max_num: int) -> list[tuple[int, int]]:
    """Candidate ``(cols, rows)`` grids, built and ordered exactly as ``dynamic_preprocess`` does."""
    ratios = {(i, j) for n in range(min_num, max_num + 1) for i in range(1, n + 1) for j in range(1, n + 1)
              if min_num <= i * j <= max_num}
    return sorted(ratios, key=lambda x: x[0] * x[1])


def find_closest_aspect_ratio(aspect: float, ratios: list[tuple[int, int]], width: int, height: int,
                              image_size: int) -> tuple[int, int]:
    """The grid whose aspect ratio is closest to ``aspect`` (ties: see the module docstring).

    Example:
        >>> find_closest_aspect_ratio(640 / 480, target_ratios(1, 12), 640, 480, 448)
        (4, 3)
    """
    best_diff = float("inf")
    best = (1, 1)
    area = width * height
    for ratio in ratios:
        diff = abs(aspect - ratio[0] / ratio[1])
        if diff < best_diff:
            best_diff, best = diff, ratio
        elif diff == best_diff and area > 0.5 * image_size * image_size * ratio[0] * ratio[1]:
            best = ratio
    return best


def internvl_frame_indices(n_frames: int, num_segments: int) -> list[int]:
    """``get_index`` of the InternVL video loader, whole clip.

    Example:
        >>> internvl_frame_indices(300, 8)
        [18, 55, 93, 130, 168, 205, 242, 280]
    """
    start, end = 0, n_frames - 1
    seg = float(end - start) / num_segments
    return [int(start + seg / 2 + np.round(seg * i)) for i in range(num_segments)]


class InternVL(VisionFamily):
    """InternVL 2.5 / 3: 448-px dynamic tiles + thumbnail, 256 tokens per tile."""

    name = "internvl"
    unit_name = "tiles"
    default_max_vision_units = 64
    exif_default = "ignore"  # PIL open + convert("RGB")
    tile = 448
    tokens_per_tile = 256

    def __init__(self, max_num: int = 12, max_frames: int = 8) -> None:
        if max_num < 1:
            raise SampleError("bad_record", "max_num must be at least 1")
        self.max_num = int(max_num)
        self.max_frames = int(max_frames)
        self._ratios = target_ratios(1, self.max_num)

    def settings(self) -> dict:
        return {"name": self.name, "exif": self.exif, "max_num": self.max_num, "max_frames": self.max_frames}

    def special_tokens(self) -> tuple[str, ...]:
        return ("<img>", "</img>", "<IMG_CONTEXT>")

    def tiles(self, height: int, width: int) -> tuple[int, int, int]:
        """``(cols, rows, tiles)``; tiles include the thumbnail when ``cols*rows > 1``."""
        if min(height, width) <= 0:
            raise SampleError("corrupt_image", f"image has a zero dimension ({width}x{height})")
        cols, rows = find_closest_aspect_ratio(width / height, self._ratios, width, height, self.tile)
        blocks = cols * rows
        return cols, rows, blocks + (1 if blocks != 1 else 0)

    def image(self, height: int, width: int) -> VisionLayout:
        cols, rows, n_tiles = self.tiles(height, width)
        n = n_tiles * self.tokens_per_tile
        segs = (("special", "<img>", 1), ("pad", "<IMG_CONTEXT>", n), ("special", "</img>", 1))
        return VisionLayout("image", n, n_tiles, (n_tiles, 16, 16), (rows * self.tile, cols * self.tile), segs)

    def video(self, meta: VideoMeta) -> VisionLayout:
        check_video(meta, self.name)
        idx = internvl_frame_indices(meta.n_frames, self.max_frames)
        n = len(idx) * self.tokens_per_tile
        times = tuple(meta.frame_time(int(i)) for i in idx)
        grid = (len(idx), 16, 16)
        return VisionLayout("video", n, len(idx), grid, (self.tile, self.tile), self.video_segments(grid, times), times)

    def video_segments(self, grid: tuple[int, int, int], timestamps: tuple[float, ...]) -> tuple:
        """Per frame: ``FrameN: <img>``, one tile of ``<IMG_CONTEXT>``, ``</img>`` and a newline."""
        segs: list[tuple[str, str, int]] = []
        for i in range(grid[0]):
            segs += [("text", f"Frame{i + 1}: ", 1), ("special", "<img>", 1),
                     ("pad", "<IMG_CONTEXT>", self.tokens_per_tile), ("special", "</img>", 1), ("text", "\n", 1)]
        return tuple(segs)
