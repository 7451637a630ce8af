"""Training mixtures: several tokenized sources packed at chosen rates (DESIGN.md §8).

A mixture is a list of sources, each with a **rate** (an epoch multiplier) or a **target
sample count**, and a seed. The mixture step turns it into one stream of sample references
``(source, row, copy)`` before anything is packed; the stream depends only on the sources'
sample counts, the rates and the seed, never on workers or ranks::

    source a: n=4, rate 1.0  ─▶ a0 a1 a2 a3
    source b: n=2, rate 2.5  ─▶ b0 b1 │ b0#c1 b1#c1 │ b1#c2       (two full copies + a seeded half)
    source c: n=5, rate 0.2  ─▶ c3                               (a seeded fifth)
    interleave by position (j + ½) / count ─▶ b0 a0 b1 a1 c3 b0#c1 a2 b1#c1 a3 b1#c2
    cut into tasks of samples_per_task ─▶ task 0, task 1, ...    (--group-by source: per source)

**The rounding rule.** A source of ``n`` samples at rate ``r`` contributes
``count = floor(r * n + 1/2)`` samples (the exact product of the rate as written, rounded half
up): ``k = count // n`` full copies of every sample, then ``m = count % n`` samples chosen by
the seed. A target count ``T`` is taken as it is (``k = T // n``, ``m = T % n``), so a target
above ``n`` up-samples. Copy ``c`` of sample ``x`` is named ``x`` for ``c == 0`` and ``x#c1``,
``x#c2``, ... after, so a derived id always starts with the original one and never equals the
``x#1`` of a message tree that tokenize split off ``x`` (copy 1 of ``x`` and the first copy of
``x#1`` would both be ``x#1``). A source that holds a record whose own id is a copy's name (an
``x#c1`` beside the ``x`` copied) keeps it, and the copy takes the first free ``x#c1#d1``,
``x#c1#d2``, ... as tokenize names a repeated id (:func:`copy_name`): the pack driver reads the
ids of that shape from each source it copies (:data:`COPY_LIKE`), so every task names the copies
alike, whatever the workers.

**The seeded subset.** The ``m`` samples of the partial copy are the rows with the smallest
``splitmix64(base + row * 0x9E3779B97F4A7C15)``, where ``base`` is ``splitmix64`` of
``(seed, source position)``: a pure function of the seed, the source's place in the mixture
and the row, independent of numpy's generators (whose streams may change between releases).

Example:
    >>> requested_count(3, rate=Fraction("2.5")), requested_count(7, rate=Fraction("0.2"))
    (8, 1)
    >>> requested_count(10, rate=Fraction("0.25")), requested_count(10, samples=25)
    (3, 25)
"""

from __future__ import annotations

import hashlib
import json
import numbers
import os
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from decimal import ROUND_CEILING, Context, Decimal
from fractions import Fraction
from pathlib import Path

import numpy as np

from .config import INT32_MAX, whole_number
from .errors import ConfigError
from .storage import is_url

__all__ = ["Mixture", "MixtureSource", "MixturePlan", "requested_count", "select_rows", "interleave", "plan_mixture",
           "parse_rates", "load_mixture", "rate_text", "least_rate", "least_rate_text", "GROUP_BY", "SAMPLES_PER_TASK",
           "copy_suffixes", "copy_name", "COPY_LIKE"]

#: ``--group-by`` choices: ``none`` lets a pack hold samples of several sources; ``source`` never does.
GROUP_BY = ("none", "source")
#: Stream entries per pack task (each task packs its slice of the stream with its own buffer).
SAMPLES_PER_TASK = 50_000
#: Keys a mixture file's source may hold.
_SOURCE_KEYS = {"path", "rate", "samples", "name"}
#: Bytes :func:`plan_mixture` holds per stream entry at its peak (measured with tracemalloc): each
#: source's rows (int64) and copies (int32), the interleaving's positions (float64) and order
#: (int64), then the stream's source (int32), row (int64) and copy (int32) in that order.
SCHEDULE_BYTES_PER_SAMPLE = 40

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer, elementwise on ``uint64`` (wrapping): a bijection of 64-bit words."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64, copy=True)
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return z


