"""The knapsack kernel against its brute-force twin, the numpy reference DP, and edge cases."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packtool.knapsack import KnapsackSolver, max_cardinality, solve_knapsack_2d

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.naive import brute_force_knapsack  # noqa: E402

JIT = os.environ.get("NUMBA_DISABLE_JIT", "0") != "1"


def _random_instance(rng, n_max=14):
    n = int(rng.integers(0, n_max + 1))
    w = rng.integers(0, 12, n)
    u = rng.integers(0, 6, n)
    v = rng.integers(0, 40, n)
    return w, u, v, int(rng.integers(0, 30)), int(rng.integers(0, 12))


def test_docstring_example():
    value, chosen = solve_knapsack_2d(np.array([3, 4, 5]), np.array([1, 1, 2]), np.array([3, 4, 5]), 8, 3)
    assert value == 8 and chosen.tolist() == [True, False, True]


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_matches_brute_force_on_random_small_buffers(seed, sparse):
    rng = np.random.default_rng(seed)
    solver = KnapsackSolver(30, 12, sparse=sparse)
    for _ in range(60 if JIT else 15):
        w, u, v, cw, cu = _random_instance(rng, 14 if JIT else 10)
        value, chosen = solver.solve(w, u, v, cw, cu)
        ref, ref_set = brute_force_knapsack(w, u, v, cw, cu)
        assert value == ref
        assert w[chosen].sum() <= cw and u[chosen].sum() <= cu and v[chosen].sum() == value
        assert chosen.tolist() == ref_set.tolist()  # the documented tie rule


@pytest.mark.parametrize("seed", range(3))
def test_item_limit_is_exact(seed):
    rng = np.random.default_rng(100 + seed)
    for _ in range(40 if JIT else 10):
        w, u, v, cw, cu = _random_instance(rng, 12 if JIT else 8)
        k = int(rng.integers(0, 5))
        value, chosen = solve_knapsack_2d(w, u, v, cw, cu, max_items=k)
        ref, _ = brute_force_knapsack(w, u, v, cw, cu, max_items=k)
        assert value == ref
        assert chosen.sum() <= k and w[chosen].sum() <= cw and u[chosen].sum() <= cu and v[chosen].sum() == value


@settings(max_examples=60 if JIT else 20, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 4), st.integers(0, 30)), max_size=11),
       st.integers(0, 25), st.integers(0, 8))
def test_property_feasible_optimal_deterministic(items, cw, cu):
    w, u, v = (np.array([it[k] for it in items], dtype=np.int64) for k in range(3))
    a = solve_knapsack_2d(w, u, v, cw, cu)
    b = KnapsackSolver(cw, cu, sparse=True).solve(w.copy(), u.copy(), v.copy())
    assert a[0] == b[0] and a[1].tolist() == b[1].tolist()
    assert a[0] == brute_force_knapsack(w, u, v, cw, cu)[0]


def test_prefix_reuse_gives_the_same_answers():
    """A solver reused across buffers that share a prefix answers exactly like fresh solves."""
    rng = np.random.default_rng(5)
    cw, cu = (512, 128) if JIT else (40, 12)
    n = 48 if JIT else 20
    scale = 1 if JIT else 12
    w = rng.integers(5, 60, n) // scale + 1
    u = rng.integers(0, 14, n) // (1 if JIT else 2)
    v = w * 32 + u * 30 - rng.integers(0, 31, n)
    solver = KnapsackSolver(cw, cu, sparse=False)  # prefix reuse is the table's
    reused = 0
    for _ in range(12 if JIT else 5):
        value, chosen = solver.solve(w, u, v)
        fresh = solve_knapsack_2d(w, u, v, cw, cu)
        assert value == fresh[0] and chosen.tolist() == fresh[1].tolist()
        reused += solver.last_items_processed < n
        # drop the chosen items, append new ones: the unchanged prefix is reusable
        keep = ~chosen
        k = int(chosen.sum())
        w = np.concatenate([w[keep], rng.integers(5, 60, k) // scale + 1])
        u = np.concatenate([u[keep], rng.integers(0, 14, k) // (1 if JIT else 2)])
        v = np.concatenate([v[keep], w[-k:] * 32 + u[-k:] * 30 - rng.integers(0, 31, k)]) if k else v[keep]
    assert reused >= 1


def test_reduced_capacity_per_call():
    solver = KnapsackSolver(10, 5)
    w, u, v = np.array([4, 6, 3]), np.array([1, 2, 1]), np.array([4, 6, 3])
    assert solver.solve(w, u, v, max_w=7)[0] == brute_force_knapsack(w, u, v, 7, 5)[0] == 7
    with pytest.raises(ValueError, match="within"):
        solver.solve(w, u, v, max_w=11)


@pytest.mark.skipif(not JIT, reason="full Molmo2-size tables are slow without the compiler")
def test_agrees_with_numpy_reference_at_molmo2_settings():
    from bench.baselines import numpy_dp_solve

    rng = np.random.default_rng(9)
    solver = KnapsackSolver(512, 128)
    for _ in range(20):
        units = np.where(rng.random(48) < 0.1, 0, rng.integers(1, 40, 48))
        tokens = units * 144 + rng.integers(10, 2000, 48)
        w, v = -(-tokens // 32), tokens + 30 * units
        ref_value, ref_set = numpy_dp_solve(w, units, v, 512, 128)
        value, chosen = solver.solve(w, units, v)
        assert value == ref_value and chosen.tolist() == ref_set.tolist()


def test_edge_cases():
    empty = np.zeros(0, dtype=np.int64)
    assert solve_knapsack_2d(empty, empty, empty, 5, 5)[0] == 0
    # zero weights and zero values; an item larger than the capacity
    w, u, v = np.array([0, 0, 9, 2]), np.array([0, 3, 0, 1]), np.array([5, 0, 50, 4])
    value, chosen = solve_knapsack_2d(w, u, v, 4, 2)
    assert value == 9 and chosen.tolist() == [True, False, False, True]
    with pytest.raises(ValueError, match="non-negative"):
        solve_knapsack_2d(np.array([-1]), np.array([0]), np.array([1]), 3, 3)
    with pytest.raises(ValueError, match="equal length"):
        solve_knapsack_2d(np.array([1, 2]), np.array([0]), np.array([1]), 3, 3)
    # large values switch to a wider table type without overflow
    big = np.array([30000, 30000, 30000])
    assert solve_knapsack_2d(np.array([1, 1, 1]), np.array([0, 0, 0]), big, 2, 0)[0] == 60000


def test_max_cardinality():
    assert max_cardinality(np.array([1, 1, 5]), np.array([0, 3, 0]), 6, 2) == 2
    assert max_cardinality(np.array([1, 1]), np.array([0, 0]), 10, 10) == 2


def test_solver_chains_match_fresh_solves():
    """Reused solvers (prefix reuse, lowered capacities, growing buffers, resets, value types
    switching) answer every call exactly like a fresh solve and the brute force."""
    rng = np.random.default_rng(21)
    cw, cu = (60, 14) if JIT else (24, 8)
    for every, sparse in ((0, False), (2, False), (8, False), (8, True)):
        solver = KnapsackSolver(cw, cu, checkpoint_every=every, sparse=sparse)
        w = rng.integers(0, 12, 10)
        u = rng.integers(0, 5, 10)
        v = rng.integers(0, 40, 10)
        reused = 0
        for step in range(40 if JIT else 24):
            big = step % 7 == 5  # values beyond int16: the solver switches table type and back
            vv = v * (1500 if big else 1)
            lw = cw if step % 5 else int(rng.integers(0, cw + 1))
            lu = cu if step % 5 else int(rng.integers(0, cu + 1))
            value, chosen = solver.solve(w, u, vv, max_w=lw, max_u=lu)
            fresh = solve_knapsack_2d(w, u, vv, lw, lu)
            assert value == fresh[0] and chosen.tolist() == fresh[1].tolist()
            if len(w) <= (12 if JIT else 9):
                ref, ref_set = brute_force_knapsack(w, u, vv, lw, lu)
                assert value == ref and chosen.tolist() == ref_set.tolist()
            reused += 0 < solver.last_items_processed < len(w)  # 0: answered without a table
            if step % 11 == 10:
                solver.reset()
            # drop the chosen items and append new ones (sometimes more: the buffer grows)
            keep = ~chosen
            k = int(chosen.sum()) + (3 if step % 6 == 0 else 0)
            w = np.concatenate([w[keep], rng.integers(0, 12, k)])
            u = np.concatenate([u[keep], rng.integers(0, 5, k)])
            v = np.concatenate([v[keep], rng.integers(0, 40, k)])
        if every and not sparse:
            assert reused >= 1
        elif not every:
            assert reused == 0


def test_reset_and_fresh_solvers_keep_no_checkpoints():
    """Checkpoints only once a solver is reused: the first call after reset() processes all."""
    rng = np.random.default_rng(3)
    n = 40 if JIT else 12
    w, u = rng.integers(1, 9, n), rng.integers(0, 4, n)
    v = 3 * w + 2 * u
    solver = KnapsackSolver(30, 10, checkpoint_every=4, sparse=False)
    solver.solve(w, u, v)
    assert solver.last_items_processed == n
    solver.solve(w, u, v)  # writes checkpoints (reused solver), nothing to reuse yet
    assert solver.last_items_processed == n
    solver.solve(w, u, v)  # identical items: restarts from the last checkpoint
    assert solver.last_items_processed < n
    solver.reset()
    solver.solve(w, u, v)
    assert solver.last_items_processed == n


@pytest.mark.skipif(not JIT, reason="compares the compiled vector step with its Python twin")
@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.int64])
def test_vector_step_matches_its_python_twin(dtype):
    from numba import njit

    from packtool.knapsack import VEC, _relax_chunk_ir, _relax_chunk_py

    @njit
    def step(t, d0, s0, vi):
        return _relax_chunk_ir(t, d0, s0, vi)

    rng = np.random.default_rng(int(np.dtype(dtype).itemsize))
    hi = np.iinfo(dtype).max // 2
    for _ in range(200):
        t = rng.integers(0, hi, 4 * VEC).astype(dtype)
        d0 = int(rng.integers(VEC, 3 * VEC))
        s0 = d0 - int(rng.integers(0, VEC + 1))  # overlapping ranges: the source is read first
        vi = int(rng.integers(0, hi))
        a, b = t.copy(), t.copy()
        bits_a = step(a, d0, s0, vi)
        bits_b = _relax_chunk_py(b, d0, s0, vi)
        assert int(bits_a) == bits_b and a.tolist() == b.tolist()
        c = t[s0: s0 + VEC].astype(np.int64) + vi
        assert (a[d0: d0 + VEC] == np.maximum(t[d0: d0 + VEC], c)).all()


@pytest.mark.parametrize("seed", range(6))
def test_column_cut_and_prefix_reuse_when_ratios_fall(seed):
    """Rows skip cells right of ``max_w - r * (max_u - b)`` (``r``: the smallest w / u of the
    later items). A reused solver whose new items have a smaller ratio than the old ones
    needs cells the old call skipped: it must restart earlier, and still answer exactly."""
    rng = np.random.default_rng(seed)
    cw, cu = (80, 30) if JIT else (30, 10)
    solver = KnapsackSolver(cw, cu, checkpoint_every=2, sparse=False)
    w = rng.integers(4, 16, 10)
    u = rng.integers(0, 3, 10)
    v = rng.integers(1, 40, 10)
    for step in range(12):
        value, chosen = solver.solve(w, u, v)
        want = brute_force_knapsack(w, u, v, cw, cu)
        assert value == want[0] and chosen.tolist() == want[1].tolist()
        keep = ~chosen
        k = int(chosen.sum())
        # new items with more units per token as the chain goes on: the ratio bound falls
        nw = rng.integers(1, 6, k)
        nu = rng.integers(1, 2 + step // 2, k)
        w = np.concatenate([w[keep], nw])[:12]
        u = np.concatenate([u[keep], nu])[:12]
        v = np.concatenate([v[keep], rng.integers(1, 40, k)])[:12]


@pytest.mark.parametrize("seed", range(4))
def test_reach_ranges_are_the_subset_bounds(seed):
    """``_reach`` (exact): in row ``b = max_u - k`` below item ``i``'s top row the columns from
    ``max_w - W_max(k)`` to ``max_w - W_min(k)`` over the subsets of the later fitting items
    with ``k`` units, an empty range where there is none; the cone contains every such
    column. Checked against every subset."""
    from itertools import combinations

    from packtool.knapsack import _FIT, _LO_B, _NCOL, _PU, _reach

    rng = np.random.default_rng(300 + seed)
    for _ in range(20):
        n = int(rng.integers(1, 9))
        w, u = rng.integers(0, 9, n), rng.integers(0, 4, n)
        max_w, max_u = int(rng.integers(1, 30)), int(rng.integers(0, 10))
        fit = (w <= max_w) & (u <= max_u)
        ints = np.zeros((_NCOL, n + 2), dtype=np.int64)
        ints[_FIT, :n] = fit
        for i in range(n):
            ints[_LO_B, i] = max(max_u - int(u[i + 1:][fit[i + 1:]].sum()), 0)
            ints[_PU, i] = min(int(u[:i][fit[:i]].sum()), max_u)
        for exact in (True, False):
            reach = np.full((n, 2, max_u + 1), -7, dtype=np.int32)
            _reach(w, u, max_w, max_u, ints, reach, np.zeros((4, max_u + 1), dtype=np.int64), exact)
            for i in range(n):
                later = [j for j in range(i + 1, n) if fit[j]]
                sums: dict[int, list[int]] = {}
                for r in range(len(later) + 1):
                    for sub in combinations(later, r):
                        sums.setdefault(int(u[list(sub)].sum()), []).append(int(w[list(sub)].sum()))
                hi = min(max_u, int(ints[_PU, i] + u[i])) if fit[i] else int(ints[_PU, i])
                for k in range(max_u - hi + 1, max_u - int(ints[_LO_B, i]) + 1):  # rows below the top row
                    lo, last = int(reach[i, 0, k]), int(reach[i, 1, k])
                    ws = sums.get(k, [])
                    if exact:  # clamped to -1 .. max_w + 1
                        want = (max(max_w - max(ws), -1), max(max_w - min(ws), -1)) if ws else None
                        assert (lo, last) == want if want else lo > last, (seed, i, k, lo, last, ws)
                    else:
                        assert all(lo <= max_w - x <= last for x in ws if max_w - x >= 0), (seed, i, k, lo, last, ws)


def _structured(rng, n, cw, cu):
    """Items whose value is nearly a price per unit of each capacity (``32 w + 30 u`` less a
    rounding loss, as the packer's values are): many subsets come within a few points of
    each other, the hard case for bounds; with ``tie`` set, exact ties too."""
    w = rng.integers(0, max(2, cw // 3), n)
    u = np.where(rng.random(n) < 0.2, 0, rng.integers(0, max(2, cu // 3), n))
    v = np.maximum(32 * w + 30 * u - rng.integers(0, 32, n), 0)
    return w, u, v


@pytest.mark.parametrize("seed", range(6))
def test_sparse_search_matches_the_table_and_brute_force(seed):
    """The bounded search returns the table's answer, value and tie-rule subset, on random
    and near-tied instances (and it is what answers them, not the table)."""
    rng = np.random.default_rng(400 + seed)
    sparse, table = KnapsackSolver(40, 14, sparse=True), KnapsackSolver(40, 14, sparse=False)
    used = 0
    for k in range(40 if JIT else 12):
        n = int(rng.integers(0, (13 if JIT else 9) + 1))
        cw, cu = int(rng.integers(0, 41)), int(rng.integers(0, 15))
        if k % 3 == 0:
            w, u, v = rng.integers(0, 12, n), rng.integers(0, 6, n), rng.integers(0, 40, n)
        elif k % 3 == 1:
            w, u, v = _structured(rng, n, cw, cu)
            if k % 2:  # prices too large for 16-bit tails: the 32-bit ones
                v = v * 1000 + rng.integers(0, 1000, n)
        else:  # values proportional to weight: ties everywhere
            w, u = rng.integers(0, 9, n), rng.integers(0, 4, n)
            v = 3 * w
        want = brute_force_knapsack(w, u, v, cw, cu)
        got = sparse.solve(w, u, v, cw, cu)
        ref = table.solve(w, u, v, cw, cu)
        assert got[0] == ref[0] == want[0], (seed, k)
        assert got[1].tolist() == ref[1].tolist() == want[1].tolist(), (seed, k)
        used += sparse.last_method == "sparse"
    assert used >= (10 if JIT else 3), (seed, used)


@pytest.mark.skipif(not JIT, reason="full Molmo2-size instances are slow without the compiler")
@pytest.mark.parametrize("seed", range(3))
def test_sparse_search_at_molmo2_settings(seed):
    """Bench-like buffers (48 Molmo2-SFT-like samples, 512 x 128): the same value and subset
    as the numpy reference DP every time, whichever method answers."""
    from bench.baselines import numpy_dp_solve
    from bench.corpus import sample_lengths

    tokens, units, _, _ = sample_lengths("molmo2", 20_000, seed)
    ok = (tokens <= 16384) & (units <= 128)
    tokens, units = tokens[ok], units[ok]
    rng = np.random.default_rng(500 + seed)
    solver = KnapsackSolver(512, 128)
    methods = []
    for _ in range(25):
        idx = rng.choice(len(tokens), 48, replace=False)
        w, u, v = -(-tokens[idx] // 32), units[idx], tokens[idx] + 30 * units[idx]
        solver.reset()
        value, chosen = solver.solve(w, u, v)
        ref_value, ref_set = numpy_dp_solve(w, u, v, 512, 128)
        assert value == ref_value and chosen.tolist() == ref_set.tolist(), (seed, idx.tolist())
        methods.append(solver.last_method)
        passes, visits = solver.last_sparse_work
        assert passes >= 1 and visits >= 1
    assert methods.count("sparse") >= 20, (seed, methods)


def test_sparse_search_gives_way_to_the_table():
    """Where the search cannot prove an answer cheaply the table decides, with the same
    answer: more than 64 items (masks are 64 bits), values too large for its 32-bit tails,
    and an instance with no loss to prune by (every value exactly its prices: thousands of
    subsets fill both capacities)."""
    rng = np.random.default_rng(17)
    cases = []
    w, u = rng.integers(1, 9, 70), rng.integers(0, 4, 70)
    cases.append(("more items than mask bits", w, u, 5 * w + 2 * u, 60, 20))
    w, u = rng.integers(1, 9, 12), rng.integers(0, 4, 12)
    cases.append(("large values", w, u, (10**8) * w + rng.integers(0, 1000, 12), 30, 10))
    cases.append(("huge values", w, u, (10**15) * (w + u) + rng.integers(0, 1000, 12), 30, 10))
    if JIT:
        w, u = rng.integers(1, 40, 60), rng.integers(0, 12, 60)
        cases.append(("no loss to prune by", w, u, 32 * w + 30 * u, 512, 128))
    for name, w, u, v, cw, cu in cases:
        solver = KnapsackSolver(cw, cu, sparse=True)
        value, chosen = solver.solve(w, u, v)
        ref = KnapsackSolver(cw, cu, sparse=False).solve(w, u, v)
        assert solver.last_method == "table", name
        assert value == ref[0] and chosen.tolist() == ref[1].tolist(), name
        if len(w) <= 12:
            assert (value, chosen.tolist()) == tuple(x.tolist() if hasattr(x, "tolist") else x
                                                     for x in brute_force_knapsack(w, u, v, cw, cu))


def test_sparse_search_edge_cases():
    """Exact fills, only one capacity binding, zero values and weights, oversize items."""
    cases = [
        # exact fill of both capacities by a unique subset
        (np.array([5, 3, 4, 2]), np.array([2, 1, 1, 3]), np.array([50, 31, 40, 20]), 9, 3),
        # the unit capacity never binds (only the first one does)
        (np.array([4, 6, 3, 5, 2]), np.array([0, 1, 0, 1, 0]), np.array([9, 13, 7, 10, 4]), 10, 50),
        # only the unit capacity binds
        (np.array([1, 1, 1, 1]), np.array([3, 2, 4, 1]), np.array([7, 5, 9, 2]), 100, 6),
        # zero values (never taken), weightless items, an item larger than either capacity
        (np.array([0, 0, 9, 2, 3, 20]), np.array([0, 3, 0, 1, 2, 0]), np.array([5, 0, 50, 4, 6, 99]), 6, 3),
        # equal values and sizes: the tie rule keeps the earlier items
        (np.array([2, 2, 2, 2, 2]), np.array([1, 1, 1, 1, 1]), np.array([6, 6, 6, 6, 6]), 5, 4),
        # nothing fits
        (np.array([7, 8]), np.array([1, 9]), np.array([3, 4]), 5, 5),
        # values past 16 bits only when items without units join: the table's value type
        # must count their values on top of the priced ones (it once kept the larger)
        (np.array([1, 1, 0, 0, 0]), np.array([0, 0, 1, 0, 1]), np.array([2305, 22083, 1565, 597, 24657]), 2, 1),
    ]
    for sparse in (True, False):
        for k, (w, u, v, cw, cu) in enumerate(cases):
            value, chosen = KnapsackSolver(cw, cu, sparse=sparse).solve(w, u, v)
            want = brute_force_knapsack(w, u, v, cw, cu)
            assert value == want[0] and chosen.tolist() == want[1].tolist(), (sparse, k)
    assert solve_knapsack_2d(*cases[4])[1].tolist() == [True, True, False, False, False]


@pytest.mark.parametrize("seed", range(3))
def test_tails_are_the_subset_bounds(seed):
    """``_tails``: row ``r``, column ``c`` holds the least ``loss(T) + price * (c - x(T))`` over
    subsets ``T`` of the items ``r..n-1`` with ``x(T) <= c``. Checked against every subset."""
    from itertools import combinations

    from packtool.knapsack import VEC, _tails

    rng = np.random.default_rng(600 + seed)
    for _ in range(10):
        n = int(rng.integers(0, 8))
        cap = int(rng.integers(0, 40))
        x = rng.integers(0, 45, n)  # some larger than the capacity: in no subset
        loss = rng.integers(-20, 40, n)
        price = int(rng.integers(0, 9))
        stride = (cap + 2 * VEC) // VEC * VEC
        h = np.full(7 + (n + 1) * stride + VEC, -99, dtype=np.int32)
        _tails(x, loss, n, price, cap, h, 7, stride)
        for r in range(n + 1):
            items = list(range(r, n))
            for c in range(cap + 1):
                want = min(int(loss[list(t)].sum()) + price * (c - int(x[list(t)].sum()))
                           for k in range(len(items) + 1) for t in combinations(items, k)
                           if int(x[list(t)].sum()) <= c)
                assert h[7 + r * stride + c] == want, (seed, r, c)
        assert (h[:7] == -99).all()  # nothing written before the base


@pytest.mark.skipif(not JIT, reason="compares the compiled vector step with its Python twin")
@pytest.mark.parametrize("kind,dtype", [("plain", np.int32), ("plain", np.int64),
                                        ("saturating", np.uint8), ("saturating", np.uint16)])
def test_minplus_step_matches_its_python_twin(kind, dtype):
    """``_minplus_chunk`` (``min(h[s0], h[s1] + x)``, ``VEC`` lanes) and ``_minplus_sat`` (the
    addition saturating at the unsigned cells' bounds, ``|x|`` cut to the largest cell value,
    ``SAT_VEC`` lanes): compiled, as the Python twin, and as the formula."""
    from numba import njit

    import packtool.knapsack as K

    if kind == "plain":
        lanes, compiled, twin = K.VEC, K._minplus_chunk_ir, K._minplus_chunk_py
        lo, hi, xs = -1000, 1000, 50
    else:
        lanes, compiled, twin = K.SAT_VEC, K._minplus_sat_ir, K._minplus_sat_py
        lo, hi = 0, int(np.iinfo(dtype).max)
        xs = 2 * hi  # beyond the cells' range too

    @njit
    def step(h, d0, s0, s1, x):
        compiled(h, d0, s0, s1, x)

    seed = int(np.dtype(dtype).itemsize) + 40
    rng = np.random.default_rng(seed)
    for _ in range(200):
        h = rng.integers(lo, hi + 1, 5 * lanes).astype(dtype)
        s0 = int(rng.integers(2 * lanes, 3 * lanes))
        s1 = s0 - int(rng.integers(0, lanes + 1))
        d0 = s0 - int(rng.integers(lanes, 2 * lanes + 1))  # a row below its sources, as in the tails
        x = int(rng.integers(-xs, xs))
        a, b = h.copy(), h.copy()
        step(a, d0, s0, s1, x)
        twin(b, d0, s0, s1, x)
        assert a.tolist() == b.tolist(), (kind, seed)
        src, add = h[s0: s0 + lanes].astype(np.int64), h[s1: s1 + lanes].astype(np.int64)
        if kind == "plain":
            want = np.minimum(src, add + x)
        else:
            want = np.minimum(src, np.clip(add + max(min(x, hi), -hi), 0, hi))
        assert a[d0: d0 + lanes].tolist() == want.tolist(), (kind, seed)


def test_sparse_search_is_tried_on_large_tables_by_default():
    """By default the search runs where the table is large (the Molmo2 settings), not where a
    one-row table is cheaper (the default family's patch axis dropped); either way on request."""
    assert KnapsackSolver(512, 128).sparse and not KnapsackSolver(1024, 0).sparse
    assert KnapsackSolver(1024, 0, sparse=True).sparse and not KnapsackSolver(512, 128, sparse=False).sparse
    w, u, v = np.array([5, 3, 4, 2]), np.array([2, 1, 1, 3]), np.array([50, 31, 40, 20])
    solver = KnapsackSolver(512, 128)
    assert solver.solve(w, u, v, 9, 3)[0] == brute_force_knapsack(w, u, v, 9, 3)[0] == 90
    assert solver.last_method == "sparse" and solver.last_items_processed == 0
    table = KnapsackSolver(512, 128, sparse=False)
    assert table.solve(w, u, v, 9, 3)[1].tolist() == solver.solve(w, u, v, 9, 3)[1].tolist()
    assert table.last_method == "table" and table.last_items_processed == 4


@pytest.mark.parametrize("seed", range(3))
def test_saturating_tails_bound_the_exact_ones(seed):
    """``_tails_sat`` (unsigned 8 bits, held less ``off = low``, the sum of the negative
    losses): every cell is at most the exact tail (a valid bound to prune by), and at least
    the smaller of the exact tail and ``2 low + 255`` (so it is exact up to there, and a cell
    beyond prunes whatever an exact one would within the budget the search allows)."""
    from packtool.knapsack import SAT_VEC, VEC, _tails, _tails_sat

    rng = np.random.default_rng(700 + seed)
    for trial in range(30):
        n = int(rng.integers(0, 12))
        cap = int(rng.integers(0, 140))
        x = rng.integers(0, 50, n)
        loss = rng.integers(-30, 200, n)
        if loss[loss < 0].sum() < -128:  # the caller's condition for 8-bit tails
            loss = np.abs(loss)
        low = int(loss[loss < 0].sum())
        price = int(rng.integers(0, 40))
        stride = (cap + 2 * VEC) // VEC * VEC
        exact = np.zeros((n + 1) * stride + VEC, dtype=np.int64)
        _tails(x, loss, n, price, cap, exact, 0, stride)
        stride8 = (cap + 2 * SAT_VEC - 1) // SAT_VEC * SAT_VEC  # the search's rows: as short as steps allow
        h = np.full(5 + (n + 1) * stride8 + SAT_VEC, 77, dtype=np.uint8)
        _tails_sat(x, loss, n, price, cap, h, 5, stride8, low)
        assert (h[:5] == 77).all(), (seed, trial)  # nothing written before the base
        assert (h[5 + (n + 1) * stride8:] == 77).all(), (seed, trial)  # nor past the last row
        for r in range(n + 1):
            want = exact[r * stride: r * stride + cap + 1]
            got = h[5 + r * stride8: 5 + r * stride8 + cap + 1].astype(np.int64) + low
            assert (got <= want).all(), (seed, trial, r)
            assert (got >= np.minimum(want, 2 * low + 255)).all(), (seed, trial, r)


@pytest.mark.parametrize("seed", range(4))
def test_sparse_search_with_8bit_tails_matches_brute_force(seed):
    """Prices that round to whole numbers at scale 1 (values 1,024 a weight unit and 960 a
    unit of the second capacity, less a rounding loss, as the Molmo2 settings give at 32 and
    30 with larger capacities): the search prunes by 8-bit tails, goes to 16 bits where a
    pass's budget passes their exact range, or to 32 where the values need it, and returns
    the brute-force value and tie-rule subset every time."""
    rng = np.random.default_rng(800 + seed)
    sparse, table = KnapsackSolver(40, 14, sparse=True), KnapsackSolver(40, 14, sparse=False)
    bits = []
    for k in range(40 if JIT else 10):
        n = int(rng.integers(1, (13 if JIT else 9) + 1))
        cw, cu = int(rng.integers(20, 41)), int(rng.integers(4, 15))
        w = rng.integers(1, 14, n)
        u = np.where(rng.random(n) < 0.2, 0, rng.integers(0, 5, n))
        v = np.maximum(1024 * w + 960 * u - rng.integers(0, 16 if k % 4 else 200, n), 0)
        want = brute_force_knapsack(w, u, v, cw, cu)
        got = sparse.solve(w, u, v, cw, cu)
        ref = table.solve(w, u, v, cw, cu)
        assert got[0] == ref[0] == want[0], (seed, k)
        assert got[1].tolist() == ref[1].tolist() == want[1].tolist(), (seed, k)
        if sparse.last_method == "sparse":
            bits.append(sparse.last_tail_bits)
    assert bits.count(8) >= (4 if JIT else 1) and 16 in bits or not JIT, (seed, bits)


def test_solve_takes_any_integer_arrays():
    """The compiled entry takes item arrays of any layout; other types, lists and read-only
    arrays are converted or read as they are, with the same answer; wrong shapes are refused
    before anything is read."""
    rng = np.random.default_rng(31)
    w, u = rng.integers(1, 60, 96), rng.integers(0, 20, 96)
    v = 32 * w + 30 * u - rng.integers(0, 32, 96)
    solver = KnapsackSolver(512, 128)
    want = solver.solve(w[::2].copy(), u[::2].copy(), v[::2].copy())
    table = KnapsackSolver(512, 128, sparse=False).solve(w[::2].copy(), u[::2].copy(), v[::2].copy())
    assert want[0] == table[0] > 0 and want[1].tolist() == table[1].tolist()
    ro = [x[::2].copy() for x in (w, u, v)]
    for x in ro:
        x.flags.writeable = False
    for args in ((w[::2], u[::2], v[::2]),  # strided views
                 (w[-2::-2][::-1], u[-2::-2][::-1], v[-2::-2][::-1]),  # negative strides
                 tuple(ro),
                 tuple(x[::2].astype(np.int32) for x in (w, u, v)),
                 tuple(x[::2].tolist() for x in (w, u, v))):
        value, chosen = solver.solve(*args)
        assert value == want[0] and chosen.tolist() == want[1].tolist()
    for bad in ((w.reshape(8, 12), u, v), (w, u[:-1], v), (w, u, v[None, :])):
        with pytest.raises(ValueError, match="1-D arrays of equal length"):
            solver.solve(*bad)
