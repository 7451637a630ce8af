"""Where one knapsack solve at the Molmo2 settings spends its time, and this kernel against another.

``python -m bench.profile_kernel [N]`` solves N bench buffers (``bench_pack.kernel_bench``'s: 48
Molmo2-SFT-like samples, 512 x 128) and times, each right after a numpy full-table DP (as the
kernel bench does: its 26 MB table leaves packtool's code and data out of the caches) and again
warm: the whole ``KnapsackSolver.solve``, the compiled entry alone (the arguments made ready
before the clock starts), an empty compiled function through numba's dispatcher with 1 and with
8 array arguments, and ``np.empty`` of the mask. Medians in microseconds.

``python -m bench.profile_kernel [N] --warmed`` times the same solve after numpy with something
else run first, untimed (:func:`warmed`): which part of the cold cost is the code path and which
the search's data.

``python -m bench.profile_kernel [N] --against FILE`` instead solves each buffer with this kernel
and with the module ``FILE`` (another version of ``packtool/knapsack.py``, e.g. ``git show
COMMIT:packtool/knapsack.py > old_knapsack.py``), each after a numpy solve, in alternating order,
checks that all three agree, and prints both medians and their ratio.
"""

from __future__ import annotations

import importlib
import os
import sys
import time

import numpy as np

from bench.baselines import numpy_dp_solve
from bench.bench_pack import GRAN, MAX_TOKENS, MAX_UNITS, VISION_WEIGHT, _fitting, _load


