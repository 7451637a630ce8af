"""Slow, obviously-correct twins of the fast code, for tests only."""

from __future__ import annotations

import numpy as np


def split_tags(text: str) -> list[tuple[str, str, int]]:
    """``(kind, text, media_number)`` pieces of a message at ``<image>``/``<video>`` tags, one
    character at a time: text between tags keeps its newlines except those touching a tag,
    and a piece that is only whitespace between tags is dropped (``formats.common.split_placeholders``
    numbers media per kind from an offset; here the number is the tag's rank within its kind)."""
    pieces: list[tuple[str, str, int]] = []
    seen = {"image": 0, "video": 0}
    buf = ""
    i = 0
    after_tag = False
    while i <= len(text):
        tag = next((k for k in ("image", "video") if text.startswith(f"<{k}>", i)), None)
        if tag is None and i < len(text):
            buf += text[i]
            i += 1
            continue
        if after_tag:
            buf = buf.lstrip("\n")
        if tag is None:  # the end of the text
            if buf:
                pieces.append(("text", buf, -1))
            break
        buf = buf.rstrip("\n")
        if buf.strip():
            pieces.append(("text", buf, -1))
        pieces.append((tag, "", seen[tag]))
        seen[tag] += 1
        buf = ""
        after_tag = True
        i += len(tag) + 2
    return pieces


def brute_force_knapsack(w, u, v, max_w: int, max_u: int, max_items: int | None = None) -> tuple[int, np.ndarray]:
    """Best value over all ``2**n`` subsets, and the subset the kernel's tie rule picks.

    The tie rule (see ``packtool.knapsack``): among optimal subsets, compare from the last
    item backwards; the first item where two differ is left out. Encoding a subset as the
    integer ``sum(2**i)``, that is the optimal subset with the smallest integer.
    """
    n = len(w)
    best, best_mask = -1, 0
    for mask in range(1 << n):
        idx = [i for i in range(n) if mask >> i & 1]
        if max_items is not None and len(idx) > max_items:
            continue
        if sum(int(w[i]) for i in idx) <= max_w and sum(int(u[i]) for i in idx) <= max_u:
            val = sum(int(v[i]) for i in idx)
            if val > best:  # masks ascend, so the first optimum has the smallest integer
                best, best_mask = val, mask
    return best, np.array([bool(best_mask >> i & 1) for i in range(n)], dtype=bool)


def pack_capacity_ok(tokens, units, packs, max_tokens: int, max_units: int) -> bool:
    """Every pack within both capacities (plain Python sums)."""
    return all(sum(int(tokens[i]) for i in p) <= max_tokens and sum(int(units[i]) for i in p) <= max_units
               for p in packs)


def gather_runs(src, starts, lengths, dst_starts, add, dst) -> None:
    """One run at a time, value by value (twin of ``packer.gather_runs``)."""
    for a, n, d, x in zip(starts, lengths, dst_starts, add, strict=True):
        for j in range(int(n)):
            dst[int(d) + j] = (int(src[int(a) + j]) + int(x) + 2**31) % 2**32 - 2**31


def compact_row(ids, tgt, pos, sub, min_run: int) -> tuple[list[list[int]], list[int], list[int]]:
    """One row's runs form token by token (twin of ``runs.compact``): the four compact
    columns, run starts and run lengths."""
    n = len(ids)
    stored: list[list[int]] = [[], [], [], []]
    starts, lengths = [], []
    t = 0
    while t < n:
        e = t + 1
        while (e < n and ids[e] == ids[t] and tgt[e] == tgt[t] and sub[e] == sub[t]
               and int(pos[e]) == int(pos[e - 1]) + 1):
            e += 1
        if e - t >= min_run:
            starts.append(len(stored[0]))
            lengths.append(e - t)
            take = [t]
        else:
            take = list(range(t, e))
        for j in take:
            for col, src in zip(stored, (ids, tgt, pos, sub), strict=True):
                col.append(int(src[j]))
        t = e
    return stored, starts, lengths


