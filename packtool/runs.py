"""The run-length layout of token columns: long placeholder spans stored as one token.

A vision span is thousands of identical placeholder tokens: the same ``input_ids``, the
same ``target_ids`` (-100), positions rising by one, one subsegment. Stored as they are,
four ``list<int32>`` columns hold ``4 x n`` values that say nothing new, and Parquet
spends nanoseconds on every one of them, writing and reading. The *runs form* keeps
only a run's first token and says how long the run is::

    expanded (what a trainer reads)         compact (what a shard stores)
    input_ids    7 9 9 9 9 9 3                compact_input_ids    7 9 3
    target_ids   9 . . . . . .  (. = -100)    compact_target_ids   9 . .
    position_ids 0 1 2 3 4 5 6                compact_position_ids 0 1 6
    subsegment   s s s s s s s                compact_subsegment   s s s
                                              run_starts  [1]   (index in the compact row)
                                              run_lengths [5]   (tokens the run stands for)

How a shard stores it (schema version 5, and 6, which changed only the media struct): each of the six stored columns is a ``binary``
column whose row is the row's values as little-endian int32 bytes (``compact_input_ids_i32le``,
``compact_target_ids_i32next``, ``compact_position_ids_i32le``, ``compact_subsegment_ids_i32le``,
``run_starts_i32le``, ``run_lengths_i32le``; each field says what its bytes are in its
``packtool.encoding`` metadata). Parquet then writes and reads a row as one byte string
instead of one repetition and definition level per value. Read a plain one as numpy with no
copy::

    np.frombuffer(row_bytes, dtype="<i4")

Targets are stored relative to the next stored input (encoding ``int32-le-next-swap``). Where
a token's target is the next token's input (the common case: every token that carries
loss), the stored value is ``-1``; where the target is ``-1`` the stored value is that next
input; any other target (``-100`` above all) is stored as it is. A row's last value has no
next input and is stored as it is. The swap is its own inverse, so every int32 target
round-trips; what it buys is that a target column becomes runs of ``-1`` and ``-100``, which
zstd writes about 4x and reads about 2.5x faster than a second copy of the token ids, at a
fifteenth of the bytes (README, "Benchmarks")::

    compact_input_ids     7   9   3   5
    target_ids            9 -100   5 -100   (what a trainer reads)
    compact_target_ids   -1 -100  -1 -100   (what a shard stores)

:func:`swap_next` does both directions. Version 4 stored the target column plainly under
``compact_target_ids_i32le``; version 3 stored the same values as ``list<int32>`` under the
names without the suffix. :func:`blob_table` turns a table of either into the version 5 form,
and every reader here goes through :func:`token_parts` (or :func:`column_parts` for a plain
column), which takes any of them. The names differ so that code written for one form fails
on a column of another instead of reading bytes as values.

A *run* is a maximal stretch of at least :data:`MIN_RUN` tokens of one row in which
``input_ids``, ``target_ids`` and ``subsegment_ids`` are each constant and
``position_ids`` rise by exactly 1 per token. :func:`compact` is a pure function of
the expanded row (maximal stretches, a fixed threshold), so equal rows give equal
bytes. Runs never cross a change of subsegment, hence never cross samples in a pack:
a pack's compact row is its samples' compact rows end to end, run starts shifted.

Everything here is numpy only (no numba), so ``packtool.reader`` stays light to import.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

__all__ = ["MIN_RUN", "TOKEN_COLUMNS", "COMPACT_COLUMNS", "RUN_COLUMNS", "STORED_COLUMNS", "V4_COMPACT_COLUMNS",
           "V3_COMPACT_COLUMNS", "V3_RUN_COLUMNS", "BLOB_DTYPE", "BLOB_METADATA", "NEXT_METADATA", "NEXT_MARK",
           "field_metadata", "swap_next", "swap_against", "token_parts", "Compact", "compact", "expand", "expanded_lengths",
           "loss_tokens", "is_runs_table", "runs_version", "stored_names", "column_parts", "blob_byte_offsets", "blob_array",
           "compact_arrays", "blob_table", "compact_table", "expand_table", "read_expanded", "expand_row"]

#: Shortest stretch stored as a run. Every run costs 6 stored values (4 columns + start +
#: length) and saves ``4 x (L - 1)``; below a few tokens the run table's bookkeeping costs
#: more time on decode than the values it saves (measured in README "Benchmarks").
MIN_RUN = 8
#: The expanded token columns, in schema order.
TOKEN_COLUMNS = ("input_ids", "target_ids", "position_ids", "subsegment_ids")
#: Their stored names in the runs form (schema version 5, int32 blobs; targets stored against
#: the next input): different names, so a reader that expects the expanded columns fails
#: loudly instead of reading compact data as if it were a row, one that expects version 3's
#: lists fails instead of reading bytes, and one that expects version 4's plain targets fails
#: instead of reading ``-1`` as a target.
COMPACT_COLUMNS = ("compact_input_ids_i32le", "compact_target_ids_i32next", "compact_position_ids_i32le",
                   "compact_subsegment_ids_i32le")
#: The same in schema version 4 (targets stored as they are), still read.
V4_COMPACT_COLUMNS = tuple(f"compact_{name}_i32le" for name in TOKEN_COLUMNS)
#: The run table: where each run sits in the compact row and how many tokens it stands for.
RUN_COLUMNS = ("run_starts_i32le", "run_lengths_i32le")
#: The six stored columns, in schema order.
STORED_COLUMNS = (*COMPACT_COLUMNS, *RUN_COLUMNS)
#: The same columns in schema version 3 (``list<int32>``), still read.
V3_COMPACT_COLUMNS = tuple(f"compact_{name}" for name in TOKEN_COLUMNS)
V3_RUN_COLUMNS = ("run_starts", "run_lengths")
#: The values of a stored blob: little-endian int32 whatever the machine.
BLOB_DTYPE = np.dtype("<i4")
#: Field metadata of a plain blob column: what its bytes are.
BLOB_METADATA = {b"packtool.encoding": b"int32-le"}
#: Field metadata of the stored target column (schema version 5): int32 values, each the
#: target with the next stored input and :data:`NEXT_MARK` swapped (:func:`swap_next`).
NEXT_METADATA = {b"packtool.encoding": b"int32-le-next-swap"}
#: What a stored target holds where the target is the next token's input.
NEXT_MARK = -1
_TARGET = COMPACT_COLUMNS[1]
_OLD_TO_NEW = {**dict(zip((*V3_COMPACT_COLUMNS, *V3_RUN_COLUMNS), STORED_COLUMNS, strict=True)),
               **dict(zip(V4_COMPACT_COLUMNS, COMPACT_COLUMNS, strict=True))}


def field_metadata(name: str) -> dict[bytes, bytes]:
    """The ``packtool.encoding`` field metadata of stored column ``name`` (schema version 5)."""
    return NEXT_METADATA if name == _TARGET else BLOB_METADATA


def swap_next(values: np.ndarray, inputs: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Targets to their stored form, or stored targets back (the map is its own inverse).

    ``values`` and ``inputs`` are one batch's flat compact target and input values, rows at
    ``offsets`` (from ``offsets[0]``, as :func:`column_parts` gives them). In each row, value
    ``i`` is swapped with :data:`NEXT_MARK` where it equals ``inputs[i + 1]`` and the other way
    round; a row's last value has no next input and stays. Returns a new int32 array of
    ``offsets[-1] - offsets[0]`` values.

    Example:
        >>> ids, off = np.array([7, 9, 3, 5]), np.array([0, 4])
        >>> stored = swap_next(np.array([9, -100, 5, -100]), ids, off)
        >>> stored.tolist(), swap_next(stored, ids, off).tolist()
        ([-1, -100, -1, -100], [9, -100, 5, -100])
        >>> swap_next(np.array([-1, 4]), np.array([2, 4]), np.array([0, 1, 2])).tolist()  # each row's last stays
        [-1, 4]
    """
    offsets = _i64(offsets)
    lo, hi = int(offsets[0]), int(offsets[-1])
    vals = np.asarray(values)[lo:hi]
    nxt = np.empty(hi - lo, dtype=BLOB_DTYPE)
    if hi > lo:
        nxt[:-1] = np.asarray(inputs)[lo + 1:hi]
        ends = offsets[1:] - lo - 1
        nxt[ends[offsets[1:] > offsets[:-1]]] = NEXT_MARK  # where the swap leaves a value as it is
    return swap_against(vals, nxt)


