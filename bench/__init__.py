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


def best_interleaved_s(fns: dict, rounds: int = 5) -> dict:
    """The fastest timed call of each of ``fns`` (name -> function), called in turn ``rounds``
    times, so a burst of load from other jobs falls on every side alike."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best
