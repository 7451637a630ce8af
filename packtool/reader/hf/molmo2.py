"""Molmo2: the processors' crops and pooling indices, and the image-token attention blocks.

How ``Molmo2ForConditionalGeneration`` turns media into features:

1. the vision tower encodes every 378-px **crop** on its own as 27x27 = 729 patches: an
   image is a global crop plus its overlapping tiles, a video frame is one crop;
2. the adapter makes one feature per **pooling row**: ``image_token_pooling[k]`` lists
   the patches (2x2 for images, 3x3 for video frames; ``-1`` pads) that feature ``k``
   pools, as indices into the patches of *all crops of the forward pass laid end to
   end* (patch ``p`` of crop ``c`` is ``c * 729 + p``); rows with no valid index are
   dropped;
3. feature ``k`` is added to the ``k``-th ``<im_patch>`` embedding of the batch (rows in
   batch order, tokens in row order).

So when media of several samples and rows share one forward pass, each item's indices
must be shifted by the patches of every crop before it; without the shift every item
after the first pools the first item's patches (the count still matches, so nothing
fails, the features are just wrong)::

    item (row order)   crops   its patches   its pooling rows
    image A (row 0)    5       0 .. 3644     as processed, + 0
    video B (row 0)    3       3645 .. 5831  as processed, + 3645
    image C (row 1)    2       5832 .. 7289  as processed, + 5832

The processors (``Molmo2ImageProcessor``, ``Molmo2VideoProcessor``) are configured with
what ``tokenize`` counted with: ``max_crops`` from the manifest, the crop size, patch
size, overlap margins and pooling of :class:`packtool.vision.molmo2.Molmo2`. Videos are
the frames packed at the counted timestamps (``decode_video``), never re-sampled: the
video processor's own sampler (64 frames by default, ``arange(0, n, n / k)``, no last
frame) is not the released ``uniform_last_frame`` one that ``tokenize`` counts with, so
it is switched off (``do_sample_frames=False``). Each
item must give exactly as many features as it has ``<im_patch>`` tokens in its span
(else :class:`~packtool.errors.InputError` names the sample and pack).

Images and videos in one batch: the model refuses ``pixel_values`` and
``pixel_values_videos`` together, but its video path *is* its image path, with the
grid ``(frames * rows, cols, 0, 0)``. A batch holding both therefore passes its videos
through the image arguments, in row order (video pooling rows are 3x3 = 9 wide, image
rows 2x2 = 4: the image rows are padded with ``-1``, which the adapter masks out).

Attention: given ``mm_token_type_ids`` (the processor returns them; the model requires
them in training), the model makes every *image token* of a sequence attend to every
other one in both directions (``block_sequence_ids`` 0 for all of them). Image tokens
are the ids ``<im_patch>``, ``<im_col>``, ``<im_start>``, ``<low_res_im_start>``,
``<im_end>``, ``<frame_start>``, ``<frame_end>``: an image's whole layout from its
``<low_res_im_start>`` to its last ``<im_end>``, and a video's frames with their markers
but *not* the timestamp text between frames. The block spans all media of the sequence
(a multi-image sample is one block), so in a packed row it is one block per sample
(:meth:`Molmo2Inputs.vision_blocks`). Media spans (``vision="sample"``) cannot say
this: they miss the tokens around the first and last patch and would open up the
timestamps.

Positions are 1-D (plain RoPE restarting per sample): the rows' ``position_ids``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import InputError
from ...schema import PREFIX_SUBSEGMENT, SUBSEGMENT_STRIDE
from ...vision.molmo2 import Molmo2
from . import FamilyInputs, media_sample_id

__all__ = ["Molmo2Inputs", "image_token_spans"]


def _pad_runs(ids: np.ndarray, start: int, n: int) -> list[tuple[int, int]]:
    """``(start, end)`` runs of the item's ``<im_patch>`` id inside its span (the span starts with one)."""
    span = ids[start:start + n]
    is_pad = span == span[0]
    edges = np.flatnonzero(np.diff(np.concatenate([[0], is_pad.astype(np.int8), [0]])))
    return [(start + int(a), start + int(b)) for a, b in zip(edges[0::2], edges[1::2], strict=True)]


