"""Buffer policy and pack assembly (DESIGN.md §4). No file I/O.

Planning works on two length columns only::

    stream ─▶ [ buffer of buffer_size samples ] ─knapsack─▶ pack ─▶ refill ─▶ ...
                                                   at end: re-solve until empty

Assembly turns a plan into packed rows with Arrow takes and numpy offset arithmetic,
never a Python loop over tokens.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numba
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from numba import njit

from .config import PackConfig
from .errors import ConfigError, InputError, OversizeSampleError
from .knapsack import MAX_TABLE_BYTES, KnapsackSolver, TableTooLarge, _solve
from .runs import (
    COMPACT_COLUMNS,
    RUN_COLUMNS,
    TOKEN_COLUMNS,
    V3_COMPACT_COLUMNS,
    V3_RUN_COLUMNS,
    V4_COMPACT_COLUMNS,
    blob_array,
    column_parts,
    compact_table,
    expand,
    expand_table,
    runs_version,
    swap_against,
    swap_next,
)
from .schema import SUBSEGMENT_STRIDE, TOKENIZED, packed_schema, with_media_type

__all__ = ["PackPlan", "plan_packs", "assemble_packs", "gather_runs", "warm_kernels", "unit_granularity", "unit_axis", "RelaxedUnitSolver",
           "MAX_UNIT_CELLS", "TAIL_PACKS", "ASSEMBLY_COLUMNS", "ASSEMBLY_COLUMNS_RUNS", "assembly_columns"]

#: The unit axis of the DP table has at most this many cells. A larger capacity is exact when
#: it cannot bind (see :func:`unit_axis`) or when the units' common divisor brings it within
#: this many cells; only otherwise are units quantized.
MAX_UNIT_CELLS = 1024
#: The tokenized columns :func:`assemble_packs` reads (a reader need not decode the others).
ASSEMBLY_COLUMNS = ["sample_id", "n_tokens", "n_vision_units", "media", "input_ids", "target_ids", "position_ids",
                    "subsegment_ids"]
#: The same from tokenized shards in runs form (schema versions 5 and 6).
ASSEMBLY_COLUMNS_RUNS = ["sample_id", "n_tokens", "n_vision_units", "media", *COMPACT_COLUMNS, *RUN_COLUMNS]
#: ... in the runs form of schema version 4,
_ASSEMBLY_COLUMNS_V4 = ["sample_id", "n_tokens", "n_vision_units", "media", *V4_COMPACT_COLUMNS, *RUN_COLUMNS]
#: ... and in the runs form of schema version 3.
_ASSEMBLY_COLUMNS_V3 = ["sample_id", "n_tokens", "n_vision_units", "media", *V3_COMPACT_COLUMNS, *V3_RUN_COLUMNS]
#: Regular packs re-optimized together with the flush packs at the end of a stream.
TAIL_PACKS = 8
#: Seconds :func:`warm_kernels` may spend before it says that it is compiling (a load from
#: numba's cache takes under one).
COMPILE_NOTICE_AFTER = 3.0
COMPILING = ("compiling packtool's packing kernels for this CPU: the first pack on a machine spends a minute "
             "or two here, once; numba caches them for later runs")

log = logging.getLogger(__name__)


class UndecodableMedia(InputError):
    """A media item whose bytes do not decode where pack reads them (a video's frames: tokenize
    reads headers only), raised by a media loader. ``row_message`` says what is wrong for the
    sample's ``errors.jsonl`` line; ``item``, ``sample`` and ``row`` are set on the way up (the
    item's index in a chunk's media, its sample's in the chunk's plan order, and that sample's
    row in its tokenized shard, or its entry in a mixture task's stream), so a pack task can
    reject that row and pack its shard (or stream) again without it."""

    def __init__(self, message: str, row_message: str, reason: str = "corrupt_video") -> None:
        super().__init__(message)
        self.row_message = row_message
        self.reason = reason
        self.item: int | None = None
        self.sample: int | None = None
        self.row: int | None = None

    def __reduce__(self):  # across a process pool (one not from an assembly stops its task): the same error
        return type(self), (str(self), self.row_message, self.reason)


_warm = False


@dataclass
class PackPlan:
    """Which samples go in which pack.

    Attributes:
        order: sample indices, pack after pack.
        offsets: ``order[offsets[p]:offsets[p+1]]`` are pack ``p``'s samples.
        dropped: indices of samples dropped as oversize.
        alone: indices of oversize samples given a pack of their own (the last packs).
        truncated: indices of text-only samples cut to ``max_tokens``.
        tail_packs_saved: packs the tail re-optimization saved over the plain flush.
        unit_axis: how the DP held the unit capacity (:func:`unit_axis`): ``exact``,
            ``redundant`` (it could not bind; exact), ``relaxed`` (exact, relaxation first) or
            ``quantized`` (an exact table would not fit in memory; units were rounded up).
    """

    order: np.ndarray
    offsets: np.ndarray
    dropped: list[int] = field(default_factory=list)
    alone: list[int] = field(default_factory=list)
    truncated: list[int] = field(default_factory=list)
    tail_packs_saved: int = 0
    unit_axis: str = "exact"

    @property
    def n_packs(self) -> int:
        return len(self.offsets) - 1


def unit_granularity(max_units: int) -> int:
    """Quantum for vision units so the DP's unit axis has at most ``MAX_UNIT_CELLS`` cells.

    The relaxation quantum of :class:`RelaxedUnitSolver` (capacities up to
    ``MAX_UNIT_CELLS``, every crop-count family, need none).

    Example:
        >>> unit_granularity(128), unit_granularity(16384)
        (1, 16)
    """
    return max(1, -(-max_units // MAX_UNIT_CELLS))


def unit_axis(qw: np.ndarray, units: np.ndarray, cap_w: int, max_units: int) -> tuple[int, int, str]:
    """How the DP represents the unit capacity for these samples: ``(quantum, cells, how)``.

    ``qw`` are the DP token weights (``ceil(tokens / g)``) and ``units`` the exact unit counts
    of the samples that fit on their own; ``cap_w`` is the DP token capacity.

    * ``"redundant"`` (``cells == 0``): no subset within the token capacity can pass the unit
      capacity, because every sample has ``units * cap_w <= max_units * qw`` (so any subset
      with ``sum(qw) <= cap_w`` has ``sum(units) <= max_units``). The unit axis is dropped:
      the same subsets are feasible, so the optimum *and* the tie-rule subset are those of
      the two-dimensional problem, from a one-row table. Patch-count families meet this at
      their defaults: a Qwen2.5-VL sample has ``units = 4 * placeholder tokens <= 4 * tokens``
      and the default capacity is ``4 * max_tokens`` patches.
    * ``"exact"``: units divided by their greatest common divisor ``quantum`` (exact: every
      sum is a multiple of it) leave at most ``MAX_UNIT_CELLS`` cells.
    * ``"relaxed"``: otherwise (a binding capacity too fine for a dense table, as a patch
      capacity far below the default) ``quantum`` is still the divisor and ``cells`` the exact
      capacity in its multiples; the planner solves a relaxation first (see
      :class:`RelaxedUnitSolver`) and the exact table only when the relaxation's subset does
      not fit.

    Example:
        >>> unit_axis(np.array([10, 4]), np.array([600, 256]), 1024, 65536)   # units <= 64 qw
        (1, 0, 'redundant')
        >>> unit_axis(np.array([10, 4]), np.array([600, 256]), 1024, 4096)
        (8, 512, 'exact')
        >>> unit_axis(np.array([10, 4]), np.array([601, 256]), 1024, 4096)
        (1, 4096, 'relaxed')
    """
    qw = np.asarray(qw, dtype=np.int64)
    units = np.asarray(units, dtype=np.int64)
    if max_units <= MAX_UNIT_CELLS:
        return 1, max_units, "exact"
    if bool(np.all(units * cap_w <= max_units * qw)):
        return 1, 0, "redundant"
    g = int(np.gcd.reduce(units[units > 0])) if bool((units > 0).any()) else max_units
    return g, max_units // g, "exact" if max_units // g <= MAX_UNIT_CELLS else "relaxed"


class RelaxedUnitSolver:
    """Exact solves over a unit capacity too fine for a dense table (``cells`` over
    ``MAX_UNIT_CELLS``), with :class:`~packtool.knapsack.KnapsackSolver`'s answer and tie rule.

    Each solve first runs the *relaxation* with units ``floor(u / q)`` and capacity
    ``floor(max_u / q)`` (``q = unit_granularity(max_u)``, at most ``MAX_UNIT_CELLS`` cells).
    Every subset that fits the exact capacity fits the relaxed one (a sum of floors is at most
    the floor of the sum), so when the relaxation's subset also fits the exact capacity it is
    the exact optimum, and the very subset the tie rule picks: it is optimal among the exact
    subsets, and any exact optimum with a smaller encoding would be a relaxed optimum too.
    Otherwise the exact dense table over ``max_u`` cells decides (slower, rare). Only when that
    table would pass ``knapsack.MAX_TABLE_BYTES`` are units rounded up instead (feasible, not
    necessarily optimal), counted in ``quantized``.

    Example:
        >>> s = RelaxedUnitSolver(8, 3000, q=1000)
        >>> s.solve(np.array([3, 4, 5]), np.array([1000, 1000, 1999]), np.array([3, 4, 5]))
        (8, array([ True, False,  True]))
        >>> s.solve(np.array([3, 4, 5]), np.array([1000, 1000, 2001]), np.array([3, 4, 5]))
        (7, array([ True,  True, False]))
        >>> s.relaxed_ok, s.exact_solves, s.quantized
        (1, 1, 0)
    """

    def __init__(self, max_w: int, max_u: int, max_items: int | None = None, q: int | None = None) -> None:
        self.max_w, self.max_u, self.max_items = int(max_w), int(max_u), max_items
        self.q = unit_granularity(self.max_u) if q is None else int(q)
        self.relaxed = KnapsackSolver(self.max_w, self.max_u // self.q, max_items)
        self._exact: KnapsackSolver | None = None
        self._rounded: KnapsackSolver | None = None
        self.relaxed_ok = self.exact_solves = self.quantized = 0

    def solve(self, w: np.ndarray, u: np.ndarray, v: np.ndarray, max_w: int | None = None,
              max_u: int | None = None) -> tuple[int, np.ndarray]:
        u = np.asarray(u, dtype=np.int64)
        cap_w = self.max_w if max_w is None else int(max_w)
        cap_u = self.max_u if max_u is None else int(max_u)
        value, chosen = self.relaxed.solve(w, u // self.q, v, cap_w, cap_u // self.q)
        if int(u[chosen].sum()) <= cap_u:
            self.relaxed_ok += 1
            return value, chosen
        if self._rounded is None:
            try:
                if self._exact is None:
                    self._exact = KnapsackSolver(self.max_w, self.max_u, self.max_items)
                value, chosen = self._exact.solve(w, u, v, cap_w, cap_u)
                self.exact_solves += 1
                return value, chosen
            except TableTooLarge:  # the exact table would pass MAX_TABLE_BYTES
                self._exact = None
                self._rounded = KnapsackSolver(self.max_w, self.max_u // self.q, self.max_items)
        self.quantized += 1
        return self._rounded.solve(w, -(-u // self.q), v, cap_w, cap_u // self.q)


def plan_packs(tokens: np.ndarray, units: np.ndarray, has_media: np.ndarray, cfg: PackConfig, max_units: int,
               anchor: bool = False, name: Callable[[int], str] | None = None) -> PackPlan:
    """Plan packs for samples with the given token and vision-unit counts, in stream order.

    The buffer policy (DESIGN.md §4)::

        stream ─▶ buffer (arrival order, ≤ buffer_size) ─knapsack─▶ pack ─▶ drop chosen ─▶ refill
        end of stream: re-solve until empty, then re-optimize the tail (last packs + flush)

    Each pack is the exact optimum over the current buffer of
    ``text_weight * tokens + vision_weight * units`` (exact counts) subject to
    ``sum(ceil(tokens / g)) <= floor(max_tokens / g)`` (``g = token_granularity``),
    ``sum(units) <= max_units`` (exact counts: see :func:`unit_axis` and
    :class:`RelaxedUnitSolver` for capacities over ``MAX_UNIT_CELLS``) and, if set,
    ``count <= max_samples_per_pack``. Ties go to older samples. Every pack fits the true
    capacities. ``plan.unit_axis`` records how the unit capacity was represented
    (``quantized`` only if some exact table was too large for memory).

    ``anchor=True`` (library only) first puts the largest buffered sample in each pack and
    fills the capacity it leaves exactly. Measured in ``bench/bench_pack.py`` it helps a
    long-video mix with large buffers on small corpora but costs packs at 40,000 samples, so
    it is off by default.

    Oversize samples (more tokens or units than a pack holds) follow ``cfg.oversize``:
    ``fail`` raises, ``drop`` drops, ``alone`` gives each its own pack (over capacity, at the
    end), ``truncate`` cuts a sample without media to ``max_tokens`` (a sample with media is
    dropped instead: cutting could split a vision span). ``name(i)``, when given, is how the
    ``fail`` error names sample ``i`` (its id; by default its index).
    """
    warm_kernels()
    tokens = np.asarray(tokens, dtype=np.int64)
    units = np.asarray(units, dtype=np.int64)
    has_media = np.asarray(has_media, dtype=bool)
    n = len(tokens)
    if not (len(units) == len(has_media) == n):
        raise ValueError("tokens, units and has_media must have the same length")
    g = cfg.token_granularity
    cap_w = cfg.max_tokens // g
    if cap_w < 1:
        raise ConfigError(f"--token-granularity {g} exceeds --max-tokens {cfg.max_tokens}; lower the granularity")
    max_units = int(max_units)
    tokens_eff = tokens.copy()
    plan = PackPlan(np.zeros(0, np.int64), np.zeros(1, np.int64))
    too_many_tokens = tokens > cfg.max_tokens
    too_many_units = units > max_units
    fits = ~(too_many_tokens | too_many_units)
    for i in np.flatnonzero(~fits).tolist():
        if cfg.oversize == "fail":
            raise OversizeSampleError(
                f"{name(i) if name is not None else f'sample at index {i}'} needs {tokens[i]:,} tokens and {units[i]:,} vision units but a pack holds "
                f"{cfg.max_tokens:,} and {max_units:,}; raise --max-tokens/--max-vision-units or use --oversize drop"
            )
        if cfg.oversize == "truncate" and not too_many_units[i] and not has_media[i]:
            plan.truncated.append(i)
            tokens_eff[i] = cfg.max_tokens
            fits[i] = True
        elif cfg.oversize == "alone":
            plan.alone.append(i)
        else:
            plan.dropped.append(i)
    # a sample that fits the true token capacity always fits the quantized one on its own
    qw = np.minimum(-(-tokens_eff // g), cap_w)
    ug, cap_u, plan.unit_axis = unit_axis(qw[fits], units[fits], cap_w, max_units)
    qu = -(-units // ug) if cap_u else np.zeros_like(units)  # exact: ug divides every fitting sample's units
    value = cfg.text_weight * tokens_eff + cfg.vision_weight * units
    stream = np.flatnonzero(fits)
    made: list = []

    def make(max_w: int, max_u: int, max_k: int | None):
        solver = (RelaxedUnitSolver if plan.unit_axis == "relaxed" else KnapsackSolver)(max_w, max_u, max_k)
        made.append(solver)
        return solver

    try:
        packs = _buffer_packs(stream, qw, qu, value, cap_w, cap_u, cfg.buffer_size, cfg.max_samples_per_pack, anchor,
                              make)
        n_flush = packs.pop()
        packs, saved = _reoptimize_tail(packs, n_flush, qw, qu, value, cap_w, cap_u, cfg.max_samples_per_pack, make)
    except TableTooLarge as exc:
        raise ConfigError(
            f"--max-tokens {cfg.max_tokens:,} at --token-granularity {g} gives {cap_w:,} token cells a pack, too "
            f"many for the exact packer: a knapsack over {exc.items} samples needs {exc.nbytes / 2**20:,.0f} MiB of "
            f"tables (the limit is {MAX_TABLE_BYTES / 2**20:,.0f} MiB); raise "
            "--token-granularity (the tables shrink in proportion), or lower --buffer-size or --max-tokens"
        ) from None
    if any(getattr(s, "quantized", 0) for s in made):
        plan.unit_axis = "quantized"
    plan.tail_packs_saved = saved
    packs.extend(np.array([i], dtype=np.int64) for i in plan.alone)
    sizes = np.array([len(p) for p in packs], dtype=np.int64)
    plan.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    plan.order = np.concatenate(packs).astype(np.int64) if packs else np.zeros(0, np.int64)
    return plan


def _buffer_packs(stream, qw, qu, value, cap_w, cap_u, buffer_size, max_k, anchor: bool = False,
                  make=KnapsackSolver) -> list:
    """The fill-solve-emit-refill loop; the last list element is the number of flush packs.

    With ``anchor`` the largest buffered sample (by the larger of its two relative sizes;
    the oldest among equals) is put in each pack first and the exact knapsack fills the
    capacity it leaves.

    With a plain :class:`~packtool.knapsack.KnapsackSolver` (no anchor, no item limit: the
    defaults) the loop runs compiled (:func:`_stream_packs`), calling the same compiled solve
    with the same items in the same order, so the packs are the same; the Python loop below
    cost about four times the solves themselves.
    """
    limit = max_k if max_k is None or not anchor else max_k - 1
    solver = make(cap_w, cap_u, limit)
    if not anchor and type(solver) is KnapsackSolver and solver.max_items is None and len(stream):
        return _compiled_buffer_packs(solver, np.ascontiguousarray(stream, dtype=np.int64), qw, qu, value, buffer_size)
    packs: list = []
    buf = np.zeros(0, dtype=np.int64)
    pos = 0
    n_flush = 0
    while pos < len(stream) or len(buf):
        if len(buf) < buffer_size and pos < len(stream):
            take = min(buffer_size - len(buf), len(stream) - pos)
            buf = np.concatenate([buf, stream[pos:pos + take]])
            pos += take
        if pos == len(stream):
            n_flush += 1
        if anchor:
            rel = np.maximum(qw[buf] / cap_w, qu[buf] / cap_u if cap_u else 0.0)
            j = int(np.argmax(rel))
            rest = np.delete(buf, j)
            _, ch = solver.solve(qw[rest], qu[rest], value[rest], cap_w - int(qw[buf[j]]), cap_u - int(qu[buf[j]]))
            chosen = np.insert(ch, j, True)
        else:
            _, chosen = solver.solve(qw[buf], qu[buf], value[buf])
            if not chosen.any():  # only with zero values; keeps the loop finite
                chosen[0] = True
        packs.append(buf[chosen])
        buf = buf[~chosen]
    packs.append(n_flush)
    return packs


def _compiled_buffer_packs(solver: KnapsackSolver, stream, qw, qu, value, buffer_size: int) -> list:
    """:func:`_buffer_packs` by :func:`_stream_packs`; a buffer the compiled solve cannot answer
    in place (the first, or one that needs a table of a wider type) is solved by
    ``solver.solve`` and handed back as the next buffer's choice."""
    qw, qu, value = (np.ascontiguousarray(x, dtype=np.int64) for x in (qw, qu, value))
    size = min(int(buffer_size), len(stream))
    state = np.zeros(_LOOP_STATE, dtype=np.int64)
    buf = np.empty(size, dtype=np.int64)
    chosen = np.empty(size, dtype=np.bool_)
    order = np.empty(len(stream), dtype=np.int64)
    ends = np.zeros(len(stream) + 1, dtype=np.int64)
    while True:
        ws, table = solver.workspace(size)
        if _stream_packs(stream, qw, qu, value, solver.max_w, solver.max_u, size, ws, table, state, buf, chosen,
                         order, ends) == 0:
            break
        held = buf[:state[_NBUF]]
        _, ch = solver.solve(qw[held], qu[held], value[held])  # raises on negative values
        chosen[:len(ch)] = ch
        state[_GIVEN] = 1
    n_packs = int(state[_NPACKS])
    packs: list = [order[a:b] for a, b in zip(ends[:n_packs].tolist(), ends[1:n_packs + 1].tolist(), strict=True)]
    packs.append(int(state[_NFLUSH]))
    return packs


