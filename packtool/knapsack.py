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
A dense dynamic program over the table ``best[b, a]`` = best value within capacity
``(a, b)`` (rows: the second dimension, contiguous along the first), one item at a time,
and a backtrack from ``(max_w, max_u)`` that needs no per-item decision table. What makes
it fast compared with the textbook ``(items x tokens x units)`` numpy table:

* the inner loop is one branch-free ``max(dst, src + v)`` over a contiguous row, written so
  that LLVM keeps it in the table's own integer type: values are held in the narrowest
  type that cannot overflow (``int16`` for the Molmo2 settings: 32 lanes per AVX-512
  instruction), chosen from a fractional (Dantzig) upper bound on any table value. Loops run
  over whole vectors (rows carry padding), and row copies are explicit loops (numba's
  slice assignment costs more than a row update);
* only cells that can still matter are touched: after item ``i`` the remaining items
  weigh ``R_w(i)`` and ``R_u(i)`` in total, so cells with ``a < max_w - R_w(i)`` or
  ``b < max_u - R_u(i)`` are never read again and are skipped; rows above the units of
  the items so far would be copies of the last reachable row and are only filled when an
  item first reaches them;
* most items update the table in place (rows in descending order, so each item is used at
  most once); every ``CHECKPOINT_EVERY``-th item instead writes its result into the next
  of a ring of tables, which leaves the previous table intact as a checkpoint for free
  (that item reads and writes each cell once either way);
* the backtrack decides item ``i`` from the checkpoint at the start of its block: the best
  value without ``i`` is the best over the (at most ``2**(CHECKPOINT_EVERY - 1)``) subsets of
  the block's earlier items plus the checkpoint's value at the capacity they leave;
* :class:`KnapsackSolver` keeps its tables between calls, so a buffer whose first items did
  not change since the last solve restarts from the last valid checkpoint instead of from
  zero (the buffer policy keeps arrival order, so the oldest items that stayed in the
  buffer form that prefix);
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
from numba.extending import overload

__all__ = ["solve_knapsack_2d", "KnapsackSolver", "max_cardinality"]

#: Every this many items one writes a fresh table, keeping the previous one as a checkpoint
#: (prefix-reuse granularity; the backtrack enumerates at most ``2**(this - 1)`` subsets).
CHECKPOINT_EVERY = 8
#: Refuse workspaces (all checkpoint tables) larger than this many bytes.
MAX_TABLE_BYTES = 1 << 30
#: Cells per vector step: row loops are rounded up to whole multiples of this (32 ``int16``
#: lanes fill an AVX-512 register); rows carry this much padding past the capacity.
VEC = 32


def _narrow(x, like):
    """``x`` converted (wrapping) to the element type of array ``like``."""
    return like.dtype.type(x)


@overload(_narrow)
def _narrow_impl(x, like):  # pragma: no cover - compiled
    # numba computes ``int16 + int64`` in int64; converting the sum back to the table's type
    # lets LLVM run the add and the max in that type (16-bit lanes instead of 64-bit ones)
    t = like.dtype

    def impl(x, like):
        return t(x)

    return impl


