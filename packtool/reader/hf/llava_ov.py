"""LLaVA-OneVision: the processors' pixels, grouped per sample, for ``LlavaOnevisionForConditionalGeneration``.

LLaVA-OneVision's language model is a plain Qwen2 with 1-D rotary positions, so the
only per-family work is the pixels. Positions need nothing: rotary attention depends
on position *differences* inside a sample, and the rows' ``position_ids`` restart at 0
for every sample and continue the prefix in every branch of a message tree, exactly
what the model computes for each sample alone. Vision tokens attend causally, like
text (``vision_attention = "causal"``). No other keyword arguments are needed.

What the model takes, and why grouping is per *sample*::

    pixel_values      (n_tiles, 3, 384, 384)  every image's tiles, images in token order
    image_sizes       (n_images, 2)           each image's original (height, width)
    batch_num_images  (n_samples_with_images) images per sample, samples in token order
    pixel_values_videos (n_videos, frames, 3, 384, 384)

An image alone in its sample is tiled (``anyres_max_9``: a 384-px base view plus up to
6x6 tiles, unpadded back to the image's aspect ratio, one newline per feature row); an
image that shares its sample with others is padded to a square and seen as one
384-px crop, 729 features + 1 newline = 730 tokens. The model learns which rule applies
from ``batch_num_images`` alone (``n == 1`` means tiled). A packed row holds many
samples, so counting images per *row* would call a row's two single-image samples "two
images" and drop their tiles; passing no ``batch_num_images`` tiles every image, and
the multi-image samples' features no longer fit their 730 placeholders. Hence one
entry per sample that has images (text-only samples have none, as in the processor).

Example: a row holding a single-image sample (2 tiles + base) and a two-image sample
gives ``batch_num_images = [1, 2]`` and ``pixel_values`` of ``3 + 1 + 1 = 5`` crops.

``pixel_values`` is passed 4-D, the crops of all images laid end to end, which the model
accepts as is. The processor's own 5-D form pads every image to the most crops of the
batch (up to 37 crops of 384x384, zeros the model slices off again); 4-D holds the same
crops without the padding.

Videos are the frames that ``tokenize`` counted, embedded in the pack (or decoded at the
recorded timestamps); they are never re-sampled. Each frame is resized to 384x384 and
pooled by the model to 14x14 = 196 tokens, plus one newline per video. The model takes
all videos of a batch as one ``(videos, frames, ...)`` tensor, so every video of a batch
must have the same number of frames (the processor refuses otherwise too).

The processors are ``transformers``' own ``LlavaOnevisionImageProcessor`` and
``LlavaOnevisionVideoProcessor`` with the released checkpoints' settings (those of
``google/siglip-so400m-patch14-384``: bicubic, mean = std = 0.5), and every item is
checked to yield exactly the ``n_tokens`` that ``tokenize`` counted, by the model's
own arithmetic (``get_anyres_image_grid_shape``, ``unpad_image``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ConfigError, InputError
from . import FamilyInputs, media_sample_id

__all__ = ["LlavaOnevisionInputs"]

# The released checkpoints (llava-hf/llava-onevision-qwen2-*-ov-hf): SigLIP so400m at 384 px,
# 14-px patches, anyres_max_9 over the 36 pinpoints (384*i, 384*j), i, j in 1..6. A model
# config passed to model_inputs overrides the geometry. The normalisation is SigLIP's (mean =
# std = 0.5: the conversion script loads the processors from google/siglip-so400m-patch14-384),
# not the processor classes' CLIP defaults, which would shift every pixel of a real checkpoint.
_TILE = 384
_PATCH = 14
_ASPECT = "anyres_max_9"
_PINPOINTS = [[384 * i, 384 * j] for i in range(1, 7) for j in range(1, 7)]
_SIGLIP_MEAN = (0.5, 0.5, 0.5)
_SIGLIP_STD = (0.5, 0.5, 0.5)


class LlavaOnevisionInputs(FamilyInputs):
    """LLaVA-OneVision (``LlavaOnevisionForConditionalGeneration``): per-sample image groups, equal-length videos.

    Attributes:
        tile: crop size in pixels (the vision tower's ``image_size``).
        patch: the vision tower's patch size; ``tile // patch`` features per crop side.
        pinpoints: the ``(height, width)`` grids an image may be tiled to.
        max_tiles: the ``N`` of ``anyres_max_N``: features beyond ``N`` tiles' worth
            (by more than 10%) are scaled down.
    """

    name = "llava-ov"
    model_class = "LlavaOnevisionForConditionalGeneration"
    placeholder_ids = True  # every media token is <image> / <video>: the config's image/video_token_id
    image_mean = _SIGLIP_MEAN
    image_std = _SIGLIP_STD

    def __init__(self, vision: dict, config: Any = None) -> None:
        super().__init__(vision, config)
        vc = getattr(config, "vision_config", None)
        self.tile = int(getattr(vc, "image_size", _TILE))
        self.patch = int(getattr(vc, "patch_size", _PATCH))
        self.pinpoints = [list(p) for p in (getattr(config, "image_grid_pinpoints", None) or _PINPOINTS)]
        aspect = str(getattr(config, "vision_aspect_ratio", None) or _ASPECT)
        if not aspect.startswith("anyres_max_") or not aspect.removeprefix("anyres_max_").isdigit():
            raise ConfigError(f"vision_aspect_ratio={aspect!r}: model_inputs supports 'anyres_max_N' only")
        self.max_tiles = int(aspect.removeprefix("anyres_max_"))
        strategy = getattr(config, "vision_feature_select_strategy", "full")
        if strategy != "full":
            raise ConfigError(f"vision_feature_select_strategy={strategy!r}: LLaVA-OneVision's SigLIP tower has no "
                              "CLS token to drop; the released checkpoints use 'full'")
        self._image_processor = None
        self._video_processor = None

    # ---- counts, by the model's own arithmetic

    def image_tokens(self, height: int, width: int, tiled: bool) -> int:
        """Placeholder tokens the model fills for one image of ``height`` x ``width`` pixels.

        ``tiled``: the image is alone in its sample (``batch_num_images`` entry 1).

        Example:
            >>> f = LlavaOnevisionInputs({"name": "llava-ov"})
            >>> f.image_tokens(480, 640, tiled=True), f.image_tokens(480, 640, tiled=False)
            (2929, 730)
        """
        import torch
        from transformers.models.llava_onevision.modeling_llava_onevision import (
            get_anyres_image_grid_shape,
            unpad_image,
        )

        side = self.tile // self.patch
        if not tiled:
            return side * side + 1  # one crop + image_newline
        rows, cols = get_anyres_image_grid_shape([height, width], self.pinpoints, self.tile)
        # a zero-channel feature map: the model's unpad_image on shapes alone
        cur_h, cur_w = unpad_image(torch.empty(0, rows * side, cols * side), [height, width]).shape[1:]
        ratio = math.sqrt(cur_h * cur_w / (self.max_tiles * side * side))
        if ratio > 1.1:
            cur_h, cur_w = int(cur_h // ratio), int(cur_w // ratio)
        return side * side + cur_h * (cur_w + 1)  # base crop + unpadded rows, each ending in a newline

    def video_tokens(self, n_frames: int) -> int:
        """Placeholder tokens of a video of ``n_frames`` frames: each pooled 2x2 (27x27 -> 14x14), one newline.

        Example:
            >>> LlavaOnevisionInputs({"name": "llava-ov"}).video_tokens(8)
            1569
        """
        pooled = math.ceil(self.tile // self.patch / 2)
        return n_frames * pooled * pooled + 1

    # ---- processors

    def image_processor(self):
        """``transformers``' ``LlavaOnevisionImageProcessor`` with the checkpoint's settings."""
        if self._image_processor is None:
            from transformers import LlavaOnevisionImageProcessor

            self._image_processor = LlavaOnevisionImageProcessor(
                size={"height": self.tile, "width": self.tile}, image_grid_pinpoints=self.pinpoints,
                image_mean=list(self.image_mean), image_std=list(self.image_std))
        return self._image_processor

    def video_processor(self):
        """``transformers``' ``LlavaOnevisionVideoProcessor``; frames arrive already sampled."""
        if self._video_processor is None:
            from transformers import LlavaOnevisionVideoProcessor

            self._video_processor = LlavaOnevisionVideoProcessor(
                size={"height": self.tile, "width": self.tile}, do_sample_frames=False,
                image_mean=list(self.image_mean), image_std=list(self.image_std))
        return self._video_processor

    # ---- pixels

    def pixels(self, rows: Sequence[dict], media_root: str | Path | None) -> dict[str, Any]:
        """``pixel_values``, ``image_sizes``, ``batch_num_images`` and ``pixel_values_videos`` of ``rows``.

        Media are taken in token order (rows in batch order), which is the order the
        model scatters features into placeholders. Keys without media are left out.

        Raises:
            InputError: an item would not fill exactly its counted placeholders, or the
                batch's videos differ in frame count.
        """
        import torch

        groups: list[list] = []  # one list of images per sample that has images
        image_media: list[tuple[dict, dict, bool]] = []
        videos, video_media = [], []
        for r in rows:
            media = sorted(r["media"], key=lambda m: int(m["token_offset"]))
            per_sample: dict[int, int] = {}
            for m in media:
                if m["kind"] != "video":
                    k = int(m.get("sample_index", 0))
                    per_sample[k] = per_sample.get(k, 0) + 1
            current = None
            for m in media:
                if m["kind"] == "video":
                    frames = list(self.video(m, media_root).frames)
                    self._check(r, m, self.video_tokens(len(frames)), f"{len(frames)} frames")
                    videos.append(torch.stack([torch.from_numpy(np.array(f, dtype=np.uint8)).permute(2, 0, 1)
                                               for f in frames]))
                    video_media.append((r, m))
                    continue
                k = int(m.get("sample_index", 0))
                if current != k:
                    groups.append([])
                    current = k
                groups[-1].append(self.image(m, media_root))  # turned by EXIF when tokenize counted it so
                image_media.append((r, m, per_sample[k] == 1))
        kw: dict[str, Any] = {}
        if groups:
            out = self.image_processor()(images=groups, return_tensors="pt")
            crops = []
            for (r, m, tiled), size, pv in zip(image_media, out["image_sizes"], out["pixel_values"], strict=True):
                h, w = (int(x) for x in size)
                self._check(r, m, self.image_tokens(h, w, tiled),
                            f"{w}x{h} px, {'tiled' if tiled else 'one crop'}")
                # the processor pads every image to the batch's most crops; keep the real ones
                crops.append(pv[: self.image_crops(h, w) if tiled else 1])
            kw["pixel_values"] = torch.cat(crops)
            kw["image_sizes"] = out["image_sizes"]
            kw["batch_num_images"] = out["batch_num_images"]
        if videos:
            counts = sorted({len(v) for v in videos})
            if len(counts) > 1:
                where = sorted({str(r.get("pack_index", "?")) for r, _ in video_media})
                raise InputError(
                    f"packs {', '.join(where)}: videos of {counts} frames in one batch; "
                    "LlavaOnevisionForConditionalGeneration takes all videos of a batch as one (videos, frames, 3, H, W) "
                    "tensor, so their frame counts must agree. Batch such rows separately, or tokenize with a "
                    "--max-frames no larger than the shortest video's frame count"
                )
            out = self.video_processor()(videos=videos, return_tensors="pt")
            kw["pixel_values_videos"] = out["pixel_values_videos"]
        return kw

    def image_crops(self, height: int, width: int) -> int:
        """384-px crops of a tiled image: the base view plus its grid (what the model slices per image).

        Example:
            >>> LlavaOnevisionInputs({"name": "llava-ov"}).image_crops(100, 500)
            3
        """
        from transformers.models.llava_onevision.modeling_llava_onevision import (
            image_size_to_num_patches,
        )

        return int(image_size_to_num_patches([height, width], self.pinpoints, self.tile))

    def _check(self, row: dict, m: dict, got: int, what: str) -> None:
        """The model's features must fill exactly the counted placeholders: else tokens and features misalign."""
        want = int(m["n_tokens"])
        if got != want:
            sid = media_sample_id(row, m)
            raise InputError(
                f"sample {sid!r} (pack {row.get('pack_index', '?')}): the {m['kind']} {m.get('path')!r} ({what}) "
                f"gives {got} vision tokens where tokenize counted {want}; the media, the processor settings or the "
                "model's vision config changed since tokenize (re-tokenize with the settings the model uses)"
            )