def _int32_values(values) -> np.ndarray:
    """``values`` as little-endian int32 (no copy when they are already), refusing what would wrap.

    Raises:
        ValueError: values that are not integers, or outside int32.
    """
    values = np.asarray(values)
    if values.dtype == BLOB_DTYPE:
        return values
    if values.dtype.kind not in "iu":
        raise ValueError(f"token values must be integers, got {values.dtype}")
    if len(values) and values.dtype.itemsize >= 4 and (values.min() < -2**31 or values.max() >= 2**31):
        raise ValueError("token values must fit in int32")
    return values.astype(BLOB_DTYPE)


def swap_against(values: np.ndarray, nxt: np.ndarray) -> np.ndarray:
    """Each of ``values`` with ``nxt`` (its next input, same length) and :data:`NEXT_MARK`
    swapped: the elementwise step of :func:`swap_next` (a new int32 array).

    Raises:
        ValueError: values that are not integers or do not fit in int32 (they would wrap).

    Example:
        >>> swap_against(np.array([5, -1, -100]), np.array([5, 8, 3])).tolist()
        [-1, 8, -100]
    """
    vals, nxt = _int32_values(values), _int32_values(nxt)
    out = np.where(vals == nxt, np.int32(NEXT_MARK), vals)
    mark = vals == NEXT_MARK
    out[mark] = nxt[mark]
    return out


