"""Exact 0/1 two-dimensional knapsack, compiled with numba (numpy in, numpy out).

Objective, exactly: choose a subset S of the buffer maximizing
``sum(value[i] for i in S)`` subject to ``sum(w[i]) <= max_w`` and ``sum(u[i]) <= max_u``,
where ``w`` are token sizes already quantized by the caller (``ceil(tokens / g)``,
capacity ``floor(max_tokens / g)``, so every chosen set also fits unquantized) and
``u`` are (possibly quantized) vision units. Values are integers, so optima compare
exactly. Ties are broken deterministically: among equal-value sets the DP keeps the
one found first in item order, so the same buffer always gives the same pack.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["solve_knapsack_2d"]


@njit(cache=True)
def _knapsack_2d(w, u, v, max_w, max_u, keep, dp):  # pragma: no cover - compiled
    n = w.shape[0]
    dp[:, :] = 0
    for i in range(n):
        wi = w[i]
        ui = u[i]
        vi = v[i]
        for a in range(max_w, wi - 1, -1):
            for b in range(max_u, ui - 1, -1):
                cand = dp[a - wi, b - ui] + vi
                if cand > dp[a, b]:
                    dp[a, b] = cand
                    keep[i, a, b] = True
                else:
                    keep[i, a, b] = False
            for b in range(min(ui, max_u + 1) - 1, -1, -1):
                keep[i, a, b] = False
        for a in range(min(wi, max_w + 1) - 1, -1, -1):
            for b in range(max_u + 1):
                keep[i, a, b] = False
    # backtrack from the full-capacity cell
    chosen = np.zeros(n, dtype=np.bool_)
    a = max_w
    b = max_u
    for i in range(n - 1, -1, -1):
        if keep[i, a, b]:
            chosen[i] = True
            a -= w[i]
            b -= u[i]
    return dp[max_w, max_u], chosen


def solve_knapsack_2d(w: np.ndarray, u: np.ndarray, v: np.ndarray, max_w: int, max_u: int) -> tuple[int, np.ndarray]:
    """Best subset of items under two capacities.

    Args:
        w: item weights in the first dimension (non-negative ints).
        u: item weights in the second dimension (non-negative ints).
        v: item values (non-negative ints).
        max_w, max_u: capacities.

    Returns:
        ``(best_value, chosen)`` with ``chosen`` a boolean mask over the items.

    Example:
        >>> solve_knapsack_2d(np.array([3, 4, 5]), np.array([1, 1, 2]), np.array([3, 4, 5]), 8, 2)
        (8, array([ True, False,  True]))
    """
    w = np.ascontiguousarray(w, dtype=np.int64)
    u = np.ascontiguousarray(u, dtype=np.int64)
    v = np.ascontiguousarray(v, dtype=np.int64)
    if not (w.ndim == u.ndim == v.ndim == 1 and len(w) == len(u) == len(v)):
        raise ValueError("w, u and v must be 1-D arrays of equal length")
    if len(w) and (w.min() < 0 or u.min() < 0 or v.min() < 0):
        raise ValueError("weights and values must be non-negative")
    if max_w < 0 or max_u < 0:
        raise ValueError("capacities must be non-negative")
    keep = np.zeros((len(w), max_w + 1, max_u + 1), dtype=np.bool_)
    dp = np.zeros((max_w + 1, max_u + 1), dtype=np.int64)
    best, chosen = _knapsack_2d(w, u, v, int(max_w), int(max_u), keep, dp)
    return int(best), chosen
