"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: 3-D mRoPE positions and the processors' pixels.

Qwen-VL models rotate queries and keys by *three* positions per token (time, height,
width). Text tokens use one number three times; an image's or video's tokens use their
place in the merged patch grid, offset by the running position. The rule, as the model
class's ``get_rope_index`` applies it to one sequence (``m`` = spatial merge, 2)::

    cur = 0
    text run of n tokens      -> (cur+i, cur+i, cur+i) for i < n;        cur += n
    vision run, grid (t,h,w)  -> (cur + int(ti*dt), cur + hi, cur + wi);  cur += max(h, w) / m
                                 ti < t, hi < h/m, wi < w/m (row-major)

``dt`` is 1 except for Qwen2.5-VL videos, where it is ``tokens_per_second *
second_per_grid_t``: seconds per temporal patch, ``temporal_patch_size / sampled_fps``
with the rate of the frames actually sampled, ``len(timestamps) / source_frames *
source_fps`` (the processor's own rule, ``VideoMetadata.sampled_fps``; qwen-vl-utils'
``sample_fps``), per video. It differs from the configured 2 fps whenever the frame
count was raised to the minimum, capped by ``--max-frames`` or rounded to even. As the
model does, the product is taken in float32 and truncated. Qwen3-VL lays a video out as
one vision run per temporal patch (with ``<t seconds>`` text between them), each with
``t = 1``.

A packed row holds several samples and message trees, so the rule runs per sample and
per branch: every sample starts at ``cur = 0``; every branch of a tree starts at the
``cur`` its prefix ended with (what the model computes for prefix + branch alone). The
cost is one pass over each row's media (no per-token Python loop): about 0.3 ms for a
4,096-token pack (``make bench BENCH=reader_hf``), against 12 bytes per token on disk
had it been stored as a column at pack time; so it is computed here.

Passed as ``position_ids`` of shape ``(4, B, L)``: row 0 is the 1-D text position
(restarting per sample; what varlen attention reads to find sample boundaries), rows
1..3 the mRoPE positions. 1-D positions alone are silently wrong for every image token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import InputError, SampleError
from . import FamilyInputs, media_sample_id, sample_spans

__all__ = ["Qwen2VLInputs", "Qwen25VLInputs", "Qwen3VLInputs", "mrope_positions"]

log = logging.getLogger(__name__)

# the released checkpoints' vision config (used when model_inputs is given no config)
_TOKENS_PER_SECOND = 2
# packs without the media source_* fields are told about once per process
_warned_no_source = False


def _pad_runs(ids: np.ndarray, start: int, n: int) -> list[tuple[int, int]]:
    """``(start, end)`` runs of the media's placeholder id inside its span (the span starts with one)."""
    span = ids[start:start + n]
    is_pad = span == span[0]
    edges = np.flatnonzero(np.diff(np.concatenate([[0], is_pad.astype(np.int8), [0]])))
    return [(start + int(a), start + int(b)) for a, b in zip(edges[0::2], edges[1::2], strict=True)]


