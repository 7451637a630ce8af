"""Vision accounting per model family: pure arithmetic, no I/O (DESIGN.md §5).

A family turns media dimensions into a :class:`VisionLayout` (how many placeholder
tokens the model's processor will produce, how much vision-encoder work it costs)
and lays those placeholders out as token *segments* that the template expands.

    >>> fam = get_family("qwen2.5-vl")
    >>> fam.image(1080, 1920).n_tokens
    2691
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

__all__ = ["VisionLayout", "VideoMeta", "VisionFamily", "get_family", "FAMILIES"]


@dataclass(frozen=True, slots=True)
class VideoMeta:
    """What a probe learned about a video without decoding it."""

    width: int
    height: int
    duration_s: float
    fps: float
    n_frames: int
    start_s: float = 0.0
    rotation: int = 0


@dataclass(frozen=True, slots=True)
class VisionLayout:
    """How one media item is seen by a model.

    Attributes:
        kind: ``"image"`` or ``"video"``.
        n_tokens: placeholder (feature) tokens the processor emits for it.
        units: vision-encoder work it costs (patches, crops or tiles; per family).
        grid: ``(t, h, w)`` in the family's patch grid (``(1, h, w)`` for images).
        resized: ``(height, width)`` the processor resizes to.
        timestamps: for videos, the exact frame times (seconds) that were counted.
        segments: the token layout: ``(kind, value, count)`` triples where kind is
            ``"special"`` (a special token by name), ``"text"`` (ordinary text) or
            ``"pad"`` (``count`` copies of a placeholder token; these are the feature slots).
    """

    kind: str
    n_tokens: int
    units: int
    grid: tuple[int, int, int]
    resized: tuple[int, int]
    segments: tuple[tuple[str, str, int], ...]
    timestamps: tuple[float, ...] = ()


class VisionFamily:
    """Interface every model family implements."""

    name: str = ""
    unit_name: str = "units"
    default_max_vision_units: int = 0

    def image(self, height: int, width: int) -> VisionLayout:  # pragma: no cover - interface
        raise NotImplementedError

    def video(self, meta: VideoMeta) -> VisionLayout:  # pragma: no cover - interface
        raise NotImplementedError

    def settings(self) -> dict:
        """The settings that change counts; stored in the manifest and the config digest."""
        return {"name": self.name}


def get_family(name: str, **settings) -> VisionFamily:
    """Return the vision family called ``name`` configured with processor ``settings``."""
    key = name.lower()
    if key in FAMILIES:
        return FAMILIES[key](**{k: v for k, v in settings.items() if v is not None})
    if key.startswith("fixed:"):
        from .fixed import Fixed

        try:
            n = int(key.split(":", 1)[1])
        except ValueError:
            n = 0
        if n <= 0:
            raise ConfigError(f"--model {name!r}: fixed:N needs a positive N, e.g. fixed:576")
        return Fixed(n)
    raise ConfigError(f"unknown --model {name!r}; choose one of: {', '.join(sorted(FAMILIES))}, fixed:N")


def _families() -> dict[str, type]:
    from .qwen import Qwen2VL, Qwen25VL

    return {"qwen2-vl": Qwen2VL, "qwen2.5-vl": Qwen25VL}


FAMILIES: dict[str, type] = _families()