@dataclass(frozen=True, slots=True)
class Compact:
    """A batch of rows in runs form: flat values plus offsets, as Arrow lists hold them.

    ``columns[name][offsets[r]:offsets[r + 1]]`` is row ``r``'s compact column;
    ``run_starts[run_offsets[r]:run_offsets[r + 1]]`` its run starts (indices within the
    compact row, ascending) and ``run_lengths`` the tokens each run stands for.
    """

    columns: dict[str, np.ndarray]
    offsets: np.ndarray
    run_starts: np.ndarray
    run_lengths: np.ndarray
    run_offsets: np.ndarray


def _i64(x) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.int64)


def compact(columns: dict[str, np.ndarray], offsets: np.ndarray, min_run: int = MIN_RUN) -> Compact:
    """The runs form of a batch of expanded rows (flat ``columns`` of equal length, rows at ``offsets``).

    ``columns`` holds the four :data:`TOKEN_COLUMNS`; the result's ``columns`` use the same
    names. One vectorised pass over the batch, no loop per row or per run.

    Example:
        >>> c = compact({"input_ids": np.array([7] + [9] * 9 + [3]), "target_ids": np.full(11, -100),
        ...              "position_ids": np.arange(11), "subsegment_ids": np.zeros(11)}, np.array([0, 11]))
        >>> c.columns["input_ids"].tolist(), c.run_starts.tolist(), c.run_lengths.tolist()
        ([7, 9, 3], [1], [9])
    """
    if min_run < 2:
        raise ValueError(f"min_run must be at least 2, got {min_run}")
    ids, tgt, pos, sub = (np.asarray(columns[name]) for name in TOKEN_COLUMNS)
    offsets = _i64(offsets)
    n = len(ids)
    if not (len(tgt) == len(pos) == len(sub) == n) or (len(offsets) and (offsets[0] != 0 or offsets[-1] != n)):
        raise ValueError("token columns must have one length, and offsets must run from 0 to it")
    # a token continues the stretch of the token before it when all four columns agree (same
    # row, same values, next position); candidates from input_ids alone, so text (where equal
    # neighbours are rare) costs one comparison pass
    same = ids[1:] == ids[:-1] if n > 1 else np.zeros(0, dtype=bool)
    inner = offsets[1:-1]
    inner = inner[(inner > 0) & (inner < n)]
    if np.count_nonzero(same) * 8 > n:  # mostly placeholders: whole-array passes beat gathers
        same &= (tgt[1:] == tgt[:-1]) & (sub[1:] == sub[:-1])
        same &= (pos[1:].astype(np.int64) - pos[:-1]) == 1
        same[inner - 1] = False  # a row's first token starts a stretch
        cont = np.flatnonzero(same) + 1
    else:
        cand = np.flatnonzero(same) + 1
        ok = (tgt[cand] == tgt[cand - 1]) & (sub[cand] == sub[cand - 1])
        ok &= (pos[cand].astype(np.int64) - pos[cand - 1]) == 1
        at = np.minimum(np.searchsorted(inner, cand), max(len(inner) - 1, 0))
        if len(inner):
            ok &= inner[at] != cand  # a row's first token starts a stretch
        cont = cand[ok]
    # maximal stretches: consecutive runs of continuing tokens, plus the token before them
    brk = np.flatnonzero(np.diff(cont) != 1) + 1
    g_first = cont[np.concatenate([[0], brk])] - 1 if len(cont) else cont
    g_last = cont[np.concatenate([brk - 1, [len(cont) - 1]])] if len(cont) else cont
    g_len = g_last - g_first + 1
    is_run = g_len >= min_run
    run_at, run_len = g_first[is_run], g_len[is_run]
    names = (ids, tgt, pos, sub)
    if len(run_at) == 0:
        return Compact(columns={name: np.asarray(col) for name, col in zip(TOKEN_COLUMNS, names, strict=True)},
                       offsets=offsets, run_starts=np.zeros(0, np.int32), run_lengths=np.zeros(0, np.int32),
                       run_offsets=np.zeros(len(offsets), dtype=np.int64))
    # drop every token of a run but its first: +1 after each run's first token, -1 after its last
    # (runs never touch, so the marks are distinct)
    mark = np.zeros(n + 1, dtype=np.int32)
    mark[run_at + 1] = 1
    mark[run_at + run_len] = -1
    keep = np.cumsum(mark[:n], dtype=np.int32) == 0
    dropped = np.zeros(len(run_at) + 1, dtype=np.int64)
    np.cumsum(run_len - 1, out=dropped[1:])  # tokens dropped before run k (and in all, last)
    before_row = np.searchsorted(run_at, offsets, side="left")  # runs starting before each row start
    out_off = offsets - dropped[before_row]
    run_row = np.searchsorted(offsets, run_at, side="right") - 1
    return Compact(
        columns={name: np.asarray(col)[keep] for name, col in zip(TOKEN_COLUMNS, names, strict=True)},
        offsets=out_off,
        run_starts=(run_at - dropped[:-1] - out_off[run_row]).astype(np.int32),
        run_lengths=run_len.astype(np.int32),
        run_offsets=before_row.astype(np.int64),
    )