@njit(cache=True)
def _dantzig(x, v, fits, cap):  # pragma: no cover - compiled
    """Fractional-knapsack bound on the value of any fitting subset with ``sum(x) <= cap``."""
    n = x.shape[0]
    bound = 0
    ratio = np.empty(n)
    k = 0
    idx = np.empty(n, dtype=np.int64)
    for i in range(n):
        if fits[i] and v[i] > 0:
            if x[i] == 0:
                bound += v[i]
            else:
                ratio[k] = -v[i] / x[i]
                idx[k] = i
                k += 1
    order = np.argsort(ratio[:k])
    left = cap
    for j in range(k):
        i = idx[order[j]]
        if x[i] <= left:
            bound += v[i]
            left -= x[i]
        else:
            bound += -(-v[i] * left // x[i])
            break
    # +1: a float sort may swap items whose ratios differ in the last bit
    return bound + 1


@njit(cache=True)
def _prepare(w, u, v, cap_w, cap_u, fits, lo_a, lo_b, pu_before):  # pragma: no cover - compiled
    """Checks and per-item bounds in one pass; returns ``(status, max_w, max_u, bound)``.

    ``status``: -1 a negative input, 1 everything that fits alone fits together (then
    ``max_w``/``max_u`` are the totals), 0 a table is needed. ``max_w``/``max_u`` are the
    capacities cut to the total weight (capacity beyond it adds nothing); ``lo_a[i]`` /
    ``lo_b[i]`` the smallest cells still needed after item ``i``; ``pu_before[i]`` the units
    of the fitting items before ``i`` (capped); ``bound`` an upper bound on any table value,
    padding columns included.
    """
    n = w.shape[0]
    sw = 0
    su = 0
    for i in range(n):
        if w[i] < 0 or u[i] < 0 or v[i] < 0:
            return -1, 0, 0, 0
        f = w[i] <= cap_w and u[i] <= cap_u
        fits[i] = f
        if f:
            sw += w[i]
            su += u[i]
    if sw <= cap_w and su <= cap_u:
        return 1, sw, su, 0
    max_w = min(cap_w, sw)
    max_u = min(cap_u, su)
    rw = 0
    ru = 0
    for i in range(n - 1, -1, -1):
        lo_a[i] = max(max_w - rw, 0)
        lo_b[i] = max(max_u - ru, 0)
        if fits[i]:
            rw += w[i]
            ru += u[i]
    pu = 0
    for i in range(n):
        pu_before[i] = min(pu, max_u)
        if fits[i]:
            pu += u[i]
    bound = min(_dantzig(w, v, fits, max_w + VEC - 1), _dantzig(u, v, fits, max_u))
    return 0, max_w, max_u, bound


@njit(cache=True, inline="always")
def _copy(dst, src, m):  # pragma: no cover - compiled
    # an explicit loop: numba's slice assignment measured several times slower per row
    for k in range(m):
        dst[k] = src[k]


@njit(cache=True, inline="always")
def _fill_zero(dst, m):  # pragma: no cover - compiled
    for k in range(m):
        dst[k] = 0


@njit(cache=True, inline="always")
def _relax(dst, old, src, vi, m):  # pragma: no cover - compiled
    """``dst[k] = max(old[k], src[k] + vi)`` in the arrays' own integer type."""
    for k in range(m):
        c = _narrow(src[k] + vi, dst)
        d = old[k]
        dst[k] = c if c > d else d


@njit(cache=True, inline="always")
def _relax_in_place(dst, src, vi, m):  # pragma: no cover - compiled
    """``dst[k] = max(dst[k], src[k] + vi)`` (a separate loop: passing ``dst`` as ``old``
    to :func:`_relax` makes LLVM's overlap check fail and the loop run scalar)."""
    for k in range(m):
        c = _narrow(src[k] + vi, dst)
        d = dst[k]
        dst[k] = c if c > d else d


@njit(cache=True)
def _forward(w, u, v, fits, max_w, max_u, lo_a, lo_b, pu_before, start, every, tables, width, scratch):  # pragma: no cover
    """Items ``start..n-1``; item ``i`` leaves its table in ``tables[i // every + 1]``.

    A table is one flat row-major array, ``width`` cells a row. ``tables[start // every]``
    must hold the table before ``start`` (for ``start == 0`` its row 0 is zeroed here).
    Item ``i`` with ``i % every == 0`` reads ``tables[i // every]`` and writes the next table
    (so the old one stays as a checkpoint); the others update in place. Invariants of a
    table before item ``i``: rows ``lo_b[i-1]..pu_before[i]`` and columns
    ``lo_a[i-1]..max_w`` are exact; rows above ``pu_before[i]`` stand for copies of that
    row and are not kept; everything else is never read again. (Rows are sliced from the
    flat array: slicing a 2-D table row by row measured 20% slower.)
    """
    n = w.shape[0]
    if start == 0:
        _fill_zero(tables[0], width)
    pu = pu_before[start]
    for i in range(start, n):
        t = tables[i // every + 1]
        wi = w[i]
        ui = u[i]
        vi = v[i]
        la = lo_a[i]
        lb = lo_b[i]
        fit = fits[i]
        hi = min(max_u, pu + ui) if fit else pu
        a0 = max(wi, la)
        m = (max_w + 1 - a0 + VEC - 1) // VEC * VEC
        if i % every == 0:
            old = tables[i // every]
            c0 = la // VEC * VEC
            for b in range(lb, hi + 1):
                ob = min(b, pu) * width
                tb = b * width
                if fit and b >= ui:
                    # columns below the item's weight keep their value; a rounded copy may
                    # run past a0, where the update below overwrites it
                    mc = (a0 - c0 + VEC - 1) // VEC * VEC
                    _copy(t[tb + c0: tb + c0 + mc], old[ob + c0: ob + c0 + mc], mc)
                    sb = (b - ui) * width + a0 - wi
                    _relax(t[tb + a0: tb + a0 + m], old[ob + a0: ob + a0 + m], old[sb: sb + m], vi, m)
                else:
                    mc = (max_w + 1 - c0 + VEC - 1) // VEC * VEC
                    _copy(t[tb + c0: tb + c0 + mc], old[ob + c0: ob + c0 + mc], mc)
        elif fit:
            # rows the item reaches for the first time start as copies of the last row
            for b in range(max(pu + 1, lb), hi + 1):
                _copy(t[b * width: (b + 1) * width], t[pu * width: (pu + 1) * width], width)
            for b in range(hi, max(ui, lb) - 1, -1):
                d0 = b * width + a0
                s0 = (b - ui) * width + a0 - wi
                if ui == 0:
                    # the item reads the row it writes: read an unchanged copy
                    _copy(scratch, t[s0: s0 + m], m)
                    _relax_in_place(t[d0: d0 + m], scratch[:m], vi, m)
                else:
                    _relax_in_place(t[d0: d0 + m], t[s0: s0 + m], vi, m)
        pu = hi


@njit(cache=True)
def _value_at(w, u, v, fits, first, last, b, a, table, width, pu):  # pragma: no cover - compiled
    """Best value of items ``first..last-1`` plus the table before ``first``, within ``(b, a)``.

    Enumerates the ``2**(last-first)`` subsets of those items (a block is short).
    """
    k = last - first
    out = -1
    for mask in range(1 << k):
        sw = 0
        su = 0
        sv = 0
        ok = True
        for j in range(k):
            if (mask >> j) & 1:
                ok = ok and fits[first + j]
                sw += w[first + j]
                su += u[first + j]
                sv += v[first + j]
        if ok and sw <= a and su <= b:
            val = sv + table[min(b - su, pu) * width + a - sw]
            if val > out:
                out = val
    return out


@njit(cache=True)
def _backtrack(w, u, v, fits, max_w, max_u, pu_before, every, tables, width, chosen):  # pragma: no cover - compiled
    """Optimal value and the tie-rule subset: item ``i`` is taken iff the best value within
    the current capacity drops without it (rebuilt from the checkpoint of ``i``'s block)."""
    n = w.shape[0]
    value = tables[(n - 1) // every + 1, max_u * width + max_w]
    a = max_w
    b = max_u
    cur = value
    for i in range(n - 1, -1, -1):
        chosen[i] = False
        if not fits[i] or w[i] > a or u[i] > b:
            continue
        s = (i // every) * every
        without = _value_at(w, u, v, fits, s, i, b, a, tables[i // every], width, pu_before[s])
        if cur > without:
            chosen[i] = True
            a -= w[i]
            b -= u[i]
            cur -= v[i]
    return value


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
                    c = _narrow(src[k] + vi, dst)
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


def _value_dtype(bound: int):
    """The narrowest integer type that holds ``bound`` (an upper bound on every table value)."""
    if bound <= np.iinfo(np.int16).max:
        return np.int16
    if bound <= np.iinfo(np.int32).max:
        return np.int32
    return np.int64


def _as_items(w, u, v):
    w = np.ascontiguousarray(w, dtype=np.int64)
    u = np.ascontiguousarray(u, dtype=np.int64)
    v = np.ascontiguousarray(v, dtype=np.int64)
    if not (w.ndim == u.ndim == v.ndim == 1 and len(w) == len(u) == len(v)):
        raise ValueError("w, u and v must be 1-D arrays of equal length")
    return w, u, v


class KnapsackSolver:
    """Reusable exact solver with a workspace and DP-prefix reuse between calls.

    Each :meth:`solve` compares the new items with those of the previous call; if the
    first ``p`` items are identical (and the skipped cells of the old tables are still
    unneeded) the DP restarts from the last checkpoint at or before ``p`` and only the
    items after it are processed. The answer is identical to a fresh solve.

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
        self._prev: tuple | None = None
        self._tables: np.ndarray | None = None
        self._scratch: np.ndarray | None = None
        self._every = CHECKPOINT_EVERY
        #: items processed by the DP in the last call (for benchmarks and tests)
        self.last_items_processed = 0

    def reset(self) -> None:
        """Forget the previous call, so the next one solves from scratch (keeps the workspace)."""
        self._prev = None

    def _workspace(self, n: int, dtype) -> None:
        rows = self.max_u + 1
        width = (self.max_w + 2 * VEC - 1) // VEC * VEC  # rounded loops end below max_w + VEC
        table = rows * width * np.dtype(dtype).itemsize
        every = CHECKPOINT_EVERY
        while ((n - 1) // every + 2) * table > MAX_TABLE_BYTES and every < 16:
            every *= 2
        count = (n - 1) // every + 2
        if count * table > MAX_TABLE_BYTES:
            raise ValueError(
                f"a knapsack over {n} items needs {count * table / 2**20:,.0f} MiB of tables; use fewer items "
                "(a smaller buffer) or a coarser granularity"
            )
        t = self._tables
        if t is None or t.dtype != dtype or t.shape[0] < count or every != self._every:
            # room for a somewhat larger buffer next time, within the byte limit
            spare = max(count, min((2 * n - 1) // every + 2, MAX_TABLE_BYTES // table))
            self._tables = np.zeros((spare, rows * width), dtype=dtype)
            self._scratch = np.zeros(width, dtype=dtype)
            self._every = every
            self._prev = None

    def solve(self, w: np.ndarray, u: np.ndarray, v: np.ndarray, max_w: int | None = None,
              max_u: int | None = None) -> tuple[int, np.ndarray]:
        """Optimal ``(value, chosen_mask)`` for these items (see the module docstring).

        ``max_w`` / ``max_u`` lower the capacities for this call (at most the solver's own).
        """
        w, u, v = _as_items(w, u, v)
        cap_w = self.max_w if max_w is None else int(max_w)
        cap_u = self.max_u if max_u is None else int(max_u)
        if not (0 <= cap_w <= self.max_w and 0 <= cap_u <= self.max_u):
            raise ValueError(f"capacities ({cap_w}, {cap_u}) must lie within the solver's ({self.max_w}, {self.max_u})")
        n = len(w)
        chosen = np.zeros(n, dtype=np.bool_)
        if n == 0:
            return 0, chosen
        fits = np.empty(n, dtype=np.bool_)
        lo_a = np.empty(n, dtype=np.int64)
        lo_b = np.empty(n, dtype=np.int64)
        pu_before = np.empty(n, dtype=np.int64)
        status, tw, tu, bound = _prepare(w, u, v, cap_w, cap_u, fits, lo_a, lo_b, pu_before)
        if status < 0:
            raise ValueError("weights and values must be non-negative")
        limit = self.max_items
        if limit is not None and limit >= max_cardinality(w[fits], u[fits], cap_w, cap_u):
            limit = None
        # everything that fits on its own fits together: take all with positive value;
        # zero-value items never improve strictly, so the tie rule leaves them out
        if limit is None and status == 1:
            chosen = fits & (v > 0)
            self.last_items_processed = 0
            return int(v[chosen].sum()), chosen
        if limit is not None:
            return self._solve_count(w, u, v, limit, cap_w, cap_u)
        self._workspace(n, _value_dtype(bound))
        every = self._every
        start = self._reusable_prefix(w, u, v, lo_a, lo_b, (tw, tu))
        width = self._scratch.shape[0]
        _forward(w, u, v, fits, tw, tu, lo_a, lo_b, pu_before, start, every, self._tables, width, self._scratch)
        value = int(_backtrack(w, u, v, fits, tw, tu, pu_before, every, self._tables, width, chosen))
        self._prev = (w.copy(), u.copy(), v.copy(), lo_a, lo_b, (tw, tu))
        self.last_items_processed = n - start
        return value, chosen

    def _reusable_prefix(self, w, u, v, lo_a, lo_b, caps) -> int:
        """First item to process: a checkpoint index whose tables are still valid, else 0."""
        if self._prev is None:
            return 0
        pw, pu, pv, old_a, old_b, old_caps = self._prev
        if old_caps != caps:
            return 0
        m = min(len(pw), len(w))
        same = (pw[:m] == w[:m]) & (pu[:m] == u[:m]) & (pv[:m] == v[:m])
        p = int(np.argmin(same)) if not same.all() else m
        every = self._every
        start = (min(p, len(w) - 1) // every) * every
        # every checkpoint up to ``start`` is exact on the cells this run reads from it
        # (the old run skipped only cells below its own bounds; lo_* grow with i)
        bad = (old_a[:start] > lo_a[:start]) | (old_b[:start] > lo_b[:start])
        if bad.any():
            start = (int(np.argmax(bad)) // every) * every
        return start

    def _solve_count(self, w, u, v, limit: int, max_w: int, max_u: int) -> tuple[int, np.ndarray]:
        n = len(w)
        cells = (limit + 1) * (max_w + 1) * (max_u + 1)
        if n * cells > MAX_TABLE_BYTES:
            raise ValueError(
                f"a knapsack over {n} items with at most {limit} per pack needs a {n * cells / 2**20:,.0f} MiB "
                "table; use fewer items (a smaller buffer) or drop the item limit"
            )
        fits = (w <= max_w) & (u <= max_u)
        bound = min(int(v[fits].sum()), int(_dantzig(w, v, fits, max_w)), int(_dantzig(u, v, fits, max_u)))
        dtype = _value_dtype(bound)
        best = np.zeros((limit + 1, max_w + 1, max_u + 1), dtype=dtype)
        keep = np.zeros((n, limit + 1, max_w + 1, max_u + 1), dtype=np.bool_)
        _forward_count(w, u, v, max_w, max_u, limit, best, keep)
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
