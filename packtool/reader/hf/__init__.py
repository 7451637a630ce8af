"""Packed rows as the exact keyword arguments of a ``transformers`` model class (``pip install packtool[hf]``).

A packed row is right only if the real model, fed from it, computes what it computes
for each sample alone (DESIGN.md §3.5). Three things differ per model family and per
attention implementation, and this module owns them so trainers need no glue:

* **positions**: 1-D restarting at every sample, or Qwen-VL's 3-D mRoPE computed per
  sample and per branch of a message tree (each branch continues its prefix);
* **pixels**: the model's own pixel inputs, made by the family's ``transformers``
  processor with the settings ``tokenize`` counted with (read from the manifest);
* **the mask**, in the form the attention implementation reads::

      attn_implementation   attention_mask                     trees
      sdpa                  (B, 1, L, L) bool, True = attend   yes
      eager                 (B, 1, L, L) float, 0 or -inf-ish  yes
      flex_attention        a BlockMask from subsegment_ids    yes
      flash_attention_2/3   none: rows laid end to end (B=1),  no (refused)
                            position_ids restart per sample

One call::

    from packtool.reader import PackedDataset
    from packtool.reader.hf import model_inputs

    ds = PackedDataset("packed/", seed=0)
    rows = [next(iter(ds))]
    out = model(**model_inputs(rows, attn_implementation="sdpa"))
    out.loss.backward()     # mean over loss tokens (num_items_in_batch)

The family and its processor settings come from the packed manifest (every
``PackedDataset`` row carries them as ``row["vision"]``), never from the caller.
The returned dict holds ``labels`` and ``shift_labels`` (the pre-shifted
``target_ids``: nothing is predicted across a sample or branch boundary),
``num_items_in_batch`` (loss tokens of these rows, so the loss is a sum over tokens
divided by that count; pass the total of a gradient-accumulation step instead with
``num_items_in_batch=``) and ``use_cache=False`` (a cache built during training
would let samples see each other).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ConfigError, InputError
from ...schema import PREFIX_SUBSEGMENT, SUBSEGMENT_STRIDE
from .. import (
    IGNORE_INDEX,
    VideoFrames,
    _has_trees,
    attention_mask,
    collate,
    decode_image,
    decode_video,
)

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "FamilyInputs",
    "model_inputs",
    "get_family_inputs",
    "loss_tokens",
    "eager_mask",
    "block_mask",
    "sample_spans",
    "media_sample_id",
]

#: The attention implementations :func:`model_inputs` builds inputs for.
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")
_VARLEN = ("flash_attention_2", "flash_attention_3")

# family name (manifest "vision"."name") -> "module:class" of its FamilyInputs
_FAMILIES = {
    "qwen2-vl": "qwen:Qwen2VLInputs",
    "qwen2.5-vl": "qwen:Qwen25VLInputs",
    "qwen3-vl": "qwen:Qwen3VLInputs",
    "llava-ov": "llava_ov:LlavaOnevisionInputs",
    "internvl": "internvl:InternVLInputs",
    "molmo2": "molmo2:Molmo2Inputs",
}


class FamilyInputs:
    """What one model family adds to a packed batch. Subclasses live in this package.

    Attributes:
        name: the family (``tokenize --model``).
        model_class: the ``transformers`` class these inputs are for.
        vision_attention: how the model lets vision tokens attend, as
            :func:`packtool.reader.attention_mask` ``vision=`` (``"causal"``: like text).
        attn_implementations: the forms the model class accepts (``transformers``
            refuses flex attention for some classes).
        placeholder_ids: media spans start with the config's image / video token id.
    """

    name = ""
    model_class = ""
    vision_attention = "causal"
    attn_implementations: tuple[str, ...] = ATTN_IMPLEMENTATIONS
    #: media spans start with the config's ``image_token_id`` / ``video_token_id`` (checked by
    #: :meth:`check_token_ids` when a config is given)
    placeholder_ids = False

    def __init__(self, vision: dict, config: Any = None) -> None:
        self.vision = dict(vision)
        #: the model's ``transformers`` config when the caller passed one (token ids, merge sizes, ...)
        self.config = config

    def image(self, m: dict, media_root: str | Path | None):
        """One image decoded as ``tokenize`` measured it (EXIF orientation applied when the manifest says so)."""
        return decode_image(m, media_root, exif=self.vision.get("exif") == "apply")

    def video(self, m: dict, media_root: str | Path | None) -> VideoFrames:
        """One video's counted frames, turned by its display rotation when the manifest says tokenize applied it."""
        setting = self.vision.get("exif")
        return decode_video(m, media_root, exif=None if setting is None else setting == "apply")

    def positions(self, rows: Sequence[dict], width: int) -> np.ndarray | None:
        """Position ids of ``rows`` padded to ``width``, or ``None`` for the rows' 1-D ``position_ids``."""
        return None

    def pixels(self, rows: Sequence[dict], media_root: str | Path | None) -> dict[str, Any]:
        """The model's vision keyword arguments for ``rows`` (media in row order, rows in batch order)."""
        return {}

    def extra(self, rows: Sequence[dict], batch: dict[str, np.ndarray]) -> dict[str, Any]:
        """Other per-family keyword arguments (token type ids and the like)."""
        return {}

    def check_token_ids(self, rows: Sequence[dict]) -> None:
        """With a model config: each media span must start with the model's placeholder id.

        Packs tokenized with another tokenizer than the checkpoint's would otherwise fail
        deep inside the model ("features and tokens do not match") or, worse, not at all.
        """
        if self.config is None or not self.placeholder_ids:
            return
        want = {kind: _config_id(self.config, kind) for kind in ("image", "video")}
        for r in rows:
            ids = r["input_ids"]
            for m in r["media"]:
                expected = want.get(m["kind"])
                got = int(ids[int(m["token_offset"])])
                if expected is not None and got != expected:
                    raise InputError(
                        f"pack {r.get('pack_index', '?')}: its {m['kind']} placeholders are token {got} but the model's "
                        f"{m['kind']}_token_id is {expected}; the packs were tokenized with another tokenizer than this "
                        "checkpoint's (re-tokenize with --tokenizer pointing at the checkpoint)"
                    )


    # -- molmo2 addition: vision blocks defined per token rather than per media span
    def vision_blocks(self, rows: Sequence[dict], width: int) -> np.ndarray | None:
        """``(B, width)`` block id per token for models whose bidirectional vision blocks are token sets, or ``None``.

        Some models (Molmo2) let a set of *tokens* attend each other both ways (every
        image or frame token of a sequence, structure tokens included, timestamp text
        between frames excluded), which media spans cannot express. Tokens with the same
        id ``>= 0`` in the same sample attend each other in both directions, on top of
        the causal rule; ``-1`` marks tokens outside every block. ``None``: the spans
        of :attr:`vision_attention` apply.
        """
        return None