def rate_text(rate: Fraction) -> str:
    """A rate as recorded in manifests: its shortest exact decimal, else ``p/q``.

    Example:
        >>> rate_text(Fraction("2.50")), rate_text(Fraction(1, 3)), rate_text(Fraction(3))
        ('2.5', '1/3', '3')
    """
    d = rate.denominator
    while d % 2 == 0:
        d //= 2
    while d % 5 == 0:
        d //= 5
    if d != 1:
        return f"{rate.numerator}/{rate.denominator}"
    text = format((Decimal(rate.numerator) / Decimal(rate.denominator)).normalize(), "f")
    return text


def _rate(value: object, where: str) -> Fraction:
    """An exact positive rate from ``"2.5"``, ``2.5`` (as written in JSON) or ``"1/3"``."""
    if isinstance(value, bool) or not isinstance(value, (int, str, Fraction)):
        raise ConfigError(f"{where}: rate {_shown(value)} is not a number; give a positive number such as 0.5 or 2.5")
    try:
        rate = Fraction(value.strip()) if isinstance(value, str) else Fraction(value)
    except (ValueError, ZeroDivisionError):
        raise ConfigError(f"{where}: rate {_shown(value)} is not a number; give a positive number such as 0.5 or "
                          "2.5") from None
    if rate <= 0:
        raise ConfigError(f"{where}: rate {_shown(value)} must be above 0; leave the source out instead of giving it "
                          "rate 0")
    try:
        float(rate)
    except OverflowError:  # beyond any float: no finite epoch multiplier (1e400 reads as infinity elsewhere)
        raise ConfigError(f"{where}: rate {_shown(value)} is not a finite number; give a positive number such as 0.5 "
                          "or 2.5") from None
    return rate


def _count(value: object, flag: str) -> int:
    """``value`` as a plain ``int`` (numpy integers too); a float, a string or a bool is a ConfigError."""
    try:
        return whole_number(value)
    except TypeError:
        raise ConfigError(f"{flag} {value!r}: give a non-negative integer") from None


def _shown(value: object) -> str:
    """A value as the user wrote it: ``'lots'`` for text, ``2.5`` for a JSON number read exactly."""
    if isinstance(value, Fraction):
        if abs(value) >= 10**15:  # 1e400 in a mixture file: not its 401 digits
            return _amount(int(value))
        return rate_text(value) if value >= 0 else "-" + rate_text(-value)
    return repr(value)


@dataclass(frozen=True, slots=True)
class MixtureSource:
    """One source of a mixture: a tokenized directory and either a ``rate`` or a target ``samples``."""

    path: str
    rate: Fraction | None = None
    samples: int | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if (self.rate is None) == (self.samples is None):
            raise ConfigError(f"mixture source {self.path!r}: give either a rate or a samples count")

    @property
    def label(self) -> str:
        return self.name or self.path

    def to_dict(self) -> dict:
        out: dict = {"path": self.path}
        if self.name is not None:
            out["name"] = self.name
        if self.rate is not None:
            out["rate"] = rate_text(self.rate)
        else:
            out["samples"] = self.samples
        return out