def _buffers(n: int, seed: int = 7):
    tokens, units = _fitting("molmo2", 200_000, seed)
    rng = np.random.default_rng(seed)
    for _ in range(n):
        idx = rng.choice(len(tokens), 48, replace=False)
        yield -(-tokens[idx] // GRAN), units[idx], tokens[idx] + VISION_WEIGHT * units[idx]


def _warm_up(solver) -> None:
    solver.solve(np.array([300, 300]), np.array([1, 1]), np.array([1, 2]))


def split(n: int) -> dict[str, tuple[float, float]]:
    """``{part: (median after numpy, median warm)}`` in microseconds."""
    from numba import njit

    from packtool.knapsack import KnapsackSolver

    @njit
    def empty1(a):  # pragma: no cover - compiled
        return a.shape[0]

    @njit
    def empty8(a, b, c, d, e, f, g, h):  # pragma: no cover - compiled
        return a.shape[0]

    cap_w = MAX_TOKENS // GRAN
    solver = KnapsackSolver(cap_w, MAX_UNITS)
    _warm_up(solver)
    z = np.zeros(48, dtype=np.int64)
    empty1(z)
    empty8(z, z, z, z, z, z, z, z)
    mask = np.dtype(np.bool_)
    parts = {
        "solve()": lambda w, u, v: solver.solve(w, u, v),
        "compiled entry": None,  # timed with its arguments ready
        "empty call, 1 array": lambda w, u, v: empty1(w),
        "empty call, 8 arrays": lambda w, u, v: empty8(w, u, v, z, z, z, z, z),
        "np.empty of the mask": lambda w, u, v: np.empty(48, mask),
    }
    cold: dict[str, list[float]] = {k: [] for k in parts}
    warm: dict[str, list[float]] = {k: [] for k in parts}
    names = list(parts)
    for b, (w, u, v) in enumerate(_buffers(n)):
        for name in names if b % 2 == 0 else names[::-1]:
            for times in (cold[name], warm[name]):
                if times is cold[name]:
                    numpy_dp_solve(w, u, v, cap_w, MAX_UNITS)
                solver.reset()
                if parts[name] is None:
                    entry, ws, table, chosen = solver._entry, solver._ws, solver._table, np.empty(48, mask)
                    t0 = time.perf_counter()
                    entry(w, u, v, cap_w, MAX_UNITS, ws, table, chosen)
                else:
                    f = parts[name]
                    t0 = time.perf_counter()
                    f(w, u, v)
                times.append(time.perf_counter() - t0)
    return {k: (float(np.median(cold[k])) * 1e6, float(np.median(warm[k])) * 1e6) for k in parts}


def against(n: int, path: str) -> dict:
    """Medians (microseconds, each solve after a numpy solve) of this kernel and the one in ``path``."""
    from packtool.knapsack import KnapsackSolver

    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    other = importlib.import_module(os.path.splitext(os.path.basename(path))[0])
    cap_w = MAX_TOKENS // GRAN
    solvers = {"this": KnapsackSolver(cap_w, MAX_UNITS), "other": other.KnapsackSolver(cap_w, MAX_UNITS)}
    for s in solvers.values():
        _warm_up(s)
    times: dict[str, list[float]] = {"numpy": [], "this": [], "other": []}
    for b, (w, u, v) in enumerate(_buffers(n)):
        for name in ("this", "other") if b % 2 == 0 else ("other", "this"):
            t0 = time.perf_counter()
            ref = numpy_dp_solve(w, u, v, cap_w, MAX_UNITS)
            t1 = time.perf_counter()
            solvers[name].reset()
            value, chosen = solvers[name].solve(w, u, v)
            t2 = time.perf_counter()
            if value != ref[0] or chosen.tolist() != ref[1].tolist():
                raise RuntimeError(f"buffer {b}: the {name} kernel differs from the numpy DP")
            times["numpy"].append(t1 - t0)
            times[name].append(t2 - t1)
    med = {k: float(np.median(t)) * 1e6 for k, t in times.items()}
    return {**med, "ratio": med["this"] / med["other"]}


def warmed(n: int) -> dict[str, float]:
    """Median solve (microseconds, right after a numpy solve) when, between the numpy solve and
    the timed one, something untimed runs first: nothing; a 2-item solve of the same solver
    (the Python call, the argument passing and the compiled prologue, answered at once); the
    previous buffer solved by a second solver (all the code, none of this solver's data); this
    solver's workspace and table read (its data, none of the code)."""
    from packtool.knapsack import KnapsackSolver

    cap_w = MAX_TOKENS // GRAN
    solver, other = KnapsackSolver(cap_w, MAX_UNITS), KnapsackSolver(cap_w, MAX_UNITS)
    for s in (solver, other):
        _warm_up(s)
    tiny = (np.array([300, 300]), np.array([1, 1]), np.array([1, 2]))
    first = {"nothing": lambda prev: None,
             "a 2-item solve": lambda prev: solver.solve(*tiny),
             "another solver, another buffer": lambda prev: other.solve(*prev),
             "the workspace and table read": lambda prev: (solver._ws.sum(), solver._table.sum())}
    times: dict[str, list[float]] = {k: [] for k in first}
    names = list(first)
    buffers = list(_buffers(n))
    for b, (w, u, v) in enumerate(buffers):
        for name in names if b % 2 == 0 else names[::-1]:
            numpy_dp_solve(w, u, v, cap_w, MAX_UNITS)
            other.reset()
            first[name](buffers[b - 1])
            solver.reset()
            t0 = time.perf_counter()
            solver.solve(w, u, v)
            times[name].append(time.perf_counter() - t0)
    return {k: float(np.median(t)) * 1e6 for k, t in times.items()}


def main(argv: list[str]) -> int:
    nums = [a for a in argv if a.isdigit()]
    n = int(nums[0]) if nums else 300
    if "--against" in argv:
        r = against(n, argv[argv.index("--against") + 1])
        print(f"{n} buffers, each solve after a numpy solve (numpy median {r['numpy']:,.0f} us), load {_load()}:")
        print(f"this kernel {r['this']:.1f} us ({r['numpy'] / r['this']:.1f}x numpy), the other {r['other']:.1f} us "
              f"({r['numpy'] / r['other']:.1f}x); this / other {r['ratio']:.3f}; same value and subset every time")
        return 0
    if "--warmed" in argv:
        print(f"{n} buffers, median solve in us right after a numpy solve, with first (untimed):")
        for name, t in warmed(n).items():
            print(f"{name:<32} {t:7.1f}")
        print(f"load {_load()}")
        return 0
    rows = split(n)
    print(f"{n} buffers, medians in us; 'cold': right after a numpy solve; load {_load()}")
    print(f"{'part':<24} {'cold':>7} {'warm':>7}")
    for name, (c, w) in rows.items():
        print(f"{name:<24} {c:7.1f} {w:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