def media_sample_id(row: dict, m: dict) -> str:
    """The id of the sample a media item of a packed row belongs to (for error messages).

    Example:
        >>> media_sample_id({"sample_ids": ["a", "b"]}, {"sample_index": 1})
        'b'
    """
    ids = row.get("sample_ids") or []
    k = int(m.get("sample_index", 0))
    return ids[k] if 0 <= k < len(ids) else "?"


def _config_id(config: Any, kind: str) -> int | None:
    for name in (f"{kind}_token_id", f"{kind}_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def get_family_inputs(vision: dict, config: Any = None) -> FamilyInputs:
    """The :class:`FamilyInputs` of a manifest's ``vision`` settings.

    Raises:
        ConfigError: the family has no ``transformers`` inputs here (``fixed:N``).
    """
    name = str(vision.get("name", ""))
    spec = _FAMILIES.get(name)
    if spec is None:
        raise ConfigError(
            f"packs of --model {name!r} have no transformers model class here; model_inputs supports "
            f"{', '.join(_FAMILIES)} (use packtool.reader.collate and attention_mask for other models)"
        )
    module, cls = spec.split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)(vision, config)


def loss_tokens(rows: Sequence[dict]) -> int:
    """Tokens that carry loss in ``rows`` (``target_ids != -100``): the ``num_items_in_batch`` of a step.

    Example:
        >>> loss_tokens([{"target_ids": [5, -100, 7]}, {"target_ids": [-100]}])
        2
    """
    return int(sum(int(np.count_nonzero(np.asarray(r["target_ids"]) != IGNORE_INDEX)) for r in rows))


