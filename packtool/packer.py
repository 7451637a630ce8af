"""Buffer policy and pack assembly (DESIGN.md §4). No file I/O.

Planning works on two length columns only::

    stream ─▶ [ buffer of buffer_size samples ] ─knapsack─▶ pack ─▶ refill ─▶ ...
                                                   at end: re-solve until empty

Assembly turns a plan into packed rows with Arrow takes and numpy offset arithmetic,
never a Python loop over tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .config import PackConfig
from .errors import OversizeSampleError
from .knapsack import solve_knapsack_2d
from .schema import PACKED, SUBSEGMENT_STRIDE

__all__ = ["PackPlan", "plan_packs", "assemble_packs", "unit_granularity", "MAX_UNIT_CELLS"]

#: The unit axis of the DP table has at most this many cells; larger capacities are quantized.
MAX_UNIT_CELLS = 256


@dataclass
class PackPlan:
    """Which samples go in which pack.

    Attributes:
        order: sample indices, pack after pack.
        offsets: ``order[offsets[p]:offsets[p+1]]`` are pack ``p``'s samples.
        dropped: indices of samples dropped as oversize.
        alone: indices of oversize samples given a pack of their own.
        truncated: indices of samples truncated to ``max_tokens`` (text-only).
    """

    order: np.ndarray
    offsets: np.ndarray
    dropped: list[int] = field(default_factory=list)
    alone: list[int] = field(default_factory=list)
    truncated: list[int] = field(default_factory=list)

    @property
    def n_packs(self) -> int:
        return len(self.offsets) - 1


def unit_granularity(max_units: int) -> int:
    """Quantum for vision units so the DP's unit axis has at most ``MAX_UNIT_CELLS`` cells.

    Example:
        >>> unit_granularity(128), unit_granularity(65536)
        (1, 256)
    """
    return max(1, -(-max_units // MAX_UNIT_CELLS))


def plan_packs(tokens: np.ndarray, units: np.ndarray, has_media: np.ndarray, cfg: PackConfig, max_units: int) -> PackPlan:
    """Plan packs for samples with the given token and vision-unit counts, in stream order.

    Each pack is an exact knapsack optimum over the current buffer for
    ``text_weight * tokens + vision_weight * units`` (exact counts), with token sizes
    rounded up to ``token_granularity`` and units up to :func:`unit_granularity` in the
    constraints, so every pack fits the true capacities.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    units = np.asarray(units, dtype=np.int64)
    n = len(tokens)
    g = cfg.token_granularity
    ug = unit_granularity(max_units)
    qw = -(-tokens // g)
    qu = -(-units // ug)
    cap_w = cfg.max_tokens // g
    cap_u = max_units // ug
    value = cfg.text_weight * tokens + cfg.vision_weight * units
    plan = PackPlan(np.zeros(0, np.int64), np.zeros(1, np.int64))
    packs: list[list[int]] = []
    too_big_tokens = tokens > cfg.max_tokens
    too_big_units = units > max_units
    fits = np.ones(n, dtype=bool)
    for i in np.flatnonzero(too_big_tokens | too_big_units):
        i = int(i)
        if cfg.oversize == "fail":
            raise OversizeSampleError(
                f"sample at index {i} needs {tokens[i]:,} tokens and {units[i]:,} vision units but a pack holds "
                f"{cfg.max_tokens:,} and {max_units:,}; raise --max-tokens/--max-vision-units or use --oversize drop"
            )
        if cfg.oversize == "truncate" and not too_big_units[i] and not has_media[i]:
            plan.truncated.append(i)
            qw[i] = cap_w
            continue
        fits[i] = False
        if cfg.oversize == "alone":
            plan.alone.append(i)
        else:
            plan.dropped.append(i)
    stream = np.flatnonzero(fits)
    buffer: list[int] = []
    pos = 0
    max_k = cfg.max_samples_per_pack
    while pos < len(stream) or buffer:
        while len(buffer) < cfg.buffer_size and pos < len(stream):
            buffer.append(int(stream[pos]))
            pos += 1
        idx = np.asarray(buffer, dtype=np.int64)
        _, chosen = solve_knapsack_2d(qw[idx], qu[idx], value[idx], cap_w, cap_u)
        sel = np.flatnonzero(chosen)
        if max_k is not None and len(sel) > max_k:
            # keep the most valuable max_k of the optimum (stable order); exact under the extra limit is future work
            top = np.argsort(-value[idx[sel]], kind="stable")[:max_k]
            sel = np.sort(sel[top])
        if len(sel) == 0:
            sel = np.array([0])
        packs.append([buffer[j] for j in sel])
        taken = set(sel.tolist())
        buffer = [b for j, b in enumerate(buffer) if j not in taken]
    for i in plan.alone:
        packs.append([i])
    sizes = np.array([len(p) for p in packs], dtype=np.int64)
    plan.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    plan.order = np.asarray([i for p in packs for i in p], dtype=np.int64)
    return plan


def _list_values(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    return pc.list_flatten(arr).to_numpy(zero_copy_only=False)


def _truncate(table: pa.Table, rows: list[int], max_tokens: int) -> pa.Table:
    """Cut text-only rows to ``max_tokens``; the last kept token predicts nothing."""
    if not rows:
        return table
    pylist = table.to_pylist()
    for r in rows:
        row = pylist[r]
        for col in ("input_ids", "target_ids", "position_ids", "subsegment_ids"):
            row[col] = row[col][:max_tokens]
        row["target_ids"][-1] = -100
        row["n_tokens"] = max_tokens
    return pa.Table.from_pylist(pylist, schema=table.schema)


def assemble_packs(
    table: pa.Table,
    plan: PackPlan,
    first_pack_index: int,
    media_data: Callable[[dict], list[bytes] | None] | None = None,
    max_tokens: int | None = None,
) -> pa.Table:
    """Build packed rows (``schema.PACKED``) from tokenized rows and a plan.

    Token columns are concatenated per pack through list offsets; subsegment ids are
    renumbered ``k * 100000 + id`` for the pack's ``k``-th sample; media spans are
    shifted by the sample's start in the pack. ``media_data(media_struct)`` returns the
    bytes to embed for one media item (``None`` keeps media by reference).
    """
    if plan.truncated and max_tokens is not None:
        table = _truncate(table, plan.truncated, max_tokens)
    taken = table.take(pa.array(plan.order))
    n_samples = taken.num_rows
    n_packs = plan.n_packs
    pack_off = plan.offsets
    lengths = taken["n_tokens"].to_numpy().astype(np.int64)
    pack_of = np.repeat(np.arange(n_packs), np.diff(pack_off))
    k_in_pack = np.arange(n_samples) - pack_off[pack_of]
    sample_end = np.cumsum(lengths)
    sample_start = sample_end - lengths
    tok_pack_off = np.concatenate([[0], sample_end])[pack_off]
    start_in_pack = sample_start - tok_pack_off[pack_of]

    def token_list(values: np.ndarray) -> pa.Array:
        return pa.ListArray.from_arrays(pa.array(tok_pack_off.astype(np.int32)), pa.array(values.astype(np.int32, copy=False)))

    sub = _list_values(taken["subsegment_ids"]).astype(np.int64)
    sub = sub + np.repeat(k_in_pack * SUBSEGMENT_STRIDE, lengths)
    # cu_seqlens: per pack [0, end_0, end_1, ...] relative to the pack start
    cu_off = pack_off + np.arange(n_packs + 1)
    cu_vals = np.zeros(n_samples + n_packs, dtype=np.int64)
    is_zero = np.zeros(n_samples + n_packs, dtype=bool)
    is_zero[cu_off[:-1]] = True
    cu_vals[~is_zero] = start_in_pack + lengths
    cu = pa.ListArray.from_arrays(pa.array(cu_off.astype(np.int32)), pa.array(cu_vals.astype(np.int32)))

    media_col = taken["media"].combine_chunks()
    media_flat = pc.list_flatten(media_col)
    m_counts = pc.list_value_length(media_col).to_numpy(zero_copy_only=False).astype(np.int64)
    m_sample = np.repeat(np.arange(n_samples), m_counts)
    names = [f.name for f in PACKED.field("media").type.value_type]
    children = {}
    for name in names:
        if name == "sample_index":
            children[name] = pa.array(k_in_pack[m_sample].astype(np.int32))
        elif name == "token_offset":
            off = media_flat.field("token_offset").to_numpy(zero_copy_only=False).astype(np.int64)
            children[name] = pa.array((off + start_in_pack[m_sample]).astype(np.int32))
        elif name == "data":
            children[name] = _media_payload(media_flat, media_data)
        else:
            children[name] = media_flat.field(name)
    media_struct = pa.StructArray.from_arrays(list(children.values()), fields=list(PACKED.field("media").type.value_type))
    m_pack_off = np.concatenate([[0], np.cumsum(m_counts)])[pack_off]
    media = pa.ListArray.from_arrays(pa.array(m_pack_off.astype(np.int32)), media_struct)

    units = taken["n_vision_units"].to_numpy().astype(np.int64)
    cols = {
        "pack_index": pa.array(np.arange(first_pack_index, first_pack_index + n_packs, dtype=np.int64)),
        "n_tokens": pa.array(np.diff(tok_pack_off).astype(np.int32)),
        "n_vision_units": pa.array(np.add.reduceat(units, pack_off[:-1]).astype(np.int32) if n_samples else np.zeros(0, np.int32)),
        "sample_ids": pa.ListArray.from_arrays(pa.array(pack_off.astype(np.int32)), taken["sample_id"].combine_chunks()),
        "input_ids": token_list(_list_values(taken["input_ids"])),
        "target_ids": token_list(_list_values(taken["target_ids"])),
        "position_ids": token_list(_list_values(taken["position_ids"])),
        "subsegment_ids": token_list(sub),
        "cu_seqlens": cu,
        "media": media,
    }
    return pa.Table.from_arrays(list(cols.values()), schema=PACKED)


def _media_payload(media_flat: pa.StructArray, media_data) -> pa.Array:
    typ = pa.list_(pa.binary())
    if media_data is None or len(media_flat) == 0:
        return pa.nulls(len(media_flat), type=typ)
    items = media_flat.to_pylist()
    return pa.array([media_data(m) for m in items], type=typ)