def mrope_positions(row: dict, *, merge: int = 2, video_dt: float | Callable[[dict], float] = 1.0,
                    split_video_frames: bool = False) -> np.ndarray:
    """``(3, L)`` mRoPE positions of one packed row (see the module docstring).

    Args:
        row: a packed row (``input_ids``, ``subsegment_ids``, ``cu_seqlens``, ``media``).
        merge: the vision tower's spatial merge size.
        video_dt: temporal position step per temporal patch of a video, or a function of the
            video's media entry giving it (Qwen2.5-VL: one per video).
        split_video_frames: Qwen3-VL: each temporal patch is its own vision run.

    Example:
        >>> row = {"input_ids": [1, 9, 9, 9, 9, 2], "subsegment_ids": [10000] * 6, "cu_seqlens": [0, 6],
        ...        "media": [{"kind": "image", "token_offset": 1, "n_tokens": 4, "grid_t": 1, "grid_h": 4, "grid_w": 4}]}
        >>> mrope_positions(row).tolist()
        [[0, 1, 1, 1, 1, 3], [0, 1, 1, 2, 2, 3], [0, 1, 2, 1, 2, 3]]
    """
    ids = np.asarray(row["input_ids"])
    length = len(ids)
    out = np.zeros((3, length), dtype=np.int64)
    media = sorted(row["media"], key=lambda m: int(m["token_offset"]))
    starts = np.array([int(m["token_offset"]) for m in media], dtype=np.int64)

    def walk(a: int, b: int, cur: int) -> int:
        lo, hi = np.searchsorted(starts, a), np.searchsorted(starts, b)
        pos = a
        for m in media[lo:hi]:
            gt, gh, gw = int(m["grid_t"]), int(m["grid_h"]) // merge, int(m["grid_w"]) // merge
            runs = _pad_runs(ids, int(m["token_offset"]), int(m["n_tokens"]))
            video = m["kind"] == "video"
            if video and split_video_frames:
                grids = [(1, 1.0)] * len(runs)
            else:
                grids = [(gt, (video_dt(m) if callable(video_dt) else video_dt) if video else 1.0)]
            if len(grids) != len(runs) or any(e - s != t * gh * gw for (s, e), (t, _) in zip(runs, grids, strict=True)):
                raise InputError(
                    f"pack {row.get('pack_index', '?')}: {m['kind']} at token {m['token_offset']} has placeholder runs "
                    f"{[e - s for s, e in runs]} that do not match its grid {gt}x{gh * merge}x{gw * merge}; "
                    "was it packed for another --model?"
                )
            for (s, e), (t, dt) in zip(runs, grids, strict=True):
                n_text = s - pos
                out[:, pos:s] = np.arange(cur, cur + n_text)
                cur += n_text
                # float32 and truncation, as the model's get_rope_index computes it
                tt = (np.arange(t, dtype=np.float32) * np.float32(dt)).astype(np.int64) + cur
                out[0, s:e] = np.repeat(tt, gh * gw)
                out[1, s:e] = np.tile(np.repeat(np.arange(gh), gw), t) + cur
                out[2, s:e] = np.tile(np.arange(gw), t * gh) + cur
                cur += max(gh, gw)
                pos = e
        out[:, pos:b] = np.arange(cur, cur + b - pos)
        return cur + b - pos

    for s, p, branches in sample_spans(row):
        cur = walk(s, p, 0)
        for bs, be in branches:
            walk(bs, be, cur)
    return out