def _counts(n_stored: int, offsets: np.ndarray, run_starts: np.ndarray, run_lengths: np.ndarray,
            run_offsets: np.ndarray) -> np.ndarray:
    """Tokens each stored value stands for (1, or its run's length), after checking the run table."""
    offsets, run_starts, run_lengths, run_offsets = (_i64(x) for x in (offsets, run_starts, run_lengths, run_offsets))
    n_rows = len(offsets) - 1
    if len(run_offsets) != n_rows + 1 or len(run_starts) != len(run_lengths):
        raise ValueError("run table: one run_starts/run_lengths list per row, of equal lengths")
    counts = np.ones(n_stored, dtype=np.int64)
    if len(run_starts) == 0:
        return counts
    run_row = np.repeat(np.arange(n_rows), np.diff(run_offsets - run_offsets[0]))
    row_len = np.diff(offsets)[run_row]
    if run_starts.min() < 0 or np.any(run_starts >= row_len) or run_lengths.min() < 1:
        raise ValueError("run table: a run starts outside its row or has no tokens")
    ascending = np.diff(run_starts) > 0
    if not np.all(ascending | (np.diff(run_row) != 0)):
        raise ValueError("run table: run starts of a row must be strictly ascending")
    counts[offsets[run_row] - offsets[0] + run_starts] = run_lengths
    return counts


def expanded_lengths(offsets: np.ndarray, run_lengths: np.ndarray, run_offsets: np.ndarray) -> np.ndarray:
    """Expanded tokens of each row: its compact length plus ``L - 1`` for every run of ``L`` tokens.

    Example:
        >>> expanded_lengths(np.array([0, 3, 5]), np.array([9]), np.array([0, 1, 1])).tolist()
        [11, 2]
    """
    offsets, run_lengths, run_offsets = _i64(offsets), _i64(run_lengths), _i64(run_offsets)
    extra = np.zeros(len(run_lengths) + 1, dtype=np.int64)
    np.cumsum(run_lengths - 1, out=extra[1:])
    rel = run_offsets - run_offsets[0]
    return np.diff(offsets) + extra[rel[1:]] - extra[rel[:-1]]


