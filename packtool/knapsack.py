"""Exact 0/1 two-dimensional knapsack, compiled with numba (numpy in, numpy out).

The objective, exactly
----------------------
Given items with integer weights ``w[i] >= 0`` (first dimension), ``u[i] >= 0`` (second
dimension) and values ``v[i] >= 0``, choose the subset ``S`` that maximizes
``sum(v[i] for i in S)`` subject to ``sum(w[i]) <= max_w`` and ``sum(u[i]) <= max_u``, and
optionally ``len(S) <= max_items``. Every input is an exact integer; there is no rounding
inside the kernel, so the returned value is the true optimum of the stated problem.

How the packer feeds it (``packer.plan_packs``): ``w = ceil(tokens / g)`` and
``max_w = floor(max_tokens / g)`` with ``g`` the token granularity, so any subset the kernel
accepts also fits the unrounded token capacity; ``u`` are the exact vision units and
``max_u`` the exact unit capacity; ``v = text_weight * tokens + vision_weight * units``
with the *exact* token count. Quantization therefore only ever makes the token constraint
slightly stricter; it never enters the value.

Ties (deterministic): among all optimal subsets the kernel returns the one that avoids the
later items: item ``i`` is taken only if taking it *strictly* improves on the best value
of items ``0..i-1`` within the capacity left. Comparing two optimal subsets from the last
item backwards, the first item where they differ is absent from the returned one. In
buffer order (oldest first) this means older samples win ties.

Algorithm
---------
A dense dynamic program over the table ``best[a, b]`` = best value within capacity
``(a, b)``, updated in place, one item at a time (``a`` descending, so each item is used at
most once); ``keep[i, a, b]`` records whether item ``i`` improved the cell, and a backtrack
from ``(max_w, max_u)`` recovers the subset. What makes it fast compared with the textbook
``(items x tokens x units)`` numpy table:

* compiled loops over contiguous rows that LLVM vectorizes; values held in the narrowest
  integer type that cannot overflow (``int16`` for the Molmo2 settings);
* only the cells that can still reach the corner are updated: after item ``i`` the
  remaining items weigh ``R_w(i)`` and ``R_u(i)`` in total, so cells with
  ``a < max_w - R_w(i)`` or ``b < max_u - R_u(i)`` are never read again and are skipped;
* :class:`KnapsackSolver` keeps checkpoints of the table every few items, so a buffer
  whose first items did not change since the last solve restarts from the last valid
  checkpoint instead of from zero (the buffer policy keeps arrival order, so the oldest
  items that stayed in the buffer form that prefix);
* trivial instances are answered without a table: when all items that fit on their own
  also fit together, every one with a positive value is taken (zero-value items never
  improve strictly, so the tie rule leaves them out, as the table would).

With ``max_items`` the table gains a count axis (``best[c, a, b]``, at most ``c`` items);
the constraint is exact, not a post-hoc top-k. It is skipped when it cannot bind (no
feasible subset has more than ``max_items`` items).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["solve_knapsack_2d", "KnapsackSolver", "max_cardinality"]

#: Table checkpoints are kept every this many items (prefix reuse granularity).
CHECKPOINT_EVERY = 8
#: Refuse tables (keep bits) larger than this many bytes; callers should shrink the buffer.
MAX_TABLE_BYTES = 1 << 30


#: Rows of the table are padded by this many cells so inner loops run in whole vectors.
PAD = 64


@njit(cache=True)
def _forward(w, u, v, max_w, max_u, lo_a, lo_b, start, pu0, best, scratch, ckpt, every):  # pragma: no cover - compiled
    """Items ``start..n-1`` into ``best[b, a]`` (in place); ``best`` holds the table before ``start``.

    ``pu0`` is the unit weight of the fitting items before ``start`` (capped at ``max_u``):
    rows above it would be copies of row ``pu0``; they are not kept up to date but
    initialized from it when an item first reaches them. Before item
    ``i`` with ``i % every == 0`` the table is copied to ``ckpt[i // every]``. Cells with
    ``a < lo_a[i]`` or ``b < lo_b[i]`` are never read again and are not updated for item ``i``.
    Returns the unit weight after the last item (capped).
    """
    n = w.shape[0]
    pu = pu0
    for i in range(start, n):
        if i % every == 0:
            ckpt[i // every, :, :] = best
        wi = w[i]
        ui = u[i]
        vi = v[i]
        if wi > max_w or ui > max_u:
            continue
        a0 = max(wi, lo_a[i])
        m = max_w + 1 - a0
        m = (m + PAD - 1) // PAD * PAD
        hi = min(max_u, pu + ui)
        for b in range(hi, max(ui, lo_b[i]) - 1, -1):
            if ui == 0:
                # the item reads the row it writes: read an unchanged copy
                scratch[:] = best[b]
                src = scratch[a0 - wi: a0 - wi + m]
            else:
                src = best[b - ui, a0 - wi: a0 - wi + m]
            if b > pu:
                # a row entering use starts as a copy of the edge row it stood for
                best[b, :] = best[pu]
            dst = best[b, a0: a0 + m]
            for k in range(m):
                c = src[k] + vi
                d = dst[k]
                dst[k] = c if c > d else d
        # rows that become valid but the item cannot reach keep the old edge row
        for b in range(max(pu + 1, lo_b[i]), min(ui, hi + 1)):
            best[b, :] = best[pu]
        pu = hi
    return pu


@njit(cache=True)
def _value_at(w, u, v, first, last, b, a, table, pu):  # pragma: no cover - compiled
    """Best value of items ``first..last-1`` plus the table before ``first``, within ``(b, a)``.

    Enumerates the ``2**(last-first)`` subsets of those items (a block is short).
    """
    k = last - first
    out = -1
    for mask in range(1 << k):
        sw = 0
        su = 0
        sv = 0
        for j in range(k):
            if (mask >> j) & 1:
                sw += w[first + j]
                su += u[first + j]
                sv += v[first + j]
        if sw <= a and su <= b:
            val = sv + table[min(b - su, pu), a - sw]
            if val > out:
                out = val
    return out


@njit(cache=True)
def _backtrack(w, u, v, max_w, max_u, best_value, pu_before, ckpt, every, chosen):  # pragma: no cover - compiled
    """Recover the subset without per-item tables: item ``i`` is taken iff the best value
    within the current capacity drops without it. That value is rebuilt from the checkpoint
    at the start of ``i``'s block by enumerating the block's earlier items."""
    a = max_w
    b = max_u
    cur = best_value
    for i in range(w.shape[0] - 1, -1, -1):
        chosen[i] = False
        if w[i] > a or u[i] > b:
            continue
        s = (i // every) * every
        without = _value_at(w, u, v, s, i, b, a, ckpt[i // every], pu_before[s])
        if cur > without:
            chosen[i] = True
            a -= w[i]
            b -= u[i]
            cur -= v[i]


@njit(cache=True)
def _forward_count(w, u, v, max_w, max_u, max_c, best, keep):  # pragma: no cover - compiled
    """As :func:`_forward` with a count axis: ``best[c, a, b]`` uses at most ``c`` items."""
    n = w.shape[0]
    for i in range(n):
        wi = w[i]
        ui = u[i]
        vi = v[i]
        if wi > max_w or ui > max_u:
            continue
        ki = keep[i]
        for cnt in range(max_c, 0, -1):
            prev = best[cnt - 1]
            cur = best[cnt]
            kc = ki[cnt]
            m = max_u + 1 - ui
            for a in range(max_w, wi - 1, -1):
                src = prev[a - wi, :m]
                dst = cur[a, ui:]
                kr = kc[a, ui:]
                for k in range(m):
                    c = src[k] + vi
                    d = dst[k]
                    t = c > d
                    kr[k] = t
                    dst[k] = c if t else d


@njit(cache=True)
def _backtrack_count(w, u, max_w, max_u, max_c, keep, chosen):  # pragma: no cover - compiled
    a = max_w
    b = max_u
    cnt = max_c
    for i in range(w.shape[0] - 1, -1, -1):
        chosen[i] = False
        if cnt > 0 and w[i] <= a and u[i] <= b and keep[i, cnt, a, b]:
            chosen[i] = True
            a -= w[i]
            b -= u[i]
            cnt -= 1


def max_cardinality(w: np.ndarray, u: np.ndarray, max_w: int, max_u: int) -> int:
    """An upper bound on how many items any feasible subset can hold.

    The ``k`` lightest items in one dimension must fit that dimension, so the answer is the
    smaller of the two "smallest-first" counts.

    Example:
        >>> max_cardinality(np.array([1, 1, 5]), np.array([0, 3, 0]), 6, 2)
        2
    """
    out = len(w)
    for x, cap in ((np.asarray(w), max_w), (np.asarray(u), max_u)):
        s = np.cumsum(np.sort(x))
        out = min(out, int(np.searchsorted(s, cap, side="right")))
    return out


def _value_dtype(v: np.ndarray, w: np.ndarray, u: np.ndarray, max_w: int, max_u: int):
    """The narrowest integer type that holds every table value without overflow.

    A table value never exceeds the total value, nor the fractional (Dantzig) bound of
    either dimension alone, so the smallest of those bounds decides.
    """
    total = int(v.sum()) if len(v) else 0
    for x, cap in ((w, max_w), (u, max_u)):
        free = x == 0
        bound = int(v[free].sum())
        x_pos, v_pos = x[~free], v[~free]
        if len(x_pos):
            order = np.argsort(-(v_pos / x_pos), kind="stable")
            cum = np.cumsum(x_pos[order])
            k = int(np.searchsorted(cum, cap, side="right"))
            bound += int(v_pos[order][:k].sum())
            if k < len(order):
                rest = cap - (int(cum[k - 1]) if k else 0)
                bound += -(-int(v_pos[order][k]) * rest // int(x_pos[order][k]))
        total = min(total, bound)
    if total <= np.iinfo(np.int16).max:
        return np.int16
    if total <= np.iinfo(np.int32).max:
        return np.int32
    return np.int64


def _validate(w, u, v, max_w, max_u, max_items):
    w = np.ascontiguousarray(w, dtype=np.int64)
    u = np.ascontiguousarray(u, dtype=np.int64)
    v = np.ascontiguousarray(v, dtype=np.int64)
    if not (w.ndim == u.ndim == v.ndim == 1 and len(w) == len(u) == len(v)):
        raise ValueError("w, u and v must be 1-D arrays of equal length")
    if len(w) and (w.min() < 0 or u.min() < 0 or v.min() < 0):
        raise ValueError("weights and values must be non-negative")
    if int(max_w) < 0 or int(max_u) < 0:
        raise ValueError("capacities must be non-negative")
    if max_items is not None and int(max_items) < 0:
        raise ValueError("max_items must be non-negative")
    return w, u, v


class KnapsackSolver:
    """Reusable exact solver with a workspace and DP-prefix reuse between calls.

    Each :meth:`solve` compares the new items with those of the previous call; if the
    first ``p`` items are identical (and the skipped cells of the old table are still
    unneeded) the table is restored from the last checkpoint at or before ``p`` and only
    the items after it are processed. The answer is identical to a fresh solve.

    Example:
        >>> s = KnapsackSolver(8, 3)
        >>> s.solve(np.array([3, 4, 5]), np.array([1, 1, 2]), np.array([3, 4, 5]))
        (8, array([ True, False,  True]))
    """

    def __init__(self, max_w: int, max_u: int, max_items: int | None = None) -> None:
        if int(max_w) < 0 or int(max_u) < 0:
            raise ValueError("capacities must be non-negative")
        if max_items is not None and int(max_items) < 0:
            raise ValueError("max_items must be non-negative")
        self.max_w = int(max_w)
        self.max_u = int(max_u)
        self.max_items = None if max_items is None else int(max_items)
        self._prev: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._dtype = None
        self._best: np.ndarray | None = None
        self._ckpt: np.ndarray | None = None
        self._lo: tuple[np.ndarray, np.ndarray] | None = None
        #: items processed by the DP in the last call (for benchmarks and tests)
        self.last_items_processed = 0

    def reset(self) -> None:
        """Forget the previous call, so the next one solves from scratch (keeps the workspace)."""
        self._prev = None

    def _workspace(self, n: int, dtype) -> None:
        rows, cols = self.max_u + 1, self.max_w + 1 + PAD
        size = (n // CHECKPOINT_EVERY + 2) * rows * cols * np.dtype(dtype).itemsize
        if size > MAX_TABLE_BYTES:
            raise ValueError(
                f"a knapsack over {n} items needs {size / 2**20:,.0f} MiB of tables; use fewer items "
                "(a smaller buffer) or a coarser granularity"
            )
        if (self._ckpt is None or self._ckpt.shape[0] < n // CHECKPOINT_EVERY + 1 or self._dtype != dtype
                or self._ckpt.shape[1:] != (rows, cols)):
            cap = max(n, 8)
            self._ckpt = np.zeros((cap // CHECKPOINT_EVERY + 1, rows, cols), dtype=dtype)
            self._best = np.zeros((rows, cols), dtype=dtype)
            self._scratch = np.zeros(cols, dtype=dtype)
            self._dtype = dtype
            self._prev = None

    def solve(self, w: np.ndarray, u: np.ndarray, v: np.ndarray, max_w: int | None = None,
              max_u: int | None = None) -> tuple[int, np.ndarray]:
        """Optimal ``(value, chosen_mask)`` for these items (see the module docstring).

        ``max_w`` / ``max_u`` lower the capacities for this call (at most the solver's own).
        """
        w, u, v = _validate(w, u, v, self.max_w, self.max_u, self.max_items)
        cap_w = self.max_w if max_w is None else int(max_w)
        cap_u = self.max_u if max_u is None else int(max_u)
        if not (0 <= cap_w <= self.max_w and 0 <= cap_u <= self.max_u):
            raise ValueError(f"capacities ({cap_w}, {cap_u}) must lie within the solver's ({self.max_w}, {self.max_u})")
        n = len(w)
        chosen = np.zeros(n, dtype=np.bool_)
        if n == 0:
            return 0, chosen
        fits = (w <= cap_w) & (u <= cap_u)
        wf = np.where(fits, w, 0)
        uf = np.where(fits, u, 0)
        limit = self.max_items
        if limit is not None and limit >= max_cardinality(w[fits], u[fits], cap_w, cap_u):
            limit = None
        # everything that fits on its own fits together: take all with positive value;
        # zero-value items never improve strictly, so the tie rule leaves them out
        if limit is None and wf.sum() <= cap_w and uf.sum() <= cap_u:
            chosen = fits & (v > 0)
            self.last_items_processed = 0
            return int(v[chosen].sum()), chosen
        if limit is not None:
            return self._solve_count(w, u, v, limit, cap_w, cap_u)
        # capacities beyond the total weight add nothing: cells there equal the edge
        max_w = int(min(cap_w, wf.sum()))
        max_u = int(min(cap_u, uf.sum()))
        dtype = _value_dtype(v, w, u, max_w, max_u)
        self._workspace(n, dtype)
        # weight of the items after i: cells below max - after[i] are never read again
        after_w = np.concatenate([np.cumsum(wf[::-1])[::-1][1:], [0]])
        after_u = np.concatenate([np.cumsum(uf[::-1])[::-1][1:], [0]])
        lo_a = np.maximum(max_w - after_w, 0)
        lo_b = np.maximum(max_u - after_u, 0)
        pu_before = np.minimum(np.concatenate([[0], np.cumsum(uf)[:-1]]), max_u)
        start = self._reusable_prefix(w, u, v, lo_a, lo_b, (max_w, max_u))
        best = self._best
        if start == 0:
            best[:, :] = 0
            pu0 = 0
        else:
            best[:, :] = self._ckpt[start // CHECKPOINT_EVERY]
            pu0 = int(pu_before[start])
        vv = v.astype(dtype)
        _forward(w, u, vv, max_w, max_u, lo_a, lo_b, start, pu0, best, self._scratch, self._ckpt, CHECKPOINT_EVERY)
        value = int(best[max_u, max_w])
        _backtrack(np.where(fits, w, max_w + 1), u, v, max_w, max_u, value, pu_before, self._ckpt, CHECKPOINT_EVERY,
                   chosen)
        self._prev = (w, u, v)
        self._lo = (lo_a, lo_b, (max_w, max_u))
        self.last_items_processed = n - start
        return value, chosen

    def _reusable_prefix(self, w, u, v, lo_a, lo_b, caps) -> int:
        """First item to process: a checkpoint index whose table is still valid, else 0."""
        if self._prev is None or self._lo is None or self._lo[2] != caps:
            return 0
        pw, pu, pv = self._prev
        m = min(len(pw), len(w))
        same = (pw[:m] == w[:m]) & (pu[:m] == u[:m]) & (pv[:m] == v[:m])
        p = int(np.argmin(same)) if not same.all() else m
        # cells skipped before must not be read now, and the reused keep rows must cover
        # every cell the backtrack can visit now
        old_a, old_b, _ = self._lo
        start = (min(p, len(w) - 1) // CHECKPOINT_EVERY) * CHECKPOINT_EVERY
        while start > 0:
            ok_table = old_a[:start].max() <= lo_a[start - 1] and old_b[:start].max() <= lo_b[start - 1]
            ok_keep = bool(np.all(old_a[:start] <= lo_a[:start]) and np.all(old_b[:start] <= lo_b[:start]))
            if ok_table and ok_keep:
                break
            start -= CHECKPOINT_EVERY
        return start

    def _solve_count(self, w, u, v, limit: int, max_w: int, max_u: int) -> tuple[int, np.ndarray]:
        n = len(w)
        cells = (limit + 1) * (max_w + 1) * (max_u + 1)
        if n * cells > MAX_TABLE_BYTES:
            raise ValueError(
                f"a knapsack over {n} items with at most {limit} per pack needs a {n * cells / 2**20:,.0f} MiB "
                "table; use fewer items (a smaller buffer) or drop the item limit"
            )
        dtype = _value_dtype(v, w, u, max_w, max_u)
        best = np.zeros((limit + 1, max_w + 1, max_u + 1), dtype=dtype)
        keep = np.zeros((n, limit + 1, max_w + 1, max_u + 1), dtype=np.bool_)
        _forward_count(w, u, v.astype(dtype), max_w, max_u, limit, best, keep)
        chosen = np.zeros(n, dtype=np.bool_)
        _backtrack_count(w, u, max_w, max_u, limit, keep, chosen)
        self._prev = None
        self.last_items_processed = n
        return int(best[limit, max_w, max_u]), chosen


def solve_knapsack_2d(
    w: np.ndarray, u: np.ndarray, v: np.ndarray, max_w: int, max_u: int, max_items: int | None = None
) -> tuple[int, np.ndarray]:
    """Best subset of items under two capacities (and optionally a cap on the item count).

    Args:
        w: item weights in the first dimension (non-negative ints).
        u: item weights in the second dimension (non-negative ints).
        v: item values (non-negative ints).
        max_w, max_u: capacities.
        max_items: at most this many items (``None``: no limit).

    Returns:
        ``(best_value, chosen)`` with ``chosen`` a boolean mask over the items; ties follow
        the rule in the module docstring.

    Example:
        >>> solve_knapsack_2d(np.array([3, 4, 5]), np.array([1, 1, 2]), np.array([3, 4, 5]), 8, 3)
        (8, array([ True, False,  True]))
    """
    return KnapsackSolver(max_w, max_u, max_items).solve(w, u, v)