#: :func:`_stream_packs`'s state between calls: stream position, samples buffered, samples
#: emitted, packs, flush packs, whether ``chosen`` already holds the buffer's choice.
_POS, _NBUF, _NOUT, _NPACKS, _NFLUSH, _GIVEN = range(6)
_LOOP_STATE = 6


@njit(cache=True)
def _stream_packs(stream, qw, qu, value, cap_w, cap_u, size, ws, tabs, state, buf, chosen, order, ends):  # pragma: no cover - compiled
    """The buffer loop of :func:`_buffer_packs` in one compiled call: refill the buffer from
    ``stream`` (arrival order), solve it with :func:`~packtool.knapsack._solve`, emit the
    chosen samples as a pack (``order[ends[p]:ends[p + 1]]``), keep the rest in order.
    Returns 0 when the stream is packed, or the solve's negative code for a buffer it could
    not answer, leaving that buffer in ``buf[:state[_NBUF]]``; the caller puts its choice in
    ``chosen`` and sets ``state[_GIVEN]``."""
    pos, nbuf, n_out, n_packs, n_flush = state[_POS], state[_NBUF], state[_NOUT], state[_NPACKS], state[_NFLUSH]
    n = stream.shape[0]
    w = np.empty(size, dtype=np.int64)
    u = np.empty(size, dtype=np.int64)
    v = np.empty(size, dtype=np.int64)
    # a step known only at run time types the item views as the solver's compiled entry takes
    # them (any layout), so this calls that very compilation
    one = max(1, size // max(1, size))
    while pos < n or nbuf > 0:
        if state[_GIVEN]:
            state[_GIVEN] = 0  # this buffer was refilled (and counted) before the caller solved it
        else:
            if nbuf < size and pos < n:
                take = min(size - nbuf, n - pos)
                for j in range(take):
                    buf[nbuf + j] = stream[pos + j]
                nbuf += take
                pos += take
            for j in range(nbuf):
                w[j] = qw[buf[j]]
                u[j] = qu[buf[j]]
                v[j] = value[buf[j]]
            code = _solve(w[0:nbuf:one], u[0:nbuf:one], v[0:nbuf:one], cap_w, cap_u, ws, tabs, chosen[:nbuf])
            if code < 0:
                state[_POS], state[_NBUF], state[_NOUT], state[_NPACKS], state[_NFLUSH] = pos, nbuf, n_out, n_packs, n_flush
                return code
        if pos == n:
            n_flush += 1
        any_chosen = False
        for j in range(nbuf):
            any_chosen = any_chosen or chosen[j]
        if not any_chosen:  # only with zero values; keeps the loop finite
            chosen[0] = True
        kept = 0
        for j in range(nbuf):
            if chosen[j]:
                order[n_out] = buf[j]
                n_out += 1
            else:
                buf[kept] = buf[j]
                kept += 1
        nbuf = kept
        n_packs += 1
        ends[n_packs] = n_out
    state[_POS], state[_NBUF], state[_NOUT], state[_NPACKS], state[_NFLUSH] = pos, nbuf, n_out, n_packs, n_flush
    return 0


def _reoptimize_tail(packs, n_flush, qw, qu, value, cap_w, cap_u, max_k, make=KnapsackSolver) -> tuple[list, int]:
    """Re-pack the flush packs and the ``TAIL_PACKS`` before them, keeping the best plan.

    The plain flush fills the first packs best and leaves the hard samples for the last
    ones. Candidates over the same samples: the plain result, first-fit and best-fit
    decreasing by the larger relative size, and "largest first, then knapsack-fill".
    The fewest packs wins, then the fuller emptiest pack; the plain result wins ties.
    """
    k = min(len(packs), n_flush + TAIL_PACKS)
    if k <= 1:
        return packs, 0
    head, tail = packs[:-k], packs[-k:]
    items = np.sort(np.concatenate(tail))
    cands = [tail, _fit_decreasing(items, qw, qu, cap_w, cap_u, max_k, best=False),
             _fit_decreasing(items, qw, qu, cap_w, cap_u, max_k, best=True),
             _largest_then_fill(items, qw, qu, value, cap_w, cap_u, max_k, make)]

    def score(ps):
        fill = min(max(qw[p].sum() / cap_w, qu[p].sum() / cap_u if cap_u else 0.0) for p in ps)
        return (len(ps), -fill)

    best = min(range(len(cands)), key=lambda c: (score(cands[c]), c))
    return head + cands[best], len(tail) - len(cands[best])


def _fit_decreasing(items, qw, qu, cap_w, cap_u, max_k, best: bool) -> list:
    key = np.maximum(qw[items] / cap_w, qu[items] / cap_u if cap_u else 0.0)
    order = items[np.argsort(-key, kind="stable")]
    loads_w: list[int] = []
    loads_u: list[int] = []
    bins: list[list[int]] = []
    for i in order.tolist():
        pick = -1
        slack = None
        for j in range(len(bins)):
            if loads_w[j] + qw[i] <= cap_w and loads_u[j] + qu[i] <= cap_u and (max_k is None or len(bins[j]) < max_k):
                if not best:
                    pick = j
                    break
                s = (cap_w - loads_w[j] - qw[i]) / cap_w + ((cap_u - loads_u[j] - qu[i]) / cap_u if cap_u else 0.0)
                if slack is None or s < slack:
                    pick, slack = j, s
        if pick < 0:
            bins.append([])
            loads_w.append(0)
            loads_u.append(0)
            pick = len(bins) - 1
        bins[pick].append(i)
        loads_w[pick] += int(qw[i])
        loads_u[pick] += int(qu[i])
    return [np.array(sorted(b), dtype=np.int64) for b in bins]


def _largest_then_fill(items, qw, qu, value, cap_w, cap_u, max_k, make=KnapsackSolver) -> list:
    rest = items.copy()
    out = []
    while len(rest):
        key = np.maximum(qw[rest] / cap_w, qu[rest] / cap_u if cap_u else 0.0)
        j = int(np.argmax(key))
        seed = rest[j]
        rest = np.delete(rest, j)
        pack = [int(seed)]
        if len(rest) and (max_k is None or max_k > 1):
            solver = make(cap_w - int(qw[seed]), cap_u - int(qu[seed]), None if max_k is None else max_k - 1)
            _, chosen = solver.solve(qw[rest], qu[rest], value[rest])
            pack += rest[chosen].tolist()
            rest = rest[~chosen]
        out.append(np.array(sorted(pack), dtype=np.int64))
    return out


@njit(cache=True)
def _gather_runs(src, starts, lengths, dst_starts, add, dst):  # pragma: no cover - compiled
    """``dst[dst_starts[k]:+lengths[k]] = src[starts[k]:+lengths[k]] + add[k]`` for every ``k``;
    -1, or the first run that lies outside ``src`` or ``dst`` (then nothing is written)."""
    for k in range(starts.shape[0]):
        if (lengths[k] < 0 or starts[k] < 0 or dst_starts[k] < 0 or starts[k] + lengths[k] > src.shape[0]
                or dst_starts[k] + lengths[k] > dst.shape[0]):
            return k
    for k in range(starts.shape[0]):
        n = lengths[k]
        x = add[k]
        # explicit loops over views of the run: numba's slice assignment is a generic strided
        # copy, and indexing dst and src at offsets keeps LLVM from vectorizing (about 3x slower
        # per value than the views, measured on 9.4M values in runs of 1-470)
        s = src[starts[k]:starts[k] + n]
        o = dst[dst_starts[k]:dst_starts[k] + n]
        if x == 0:
            for j in range(n):
                o[j] = s[j]
        else:
            for j in range(n):
                o[j] = s[j] + x
    return -1


def gather_runs(src: np.ndarray, starts: np.ndarray, lengths: np.ndarray, dst_starts: np.ndarray, add: np.ndarray,
                dst: np.ndarray) -> None:
    """Copy run ``k`` of ``src`` (``lengths[k]`` values from ``starts[k]``) to ``dst`` at
    ``dst_starts[k]``, adding ``add[k]`` to each value (wrapping in ``dst``'s type), in one
    compiled pass: the assembly's gather of sample slices into packs, without a Python slice
    per sample.

    Example:
        >>> out = np.zeros(5, dtype=np.int32)
        >>> gather_runs(np.arange(10, dtype=np.int32), np.array([7, 1]), np.array([2, 3]), np.array([0, 2]),
        ...             np.array([0, 100], dtype=np.int32), out)
        >>> out.tolist()
        [7, 8, 101, 102, 103]
    """
    starts, lengths, dst_starts = (np.ascontiguousarray(x, dtype=np.int64) for x in (starts, lengths, dst_starts))
    add = np.ascontiguousarray(add, dtype=dst.dtype)
    k = len(starts)
    if not (len(lengths) == len(dst_starts) == len(add) == k):
        raise ValueError("starts, lengths, dst_starts and add must have the same length")
    if _gather_runs(src, starts, lengths, dst_starts, add, dst) >= 0:
        raise ValueError("a run lies outside src or dst")


def warm_kernels() -> None:
    """Load the compiled kernels every pack runs (the knapsack's solve for the default table
    type, the buffer loop, the gather) from numba's cache, compiling those it lacks; once per
    process, on the first :func:`plan_packs` (and in the forkserver of a pool of pack workers,
    so its workers fork with them loaded).

    The cache is per machine: on the first pack of a machine (or a new CPU, a new packtool or
    numba) the compile takes a minute or two of one core, with nothing on screen. A load
    taking over :data:`COMPILE_NOTICE_AFTER` seconds logs :data:`COMPILING` as a warning (the
    command line prints it), so the pause does not pass for a hang.

    The first process of a machine to load them does so alone (:func:`_kernel_lock`): the
    ``pack`` command and the forkserver it starts for its workers both warm the kernels, and a
    first pack compiled them twice at once and said so twice. Processes that come while it
    loads wait for it, then load from the cache side by side (Ray workers starting together on
    a node are not queued one behind another), and say nothing.
    """
    global _warm
    if _warm or numba.config.DISABLE_JIT:
        return
    with _kernel_lock():
        notice = threading.Timer(COMPILE_NOTICE_AFTER, log.warning, args=(COMPILING,))
        notice.daemon = True
        notice.start()
        try:
            one = np.ones(2, dtype=np.int64)
            _buffer_packs(np.arange(2), one, one, one, 2, 2, 2, None)
            gather_runs(np.zeros(1, dtype=np.int32), np.zeros(1), np.ones(1), np.zeros(1), np.zeros(1),
                        np.zeros(1, dtype=np.int32))
        finally:
            notice.cancel()
            notice.join()
    _warm = True


def _kernel_lock_path() -> Path:
    """The lock file of :func:`_kernel_lock`: one per user and installed packtool."""
    key = hashlib.sha256(str(Path(__file__).resolve().parent).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"packtool-kernels-{os.getuid()}-{key}.lock"


@contextlib.contextmanager
def _kernel_lock():
    """Hold this machine's lock on loading packtool's kernels (an ``flock`` on a file in the
    temporary directory, one per user and installed packtool; released by the system if the
    process dies): exclusive when no other process holds it, else shared once the exclusive
    holder (the one loading, or compiling, first) is done. Where no lock can be taken (no
    writable temporary directory, no ``fcntl``) the load goes ahead unlocked, as before."""
    try:
        import fcntl

        fh = open(_kernel_lock_path(), "a+b")  # noqa: SIM115
    except (ImportError, OSError, AttributeError):
        yield
        return
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process loads them: wait for it, then load beside the others
            with contextlib.suppress(OSError):
                fcntl.flock(fh, fcntl.LOCK_SH)
        except OSError:
            pass
        yield  # closing the file releases the lock


def _token_columns(tables: list[pa.Table], name: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Flat values and row offsets of one token column per table, without copying (``runs.column_parts``)."""
    values, offsets = [], []
    for t in tables:
        vals, offs = column_parts(t.column(name))
        values.append(vals)
        offsets.append(offs)
    return values, offsets


def assembly_columns(schema: pa.Schema) -> list[str]:
    """The tokenized columns :func:`assemble_packs` reads from shards of ``schema`` (a reader
    need not decode the others): :data:`ASSEMBLY_COLUMNS`, their runs form in version 3, 4 and 5 shards."""
    return {5: ASSEMBLY_COLUMNS_RUNS, 4: _ASSEMBLY_COLUMNS_V4, 3: _ASSEMBLY_COLUMNS_V3}.get(runs_version(schema),
                                                                                          ASSEMBLY_COLUMNS)


def _cut_rows(tables: list[pa.Table], rows: list[tuple[int, int]], max_tokens: int) -> pa.Table:
    """Rows ``(table, local row)`` cut to their first ``max_tokens`` tokens, in runs form.

    The cut may fall inside a run, so each row is expanded, cut, and compacted again; the
    last kept token's target becomes -100 (it would predict a token that is gone). Rows
    cut this way are rare (``--oversize truncate``) and text-only.
    """
    parts = [expand_table(tables[s].slice(i, 1).select([*COMPACT_COLUMNS, *RUN_COLUMNS])) for s, i in rows]
    full = pa.concat_tables(parts).combine_chunks()
    cols = {}
    for name in TOKEN_COLUMNS:
        arr = full.column(name).chunk(0)
        vals = arr.values.to_numpy(zero_copy_only=False)
        offs = arr.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
        kept = [vals[a:a + max_tokens].copy() for a in offs[:-1].tolist()]
        if name == "target_ids":
            for k in kept:
                k[-1] = -100
        cols[name] = kept
    return compact_table(pa.table({name: pa.array(cols[name], type=pa.list_(pa.int32())) for name in TOKEN_COLUMNS}))


def assemble_packs(
    table: pa.Table | list[pa.Table],
    plan: PackPlan,
    first_pack_index: int,
    media_data: Callable[[dict], list[bytes] | None] | None = None,
    max_tokens: int | None = None,
    media_loaders: tuple[list[Callable[[dict], list[bytes] | None]], np.ndarray] | None = None,
    layout: str = "runs",
) -> pa.Table:
    """Build packed rows (``schema.packed_schema(layout)``) from tokenized rows and a plan.

    Tokenized rows may be in runs form (schema version 6 or 5, or 3 and 4 turned into 5's form
    first) or expanded (versions 1 and 2, compacted here first: a pure function of the row, so
    the packs are the same bytes); media of versions 1 to 5 get null ``source_*`` fields. Stored targets are copied as they are (each is stored
    against the next input, ``runs.swap_next``), except each sample's last one, whose next
    input in the pack is the next sample's first: it is stored against that.
    A pack's compact row is its samples' compact rows end to end: compact columns and
    run tables are concatenated per pack through list offsets, run starts shifted by the
    sample's start in the pack's compact row, so the placeholders are never materialised;
    subsegment ids are renumbered ``k * 100000 + id`` for the pack's ``k``-th sample;
    media spans, ``n_tokens`` and ``cu_seqlens`` count expanded tokens. ``layout="full"``
    expands the packs at the end (schema version 7, every token stored).
    ``media_data(media_struct)`` returns the bytes to embed for one media item (``None``
    keeps media by reference).

    ``table`` may be a list of tables read as one (rows numbered across them in list
    order), so rows can be gathered straight from the row groups that hold them: each
    token lands in its pack with one copy, whatever tables it comes from.

    Rows listed in ``plan.truncated`` (indices into ``table``; text-only by construction)
    are cut to their first ``max_tokens`` tokens, and the last kept token's target
    becomes ``-100``.

    ``media_loaders = (loaders, which)`` replaces ``media_data`` when samples come from sources
    with different media roots: sample ``k`` of ``plan.order`` loads its media with
    ``loaders[which[k]]``.
    """
    schema = packed_schema(layout)
    # rows of schema version 5 or older have no media source_* fields: they pack with nulls there
    media_type = TOKENIZED.field("media").type
    tables = [with_media_type(t, media_type) for t in ([table] if isinstance(table, pa.Table) else list(table))]
    order = np.asarray(plan.order, dtype=np.int64)
    row_start = np.cumsum([0] + [t.num_rows for t in tables])
    small = [t.select(["sample_id", "n_tokens", "n_vision_units", "media"]) for t in tables]
    small = pa.concat_tables(small) if len(small) > 1 else small[0]
    if len(order) == small.num_rows and bool((order == np.arange(len(order))).all()):
        taken = small  # rows already in pack order: no copy
    else:
        taken = small.take(pa.array(order))
    n_samples = taken.num_rows
    n_packs = plan.n_packs
    pack_off = plan.offsets
    full = taken["n_tokens"].to_numpy().astype(np.int64)
    lengths = full
    # each sample's table and row within it; one slice per sample is copied into place
    src = np.searchsorted(row_start, order, side="right") - 1
    local = order - row_start[src]
    tables = [t if runs_version(t) == 5 else compact_table(t) if runs_version(t) in (3, 4)
              else compact_table(t.select([c for c in t.column_names if c in ASSEMBLY_COLUMNS])) for t in tables]
    if plan.truncated and max_tokens is not None:
        cut = np.zeros(int(row_start[-1]), dtype=bool)
        cut[np.asarray(plan.truncated, dtype=np.int64)] = True
        cut = cut[order] & (full > max_tokens)
        if cut.any():
            lengths = np.where(cut, max_tokens, full)
            which = np.flatnonzero(cut)
            tables.append(_cut_rows(tables, list(zip(src[which].tolist(), local[which].tolist(), strict=True)),
                                    max_tokens))
            src = src.copy()
            local = local.copy()
            src[which] = len(tables) - 1
            local[which] = np.arange(len(which))
    pack_of = np.repeat(np.arange(n_packs), np.diff(pack_off))
    k_in_pack = np.arange(n_samples) - pack_off[pack_of]
    sample_end = np.cumsum(lengths)
    sample_start = sample_end - lengths
    tok_pack_off = np.concatenate([[0], sample_end])[pack_off]
    start_in_pack = sample_start - tok_pack_off[pack_of]
    in_table = [np.flatnonzero(src == s) for s in range(len(tables))]
    parts: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}

    def stored(name: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Values and row offsets of a stored column in every table, looked up once."""
        if name not in parts:
            parts[name] = _token_columns(tables, name)
        return parts[name]

    def spans(name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each sample's list length in column ``name``, its start in the flat output, and each pack's offsets."""
        n = np.zeros(n_samples, dtype=np.int64)
        for s, here in enumerate(in_table):
            if len(here):
                offs = stored(name)[1][s]
                n[here] = offs[local[here] + 1] - offs[local[here]]
        end = np.cumsum(n)
        return n, end - n, np.concatenate([[0], end])[pack_off]

    c_len, c_start, c_pack_off = spans(COMPACT_COLUMNS[0])
    r_len, r_start, r_pack_off = spans(RUN_COLUMNS[0])
    # every stored column of a row is gathered with input ids' length: a damaged shard whose
    # columns disagree must stop here, not copy past a row's end
    used = [s for s, here in enumerate(in_table) if len(here)]

    def from_zero(name: str) -> list[np.ndarray]:
        """Row offsets of column ``name`` in each table that gives samples, counted from 0."""
        return [stored(name)[1][s] - stored(name)[1][s][0] for s in used]

    refs = {ref: from_zero(ref) for ref in (COMPACT_COLUMNS[0], RUN_COLUMNS[0])}
    for name, want in [(c, c_len) for c in COMPACT_COLUMNS[1:]] + [(RUN_COLUMNS[1], r_len)]:
        ref = COMPACT_COLUMNS[0] if name in COMPACT_COLUMNS else RUN_COLUMNS[0]
        if all(np.array_equal(a, b) for a, b in zip(from_zero(name), refs[ref], strict=True)):
            continue  # every row of the tables agrees: one comparison of offsets per table, no per-sample spans
        got = spans(name)[0]
        if not np.array_equal(got, want):
            k = int(np.flatnonzero(got != want)[0])
            raise ValueError(f"tokenized row {taken['sample_id'][k].as_py()!r}: {name} holds {int(got[k])} values, "
                             f"{ref} {int(want[k])}; the shard is damaged: re-run tokenize")
    c_start_in_pack = c_start - c_pack_off[pack_of]
    no_add = np.zeros(n_samples, dtype=np.int32)

    def values(name: str, n: np.ndarray, at: np.ndarray, add: np.ndarray = no_add) -> np.ndarray:
        vals, offs = stored(name)
        out = np.empty(int(n.sum()), dtype=np.int32)
        for s, here in enumerate(in_table):
            if len(here):
                gather_runs(vals[s], offs[s][local[here]], n[here], at[here], add[here], out)
        return out

    def compact_values(name: str, add: np.ndarray = no_add) -> np.ndarray:
        return values(COMPACT_COLUMNS[TOKEN_COLUMNS.index(name)], c_len, c_start, add)

    run_starts = values(RUN_COLUMNS[0], r_len, r_start, c_start_in_pack.astype(np.int32))
    run_lengths = values(RUN_COLUMNS[1], r_len, r_start)
    if n_samples:
        got = c_len + np.bincount(np.repeat(np.arange(n_samples), r_len), weights=run_lengths - 1,
                                  minlength=n_samples).astype(np.int64)
        if not np.array_equal(got, lengths):
            k = int(np.flatnonzero(got != lengths)[0])
            raise ValueError(f"tokenized row {taken['sample_id'][k].as_py()!r}: n_tokens is {int(lengths[k])} but its "
                             f"token columns hold {int(got[k])} tokens; re-run tokenize")
    # int32 wraps as the old int64 sum cast to int32 did; ids stay far below 2**31 in practice
    token_cols = {
        "input_ids": compact_values("input_ids"),
        "target_ids": compact_values("target_ids"),
        "position_ids": compact_values("position_ids"),
        "subsegment_ids": compact_values("subsegment_ids", (k_in_pack * SUBSEGMENT_STRIDE).astype(np.int32)),
    }
    # a sample's last stored target is its row's last value, stored as it is; in the pack a
    # next input follows (the next sample's first), so store it against that
    joins = c_start + c_len - 1
    joins = joins[(c_len > 0) & (joins + 1 < c_pack_off[pack_of + 1])]
    if len(joins):
        inputs = token_cols["input_ids"]
        token_cols["target_ids"][joins] = swap_against(token_cols["target_ids"][joins], inputs[joins + 1])
    # cu_seqlens: per pack [0, end_0, end_1, ...] relative to the pack start
    cu_off = pack_off + np.arange(n_packs + 1)
    cu_vals = np.zeros(n_samples + n_packs, dtype=np.int64)
    is_zero = np.zeros(n_samples + n_packs, dtype=bool)
    is_zero[cu_off[:-1]] = True
    cu_vals[~is_zero] = start_in_pack + lengths
    cu = pa.ListArray.from_arrays(pa.array(cu_off.astype(np.int32)), pa.array(cu_vals.astype(np.int32)))

    media_col = taken["media"].combine_chunks()
    media_flat = pc.list_flatten(media_col)
    m_counts = pc.list_value_length(media_col).to_numpy(zero_copy_only=False).astype(np.int64)
    m_sample = np.repeat(np.arange(n_samples), m_counts)
    media_fields = list(schema.field("media").type.value_type)
    names = [f.name for f in media_fields]
    children = {}
    for name in names:
        if name == "sample_index":
            children[name] = pa.array(k_in_pack[m_sample].astype(np.int32))
        elif name == "token_offset":
            off = media_flat.field("token_offset").to_numpy(zero_copy_only=False).astype(np.int64)
            children[name] = pa.array((off + start_in_pack[m_sample]).astype(np.int32))
        elif name == "data":
            try:
                if media_loaders is not None:
                    loaders, which = media_loaders
                    children["data"], children["frames"] = _media_payload(media_flat, loaders,
                                                                          np.asarray(which)[m_sample].tolist())
                else:
                    children["data"], children["frames"] = _media_payload(media_flat, media_data)
            except UndecodableMedia as err:
                err.sample = int(m_sample[err.item])  # its sample, in plan order
                raise
        elif name == "frames":
            continue
        else:
            children[name] = media_flat.field(name)
    media_struct = pa.StructArray.from_arrays([children[n] for n in names], fields=media_fields)
    m_pack_off = np.concatenate([[0], np.cumsum(m_counts)])[pack_off]
    media = pa.ListArray.from_arrays(pa.array(m_pack_off.astype(np.int32)), media_struct)

    def token_list(values: np.ndarray, offsets: np.ndarray) -> pa.Array:
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))

    units = taken["n_vision_units"].to_numpy().astype(np.int64)
    cols = {
        "pack_index": pa.array(np.arange(first_pack_index, first_pack_index + n_packs, dtype=np.int64)),
        "n_tokens": pa.array(np.diff(tok_pack_off).astype(np.int32)),
        "n_vision_units": pa.array(np.add.reduceat(units, pack_off[:-1]).astype(np.int32) if n_samples else np.zeros(0, np.int32)),
        "sample_ids": pa.ListArray.from_arrays(pa.array(pack_off.astype(np.int32)), taken["sample_id"].combine_chunks()),
    }
    if layout == "full":
        token_cols["target_ids"] = swap_next(token_cols["target_ids"], token_cols["input_ids"], c_pack_off)
        expanded, off = expand(token_cols, c_pack_off, run_starts, run_lengths, r_pack_off)
        if not np.array_equal(off, tok_pack_off):
            raise RuntimeError("internal error: expanded packs disagree with their n_tokens")
        for name in TOKEN_COLUMNS:
            cols[name] = token_list(expanded[name], tok_pack_off)
    else:
        for stored, name in zip(COMPACT_COLUMNS, TOKEN_COLUMNS, strict=True):
            cols[stored] = blob_array(token_cols[name], c_pack_off)
        cols[RUN_COLUMNS[0]] = blob_array(run_starts, r_pack_off)
        cols[RUN_COLUMNS[1]] = blob_array(run_lengths, r_pack_off)
    cols["cu_seqlens"] = cu
    cols["media"] = media
    return pa.Table.from_arrays([cols[f.name] for f in schema], schema=schema)


def _media_payload(media_flat: pa.StructArray, media_data, which: list[int] | None = None) -> tuple[pa.Array, pa.Array]:
    """The ``data`` (an image file's bytes) and ``frames`` (a video's JPEG per timestamp) columns.

    ``media_data`` loads one item; with ``which`` it is a list of loaders and item ``j`` uses
    ``media_data[which[j]]`` (a mixture's sources, each with its own media root). Without one
    (``--media reference``) an item that came with its file's bytes (a data URI, a Parquet image
    struct or column) keeps them in ``data``: there is no file to refer to, so a reference
    would lose the item (a video's ``data`` is its file, decoded at read time as a file is).
    """
    n = len(media_flat)
    if media_data is None or n == 0:
        inline = media_flat.field("data") if n and "data" in [f.name for f in media_flat.type] else None
        return (inline if inline is not None else pa.nulls(n, type=pa.binary()),
                pa.nulls(n, type=pa.list_(pa.binary())))
    # a loader's UndecodableMedia leaves with the item's index set (``item``)
    loaders = media_data if which is not None else None
    if media_flat.null_count or not all(callable(getattr(f, "image", None)) for f in (loaders or [media_data])):
        data, frames = [], []
        for j, m in enumerate(media_flat.to_pylist()):
            try:
                payload = media_data(m) if which is None else media_data[which[j]](m)
            except UndecodableMedia as err:
                err.item = j
                raise
            data.append((payload[0] if payload else None) if m["kind"] == "image" else None)
            frames.append(None if m["kind"] == "image" else payload)
        return pa.array(data, type=pa.binary()), pa.array(frames, type=pa.list_(pa.binary()))
    # a loader with ``image(path, size_bytes)`` reads an image file from four fields, without
    # the item's dict (building one per image cost as much as opening the file)
    col = dict(zip([f.name for f in media_flat.type], media_flat.flatten(), strict=True))
    kinds = col["kind"].to_pylist()
    paths = col["path"].to_pylist()
    inline = col["data"].to_pylist() if "data" in col else [None] * n
    sizes = col["size_bytes"].to_pylist() if "size_bytes" in col else [None] * n
    data = [None] * n
    frames = [None] * n
    for j, (kind, path, raw, size) in enumerate(zip(kinds, paths, inline, sizes, strict=True)):
        load = media_data if which is None else media_data[which[j]]
        if kind == "image" and raw is None and path is not None:
            data[j] = load.image(path, size)
            continue
        try:
            payload = load(media_flat[j].as_py())
        except UndecodableMedia as err:
            err.item = j
            raise
        if kind == "image":
            data[j] = payload[0] if payload else None
        else:
            frames[j] = payload
    return _binary_array(data), pa.array(frames, type=pa.list_(pa.binary()))


def _binary_array(items: list[bytes | None]) -> pa.Array:
    """``pa.array(items, type=pa.binary())`` built as one joined buffer plus offsets (a third of
    the time for a chunk of small images; the same array).

    Example:
        >>> _binary_array([b"ab", None, b"c"]).to_pylist()
        [b'ab', None, b'c']
    """
    n = len(items)
    lengths = np.fromiter((0 if b is None else len(b) for b in items), dtype=np.int64, count=n)
    if lengths.sum() >= 2**31:  # past int32 offsets: let Arrow decide (it raises or splits)
        return pa.array(items, type=pa.binary())
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    valid = np.fromiter((b is not None for b in items), dtype=bool, count=n)
    n_null = n - int(valid.sum())
    bitmap = pa.py_buffer(np.packbits(valid, bitorder="little")) if n_null else None
    return pa.Array.from_buffers(pa.binary(), n, [bitmap, pa.py_buffer(offsets), pa.py_buffer(b"".join([b for b in items if b]))],
                                 null_count=n_null)
