"""``runs``: the run-length layout of token columns round-trips exactly, and says no to bad run tables."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from naive import compact_row

from packtool.runs import (
    COMPACT_COLUMNS,
    MIN_RUN,
    RUN_COLUMNS,
    TOKEN_COLUMNS,
    compact,
    compact_arrays,
    compact_table,
    expand,
    expand_row,
    expand_table,
)
from packtool.schema import PREFIX_SUBSEGMENT

SEEDS = range(40)


def _branch(rng: np.random.Generator, n_lo: int, n_hi: int) -> tuple[list[int], list[bool]]:
    """Token ids and loss flags of one conversation: text, Qwen-like spans (one pad run),
    Molmo2-like spans (rows of patches split by a column token), and stretches of exactly
    1, MIN_RUN - 1 and MIN_RUN repeated tokens."""
    ids: list[int] = []
    loss: list[bool] = []
    target = int(rng.integers(n_lo, n_hi))
    while len(ids) < target:
        kind = rng.integers(6)
        if kind == 0:  # text
            k = int(rng.integers(1, 12))
            ids += rng.integers(0, 50, k).tolist()
            loss += (rng.random(k) < 0.5).tolist()
        elif kind == 1:  # one Qwen-like span
            k = int(rng.integers(1, 300))
            ids += [151655] * k
            loss += [False] * k
        elif kind == 2:  # Molmo2-like: rows of patches, a column token after each row
            w, h = int(rng.integers(1, 14)), int(rng.integers(1, 6))
            for _ in range(h):
                ids += [7] * w + [8]
                loss += [False] * (w + 1)
        else:  # a repeated token near the threshold, with or without loss
            k = int(rng.choice([1, MIN_RUN - 1, MIN_RUN, MIN_RUN + 1]))
            ids += [int(rng.integers(0, 3))] * k
            loss += [bool(rng.random() < 0.5)] * k
    return ids, loss


def _row(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """An expanded tokenized or packed row: one or more samples, each a tree (shared prefix
    then branches restarting positions) or a single branch; runs may end the row."""
    parts = {name: [] for name in TOKEN_COLUMNS}
    for k in range(int(rng.integers(1, 4))):
        prefix, ploss = _branch(rng, 0, 400)
        branches = [_branch(rng, 1, 120) for _ in range(int(rng.integers(0, 3)))]
        segs = [(prefix, ploss, 0, PREFIX_SUBSEGMENT)] + [(b, bl, len(prefix), j) for j, (b, bl) in enumerate(branches)]
        for ids, loss, pos0, sub in segs:
            tgt = np.where(np.append(loss[1:], False), np.append(ids[1:], 0), -100)
            parts["input_ids"].append(np.array(ids, dtype=np.int32))
            parts["target_ids"].append(tgt.astype(np.int32))
            parts["position_ids"].append(np.arange(pos0, pos0 + len(ids), dtype=np.int32))
            parts["subsegment_ids"].append(np.full(len(ids), k * 100_000 + sub, dtype=np.int32))
    return {name: np.concatenate(v) if v else np.zeros(0, np.int32) for name, v in parts.items()}


def _batch(rng: np.random.Generator, n_rows: int):
    rows = [_row(rng) for _ in range(n_rows)]
    if n_rows > 1:
        rows[int(rng.integers(n_rows))] = {name: np.zeros(0, np.int32) for name in TOKEN_COLUMNS}  # an empty row
    offsets = np.concatenate([[0], np.cumsum([len(r["input_ids"]) for r in rows])])
    flat = {name: np.concatenate([r[name] for r in rows]) for name in TOKEN_COLUMNS}
    return rows, flat, offsets


@pytest.mark.parametrize("seed", SEEDS)
def test_expand_inverts_compact_and_matches_the_twin(seed):
    rng = np.random.default_rng(seed)
    rows, flat, offsets = _batch(rng, int(rng.integers(1, 6)))
    c = compact(flat, offsets)
    for r, row in enumerate(rows):
        stored, starts, lengths = compact_row(*(row[name] for name in TOKEN_COLUMNS), MIN_RUN)
        a, b = c.offsets[r], c.offsets[r + 1]
        ra, rb = c.run_offsets[r], c.run_offsets[r + 1]
        for name, want in zip(TOKEN_COLUMNS, stored, strict=True):
            assert c.columns[name][a:b].tolist() == want, f"seed {seed} row {r} {name}"
        assert c.run_starts[ra:rb].tolist() == starts, f"seed {seed} row {r}"
        assert c.run_lengths[ra:rb].tolist() == lengths, f"seed {seed} row {r}"
    full, off = expand(c.columns, c.offsets, c.run_starts, c.run_lengths, c.run_offsets)
    assert off.tolist() == offsets.tolist(), f"seed {seed}"
    for name in TOKEN_COLUMNS:
        assert full[name].dtype == np.int32
        assert np.array_equal(full[name], flat[name]), f"seed {seed} {name}"


def test_spans_become_one_run_each_and_runs_end_rows():
    qwen = np.array([1, 2] + [9] * 2691 + [3], dtype=np.int32)
    molmo = np.array(([7] * 12 + [8]) * 3 + [7] * 12, dtype=np.int32)  # rows of patches; the last ends the row
    flat = {"input_ids": np.concatenate([qwen, molmo]), "target_ids": np.full(len(qwen) + len(molmo), -100, np.int32),
            "position_ids": np.concatenate([np.arange(len(qwen)), np.arange(len(molmo))]).astype(np.int32),
            "subsegment_ids": np.full(len(qwen) + len(molmo), PREFIX_SUBSEGMENT, np.int32)}
    c = compact(flat, np.array([0, len(qwen), len(qwen) + len(molmo)]))
    assert c.offsets.tolist() == [0, 4, 4 + 7]
    assert c.run_starts.tolist() == [2, 0, 2, 4, 6] and c.run_lengths.tolist() == [2691, 12, 12, 12, 12]
    assert c.run_offsets.tolist() == [0, 1, 5]


def test_positions_that_jump_or_restart_break_a_run():
    ids = np.full(2 * MIN_RUN, 5, np.int32)
    pos = np.concatenate([np.arange(MIN_RUN), np.arange(MIN_RUN)]).astype(np.int32)  # a second branch restarts
    c = compact({"input_ids": ids, "target_ids": np.full_like(ids, -100), "position_ids": pos,
                 "subsegment_ids": np.full_like(ids, 10_000)}, np.array([0, len(ids)]))
    assert c.run_starts.tolist() == [0, 1] and c.run_lengths.tolist() == [MIN_RUN, MIN_RUN]


@pytest.mark.parametrize("seed", range(5))
def test_tables_round_trip_through_arrow_slices(seed):
    rng = np.random.default_rng(100 + seed)
    rows, _, _ = _batch(rng, 7)
    table = pa.table({"sample_id": [f"s{i}" for i in range(len(rows))],
                      **{name: pa.array([r[name] for r in rows], pa.list_(pa.int32())) for name in TOKEN_COLUMNS},
                      "n_tokens": [len(r["input_ids"]) for r in rows]})
    runs = compact_table(table)
    assert runs.column_names == ["sample_id", *COMPACT_COLUMNS, *RUN_COLUMNS, "n_tokens"]
    assert compact_table(runs) is runs and expand_table(table) is table
    assert expand_table(runs).equals(table), f"seed {100 + seed}"
    sliced = runs.slice(2, 4)  # list offsets that do not start at 0
    assert expand_table(sliced).equals(table.slice(2, 4)), f"seed {100 + seed}"
    half = expand_table(runs.select([COMPACT_COLUMNS[0], *RUN_COLUMNS]).slice(3))
    assert half.column_names == ["input_ids"] and half.equals(table.select(["input_ids"]).slice(3))
    for i, row in enumerate(runs.slice(1, 3).to_pylist()):
        assert expand_row(row) == table.slice(1, 3).to_pylist()[i], f"seed {100 + seed}"


@pytest.mark.parametrize("starts, lengths, message", [
    ([3], [4], "outside its row"),
    ([-1], [4], "outside its row"),
    ([1], [0], "no tokens"),
    ([2, 1], [4, 4], "ascending"),
    ([1, 1], [4, 4], "ascending"),
])
def test_bad_run_tables_are_refused(starts, lengths, message):
    with pytest.raises(ValueError, match=message):
        expand({"input_ids": np.array([1, 2, 3])}, np.array([0, 3]), np.array(starts), np.array(lengths),
               np.array([0, len(starts)]))


def test_a_table_without_runs_expands_by_renaming():
    table = pa.table({name: pa.array([[1, 2, 3], [4]], pa.list_(pa.int32())) for name in TOKEN_COLUMNS})
    runs = compact_table(table)
    assert runs.column(RUN_COLUMNS[0]).to_pylist() == [b"", b""]
    back = expand_table(runs)
    assert back.equals(table)
    assert back.column("input_ids").chunk(0).values.buffers()[1].address == \
        runs.column(COMPACT_COLUMNS[0]).chunk(0).buffers()[2].address  # the blob's bytes, not a copy


@pytest.mark.parametrize("seed", range(3))
def test_stored_blobs_are_each_rows_little_endian_int32_values(seed):
    """Schema v5 stores each compact row as the bytes of its values (little-endian int32), read
    back as a numpy view of Arrow's buffer, the targets against the next input (decoded here
    one value at a time); v3's list form and v4's plain targets convert to the same columns."""
    from naive import list_form, plain_target_form, unswap_targets

    from packtool.runs import V3_COMPACT_COLUMNS, blob_table, column_parts, token_parts

    rng = np.random.default_rng(200 + seed)
    rows, _, _ = _batch(rng, 6)
    table = pa.table({name: pa.array([r[name] for r in rows], pa.list_(pa.int32())) for name in TOKEN_COLUMNS})
    runs = compact_table(table)
    old = list_form(runs)  # the struct-by-struct twin: the same values as version 3 stored them
    assert old.column_names == [*V3_COMPACT_COLUMNS, "run_starts", "run_lengths"]
    inputs = old.column(V3_COMPACT_COLUMNS[0]).to_pylist()
    for stored, name in zip(runs.column_names, old.column_names, strict=True):
        want = old.column(name).to_pylist()
        got = [np.frombuffer(b, "<i4").tolist() for b in runs.column(stored).to_pylist()]
        if stored == COMPACT_COLUMNS[1]:
            assert stored == "compact_target_ids_i32next"
            got = [unswap_targets(g, i) for g, i in zip(got, inputs, strict=True)]
            vals, off = token_parts(runs.slice(1), stored)
        else:
            vals, off = column_parts(runs.column(stored).slice(1))
        assert got == want, f"seed {200 + seed}"
        assert [vals[a:b].tolist() for a, b in zip(off[:-1], off[1:], strict=True)] == want[1:]
    # a view, not a copy: the numpy values live in the blob column's data buffer
    vals, _ = column_parts(runs.column(COMPACT_COLUMNS[0]))
    assert vals.__array_interface__["data"][0] == runs.column(COMPACT_COLUMNS[0]).chunk(0).buffers()[2].address
    # version 3's lists become the same blobs, and expand to the same rows
    assert blob_table(old).equals(runs) and compact_table(old).equals(runs)
    assert blob_table(plain_target_form(runs)).equals(runs)
    assert expand_table(old).equals(expand_table(runs)) and expand_table(runs).equals(table)
    assert [expand_row(r) for r in old.to_pylist()] == [expand_row(r) for r in runs.to_pylist()] == table.to_pylist()


def test_a_batch_past_the_binary_limit_is_cut_at_row_boundaries(monkeypatch):
    """A binary array holds at most 2 GiB; a bigger batch becomes chunks cut between rows (the
    limit lowered here to 40 bytes, i.e. 10 values), and a row alone past it is refused."""
    import packtool.runs as runs_mod

    monkeypatch.setattr(runs_mod, "_MAX_BLOB_BYTES", 40)
    values = np.arange(23, dtype=np.int32)
    offsets = np.array([0, 4, 8, 10, 17, 23])
    col = runs_mod.blob_array(values, offsets)
    assert isinstance(col, pa.ChunkedArray) and [len(c) for c in col.chunks] == [3, 1, 1]
    assert all(sum(len(b) for b in c.to_pylist()) <= 40 for c in col.chunks)
    vals, off = runs_mod.column_parts(col)
    assert vals.tolist() == values.tolist() and off.tolist() == offsets.tolist()
    with pytest.raises(ValueError, match="does not fit in one binary value"):
        runs_mod.blob_array(values, np.array([0, 11, 23]))


@pytest.mark.parametrize("blob, message", [
    (b"\x01\x00\x00", "not a multiple of 4"),
    (None, "nulls"),
])
def test_bad_blobs_are_refused(blob, message):
    from packtool.runs import column_parts

    with pytest.raises(ValueError, match=message):
        column_parts(pa.array([np.array([1, 2], "<i4").tobytes(), blob], pa.binary()))
    if blob is not None:
        with pytest.raises(ValueError, match=message):
            expand_row({COMPACT_COLUMNS[0]: blob, "run_starts_i32le": b"", "run_lengths_i32le": b""})


@pytest.mark.parametrize("seed", range(5))
def test_stored_targets_round_trip_every_int32_and_agree_with_the_naive_twin(seed):
    """``swap_next`` is its own inverse on any int32 targets, collisions with the mark (-1) and
    with the next input included, row ends left as they are; it agrees value by value with the
    one-at-a-time twin, and a row whose every token carries loss stores only the mark."""
    from naive import unswap_targets

    from packtool.runs import NEXT_MARK, swap_next

    rng = np.random.default_rng(300 + seed)
    lengths = rng.integers(0, 9, 40)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    n = int(offsets[-1])
    inputs = rng.choice(np.array([-1, 0, 3, 5, 2**31 - 1, -2**31], dtype=np.int32), n)
    nxt = np.append(inputs[1:], 0)
    # targets drawn from the colliding values: the next input, the mark, -100, anything
    targets = np.where(rng.random(n) < 0.4, nxt, rng.choice(np.array([-1, -100, 3, 5, -2**31], dtype=np.int32), n))
    targets = targets.astype(np.int32)
    stored = swap_next(targets, inputs, offsets)
    assert stored.dtype == np.int32
    assert np.array_equal(swap_next(stored, inputs, offsets), targets), f"seed {300 + seed}"
    for a, b in zip(offsets[:-1], offsets[1:], strict=True):
        assert unswap_targets(stored[a:b].tolist(), inputs[a:b].tolist()) == targets[a:b].tolist(), f"seed {300 + seed}"
        if b > a:
            assert stored[b - 1] == targets[b - 1]  # a row's last value has no next input
    # sliced input: offsets need not start at 0
    assert np.array_equal(swap_next(np.r_[[7, 7], targets], np.r_[[7, 7], inputs], offsets + 2), stored)
    text = np.array([11, 12, 13, 14], dtype=np.int32)
    assert swap_next(np.append(text[1:], -100), text, np.array([0, 4])).tolist() == [NEXT_MARK] * 3 + [-100]
    # a target past int32 is refused, as any stored value is, never wrapped on its way to the blob
    c = compact({"input_ids": np.array([1, 2]), "target_ids": np.array([2**31, -100]), "position_ids": np.arange(2),
                 "subsegment_ids": np.zeros(2, int)}, np.array([0, 2]))
    with pytest.raises(ValueError, match="fit in int32"):
        compact_arrays(c)


def test_stored_targets_need_their_inputs():
    """Version 5 targets cannot be read without the inputs they are stored against: the reader
    asks for both, and a table or row without them says which column to read."""
    from packtool.runs import stored_names, token_parts

    table = compact_table(pa.table({name: pa.array([[4, 5, 6]], pa.list_(pa.int32())) for name in TOKEN_COLUMNS}))
    assert stored_names(table.schema, ["target_ids"]) == [COMPACT_COLUMNS[1], COMPACT_COLUMNS[0], *RUN_COLUMNS]
    alone = table.select([COMPACT_COLUMNS[1], *RUN_COLUMNS])
    with pytest.raises(ValueError, match="read compact_input_ids_i32le with it"):
        token_parts(alone, COMPACT_COLUMNS[1])
    with pytest.raises(ValueError, match="read compact_input_ids_i32le with it"):
        expand_table(alone)
    with pytest.raises(ValueError, match="read compact_input_ids_i32le with it"):
        expand_row(alone.to_pylist()[0])
    assert expand_table(table.select([COMPACT_COLUMNS[1], COMPACT_COLUMNS[0], *RUN_COLUMNS])).column(
        "target_ids").to_pylist() == [[4, 5, 6]]