def image_token_spans(row: dict) -> list[tuple[int, int]]:
    """``(start, end)`` spans of a row's Molmo2 *image tokens* (what the processor marks ``mm_token_type_ids == 1``).

    A media item's ``token_offset``/``n_tokens`` run from its first ``<im_patch>`` to its
    last; the layout (:class:`packtool.vision.molmo2.Molmo2`) puts one structure token
    before that and, for an image, two after it::

        image: <low_res_im_start> [patches ... <im_end><im_start> ... patches] <im_col><im_end>
        video: "0.0 " <frame_start> [patches <frame_end> " 0.5 " <frame_start> patches] <frame_end>

    so an image is ``[offset - 1, offset + n + 2)`` and a video frame is its pad run with
    one marker on each side (the timestamp text is ordinary text).

    Example:
        >>> row = {"input_ids": [9, 5, 7, 7, 3, 4, 7, 1, 3, 8], "media": [
        ...     {"kind": "image", "token_offset": 2, "n_tokens": 5}]}
        >>> image_token_spans(row)
        [(1, 9)]
    """
    ids = np.asarray(row["input_ids"])
    out = []
    for m in row["media"]:
        off, n = int(m["token_offset"]), int(m["n_tokens"])
        if m["kind"] == "video":
            out.extend((s - 1, e + 1) for s, e in _pad_runs(ids, off, n))
        else:
            out.append((off - 1, off + n + 2))
    if any(s < 0 or e > len(ids) for s, e in out):
        raise InputError(f"pack {row.get('pack_index', '?')}: a media span runs past the row's tokens; "
                         "was it packed for another --model than molmo2?")
    return out