class Qwen2VLInputs(FamilyInputs):
    """Qwen2-VL (``Qwen2VLForConditionalGeneration``): 14-px patches, CLIP normalisation."""

    name = "qwen2-vl"
    model_class = "Qwen2VLForConditionalGeneration"
    placeholder_ids = True
    # transformers' Qwen-VL classes refuse flex attention (no _supports_flex_attn)
    attn_implementations = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
    patch_size = 14
    merge_size = 2
    temporal_patch_size = 2
    image_mean: tuple[float, ...] | None = None  # the processor class's default (OpenAI CLIP)
    image_std: tuple[float, ...] | None = None
    split_video_frames = False

    def __init__(self, vision: dict, config: Any = None) -> None:
        super().__init__(vision, config)
        vc = getattr(config, "vision_config", None)
        if vc is not None:
            self.merge_size = int(getattr(vc, "spatial_merge_size", self.merge_size))
        self._image_processor = None
        self._video_processor = None

    # ---- positions

    def video_dt(self, m: dict) -> float:
        """Temporal position step per temporal patch of video ``m``."""
        return 1.0

    def positions(self, rows: Sequence[dict], width: int) -> np.ndarray:
        out = np.zeros((4, len(rows), width), dtype=np.int64)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            out[0, i, :n] = r["position_ids"]
            out[1:, i, :n] = mrope_positions(r, merge=self.merge_size, video_dt=self.video_dt,
                                             split_video_frames=self.split_video_frames)
        return out

    def extra(self, rows: Sequence[dict], batch: dict[str, np.ndarray]) -> dict[str, Any]:
        import torch

        # which tokens are image (1) or video (2) features, as the processor returns it
        types = np.zeros(batch["input_ids"].shape, dtype=np.int32)
        for i, r in enumerate(rows):
            ids = np.asarray(r["input_ids"])
            for m in r["media"]:
                for s, e in _pad_runs(ids, int(m["token_offset"]), int(m["n_tokens"])):
                    types[i, s:e] = 2 if m["kind"] == "video" else 1
        return {"mm_token_type_ids": torch.from_numpy(types)}

    # ---- pixels

    def _processor_kwargs(self) -> dict:
        kw: dict[str, Any] = {"patch_size": self.patch_size, "merge_size": self.merge_size,
                              "temporal_patch_size": self.temporal_patch_size}
        if self.image_mean is not None:
            kw.update(image_mean=list(self.image_mean), image_std=list(self.image_std))
        return kw

    def image_processor(self):
        if self._image_processor is None:
            from transformers import Qwen2VLImageProcessor

            size = {"shortest_edge": int(self.vision["min_pixels"]), "longest_edge": int(self.vision["max_pixels"])}
            self._image_processor = Qwen2VLImageProcessor(size=size, **self._processor_kwargs())
        return self._image_processor

    def video_processor(self):
        if self._video_processor is None:
            from transformers import Qwen2VLVideoProcessor

            # frames arrive already sampled and resized to the counted size (qwen-vl-utils' rule)
            # cap_pixels_per_frame only matters when resizing (here: never); set to silence its notice
            self._video_processor = Qwen2VLVideoProcessor(do_resize=False, do_sample_frames=False,
                                                          cap_pixels_per_frame=True, **self._processor_kwargs())
        return self._video_processor

    #: whether videos are resized with qwen-vl-utils' own call (torchvision's v1 ``resize``: float
    #: arithmetic, rounded once), which gives other pixels than the v2 uint8 kernel (up to 25 levels
    #: on noise) though the same size. Qwen2-VL and Qwen2.5-VL count every video as qwen-vl-utils
    #: prepares it, so they take its pixels too; Qwen3-VL only under ``--video-sampler qwen-vl-utils``.
    qwen_vl_utils_resize = True

    def _video_pixels(self, frames: list, m: dict):
        """The counted frames resized to the counted size (bicubic, antialiased) and patchified."""
        import torch
        from torchvision.transforms.v2 import functional as F

        video = torch.stack([torch.from_numpy(np.array(f, dtype=np.uint8)).permute(2, 0, 1) for f in frames])
        size = [int(m["resized_height"]), int(m["resized_width"])]
        if self.qwen_vl_utils_resize:
            from torchvision.transforms import functional as F1

            video = F1.resize(video, size, interpolation=F.InterpolationMode.BICUBIC, antialias=True)
        else:
            video = F.resize(video, size, interpolation=F.InterpolationMode.BICUBIC, antialias=True)
        return self.video_processor()(videos=[video], return_tensors="pt")

    def _counted_image(self, m: dict, media_root: str | Path | None):
        """Image ``m`` as the processor must get it to make the counted grid.

        tokenize counts with qwen-vl-utils' resize rule, under which no side rounds below one
        ``patch * merge`` block; the copy of the rule in ``transformers`` lets a side under half a
        block round to 0 first and then lands on another size (a 1000x5 strip: 28x812 px, where
        tokenize counted 28x1008). Such an image is resized to the counted size first, as
        qwen-vl-utils' ``fetch_image`` does (PIL's bicubic), and the processor keeps that size;
        any other image goes to the processor as decoded, and any other disagreement is left to
        :meth:`_check`.
        """
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import (
            smart_resize as hf_smart_resize,
        )

        from ...vision.qwen import smart_resize

        img = self.image(m, media_root)
        counted = (int(m["resized_height"]), int(m["resized_width"]))
        factor = self.patch_size * self.merge_size
        lo, hi = int(self.vision["min_pixels"]), int(self.vision["max_pixels"])
        try:
            if (smart_resize(img.height, img.width, factor, lo, hi) == counted
                    and hf_smart_resize(img.height, img.width, factor, lo, hi) != counted):
                img = img.resize((counted[1], counted[0]), resample=3)  # PIL.Image.BICUBIC
        except (ValueError, SampleError):  # a size either rule refuses: the processor says so below
            pass
        return img

    def pixels(self, rows: Sequence[dict], media_root: str | Path | None) -> dict[str, Any]:
        import torch

        images, image_media, videos, grids_v, video_media = [], [], [], [], []
        for r in rows:
            for m in sorted(r["media"], key=lambda m: int(m["token_offset"])):
                if m["kind"] == "video":
                    out = self._video_pixels(list(self.video(m, media_root).frames), m)
                    self._check(r, m, out["video_grid_thw"][0])
                    videos.append(out["pixel_values_videos"])
                    grids_v.append(out["video_grid_thw"])
                    video_media.append(m)
                else:
                    images.append(self._counted_image(m, media_root))
                    image_media.append((r, m))
        kw: dict[str, Any] = {}
        if images:
            out = self.image_processor()(images=images, return_tensors="pt")
            for (r, m), grid in zip(image_media, out["image_grid_thw"], strict=True):
                self._check(r, m, grid)
            kw["pixel_values"] = out["pixel_values"]
            kw["image_grid_thw"] = out["image_grid_thw"]
        if videos:
            kw["pixel_values_videos"] = torch.cat(videos)
            kw["video_grid_thw"] = torch.cat(grids_v)
            kw.update(self._video_extra(video_media))
        return kw

    def _video_extra(self, video_media: list[dict]) -> dict[str, Any]:
        """What the processor returns beside a batch's video pixels (``video_media`` in pixel order)."""
        return {}

    def _check(self, row: dict, m: dict, grid) -> None:
        """The processor's grid must be the counted one: else the features would not fill the placeholders."""
        got = tuple(int(x) for x in grid)
        want = (int(m["grid_t"]), int(m["grid_h"]), int(m["grid_w"]))
        if got != want:
            sid = media_sample_id(row, m)
            raise InputError(
                f"sample {sid!r} (pack {row.get('pack_index', '?')}): the {self.name} processor makes a {m['kind']} grid "
                f"{got} where tokenize counted {want}; the media or the processor settings changed since tokenize "
                "(re-tokenize with the settings the model uses)"
            )



