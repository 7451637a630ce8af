"""InternVL 2.5 / 3 (``InternVLForConditionalGeneration``): 1-D positions and the processors' tiles.

InternVL's language model is a plain causal Qwen2 / Llama: positions are 1-D and
restart at every sample (the packed rows' own ``position_ids``; a message tree's
branches continue their prefix), and vision tokens attend causally like text. All the
family adds is ``pixel_values``: one ``(3, 448, 448)`` tile per 256 ``<IMG_CONTEXT>``
tokens, for every image and every video frame of the batch, in the order their
placeholders appear (rows in batch order, media by token offset). The model runs the
vision tower on every tile and scatters the features into the ``<IMG_CONTEXT>``
positions in that order; there is no ``image_sizes`` or video tensor of its own
(``InternVLProcessor`` itself flattens video frames into ``pixel_values``)::

    row 0: [text <img> ctx*256*3 </img> text] [text Frame1: <img> ctx*256 </img>\\n Frame2: ...]
    row 1: [text <img> ctx*256 </img> ...]
    pixel_values: row0.image tiles 1,2,thumbnail | row0.video frame 1, frame 2 | row1.image tile

Tiles come from ``transformers``' own processors, configured with the manifest's
settings: ``GotOcr2ImageProcessor(crop_to_patches=True, max_patches=max_num)`` for
images (the grid of ``dynamic_preprocess``, plus a thumbnail when the grid has more
than one tile) and ``InternVLVideoProcessor`` for the frames ``tokenize`` counted (one
448-px tile each; never re-sampled). Both use the released checkpoints' ImageNet
normalisation and bicubic resizing.

Grid choice. packtool counts tiles with the original chat code's ``dynamic_preprocess``;
``transformers`` picks the grid with ``get_optimal_tiled_canvas``. The two build their
candidate grids in different orders (a ``set`` sorted by area against a list sorted by
area), so grids of *equal area* are visited in a different order, e.g. ``(3, 1)``
before ``(1, 3)``. The order can only matter when two equal-area grids tie for the
closest aspect ratio, and that never happens: grids ``c1 x r1`` and ``c2 x r2`` of equal
area with ``c1 < c2`` tie only for the aspect halfway between them, where the smaller
grid ``c1 x r2`` lies strictly closer. So both pick the same grid for every image size
and every ``max_num``; :meth:`InternVLInputs.pixels` still checks each image's grid
and tile count against the counted ones and raises rather than feed misaligned tiles.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ConfigError, InputError
from ...vision.internvl import InternVL
from . import FamilyInputs, media_sample_id

__all__ = ["InternVLInputs"]

# the released checkpoints' processor settings (OpenGVLab/InternVL3-*-hf preprocessor_config.json)
_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)
_DEFAULT_MAX_NUM = 12


class InternVLInputs(FamilyInputs):
    """InternVL 2.5 / 3 (``InternVLForConditionalGeneration``): ``pixel_values`` for every tile and frame.

    Positions are the rows' 1-D ``position_ids`` and the mask is the causal packed mask
    (:func:`packtool.reader.hf.model_inputs` builds both); this class adds the tiles.

    Example:
        >>> fam = InternVLInputs({"name": "internvl", "max_num": 6, "max_frames": 8, "exif": "ignore"})
        >>> fam.image_processor().max_patches, fam.tile, fam.tokens_per_tile
        (6, 448, 256)
    """

    name = "internvl"
    model_class = "InternVLForConditionalGeneration"
    tile = InternVL.tile
    tokens_per_tile = InternVL.tokens_per_tile
    placeholder_ids = True

    def __init__(self, vision: dict, config: Any = None) -> None:
        super().__init__(vision, config)
        self.max_num = int(self.vision.get("max_num") or _DEFAULT_MAX_NUM)
        self._image_processor = None
        self._video_processor = None
        if config is not None:
            self._check_config(config)

    def _check_config(self, config: Any) -> None:
        """The model must take 448-px tiles of 256 tokens: what ``tokenize`` laid out."""
        vc = getattr(config, "vision_config", None)
        if vc is None:
            return
        size = getattr(vc, "image_size", self.tile)
        patch = getattr(vc, "patch_size", 14)
        size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
        patch = tuple(patch) if isinstance(patch, (list, tuple)) else (patch, patch)
        ratio = float(getattr(config, "downsample_ratio", 0.5))
        per_tile = int(round((size[0] // patch[0]) * (size[1] // patch[1]) * ratio * ratio))
        if size != (self.tile, self.tile) or per_tile != self.tokens_per_tile:
            raise ConfigError(
                f"the model takes {size[0]}x{size[1]} tiles of {per_tile} tokens, but packs of --model internvl are "
                f"laid out for {self.tile}x{self.tile} tiles of {self.tokens_per_tile} tokens; use a model with "
                "InternVL's 448-px vision tower (patch 14, downsample_ratio 0.5)"
            )

    def check_token_ids(self, rows: Sequence[dict]) -> None:
        """With a model config: every media span, image or video, starts with the config's ``image_token_id``.

        InternVL has no video token: video frames are ``<IMG_CONTEXT>`` runs like image tiles.
        """
        want = getattr(self.config, "image_token_id", None) if self.config is not None else None
        if not isinstance(want, int):
            return
        for r in rows:
            for m in r["media"]:
                got = int(r["input_ids"][int(m["token_offset"])])
                if got != want:
                    raise InputError(
                        f"pack {r.get('pack_index', '?')}: its {m['kind']} placeholders are token {got} but the model's "
                        f"image_token_id (<IMG_CONTEXT>) is {want}; the packs were tokenized with another tokenizer "
                        "than this checkpoint's (re-tokenize with --tokenizer pointing at the checkpoint)"
                    )

    # ---- processors

    def image_processor(self):
        """``GotOcr2ImageProcessor`` cutting ``max_num`` tiles at most (plus a thumbnail), as the checkpoints do."""
        if self._image_processor is None:
            from transformers import GotOcr2ImageProcessor

            self._image_processor = GotOcr2ImageProcessor(
                size={"height": self.tile, "width": self.tile}, crop_to_patches=True, min_patches=1,
                max_patches=self.max_num, image_mean=list(_IMAGENET_MEAN), image_std=list(_IMAGENET_STD))
        return self._image_processor

    def video_processor(self):
        """``InternVLVideoProcessor``: each given frame resized to one 448-px tile, no frame sampling."""
        if self._video_processor is None:
            from transformers import InternVLVideoProcessor

            self._video_processor = InternVLVideoProcessor(
                size={"height": self.tile, "width": self.tile}, do_sample_frames=False,
                image_mean=list(_IMAGENET_MEAN), image_std=list(_IMAGENET_STD))
        return self._video_processor

    # ---- pixels

    def pixels(self, rows: Sequence[dict], media_root: str | Path | None) -> dict[str, Any]:
        """``{"pixel_values": (tiles, 3, 448, 448)}`` for every image tile and video frame of ``rows``, in token order.

        Raises:
            InputError: an item whose tiles or ``<IMG_CONTEXT>`` tokens are not the counted
                ones (the message names the sample and the pack).
        """
        import torch

        items: list[tuple[dict, dict]] = []
        images: list = []
        for r in rows:
            for m in sorted(r["media"], key=lambda m: int(m["token_offset"])):
                items.append((r, m))
                if m["kind"] != "video":
                    images.append(self._image(r, m, media_root))
        if not items:
            return {}
        image_tiles: list = []
        if images:
            out = self.image_processor()(images=images, return_tensors="pt")
            counts = [int(n) for n in out["num_patches"]]
            image_tiles = list(torch.split(out["pixel_values"], counts))
        parts = []
        k = 0
        for r, m in items:
            if m["kind"] == "video":
                frames = list(self.video(m, media_root).frames)
                tiles = self.video_processor()(videos=[frames], return_tensors="pt")["pixel_values_videos"][0]
            else:
                tiles = image_tiles[k]
                k += 1
            self._check(r, m, int(tiles.shape[0]))
            parts.append(tiles)
        return {"pixel_values": torch.cat(parts)}

    def _image(self, row: dict, m: dict, media_root: str | Path | None):
        """The decoded image, oriented as ``tokenize`` measured it, with its grid checked against the counted one."""
        from transformers.models.got_ocr2.image_processing_got_ocr2 import get_optimal_tiled_canvas

        # turned before transparency is laid over white: the composite keeps no EXIF to turn by
        im = self.image(m, media_root)
        want = (int(m["resized_width"]) // self.tile, int(m["resized_height"]) // self.tile)
        got = get_optimal_tiled_canvas((im.height, im.width), (self.tile, self.tile), 1, self.max_num)
        if (im.width, im.height) != (int(m["width"]), int(m["height"])) or tuple(got) != want:
            raise InputError(
                f"sample {media_sample_id(row, m)!r} (pack {row.get('pack_index', '?')}): the image decodes to "
                f"{im.width}x{im.height} and GotOcr2ImageProcessor(max_patches={self.max_num}) cuts a "
                f"{got[0]}x{got[1]} grid, where tokenize counted {m['width']}x{m['height']} and a {want[0]}x{want[1]} "
                "grid; the media or --max-num / --exif changed since tokenize (re-tokenize with the model's settings)"
            )
        return im

    def _check(self, row: dict, m: dict, n_tiles: int) -> None:
        """Tiles and ``<IMG_CONTEXT>`` tokens must be the counted ones, else features would land on the wrong tokens."""
        ids = np.asarray(row["input_ids"])
        start, n = int(m["token_offset"]), int(m["n_tokens"])
        span = ids[start:start + n]
        n_context = int(np.count_nonzero(span == span[0])) if n else 0
        units = int(m["vision_units"])
        if n_tiles != units or n_context != units * self.tokens_per_tile:
            raise InputError(
                f"sample {media_sample_id(row, m)!r} (pack {row.get('pack_index', '?')}): the {self.name} processor makes "
                f"{n_tiles} tiles ({n_tiles * self.tokens_per_tile} tokens) for the {m['kind']} at token {start}, "
                f"where tokenize counted {units} tiles and laid out {n_context} placeholder tokens; the media or the "
                "processor settings changed since tokenize, or the pack is for another --model"
            )

