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


@pytest.mark.parametrize("seed", range(4))
def test_matches_brute_force_on_random_small_buffers(seed):
    rng = np.random.default_rng(seed)
    for _ in range(60 if JIT else 15):
        w, u, v, cw, cu = _random_instance(rng, 14 if JIT else 10)
        value, chosen = solve_knapsack_2d(w, u, v, cw, cu)
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
    b = solve_knapsack_2d(w.copy(), u.copy(), v.copy(), cw, cu)
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
        ints = np.zeros((n + 2, _NCOL), dtype=np.int64)
        ints[:n, _FIT] = fit
        for i in range(n):
            ints[i, _LO_B] = max(max_u - int(u[i + 1:][fit[i + 1:]].sum()), 0)
            ints[i, _PU] = min(int(u[:i][fit[:i]].sum()), max_u)
        for exact in (True, False):
            reach = np.full((n, 2, max_u + 1), -7, dtype=np.int32)
            _reach(w, u, max_w, max_u, ints, reach, np.zeros((4, max_u + 1), dtype=np.int64), exact)
            for i in range(n):
                later = [j for j in range(i + 1, n) if fit[j]]
                sums: dict[int, list[int]] = {}
                for r in range(len(later) + 1):
                    for sub in combinations(later, r):
                        sums.setdefault(int(u[list(sub)].sum()), []).append(int(w[list(sub)].sum()))
                hi = min(max_u, int(ints[i, _PU] + u[i])) if fit[i] else int(ints[i, _PU])
                for k in range(max_u - hi + 1, max_u - int(ints[i, _LO_B]) + 1):  # rows below the top row
                    lo, last = int(reach[i, 0, k]), int(reach[i, 1, k])
                    ws = sums.get(k, [])
                    if exact:  # clamped to -1 .. max_w + 1
                        want = (max(max_w - max(ws), -1), max(max_w - min(ws), -1)) if ws else None
                        assert (lo, last) == want if want else lo > last, (seed, i, k, lo, last, ws)
                    else:
                        assert all(lo <= max_w - x <= last for x in ws if max_w - x >= 0), (seed, i, k, lo, last, ws)
