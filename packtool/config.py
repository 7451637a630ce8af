"""Frozen run configurations; each has a stable ``digest()`` stored in every manifest.

A re-run into the same output directory compares digests, so resuming with a
different setting is refused instead of silently mixing two configurations.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import numbers
import operator
import os
from dataclasses import dataclass

import numpy as np

from .errors import ConfigError

__all__ = ["TokenizeConfig", "PackConfig", "default_template", "config_diff", "config_digest", "digest_of", "check_range", "check_types", "whole_number", "INT32_MAX"]

#: The largest int32: shards store token and vision-unit counts, image sizes and grids as int32,
#: so a setting that ends up in one of those columns is refused above it.
INT32_MAX = 2**31 - 1


def digest_of(config: dict, exclude: tuple[str, ...] = ()) -> str:
    """Stable short sha256 of a config dict's canonical JSON, leaving out ``exclude`` keys."""
    data = {k: v for k, v in config.items() if k not in exclude}
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


#: Settings a run's recorded config holds that change no output byte, so its digest leaves them out.
NOT_DIGESTED = ("max_errors",)


def config_digest(config: dict) -> str:
    """The ``config_digest`` a manifest records for the ``config`` it records (tokenized, packed
    or mixture): what a resume compares, and what ``packtool validate`` recomputes.

    Example:
        >>> config_digest({"max_tokens": 8192, "max_errors": 3}) == config_digest({"max_tokens": 8192})
        True
    """
    return digest_of(config, exclude=NOT_DIGESTED)


def check_range(flag: str, value: int, lo: int, hi: int, why: str = "") -> None:
    """Refuse ``value`` outside ``lo..hi`` with a :class:`ConfigError` naming ``flag``; ``why`` says
    where the upper bound comes from.

    Example:
        >>> check_range("--max-crops", 40000, 1, 256, "far above any released checkpoint's")
        Traceback (most recent call last):
        ...
        packtool.errors.ConfigError: --max-crops 40000: choose a value from 1 to 256 (far above any released checkpoint's)
    """
    if not lo <= value <= hi:
        raise ConfigError(f"{flag} {value}: choose a value from {lo:,} to {hi:,}" + (f" ({why})" if why else ""))


#: Why counts are refused above :data:`INT32_MAX` (the ``why`` of :func:`check_range`).
INT32_WHY = "the largest int32, the type of the shards' token, unit and size columns"
#: Why objective weights are: a sample's value, a weight times an int32 count, then fits int64.
WEIGHT_WHY = "the largest int32, so a sample's value, the weight times an int32 count, fits int64"


def whole_number(value: object) -> int:
    """``value`` as a plain ``int``: an ``int`` or a numpy or torch integer, never a bool, a
    float or a string (``TypeError``). Settings from Python often come from numpy or the
    environment; each caller words the error for its own argument.

    Example:
        >>> whole_number(np.int64(3)), type(whole_number(np.int64(3))).__name__
        (3, 'int')
    """
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{value!r} is a bool, not a count")
    return operator.index(value)  # type: ignore[arg-type]


def check_types(config: object) -> None:
    """Refuse a field of the dataclass ``config`` of the wrong type with a :class:`ConfigError`
    naming it, and store numpy numbers and paths as the plain ``int``, ``float`` and ``str``
    the CLI passes (annotations ``int``, ``float``, ``bool``, ``str``, each maybe ``| None``).

    Called from Python a count often comes from numpy (``np.int64``, which JSON cannot
    write into the manifest) or a computation (``8192.0``, ``"8192"`` from the environment);
    stored as given, these either failed deep in a run or gave another digest than the
    same flags, so a resume was refused.
    """
    for field in dataclasses.fields(config):  # type: ignore[arg-type]
        value = getattr(config, field.name)
        kinds = str(field.type).split(" | ")
        if value is None and "None" in kinds:
            continue
        kind = kinds[0]
        try:
            if isinstance(value, (bool, np.bool_)) and kind != "bool":
                raise TypeError
            if kind == "int":
                plain: object = whole_number(value)
            elif kind == "float":
                if not isinstance(value, numbers.Real):
                    raise TypeError
                plain = float(value)
            elif kind == "bool":
                if not isinstance(value, (bool, np.bool_)):
                    raise TypeError
                plain = bool(value)
            else:
                plain = os.fspath(value) if isinstance(value, os.PathLike) else value
                if not isinstance(plain, str):
                    raise TypeError
        except TypeError:
            allowed = " or ".join(("an integer" if k == "int" else "a number" if k == "float" else
                                   "True or False" if k == "bool" else "None" if k == "None" else "a string")
                                  for k in kinds)
            raise ConfigError(f"{type(config).__name__}({field.name}=...) must be {allowed}, got {value!r} "
                              f"({type(value).__name__})") from None
        if plain is not value:
            object.__setattr__(config, field.name, plain)


