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
buffer order (oldest first) this means older samples win ties. Encoding a subset as the
integer ``sum(2**i for i in S)``, it is the optimal subset with the smallest integer.

Two methods, one answer
-----------------------
Most buffers are answered by a *bounded sparse search* (:func:`_sparse`, up to 64 items,
by default where the table would have over ``SPARSE_MIN_CELLS`` cells); when it cannot
prove the answer cheaply the dense table below decides. Both return the same value and
subset: the search is exact, not a heuristic.

The search keeps, item by item, the subsets with distinct sums ``(a, b)`` (per sum the best
value, ties to the smaller integer) and drops every subset that provably cannot complete to
a value ``target``:

* prices ``lam``, ``mu`` of a unit of each capacity, near the optimum of the LP relaxation's
  dual (:func:`_multipliers`), make each item's *loss* ``lam w + mu u - v`` small: at the
  Molmo2 settings (value ``tokens + 30 crops``, weight ``ceil(tokens / 32)``) it is the
  rounding of the tokens, 0 to 31;
* any subset ``S`` is worth ``lam max_w + mu max_u`` less its *deficit*: the losses of its
  items plus the priced capacity it leaves unused. A subset ``P`` of the items so far,
  completed by later items ``T``, has a deficit of at least ``loss(P)`` plus the least
  ``loss(T) + lam (max_w - a - w(T))`` over the later subsets that fit the first capacity
  (one dimension, exact: a 1-D dynamic program per item from the last, :func:`_tails`), and
  likewise in the second dimension. ``P`` is dropped when that passes the deficit ``target``
  allows;
* the first ``target`` is the bound before any item; a pass that ends below it proves the
  optimum lower, and the next pass lowers the target (by ``SPARSE_STEP`` or to the bound
  the pass proved, never below a subset it met). The pass that reaches its target keeps
  every subset worth at least that, so its best subset is the optimum and the tie-rule one;