def sample_spans(row: dict) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """The samples of a packed row: ``(start, prefix_end, branches)`` with ``branches`` as ``(start, end)``.

    A one-branch sample is all prefix (``branches`` empty). Branches follow their
    prefix in the row, in order.

    Example:
        >>> sample_spans({"cu_seqlens": [0, 2, 7], "subsegment_ids": [10000, 10000, 110000, 110000, 100000, 100001, 100001]})
        [(0, 2, []), (2, 4, [(4, 5), (5, 7)])]
    """
    sub = np.asarray(row["subsegment_ids"], dtype=np.int64)
    cu = np.asarray(row["cu_seqlens"], dtype=np.int64)
    out = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        local = sub[s:e] % SUBSEGMENT_STRIDE
        is_branch = local != PREFIX_SUBSEGMENT
        p = s + (int(np.argmax(is_branch)) if is_branch.any() else e - s)
        branches = []
        if p < e:
            change = np.flatnonzero(np.diff(local[p - s:])) + 1
            bounds = [p, *(p + change).tolist(), e]
            branches = list(zip(bounds[:-1], bounds[1:], strict=True))
        out.append((s, p, branches))
    return out


def eager_mask(allowed: np.ndarray, dtype=None):
    """An additive float mask for ``attn_implementation="eager"``: 0 where allowed, the dtype's minimum elsewhere.

    Eager attention *adds* the mask to the scores, so a boolean mask there is silently
    wrong (True adds 1, False adds 0); this is the form it needs.
    """
    import torch

    dtype = dtype or torch.float32
    allowed_t = torch.from_numpy(np.ascontiguousarray(allowed))
    out = torch.zeros(allowed_t.shape, dtype=dtype)
    return out.masked_fill_(~allowed_t, torch.finfo(dtype).min)