class _Digestible:
    _not_digested: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)  # type: ignore[arg-type]

    def digest(self) -> str:
        """Digest of the settings that change the output bytes."""
        return digest_of(self.to_dict(), self._not_digested)


#: ``--oversize`` choices: what happens to a sample that can never fit a pack.
OVERSIZE_POLICIES = ("drop", "truncate", "alone", "fail")
#: ``--media`` choices: embed media bytes in packed rows, or keep references to the files.
MEDIA_MODES = ("embed", "reference")
#: ``--layout`` choices of packed shards (``schema.LAYOUTS``).
LAYOUTS = ("runs", "full")

#: The chat template of a vision family whose model is trained with one other than ChatML with
#: Qwen2's default system prompt (``chatml``, the template of every other family here).
FAMILY_TEMPLATES = {"qwen3-vl": "qwen3-vl", "molmo2": "molmo2"}


def default_template(model: str) -> str:
    """The template a ``--model`` gets when ``--template`` is not given: its own chat format.

    Example:
        >>> default_template("qwen2.5-vl"), default_template("qwen3-vl"), default_template("molmo2")
        ('chatml', 'qwen3-vl', 'molmo2')
    """
    return FAMILY_TEMPLATES.get(model, "chatml")


@dataclass(frozen=True, slots=True)
class TokenizeConfig(_Digestible):
    """Settings of ``packtool tokenize``.

    Attributes:
        model: vision family (``qwen2.5-vl``, ``fixed:576`` ...).
        template: chat template name; ``None`` (the default) is the model's (:func:`default_template`),
            which the config holds from then on.
        tokenizer: ``None`` for the template's default (the embedded Qwen2 vocabulary; ``qwen3``
            under ``qwen3-vl``), ``qwen2`` or ``qwen3`` for an embedded one, ``hf:ORG/NAME``
            from the local Hugging Face cache, else a path.
        format: input format or ``auto``.
        media_root: directory media paths resolve under.
        system_prompt: ``None`` for the template's default.
        min_pixels, max_pixels: image pixel budget (families that use one).
        max_frames: most frames sampled per video (``None``: the family's default).
        fps: video sampling rate for families that sample by rate (Qwen).
        max_crops: Molmo2 crops per image; max_num: InternVL tiles per image.
        exif: ``apply`` or ``ignore`` EXIF orientation / video rotation (``None``: the family's loader).
        video_sampler: ``qwen3-vl`` only: ``processor`` counts videos as ``transformers``'
            ``Qwen3VLVideoProcessor`` samples and resizes them, ``qwen-vl-utils`` as the Qwen team's
            ``qwen_vl_utils.fetch_video`` does (a per-frame cap); ``None``: ``processor``, and the
            recorded config and its digest are those of a run before the setting existed.
        rows_per_shard: tokenized rows per output shard.
        max_errors: fail the run when more rows than this are rejected (``None``: no limit).
        max_branches: most branches in one message tree; more go to another tree on the
            same media (``None``: no cap).
        max_tokens: most tokens in one message tree; branches beyond it go to another
            tree on the same media (``None``: no cap). Usually the pack's ``--max-tokens``.
        group_by_media: merge separate records that reference the same media file (same
            resolved path or same bytes) into one message tree.
        reasoning_loss: whether reasoning the template keeps (``qwen3-vl``'s
            ``<think>…</think>``) carries loss; the answer always does.
    """

    model: str = "qwen2.5-vl"
    template: str | None = None
    tokenizer: str | None = None
    format: str = "auto"
    media_root: str = "."
    system_prompt: str | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    max_frames: int | None = None
    fps: float | None = None
    max_crops: int | None = None
    max_num: int | None = None
    exif: str | None = None
    video_sampler: str | None = None
    rows_per_shard: int = 50_000
    max_errors: int | None = None
    max_branches: int | None = None
    max_tokens: int | None = None
    group_by_media: bool = False
    reasoning_loss: bool = True
    _not_digested = NOT_DIGESTED

    def __post_init__(self) -> None:
        if self.template is None and isinstance(self.model, str):
            object.__setattr__(self, "template", default_template(self.model))
        check_types(self)
        if self.rows_per_shard < 1:
            raise ConfigError("--rows-per-shard must be at least 1")
        if self.max_errors is not None and self.max_errors < 0:
            raise ConfigError(f"--max-errors {self.max_errors}: choose 0 or more (None: no limit)")
        if self.max_branches is not None and self.max_branches < 1:
            raise ConfigError("--max-branches must be at least 1")
        if self.max_tokens is not None:
            if self.max_tokens < 1:
                raise ConfigError("--max-tokens must be at least 1")
            check_range("--max-tokens", self.max_tokens, 1, INT32_MAX, INT32_WHY)
        if self.system_prompt and self.template == "plain":
            raise ConfigError("--system-prompt has no place in --template plain: LLaVA's pretraining renders each "
                              "image and its answer, nothing else; leave the flag out, or pick another --template")
        if self.system_prompt is not None:
            try:
                self.system_prompt.encode("utf-8")
            except UnicodeEncodeError:  # an argument's undecodable byte, or a lone surrogate
                raise ConfigError("--system-prompt is not valid UTF-8 text (the same text in a record is rejected as "
                                  "bad_encoding; the tokenizer would have put U+FFFD in its place); write it as UTF-8"
                                  ) from None
        from .formats import check_format
        from .vision import check_settings

        check_format(self.format)
        check_settings(self.model, **self.vision_settings())

    def vision_settings(self) -> dict:
        """The processor settings :func:`packtool.vision.get_family` builds the family with.

        Example:
            >>> TokenizeConfig(model="qwen3-vl", video_sampler="qwen-vl-utils").vision_settings()["video_sampler"]
            'qwen-vl-utils'
        """
        return {"min_pixels": self.min_pixels, "max_pixels": self.max_pixels, "max_frames": self.max_frames,
                "fps": self.fps, "max_crops": self.max_crops, "max_num": self.max_num, "exif": self.exif,
                "video_sampler": self.video_sampler}

    def to_dict(self) -> dict:
        """The settings as recorded in the manifest; ``video_sampler`` is left out when not given, so
        a run without ``--video-sampler`` records the config (and digest) earlier versions did, and
        resumes or skips a run they wrote.

        Example:
            >>> "video_sampler" in TokenizeConfig().to_dict()
            False
        """
        out = dataclasses.asdict(self)  # type: ignore[call-overload]
        if out["video_sampler"] is None:
            del out["video_sampler"]
        return out


