"""Buffer policy, oversize handling, item cap, tail re-optimization and vectorized assembly."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packtool.config import PackConfig
from packtool.errors import OversizeSampleError
from packtool.knapsack import KnapsackSolver
from packtool.packer import (
    MAX_UNIT_CELLS,
    RelaxedUnitSolver,
    assemble_packs,
    gather_runs,
    plan_packs,
    unit_axis,
    unit_granularity,
)
from packtool.runs import compact_table, expand_table
from packtool.schema import PACKED, PACKED_FULL, SUBSEGMENT_STRIDE

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.naive import brute_force_knapsack, list_form, pack_capacity_ok  # noqa: E402
from tests.naive import gather_runs as naive_gather_runs  # noqa: E402

JIT = os.environ.get("NUMBA_DISABLE_JIT", "0") != "1"
# small capacities keep the table tiny when the kernels run as plain Python
MAX_TOKENS, GRAN, MAX_UNITS = (4096, 16, 32) if JIT else (256, 16, 6)


def _packs(plan):
    return [plan.order[plan.offsets[p]:plan.offsets[p + 1]].tolist() for p in range(plan.n_packs)]


def _cfg(**kw):
    base = dict(max_tokens=MAX_TOKENS, token_granularity=GRAN, buffer_size=16, vision_weight=30)
    return PackConfig(**{**base, **kw})


samples = st.lists(st.tuples(st.integers(1, MAX_TOKENS + MAX_TOKENS // 4), st.integers(0, MAX_UNITS + 2)),
                   min_size=0, max_size=60 if JIT else 25)


@settings(max_examples=40 if JIT else 12, deadline=None)
@given(samples, st.sampled_from(["drop", "alone", "truncate"]), st.integers(1, 20), st.none() | st.integers(1, 4),
       st.booleans())
def test_every_sample_once_capacities_kept_deterministic(items, oversize, buffer_size, max_k, anchor):
    tokens = np.array([t for t, _ in items], dtype=np.int64)
    units = np.array([u for _, u in items], dtype=np.int64)
    has_media = units > 0
    cfg = _cfg(oversize=oversize, buffer_size=buffer_size, max_samples_per_pack=max_k)
    plan = plan_packs(tokens, units, has_media, cfg, MAX_UNITS, anchor=anchor)
    again = plan_packs(tokens.copy(), units.copy(), has_media.copy(), cfg, MAX_UNITS, anchor=anchor)
    assert plan.order.tolist() == again.order.tolist() and plan.offsets.tolist() == again.offsets.tolist()
    placed = plan.order.tolist()
    assert sorted(placed + plan.dropped) == list(range(len(tokens)))  # each sample exactly once
    eff = tokens.copy()
    eff[plan.truncated] = MAX_TOKENS
    alone = set(plan.alone)
    regular = [p for p in _packs(plan) if not (len(p) == 1 and p[0] in alone)]
    assert pack_capacity_ok(eff, units, regular, MAX_TOKENS, MAX_UNITS)
    assert all(len(p) >= 1 for p in _packs(plan))
    if max_k is not None:
        assert all(len(p) <= max_k for p in regular)
    for i in plan.truncated:
        assert not has_media[i] and tokens[i] > MAX_TOKENS
    assert plan.tail_packs_saved >= 0


@pytest.mark.skipif(os.environ.get("NUMBA_DISABLE_JIT") == "1", reason="nothing is compiled")
def test_a_kernel_load_that_takes_long_says_it_compiles_and_a_quick_one_says_nothing(monkeypatch, caplog):
    """The first pack on a machine compiles the kernels for a minute or two with nothing on screen;
    a load past ``COMPILE_NOTICE_AFTER`` says so, once per process; a load from the cache is silent."""
    import time

    import packtool.packer as packer

    real = packer._buffer_packs

    def slow(*args, **kwargs):  # as a compile would be: the real loop, late
        time.sleep(0.6)
        return real(*args, **kwargs)

    monkeypatch.setattr(packer, "_warm", False)
    monkeypatch.setattr(packer, "_buffer_packs", slow)
    monkeypatch.setattr(packer, "COMPILE_NOTICE_AFTER", 0.05)
    plan = plan_packs(np.array([3, 4]), np.array([0, 0]), np.array([False, False]), PackConfig(max_tokens=8, token_granularity=1), 0)
    assert plan.order.tolist() == [0, 1] and packer._warm
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("WARNING", packer.COMPILING)]
    assert "first pack on a machine" in packer.COMPILING
    caplog.clear()
    plan_packs(np.array([3]), np.array([0]), np.array([False]), PackConfig(max_tokens=8, token_granularity=1), 0)  # once a process
    monkeypatch.setattr(packer, "_warm", False)
    monkeypatch.setattr(packer, "_buffer_packs", real)
    monkeypatch.setattr(packer, "COMPILE_NOTICE_AFTER", 3.0)
    packer.warm_kernels()  # loaded in this process already: well under the threshold
    assert caplog.records == [] and packer._warm


def test_processes_of_a_machine_load_the_kernels_one_at_a_time(monkeypatch, caplog):
    """The ``pack`` command and the forkserver it starts both warm the kernels: on a machine's
    first pack both compiled at once and both said so. A process that finds another loading
    first waits for it (then loads from the cache, silently); processes that came while it
    loaded load side by side, not one behind another (a node's Ray workers start together)."""
    import subprocess
    import sys
    import threading

    import packtool.packer as packer

    holder = subprocess.Popen([sys.executable, "-c", "import sys\nfrom packtool.packer import _kernel_lock\n"
                               "with _kernel_lock():\n    print('held', flush=True)\n    sys.stdin.readline()\n"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        monkeypatch.setattr(packer, "_warm", False)
        monkeypatch.setattr(packer, "COMPILE_NOTICE_AFTER", 0.05)
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (packer.warm_kernels(), done.set()), daemon=True)
        waiter.start()
        assert not done.wait(0.5) and not packer._warm  # waiting for the other process...
        assert caplog.records == []  # ... and not saying it compiles (the notice is the loader's)
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert done.wait(60) and packer._warm
        waiter.join()
    finally:
        holder.kill()
        holder.wait()
    # one that waited holds the lock shared while it loads: another comes in beside it
    sharer = subprocess.Popen([sys.executable, "-c", "import fcntl, sys\nfrom packtool.packer import _kernel_lock_path\n"
                               "fh = open(_kernel_lock_path(), 'a+b')\nfcntl.flock(fh, fcntl.LOCK_SH)\n"
                               "print('held', flush=True)\nsys.stdin.readline()\n"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert sharer.stdout.readline() == "held\n"
        monkeypatch.setattr(packer, "_warm", False)
        done = threading.Event()
        beside = threading.Thread(target=lambda: (packer.warm_kernels(), done.set()), daemon=True)
        beside.start()
        assert done.wait(60) and packer._warm  # done while the other still holds it shared
    finally:
        sharer.kill()
        sharer.wait()


def test_a_forkserver_logs_as_the_command_line_does():
    """A forkserver has no log handler: its compile notice came out as a bare line beside the
    command's ``WARNING packtool.packer: ...``; it is configured to say it the same way."""
    import subprocess
    import sys

    code = ("import logging\nfrom packtool.preload import command_line_logging\ncommand_line_logging()\n"
            "command_line_logging()\nlogging.getLogger('packtool.packer').warning('compiling')\n"
            "logging.getLogger('packtool.packer').info('quiet')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stderr == "WARNING packtool.packer: compiling\n"


def test_oversize_policies():
    tokens = np.array([100, MAX_TOKENS + 5, MAX_TOKENS * 2, 50])
    units = np.array([1, 0, 2, MAX_UNITS + 1])
    has_media = units > 0
    drop = plan_packs(tokens, units, has_media, _cfg(oversize="drop"), MAX_UNITS)
    assert drop.dropped == [1, 2, 3] and drop.order.tolist() == [0]
    trunc = plan_packs(tokens, units, has_media, _cfg(oversize="truncate"), MAX_UNITS)
    # text-only sample 1 is cut; sample 2 has media and 3 too many units: never cut
    assert trunc.truncated == [1] and trunc.dropped == [2, 3]
    alone = plan_packs(tokens, units, has_media, _cfg(oversize="alone"), MAX_UNITS)
    assert alone.alone == [1, 2, 3] and _packs(alone)[-3:] == [[1], [2], [3]]
    with pytest.raises(OversizeSampleError, match="--oversize drop"):
        plan_packs(tokens, units, has_media, _cfg(oversize="fail"), MAX_UNITS)


def test_largest_sample_anchors_and_rest_is_exact_fill():
    # capacity 4096/16 = 256 granules; sample 2 is largest and must be in the first pack
    if not JIT:
        return
    tokens = np.array([992, 1200, 3008, 992, 96])
    units = np.zeros(5, dtype=np.int64)
    plan = plan_packs(tokens, units, units > 0, _cfg(buffer_size=5, vision_weight=0), MAX_UNITS, anchor=True)
    # 3008 + 992 + 96 fills exactly; of the two equal 992s the older one wins the tie
    assert _packs(plan)[0] == [0, 2, 4]


def test_tail_reoptimization_never_worse_and_sometimes_better():
    rng = np.random.default_rng(3)
    saved = 0
    for _ in range(15 if JIT else 4):
        n = 120 if JIT else 30
        units = rng.integers(0, MAX_UNITS // 2 + 2, n)
        tokens = rng.integers(MAX_TOKENS // 8, MAX_TOKENS // 2, n)
        plan = plan_packs(tokens, units, units > 0, _cfg(buffer_size=24), MAX_UNITS)
        assert plan.tail_packs_saved >= 0
        saved += plan.tail_packs_saved
        lb = max(-(-tokens.sum() // MAX_TOKENS), -(-units.sum() // MAX_UNITS))
        assert plan.n_packs >= lb
    assert saved >= 0


@pytest.mark.parametrize("seed", range(6))
def test_compiled_buffer_loop_makes_the_python_loops_packs(seed):
    """The compiled buffer loop (the default solver) and the Python loop (any other solver)
    call the same solve on the same buffers: the same packs and flush count, through zero
    values (the forced first pick) and values that need an int32 or int64 table mid-stream."""
    from packtool.packer import _buffer_packs

    class PythonLoop(KnapsackSolver):  # any subclass takes the Python loop
        pass

    rng = np.random.default_rng(seed)
    for trial in range(8 if JIT else 2):
        n = int(rng.integers(1, 300 if JIT else 40))
        cap_w, cap_u = int(rng.integers(8, 400)), int(rng.choice([0, int(rng.integers(1, 200))]))
        qw = rng.integers(0, cap_w + 1, n)
        qu = rng.integers(0, cap_u + 1, n) if cap_u else np.zeros(n, dtype=np.int64)
        v = [rng.integers(0, 50, n) * (rng.random(n) < 0.9), qw * 1000 + qu, rng.integers(0, 2**40, n),
             np.zeros(n, dtype=np.int64)][trial % 4]
        stream = np.flatnonzero(rng.random(n) < 0.9)
        size = int(rng.integers(1, 70))
        got = _buffer_packs(stream, qw, qu, v, cap_w, cap_u, size, None)
        want = _buffer_packs(stream, qw, qu, v, cap_w, cap_u, size, None, make=PythonLoop)
        assert got[-1] == want[-1], f"seed {seed} trial {trial}: flush packs differ"
        assert [p.tolist() for p in got[:-1]] == [p.tolist() for p in want[:-1]], f"seed {seed} trial {trial}"


def test_unit_granularity_keeps_packs_within_large_capacities():
    assert unit_granularity(128) == 1 and unit_granularity(1024) == 1 and unit_granularity(16384) == 16
    if not JIT:
        return
    rng = np.random.default_rng(1)
    units = rng.integers(100, 3000, 200)
    tokens = rng.integers(50, 1000, 200)
    plan = plan_packs(tokens, units, units > 0, _cfg(), 16384)
    assert pack_capacity_ok(tokens, units, _packs(plan), MAX_TOKENS, 16384)


def _qwen_like(rng, n, g, cap_w):
    """Token weights and patch counts with ``units <= ratio * g * qw`` (Qwen: 4 patches per
    placeholder token), the capacity ``ratio * g * cap_w`` (the default: 4 x max_tokens)."""
    tokens = rng.integers(1, g * cap_w // 2 + 1, n)
    vt = (tokens * rng.random(n)).astype(np.int64) * (rng.random(n) < 0.85)
    return tokens, 4 * vt


@pytest.mark.parametrize("seed", range(40))
def test_redundant_unit_axis_matches_the_two_dimensional_twin(seed):
    """Dropping a unit capacity that cannot bind gives the brute-force 2-D optimum and the
    very subset its tie rule picks (the feasible subsets are the same)."""
    rng = np.random.default_rng(seed)
    g, cap_w = 4, int(rng.integers(8, 40))
    n = int(rng.integers(1, 13))
    tokens, units = _qwen_like(rng, n, g, cap_w)
    qw = np.minimum(-(-tokens // g), cap_w)
    max_units = 4 * g * cap_w + int(rng.integers(0, 3)) * MAX_UNIT_CELLS
    if max_units <= MAX_UNIT_CELLS:
        max_units += MAX_UNIT_CELLS
    assert unit_axis(qw, units, cap_w, max_units)[1:] == (0, "redundant")
    v = tokens + int(rng.integers(0, 3)) * units
    want = brute_force_knapsack(qw, units, v, cap_w, max_units)
    got = KnapsackSolver(cap_w, 0).solve(qw, np.zeros(n, dtype=np.int64), v)
    assert got[0] == want[0] and (got[1] == want[1]).all()


def test_unit_axis_cases():
    qw = np.array([10, 4, 7])
    assert unit_axis(qw, np.array([1, 2, 3]), 100, 128) == (1, 128, "exact")
    assert unit_axis(qw, np.array([640, 256, 448]), 100, 6400) == (1, 0, "redundant")
    # one sample over the ratio: the capacity may bind; the units' divisor keeps it exact
    assert unit_axis(qw, np.array([648, 256, 448]), 100, 6400) == (8, 800, "exact")
    assert unit_axis(qw, np.array([649, 256, 448]), 100, 6400) == (1, 6400, "relaxed")
    assert unit_axis(qw, np.zeros(3, dtype=np.int64), 100, 6400)[2] == "redundant"


@pytest.mark.parametrize("seed", range(60))
def test_relaxed_unit_solver_matches_the_brute_force_twin(seed):
    """Relaxation first, exact table when its subset does not fit: the brute-force optimum
    and tie-rule subset every time, with and without an item limit and per-call capacities."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 12))
    cap_w, cap_u, q = int(rng.integers(5, 40)), int(rng.integers(40, 200)), int(rng.integers(2, 9))
    w = rng.integers(0, cap_w // 2 + 2, n)
    u = rng.integers(0, cap_u // 2 + 2, n)
    v = rng.integers(0, 50, n)
    max_k = None if seed % 3 else int(rng.integers(1, 4))
    solver = RelaxedUnitSolver(cap_w, cap_u, max_k, q=q)
    for cw, cu in ((cap_w, cap_u), (cap_w - 1, cap_u - int(rng.integers(0, 30)))):
        want = brute_force_knapsack(w, u, v, cw, cu, max_k)
        got = solver.solve(w, u, v, cw, cu)
        assert got[0] == want[0] and (got[1] == want[1]).all()
    assert solver.quantized == 0 and solver.relaxed_ok + solver.exact_solves == 2


def test_relaxed_unit_solver_rounds_up_only_when_the_exact_table_is_too_large(monkeypatch):
    import packtool.knapsack as knapsack

    solver = RelaxedUnitSolver(8, 3000, q=1000)
    monkeypatch.setattr(knapsack, "MAX_TABLE_BYTES", 200_000)  # the 8 x 3000 table no longer fits
    value, chosen = solver.solve(np.array([3, 4, 5]), np.array([1000, 1000, 2001]), np.array([3, 4, 5]))
    assert solver.quantized == 1 and int(np.array([1000, 1000, 2001])[chosen].sum()) <= 3000


@pytest.mark.skipif(not JIT, reason="a 65,536-patch capacity needs the compiled kernels")
def test_binding_patch_capacity_plans_are_exact():
    """A patch capacity that binds and has no common divisor to shrink it: relaxed solves,
    every regular pack the brute-force optimum of its buffer, every pack within both capacities."""
    rng = np.random.default_rng(8)
    tokens, units = _qwen_like(rng, 200, GRAN, MAX_TOKENS // GRAN)
    units = units + (units > 0)  # no common divisor
    max_units = 3001
    cfg = _cfg(buffer_size=10)
    plan = plan_packs(tokens, units, units > 0, cfg, max_units)
    assert plan.unit_axis == "relaxed"
    packs = _packs(plan)
    assert pack_capacity_ok(tokens, units, packs, MAX_TOKENS, max_units)
    qw = -(-tokens // GRAN)
    fits = np.flatnonzero(units <= max_units)
    buf, pos, k = [], 0, 0
    assert len(packs) > 40
    while k < len(packs) - 8 - 10:  # the tail (last 8 + flush packs) is re-optimized
        while len(buf) < 10 and pos < len(fits):
            buf.append(int(fits[pos]))
            pos += 1
        b = np.array(buf)
        _, chosen = brute_force_knapsack(qw[b], units[b], tokens[b] + cfg.vision_weight * units[b], MAX_TOKENS // GRAN,
                                         max_units)
        assert b[chosen].tolist() == packs[k]
        buf = b[~chosen].tolist()
        k += 1


@pytest.mark.skipif(not JIT, reason="a 65,536-patch capacity needs the compiled kernels")
def test_patch_capacity_plans_are_exact_and_fit():
    """Qwen-like samples at the default patch capacity: the unit axis is dropped (no
    quantization), every pack fits both true capacities, and each pack is the exact
    optimum of its buffer (replayed against the 2-D brute force on small buffers)."""
    rng = np.random.default_rng(5)
    tokens, units = _qwen_like(rng, 300, GRAN, MAX_TOKENS // GRAN)
    cfg = _cfg(buffer_size=10)
    plan = plan_packs(tokens, units, units > 0, cfg, 4 * MAX_TOKENS)
    assert plan.unit_axis == "redundant"
    packs = _packs(plan)
    assert pack_capacity_ok(tokens, units, packs, MAX_TOKENS, 4 * MAX_TOKENS)
    assert sorted(i for p in packs for i in p) == list(range(300))
    # replay the buffer policy with the brute force over the exact patch counts
    qw = -(-tokens // GRAN)
    buf, pos, k = [], 0, 0
    while k < len(packs) - 8 - 10:  # the tail (last 8 + flush packs) is re-optimized; compare the regular packs
        while len(buf) < 10 and pos < 300:
            buf.append(pos)
            pos += 1
        b = np.array(buf)
        value = tokens[b] + cfg.vision_weight * units[b]
        _, chosen = brute_force_knapsack(qw[b], units[b], value, MAX_TOKENS // GRAN, 4 * MAX_TOKENS)
        assert b[chosen].tolist() == packs[k]
        buf = b[~chosen].tolist()
        k += 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 9), st.integers(-3, 2**31 - 1)), max_size=12),
       st.integers(0, 2**32 - 1))
def test_gather_runs_matches_its_twin(runs, seed):
    """Runs copied into place (in a shuffled order, with additions that may wrap int32),
    as the slow twin does it."""
    rng = np.random.default_rng(seed)
    src = rng.integers(-2**31, 2**31, 60).astype(np.int32)
    starts = np.array([min(a, 60 - n) for a, n, _ in runs], dtype=np.int64)
    lengths = np.array([n for _, n, _ in runs], dtype=np.int64)
    add = np.array([x for _, _, x in runs], dtype=np.int64).astype(np.int32)
    perm = rng.permutation(len(runs))
    dst_starts = np.zeros(len(runs), dtype=np.int64)
    dst_starts[perm] = np.concatenate([[0], np.cumsum(lengths[perm])[:-1]]) if len(runs) else []
    total = int(lengths.sum())
    got, want = np.full(total, 7, np.int32), np.full(total, 7, np.int32)
    with np.errstate(over="ignore"):
        gather_runs(src, starts, lengths, dst_starts, add, got)
    naive_gather_runs(src, starts, lengths, dst_starts, add, want)
    assert (got == want).all()
    with pytest.raises(ValueError):
        gather_runs(src, np.array([55]), np.array([6]), np.array([0]), np.array([0], np.int32), got)


def _tokenized_table(lengths, kinds):
    """Real tokenized rows (schema.TOKENIZED) built column-wise by the bench generator."""
    from bench.corpus import _batch_table

    tokens = np.asarray(lengths, dtype=np.int64)
    kind = np.asarray(kinds, dtype=np.int64)
    units = np.where(kind > 0, 2, 0)
    vt = np.where(kind > 0, 2 * 144, 0)
    return _batch_table(tokens, units, vt, kind, 0, np.random.default_rng(0), "test")


def test_assemble_concatenates_renumbers_and_truncates_vectorized():
    table = _tokenized_table([400, 700, 300, 5000], [1, 0, 1, 0])
    max_tokens = 1200
    cfg = PackConfig(max_tokens=max_tokens, token_granularity=16, oversize="truncate", buffer_size=8)
    tokens = np.array(table["n_tokens"].to_pylist())
    units = np.array(table["n_vision_units"].to_pylist())
    has_media = np.array([len(m) > 0 for m in table["media"].to_pylist()])
    plan = plan_packs(tokens, units, has_media, cfg, 32)
    assert plan.truncated == [3]
    packed = assemble_packs(table, plan, 7, None, max_tokens)
    assert packed.schema.equals(PACKED) and [288] in list_form(packed).column("run_lengths").to_pylist()  # a span is one run
    assert assemble_packs(table, plan, 7, None, max_tokens, layout="full").equals(expand_table(packed).cast(PACKED_FULL))
    packed = expand_table(packed)
    rows = packed.to_pylist()
    src = table.to_pylist()
    assert [r["pack_index"] for r in rows] == list(range(7, 7 + plan.n_packs))
    for r, members in zip(rows, _packs(plan), strict=True):
        assert r["n_tokens"] <= max_tokens and len(r["input_ids"]) == r["n_tokens"]
        start = 0
        for k, i in enumerate(members):
            n_i = min(int(tokens[i]), max_tokens)
            assert r["input_ids"][start:start + n_i] == src[i]["input_ids"][:n_i]
            assert r["position_ids"][start:start + n_i] == src[i]["position_ids"][:n_i]
            assert set(r["subsegment_ids"][start:start + n_i]) == {k * SUBSEGMENT_STRIDE + 10000}
            assert r["cu_seqlens"][k + 1] == start + n_i
            if i == 3:
                assert r["target_ids"][start + n_i - 1] == -100
                assert r["target_ids"][start:start + n_i - 1] == src[i]["target_ids"][:n_i - 1]
            start += n_i
        for m in r["media"]:
            owner = members[m["sample_index"]]
            first = sum(min(int(tokens[j]), max_tokens) for j in members[:m["sample_index"]])
            assert m["token_offset"] == first + src[owner]["media"][0]["token_offset"]
            assert r["input_ids"][m["token_offset"]] == 151655  # the vision span moved with its sample
    assert pa.Table.from_pylist(rows, schema=packed.schema).num_rows == plan.n_packs


def test_assemble_from_several_tables_equals_one_table():
    """Rows gathered straight from several tables (as the pipeline hands over row groups)
    give the same packs as the same rows in one table, truncation included."""
    table = _tokenized_table([400, 700, 300, 5000, 90, 1100, 600], [1, 0, 1, 0, 0, 1, 0])
    max_tokens = 1200
    cfg = PackConfig(max_tokens=max_tokens, token_granularity=16, oversize="truncate", buffer_size=3)
    tokens = np.array(table["n_tokens"].to_pylist())
    units = np.array(table["n_vision_units"].to_pylist())
    has_media = np.array([len(m) > 0 for m in table["media"].to_pylist()])
    plan = plan_packs(tokens, units, has_media, cfg, 32)
    assert plan.truncated == [3] and plan.n_packs > 1
    whole = assemble_packs(table, plan, 0, None, max_tokens)
    # sliced tables: list offsets that do not start at zero, one of them two chunks
    parts = [table.slice(0, 2), pa.concat_tables([table.slice(2, 2), table.slice(4, 1)]), table.slice(5)]
    split = assemble_packs(parts, plan, 0, None, max_tokens)
    assert split.equals(whole)
    # tokenized rows in runs form (as tokenize writes them) give the same bytes
    assert assemble_packs([compact_table(p) for p in parts], plan, 0, None, max_tokens).equals(whole)
    # ... and so do rows in the list form of schema version 3, as older packtool wrote them
    assert assemble_packs([list_form(compact_table(p)) for p in parts], plan, 0, None, max_tokens).equals(whole)
    assert assemble_packs(compact_table(table), plan, 0, None, max_tokens, layout="full").equals(
        assemble_packs(table, plan, 0, None, max_tokens, layout="full"))
    untruncated = assemble_packs(table, plan, 0)
    assert split.column("compact_target_ids_i32next").to_pylist() != untruncated.column("compact_target_ids_i32next").to_pylist()


def test_embedded_bytes_are_the_files_through_either_loader_path(tmp_path):
    """Pack's loader reads image files without building each item's dict (``image(path, size)``);
    a plain ``media_data`` function gets dicts. Both give the same packs, the files' exact bytes,
    and a file whose size changed after tokenize stops the run with a message naming the fix."""
    from packtool.errors import InputError
    from packtool.pipeline import _media_loader

    seed = 16
    rng = np.random.default_rng(seed)
    kinds = [1, 0, 1, 1, 0, 1, 1, 0, 1]
    table = _tokenized_table(rng.integers(300, 900, len(kinds)).tolist(), kinds)
    rows = table.to_pylist()
    (tmp_path / "images").mkdir()
    for r in rows:
        for m in r["media"]:
            body = rng.bytes(int(rng.integers(0, 5000)))
            (tmp_path / m["path"]).write_bytes(body)
            m["size_bytes"] = len(body)
    table = pa.Table.from_pylist(rows, schema=table.schema)
    cfg = PackConfig(max_tokens=2048, token_granularity=16, buffer_size=4)
    plan = plan_packs(table["n_tokens"].to_numpy(), table["n_vision_units"].to_numpy(),
                      np.array([k > 0 for k in kinds]), cfg, 64)
    parts = [table.slice(0, 3), table.slice(3)]  # struct children at an offset
    loader = _media_loader(tmp_path)
    fast = assemble_packs(parts, plan, 0, loader, cfg.max_tokens)
    plain = assemble_packs(parts, plan, 0, lambda m: loader(m), cfg.max_tokens)
    assert fast.equals(plain), f"seed {seed}"
    got = [m for r in fast.column("media").to_pylist() for m in r]
    assert len(got) == sum(kinds)
    assert all(m["data"] == (tmp_path / m["path"]).read_bytes() and m["frames"] is None for m in got)
    changed = got[0]["path"]
    loader = _media_loader(tmp_path)  # one that has read the file embeds the bytes it read (see the next test)
    (tmp_path / changed).write_bytes(b"other" * 3000)
    for media_data in (loader, lambda m: loader(m)):
        with pytest.raises(InputError, match=f"{changed}.*changed while pack was running.*re-run"):
            assemble_packs(parts, plan, 0, media_data, cfg.max_tokens)
    (tmp_path / changed).unlink()  # gone after the check before planning: the task stops, naming it and the fix
    for media_data in (loader, lambda m: loader(m)):
        with pytest.raises(InputError, match=f"could not be read while pack was running: media file '{changed}' not "
                                             "found.*re-run the same command.*errors.jsonl"):
            assemble_packs(parts, plan, 0, media_data, cfg.max_tokens)
    video = {"kind": "video", "path": "gone.mp4", "timestamps": [0.0, 0.5], "size_bytes": 1000}
    with pytest.raises(InputError, match="could not be read while pack was running: media file 'gone.mp4' not found"
                                         ".*pack checks every file before planning"):
        loader(video)
    with pytest.raises(InputError, match="'gone.mp4' not found.*or tokenize again: these tokenized shards record no "
                                         "media sizes"):
        loader({**video, "size_bytes": None})
    with pytest.raises(InputError, match="neither a path nor inline bytes.*tokenize the corpus again"):
        loader({"kind": "image", "path": None, "data": None, "size_bytes": None})


def test_a_task_reads_each_repeated_media_file_once_and_writes_the_same_shards(tmp_path, monkeypatch):
    """Records that share an image or a video (several questions about one picture): a pack
    task reads each image file once and decodes each video's frames once while they stay among
    its recent items, and writes shards byte-identical to a run that reads every item again."""
    import json

    from PIL import Image

    import packtool.media as media
    import packtool.pipeline as pipeline
    from packtool.config import TokenizeConfig
    from packtool.pipeline import pack_dataset, tokenize_dataset
    from tests.test_bad_input import video

    root = tmp_path / "media"
    root.mkdir()
    for i, (w, h) in enumerate([(320, 240), (200, 300)]):
        Image.effect_noise((w, h), 40 + i).convert("RGB").save(root / f"img{i}.jpg", quality=90)
    video(root / "clip.mp4", n_frames=20)
    conv = [{"from": "human", "value": "<image>\nWhat is here?"}, {"from": "gpt", "value": "Noise, mostly."}]
    recs = [{"id": f"i{k}", "image": f"img{k % 2}.jpg", "conversations": conv} for k in range(12)]
    recs += [{"id": f"v{k}", "video": "clip.mp4", "conversations": [
        {"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": "It brightens."}]} for k in range(3)]
    src = tmp_path / "data.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    tok = tmp_path / "tok"
    tokenize_dataset([src], tok, TokenizeConfig(media_root=str(root)), workers=1, progress=None)

    reads, decodes = [], []
    read, extract = media.MediaPathResolver.read, media.extract_frames
    monkeypatch.setattr(media.MediaPathResolver, "read", lambda self, path: reads.append(path) or read(self, path))
    monkeypatch.setattr(media, "extract_frames", lambda *a, **k: decodes.append(a[1]["path"]) or extract(*a, **k))
    cfg = PackConfig(media="embed", max_tokens=2048)
    pack_dataset(tok, tmp_path / "once", cfg, workers=1)
    assert sorted(reads) == ["img0.jpg", "img1.jpg"] and decodes == ["clip.mp4"], (reads, decodes)

    reads.clear(), decodes.clear()
    monkeypatch.setattr(pipeline, "RECENT_MEDIA_BYTES", 0)  # nothing kept: every item read again
    pack_dataset(tok, tmp_path / "every", cfg, workers=1)
    assert len(reads) == 12 and decodes == ["clip.mp4"] * 3, (reads, decodes)
    shards = sorted(p.relative_to(tmp_path / "once") for p in (tmp_path / "once").rglob("*.parquet"))
    assert shards and all((tmp_path / "once" / p).read_bytes() == (tmp_path / "every" / p).read_bytes() for p in shards)
    # a mixture task holds a loader per source: together they keep what one does
    monkeypatch.setattr(pipeline, "RECENT_MEDIA_BYTES", 64 << 20)
    assert [pipeline._media_loader(root, share=k)._recent.limit for k in (1, 3)] == [64 << 20, (64 << 20) // 3]


def test_a_chunk_from_a_bucket_prefetches_only_the_images_its_loader_does_not_hold(tmp_path):
    """Embedding from a bucket fetches a chunk's image files ahead, in parallel; a file the task's
    loader still holds from an earlier chunk is embedded from memory, so it is not fetched again."""
    from packtool.pipeline import _media_loader, _prefetch_media

    table = _tokenized_table([300, 400, 500, 600], [1, 0, 1, 1])
    paths = [m["path"] for r in table.column("media").to_pylist() for m in r]
    asked = []

    class Root:  # the one call _prefetch_media makes of a bucket's media root
        def prefetch(self, got, whole=False):
            asked.append((list(got), whole))

    loader = _media_loader(tmp_path)
    _prefetch_media(Root(), [table], np.arange(4), loader)
    loader._recent.put(paths[1], b"held", 4)
    _prefetch_media(Root(), [table], np.arange(4), loader)
    _prefetch_media(Root(), [table], np.arange(4))
    assert asked == [(paths, True), ([paths[0], paths[2]], True), (paths, True)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_binary_array_is_what_arrow_builds(seed):
    from packtool.packer import _binary_array

    rng = np.random.default_rng(seed)
    for n in (0, 1, 7, 8, 9, 300):
        items = [None if rng.random() < 0.3 else rng.bytes(int(rng.integers(0, 40))) for _ in range(n)]
        got = _binary_array(items)
        got.validate(full=True)
        assert got.equals(pa.array(items, type=pa.binary())) and got.to_pylist() == items, f"seed {seed}, n {n}"


def test_truncation_inside_a_run_cuts_the_run():
    """A text row cut by --oversize truncate in the middle of a run of one repeated token: the
    packed row is the first max_tokens tokens, last target -100, the cut run shortened."""
    from packtool.packer import PackPlan
    from packtool.schema import TOKENIZED_ROWS

    ids = np.array([5, 6] + [9] * 40 + [7] * 10, dtype=np.int32)
    tgt = np.append(ids[1:], -100).astype(np.int32)  # loss on every token: runs of 9 predict 9
    row = {"sample_id": "long", "source": "t", "source_row": 0, "n_tokens": len(ids), "n_vision_units": 0,
           "n_branches": 1, "input_ids": ids, "target_ids": tgt, "position_ids": np.arange(len(ids), dtype=np.int32),
           "subsegment_ids": np.full(len(ids), 10_000, np.int32), "media": []}
    table = compact_table(pa.Table.from_pylist([row], schema=TOKENIZED_ROWS))
    assert list_form(table).column("run_lengths").to_pylist() == [[39, 9]]  # the 9s' last one predicts 7: its own stretch
    plan = PackPlan(np.array([0]), np.array([0, 1]), truncated=[0])
    packed = assemble_packs(table, plan, 0, None, 20)
    assert list_form(packed).column("run_lengths").to_pylist() == [[17]] and list_form(packed).column("run_starts").to_pylist() == [[2]]
    got = expand_table(packed).to_pylist()[0]
    assert got["input_ids"] == ids[:20].tolist() and got["position_ids"] == list(range(20))
    assert got["target_ids"] == tgt[:19].tolist() + [-100] and got["n_tokens"] == 20
    assert expand_table(packed).cast(PACKED_FULL).equals(assemble_packs(table, plan, 0, None, 20, layout="full"))


@pytest.mark.parametrize("column", ["compact_target_ids_i32next", "compact_subsegment_ids_i32le", "run_lengths_i32le"])
def test_stored_columns_of_unequal_length_stop_the_assembly(column):
    """A tokenized row whose stored columns disagree in length (a damaged shard) is refused by
    name before any value is gathered, never copied past the row's end."""
    from packtool.packer import PackPlan

    table = compact_table(_tokenized_table([400, 700, 300], [1, 0, 1]))
    rows = table.to_pylist()
    assert rows[0]["run_lengths_i32le"], "row 0 holds an image span"
    rows[0][column] = rows[0][column][:-4]  # one int32 value fewer
    damaged = pa.Table.from_pylist(rows, schema=table.schema)
    plan = PackPlan(np.array([2, 1, 0]), np.array([0, 3]))
    assert assemble_packs(table, plan, 0).num_rows == 1
    with pytest.raises(ValueError, match=f"tokenized row '[^']+': {column} holds .* re-run tokenize"):
        assemble_packs(damaged, plan, 0)


def test_a_samples_last_target_is_stored_against_the_next_samples_first_input():
    """In a tokenized row the last target has no next input and is stored as it is; in a pack
    the next sample's first input follows it, and the pack stores it against that. Rows whose
    last target equals the next sample's first input, or the mark (-1), pack to rows that
    expand to the same targets and are in the one canonical form validate checks."""
    from packtool.packer import PackPlan
    from packtool.runs import NEXT_MARK, swap_next
    from packtool.validate import run_problems

    table = _tokenized_table([40, 30, 50, 20], [0, 0, 0, 0])
    rows = table.to_pylist()
    firsts = [r["input_ids"][0] for r in rows]
    rows[0]["target_ids"][-1] = firsts[1]  # predicts the next sample's first token
    rows[1]["target_ids"][-1] = NEXT_MARK  # a target that is the mark itself
    rows[2]["target_ids"][-1] = -100
    expanded = pa.Table.from_pylist(rows, schema=table.schema)
    plan = PackPlan(np.arange(4), np.array([0, 4]))
    packed = assemble_packs(compact_table(expanded), plan, 0)
    assert run_problems(packed) == []
    got = expand_table(packed).to_pylist()[0]["target_ids"]
    assert got == [t for r in rows for t in r["target_ids"]]
    stored = np.frombuffer(packed.column("compact_target_ids_i32next")[0].as_py(), "<i4")
    inputs = np.frombuffer(packed.column("compact_input_ids_i32le")[0].as_py(), "<i4")
    assert packed.column("run_starts_i32le")[0].as_py() == b""  # text only: compact index = token index
    ends = np.cumsum([len(r["input_ids"]) for r in rows]) - 1
    assert stored[ends[0]] == NEXT_MARK and stored[ends[1]] == firsts[2] and stored[ends[2]] == -100
    assert np.array_equal(swap_next(stored, inputs, np.array([0, len(stored)])), got)
    assert assemble_packs(expanded, plan, 0, layout="full").column("target_ids").to_pylist() == [got]


def test_a_capacity_too_fine_for_the_tables_is_a_config_error_naming_the_options():
    """--max-tokens 1,048,576 at granularity 16 is 65,536 token cells: the tables of a solve
    pass the knapsack's limit. That used to escape as a ValueError traceback; it is a
    ConfigError naming the options to change, and a coarser granularity packs the same data."""
    from packtool.errors import ConfigError

    seed = 3
    rng = np.random.default_rng(seed)
    tokens = rng.integers(100, 1_500, 200)
    units = rng.integers(0, 200, 200)
    media = units > 0
    cfg = PackConfig(max_tokens=1_048_576, token_granularity=16)
    with pytest.raises(ConfigError, match=r"--max-tokens 1,048,576 at --token-granularity 16 gives 65,536 token cells "
                                          r"a pack, too many for the exact packer: a knapsack over \d+ samples needs "
                                          r"[\d,]+ MiB of tables \(the limit is 1,024 MiB\); raise --token-granularity"):
        plan_packs(tokens, units, media, cfg, 16_384)
    plan = plan_packs(tokens, units, media, PackConfig(max_tokens=1_048_576, token_granularity=1024), 16_384)
    assert sorted(plan.order.tolist()) == list(range(200)), f"seed {seed}"


def test_a_video_whose_frames_do_not_decode_is_named(tmp_path):
    """Tokenize reads a video's headers only; a file whose frame data is damaged is found at
    embedding, and the loader's error says which file: a pack task rejects the sample with it
    (tests/test_video.py), a mixture's task stops on it."""
    from video_fixtures import write_video

    from packtool.errors import InputError
    from packtool.pipeline import _media_loader

    video = bytearray(write_video(tmp_path / "zeroed.mp4", 30).read_bytes())
    at = video.find(b"mdat")
    size = int.from_bytes(video[at - 4:at], "big")
    video[at + 4:at - 4 + size] = bytes(size - 8)  # the frames zeroed, the headers intact
    (tmp_path / "zeroed.mp4").write_bytes(bytes(video))
    item = {"kind": "video", "path": "zeroed.mp4", "timestamps": [0.0, 0.5], "size_bytes": len(video)}
    with pytest.raises(InputError, match="video 'zeroed.mp4' has frames that do not decode .*replace the file"):
        _media_loader(tmp_path)(item)
