"""``fixed:N``: every image (and every video) costs exactly N placeholder tokens and one vision unit.

For custom models whose connector emits a fixed number of features. A video's
frames (``--max-frames``, 8 by default) are sampled uniformly, first and last kept,
and recorded so pack can extract them; the count stays N.
"""

from __future__ import annotations

from . import VideoMeta, VisionFamily, VisionLayout, check_video
from .qwen import uniform_indices

__all__ = ["Fixed"]


class Fixed(VisionFamily):
    unit_name = "images"
    default_max_vision_units = 64
    exif_default = "ignore"

    def __init__(self, n_tokens: int, max_frames: int = 8) -> None:
        self.n_tokens = int(n_tokens)
        self.max_frames = int(max_frames)
        self.name = f"fixed:{self.n_tokens}"

    def settings(self) -> dict:
        return {"name": self.name, "exif": self.exif, "max_frames": self.max_frames}

    def special_tokens(self) -> tuple[str, ...]:
        return ("<|image_pad|>", "<|video_pad|>")

    def image(self, height: int, width: int) -> VisionLayout:
        segs = (("pad", "<|image_pad|>", self.n_tokens),)
        return VisionLayout("image", self.n_tokens, 1, (1, 1, self.n_tokens), (height, width), segs)

    def video(self, meta: VideoMeta) -> VisionLayout:
        check_video(meta, self.name)
        n = min(self.max_frames, meta.n_frames)
        times = tuple(meta.frame_time(int(i)) for i in uniform_indices(meta.n_frames, n))
        grid = (1, 1, self.n_tokens)
        return VisionLayout("video", self.n_tokens, 1, grid, (meta.height, meta.width), self.video_segments(grid, times), times)

    def video_segments(self, grid: tuple[int, int, int], timestamps: tuple[float, ...]) -> tuple:
        """One ``<|video_pad|>`` run of N."""
        return (("pad", "<|video_pad|>", self.n_tokens),)