@dataclass(frozen=True, slots=True)
class Mixture:
    """What ``pack_dataset`` takes instead of one tokenized directory.

    Attributes:
        sources: the tokenized directories with their rates or target counts, in order; a
            source's position is its index in the packed ``sample_sources`` column.
        seed: chooses the partial copies' samples (recorded in the manifest).
        group_by: ``none`` (packs mix sources) or ``source`` (a pack holds one source).
        samples_per_task: stream entries per pack task.

    Example:
        >>> m = Mixture.from_rates(["tok_a", "tok_b"], "1.0,2.5", seed=3)
        >>> [s.to_dict() for s in m.sources]
        [{'path': 'tok_a', 'rate': '1'}, {'path': 'tok_b', 'rate': '2.5'}]
    """

    sources: tuple[MixtureSource, ...]
    seed: int = 0
    group_by: str = "none"
    samples_per_task: int = SAMPLES_PER_TASK

    def __post_init__(self) -> None:
        if not self.sources:
            raise ConfigError("a mixture needs at least one source")
        # the same directory twice (``pack A A``, a glob that matched it twice) packed each sample
        # twice under one id and showed two rows the table could not tell apart: a rate says it
        seen: dict[str, int] = {}
        for i, src in enumerate(self.sources):
            key = src.path.rstrip("/") if is_url(src.path) else os.path.realpath(src.path)
            if key in seen:
                raise ConfigError(f"mixture sources {seen[key] + 1} and {i + 1} are the same tokenized directory "
                                  f"{src.path!r}; give it once, at the sum of their rates or samples (a rate of 2 "
                                  "takes every sample twice)")
            seen[key] = i
        if self.group_by not in GROUP_BY:
            raise ConfigError(f"--group-by {self.group_by!r}: choose none or source")
        # numpy integers are stored as the int the flag gives (the seed goes into the manifest's JSON)
        object.__setattr__(self, "samples_per_task", _count(self.samples_per_task, "samples_per_task"))
        if self.samples_per_task < 1:
            raise ConfigError("samples_per_task must be at least 1")
        seed = _count(self.seed, "--seed")
        if seed < 0:
            raise ConfigError(f"--seed {self.seed!r}: give a non-negative integer")
        object.__setattr__(self, "seed", seed)

    @classmethod
    def from_rates(cls, paths: str | os.PathLike | Iterable[str | os.PathLike],
                   rates: str | float | Iterable[float | str] | None = None, **kw) -> Mixture:
        """Sources from positional inputs and ``--rates`` (one per input, in order; ``None``: all 1).

        ``rates`` is the flag's text, ``"1.0,2.5"``, or one rate per input, ``[1.0, 2.5]`` (a
        float means the number its shortest form shows: ``0.1`` is 1/10, as ``--rates 0.1``).
        """
        paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)  # one path is one input
        if rates is not None and not isinstance(rates, str):
            # str() of a float (numpy's too) is its shortest form, the text the flag would hold
            rates = ",".join(str(v) for v in ([rates] if isinstance(rates, numbers.Number) else rates))
        values = ["1"] * len(paths) if rates is None else parse_rates(rates, len(paths))
        return cls(tuple(MixtureSource(str(p), rate=_rate(v, f"--rates, input {i + 1}"))
                         for i, (p, v) in enumerate(zip(paths, values, strict=True))), **kw)

    def to_dict(self) -> dict:
        return {"sources": [s.to_dict() for s in self.sources], "seed": self.seed, "group_by": self.group_by,
                "samples_per_task": self.samples_per_task}


def parse_rates(text: str, n_inputs: int) -> list[str]:
    """Split ``--rates`` into one value per input, refusing a count that does not match.

    Example:
        >>> parse_rates("1.0, 2.5,0.2", 3)
        ['1.0', '2.5', '0.2']
    """
    values = [v.strip() for v in text.split(",")]
    if len(values) != n_inputs:
        raise ConfigError(f"--rates {text!r} gives {len(values)} rate{'s' if len(values) != 1 else ''} for "
                          f"{n_inputs} input{'s' if n_inputs != 1 else ''}; give one rate per input, in order "
                          f"(e.g. --rates {','.join(['1.0'] * n_inputs)})")
    for i, v in enumerate(values):
        _rate(v, f"--rates, input {i + 1}")
    return values