@dataclass(frozen=True, slots=True)
class PackConfig(_Digestible):
    """Settings of ``packtool pack`` (DESIGN.md §4).

    Attributes:
        max_tokens: tokens per pack (the sequence length).
        max_vision_units: vision units per pack (``None``: the tokenized family's default).
        buffer_size: samples the knapsack chooses from for each pack.
        text_weight, vision_weight: the objective ``text_weight*tokens + vision_weight*units``.
        token_granularity: token sizes are rounded *up* to a multiple of this for the DP table.
        oversize: what to do with a sample that can never fit: ``drop``, ``truncate``, ``alone``, ``fail``.
        max_samples_per_pack: most samples in one pack, an exact constraint of the knapsack
            (``None``: no cap).
        media: ``embed`` original bytes into packed rows, or ``reference`` paths only.
        packs_per_shard: packed rows per output shard.
        frame_quality: JPEG quality of embedded video frames (1-100).
        layout: ``runs`` (placeholder runs stored once, schema version 6) or ``full``
            (every token stored, schema version 7); see README "Output layout".
    """

    max_tokens: int = 16384
    max_vision_units: int | None = None
    buffer_size: int = 64
    text_weight: int = 1
    vision_weight: int = 0
    token_granularity: int = 16
    oversize: str = "drop"
    max_samples_per_pack: int | None = None
    media: str = "embed"
    packs_per_shard: int = 2_000
    frame_quality: int = 90
    layout: str = "runs"

    def __post_init__(self) -> None:
        check_types(self)
        if self.layout not in LAYOUTS:
            raise ConfigError(f"--layout {self.layout!r}: choose {' or '.join(LAYOUTS)}")
        for name in ("max_tokens", "buffer_size", "token_granularity", "packs_per_shard"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if self.max_vision_units is not None and self.max_vision_units < 0:
            raise ConfigError("--max-vision-units must be non-negative")
        if self.text_weight < 0 or self.vision_weight < 0:
            raise ConfigError("--text-weight and --vision-weight must be non-negative")
        check_range("--max-tokens", self.max_tokens, 1, INT32_MAX, INT32_WHY)
        if self.token_granularity > self.max_tokens:
            raise ConfigError(f"--token-granularity {self.token_granularity} exceeds --max-tokens {self.max_tokens}; "
                              "lower the granularity")
        if self.max_vision_units is not None:
            check_range("--max-vision-units", self.max_vision_units, 0, INT32_MAX, INT32_WHY)
        check_range("--text-weight", self.text_weight, 0, INT32_MAX, WEIGHT_WHY)
        check_range("--vision-weight", self.vision_weight, 0, INT32_MAX, WEIGHT_WHY)
        if self.oversize not in OVERSIZE_POLICIES:
            raise ConfigError(f"--oversize {self.oversize!r}: choose drop, truncate, alone or fail")
        if self.media not in MEDIA_MODES:
            raise ConfigError(f"--media {self.media!r}: choose embed or reference")
        if not 1 <= self.frame_quality <= 100:
            raise ConfigError(f"--frame-quality {self.frame_quality}: choose a JPEG quality from 1 to 100")
        if self.max_samples_per_pack is not None and self.max_samples_per_pack < 1:
            raise ConfigError("--max-samples-per-pack must be at least 1")


def config_diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Human-readable differences between two config dicts (for resume refusals).

    Nested settings are named by their path, so a mixture resumed with another seed reads
    ``mixture.seed: 0 -> 1``, not as both whole mixtures; an entry one side lacks is ``None``,
    and an entry with another ``path`` (a mixture's sources in another order) is named by it alone.

    Example:
        >>> config_diff({"max_tokens": 8192, "mixture": {"seed": 0, "sources": [{"rate": "1"}]}},
        ...             {"max_tokens": 8192, "mixture": {"seed": 1, "sources": [{"rate": "2.5"}]}})
        ['mixture.seed: 0 -> 1', "mixture.sources[0].rate: '1' -> '2.5'"]
    """
    out = []
    for k in sorted(set(old) | set(new)):  # one type a dict: names, or a list's indices
        a, b = old.get(k), new.get(k)
        if a == b:
            continue
        name = f"{prefix}.{k}" if prefix and isinstance(k, str) else f"{prefix}[{k}]" if prefix else str(k)
        if isinstance(a, list) and isinstance(b, list):
            a, b = dict(enumerate(a)), dict(enumerate(b))
        if isinstance(a, dict) and isinstance(b, dict) and a.get("path") != b.get("path"):
            out.append(f"{name}.path: {a.get('path')!r} -> {b.get('path')!r}")  # another source: its settings differ too
        elif isinstance(a, dict) and isinstance(b, dict):
            out += config_diff(a, b, name)
        else:
            out.append(f"{name}: {a!r} -> {b!r}")
    return out
