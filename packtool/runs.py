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

__all__ = ["MIN_RUN", "TOKEN_COLUMNS", "COMPACT_COLUMNS", "RUN_COLUMNS", "Compact", "compact", "expand",
           "expanded_lengths", "loss_tokens", "is_runs_table", "compact_table", "expand_table", "read_expanded", "expand_row"]

#: Shortest stretch stored as a run. Every run costs 6 stored values (4 columns + start +
#: length) and saves ``4 x (L - 1)``; below a few tokens the run table's bookkeeping costs
#: more time on decode than the values it saves (measured in README "Benchmarks").
MIN_RUN = 8
#: The expanded token columns, in schema order.
TOKEN_COLUMNS = ("input_ids", "target_ids", "position_ids", "subsegment_ids")
#: Their stored names in the runs form: different names, so a reader that expects the
#: expanded columns fails loudly instead of reading compact data as if it were a row.
COMPACT_COLUMNS = tuple(f"compact_{name}" for name in TOKEN_COLUMNS)
#: The run table: where each run sits in the compact row and how many tokens it stands for.
RUN_COLUMNS = ("run_starts", "run_lengths")


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
    """One row (a dict of lists or arrays, e.g. from ``Table.to_pylist()``) in expanded form.

    A row already expanded (no ``run_starts``) comes back as it is; otherwise the
    ``compact_*`` entries and the run table are replaced by the four token columns.

    Example:
        >>> expand_row({"compact_input_ids": [7, 9, 3], "run_starts": [1], "run_lengths": [3]})
        {'input_ids': [7, 9, 9, 9, 3]}
    """
    if "run_starts" not in row:
        return row
    cols = {name: np.asarray(row[c]) for name, c in zip(TOKEN_COLUMNS, COMPACT_COLUMNS, strict=True) if c in row}
    n = len(next(iter(cols.values()))) if cols else 0
    full, _ = expand(cols, np.array([0, n]), np.asarray(row["run_starts"]), np.asarray(row["run_lengths"]),
                     np.array([0, len(row["run_starts"])]))
    out = {}
    for key, value in row.items():
        if key in RUN_COLUMNS:
            continue
        if key in COMPACT_COLUMNS:
            name = TOKEN_COLUMNS[COMPACT_COLUMNS.index(key)]
            out[name] = full[name].tolist() if isinstance(value, list) else full[name]
        else:
            out[key] = value
    return out


def loss_tokens(table: pa.Table, sample_tokens: np.ndarray) -> np.ndarray:
    """Tokens with a target (``target_ids != -100``) of each sample of a packed table, in
    either layout; ``sample_tokens`` are the samples' expanded lengths, back to back in
    pack order. Counted on the compact column: a run counts its length, and runs never
    cross samples.

    Example:
        >>> t = pa.table({"compact_target_ids": pa.array([[5, -100, 7, 8]], pa.list_(pa.int32())),
        ...               "run_starts": pa.array([[2]], pa.list_(pa.int32())),
        ...               "run_lengths": pa.array([[4]], pa.list_(pa.int32()))})
        >>> loss_tokens(t, np.array([2, 5])).tolist()
        [1, 5]
    """
    sample_tokens = _i64(sample_tokens)
    if not is_runs_table(table):
        vals, off = _list_parts(table.column("target_ids"))
        hit = (vals[off[0]:off[-1]] != -100).astype(np.int64)
        return np.add.reduceat(hit, np.cumsum(sample_tokens) - sample_tokens) if len(sample_tokens) else hit
    vals, off = _list_parts(table.column("compact_target_ids"))
    starts, run_off = _list_parts(table.column("run_starts"))
    lengths, _ = _list_parts(table.column("run_lengths"))
    counts = _counts(int(off[-1] - off[0]), off, starts[run_off[0]:run_off[-1]], lengths[run_off[0]:run_off[-1]],
                     run_off - run_off[0])
    first = np.cumsum(counts) - counts  # expanded index of each stored value
    sample = np.searchsorted(np.cumsum(sample_tokens), first, side="right")
    hit = np.where(vals[off[0]:off[-1]] != -100, counts, 0)
    return np.bincount(sample, weights=hit, minlength=len(sample_tokens)).astype(np.int64)


def is_runs_table(table: pa.Table | pa.Schema) -> bool:
    """Whether a table (or schema) holds token columns in runs form."""
    names = table.names if isinstance(table, pa.Schema) else table.column_names
    return "run_starts" in names


def _list_parts(col) -> tuple[np.ndarray, np.ndarray]:
    """Flat values and absolute offsets of a ``list<int32>`` column (no copy when it is one chunk)."""
    arr = col.chunk(0) if isinstance(col, pa.ChunkedArray) and col.num_chunks == 1 else (
        col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col)
    if arr.null_count:
        raise ValueError("token columns may not hold nulls")
    return arr.values.to_numpy(zero_copy_only=False), arr.offsets.to_numpy(zero_copy_only=False).astype(np.int64)