def load_mixture(file: str | Path, **kw) -> Mixture:
    """Read a mixture file: ``{"sources": [{"path": ..., "rate": 2.5 | "samples": 20000, "name": ...}, ...]}``.

    Relative paths are resolved against the file's folder (bucket URLs are kept as written);
    rates are read exactly as written (``0.1`` is one tenth, not the nearest float). ``kw`` go
    to :class:`Mixture` (seed, group_by).

    Raises:
        ConfigError: the file is missing, not JSON, or a source is malformed (naming it and the fix).
    """
    file = Path(file)
    try:
        text = file.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors) is no part of the JSON
    except OSError as exc:
        raise ConfigError(f"--mixture {str(file)!r} cannot be read ({exc.strerror}); give the path of a mixture "
                          "JSON file") from None
    try:
        data = json.loads(text, parse_float=Fraction)
    except ValueError as exc:
        raise ConfigError(f"--mixture {str(file)!r} is not valid JSON ({exc}); see README, Training mixtures") from None
    example = '{"sources": [{"path": "tok_a", "rate": 1.0}, {"path": "tok_b", "samples": 20000}]}'
    if isinstance(data, dict) and set(data) - {"sources"}:
        unknown = ", ".join(map(repr, sorted(set(data) - {"sources"})))
        raise ConfigError(f"--mixture {str(file)!r}: unknown top-level key {unknown}; the file holds \"sources\" only "
                          "(give --seed and --group-by on the command line)")
    if not isinstance(data, dict) or not isinstance(data.get("sources"), list) or not data["sources"]:
        raise ConfigError(f"--mixture {str(file)!r} must hold one object with a non-empty \"sources\" list, e.g. "
                          f"{example}")
    sources = []
    for i, s in enumerate(data["sources"]):
        where = f"--mixture {str(file)!r}, source {i + 1}"
        if not isinstance(s, dict) or not isinstance(s.get("path"), str) or not s["path"]:
            raise ConfigError(f"{where}: give an object with a \"path\" (a tokenized directory), e.g. {example}")
        unknown = sorted(set(s) - _SOURCE_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                              f"a source takes {', '.join(sorted(_SOURCE_KEYS))}")
        if ("rate" in s) == ("samples" in s):
            raise ConfigError(f"{where} ({s['path']!r}): give exactly one of \"rate\" (epoch multiplier) or "
                              "\"samples\" (target count)")
        name = s.get("name")
        if name is not None and (not isinstance(name, str) or not name):
            raise ConfigError(f"{where}: \"name\" must be a non-empty string")
        if is_url(s["path"]):  # a bucket prefix is taken as written
            path = s["path"]
        else:
            path = Path(s["path"])
            path = path if path.is_absolute() else file.parent / path
        if "samples" in s:
            n = s["samples"]
            if isinstance(n, Fraction) and n.denominator == 1:  # 20000.0, 2e4: JSON has one number type
                n = int(n)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ConfigError(f"{where} ({s['path']!r}): \"samples\" {_shown(n)} must be a whole number of at least 1")
            sources.append(MixtureSource(str(path), samples=n, name=name))
        else:
            sources.append(MixtureSource(str(path), rate=_rate(s["rate"], where), name=name))
    return Mixture(tuple(sources), **kw)


def requested_count(n: int, rate: Fraction | None = None, samples: int | None = None) -> int:
    """Samples a source of ``n`` contributes: ``floor(rate * n + 1/2)`` exactly, or ``samples``.

    Example:
        >>> requested_count(5, rate=Fraction("0.2")), requested_count(3, rate=Fraction("0.5"))
        (1, 2)
    """
    if samples is not None:
        return int(samples)
    if rate is None:
        raise RuntimeError("internal error: a source with neither rate nor samples")
    return int((Fraction(rate) * n + Fraction(1, 2)) // 1)


def select_rows(n: int, count: int, seed: int, position: int) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, copies)`` of ``count`` entries of a source of ``n`` samples, copy-major.

    Every row ``count // n`` times (copy 0, then copy 1, ...), then the ``count % n`` rows the
    seed picks (see the module docstring), ascending, as the last copy.

    Example:
        >>> rows, copies = select_rows(4, 6, seed=0, position=0)
        >>> rows[:4].tolist(), copies.tolist()
        ([0, 1, 2, 3], [0, 0, 0, 0, 1, 1])
    """
    if n == 0 or count == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int32)
    k, m = divmod(count, n)
    parts = [np.tile(np.arange(n, dtype=np.int64), k)]
    if m:
        base = _splitmix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))[0] ^ np.uint64(position)
        base = _splitmix64(np.array([base], dtype=np.uint64))[0]
        with np.errstate(over="ignore"):
            keys = _splitmix64(np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + base)
        # distinct keys (a bijection of distinct words), so the m smallest are one set
        parts.append(np.sort(np.argpartition(keys, m - 1)[:m]).astype(np.int64))
    rows = np.concatenate(parts)
    copies = np.repeat(np.arange(k + 1, dtype=np.int32), [n] * k + [m])
    return rows, copies


def interleave(counts: list[int]) -> np.ndarray:
    """Source of each stream position when sources of ``counts`` entries are spread evenly.

    Entry ``j`` of a source with ``count`` entries sits at ``(j + 1/2) / count`` of the stream;
    equal positions go to the earlier source. Each source keeps its own order.

    Example:
        >>> interleave([2, 1, 4]).tolist()
        [2, 0, 2, 1, 2, 0, 2]
    """
    src = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
    return src[_interleave_order(counts)]


def _interleave_order(counts: list[int]) -> np.ndarray:
    """The stream order of the sources' entries laid end to end (see :func:`interleave`)."""
    src = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
    pos = np.concatenate([(np.arange(c, dtype=np.float64) + 0.5) / c for c in counts if c]) if len(src) else np.zeros(0)
    return np.lexsort((src, pos))


