"""Benchmarks run by ``make bench``: each ``bench/bench_*.py`` module exposes ``run(quick: bool) -> str``
returning a Markdown table measured side by side with its baseline in the same run."""

import time


def best_s(fn, repeat: int = 3) -> float:
    """The fastest of ``repeat`` timed calls of ``fn()``, in seconds (the least disturbed by other jobs)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