* items are searched by loss, big items first among equals (any order gives the same answer:
  adding the same later items to two subsets keeps their integers' order);
* where the prices are whole numbers (scale 1) the tails are held in 8-bit unsigned cells
  less the least value any can have, with saturating steps (:func:`_tails_sat`): each cell
  is a lower bound on its tail (so pruning stays valid) and exact within a range of about
  255 above the least; a pass whose deficit budget reaches past that range would prune less,
  so the search then starts over with 16-bit tails. Half the memory of 16 bits, which is
  what a solve after another program's large table waits on.

At the Molmo2 settings a solve takes a median of 4 passes and about 300 state visits, and
about 1% of buffers go to the table (a pass over ``SPARSE_STATES`` states, or the search
over ``SPARSE_VISITS`` visits in all): ``make bench BENCH=pack``.

The table
---------
A dense dynamic program over the table ``best[b, a]`` = best value within capacity
``(a, b)`` (rows: the second dimension, contiguous along the first), one item at a time,
in place, and a backtrack from ``(max_w, max_u)``. What makes it fast compared with the
textbook ``(items x tokens x units)`` numpy table (at the Molmo2 settings, 48 items and a
512 x 128 capacity: about 0.06 ms a solve with warm caches, 0.09 ms cold, against 5-7 ms;
``make bench BENCH=pack``):

* values are held in the narrowest integer type that cannot overflow (``int16`` for the
  Molmo2 settings), chosen from an upper bound on any table value (best value per unit
  of weight times capacity, or the fractional (Dantzig) bound when that is not enough);
* the update runs in explicit 32-lane vector steps (a numba intrinsic: load, add,
  compare, select, store in the table's own type; one AVX-512 register of ``int16``).
  Numba computes small-integer sums in 64 bits, so the same loop left to LLVM ran in
  64-bit lanes. Rows carry padding so that whole steps never leave them;
* the compare mask of each step is stored as the item's decision bits (1 bit per cell
  the item touches), so the backtrack reads one bit per item: item ``i`` is taken iff it
  strictly improved the cell of the capacity left. No per-item tables, no checkpoints;
* only cells that can still matter are touched: after item ``i`` the remaining items
  weigh ``R_w(i)`` and ``R_u(i)`` in total, so cells with ``a < max_w - R_w(i)`` or
  ``b < max_u - R_u(i)`` are never read again and are skipped; and in every row but the
  item's top one only the columns the backtrack can reach are updated (:func:`_reach`):
  from the corner, a subset ``S`` of the later items leads to ``(max_w - w(S), max_u -
  u(S))``, so row ``b`` needs the columns between ``max_w`` minus the greatest and minus
  the least weight of a later subset with ``max_u - b`` units (two small one-dimensional
  DPs give both). Every cell a kept cell reads is kept too. At the Molmo2 settings that is
  about 22,000 vector steps a solve, against 38,000 with the ratio cone a reused solver
  keeps (``max_w - a >= r * (max_u - b)``, ``r`` the smallest ``w / u`` of the later items:
  unlike the exact ranges it stays valid while later items change, which prefix reuse
  needs); rows above the units of
  the items so far would be copies of the last reachable row and are only filled when an
  item first reaches them; capacities beyond the total weight are cut off;
* the whole solve is one compiled call with few arguments (the solver's arrays but the
  table live in one workspace), made without numba's dispatcher (:func:`_compiled_entry`):
  with caches cold (as when another solver ran in between), typing the arguments of one
  call costs more than the search, and so does each Python step around it;
* :class:`KnapsackSolver` keeps its workspace between calls, and once a solver is reused
  without :meth:`~KnapsackSolver.reset` it also keeps a copy of the table every
  ``CHECKPOINT_EVERY`` items: a buffer whose first items did not change since the last
  solve restarts from the last valid checkpoint instead of from zero (valid: the old call
  skipped none of the cells the new one needs: bounds and column ranges compared) (the buffer policy
  keeps arrival order, so the oldest items that stayed in the buffer form that prefix;
  packing 8,000 Molmo2-like samples it skips 29% of the item updates at buffer 48 with
  granularity 32, 46% at buffer 64 with granularity 16). A fresh or reset solver writes
  none (they cost time when no call reuses them);
* trivial instances are answered without a table: when all items that fit on their own
  also fit together, every one with a positive value is taken (zero-value items never
  improve strictly, so the tie rule leaves them out, as the table would).

With ``max_items`` the table gains a count axis (``best[c, a, b]``, at most ``c`` items);
the constraint is exact, not a post-hoc top-k. It is skipped when it cannot bind (no
feasible subset has more than ``max_items`` items).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

__all__ = ["solve_knapsack_2d", "KnapsackSolver", "max_cardinality"]

#: Default spacing of the table copies kept for prefix reuse (0 keeps none).
CHECKPOINT_EVERY = 8
#: Refuse workspaces (table, checkpoints, decision bits) larger than this many bytes.
MAX_TABLE_BYTES = 1 << 30


class TableTooLarge(ValueError):
    """A solve whose tables would pass :data:`MAX_TABLE_BYTES` (the capacity, the item count
    or the item limit is too large for one table): ``items`` of the solve, ``nbytes`` its tables."""

    def __init__(self, message: str, items: int, nbytes: int) -> None:
        super().__init__(message)
        self.items, self.nbytes = items, nbytes

    def __reduce__(self):
        return type(self), (str(self), self.items, self.nbytes)

#: Cells per vector step (32 ``int16`` lanes fill an AVX-512 register); rows carry padding
#: so that whole steps never leave them.
VEC = 32
#: The bounded sparse search (:func:`_sparse`): prices are scaled by this before rounding to
#: integers (by less where that lets the tails fit 16-bit cells); each pass that misses lowers its target by at least this much; a pass gives
#: up past this many states in one stage, the search past this many state visits in all
#: (then the table decides); this many bisection steps for the prices.
SPARSE_SCALE = 16
#: Cells per step of the saturating 8-bit tails (64 lanes fill an AVX-512 register).
SAT_VEC = 64
SPARSE_STEP = 4
SPARSE_STATES = 4096
SPARSE_VISITS = 6000
#: By default the search is tried only when the table has more cells than this (a small
#: table is faster: one row of 1,025 cells, 64 items, 8 us against 15 us).
SPARSE_MIN_CELLS = 1 << 14
SPARSE_DUAL_STEPS = 12
#: The search takes items by loss (value short of their priced size) times this, less their
#: priced size: cheap losses first, big items first among equals.
SPARSE_ORDER = 100

# Rows of the integer workspace ``ints`` (a column per item, one more for ``_OFF``, and a
# last column of settings and state; item-major, so that a pass over the items reads one
# contiguous row: with caches cold, 6 cache lines for 48 items instead of 48): whether the
# item fits alone and its bounds (``_prepare``), its table region and bit offset
# (``_forward``), and the previous call's items and bounds (prefix reuse).
_FIT, _LO_A, _LO_B, _PU, _A0, _BLO, _HI, _NCH, _OFF, _PW, _PUN, _PV, _PLA, _PLB = range(14)
_NCOL = 14
# Rows of the last column: settings, the previous call (prefix reuse), the last call, and
# which half of the reach workspace holds the last call's column ranges.
_M_EVERY, _M_WIDTH, _M_PREV_N, _M_TW, _M_TU, _M_CODE, _M_PROCESSED, _M_REACH = range(8)
# ... and the bounded sparse search (:func:`_sparse`): whether to try it, how the last call was
# answered (``_BY_*``), its passes and the states they visited.
_M_SPARSE, _M_METHOD, _M_PASSES, _M_VISITS = range(8, 12)
# ... and the bits of the tails cell the last search used (0: no search).
_M_TAILS = 12
_BY_TRIVIAL, _BY_SPARSE, _BY_TABLE, _BY_COUNT = range(4)
# The solver's integer workspace ``ws`` holds every per-solver array but the table, one region
# after the other (each compiled call then unboxes one array instead of ten: with caches cold,
# each argument costs about half a microsecond). Its first entries: where each region starts
# (the next one's start is its end), then the item capacity, the table rows and the width of
# the search's state lists. Regions: ``ints``, ``span`` (:func:`_reach`), the search's
# ``states`` and ``work``, the prices' scratch (``ratio``, float64, 6 x 64), the column ranges
# (``reach``, int32), the search's tails (int32) and the decision bits (uint32).
_W_INTS, _W_SPAN, _W_STATES, _W_WORK, _W_RATIO, _W_REACH, _W_TAILS, _W_BITS, _W_END = range(9)
_W_CAP, _W_ROWS, _W_NSTATES = range(9, 12)
_W_HEADER = 12
#: Method names by ``_BY_*`` code (:attr:`KnapsackSolver.last_method`).
METHODS = ("trivial", "sparse", "table", "count")
# "No subset": beyond any weight sum a table can have.
_FAR = 1 << 40
# No key / no excess yet (beyond any).
_NONE = 1 << 62
# Results of ``_solve`` below 0; ``_NEED_TABLE - code``: first allocate the table of that type.
_NEGATIVE, _NEED_TABLE = -1, -2
#: Table value types by code (the narrowest whose range holds the value bound).
_DTYPES = (np.int16, np.int32, np.int64)
_INT64 = np.dtype(np.int64)
_BOOL = np.dtype(np.bool_)


def _narrow(x, like):
    """``x`` converted (wrapping) to the element type of array ``like``."""
    return like.dtype.type(x)


@overload(_narrow)
def _narrow_impl(x, like):  # pragma: no cover - compiled
    # numba computes ``int16 + int64`` in int64; converting back to the table's type lets
    # LLVM run the arithmetic in that type (16-bit lanes instead of 64-bit ones)
    t = like.dtype

    def impl(x, like):
        return t(x)

    return impl


def _relax_chunk_py(t, d0, s0, vi):
    """``t[d0:d0+32] = max(t[d0:d0+32], t[s0:s0+32] + vi)``; bit ``k`` of the result: cell
    ``d0 + k`` improved (strictly). Both ranges are read before the write. (Python twin of
    the compiled version, used when numba's JIT is disabled.)"""
    c = t[s0: s0 + VEC].astype(np.int64) + vi
    d = t[d0: d0 + VEC]
    gt = c > d
    t[d0: d0 + VEC] = np.where(gt, c, d).astype(t.dtype)  # padding cells may wrap, as compiled
    return int(np.packbits(gt, bitorder="little").view(np.uint32)[0])


@intrinsic
def _relax_chunk_ir(typingctx, t, d0, s0, vi):
    """Compiled :func:`_relax_chunk_py`: one ``VEC``-lane add, compare, select and store in
    the table's own type; the compare mask is the returned bits (with AVX-512 a single
    compare into a mask register)."""
    if not (isinstance(t, types.Array) and isinstance(t.dtype, types.Integer)):
        return None
    sig = types.uint32(t, d0, s0, vi)

    def codegen(context, builder, signature, args):
        tv, d0v, s0v, viv = args
        arr = context.make_array(signature.args[0])(context, builder, tv)
        elt = context.get_data_type(signature.args[0].dtype)
        vec = ir.VectorType(elt, VEC)
        d0v = context.cast(builder, d0v, signature.args[1], types.intp)
        s0v = context.cast(builder, s0v, signature.args[2], types.intp)
        dp = builder.bitcast(builder.gep(arr.data, [d0v]), vec.as_pointer())
        sp = builder.bitcast(builder.gep(arr.data, [s0v]), vec.as_pointer())
        size = elt.width // 8
        d = builder.load(dp, align=size)
        src = builder.load(sp, align=size)
        x = context.cast(builder, viv, signature.args[3], signature.args[0].dtype)
        one = builder.insert_element(ir.Constant(vec, ir.Undefined), x, ir.Constant(ir.IntType(32), 0))
        splat = builder.shuffle_vector(one, ir.Constant(vec, ir.Undefined),
                                       ir.Constant(ir.VectorType(ir.IntType(32), VEC), [0] * VEC))
        c = builder.add(src, splat)
        gt = builder.icmp_signed(">", c, d)
        builder.store(builder.select(gt, c, d), dp, align=size)
        return builder.bitcast(gt, ir.IntType(32))

    return sig, codegen


_relax_chunk = _relax_chunk_py if numba.config.DISABLE_JIT else _relax_chunk_ir



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
def _prepare(w, u, v, cap_w, cap_u, ints, chosen):  # pragma: no cover - compiled
    """Checks and per-item bounds in one pass; returns ``(status, max_w, max_u, bound)``.

    ``status``: -1 a negative input; 1 when everything that fits alone fits together (then
    ``chosen`` holds the answer and ``max_w`` its value); 0 a table is needed.
    ``max_w``/``max_u`` are the capacities cut to the total weight (capacity beyond it
    adds nothing); per item ``ints[_FIT, i]``: it fits alone;
    ``ints[i, _LO_A/_LO_B]``: the smallest cells still needed after it; ``ints[_PU, i]``:
    the units of the fitting items before it (capped). ``bound`` bounds every table value,
    padding columns included.
    """
    n = w.shape[0]
    sw = 0
    su = 0
    for i in range(n):
        if w[i] < 0 or u[i] < 0 or v[i] < 0:
            return -1, 0, 0, 0
        f = w[i] <= cap_w and u[i] <= cap_u
        ints[_FIT, i] = f
        if f:
            sw += w[i]
            su += u[i]
    if sw <= cap_w and su <= cap_u:
        # zero-value items never improve strictly, so the tie rule leaves them out
        total = 0
        for i in range(n):
            chosen[i] = ints[_FIT, i] != 0 and v[i] > 0
            if chosen[i]:
                total += v[i]
        return 1, total, 0, 0
    max_w = min(cap_w, sw)
    max_u = min(cap_u, su)
    rw = 0
    ru = 0
    for i in range(n - 1, -1, -1):
        ints[_LO_A, i] = max(max_w - rw, 0)
        ints[_LO_B, i] = max(max_u - ru, 0)
        if ints[_FIT, i]:
            rw += w[i]
            ru += u[i]
    # a subset's value is at most (best value per unit of weight) x capacity, in either
    # dimension; the tighter fractional bound is computed only when that is not enough
    pu = 0
    # (the items without weight in a dimension add their values whole, the others at most
    # the best value per unit of it times the capacity: a sum of the two, not the larger)
    zw = 0
    zu = 0
    bw = 0
    bu = 0
    total = 0
    for i in range(n):
        ints[_PU, i] = min(pu, max_u)
        if ints[_FIT, i]:
            pu += u[i]
            total += v[i]
            if w[i] == 0:
                zw += v[i]
            else:
                bw = max(bw, -(-v[i] * (max_w + VEC - 1) // w[i]))
            if u[i] == 0:
                zu += v[i]
            else:
                bu = max(bu, -(-v[i] * max_u // u[i]))
    bound = min(total, zw + bw, zu + bu)
    if bound > 32767:
        fits = ints[_FIT, :n] != 0
        bound = min(bound, _dantzig(w, v, fits, max_w + VEC - 1), _dantzig(u, v, fits, max_u))
    return 0, max_w, max_u, bound


@njit(cache=True)
def _reach(w, u, max_w, max_u, ints, reach, span, exact):  # pragma: no cover - compiled
    """The columns the backtrack can reach, per item and row ``b = max_u - k``: from
    ``reach[i, 0, k]`` to ``reach[i, 1, k]``.

    The backtrack visits, after item ``i``, only cells ``(max_w - w(S), max_u - u(S))`` with
    ``S`` a subset of the later (fitting) items. In row ``b`` (``k = max_u - b`` units) that
    is a column between ``max_w - W_max(k)`` and ``max_w - W_min(k)``, ``W_min`` / ``W_max``
    the least and greatest weight of a later subset of exactly ``k`` units.

    * ``exact``: those bounds, from two one-dimensional DPs over the unit count, item by item
      from the last (in ``span``); a row no such subset has is empty
      (``lo > hi``). About 40% fewer vector steps at the Molmo2 settings than the cone below.
    * otherwise a cone that stays valid while the later items change (prefix reuse compares
      the ranges of two calls, see :func:`_reusable`): ``W_min(k) >= r * k`` with ``r`` the
      smallest ``w / u`` of the later items with units, and no lower bound.

    Both are closed under the DP's reads: a cell in item ``i``'s ranges reads cells in item
    ``i - 1``'s (the same subset plus item ``i``, or the subset alone), so every cell in them
    is exact although the cells outside are never updated. Rows below ``ints[_LO_B, i]`` (no
    later subset has that many units) and the item's top row and those above it (updated
    whole) are not written.
    """
    n = w.shape[0]
    # span[p] / span[2 + p]: least / greatest weight per unit count, p the current pair
    for k in range(max_u + 1):
        span[0, k] = _FAR
        span[1, k] = _FAR
        span[2, k] = -_FAR
        span[3, k] = -_FAR
    span[0, 0] = 0
    span[2, 0] = 0
    p = 0
    top = 0
    rn = 0  # the cone's ratio rn / rd; 0 / 1 (no cut) while no later item has units
    rd = 1
    seen = False
    for i in range(n - 1, -1, -1):
        fit = ints[_FIT, i] != 0
        # the rows the item updates below its top row: k from max_u - hi + 1 on. (Indexing
        # the 2-D arrays, not row views: a view costs two atomic reference counts.)
        k0 = max_u - (min(max_u, ints[_PU, i] + u[i]) if fit else ints[_PU, i]) + 1
        if exact:
            for k in range(k0, top + 1):
                reach[i, 0, k] = min(max(max_w - span[2 + p, k], -1), max_w + 1)
                reach[i, 1, k] = max(max_w - span[p, k], -1)
        elif k0 <= top:
            # max_w - ceil(rn * k / rd), quotient and remainder carried from row to row
            qn = rn // rd
            rr = rn % rd
            q = (rn * k0 + rd - 1) // rd
            r = (rn * k0 + rd - 1) % rd
            for k in range(k0, top + 1):
                reach[i, 0, k] = -1
                reach[i, 1, k] = max(max_w - q, -1)
                q += qn
                r += rr
                if r >= rd:
                    r -= rd
                    q += 1
        if fit:
            wi = w[i]
            ui = u[i]
            new_top = min(max_u, top + ui)
            if exact:
                # into the other pair (no overlap: the loops vectorize); beyond ``new_top``
                # both pairs hold their initial values
                for k in range(min(ui, new_top + 1)):
                    span[1 - p, k] = span[p, k]
                    span[3 - p, k] = span[2 + p, k]
                for k in range(ui, new_top + 1):
                    span[1 - p, k] = min(span[p, k], span[p, k - ui] + wi)
                    span[3 - p, k] = max(span[2 + p, k], span[2 + p, k - ui] + wi)
                p = 1 - p
            elif ui > 0 and (not seen or wi * rd < rn * ui):
                rn = wi
                rd = ui
                seen = True
            top = new_top


@njit(cache=True, inline="always")
def _copy(dst, src, m):  # pragma: no cover - compiled
    # an explicit loop: numba's slice assignment measured several times slower per row
    for k in range(m):
        dst[k] = src[k]


@njit(cache=True, inline="always")
def _item(w, u, v, max_w, max_u, i, pu, off, ints, bits, table, width, reach):  # pragma: no cover - compiled
    """Item ``i`` (see :func:`_forward`); returns the new ``(off, pu)``."""
    wi = w[i]
    ui = u[i]
    vi = v[i]
    lb = ints[_LO_B, i]
    a0 = max(wi, ints[_LO_A, i])
    nch = (max_w + 1 - a0 + VEC - 1) // VEC
    fit = ints[_FIT, i] != 0
    hi = min(max_u, pu + ui) if fit else pu
    blo = max(ui, lb) if fit else hi + 1
    ints[_A0, i] = a0
    ints[_BLO, i] = blo
    ints[_HI, i] = hi
    ints[_NCH, i] = nch
    ints[_OFF, i] = off
    if fit:
        # rows the item reaches for the first time start as copies of the last row
        for b in range(pu + 1, hi + 1):
            _copy(table[b * width: (b + 1) * width], table[pu * width: (pu + 1) * width],
                  width)
        # the top row whole: rows above it stand for copies of it
        d0 = hi * width + a0
        s0 = d0 - ui * width - wi
        for c in range(nch - 1, -1, -1):
            # an unsigned index: no negative-index wraparound check in the loop
            bits[np.uint64(off + c)] = _relax_chunk(table, d0 + c * VEC, s0 + c * VEC, vi)
        # below it only the steps over the columns the backtrack can reach (see _reach), two
        # rows per loop (half the loop exits, which mispredict: the step counts vary by row).
        # Row b goes first at each step: its source may be row b - 1, and a step of row b
        # reads only columns of row b - 1 that row b - 1's later steps have not written
        b = hi - 1
        while b >= blo:
            lo = max(reach[i, 0, max_u - b], a0)
            top = (reach[i, 1, max_u - b] - a0) // VEC
            bottom = (lo - a0) // VEC
            if reach[i, 1, max_u - b] < lo:
                top = -1
                bottom = 0
            top2 = -1
            bottom2 = 0
            if b > blo:
                lo2 = max(reach[i, 0, max_u - b + 1], a0)
                if reach[i, 1, max_u - b + 1] >= lo2:
                    top2 = (reach[i, 1, max_u - b + 1] - a0) // VEC
                    bottom2 = (lo2 - a0) // VEC
            d0 = b * width + a0
            s0 = d0 - ui * width - wi
            row = off + (hi - b) * nch
            if top < bottom:
                for c in range(top2, bottom2 - 1, -1):
                    bits[np.uint64(row + nch + c)] = _relax_chunk(table, d0 - width + c * VEC, s0 - width + c * VEC, vi)
            elif top2 < bottom2:
                for c in range(top, bottom - 1, -1):
                    bits[np.uint64(row + c)] = _relax_chunk(table, d0 + c * VEC, s0 + c * VEC, vi)
            else:
                # steps outside a row's range only touch cells nothing reads
                for c in range(max(top, top2), min(bottom, bottom2) - 1, -1):
                    bits[np.uint64(row + c)] = _relax_chunk(table, d0 + c * VEC, s0 + c * VEC, vi)
                    bits[np.uint64(row + nch + c)] = _relax_chunk(table, d0 - width + c * VEC, s0 - width + c * VEC, vi)
            b -= 2
        off += (hi - blo + 1) * nch
    ints[_OFF, i + 1] = off
    return off, hi


@njit(cache=True)
def _forward(w, u, v, max_w, max_u, start, every, ints, bits, tabs, width, reach):  # pragma: no cover - compiled
    """Items ``start..n-1`` into the table ``tabs[0]`` (flat: cell ``(b, a)`` at
    ``b * width + a``), in place.

    An item updates rows ``ints[_BLO, i]..ints[_HI, i]`` (descending, so each item is used
    at most once) from column ``ints[_A0, i]`` on, in ``ints[_NCH, i]`` steps of ``VEC``
    cells a row (descending too: an item without units reads the row it writes, and a step
    reads its sources before it writes), and stores the steps' improvement bits from
    ``bits[ints[_OFF, i]]`` on. Invariants
    of the table before item ``i``: rows ``lo_b[i-1]..pu_before[i]`` and columns
    ``lo_a[i-1]..max_w`` are exact; rows above ``pu_before[i]`` stand for copies of that
    row and are not kept; everything else is never read again. With ``every > 0`` those
    exact rows are copied to ``tabs[i // every]`` before each item ``i > 0`` with
    ``i % every == 0``, and ``start > 0`` restores that copy.
    """
    n = w.shape[0]
    table = tabs[0]
    pu = ints[_PU, start]
    if start == 0:
        for k in range(width):
            table[k] = 0
        ints[_OFF, 0] = 0
    else:
        r0 = ints[_LO_B, start - 1] * width
        r1 = (pu + 1) * width
        _copy(table[r0: r1], tabs[start // every, r0: r1], r1 - r0)
    off = ints[_OFF, start]
    for i in range(start, n):
        if every > 0 and i > start and i % every == 0:
            r0 = ints[_LO_B, i - 1] * width
            r1 = (pu + 1) * width
            _copy(tabs[i // every, r0: r1], table[r0: r1], r1 - r0)
        off, pu = _item(w, u, v, max_w, max_u, i, pu, off, ints, bits, table, width, reach)


@njit(cache=True)
def _backtrack(w, u, max_w, max_u, ints, bits, chosen):  # pragma: no cover - compiled
    """The tie-rule subset into ``chosen``: from ``(max_w, max_u)`` backwards, item ``i``
    is taken iff it strictly improved the cell of the capacity left (its bit)."""
    a = max_w
    b = max_u
    for i in range(w.shape[0] - 1, -1, -1):
        chosen[i] = False
        if not ints[_FIT, i] or w[i] > a or u[i] > b:
            continue
        # rows above the item's reach hold the same values (and decisions) as its top row
        hi = ints[_HI, i]
        k = a - ints[_A0, i]
        word = bits[ints[_OFF, i] + (hi - min(b, hi)) * ints[_NCH, i] + k // VEC]
        if (word >> (k % VEC)) & 1:
            chosen[i] = True
            a -= w[i]
            b -= u[i]


@njit(cache=True)
def _reusable(w, u, v, max_w, max_u, code, ints, reach, old):  # pragma: no cover - compiled
    """First item to process: the last checkpoint whose prefix of items is unchanged since
    the previous call and whose stored state is exact where this call reads it, else 0."""
    n = w.shape[0]
    m = ints[:, ints.shape[1] - 1]
    every = m[_M_EVERY]
    pn = m[_M_PREV_N]
    if every == 0 or pn <= 0 or m[_M_TW] != max_w or m[_M_TU] != max_u or m[_M_CODE] != code:
        return 0
    p = 0
    while p < min(n, pn) and ints[_PW, p] == w[p] and ints[_PUN, p] == u[p] and ints[_PV, p] == v[p]:
        p += 1
    # checkpoints exist before items every, 2 every, ... below the previous length
    start = (min(p, n - 1, pn - 1) // every) * every
    # the old bits and checkpoints are exact on the cells the old call kept: at or above its
    # bounds, and in each row within its reachable columns
    for i in range(start):
        if ints[_PLA, i] > ints[_LO_A, i] or ints[_PLB, i] > ints[_LO_B, i]:
            return (i // every) * every
        fit = ints[_FIT, i] != 0
        k0 = max_u - (min(max_u, ints[_PU, i] + u[i]) if fit else ints[_PU, i]) + 1
        for k in range(k0, max_u - ints[_LO_B, i] + 1):
            if reach[i, 0, k] <= reach[i, 1, k] and (old[i, 0, k] > reach[i, 0, k] or old[i, 1, k] < reach[i, 1, k]):
                return (i // every) * every
    return start


# ---------------------------------------------------------------------------------------
# The bounded sparse search: most buffers are answered without the table (module docstring).


def _vector_operands(context, builder, signature, args, lanes):
    """For a vector-step intrinsic ``f(h, d0, s0, s1, x)``: the ``lanes``-wide vector type of
    ``h``'s cells, their alignment, the pointer at ``d0`` and the vectors loaded at ``s0`` and
    ``s1``."""
    arr = context.make_array(signature.args[0])(context, builder, args[0])
    elt = context.get_data_type(signature.args[0].dtype)
    vec = ir.VectorType(elt, lanes)
    size = elt.width // 8
    ptrs = []
    for k in (1, 2, 3):
        idx = context.cast(builder, args[k], signature.args[k], types.intp)
        ptrs.append(builder.bitcast(builder.gep(arr.data, [idx]), vec.as_pointer()))
    return vec, size, ptrs[0], builder.load(ptrs[1], align=size), builder.load(ptrs[2], align=size)


def _splat(builder, x, vec):
    """The scalar ``x`` in every lane of a vector of type ``vec``."""
    one = builder.insert_element(ir.Constant(vec, ir.Undefined), x, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, ir.Constant(vec, ir.Undefined),
                                  ir.Constant(ir.VectorType(ir.IntType(32), vec.count), [0] * vec.count))


def _minplus_chunk_py(h, d0, s0, s1, x):
    """``h[d0:d0+32] = min(h[s0:s0+32], h[s1:s1+32] + x)``, both ranges read before the write.
    (Python twin of the compiled version, used when numba's JIT is disabled.)"""
    c = np.minimum(h[s0: s0 + VEC].astype(np.int64), h[s1: s1 + VEC].astype(np.int64) + x)
    h[d0: d0 + VEC] = c.astype(h.dtype)  # padding cells may wrap, as compiled


@intrinsic
def _minplus_chunk_ir(typingctx, h, d0, s0, s1, x):
    """Compiled :func:`_minplus_chunk_py`: one ``VEC``-lane add, compare, select and store in the
    array's own type (LLVM cannot vectorize the same loop itself: source and destination
    are rows of one array, which it must assume overlap)."""
    if not (isinstance(h, types.Array) and isinstance(h.dtype, types.Integer)):
        return None
    sig = types.void(h, d0, s0, s1, x)

    def codegen(context, builder, signature, args):
        vec, size, dst, a, b = _vector_operands(context, builder, signature, args, VEC)
        c = builder.add(b, _splat(builder, context.cast(builder, args[4], signature.args[4], signature.args[0].dtype), vec))
        builder.store(builder.select(builder.icmp_signed("<", c, a), c, a), dst, align=size)
        return context.get_dummy_value()

    return sig, codegen


_minplus_chunk = _minplus_chunk_py if numba.config.DISABLE_JIT else _minplus_chunk_ir


def _minplus_sat_py(h, d0, s0, s1, x):
    """``h[d0:d0+64] = min(h[s0:s0+64], h[s1:s1+64] (+) x)`` over unsigned cells, with ``(+)``
    an addition (or, for ``x < 0``, a subtraction of ``-x``) that saturates at the bounds of
    ``h``'s type; ``|x|`` is cut to the type's largest value first. Both ranges are read
    before the write. (Python twin of the compiled version, used when numba's JIT is
    disabled.)"""
    top = np.iinfo(h.dtype).max
    x = max(min(int(x), top), -top)
    c = np.clip(h[s1: s1 + SAT_VEC].astype(np.int64) + x, 0, top)
    h[d0: d0 + SAT_VEC] = np.minimum(h[s0: s0 + SAT_VEC].astype(np.int64), c).astype(h.dtype)


@intrinsic
def _minplus_sat_ir(typingctx, h, d0, s0, s1, x):
    """Compiled :func:`_minplus_sat_py`: one ``SAT_VEC``-lane saturating add or subtract
    (LLVM's ``uadd.sat`` / ``usub.sat``: one instruction for 8-bit lanes, chosen by the sign
    of ``x``), unsigned compare, select and store."""
    if not (isinstance(h, types.Array) and isinstance(h.dtype, types.Integer)):
        return None
    sig = types.void(h, d0, s0, s1, x)

    def codegen(context, builder, signature, args):
        vec, size, dst, a, b = _vector_operands(context, builder, signature, args, SAT_VEC)
        elt = vec.element
        # |x| cut to the largest cell value, as the cell type
        i64 = ir.IntType(64)
        xv = context.cast(builder, args[4], signature.args[4], types.int64)
        neg = builder.icmp_signed("<", xv, ir.Constant(i64, 0))
        mag = builder.select(neg, builder.neg(xv), xv)
        top = ir.Constant(i64, (1 << elt.width) - 1)
        mag = builder.trunc(builder.select(builder.icmp_unsigned(">", mag, top), top, mag), elt)
        splat = _splat(builder, mag, vec)
        fnty = ir.FunctionType(vec, [vec, vec])
        add = builder.call(cgutils.get_or_insert_function(builder.module, fnty, f"llvm.uadd.sat.v{SAT_VEC}i{elt.width}"),
                           [b, splat])
        sub = builder.call(cgutils.get_or_insert_function(builder.module, fnty, f"llvm.usub.sat.v{SAT_VEC}i{elt.width}"),
                           [b, splat])
        c = builder.select(neg, sub, add)
        builder.store(builder.select(builder.icmp_unsigned("<", c, a), c, a), dst, align=size)
        return context.get_dummy_value()

    return sig, codegen


_minplus_sat = _minplus_sat_py if numba.config.DISABLE_JIT else _minplus_sat_ir


@njit(cache=True)
def _lambda_step(cw, cu, cv, r, order, k, cap, mu):  # pragma: no cover - compiled
    """For values ``v - mu * u``: the fractional knapsack over the first capacity ``cap``, as
    ``(lambda, units, value)``: its critical value per unit of weight (the LP dual of that
    capacity), the units of its fractional solution (``max_u`` minus them is the slope of the
    dual in ``mu``) and ``sum(max(0, v - mu u - lambda w))``, over the ``k`` candidates
    ``cw[:k], cu[:k], cv[:k]`` (all with ``w > 0``; contiguous copies, so the loops over them
    vectorize). ``order`` holds the candidates by value per weight, best first, from the last
    call: an insertion sort brings it up to date (successive calls move ``mu`` a little, so it
    is nearly sorted already)."""
    for j in range(k):
        r[j] = (cv[j] - mu * cu[j]) / cw[j]
    for j in range(1, k):
        p = order[j]
        x = r[p]
        h = j
        while h > 0 and r[order[h - 1]] < x:
            order[h] = order[h - 1]
            h -= 1
        order[h] = p
    acc = 0.0
    units = 0.0
    lam = 0.0
    for j in range(k):
        i = order[j]
        if r[i] <= 0:
            break
        if acc + cw[i] > cap:
            lam = r[i]
            units += cu[i] * (cap - acc) / cw[i]
            break
        acc += cw[i]
        units += cu[i]
    excess = 0.0
    for j in range(k):
        excess += max(r[j] - lam, 0.0) * cw[j]
    return lam, units, excess


@njit(cache=True)
def _dual_at(fl, order, k, kz, max_w, max_u, mu):  # pragma: no cover - compiled
    """The LP dual minimized over ``lambda`` at this ``mu``: ``(value, slope in mu, lambda)``
    (the candidates as :func:`_multipliers` laid them out in ``fl``)."""
    lam, units, excess = _lambda_step(fl[0], fl[1], fl[2], fl[3], order, k, max_w, mu)
    for j in range(kz):  # weightless items: in whenever their value is left positive
        if fl[5, j] > mu * fl[4, j]:
            units += fl[4, j]
            excess += fl[5, j] - mu * fl[4, j]
    return lam * max_w + mu * max_u + excess, max_u - units, lam


@njit(cache=True)
def _multipliers(w, u, v, max_w, max_u, ints, fl, order):  # pragma: no cover - compiled
    """Prices ``(lambda, mu)`` of a unit of each capacity at (or near) the optimum of the LP
    dual ``D(lambda, mu) = lambda max_w + mu max_u + sum(max(0, v - lambda w - mu u))``. For
    each ``mu`` the best ``lambda`` is the fractional knapsack's; ``g(mu) = min D`` is convex
    and piecewise linear in ``mu``, so cutting planes find its minimum in a few steps: the
    tangents at the two ends of the bracket meet at the next point tried, and where the
    function comes within one unit of that lower model the point is (near) optimal. Any prices give valid bounds;
    close ones prune far more (at the Molmo2 settings a ``mu`` off by 0.5 visits three
    times the states). ``fl`` (float64, 6 rows of 64) and ``order`` (64) are scratch."""
    n = w.shape[0]
    # mu is at most the price of a unit alone (lambda = 0): the larger lambda, the less of
    # each value is left to price the units with
    k = 0
    for i in range(n):
        if ints[_FIT, i] and v[i] > 0 and u[i] > 0:
            fl[0, k] = u[i]
            fl[1, k] = 0.0
            fl[2, k] = v[i]
            order[k] = k
            k += 1
    hi, _, _ = _lambda_step(fl[0], fl[1], fl[2], fl[3], order, k, max_u, 0.0)
    k = 0
    kz = 0
    for i in range(n):
        if ints[_FIT, i] and v[i] > 0:
            if w[i] > 0:
                fl[0, k] = w[i]
                fl[1, k] = u[i]
                fl[2, k] = v[i]
                order[k] = k
                k += 1
            else:
                fl[4, kz] = u[i]
                fl[5, kz] = v[i]
                kz += 1
    lo = 0.0
    g_lo, s_lo, lam_lo = _dual_at(fl, order, k, kz, max_w, max_u, lo)
    if s_lo >= 0:
        return lam_lo, 0.0
    g_hi, s_hi, lam_hi = _dual_at(fl, order, k, kz, max_w, max_u, hi)
    best_g, best_lam, best_mu = g_lo, lam_lo, lo
    if g_hi < best_g:
        best_g, best_lam, best_mu = g_hi, lam_hi, hi
    for _ in range(SPARSE_DUAL_STEPS):
        if s_hi <= s_lo or hi - lo <= 1e-9 * (1.0 + hi):
            break
        mu = (g_hi - g_lo + s_lo * lo - s_hi * hi) / (s_lo - s_hi)
        if not lo < mu < hi:
            break
        model = g_lo + s_lo * (mu - lo)
        g, slope, lam = _dual_at(fl, order, k, kz, max_w, max_u, mu)
        if g < best_g:
            best_g, best_lam, best_mu = g, lam, mu
        if g <= model + 1.0:
            # the model's minimum is a lower bound on the function's: within one unit of
            # value (values are integers) of it, more steps would barely prune more
            break
        if slope < 0:
            lo, g_lo, s_lo = mu, g, slope
        else:
            hi, g_hi, s_hi = mu, g, slope
    return best_lam, best_mu


@njit(cache=True)
def _tails(x, loss, n, price, cap, h, base, stride):  # pragma: no cover - compiled
    """``h[base + r * stride + c]``: the least ``loss(T) + price * (c - x(T))`` over subsets
    ``T`` of the items ``r..n-1`` with ``x(T) <= c``, for ``r = n`` (no items: ``price * c``)
    down to 0, one vector step per 32 cells."""
    c1 = cap + 1
    top = base + n * stride
    for c in range(stride):  # the padding only ever feeds padding: any value that fits
        h[top + c] = price * min(c, cap)
    for r in range(n - 1, -1, -1):
        dst = base + r * stride
        src = dst + stride
        xr = min(x[r], c1)
        for c in range(0, xr, VEC):  # copies (whole steps may overrun: the min steps follow)
            _minplus_chunk(h, dst + c, src + c, src + c, 0)
        for c in range(xr, c1, VEC):
            _minplus_chunk(h, dst + c, src + c, src + c - xr, loss[r])


@njit(cache=True)
def _tails_sat(x, loss, n, price, cap, h, base, stride, off):  # pragma: no cover - compiled
    """:func:`_tails` in unsigned cells (``h``: 8 bits) whose range need not hold every value:
    each cell holds its value less ``off``, and the steps saturate at the range's ends. With
    ``off = low``, the sum of the negative losses (at least -255), no value is below the range
    and each cell holds at most the true value (a lower bound, which is all the search needs:
    one too low only keeps a subset longer) and at least the smaller of the true value and
    ``2 low + 255`` less ``off`` (exact up to there: a sum that saturated at the top, then
    fell by the negative losses, ends at least that high). ``SAT_VEC`` cells a step."""
    c1 = cap + 1
    top = base + n * stride
    hmax = (1 << (8 * h.itemsize)) - 1
    for c in range(stride):
        h[top + c] = min(price * min(c, cap) - off, hmax)
    for r in range(n - 1, -1, -1):
        dst = base + r * stride
        src = dst + stride
        xr = min(x[r], c1)
        for c in range(0, xr, SAT_VEC):
            _minplus_sat(h, dst + c, src + c, src + c, 0)
        for c in range(xr, c1, SAT_VEC):
            _minplus_sat(h, dst + c, src + c, src + c - xr, loss[r])


@njit(cache=True)
def _sparse_pass(w, u, v, item, n, max_w, max_u, lam, mu, scale, h, hoff, sw, su, states, target, out):  # pragma: no cover - compiled
    """One search for the best subsets worth at least ``target``; returns ``(best, mask)``
    of the surviving subsets (``best < 0``: none survived) or ``(-2, 0)`` when a stage holds
    more than ``SPARSE_STATES`` states. ``out``: the best value of any subset met (a lower
    bound on the optimum), an upper bound on the optimum (the best bound a pruned subset had),
    and the states visited.

    The items ``w[:n], u[:n], v[:n]`` are the fitting ones in the order searched; ``item``
    their positions in the buffer (the bits of the masks). States are subsets of the items
    so far with distinct sums ``(a, b)``, sorted by the key
    ``b << shift | a``; item ``i`` merges the list with itself shifted by ``(w[i], u[i])`` (an
    order-preserving shift of the keys), keeping per cell the larger value and, on a tie, the
    smaller mask (the tie rule: later items' bits are the same on both sides). A state is
    dropped when ``lam * a + mu * b - SCALE * value`` plus the larger of the two tails of the
    later items (:func:`_tails`, rows ``i + 1``) exceeds ``lam * max_w + mu * max_u - SCALE *
    target``: then no completion reaches ``target``.
    """
    cap = states.shape[1] // 2
    shift = 1
    while (1 << shift) <= max_w:
        shift += 1
    low = (1 << shift) - 1
    g = lam * max_w + mu * max_u - scale * target - hoff  # the tails hold their values less hoff
    sk = states[0]
    sv = states[1]
    sm = states[2].view(np.uint64)
    cur = 0
    nxt = cap
    m = 1
    sk[0] = 0
    sv[0] = 0
    sm[0] = 0
    seen = 0
    least_excess = _NONE
    visits = 0
    hu = (n + 1) * sw
    for i in range(n):
        wi = w[i]
        ui = u[i]
        vi = v[i]
        delta = (ui << shift) + wi
        bit = np.uint64(1) << np.uint64(item[i])
        rw = (i + 1) * sw + max_w
        ru = hu + (i + 1) * su + max_u
        p = 0
        q = 0
        k = 0
        visits += m
        while True:
            # the next candidate (state q plus the item) within the capacities
            ckey = _NONE
            while q < m:
                key = sk[cur + q]
                if (key >> shift) + ui > max_u:  # so are all later ones (sorted by b first)
                    q = m
                elif (key & low) + wi <= max_w:
                    ckey = key + delta
                    break
                else:
                    q += 1
            okey = sk[cur + p] if p < m else _NONE
            if okey == ckey:  # both _NONE, or the same cell
                if p >= m:
                    break
                val = sv[cur + q] + vi
                seen = max(seen, val)
                mask = sm[cur + q] | bit
                # on a tie the smaller mask (items are not searched in buffer order)
                if val < sv[cur + p] or (val == sv[cur + p] and sm[cur + p] < mask):
                    val = sv[cur + p]
                    mask = sm[cur + p]
                key = okey
                p += 1
                q += 1
            elif okey < ckey:
                key = okey
                val = sv[cur + p]
                mask = sm[cur + p]
                p += 1
            else:
                key = ckey
                val = sv[cur + q] + vi
                seen = max(seen, val)
                mask = sm[cur + q] | bit
                q += 1
            a = key & low
            b = key >> shift
            excess = lam * a + mu * b - scale * val + max(h[rw - a], h[ru - b]) - g
            # written either way, kept only if within the bound (no branch to mispredict)
            keep = excess <= 0
            least_excess = min(least_excess, excess if not keep else _NONE)
            sk[nxt + k] = key
            sv[nxt + k] = val
            sm[nxt + k] = mask
            k += keep
            if k >= cap:
                return -2, np.uint64(0)
        cur, nxt = nxt, cur
        m = k
        if m == 0:
            break
    best = -1
    best_mask = np.uint64(0)
    for j in range(m):
        if sv[cur + j] > best or (sv[cur + j] == best and sm[cur + j] < best_mask):
            best = sv[cur + j]
            best_mask = sm[cur + j]
    out[0] = max(seen, best)
    # every subset either survived or was dropped with a bound at most target - excess / SCALE
    out[1] = max(best, target - 1 - (least_excess - 1) // scale)
    out[2] = visits
    return best, best_mask


@njit(cache=True)
def _sparse(w, u, v, max_w, max_u, ints, tails, states, ratio, work, chosen):  # pragma: no cover - compiled
    """The exact optimum and tie-rule subset by bounded search, or -1 when it gives up (too
    many states; the table decides then). See the module docstring."""
    n = w.shape[0]
    lam_f, mu_f = _multipliers(w, u, v, max_w, max_u, ints, ratio, work[0])
    if max(lam_f, mu_f) * SPARSE_SCALE >= 1 << 40:  # prices beyond integers the tails can hold
        return -1
    # prices in integers: scaled by SPARSE_SCALE, or by less where that lets every value of
    # the tails fit 16 bits (half the memory to write and read back)
    scale = SPARSE_SCALE
    while scale >= 1:
        lam = np.int64(lam_f * scale + 0.5)
        mu = np.int64(mu_f * scale + 0.5)
        high = max(lam * max_w, mu * max_u)
        low = 0
        for i in range(n):
            if ints[_FIT, i]:
                loss = lam * w[i] + mu * u[i] - scale * v[i]
                high += max(loss, 0)
                low += min(loss, 0)
        if scale == 1 and low >= -(1 << 7):
            # 8-bit tails, saturating (half the memory of 16 bits): exact up to 255 above the
            # least value (less its distance from 0), enough for the deficits most passes allow
            # at these prices (the LP bound's gap); a pass that would allow more goes to 16 bits
            value = _sparse_search(w, u, v, max_w, max_u, lam, mu, scale, ints, tails.view(np.uint8), states, work,
                                   chosen)
            if value != -3:
                return value
        if high < 1 << 15 and low > -(1 << 15):
            return _sparse_search(w, u, v, max_w, max_u, lam, mu, scale, ints, tails.view(np.int16), states, work,
                                  chosen)
        scale //= 2
    lam = np.int64(lam_f * SPARSE_SCALE + 0.5)
    mu = np.int64(mu_f * SPARSE_SCALE + 0.5)
    return _sparse_search(w, u, v, max_w, max_u, lam, mu, SPARSE_SCALE, ints, tails, states, work, chosen)


@njit(cache=True)
def _sparse_search(w, u, v, max_w, max_u, lam, mu, scale, ints, h, states, work, chosen):  # pragma: no cover - compiled
    """:func:`_sparse` at these integer prices (``scale`` times the real ones), the tails in
    ``h`` (16 or 32 bits). ``work``: the fitting items in the order searched (weights, units,
    values, losses, buffer positions, sort keys) and the passes' outputs."""
    n = w.shape[0]
    m = ints[:, ints.shape[1] - 1]
    m[_M_TAILS] = 8 * h.itemsize
    ow, ou, ov, ol, item, key, out = work[0], work[1], work[2], work[3], work[4], work[5], work[6]
    # the search order: least loss first, less a hundredth of the priced size (big items
    # early). Any order gives the same answer (a mask's order is its items' positions);
    # this one visits about a third of the states buffer order does at the Molmo2 settings
    k = 0
    for i in range(n):
        if not ints[_FIT, i]:
            continue
        priced = lam * w[i] + mu * u[i]
        x = (priced - scale * v[i]) * SPARSE_ORDER - priced
        j = k
        while j > 0 and key[j - 1] > x:
            key[j] = key[j - 1]
            item[j] = item[j - 1]
            j -= 1
        key[j] = x
        item[j] = i
        k += 1
    high = max(lam * max_w, mu * max_u)
    low = 0
    for j in range(k):
        i = item[j]
        ow[j] = w[i]
        ou[j] = u[i]
        ov[j] = v[i]
        ol[j] = lam * w[i] + mu * u[i] - scale * v[i]
        high += max(ol[j], 0)
        low += min(ol[j], 0)
    # every value the tails compute is a subset's: within [low, high], which must fit
    if h.itemsize == 4 and (high >= 1 << 30 or low <= -(1 << 30)):
        return -1
    # 8-bit tails hold each value less hoff = low (the least any can be); exact up to 2 low + 255
    hoff = low if h.itemsize == 1 else 0
    if h.itemsize == 1:
        # rows just long enough for the last step's overrun (cells up to cap + SAT_VEC - 1)
        sw = (max_w + 2 * SAT_VEC - 1) // SAT_VEC * SAT_VEC
        su = (max_u + 2 * SAT_VEC - 1) // SAT_VEC * SAT_VEC
        _tails_sat(ow, ol, k, lam, max_w, h, 0, sw, hoff)
        _tails_sat(ou, ol, k, mu, max_u, h, (k + 1) * sw, su, hoff)
    else:
        sw = (max_w + 2 * VEC) // VEC * VEC
        su = (max_u + 2 * VEC) // VEC * VEC
        _tails(ow, ol, k, lam, max_w, h, 0, sw)
        _tails(ou, ol, k, mu, max_u, h, (k + 1) * sw, su)
    # the optimum is at most the better of the two bounds before any item
    target = (lam * max_w + mu * max_u - hoff - max(h[max_w], h[(k + 1) * sw + max_u])) // scale
    lower = 0
    passes = 0
    visits = 0
    while True:
        passes += 1
        if h.itemsize == 1 and lam * max_w + mu * max_u - scale * target >= 3 * low + 255:
            return -3  # the pass would prune on tails beyond their exact range: 16 bits decide
        best, mask = _sparse_pass(ow, ou, ov, item, k, max_w, max_u, lam, mu, scale, h, hoff, sw, su, states, target,
                                  out)
        visits += out[2]
        m[_M_PASSES] = passes
        m[_M_VISITS] = visits
        if best == -2 or visits > SPARSE_VISITS:
            return -1
        if best >= target:
            for i in range(n):
                chosen[i] = (mask >> np.uint64(i)) & np.uint64(1)
            return best
        # the optimum is below target: search again lower, never below a subset met
        lower = max(lower, out[0])
        target = max(lower, min(out[1], target - SPARSE_STEP))


@njit(cache=True)
def _solve(w, u, v, cap_w, cap_u, ws, tabs, chosen):  # pragma: no cover - compiled
    """:func:`_solve_parts` on the regions of the workspace ``ws`` (the ``_W_*`` entries)."""
    cap = ws[_W_CAP]
    rows = ws[_W_ROWS]
    ints = ws[ws[_W_INTS]: ws[_W_SPAN]].reshape((_NCOL, cap + 2))
    span = ws[ws[_W_SPAN]: ws[_W_STATES]].reshape((4, rows))
    states = ws[ws[_W_STATES]: ws[_W_WORK]].reshape((3, ws[_W_NSTATES]))
    work = ws[ws[_W_WORK]: ws[_W_RATIO]].reshape((7, 64))
    ratio = ws[ws[_W_RATIO]: ws[_W_REACH]].view(np.float64).reshape((6, 64))
    reach = ws[ws[_W_REACH]: ws[_W_TAILS]].view(np.int32).reshape((2, cap, 2, rows))
    tails = ws[ws[_W_TAILS]: ws[_W_BITS]].view(np.int32)
    bits = ws[ws[_W_BITS]: ws[_W_END]].view(np.uint32)
    return _solve_parts(w, u, v, cap_w, cap_u, ints, bits, tabs, reach, span, tails, states, ratio, work, chosen)


@njit(cache=True)
def _solve_parts(w, u, v, cap_w, cap_u, ints, bits, tabs, reach, span, tails, states, ratio, work, chosen):  # pragma: no cover - compiled
    """The whole exact solve in one call (each Python round trip costs more than a DP item
    when caches are cold): the optimal value, or ``_NEGATIVE``, or ``_NEED_TABLE - code``
    when ``tabs`` is not of the value type needed (``_DTYPES[code]``). The chosen items go
    to ``chosen``; ``tabs`` holds the table and the checkpoints, ``reach`` this call's and
    the last call's column ranges (:func:`_reach`), settings and state live in the last row
    of ``ints``."""
    status, max_w, max_u, bound = _prepare(w, u, v, cap_w, cap_u, ints, chosen)
    m = ints[:, ints.shape[1] - 1]
    m[_M_PASSES] = 0
    m[_M_VISITS] = 0
    m[_M_TAILS] = 0
    if status < 0:
        return _NEGATIVE
    m[_M_PROCESSED] = 0
    if status == 1:
        m[_M_METHOD] = _BY_TRIVIAL
        return max_w
    code = 0 if bound <= 32767 else (1 if bound <= 2147483647 else 2)
    if tabs.shape[0] == 0 or tabs.itemsize != 2 << code:
        return _NEED_TABLE - code
    if m[_M_SPARSE] and w.shape[0] <= 64:
        # the table's state (its checkpoints and the last call it describes) stays as it was
        value = _sparse(w, u, v, max_w, max_u, ints, tails, states, ratio, work, chosen)
        if value >= 0:
            m[_M_METHOD] = _BY_SPARSE
            return value
    m[_M_METHOD] = _BY_TABLE
    n = w.shape[0]
    # checkpoints only pay when the next call reuses them: a fresh or reset solver (the
    # caller solves independent buffers) writes none; from its second call on it does
    every = m[_M_EVERY] if m[_M_PREV_N] >= 0 else 0
    width = m[_M_WIDTH]
    cur = 1 - m[_M_REACH]
    # a solver that may be reused keeps the cone (the exact ranges change with the later
    # items, so a next call could rarely reuse them); a fresh or reset one the exact ranges
    _reach(w, u, max_w, max_u, ints, reach[cur], span, m[_M_PREV_N] < 0)
    start = _reusable(w, u, v, max_w, max_u, code, ints, reach[cur], reach[1 - cur])
    _forward(w, u, v, max_w, max_u, start, every, ints, bits, tabs, width, reach[cur])
    _backtrack(w, u, max_w, max_u, ints, bits, chosen)
    m[_M_PROCESSED] = n - start
    m[_M_PREV_N] = 0  # a call happened, with nothing to reuse unless set below
    if every > 0:
        for i in range(n):
            ints[_PW, i] = w[i]
            ints[_PUN, i] = u[i]
            ints[_PV, i] = v[i]
            ints[_PLA, i] = ints[_LO_A, i]
            ints[_PLB, i] = ints[_LO_B, i]
        m[_M_PREV_N] = n
        m[_M_REACH] = cur
        m[_M_TW] = max_w
        m[_M_TU] = max_u
        m[_M_CODE] = code
    return tabs[0, max_u * width + max_w]


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


_ENTRIES: dict = {}


def _compiled_entry(table_dtype: np.dtype):
    """The compiled :func:`_solve` for a table of this type, called without numba's dispatcher
    (which types every argument on every call: with caches cold, as after another program's
    large table, that costs more than the search). Compiled (or loaded from numba's cache) for
    item arrays of any layout, so the caller checks only their type and rank: the entry itself
    checks no more than array item sizes. Without the JIT, the plain function."""
    if numba.config.DISABLE_JIT:
        return _solve
    entry = _ENTRIES.get(table_dtype)
    if entry is None:
        items = types.Array(types.int64, 1, "A")
        sig = (items, items, items, types.int64, types.int64, types.Array(types.int64, 1, "C"),
               types.Array(numba.from_dtype(table_dtype), 2, "C"), types.Array(types.boolean, 1, "C"))
        entry = _ENTRIES[table_dtype] = _solve.compile(sig)
    return entry


class KnapsackSolver:
    """Reusable exact solver with a workspace and DP-prefix reuse between calls.

    ``sparse``: try the bounded sparse search before the table (module docstring); ``None``
    (the default) where the table would have over ``SPARSE_MIN_CELLS`` cells. The answer is
    the same either way; :attr:`last_method` tells which method gave it.

    When the table decides, each :meth:`solve` compares the new items with those of the
    last call the table answered; if the first ``p`` items are identical (and the skipped
    cells of the old table are still unneeded) the DP restarts from the last checkpoint at
    or before ``p`` and only the items after it are processed. The answer is identical to a
    fresh solve. Checkpoints (a copy of the table every ``checkpoint_every`` items) cost time
    when every call starts afresh; ``checkpoint_every=0`` keeps none.

    Example:
        >>> s = KnapsackSolver(8, 3)
        >>> s.solve(np.array([3, 4, 5]), np.array([1, 1, 2]), np.array([3, 4, 5]))
        (8, array([ True, False,  True]))
    """

    def __init__(self, max_w: int, max_u: int, max_items: int | None = None,
                 checkpoint_every: int = CHECKPOINT_EVERY, sparse: bool | None = None) -> None:
        if int(max_w) < 0 or int(max_u) < 0:
            raise ValueError("capacities must be non-negative")
        if max_items is not None and int(max_items) < 0:
            raise ValueError("max_items must be non-negative")
        if int(checkpoint_every) < 0:
            raise ValueError("checkpoint_every must be non-negative (0: no prefix reuse)")
        self.max_w = int(max_w)
        self.max_u = int(max_u)
        self.max_items = None if max_items is None else int(max_items)
        self.checkpoint_every = int(checkpoint_every)
        self._rows = self.max_u + 1
        self._width = (self.max_w + 2 * VEC - 1) // VEC * VEC  # steps end below max_w + VEC
        # the sparse search's workspace: the tails of up to 64 items over both capacities
        # (int32 rows padded for whole vector steps), two stages of states, the prices' sort keys
        stride = (self.max_w + 2 * VEC) // VEC * VEC + (self.max_u + 2 * VEC) // VEC * VEC
        auto = (self.max_u + 1) * (self.max_w + 1) > SPARSE_MIN_CELLS
        self.sparse = bool(auto if sparse is None else sparse) and 65 * stride * 4 <= MAX_TABLE_BYTES // 16
        self._n_tails = 65 * stride if self.sparse else 0
        self._n_states = 2 * SPARSE_STATES if self.sparse else 0
        self._cap = 0
        self._tables: dict = {}
        self._table = np.zeros((0, 0), dtype=np.int16)
        self._entry = _compiled_entry(self._table.dtype)
        self._count = self.max_items is not None  # the item-count limit: decided per call
        self._allocate(16)

    @property
    def last_items_processed(self) -> int:
        """Items the table processed in the last call (for benchmarks and tests): 0 when the
        call needed no table."""
        return int(self._ints[_M_PROCESSED, -1])

    @property
    def last_method(self) -> str:
        """How the last call was answered: ``"trivial"`` (everything that fits alone fits
        together), ``"sparse"`` (the bounded search), ``"table"`` or ``"count"`` (the table
        with an item-count axis)."""
        return METHODS[int(self._ints[_M_METHOD, -1])]

    @property
    def last_sparse_work(self) -> tuple[int, int]:
        """``(passes, states visited)`` of the bounded search in the last call (also when it
        gave up and the table decided)."""
        return int(self._ints[_M_PASSES, -1]), int(self._ints[_M_VISITS, -1])

    @property
    def last_tail_bits(self) -> int:
        """Bits per cell of the tails the last bounded search pruned by (8, 16 or 32; 0 when
        no search ran): 8-bit tails where the prices are whole numbers and the deficits small."""
        return int(self._ints[_M_TAILS, -1])

    def workspace(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The compiled solve's workspace and table (``_solve``'s ``ws`` and ``tabs``), with room
        for ``n`` items, for a compiled caller that solves in place (``packer._stream_packs``):
        what that solve cannot answer (a first call, a table of another type) it hands back to
        :meth:`solve`, which allocates what is needed."""
        if n > self._cap:
            self._allocate(n)
        return self._ws, self._table

    def reset(self) -> None:
        """Forget the previous call, so the next one solves from scratch (keeps the workspace)."""
        self._ints[_M_PREV_N, -1] = -1

    def _allocate(self, n: int, dtype=None) -> None:
        """Per-item workspaces for at least ``n`` items; with ``dtype``, that type's tables."""
        every = self.checkpoint_every
        cap = max(n, self._cap)
        cells = self._rows * self._width
        n_tabs = 1 + ((cap - 1) // every if every else 0)
        types_ = {np.dtype(t) for t in self._tables} | ({np.dtype(dtype)} if dtype is not None else set())
        size = cap * cells // 8 + 16 * cap * self._rows + sum(n_tabs * cells * t.itemsize for t in types_)
        if size > MAX_TABLE_BYTES:
            raise TableTooLarge(
                f"a knapsack over {n} items needs {size / 2**20:,.0f} MiB of tables; use fewer items "
                "(a smaller buffer) or a coarser granularity", n, size
            )
        if cap > self._cap:
            self._cap = cap
            rows = self._rows
            # region sizes in int64 entries (the int32 and uint32 ones rounded up)
            sizes = (((cap + 2) * _NCOL), 4 * rows, 3 * self._n_states, 7 * 64, 6 * 64, cap * 2 * rows,
                     (self._n_tails + 1) // 2, (cap * rows * (self._width // VEC) + 1) // 2)
            starts = np.cumsum((_W_HEADER,) + sizes)
            self._ws = ws = np.zeros(int(starts[-1]), dtype=np.int64)
            ws[_W_INTS: _W_END + 1] = starts
            ws[_W_CAP] = cap
            ws[_W_ROWS] = rows
            ws[_W_NSTATES] = self._n_states
            self._ints = ws[starts[_W_INTS]: starts[_W_SPAN]].reshape(_NCOL, cap + 2)
            self._ints[_M_EVERY, -1] = every
            self._ints[_M_WIDTH, -1] = self._width
            self._ints[_M_PREV_N, -1] = -1
            self._ints[_M_SPARSE, -1] = self.sparse
        for t in types_:
            if t not in self._tables or self._tables[t].shape[0] != n_tabs:
                self._tables[t] = np.zeros((n_tabs, cells), dtype=t)
                self._ints[_M_PREV_N, -1] = -1
        current = np.dtype(dtype) if dtype is not None else self._table.dtype
        self._table = self._tables.get(current, self._table)

    def solve(self, w: np.ndarray, u: np.ndarray, v: np.ndarray, max_w: int | None = None,
              max_u: int | None = None) -> tuple[int, np.ndarray]:
        """Optimal ``(value, chosen_mask)`` for these items (see the module docstring).

        ``max_w`` / ``max_u`` lower the capacities for this call (at most the solver's own).
        """
        # As few Python steps as possible: with caches cold each costs tens of nanoseconds, and
        # a search after another program's large table takes about 30 us. Any int64 array of
        # rank 1 goes in as it is (the compiled entry takes any layout; it checks only ranks
        # and item sizes, hence the checks here)
        try:
            ok = w.dtype is _INT64 and u.dtype is _INT64 and v.dtype is _INT64 and w.ndim == u.ndim == v.ndim == 1
        except AttributeError:  # not arrays
            ok = False
        if not ok:
            w, u, v = (np.asarray(x, dtype=np.int64) for x in (w, u, v))
            if not w.ndim == u.ndim == v.ndim == 1:
                raise ValueError("w, u and v must be 1-D arrays of equal length")
        n = len(w)
        if len(u) != n or len(v) != n:
            raise ValueError("w, u and v must be 1-D arrays of equal length")
        if max_w is None and max_u is None:
            cap_w = self.max_w
            cap_u = self.max_u
        else:
            cap_w = self.max_w if max_w is None else int(max_w)
            cap_u = self.max_u if max_u is None else int(max_u)
            if not (0 <= cap_w <= self.max_w and 0 <= cap_u <= self.max_u):
                raise ValueError(f"capacities ({cap_w}, {cap_u}) must lie within the solver's ({self.max_w}, "
                                 f"{self.max_u})")
        chosen = np.empty(n, _BOOL)  # every entry is written
        if n > self._cap or self._count or n == 0:
            return self._solve_other(w, u, v, cap_w, cap_u, chosen)
        value = self._entry(w, u, v, cap_w, cap_u, self._ws, self._table, chosen)
        if value < 0:
            return self._solve_other(w, u, v, cap_w, cap_u, chosen)
        return value, chosen

    def _solve_other(self, w, u, v, cap_w: int, cap_u: int, chosen: np.ndarray) -> tuple[int, np.ndarray]:
        """:meth:`solve` where its short path does not decide: no items, the item-count limit
        may bind, more items than the workspace holds, or the table must change type."""
        n = len(w)
        if n == 0:
            return 0, chosen
        if self.max_items is not None:
            if w.min() < 0 or u.min() < 0 or v.min() < 0:
                raise ValueError("weights and values must be non-negative")
            fits = (w <= cap_w) & (u <= cap_u)
            if self.max_items < max_cardinality(w[fits], u[fits], cap_w, cap_u):
                return self._solve_count(w, u, v, self.max_items, cap_w, cap_u)
        if n > self._cap:
            self._allocate(n)
        value = self._entry(w, u, v, cap_w, cap_u, self._ws, self._table, chosen)
        if value <= _NEED_TABLE:  # the first call, or the value bound needs another table type (rare)
            self._allocate(n, _DTYPES[_NEED_TABLE - value])
            self._entry = _compiled_entry(self._table.dtype)
            value = self._entry(w, u, v, cap_w, cap_u, self._ws, self._table, chosen)
        if value == _NEGATIVE:
            raise ValueError("weights and values must be non-negative")
        return value, chosen

    def _solve_count(self, w, u, v, limit: int, max_w: int, max_u: int) -> tuple[int, np.ndarray]:
        n = len(w)
        cells = (limit + 1) * (max_w + 1) * (max_u + 1)
        if n * cells > MAX_TABLE_BYTES:
            raise TableTooLarge(
                f"a knapsack over {n} items with at most {limit} per pack needs a {n * cells / 2**20:,.0f} MiB "
                "table; use fewer items (a smaller buffer) or drop the item limit", n, n * cells
            )
        fits = (w <= max_w) & (u <= max_u)
        bound = min(int(v[fits].sum()), int(_dantzig(w, v, fits, max_w)), int(_dantzig(u, v, fits, max_u)))
        dtype = next(dt for dt in _DTYPES if bound <= np.iinfo(dt).max)
        best = np.zeros((limit + 1, max_w + 1, max_u + 1), dtype=dtype)
        keep = np.zeros((n, limit + 1, max_w + 1, max_u + 1), dtype=np.bool_)
        _forward_count(w, u, v, max_w, max_u, limit, best, keep)
        chosen = np.zeros(n, dtype=np.bool_)
        _backtrack_count(w, u, max_w, max_u, limit, keep, chosen)
        self._ints[_M_PREV_N, -1] = -1
        self._ints[_M_PROCESSED, -1] = n
        self._ints[_M_METHOD, -1] = _BY_COUNT
        self._ints[_M_PASSES, -1] = self._ints[_M_VISITS, -1] = self._ints[_M_TAILS, -1] = 0
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