class Molmo2Inputs(FamilyInputs):
    """Molmo2 (``Molmo2ForConditionalGeneration``): crops, pooling indices and image-token blocks.

    Keyword arguments added to :func:`packtool.reader.hf.model_inputs`' output:

    * images only: ``pixel_values`` ``(crops, 729, 588)``, ``image_token_pooling``
      ``(features, 4)``, ``image_grids`` ``(images, 4)`` (low-res rows, cols, high-res
      rows, cols), ``image_num_crops``;
    * videos only: ``pixel_values_videos`` ``(frames, 729, 588)``,
      ``video_token_pooling`` ``(features, 9)``, ``video_grids`` ``(videos, 3)``;
    * both: the image arguments, videos folded in (see the module docstring);
    * always ``mm_token_type_ids`` ``(B, L)``: 1 on image tokens, as the processor makes it.
    """

    name = "molmo2"
    model_class = "Molmo2ForConditionalGeneration"
    # the bidirectional blocks are token sets, not media spans: see vision_blocks
    vision_attention = "causal"
    # the class refuses flash attention (it would drop the bidirectional image block)
    attn_implementations = ("sdpa", "eager", "flex_attention")
    # image and video spans start with <im_patch>, the config's image_token_id and video_token_id
    placeholder_ids = True

    def __init__(self, vision: dict, config: Any = None) -> None:
        super().__init__(vision, config)
        self.layout = Molmo2(max_crops=int(self.vision.get("max_crops", 8)),
                             max_frames=int(self.vision.get("max_frames", 128)),
                             single_crop_col_tokens=bool(self.vision.get("single_crop_col_tokens", False)))
        self._image_processor = None
        self._video_processor = None

    # ---- processors, with the settings tokenize counted with

    def _processor_kwargs(self, pool: int) -> dict:
        lay = self.layout
        return {"size": {"height": lay.crop, "width": lay.crop}, "patch_size": lay.patch, "pooling_size": [pool, pool]}

    def image_processor(self):
        """``Molmo2ImageProcessor`` with the manifest's ``max_crops`` and the counted crop geometry."""
        if self._image_processor is None:
            from transformers import Molmo2ImageProcessor

            self._image_processor = Molmo2ImageProcessor(max_crops=self.layout.max_crops,
                                                         overlap_margins=list(self.layout.margins),
                                                         **self._processor_kwargs(self.layout.pool))
        return self._image_processor

    def video_processor(self):
        """``Molmo2VideoProcessor`` that takes the packed frames as they are (no frame sampling)."""
        if self._video_processor is None:
            from transformers import Molmo2VideoProcessor

            self._video_processor = Molmo2VideoProcessor(do_sample_frames=False,
                                                         **self._processor_kwargs(self.layout.video_pool))
        return self._video_processor

    # ---- pixels

    def pixels(self, rows: Sequence[dict], media_root: str | Path | None) -> dict[str, Any]:
        import torch

        items = [(r, m) for r in rows for m in sorted(r["media"], key=lambda m: int(m["token_offset"]))]
        if not items:
            return {}
        images = [self.image(m, media_root) for _, m in items if m["kind"] != "video"]
        videos = [self._video(m, media_root) for _, m in items if m["kind"] == "video"]
        image_pieces = self._split(self.image_processor()(images=images, return_tensors="pt"), "image") if images else []
        video_pieces = self._split(self.video_processor()(videos=videos, return_tensors="pt"), "video") if videos else []

        # every item's pieces in row order, its pooling indices shifted past the crops before it
        pieces = []
        it_images, it_videos = iter(image_pieces), iter(video_pieces)
        for r, m in items:
            piece = next(it_videos) if m["kind"] == "video" else next(it_images)
            self._check(r, m, piece)
            pieces.append(piece)
        crops, pooling, offset = [], [], 0
        for pix, pool, _ in pieces:
            pooling.append(torch.where(pool >= 0, pool + offset, pool))
            crops.append(pix)
            offset += pix.shape[0] * pix.shape[1]
        if not images:
            return {"pixel_values_videos": torch.cat(crops), "video_token_pooling": torch.cat(pooling),
                    "video_grids": torch.stack([grid for _, _, grid in pieces])}
        width = max(p.shape[1] for p in pooling)
        pooling = [torch.nn.functional.pad(p, (0, width - p.shape[1]), value=-1) for p in pooling]
        grids = []
        for (_, m), (_, _, grid) in zip(items, pieces, strict=True):
            if m["kind"] == "video":  # the model's own video -> image grid (get_video_features)
                grid = torch.stack([grid[0] * grid[1], grid[2], grid.new_zeros(()), grid.new_zeros(())])
            grids.append(grid)
        return {"pixel_values": torch.cat(crops), "image_token_pooling": torch.cat(pooling),
                "image_grids": torch.stack(grids),
                "image_num_crops": torch.tensor([p.shape[0] for p, _, _ in pieces], dtype=torch.int64)}

    def _video(self, m: dict, media_root):
        import torch

        frames = self.video(m, media_root).frames
        return torch.stack([torch.from_numpy(np.array(f, dtype=np.uint8)).permute(2, 0, 1) for f in frames])

    @staticmethod
    def _split(out, kind: str) -> list:
        """A processor output as ``(crops, pooling rows with item-local indices, grid)`` per item."""
        import torch

        if kind == "image":
            pix, pool, grids = out["pixel_values"], out["image_token_pooling"], out["image_grids"]
            n_crops = out["image_num_crops"].tolist()
            n_rows = (grids[:, 0] * grids[:, 1] + grids[:, 2] * grids[:, 3]).tolist()
        else:
            pix, pool, grids = out["pixel_values_videos"], out["video_token_pooling"], out["video_grids"]
            n_crops = grids[:, 0].tolist()
            n_rows = (grids[:, 0] * grids[:, 1] * grids[:, 2]).tolist()
        per_crop = pix.shape[1]
        first = np.concatenate([[0], np.cumsum(n_crops)[:-1]]) * per_crop
        return [(p, torch.where(q >= 0, q - int(f), q), g)
                for p, q, g, f in zip(torch.split(pix, n_crops), torch.split(pool, n_rows), grids, first, strict=True)]

    def _check(self, row: dict, m: dict, piece) -> None:
        """The processor must give the counted grid and one feature per ``<im_patch>`` of the item's span."""
        _, pool, grid = piece
        ids = np.asarray(row["input_ids"])
        off, n = int(m["token_offset"]), int(m["n_tokens"])
        n_pads = int(np.count_nonzero(ids[off:off + n] == ids[off])) if n else 0
        n_features = int((pool >= 0).any(-1).sum())
        g = [int(x) for x in grid]
        got = (g[0], g[1], g[2]) if m["kind"] == "video" else (1, g[2], g[3])
        want = (int(m["grid_t"]), int(m["grid_h"]), int(m["grid_w"]))
        if n_features != n_pads or got != want:
            sid = media_sample_id(row, m)
            raise InputError(
                f"sample {sid!r} (pack {row.get('pack_index', '?')}): the molmo2 processor makes {n_features} "
                f"{m['kind']} features (grid {got}) where tokenize counted {n_pads} <im_patch> tokens (grid {want}); "
                "the media or the processor settings (--max-crops) changed since tokenize: re-tokenize with the "
                "settings the model uses"
            )

    # ---- mask and token types

    def _image_tokens(self, rows: Sequence[dict], width: int) -> np.ndarray:
        out = np.zeros((len(rows), width), dtype=bool)
        for i, r in enumerate(rows):
            for s, e in image_token_spans(r):
                out[i, s:e] = True
        return out

    def vision_blocks(self, rows: Sequence[dict], width: int) -> np.ndarray:
        """Block 0 on every image token; the core keeps blocks inside their sample (one block per sample).

        Raises:
            InputError: a tree whose image tokens are not all in its shared prefix (a
                branch cannot see what the model would let the prefix see of it).
        """
        is_image = self._image_tokens(rows, width)
        for i, r in enumerate(rows):
            sub = np.asarray(r["subsegment_ids"], dtype=np.int64)
            in_branch = is_image[i, :len(sub)] & (sub % SUBSEGMENT_STRIDE != PREFIX_SUBSEGMENT)
            if in_branch.any():
                raise InputError(f"pack {r.get('pack_index', '?')}: image tokens inside a branch of a message tree at "
                                 f"token {int(np.argmax(in_branch))}; Molmo2 media must lie in the shared prefix")
        return np.where(is_image, 0, -1)

    def extra(self, rows: Sequence[dict], batch: dict[str, np.ndarray]) -> dict[str, Any]:
        import torch

        types = self._image_tokens(rows, batch["input_ids"].shape[1]).astype(np.int64)
        return {"mm_token_type_ids": torch.from_numpy(types)}