@dataclass(slots=True)
class MixturePlan:
    """The mixture step's result: the stream cut into tasks.

    Attributes:
        available: samples each source holds.
        requested: entries each source contributes (the rounding rule's counts).
        tasks: per task ``(source, row, copy)`` arrays (rows numbered across a source's shards).
    """

    available: list[int]
    requested: list[int]
    tasks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)

    def digest(self) -> str:
        h = hashlib.sha256()
        for arrays in self.tasks:
            for a in arrays:
                h.update(np.ascontiguousarray(a).tobytes())
            h.update(b"|")
        return h.hexdigest()[:16]


def plan_mixture(mixture: Mixture, available: list[int]) -> MixturePlan:
    """The stream of sample references for ``mixture`` given each source's sample count.

    Pure arithmetic on counts (no file is read): select each source's entries
    (:func:`select_rows`), spread them over one stream (:func:`interleave`; with
    ``group_by="source"`` the sources follow each other instead) and cut it into tasks of
    ``samples_per_task`` entries (per source with ``group_by="source"``, so no task, and no
    pack, holds two sources).

    Example:
        >>> p = plan_mixture(Mixture.from_rates(["a", "b"], "1,0.5"), [2, 2])
        >>> p.requested, [t[0].tolist() for t in p.tasks], [t[1].tolist() for t in p.tasks]
        ([2, 1], [[0, 1, 0]], [[0, 0, 1]])
    """
    requested = [requested_count(n, s.rate, s.samples) for n, s in zip(available, mixture.sources, strict=True)]
    _check_schedule(mixture, available, requested)
    _check_selects_some(mixture, available, requested)
    rows, copies = [], []
    for i, (n, count) in enumerate(zip(available, requested, strict=True)):
        r, c = select_rows(n, count if n else 0, mixture.seed, i)
        rows.append(r)
        copies.append(c)
    plan = MixturePlan(list(available), requested)
    counts = [len(r) for r in rows]
    size = mixture.samples_per_task
    if mixture.group_by == "source":
        for i, (r, c) in enumerate(zip(rows, copies, strict=True)):
            for a in range(0, len(r), size):
                plan.tasks.append((np.full(len(r[a:a + size]), i, np.int32), r[a:a + size], c[a:a + size]))
        return plan
    order = _interleave_order(counts)
    src = np.repeat(np.arange(len(counts), dtype=np.int32), counts)[order]
    row = np.concatenate(rows)[order]
    copy = np.concatenate(copies)[order]
    for a in range(0, len(src), size):
        plan.tasks.append((src[a:a + size], row[a:a + size], copy[a:a + size]))
    return plan