def line_offsets(data: bytes, first: int, every: int) -> tuple[int, list[tuple[int, int]]]:
    """Lines of ``data`` and the byte offset where each of lines ``first, first+every, ...`` starts,
    from ``bytes.split`` (``pipeline._line_offsets``'s twin)."""
    lines = data.split(b"\n")
    n_lines = len(lines) - (1 if data.endswith(b"\n") or not data else 0)
    starts = np.cumsum([0] + [len(x) + 1 for x in lines[:-1]])
    return n_lines, [(t, int(starts[t])) for t in range(first, n_lines, every)]


def unswap_targets(stored: list[int], inputs: list[int]) -> list[int]:
    """A version 5 row's targets from their stored form, one value at a time (``runs.swap_next``'s
    twin): each value and the next input are swapped with -1; the row's last value stays."""
    out = []
    for i, v in enumerate(stored):
        nxt = inputs[i + 1] if i + 1 < len(inputs) else None
        out.append(v if nxt is None else nxt if v == -1 else -1 if v == nxt else v)
    return out


def _blob_rows(col) -> list[list[int]]:
    """Each row of an int32 blob column as a list, one value at a time with ``struct``."""
    import struct

    return [list(struct.unpack(f"<{len(b) // 4}i", b)) for b in col.to_pylist()]


def _plain_targets(table) -> list[list[int]]:
    """Each row's targets of a version 5 table, decoded against its inputs by :func:`unswap_targets`."""
    return [unswap_targets(s, i) for s, i in zip(_blob_rows(table["compact_target_ids_i32next"]),
                                                  _blob_rows(table["compact_input_ids_i32le"]), strict=True)]


def v5_media(table):
    """A table of schema version 6 with version 5's media struct (no ``source_*`` fields), as
    every packtool before version 6 wrote it."""
    from packtool.schema import PACKED_V5, TOKENIZED_V5, has_source_fields, with_media_type

    if not has_source_fields(table.schema):
        return table
    like = PACKED_V5 if "pack_index" in table.column_names else TOKENIZED_V5
    return with_media_type(table, like.field("media").type)


def v5_form(table):
    """A runs-form table of schema version 6 as version 5 stored it: no media ``source_*`` fields."""
    table = v5_media(table)
    meta = dict(table.schema.metadata or {})
    if b"packtool.schema_version" in meta:
        meta[b"packtool.schema_version"] = b"5"
    return table.replace_schema_metadata(meta or None)


def plain_target_form(table):
    """A runs-form table of schema version 5 or 6 as version 4 stored it: the target blob holds the
    targets as they are, under ``compact_target_ids_i32le`` (one value at a time with ``struct``)."""
    import struct

    import pyarrow as pa

    table = v5_media(table)
    rows = _plain_targets(table)
    col = pa.array([struct.pack(f"<{len(r)}i", *r) for r in rows], pa.binary())
    at = table.column_names.index("compact_target_ids_i32next")
    table = table.set_column(at, "compact_target_ids_i32le", col)
    meta = dict(table.schema.metadata or {})
    if b"packtool.schema_version" in meta:
        meta[b"packtool.schema_version"] = b"4"
    return table.replace_schema_metadata(meta or None)


def list_form(table):
    """A runs-form table of schema version 4, 5 or 6 (int32 blobs) as version 3 stored it
    (``list<int32>`` columns under the names without ``_i32le``, targets as they are), one
    value at a time with ``struct``: the twin of ``runs.blob_table`` run backwards."""
    import pyarrow as pa

    table = v5_media(table)
    names, cols = [], []
    for name, col in zip(table.column_names, table.columns, strict=True):
        if name == "compact_target_ids_i32next":
            names.append("compact_target_ids")
            cols.append(pa.array(_plain_targets(table), pa.list_(pa.int32())))
        elif name.endswith("_i32le"):
            names.append(name.removesuffix("_i32le"))
            cols.append(pa.array(_blob_rows(col), pa.list_(pa.int32())))
        else:
            names.append(name)
            cols.append(col)
    meta = dict(table.schema.metadata or {})
    if b"packtool.schema_version" in meta:
        meta[b"packtool.schema_version"] = b"3"
    return pa.Table.from_arrays(cols, names=names).replace_schema_metadata(meta or None)