def expand(columns: dict[str, np.ndarray], offsets: np.ndarray, run_starts: np.ndarray, run_lengths: np.ndarray,
           run_offsets: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The expanded rows of a batch in runs form: ``(columns, offsets)``, the inverse of :func:`compact`.

    ``columns`` may hold any of the :data:`TOKEN_COLUMNS` (flat compact values from
    ``offsets[0]`` to ``offsets[-1]``, as a sliced Arrow list holds them); each comes back
    expanded: a run's value repeated, ``position_ids`` rising by one along it. The returned
    offsets start at 0. The run table is checked (starts inside their row and ascending,
    lengths at least 1); a bad one raises ``ValueError``.

    Example:
        >>> cols, off = expand({"input_ids": np.array([7, 9, 3]), "position_ids": np.array([0, 1, 6])},
        ...                    np.array([0, 3]), np.array([1]), np.array([5]), np.array([0, 1]))
        >>> cols["input_ids"].tolist(), cols["position_ids"].tolist(), off.tolist()
        ([7, 9, 9, 9, 9, 9, 3], [0, 1, 2, 3, 4, 5, 6], [0, 7])
    """
    offsets = _i64(offsets)
    lo, hi = int(offsets[0]), int(offsets[-1])
    counts = _counts(hi - lo, offsets, run_starts, run_lengths, run_offsets)
    out_off = np.zeros(len(offsets), dtype=np.int64)
    out_off[1:] = np.cumsum(expanded_lengths(offsets, run_lengths, run_offsets))
    out = {}
    for name, col in columns.items():
        if name not in TOKEN_COLUMNS:
            raise ValueError(f"expand: {name!r} is not a token column ({', '.join(TOKEN_COLUMNS)})")
        vals = np.asarray(col)[lo:hi]
        if len(run_starts) == 0:
            out[name] = vals.copy()  # nothing to expand
        elif name == "position_ids":
            # along a run the position rises with the expanded index t: pos[t] = (pos_i - first_i) + t,
            # first_i the expanded index of stored value i; one repeat and one add
            first = np.cumsum(counts) - counts
            total = int(out_off[-1])
            wide = total >= 2**31 or vals.dtype.itemsize > 4
            base = (vals.astype(np.int64) - first).astype(vals.dtype if not wide else np.int64)
            expanded = np.repeat(base, counts)
            expanded += np.arange(total, dtype=expanded.dtype)
            out[name] = expanded.astype(vals.dtype, copy=False)
        else:
            out[name] = np.repeat(vals, counts)
    return out, out_off


def expand_row(row: dict) -> dict:
    """One row (a dict, e.g. from ``Table.to_pylist()``) in expanded form.

    A row already expanded (no run table) comes back as it is; otherwise the compact
    entries and the run table are replaced by the four token columns. Stored blobs
    (``bytes``, schema versions 4 and 5) come back as lists, as do version 3's lists; numpy
    arrays stay arrays. A version 5 row's targets need its inputs (:func:`swap_next`).

    Example:
        >>> expand_row({"compact_input_ids": [7, 9, 3], "run_starts": [1], "run_lengths": [3]})
        {'input_ids': [7, 9, 9, 9, 3]}
        >>> blob = lambda v: np.array(v, "<i4").tobytes()
        >>> expand_row({"compact_input_ids_i32le": blob([7, 9, 3]), "run_starts_i32le": blob([1]),
        ...             "run_lengths_i32le": blob([3])})
        {'input_ids': [7, 9, 9, 9, 3]}
    """
    version = runs_version(list(row))
    if version is None:
        return row
    compact_names, run_names = _names(version)
    cols = {name: _row_values(row[c], c) for name, c in zip(TOKEN_COLUMNS, compact_names, strict=True) if c in row}
    starts, lengths = (_row_values(row[c], c) for c in run_names)
    n = len(next(iter(cols.values()))) if cols else 0
    if _TARGET in row:
        if "input_ids" not in cols:
            raise ValueError(f"{_TARGET} is stored against the next input: read {COMPACT_COLUMNS[0]} with it")
        if len(cols["input_ids"]) != n or len(cols["target_ids"]) != n:
            raise ValueError(f"{COMPACT_COLUMNS[0]} and {_TARGET} of a row must have one length")
        cols["target_ids"] = swap_next(cols["target_ids"], cols["input_ids"], np.array([0, n]))
    full, _ = expand(cols, np.array([0, n]), starts, lengths, np.array([0, len(starts)]))
    out = {}
    for key, value in row.items():
        if key in run_names:
            continue
        if key in compact_names:
            name = TOKEN_COLUMNS[compact_names.index(key)]
            out[name] = full[name] if isinstance(value, np.ndarray) else full[name].tolist()
        else:
            out[key] = value
    return out


def _row_values(value, name: str) -> np.ndarray:
    """One row's stored values: a blob's int32s (no copy), or a list as it is."""
    if isinstance(value, bytes | bytearray | memoryview):
        if len(value) % 4:
            raise ValueError(f"{name}: {len(value)} bytes, not a multiple of 4 (int32 values)")
        return np.frombuffer(value, dtype=BLOB_DTYPE).astype(np.int32, copy=False)
    return np.asarray(value)


def loss_tokens(table: pa.Table, sample_tokens: np.ndarray) -> np.ndarray:
    """Tokens with a target (``target_ids != -100``) of each sample of a packed table, in
    any layout; ``sample_tokens`` are the samples' expanded lengths, back to back in
    pack order. Counted on the compact column: a run counts its length, and runs never
    cross samples.

    Example:
        >>> t = compact_table(pa.table({name: pa.array([[5, -100] + [7] * 4 + [8, 8, 8]], pa.list_(pa.int32()))
        ...                             for name in TOKEN_COLUMNS}))
        >>> loss_tokens(t, np.array([2, 7])).tolist()
        [1, 7]
    """
    sample_tokens = _i64(sample_tokens)
    version = runs_version(table)
    if version is None:
        vals, off = column_parts(table.column("target_ids"))
        hit = (vals[off[0]:off[-1]] != -100).astype(np.int64)
        return np.add.reduceat(hit, np.cumsum(sample_tokens) - sample_tokens) if len(sample_tokens) else hit
    compact_names, run_names = _names(version)
    vals, off = token_parts(table, compact_names[TOKEN_COLUMNS.index("target_ids")])
    starts, run_off = column_parts(table.column(run_names[0]))
    lengths, _ = column_parts(table.column(run_names[1]))
    counts = _counts(int(off[-1] - off[0]), off, starts[run_off[0]:run_off[-1]], lengths[run_off[0]:run_off[-1]],
                     run_off - run_off[0])
    first = np.cumsum(counts) - counts  # expanded index of each stored value
    sample = np.searchsorted(np.cumsum(sample_tokens), first, side="right")
    hit = np.where(vals[off[0]:off[-1]] != -100, counts, 0)
    return np.bincount(sample, weights=hit, minlength=len(sample_tokens)).astype(np.int64)


def runs_version(table) -> int | None:
    """The runs form a table, schema or list of column names holds: 5 (int32 blobs, targets
    against the next input), 4 (int32 blobs), 3 (``list<int32>``), or ``None`` (expanded
    token columns). A selection without the version 5 target column says 4: the other five
    columns did not change between the two, so they read the same either way."""
    names = table.names if isinstance(table, pa.Schema) else (
        table.column_names if isinstance(table, pa.Table | pa.RecordBatch) else list(table))
    if _TARGET in names:
        return 5
    if RUN_COLUMNS[0] in names or V4_COMPACT_COLUMNS[1] in names:
        return 4
    if V3_RUN_COLUMNS[0] in names:
        return 3
    return None


def is_runs_table(table: pa.Table | pa.Schema) -> bool:
    """Whether a table (or schema) holds token columns in runs form (schema version 3, 4 or 5)."""
    return runs_version(table) is not None


def _names(version: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The compact and run-table column names of a runs-form version."""
    return {5: (COMPACT_COLUMNS, RUN_COLUMNS), 4: (V4_COMPACT_COLUMNS, RUN_COLUMNS)}.get(
        version, (V3_COMPACT_COLUMNS, V3_RUN_COLUMNS))


def stored_names(schema, columns: list[str]) -> list[str]:
    """The columns to read from a shard of ``schema`` for ``columns`` named as a trainer sees
    them: a token column becomes its compact twin, and the run table is added when any token
    column is asked for (and, in schema version 5, the inputs when the targets are: they are
    stored against them). Expanded shards read ``columns`` as they are.

    Example:
        >>> stored_names(["pack_index", "compact_input_ids_i32le", "run_starts_i32le"], ["pack_index", "input_ids"])
        ['pack_index', 'compact_input_ids_i32le', 'run_starts_i32le', 'run_lengths_i32le']
        >>> stored_names([*COMPACT_COLUMNS, *RUN_COLUMNS], ["target_ids"])  # version 5: the inputs come along
        ['compact_target_ids_i32next', 'compact_input_ids_i32le', 'run_starts_i32le', 'run_lengths_i32le']
    """
    version = runs_version(schema)
    if version is None:
        return list(columns)
    compact_names, run_names = _names(version)
    out = [compact_names[TOKEN_COLUMNS.index(c)] if c in TOKEN_COLUMNS else c for c in columns]
    if _TARGET in out and compact_names[0] not in out:
        out.append(compact_names[0])
    if any(c in TOKEN_COLUMNS for c in columns):
        out += list(run_names)
    return out


def _one_array(col) -> pa.Array:
    if isinstance(col, pa.ChunkedArray):
        return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    return col


def blob_byte_offsets(col) -> np.ndarray:
    """Absolute byte offsets of the rows of a ``binary`` column (one chunk, or combined), no copy of the data.

    Example:
        >>> blob_byte_offsets(pa.array([b"abcd", b"", b"ef"]).slice(1)).tolist()
        [4, 4, 6]
    """
    arr = _one_array(col)
    width = np.int64 if pa.types.is_large_binary(arr.type) else np.int32
    buf = arr.buffers()[1]
    if buf is None or len(arr) == 0:
        return np.zeros(1, dtype=np.int64)
    return np.frombuffer(buf, dtype=width)[arr.offset:arr.offset + len(arr) + 1].astype(np.int64)


def column_parts(col) -> tuple[np.ndarray, np.ndarray]:
    """Flat int32 values and absolute row offsets (in values) of a stored token column: an
    int32 blob column (schema versions 4 and 5: the values are a view of Arrow's data buffer, offsets
    are its byte offsets // 4) or a ``list<int32>`` column (versions 1 to 3; a view of the
    list's values). No copy when the column is one chunk. Version 5 targets come back as
    stored; :func:`token_parts` decodes them.

    Raises:
        ValueError: on nulls, or a blob whose byte length is not a multiple of 4.

    Example:
        >>> vals, off = column_parts(pa.array([np.array([7, 9], "<i4").tobytes(), b"", np.array([3], "<i4").tobytes()]))
        >>> vals.tolist(), off.tolist()
        ([7, 9, 3], [0, 2, 2, 3])
    """
    arr = _one_array(col)
    if arr.null_count:
        raise ValueError("token columns may not hold nulls")
    if pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type):
        byte_off = blob_byte_offsets(arr)
        if np.any(byte_off & 3):
            raise ValueError("a stored token blob's byte length is not a multiple of 4 (int32 values)")
        data = arr.buffers()[2]
        n = int(byte_off[-1]) // 4
        vals = np.frombuffer(data, dtype=BLOB_DTYPE, count=n) if n else np.zeros(0, dtype=BLOB_DTYPE)
        return vals.astype(np.int32, copy=False), byte_off >> 2
    return arr.values.to_numpy(zero_copy_only=False), arr.offsets.to_numpy(zero_copy_only=False).astype(np.int64)