def _memory_bytes() -> int | None:
    """This machine's physical memory, or ``None`` where the platform does not tell."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _amount(x: int | Decimal, places: int = 0) -> str:
    """``x`` with thousands separators, or in three significant digits once it has more than 15."""
    d = Decimal(x)
    return format(d, f",.{places}f") if d < 10**15 else format(d, ".3g")


def _check_schedule(mixture: Mixture, available: list[int], requested: list[int]) -> None:
    """Refuse, before anything is allocated, a stream :func:`plan_mixture` cannot build: a source
    copied more often than its int32 copy numbers count, or a schedule larger than this machine's
    memory (:data:`SCHEDULE_BYTES_PER_SAMPLE` a sample). No cap of its own: a 1:1000 mixture of
    a million samples a source (a billion entries) needs 37 GiB and is refused only where the
    machine has less.

    Raises:
        ConfigError: naming the source that asks for the most samples, and the fix.
    """
    counts = [count if n else 0 for n, count in zip(available, requested, strict=True)]

    def source(i: int) -> str:
        s, n = mixture.sources[i], available[i]
        if s.rate is None:
            return f"source {i + 1} ({s.label!r}: a target of {_amount(counts[i])} samples from its {n:,})"
        return (f"source {i + 1} ({s.label!r}: {n:,} sample{'s' if n != 1 else ''} at rate {_shown(s.rate)} give "
                f"{_amount(counts[i])})")

    for i, (n, count) in enumerate(zip(available, counts, strict=True)):
        if n and count // n > INT32_MAX:
            raise ConfigError(f"mixture {source(i)} copies each sample {_amount(count // n)} times; copy numbers are "
                              f"int32, at most {INT32_MAX:,}: lower its rate or target")
    total = sum(counts)
    need = total * SCHEDULE_BYTES_PER_SAMPLE
    memory = _memory_bytes()
    if memory is not None and need > memory:
        top = counts.index(max(counts))
        raise ConfigError(f"the mixture asks for {_amount(total)} samples, the most from {source(top)}; listing them "
                          f"takes {SCHEDULE_BYTES_PER_SAMPLE} bytes a sample, {_amount(Decimal(need) / 2**30, 1)} GiB, "
                          f"more than this machine's {_amount(Decimal(memory) / 2**30, 1)} GiB of memory: lower the "
                          "rates or targets")


def least_rate(n: int) -> Fraction:
    """The smallest rate at which a source of ``n`` samples gives one: ``floor(r * n + 1/2) >= 1``.

    Example:
        >>> least_rate(40), requested_count(40, rate=least_rate(40)), requested_count(40, rate=Fraction("0.001"))
        (Fraction(1, 80), 1, 0)
    """
    return Fraction(1, 2 * n)


def least_rate_text(n: int) -> str:
    """:func:`least_rate` as a rate to give: exact, and as a decimal rounded up where that is shorter.

    Example:
        >>> least_rate_text(40), least_rate_text(30)
        ('0.0125', '1/60 (0.0167)')
    """
    exact = rate_text(least_rate(n))
    if "/" not in exact:
        return exact
    # rounded up, so the decimal given also selects a sample
    up = Context(prec=3, rounding=ROUND_CEILING).divide(Decimal(1), Decimal(2 * n))
    return f"{exact} ({format(up.normalize(), 'f')})"


def _check_selects_some(mixture: Mixture, available: list[int], requested: list[int]) -> None:
    """Refuse a mixture whose sources hold samples but whose rates all round to none of them: it
    would write a run of no packs and exit 0. (A source that rounds to none beside others that do
    not is a warning of the summary, ``stats.mixture_summary``.)

    Raises:
        ConfigError: naming each source, what its rate gives, and the least rate that gives a sample.
    """
    if any(count for n, count in zip(available, requested, strict=True) if n) or not any(available):
        return
    parts = [f"source {i + 1} ({s.label!r}): {n:,} sample{'s' if n != 1 else ''} at rate {_shown(s.rate)} give 0, "
             f"a rate of at least {least_rate_text(n)} gives one"
             for i, (s, n) in enumerate(zip(mixture.sources, available, strict=True)) if n]
    raise ConfigError(f"the mixture selects no sample, every rate rounds to 0 samples ({'; '.join(parts)}); raise "
                      "the rates or give \"samples\" targets")


#: The ids a copy's name could clash with: those ending ``#c<n>``, or ``#c<n>#d<k>`` (the name
#: :func:`copy_name` gives a copy whose ``#c<n>`` name was taken). An RE2 pattern, as Arrow's
#: ``match_substring_regex`` takes it.
COPY_LIKE = r"#c[0-9]+(#d[0-9]+)?$"


def copy_name(sample_id: str, copy: int, taken: AbstractSet[str] = frozenset()) -> str:
    """The name of copy ``copy`` of sample ``sample_id``: the id itself for copy 0, else
    ``ID#cN``; when a sample of the same source bears that name itself (``taken``: the source's
    ids that match :data:`COPY_LIKE`), the first of ``ID#cN#d1``, ``ID#cN#d2``, ... none bears.

    Names stay apart: ``ID#cN`` splits back into one ``(ID, N)`` at its last ``#c``, a ``#dK``
    name ends unlike any ``#cN`` name, and neither is ever a name in ``taken``.

    Example:
        >>> copy_name("x", 0), copy_name("x", 2), copy_name("x", 1, {"x#c1"}), copy_name("x", 1, {"x#c1", "x#c1#d1"})
        ('x', 'x#c2', 'x#c1#d1', 'x#c1#d2')
    """
    if copy == 0:
        return sample_id
    name = f"{sample_id}#c{copy}"
    if name not in taken:
        return name
    k = 1
    while f"{name}#d{k}" in taken:
        k += 1
    return f"{name}#d{k}"


def copy_suffixes(copies: np.ndarray) -> list[str]:
    """The id suffix of each copy number: ``""`` for copy 0, ``"#c1"``, ``"#c2"``, ... after.

    Example:
        >>> copy_suffixes(np.array([0, 2, 1]))
        ['', '#c2', '#c1']
    """
    return ["" if c == 0 else f"#c{c}" for c in np.asarray(copies).tolist()]