def block_mask(subsegment_ids: np.ndarray, *, media: Sequence[Sequence[dict]] | None = None, vision: str = "causal",
               block_size: int = 128, device: str = "cpu", blocks: np.ndarray | None = None):
    """A flex-attention ``BlockMask`` for a ``(B, L)`` batch of subsegment ids (padding: ``PAD_SUBSEGMENT``, -1).

    The rule is the one of :func:`packtool.reader.attention_mask`. No dense ``L x L``
    mask is ever built: each ``block_size`` tile is classified from per-block summaries
    (empty: other samples or above the diagonal; full: one sample and one subsegment on
    each side, keys before queries), and only tiles on the diagonal or across a
    sample, branch or image boundary are evaluated exactly. At 16,384 tokens the mask
    is a few hundred KiB of block indices instead of 268 MB of booleans.

    Example:
        >>> bm = block_mask(np.array([[10000] * 200 + [110000] * 56]))
        >>> bm.shape, bm.to_dense()[0, 0].tolist()   # block 1 starts inside sample 0, so it sees block 0
        ((1, 1, 256, 256), [[1, 0], [1, 1]])
    """
    import torch

    sub_np = np.asarray(subsegment_ids, dtype=np.int64)
    b, length = sub_np.shape
    # padding forms its own sample; a large id keeps sample ids ascending along the row
    sample_np = np.where(sub_np >= 0, sub_np // SUBSEGMENT_STRIDE, np.int64(1) << 40)
    groups_np = np.full((b, length), -1, dtype=np.int64)
    if blocks is not None:  # molmo2 addition: token blocks (FamilyInputs.vision_blocks) replace media spans
        groups_np = np.asarray(blocks, dtype=np.int64)
    elif vision != "causal":
        if media is None:
            raise ConfigError(f"vision={vision!r} needs the rows' media lists")
        for i, items in enumerate(media):
            for j, m in enumerate(items):
                key = j if vision == "media" else int(m.get("sample_index", 0))
                start = int(m["token_offset"])
                groups_np[i, start:start + int(m["n_tokens"])] = key
    nb = -(-length // block_size)
    kv_num, kv_idx, full_num, full_idx = (np.zeros((b, 1, nb), np.int32), np.zeros((b, 1, nb, nb), np.int32),
                                          np.zeros((b, 1, nb), np.int32), np.zeros((b, 1, nb, nb), np.int32))
    for i in range(b):
        kind = _classify_blocks(sample_np[i], sub_np[i], groups_np[i], block_size)
        for q in range(nb):
            part, full = np.flatnonzero(kind[q] == 1), np.flatnonzero(kind[q] == 2)
            kv_num[i, 0, q], full_num[i, 0, q] = len(part), len(full)
            kv_idx[i, 0, q, :len(part)] = part
            full_idx[i, 0, q, :len(full)] = full

    sub = torch.as_tensor(sub_np, device=device)
    sample = torch.as_tensor(sample_np, device=device)
    groups = torch.as_tensor(groups_np, device=device) if vision != "causal" or blocks is not None else None

    def t(a):
        return torch.as_tensor(a, device=device)

    return _block_mask_class().from_kv_blocks(t(kv_num), t(kv_idx), t(full_num), t(full_idx), BLOCK_SIZE=block_size,
                                    mask_mod=SubsegmentMaskMod(sub, sample, groups), seq_lengths=(length, length))


class SubsegmentMaskMod:
    """The ``mask_mod`` of :func:`block_mask`: the attention rule over ``(B, L)`` id tensors.

    A module-level callable rather than a closure, so a ``BlockMask`` made in a DataLoader
    worker pickles to the training process.
    """

    def __init__(self, sub, sample, groups=None) -> None:
        self.sub, self.sample, self.groups = sub, sample, groups

    def to(self, device) -> SubsegmentMaskMod:
        """The same rule reading its id tensors on ``device``."""
        return SubsegmentMaskMod(self.sub.to(device), self.sample.to(device),
                                 None if self.groups is None else self.groups.to(device))

    def __call__(self, bi, h, q, k):
        same = self.sample[bi, q] == self.sample[bi, k]
        allowed = (k <= q) & (self.sub[bi, q] <= self.sub[bi, k]) & same
        if self.groups is not None:
            g = self.groups
            allowed = allowed | (same & (g[bi, q] >= 0) & (g[bi, q] == g[bi, k]))
        return allowed


_BLOCK_MASK_CLASS = None


def _block_mask_class():
    """``PackedBlockMask``: a flex-attention ``BlockMask`` whose ``.to(device)`` also moves the id
    tensors its ``mask_mod`` reads. ``BlockMask.to`` moves only the block indices, so a mask built on
    the CPU (in a DataLoader worker, where CUDA cannot be used) and moved to the GPU by the trainer
    (``batch["attention_mask"].to("cuda")``, or accelerate's ``send_to_device``) would hand the
    kernel a ``mask_mod`` indexing CPU tensors."""
    global _BLOCK_MASK_CLASS
    if _BLOCK_MASK_CLASS is None:
        from torch.nn.attention.flex_attention import BlockMask

        class PackedBlockMask(BlockMask):
            def to(self, device):
                moved = super().to(device)
                moved.__class__ = PackedBlockMask
                if isinstance(moved.mask_mod, SubsegmentMaskMod):
                    moved.mask_mod = moved.mask_mod.to(device)
                return moved

        PackedBlockMask.__module__, PackedBlockMask.__qualname__ = __name__, "PackedBlockMask"
        globals()["PackedBlockMask"] = _BLOCK_MASK_CLASS = PackedBlockMask
    return _BLOCK_MASK_CLASS


def __getattr__(name: str):
    if name == "PackedBlockMask":  # made on first use: importing this module does not import torch
        return _block_mask_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _classify_blocks(sample: np.ndarray, sub: np.ndarray, groups: np.ndarray, bs: int) -> np.ndarray:
    """``(nb, nb)`` tile kinds of one row: 0 empty, 1 partial, 2 full (query block, key block)."""
    length = len(sub)
    nb = -(-length // bs)
    pad = nb * bs - length
    # positions past the row: a sample of their own that nothing attends
    s = np.concatenate([sample, np.full(pad, -1, np.int64)]).reshape(nb, bs)
    u = np.concatenate([sub, np.full(pad, -1, np.int64)]).reshape(nb, bs)
    g = np.concatenate([groups, np.full(pad, -1, np.int64)]).reshape(nb, bs)
    valid = np.concatenate([np.ones(length, bool), np.zeros(pad, bool)]).reshape(nb, bs)
    smin, smax = np.where(valid, s, np.iinfo(np.int64).max).min(1), np.where(valid, s, -1).max(1)
    umin, umax = u.min(1), u.max(1)
    vis = (g >= 0).any(1)
    const = (smin == smax) & (umin == umax) & valid.all(1)
    qi, ki = np.meshgrid(np.arange(nb), np.arange(nb), indexing="ij")
    overlap = (smin[qi] <= smax[ki]) & (smin[ki] <= smax[qi])
    kind = np.zeros((nb, nb), np.int8)
    # one sample and one subsegment on each side, keys strictly before queries, no image spanning both:
    # all or nothing
    easy = overlap & (ki < qi) & const[qi] & const[ki] & ~(vis[qi] & vis[ki])
    kind[easy & (umin[qi] <= umin[ki])] = 2
    # everything else that may hold an allowed pair is evaluated exactly
    exact = overlap & ~easy & ((ki <= qi) | (vis[qi] & vis[ki]))
    pairs = np.argwhere(exact)
    r = np.arange(bs)
    for c in range(0, len(pairs), 256):
        qb, kb = pairs[c:c + 256, 0], pairs[c:c + 256, 1]
        qpos, kpos = qb[:, None] * bs + r, kb[:, None] * bs + r
        same = s[qb][:, :, None] == s[kb][:, None, :]
        allowed = same & (kpos[:, None, :] <= qpos[:, :, None]) & (u[qb][:, :, None] <= u[kb][:, None, :])
        gq, gk = g[qb][:, :, None], g[kb][:, None, :]
        allowed |= same & (gq >= 0) & (gq == gk)
        allowed &= valid[qb][:, :, None] & valid[kb][:, None, :]
        n_allowed = allowed.sum((1, 2))
        n_pairs = valid[qb].sum(1) * valid[kb].sum(1)
        kind[qb, kb] = np.where(n_allowed == 0, 0, np.where(n_allowed == n_pairs, 2, 1))
    return kind


def _block_overlay(blocks: np.ndarray, subsegment_ids: np.ndarray) -> np.ndarray:
    """``(B, L, L)``: True where query and key share a vision block (id ``>= 0``) and a sample (molmo2 addition)."""
    blocks = np.asarray(blocks, dtype=np.int64)
    sub = np.asarray(subsegment_ids, dtype=np.int64)
    sample = np.where(sub >= 0, sub // SUBSEGMENT_STRIDE, -1)
    same = (blocks[:, :, None] == blocks[:, None, :]) & (blocks >= 0)[:, :, None]
    return same & (sample[:, :, None] == sample[:, None, :])


def _concat_rows(rows: Sequence[dict]) -> dict:
    """Rows laid end to end as one row (the padding-free batch varlen kernels read)."""
    out: dict[str, Any] = {"pack_index": rows[0].get("pack_index"), "vision": rows[0].get("vision"), "media": [],
                           "sample_ids": []}
    offset, n_samples, cus = 0, 0, [np.zeros(1, dtype=np.int64)]
    for name in ("input_ids", "target_ids", "position_ids"):
        out[name] = np.concatenate([np.asarray(r[name], dtype=np.int64) for r in rows])
    subs = []
    for r in rows:
        sub = np.asarray(r["subsegment_ids"], dtype=np.int64)
        subs.append(sub + n_samples * SUBSEGMENT_STRIDE)
        cu = np.asarray(r["cu_seqlens"], dtype=np.int64)
        cus.append(cu[1:] + offset)
        for m in r["media"]:
            out["media"].append({**m, "token_offset": int(m["token_offset"]) + offset,
                                 "sample_index": int(m.get("sample_index", 0)) + n_samples})
        out["sample_ids"].extend(r.get("sample_ids", []))
        n_samples += len(cu) - 1
        offset += len(sub)
    out["subsegment_ids"] = np.concatenate(subs)
    out["cu_seqlens"] = np.concatenate(cus)
    return out


def model_inputs(rows: Sequence[dict], *, attn_implementation: str = "sdpa", media_root: str | Path | None = None,
                 pad_to: int | None = None, pad_token_id: int = 0, num_items_in_batch: int | None = None,
                 dtype=None, vision: dict | None = None, config: Any = None, device: str | None = None) -> dict[str, Any]:
    """The keyword arguments of the family's ``transformers`` model class for a batch of packed rows.

    ``model(**model_inputs(rows))`` computes, for every sample of every row, what the
    model computes for that sample alone (each branch of a message tree with its
    prefix): the same logits, loss and gradients.

    Args:
        rows: rows from :class:`packtool.reader.PackedDataset` (each carries ``"vision"``,
            the manifest's family settings).
        attn_implementation: the model's ``config._attn_implementation``; one of
            :data:`ATTN_IMPLEMENTATIONS`. Varlen (flash) forms lay the rows end to end
            as one sequence and refuse message trees.
        media_root: where media packed with ``--media reference`` live.
        pad_to: pad rows to this length (static shapes); ``None``: the longest row.
        pad_token_id: input id of padding (padding never carries loss nor is seen).
        num_items_in_batch: loss tokens to normalise by; ``None``: those of ``rows``.
            For gradient accumulation pass the sum over the step's micro-batches.
        dtype: float dtype of an eager mask (the model's dtype; default float32).
        vision: the manifest's ``vision`` settings when rows lack them.
        config: the model's config (``model.config``). Families read from it what the
            checkpoint fixes rather than the data (Qwen2.5-VL's ``tokens_per_second``,
            merge sizes); without it the released checkpoints' values apply.
        device: where a flex ``BlockMask`` is built (its ``mask_mod`` reads tensors on that
            device, so build it where the model runs, e.g. ``"cuda"``); other tensors stay
            on the CPU for the trainer (or pin-memory) to move.

    Returns:
        ``input_ids``, ``labels`` and ``shift_labels`` (both the pre-shifted targets),
        ``position_ids``, ``attention_mask`` (absent for varlen forms),
        ``num_items_in_batch``, ``use_cache=False`` and the family's pixel inputs, all
        ``torch`` tensors on the CPU.

    Raises:
        ConfigError: unknown attention implementation, rows of another family mixed in,
            or no family settings.
        InputError: message trees with a varlen implementation; media that do not give
            the counted number of vision tokens.
    """
    import torch

    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(f"attn_implementation={attn_implementation!r}: choose one of {', '.join(ATTN_IMPLEMENTATIONS)}")
    if not rows:
        raise ConfigError("model_inputs needs at least one row")
    settings = vision if vision is not None else rows[0].get("vision")
    if not settings:
        raise ConfigError("rows carry no family settings (row['vision']); take rows from packtool.reader.PackedDataset "
                          "or pass vision=manifest['vision']")
    for r in rows:
        if vision is None and r.get("vision") not in (None, settings):
            raise ConfigError(f"pack {r.get('pack_index')} was packed for {r['vision'].get('name')!r} but the batch is "
                              f"for {settings.get('name')!r}; batch rows of one packed directory together")
    family = get_family_inputs(settings, config)
    if attn_implementation not in family.attn_implementations:
        raise ConfigError(
            f"{family.model_class} does not take attn_implementation={attn_implementation!r} in transformers; "
            f"use one of {', '.join(family.attn_implementations)}"
        )
    family.check_token_ids(rows)
    if attn_implementation in _VARLEN:
        if any(_has_trees(np.asarray(r["subsegment_ids"], dtype=np.int64)) for r in rows):
            raise InputError(
                f"packs {[r.get('pack_index') for r in rows]} hold message trees, which {attn_implementation} "
                "cannot express (varlen kernels would let branches see each other); use sdpa, eager or flex_attention, "
                "or tokenize with --max-branches 1"
            )
        rows = [_concat_rows(rows)]
        pad_to = None
    batch = collate(rows, pad_to, pad_token_id=pad_token_id, pixels=False)
    width = batch["input_ids"].shape[1]
    out: dict[str, Any] = {"input_ids": torch.from_numpy(batch["input_ids"])}
    labels = torch.from_numpy(batch["target_ids"])
    out["labels"] = labels
    out["shift_labels"] = labels
    pos = family.positions(rows, width)
    pos = batch["position_ids"] if pos is None else pos
    out["position_ids"] = torch.from_numpy(np.ascontiguousarray(pos, dtype=np.int64))
    blocks = family.vision_blocks(rows, width)
    if attn_implementation in _VARLEN and blocks is not None and bool((blocks >= 0).any()):
        raise ConfigError(f"{family.name} lets vision tokens attend both ways, which {attn_implementation} cannot "
                          "express; use sdpa, eager or flex_attention")
    if attn_implementation == "flex_attention":
        out["attention_mask"] = block_mask(batch["subsegment_ids"], media=batch["media"], vision=family.vision_attention,
                                           blocks=blocks, device=device or "cpu")
    elif attn_implementation not in _VARLEN:
        allowed = np.stack([attention_mask(batch["subsegment_ids"][i], batch["media"][i], vision=family.vision_attention)
                            for i in range(len(rows))])[:, None]
        if blocks is not None:
            allowed |= _block_overlay(blocks, batch["subsegment_ids"])[:, None]
        out["attention_mask"] = torch.from_numpy(allowed) if attn_implementation == "sdpa" else eager_mask(allowed, dtype)
    out.update(family.pixels(rows, media_root))
    out.update(family.extra(rows, batch))
    n_items = loss_tokens(rows) if num_items_in_batch is None else int(num_items_in_batch)
    out["num_items_in_batch"] = torch.tensor(n_items)
    out["use_cache"] = False
    return out
