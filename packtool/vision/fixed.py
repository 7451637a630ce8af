"""``fixed:N``: every image costs exactly N placeholder tokens and one vision unit."""

from __future__ import annotations

from . import VideoMeta, VisionFamily, VisionLayout

__all__ = ["Fixed"]


class Fixed(VisionFamily):
    unit_name = "images"
    default_max_vision_units = 64

    def __init__(self, n_tokens: int) -> None:
        self.n_tokens = int(n_tokens)
        self.name = f"fixed:{self.n_tokens}"

    def settings(self) -> dict:
        return {"name": self.name}

    def image(self, height: int, width: int) -> VisionLayout:
        segs = (("pad", "<|image_pad|>", self.n_tokens),)
        return VisionLayout("image", self.n_tokens, 1, (1, 1, self.n_tokens), (height, width), segs)

    def video(self, meta: VideoMeta) -> VisionLayout:
        segs = (("pad", "<|video_pad|>", self.n_tokens),)
        return VisionLayout("video", self.n_tokens, 1, (1, 1, self.n_tokens), (meta.height, meta.width), segs)