def token_parts(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Flat values and absolute row offsets of stored column ``name`` of ``table``, as the
    rows hold them: :func:`column_parts`, and for the version 5 target column the targets
    decoded against the table's inputs (:func:`swap_next`, a new array; offsets then start at 0).

    Raises:
        ValueError: as :func:`column_parts`; or version 5 targets without their inputs, or
        rows whose targets and inputs differ in length.
    """
    if name != _TARGET:
        return column_parts(table.column(name))
    if COMPACT_COLUMNS[0] not in table.column_names:
        raise ValueError(f"{_TARGET} is stored against the next input: read {COMPACT_COLUMNS[0]} with it")
    vals, rel = _from_zero(table.column(name))
    inputs, in_rel = _from_zero(table.column(COMPACT_COLUMNS[0]))
    if not np.array_equal(in_rel, rel):
        raise ValueError(f"{COMPACT_COLUMNS[0]} and {_TARGET} of a row must have one length")
    return swap_next(vals, inputs, rel), rel


def _from_zero(col) -> tuple[np.ndarray, np.ndarray]:
    """:func:`column_parts` with the values cut to the rows and the offsets starting at 0 (no copy)."""
    vals, off = column_parts(col)
    return vals[int(off[0]):int(off[-1])], off - off[0]


#: Bytes one binary array may hold (its offsets are int32).
_MAX_BLOB_BYTES = 2**31 - 1


def blob_array(values: np.ndarray, offsets: np.ndarray) -> pa.Array | pa.ChunkedArray:
    """Rows of int32 ``values`` at ``offsets`` (in values, from ``offsets[0]``) as an int32 blob
    column: one ``binary`` row per row, its values' little-endian bytes. The values are not
    copied (Arrow's data buffer is a view of ``values`` when they are int32 already). A batch
    past 2 GiB is cut into chunks at row boundaries (a row group never holds that much).

    Example:
        >>> blob_array(np.array([7, 9, 3], np.int32), np.array([0, 2, 3])).to_pylist() == [
        ...     np.array([7, 9], "<i4").tobytes(), np.array([3], "<i4").tobytes()]
        True
    """
    offsets = _i64(offsets)
    values = np.ascontiguousarray(_int32_values(values)[offsets[0]:offsets[-1]])
    rel = (offsets - offsets[0]) * 4
    n = len(offsets) - 1
    if rel[-1] <= _MAX_BLOB_BYTES:
        return pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(rel.astype(np.int32)), pa.py_buffer(values)])
    chunks, lo = [], 0
    while lo < n:
        hi = int(np.searchsorted(rel, rel[lo] + _MAX_BLOB_BYTES, side="right")) - 1
        if hi <= lo:
            raise ValueError(f"a row of {int(rel[lo + 1] - rel[lo]):,} bytes of tokens does not fit in one binary value "
                             "(2 GiB); lower max_tokens")
        chunks.append(blob_array(values, (rel[lo:hi + 1] - rel[0]) // 4))
        lo = hi
    return pa.chunked_array(chunks, type=pa.binary())


def compact_arrays(c: Compact) -> dict[str, pa.Array | pa.ChunkedArray]:
    """The six stored columns of a batch in runs form, by stored name in schema order: what a
    shard of schema version 5 holds for these rows (targets stored against the next input).

    Example:
        >>> c = compact({"input_ids": np.array([7] + [9] * 9 + [3]), "target_ids": np.full(11, -100),
        ...              "position_ids": np.arange(11), "subsegment_ids": np.zeros(11, int)}, np.array([0, 11]))
        >>> np.frombuffer(compact_arrays(c)["run_lengths_i32le"][0].as_py(), "<i4").tolist()
        [9]
    """
    cols = dict(c.columns)
    cols["target_ids"] = swap_next(cols["target_ids"], cols["input_ids"], c.offsets)
    offsets = _i64(c.offsets) - int(c.offsets[0])
    out = {name: blob_array(cols[tok], c.offsets if tok != "target_ids" else offsets)
           for name, tok in zip(COMPACT_COLUMNS, TOKEN_COLUMNS, strict=True)}
    out[RUN_COLUMNS[0]] = blob_array(c.run_starts, c.run_offsets)
    out[RUN_COLUMNS[1]] = blob_array(c.run_lengths, c.run_offsets)
    return out


def _list_array(values: np.ndarray, offsets: np.ndarray) -> pa.Array:
    offsets = _i64(offsets)
    rel = offsets - offsets[0]
    if rel[-1] >= 2**31:
        raise ValueError("a batch of token lists holds 2**31 values or more; write it in smaller batches")
    return pa.ListArray.from_arrays(pa.array(rel.astype(np.int32)), pa.array(values[offsets[0]:offsets[-1]], type=pa.int32()))


def blob_table(table: pa.Table) -> pa.Table:
    """A runs-form table of schema version 3 (``list<int32>`` columns) or 4 (int32 blobs) in the
    version 5 form: each stored column renamed, turned into int32 blobs (the values are not
    copied, only the offsets), and the targets stored against the next input (a new column,
    which needs the inputs in the table). Any other table comes back as it is."""
    version = runs_version(table)
    if version not in (3, 4):
        return table
    compact_names, _ = _names(version)
    old_target, old_input = compact_names[1], compact_names[0]
    names, cols = [], []
    for name, col in zip(table.column_names, table.columns, strict=True):
        if name == old_target:
            if old_input not in table.column_names:
                raise ValueError(f"{old_target} is stored against the next input in version 5: read {old_input} with it")
            vals, rel = _from_zero(col)
            inputs, in_rel = _from_zero(table.column(old_input))
            if not np.array_equal(rel, in_rel):
                raise ValueError(f"{old_input} and {old_target} of a row must have one length")
            names.append(_TARGET)
            cols.append(blob_array(swap_next(vals, inputs, rel), rel))
        elif name in _OLD_TO_NEW:
            names.append(_OLD_TO_NEW[name])
            cols.append(col if version == 4 else blob_array(*column_parts(col)))
        else:
            names.append(name)
            cols.append(col)
    return pa.Table.from_arrays(cols, names=names)


def compact_table(table: pa.Table, min_run: int = MIN_RUN) -> pa.Table:
    """A table with the four expanded token columns in runs form (schema version 5): each ``X``
    becomes its stored twin (``compact_X_i32le``; ``compact_target_ids_i32next``) at its
    place, and ``run_starts_i32le``, ``run_lengths_i32le`` follow the last of them. A table in
    runs form comes back in the version 5 form."""
    if is_runs_table(table):
        return blob_table(table)
    parts = [column_parts(table.column(name)) for name in TOKEN_COLUMNS]
    offsets = parts[0][1]
    for _, off in parts[1:]:
        if not np.array_equal(off - off[0], offsets - offsets[0]):
            raise ValueError("token columns of a row must have one length")
    c = compact({name: vals[int(off[0]):int(off[-1])] for name, (vals, off) in zip(TOKEN_COLUMNS, parts, strict=True)},
                offsets - offsets[0], min_run)
    stored = compact_arrays(c)
    names, cols = [], []
    last = max(table.column_names.index(name) for name in TOKEN_COLUMNS)
    for i, name in enumerate(table.column_names):
        if name in TOKEN_COLUMNS:
            names.append(COMPACT_COLUMNS[TOKEN_COLUMNS.index(name)])
            cols.append(stored[names[-1]])
        else:
            names.append(name)
            cols.append(table.column(i))
        if i == last:
            names += list(RUN_COLUMNS)
            cols += [stored[n] for n in RUN_COLUMNS]
    return pa.Table.from_arrays(cols, names=names)


def read_expanded(source, columns: list[str] | None = None, **kwargs) -> pa.Table:
    """``pyarrow.parquet.read_table`` of a tokenized or packed shard, token columns expanded
    whatever the layout: the plain way to read a shard as documented.

    ``columns`` name expanded columns (``input_ids``, ...); for a runs-form shard they are
    read as their compact twins plus the run table, then expanded.

    Example:
        >>> read_expanded("packed/part-00000-00000.parquet", ["pack_index", "input_ids"])  # doctest: +SKIP
    """
    import pyarrow.parquet as pq

    if columns is not None:
        columns = stored_names(pq.read_schema(source), columns)
    return expand_table(pq.read_table(source, columns=columns, **kwargs))


def expand_table(table: pa.Table) -> pa.Table:
    """A table in runs form (schema version 3, 4 or 5) with its token columns expanded: each
    compact column present becomes ``X`` (``list<int32>``) at its place and the run table is
    dropped. A table without a run table (expanded already) comes back as it is. Version 5
    targets need the inputs in the table (:func:`stored_names` adds them)."""
    version = runs_version(table)
    if version is None:
        return table
    compact_names, run_names = _names(version)
    present = [c for c in compact_names if c in table.column_names]
    if run_names[1] not in table.column_names:
        raise ValueError(f"a table in runs form needs both {run_names[0]} and {run_names[1]}")
    starts, run_off = column_parts(table.column(run_names[0]))
    lengths, len_off = column_parts(table.column(run_names[1]))
    if not np.array_equal(run_off - run_off[0], len_off - len_off[0]):
        raise ValueError(f"run table: {run_names[0]} and {run_names[1]} of a row must have one length")
    parts = {TOKEN_COLUMNS[compact_names.index(c)]: token_parts(table, c) for c in present}
    parts = {name: (vals[int(off[0]):int(off[-1])], off - off[0]) for name, (vals, off) in parts.items()}  # from 0
    offsets = next(iter(parts.values()))[1] if parts else None
    for _, off in parts.values():
        if not np.array_equal(off, offsets):
            raise ValueError("compact token columns of a row must have one length")
    if not parts:
        full, out_off = {}, None
    elif run_off[-1] == run_off[0]:  # no runs in these rows: the compact values are the rows, no copy
        full, out_off = {name: vals for name, (vals, _) in parts.items()}, offsets
    else:
        full, out_off = expand({name: vals for name, (vals, _) in parts.items()}, offsets,
                               starts[int(run_off[0]):int(run_off[-1])], lengths[int(len_off[0]):int(len_off[-1])],
                               run_off - run_off[0])
    names, cols = [], []
    for i, name in enumerate(table.column_names):
        if name in run_names:
            continue
        if name in compact_names:
            plain = TOKEN_COLUMNS[compact_names.index(name)]
            names.append(plain)
            cols.append(_list_array(full[plain], out_off))
        else:
            names.append(name)
            cols.append(table.column(i))
    return pa.Table.from_arrays(cols, names=names)
