"""Vision accounting per model family: pure arithmetic, no I/O (DESIGN.md §5).

A family turns media dimensions into a :class:`VisionLayout` (how many placeholder
tokens the model's processor will produce, how much vision-encoder work it costs)
and lays those placeholders out as token *segments* that the template expands.

    >>> fam = get_family("qwen2.5-vl")
    >>> fam.image(1080, 1920).n_tokens
    2691

Families, their vision unit and default capacity (``--max-vision-units``):

============  ==========================  =======
family        vision unit                 default
============  ==========================  =======
qwen2-vl      14-px ViT patch              65,536
qwen2.5-vl    14-px ViT patch              65,536
qwen3-vl      16-px ViT patch              65,536
molmo2        378-px crop (global + tiles)    128
llava-ov      384-px tile / video frame        64
internvl      448-px tile (incl. thumbnail)    64
fixed:N       image                            64
============  ==========================  =======

A video's frame times are chosen by the family (each reproduces its processor's
sampler) and returned in :attr:`VisionLayout.timestamps`, in seconds from the first
frame; the tokenized row records them and pack extracts exactly those frames.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from ..config import INT32_MAX, INT32_WHY, check_range
from ..errors import ConfigError, SampleError

__all__ = ["VisionLayout", "VideoMeta", "VisionFamily", "get_family", "check_settings", "check_tokenizer",
           "span_segments", "FAMILIES", "EXIF_MODES", "SETTING_LIMITS", "VIDEO_SAMPLERS", "check_video_sampler"]

EXIF_MODES = ("apply", "ignore")
#: ``--video-sampler`` choices (``qwen3-vl`` only), the default first: ``processor`` counts a video as
#: ``transformers``' video processor samples and resizes it from the file; ``qwen-vl-utils`` as the
#: Qwen team's ``qwen_vl_utils.fetch_video`` does before the processor (a per-frame pixel cap).
VIDEO_SAMPLERS = ("processor", "qwen-vl-utils")
#: Families that count videos with qwen-vl-utils' rule already (``--video-sampler`` has nothing to change).
_QWEN_VL_UTILS_ALREADY = ("qwen2-vl", "qwen2.5-vl")


def check_video_sampler(value: str) -> None:
    """Refuse a ``--video-sampler`` that is none of :data:`VIDEO_SAMPLERS`.

    Example:
        >>> check_video_sampler("qwen-vl-utils")
        >>> check_video_sampler("decord")
        Traceback (most recent call last):
        packtool.errors.ConfigError: --video-sampler 'decord': choose processor or qwen-vl-utils
    """
    if value not in VIDEO_SAMPLERS:
        raise ConfigError(f"--video-sampler {value!r}: choose {' or '.join(VIDEO_SAMPLERS)}")


@dataclass(frozen=True, slots=True)
class VideoMeta:
    """What a probe learned about a video without decoding it.

    Attributes:
        width, height: frame size as the family sees it (coded size; swapped for a
            90/270 degree display rotation when rotation is applied).
        duration_s: playable duration from the first frame.
        fps: average frame rate.
        n_frames: number of frames (as a frame-indexed reader such as decord counts them).
        start_s: presentation time of the first frame (non-zero in many TS/MKV files).
        rotation: display rotation in degrees (0, 90, 180, 270) from the container.
        frame_times: for a variable-rate stream, every frame's presentation time in
            seconds from the first frame, in display order; empty when frame ``i`` is
            at ``i / fps`` (to one tick of the stream's clock).
    """

    width: int
    height: int
    duration_s: float
    fps: float
    n_frames: int
    start_s: float = 0.0
    rotation: int = 0
    frame_times: tuple[float, ...] = ()

    def frame_time(self, index: int) -> float:
        """The time (seconds from the first frame) at which frame ``index`` is shown: the
        time a family records for a frame it samples by index, so that the frame taken at
        that time (:func:`packtool.media.counted_frames`) is frame ``index`` itself.

        Example:
            >>> VideoMeta(64, 48, 2.0, 10.0, 20).frame_time(5)
            0.5
            >>> VideoMeta(64, 48, 0.3, 10.0, 3, frame_times=(0.0, 0.01, 0.25)).frame_time(2)
            0.25
        """
        return self.frame_times[index] if self.frame_times else index / self.fps


@dataclass(frozen=True, slots=True)
class VisionLayout:
    """How one media item is seen by a model.

    Attributes:
        kind: ``"image"`` or ``"video"``.
        n_tokens: placeholder (feature) tokens the processor emits for it: the sum of
            the ``"pad"`` segment counts. Structure tokens (column, frame markers,
            timestamp text) are extra.
        units: vision-encoder work it costs (patches, crops or tiles; per family).
        grid: ``(t, h, w)`` in the family's patch grid (``(1, h, w)`` for images).
        resized: ``(height, width)`` the processor resizes to.
        timestamps: for videos, the exact frame times (seconds from the first frame)
            that were counted; the packed shard embeds exactly these frames.
        segments: the token layout: ``(kind, value, count)`` triples where kind is
            ``"special"`` (a special token by name), ``"text"`` (ordinary text) or
            ``"pad"`` (``count`` copies of a placeholder token; these are the feature
            slots). A layout may hold several pad runs (one per row or frame); the
            media span in a row then runs from the first pad to the last pad.
    """

    kind: str
    n_tokens: int
    units: int
    grid: tuple[int, int, int]
    resized: tuple[int, int]
    segments: tuple[tuple[str, str, int], ...]
    timestamps: tuple[float, ...] = ()


class VisionFamily:
    """Interface every model family implements.

    Class attributes document the family: ``unit_name`` (what one vision unit is),
    ``default_max_vision_units`` (the pack capacity used when ``--max-vision-units``
    is not given) and ``exif_default`` (whether the family's own image loader applies
    EXIF orientation; ``--exif`` overrides it).
    """

    name: str = ""
    unit_name: str = "units"
    default_max_vision_units: int = 0
    exif_default: str = "ignore"
    exif: str = "ignore"

    def image(self, height: int, width: int) -> VisionLayout:  # pragma: no cover - interface
        raise NotImplementedError

    def video(self, meta: VideoMeta) -> VisionLayout:  # pragma: no cover - interface
        raise NotImplementedError

    def video_segments(self, grid: tuple[int, int, int], timestamps: tuple[float, ...]) -> tuple:  # pragma: no cover
        """The token segments of a video whose layout has ``grid`` and frame ``timestamps``
        (what :meth:`video` puts in :attr:`VisionLayout.segments`; validation rebuilds a
        recorded video's span with it)."""
        raise NotImplementedError

    def segment_times(self, media: dict) -> tuple[float, ...]:
        """The frame times :meth:`video_segments` lays out a recorded video's span with
        (``media``: a row's media entry): its recorded timestamps, unless the family
        writes other times into the text (Qwen3-VL)."""
        return tuple(media.get("timestamps") or ())

    def image_in_sample(self, height: int, width: int, n_images: int) -> VisionLayout:
        """Layout of one image in a sample that holds ``n_images`` images (videos not counted).

        Most processors treat every image alike, so the default is :meth:`image`.
        LLaVA-OneVision encodes the images of a multi-image sample without tiling.
        """
        return self.image(height, width)

    def image_count_key(self, n_images: int):
        """What of a sample's image count changes an image's layout (part of the probe cache key).

        ``None`` (the default): nothing; a family that overrides :meth:`image_in_sample`
        returns the smallest key that tells its cases apart.
        """
        return None

    def settings(self) -> dict:
        """The settings that change counts; stored in the manifest and the config digest."""
        return {"name": self.name, "exif": self.exif}

    def special_tokens(self) -> tuple[str, ...]:
        """Names of the special tokens this family's layouts use (the tokenizer must know them)."""
        return ()


def check_video(meta: VideoMeta, family: str, min_frames: int = 1) -> None:
    """Reject videos a family cannot sample (no frames, no rate, too few frames)."""
    if meta.n_frames < 1 or meta.width <= 0 or meta.height <= 0:
        raise SampleError("corrupt_video", f"video has no decodable frames ({meta.width}x{meta.height}, {meta.n_frames} frames)")
    if not meta.fps or meta.fps <= 0:
        raise SampleError("corrupt_video", "video has no frame rate")
    if meta.n_frames < min_frames:
        raise SampleError(
            "video_too_short",
            f"video has {meta.n_frames} frame(s); the {family} processor needs at least {min_frames}",
        )


def check_tokenizer(family: VisionFamily, tokenizer) -> None:
    """Fail fast when ``tokenizer`` lacks a special token the family's layouts use.

    Raises:
        ConfigError: naming the missing tokens and the ``--tokenizer`` fix.
    """
    missing = []
    for name in family.special_tokens():
        try:
            tokenizer.special_id(name)
        except ConfigError:
            missing.append(name)
    if missing:
        raise ConfigError(
            f"--model {family.name} lays out media with special tokens {', '.join(missing)}, which tokenizer "
            f"{getattr(tokenizer, 'name', '') or 'in use'!r} does not have; pass --tokenizer with the checkpoint's "
            "tokenizer.json (or its directory)"
        )


def span_segments(family: VisionFamily, media: dict, n_images: int = 1) -> tuple[tuple[str, str, int], ...]:
    """The segments a row's span of one recorded media item must hold, from its first pad
    run to its last (the span :mod:`packtool.rows` records), adjacent text joined as the
    encoder joins it.

    ``media`` is a row's media entry: an image's layout is rebuilt by the family from its
    recorded size (``n_images``: the images of its sample), a video's from its recorded
    grid and timestamps.

    Raises:
        ValueError: the rebuilt layout's grid differs from the recorded one.

    Example:
        >>> m = dict(kind="video", grid_t=2, grid_h=9, grid_w=9, timestamps=[0.0, 0.5])
        >>> [s[1] for s in span_segments(get_family("molmo2"), m)]
        ['<im_patch>', '<frame_end>', ' 0.5 ', '<frame_start>', '<im_patch>']
    """
    grid = (int(media["grid_t"]), int(media["grid_h"]), int(media["grid_w"]))
    if media["kind"] == "video":
        segs = family.video_segments(grid, family.segment_times(media))
    else:
        lay = family.image_in_sample(int(media["height"]), int(media["width"]), n_images)
        if tuple(lay.grid) != grid:
            raise ValueError(f"recorded grid {grid} but {family.name} lays out a "
                             f"{media['width']}x{media['height']} image on {tuple(lay.grid)}")
        segs = lay.segments
    pads = [i for i, s in enumerate(segs) if s[0] == "pad"]
    out: list[tuple[str, str, int]] = []
    for kind, value, count in segs[pads[0]:pads[-1] + 1] if pads else ():
        if kind == "text" and out and out[-1][0] == "text":
            out[-1] = ("text", out[-1][1] + value, 1)
        else:
            out.append((kind, value, count))
    return tuple(out)


#: Upper bounds of the processor settings, which :func:`get_family` refuses beyond and the CLI's
#: options declare. Pixel budgets and ``fixed:N`` end up in int32 columns (an image's resized
#: size, grid and token count); the others are far above any released checkpoint's setting
#: (frames: Qwen's 768; crops: Molmo2's 8; tiles: InternVL's 12, about 40 in use), where the
#: processors' enumerations still take well under a second (InternVL's candidate grids grow
#: with the cube of ``--max-num``: 0.4 s at 256, 31 s at 1,024). ``--fps`` (a float) is capped
#: far above any video's frame rate: beyond a video's own rate every frame is sampled anyway, and
#: an infinite rate made the frame count infinite.
SETTING_LIMITS = {"min_pixels": INT32_MAX, "max_pixels": INT32_MAX, "max_frames": 65_536, "max_crops": 256,
                  "max_num": 256, "fixed": INT32_MAX, "fps": 1000}
_LIMIT_WHY = {"min_pixels": INT32_WHY, "max_pixels": INT32_WHY, "fixed": INT32_WHY}


def _checked(name: str, settings: dict) -> tuple[type, tuple, dict, str | None]:
    """``(family class, positional arguments, settings, exif)`` for ``name`` and ``settings``, every
    one checked (see :func:`get_family`)."""
    given = {k: v for k, v in settings.items() if v is not None}
    exif = given.pop("exif", None)
    if exif is not None and exif not in EXIF_MODES:
        raise ConfigError(f"--exif {exif!r}: choose apply or ignore")
    key = name.lower()
    args: tuple = ()
    if key in FAMILIES:
        cls = FAMILIES[key]
        accepted = set(inspect.signature(cls.__init__).parameters) - {"self"}
        unknown = sorted(set(given) - accepted)
        if "video_sampler" in unknown and key in _QWEN_VL_UTILS_ALREADY:
            raise ConfigError(f"--video-sampler does not apply to --model {key}: it counts videos as qwen-vl-utils "
                              "samples and resizes them already; leave the flag out (it chooses the rule for "
                              "--model qwen3-vl only)")
        if unknown:
            flags = ", ".join("--" + k.replace("_", "-") for k in unknown)
            # settings that are options (not single_crop_col_tokens)
            flagged = sorted(accepted & {*SETTING_LIMITS, "video_sampler"})
            raise ConfigError(f"{flags} does not apply to --model {key}; it accepts: "
                              + (", ".join("--" + k.replace("_", "-") for k in flagged) or "no settings"))
    elif key.startswith("fixed:"):
        from .fixed import Fixed

        cls = Fixed
        try:
            n = int(key.split(":", 1)[1])
        except ValueError:
            n = 0
        if n <= 0:
            raise ConfigError(f"--model {name!r}: fixed:N needs a positive N, e.g. fixed:576")
        if n > SETTING_LIMITS["fixed"]:
            raise ConfigError(f"--model {name!r}: fixed:N takes N from 1 to {SETTING_LIMITS['fixed']:,} "
                              f"({_LIMIT_WHY['fixed']}), e.g. fixed:576")
        extra = sorted(set(given) - {"max_frames"})
        if extra:
            raise ConfigError(f"{', '.join('--' + k.replace('_', '-') for k in extra)} does not apply to --model fixed:N")
        args = (n,)
    else:
        raise ConfigError(f"unknown --model {name!r}; choose one of: {', '.join(sorted(FAMILIES))}, fixed:N")
    for k, v in given.items():
        if k == "video_sampler":
            check_video_sampler(v)
        elif k == "fps":
            if not v > 0:  # also NaN
                raise ConfigError(f"--fps {v}: give a positive video sampling rate, e.g. 2")
            if not v <= SETTING_LIMITS["fps"]:  # also infinity
                raise ConfigError(f"--fps {v}: give a video sampling rate up to {SETTING_LIMITS['fps']:,} frames per "
                                  "second (far above any video's frame rate), e.g. 2")
        elif k in SETTING_LIMITS:
            check_range("--" + k.replace("_", "-"), v, 1, SETTING_LIMITS[k],
                        _LIMIT_WHY.get(k, "far above any released checkpoint's setting"))
    min_frames = getattr(cls, "min_max_frames", 1)
    if given.get("max_frames", min_frames) < min_frames:
        raise ConfigError(f"--max-frames {given['max_frames']}: --model {key} samples video frames in pairs "
                          f"(temporal patch {min_frames}), so every video would be rejected; give {min_frames} or more")
    if given.get("min_pixels", 0) > given.get("max_pixels", INT32_MAX):
        raise ConfigError(f"--min-pixels {given['min_pixels']} is above --max-pixels {given['max_pixels']}; "
                          "give a pixel floor no larger than the cap")
    return cls, args, given, exif


def check_settings(name: str, **settings) -> None:
    """Refuse a ``--model`` and processor ``settings`` that :func:`get_family` would refuse, without
    building the family (``TokenizeConfig`` checks its settings with it).

    Raises:
        ConfigError: an unknown family or ``fixed:N``, a setting the family does not take, or a
            value out of its bounds (:data:`SETTING_LIMITS`), naming the flag and the fix.
    """
    _checked(name, settings)


def get_family(name: str, **settings) -> VisionFamily:
    """Return the vision family called ``name`` configured with processor ``settings``.

    ``None`` settings are ignored (the family's released-checkpoint default applies).
    A setting the family does not use is a :class:`ConfigError`, so that, say,
    ``--max-crops`` with ``qwen2.5-vl`` does not silently do nothing; so is a value
    out of its bounds (:data:`SETTING_LIMITS`), or ``min_pixels`` above ``max_pixels``.

    Example:
        >>> get_family("internvl", max_num=6).max_num
        6
    """
    cls, args, given, exif = _checked(name, settings)
    family = cls(*args, **given)
    family.exif = exif or family.exif_default
    return family


def _families() -> dict[str, type]:
    from .internvl import InternVL
    from .llava_ov import LlavaOneVision
    from .molmo2 import Molmo2
    from .qwen import Qwen2VL, Qwen25VL
    from .qwen3 import Qwen3VL

    return {
        "qwen2-vl": Qwen2VL,
        "qwen2.5-vl": Qwen25VL,
        "qwen3-vl": Qwen3VL,
        "molmo2": Molmo2,
        "llava-ov": LlavaOneVision,
        "internvl": InternVL,
    }


FAMILIES: dict[str, type] = _families()