def _list_array(values: np.ndarray, offsets: np.ndarray) -> pa.Array:
    offsets = _i64(offsets)
    rel = offsets - offsets[0]
    if rel[-1] >= 2**31:
        raise ValueError("a batch of token lists holds 2**31 values or more; write it in smaller batches")
    return pa.ListArray.from_arrays(pa.array(rel.astype(np.int32)), pa.array(values, type=pa.int32()))


def compact_table(table: pa.Table, min_run: int = MIN_RUN) -> pa.Table:
    """A table with the four expanded token columns in runs form: each ``X`` becomes
    ``compact_X`` at its place, and ``run_starts``, ``run_lengths`` follow the last of them.
    A table already in runs form comes back as it is."""
    if is_runs_table(table):
        return table
    parts = [_list_parts(table.column(name)) for name in TOKEN_COLUMNS]
    offsets = parts[0][1]
    for _, off in parts[1:]:
        if not np.array_equal(off - off[0], offsets - offsets[0]):
            raise ValueError("token columns of a row must have one length")
    c = compact({name: vals[int(off[0]):int(off[-1])] for name, (vals, off) in zip(TOKEN_COLUMNS, parts, strict=True)},
                offsets - offsets[0], min_run)
    names, cols = [], []
    last = max(table.column_names.index(name) for name in TOKEN_COLUMNS)
    for i, name in enumerate(table.column_names):
        if name in TOKEN_COLUMNS:
            names.append(f"compact_{name}")
            cols.append(_list_array(c.columns[name], c.offsets))
        else:
            names.append(name)
            cols.append(table.column(i))
        if i == last:
            names += list(RUN_COLUMNS)
            cols += [_list_array(c.run_starts, c.run_offsets), _list_array(c.run_lengths, c.run_offsets)]
    return pa.Table.from_arrays(cols, names=names)


def read_expanded(source, columns: list[str] | None = None, **kwargs) -> pa.Table:
    """``pyarrow.parquet.read_table`` of a tokenized or packed shard, token columns expanded
    whatever the layout: the plain way to read a shard as documented.

    ``columns`` name expanded columns (``input_ids``, ...); for a runs-form shard they are
    read as their ``compact_*`` twins plus the run table, then expanded.

    Example:
        >>> read_expanded("packed/part-00000-00000.parquet", ["pack_index", "input_ids"])  # doctest: +SKIP
    """
    import pyarrow.parquet as pq

    if columns is not None and is_runs_table(pq.read_schema(source)):
        wanted = [f"compact_{c}" if c in TOKEN_COLUMNS else c for c in columns]
        if any(c in TOKEN_COLUMNS for c in columns):
            wanted += list(RUN_COLUMNS)
        columns = wanted
    return expand_table(pq.read_table(source, columns=columns, **kwargs))


def expand_table(table: pa.Table) -> pa.Table:
    """A table in runs form with its token columns expanded: each ``compact_X`` present becomes
    ``X`` at its place and the run table is dropped. A table without a run table (expanded
    already) comes back as it is."""
    if not is_runs_table(table):
        return table
    present = [c for c in COMPACT_COLUMNS if c in table.column_names]
    if "run_lengths" not in table.column_names:
        raise ValueError("a table in runs form needs both run_starts and run_lengths")
    starts, run_off = _list_parts(table.column("run_starts"))
    lengths, len_off = _list_parts(table.column("run_lengths"))
    if not np.array_equal(run_off - run_off[0], len_off - len_off[0]):
        raise ValueError("run table: run_starts and run_lengths of a row must have one length")
    if not present:
        return table.drop_columns(list(RUN_COLUMNS))
    if run_off[-1] == run_off[0]:  # no runs in these rows: the compact columns are the rows, no copy
        return table.drop_columns(list(RUN_COLUMNS)).rename_columns(
            [TOKEN_COLUMNS[COMPACT_COLUMNS.index(c)] if c in COMPACT_COLUMNS else c
             for c in table.drop_columns(list(RUN_COLUMNS)).column_names])
    parts = {TOKEN_COLUMNS[COMPACT_COLUMNS.index(c)]: _list_parts(table.column(c)) for c in present}
    offsets = next(iter(parts.values()))[1]
    for _, off in parts.values():
        if not np.array_equal(off - off[0], offsets - offsets[0]):
            raise ValueError("compact token columns of a row must have one length")
    cols_np = {name: vals[int(off[0]):int(off[-1])] for name, (vals, off) in parts.items()}
    full, out_off = expand(cols_np, offsets - offsets[0], starts[int(run_off[0]):int(run_off[-1])],
                           lengths[int(len_off[0]):int(len_off[-1])], run_off - run_off[0])
    names, cols = [], []
    for i, name in enumerate(table.column_names):
        if name in RUN_COLUMNS:
            continue
        if name in COMPACT_COLUMNS:
            plain = TOKEN_COLUMNS[COMPACT_COLUMNS.index(name)]
            names.append(plain)
            cols.append(_list_array(full[plain], out_off))
        else:
            names.append(name)
            cols.append(table.column(i))
    return pa.Table.from_arrays(cols, names=names)