class Qwen25VLInputs(Qwen2VLInputs):
    """Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): video time steps scale with ``tokens_per_second``."""

    name = "qwen2.5-vl"
    model_class = "Qwen2_5_VLForConditionalGeneration"

    def __init__(self, vision: dict, config: Any = None) -> None:
        super().__init__(vision, config)
        vc = getattr(config, "vision_config", None)
        self.tokens_per_second = int(getattr(vc, "tokens_per_second", _TOKENS_PER_SECOND))

    def second_per_grid(self, m: dict) -> float:
        """Seconds per temporal patch of video ``m``: ``temporal_patch_size / sampled_fps``, the
        rate of the frames sampled, computed as the processor computes it
        (``len(frames_indices) / total_num_frames * fps``).

        Packs from a packtool before schema version 6 lack ``source_fps`` / ``source_frames``;
        they get ``temporal_patch_size / fps`` (the configured rate, right only for videos whose
        frame count was not clamped or rounded) and a warning, once.

        Example:
            >>> inputs = Qwen25VLInputs({"fps": 2.0})
            >>> inputs.second_per_grid({"timestamps": [0.0, 0.4, 0.9, 1.4], "source_fps": 10.0, "source_frames": 15})
            0.75
        """
        fps, frames, ts = m.get("source_fps"), m.get("source_frames"), m.get("timestamps")
        if fps is None or not frames or not ts:
            _warn_no_source()
            return self.temporal_patch_size / float(self.vision.get("fps", 2.0))
        sampled_fps = len(ts) / int(frames) * float(fps)
        return self.temporal_patch_size / sampled_fps

    def video_dt(self, m: dict) -> float:
        # what the model computes: tokens_per_second times the float32 second_per_grid_ts entry
        return float(np.float32(self.tokens_per_second) * np.float32(self.second_per_grid(m)))

    def _video_extra(self, video_media: list[dict]) -> dict[str, Any]:
        import torch

        # float32, as the processor's BatchFeature holds it (the model multiplies in that type)
        return {"second_per_grid_ts": torch.tensor([self.second_per_grid(m) for m in video_media], dtype=torch.float32)}


def _warn_no_source() -> None:
    global _warned_no_source
    if not _warned_no_source:
        _warned_no_source = True
        log.warning("packed videos without source_fps / source_frames (packed by a packtool before schema version 6): "
                    "Qwen2.5-VL video time positions and second_per_grid_ts use the configured fps, which is wrong "
                    "for videos whose frame count was raised to the minimum, capped by --max-frames or rounded to "
                    "even; re-run tokenize and pack with this packtool version")


class Qwen3VLInputs(Qwen2VLInputs):
    """Qwen3-VL (``Qwen3VLForConditionalGeneration``): 16-px patches, one vision run per temporal patch.

    Videos go to the processor at the size tokenize counted, with resizing and sampling off, under
    either ``--video-sampler``; counted as qwen-vl-utils counts them (the manifest's
    ``video_sampler``), they are resized with qwen-vl-utils' own call, so the pixels are the ones
    ``fetch_video`` hands a trainer.

    Example:
        >>> Qwen3VLInputs({"video_sampler": "qwen-vl-utils"}).qwen_vl_utils_resize
        True
    """

    name = "qwen3-vl"
    model_class = "Qwen3VLForConditionalGeneration"
    patch_size = 16
    image_mean = (0.5, 0.5, 0.5)
    image_std = (0.5, 0.5, 0.5)
    split_video_frames = True

    def __init__(self, vision: dict, config: Any = None) -> None:
        super().__init__(vision, config)
        self.qwen_vl_utils_resize = vision.get("video_sampler") == "qwen-vl-utils"

    def video_processor(self):
        if self._video_processor is None:
            from transformers import Qwen3VLVideoProcessor

            self._video_processor = Qwen3VLVideoProcessor(do_resize=False, do_sample_frames=False,
                                                          cap_pixels_per_frame=True, **self._processor_kwargs())
        return self._video_processor
