"""The two stages as library calls: ``tokenize_dataset`` and ``pack_dataset``.

Each is a pure function of (input files, config): the same inputs and config give the
same shard bytes, whatever the number of workers, machines or ranks. Both stages are
cut into **tasks** (DESIGN.md §6), each one input slice → its own shards + errors +
completion marker, run by an executor (``executors.py``)::

    tokenize: sorted inputs ─cut every rows_per_shard lines─▶ task t ─▶ part-ttttt-kkkkk.parquet
    pack:     tokenized shard t ─────────────────────────────▶ task t ─▶ part-ttttt-kkkkk.parquet
                                                          each task ─▶ .packtool/task-ttttt.json
    all tasks marked ─▶ .packtool/errors.jsonl (task order) ─▶ .packtool/manifest.json (last)

Task boundaries depend only on the inputs and ``rows_per_shard``, so a re-run after a
crash skips the finished tasks and writes the same bytes as an uninterrupted run.
Memory is bounded by a task's working set (a batch of records while tokenizing, a
chunk of packs and the row groups it draws from while packing), never by the corpus.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import math
import os
import re
import shutil
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .config import PackConfig, TokenizeConfig, config_digest, digest_of, whole_number
from .errors import (
    ConfigError,
    InputError,
    OutputError,
    OversizeSampleError,
    PacktoolError,
    SampleError,
    TooManyErrorsError,
)
from .executors import (
    ExecutorConfig,
    attempt_may_repeat,
    default_workers,
    run_tasks,
    set_total,
    start_pool,
    worker_place,
)
from .formats import (
    UTF8_BOM,
    Rejected,
    expand_inputs,
    head_problem,
    is_jsonl_content,
    is_jsonl_name,
    is_parquet_name,
    opens_alone,
    parse_json_line,
    parse_record,
)
from .formats.common import file_id_names
from .mixture import Mixture
from .publication import (
    output_dir,
    publish_task,
    state_prepared,
    stored_plan,
    task_dir,
    task_target,
    tasks_ran,
)
from .shards import (
    ERRORS,
    LEGACY_ERRORS,
    LEGACY_MANIFEST,
    PLAN,
    RUN_STATE,
    STATE_DIR,
    ShardWriter,
    clear_task,
    clear_tasks,
    finished_as_is,
    manifest_path,
    open_shard,
    prepare_run,
    read_manifest,
    read_marker,
    read_run,
    sha256_file,
    shard_error,
    sweep_stale_tmps,
    task_errors_path,
    task_prefix,
    temporary,
    tmp_path,
    write_manifest,
)
from .storage import (
    as_root,
    check_listed,
    fetch_inputs,
    fetch_listed,
    fetch_manifest,
    fetch_shard,
    input_copy,
    input_stat,
    is_listed,
    is_url,
    join,
    place,
    source_name,
)

__all__ = ["tokenize_dataset", "pack_dataset", "merge_output", "lower_bound", "plan_tokenize_tasks", "Slice",
           "ON_ERROR"]

log = logging.getLogger(__name__)

Progress = Callable[[int], None] | None
#: Records encoded together (one tokenizer batch call).
BATCH = 512
#: Packs assembled together; bounds the rows a pack task holds at once.
PACK_CHUNK = 128
#: Rows per row group of packed shards (one chunk of packs when PACK_CHUNK is the same).
PACKED_GROUP_ROWS = 128
#: Files that cannot be cut (compressed inputs, JSON arrays whose frame does not scan) share one tokenize task up
#: to this size.
WHOLE_FILES_PER_TASK_BYTES = 32 << 20
#: ``pack_index = task * PACK_INDEX_STRIDE + k`` for the ``k``-th pack of pack task ``task``: unique,
#: rising in manifest order, and known to a task without asking any other (ranks never wait).
PACK_INDEX_STRIDE = 1_000_000_000
#: ``--on-error`` choices: ``skip`` records a bad row and goes on; ``fail`` stops at the first.
ON_ERROR = ("skip", "fail")


def _environment_errors(fn):
    """Turn what the machine refuses (disk full, no permission, a read-only file system) into
    one ``PacktoolError`` naming the path and the fix, for a stage function with an ``out_dir``.

    Only ``OSError`` with an ``errno`` is translated: those come from the environment, not from
    the data (a damaged input is a row error or an ``InputError`` already) nor from a bug.
    Tasks that finished keep their markers, so the same command resumes once the cause is fixed.
    """
    import functools
    import inspect

    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except OSError as exc:
            if exc.errno is None:
                raise
            out = sig.bind_partial(*args, **kwargs).arguments.get("out_dir")
            raise environment_error(exc, Path(out) if out is not None else None) from exc

    return wrapper


def environment_error(exc: OSError, out: Path | None) -> PacktoolError:
    """The ``Error:`` for an ``OSError`` the environment raised while a stage wrote into ``out``.

    Example:
        ``OSError(ENOSPC)`` while writing ``tok`` gives ``OutputError("no space left writing to
        'tok' (No space left on device); free space on its disk or choose another -o, then run the
        same command again: finished tasks are kept")``.
    """
    import errno

    why = exc.strerror or os.strerror(exc.errno or 0)
    path = exc.filename if isinstance(exc.filename, str) else None
    # the output, something in it, or a folder above it that mkdir had to create
    under_out = out is not None and (path is None or Path(os.path.abspath(path)).is_relative_to(os.path.abspath(out))
                                     or Path(os.path.abspath(out)).is_relative_to(os.path.abspath(path)))
    resume = "then run the same command again: finished tasks are kept"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return OutputError(f"no space left writing to {str(path or out)!r} ({why}); free space on its disk or "
                           f"choose another -o, {resume}")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        if under_out or exc.errno == errno.EROFS:
            return OutputError(f"cannot write to {str(path or out)!r} ({why}); choose a writable -o, or fix its "
                               f"permissions and {resume}")
        return InputError(f"cannot read {str(path)!r} ({why}); make it readable or leave it out of the inputs")
    return PacktoolError(f"{why} ({str(path or out)!r}); fix the cause and {resume}")


def _batched(it: Iterable, n: int) -> Iterator[list]:
    batch: list = []
    for x in it:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def _executor(ex: ExecutorConfig | None, workers, executor, ray_address, rank, world_size) -> ExecutorConfig:
    if ex is not None:
        return ex
    return ExecutorConfig(executor=executor, workers=workers, ray_address=ray_address, rank=rank, world_size=world_size)


def _check_on_error(on_error: str) -> None:
    if on_error not in ON_ERROR:
        raise ConfigError(f"--on-error {on_error!r}: choose skip or fail")


def _check_call(cfg: object, kind: type, max_errors: object = None) -> int | None:
    """Refuse a stage's config of another class (a ``TokenizeConfig`` given to pack, a dict, a
    number) and a ``max_errors`` that is not a count, before anything is read or written;
    return ``max_errors`` as a plain ``int`` (it is stored in the run's JSON state)."""
    if not isinstance(cfg, kind):
        raise ConfigError(f"cfg must be a packtool.{kind.__name__}, got {type(cfg).__name__} ({cfg!r:.60}); "
                          f"build one with packtool.{kind.__name__}(...)")
    if max_errors is None:
        return None
    try:
        count = whole_number(max_errors)
    except TypeError:
        count = -1
    if count < 0:
        raise ConfigError(f"--max-errors {max_errors!r}: choose an integer of 0 or more (None: no limit)")
    return count


class _TaskErrors:
    """One task's rejected rows, written to a temporary file and renamed into place with the task.

    ``bytes`` is the file's size, which the task's completion marker records (``errors_bytes``):
    ``errors.jsonl`` is made of these logs, so a log lost or cut since makes the marker void
    (:func:`~packtool.shards.read_marker`, a ``stat``) and the task is redone."""

    def __init__(self, out_dir: Path, task: int, max_errors: int | None, on_error: str) -> None:
        self.final = task_errors_path(out_dir, task)
        self.tmp = tmp_path(self.final)
        self.fh = open(self.tmp, "wb")
        self.by_reason: Counter[str] = Counter()
        self.bytes = 0
        self.max_errors = max_errors
        self.on_error = on_error

    def add(self, rej: Rejected, over: str | None = None) -> None:
        """Record ``rej``; ``over``: for an ``oversize`` row, the capacity flag(s) it passes, which
        a run stopped by ``--on-error fail`` names as the fix."""
        if " at 0x" in rej.message:  # a library's repr of an object: its address differs run to run
            rej = Rejected(rej.source, rej.source_row, rej.sample_id, rej.reason, _ADDRESS.sub("", rej.message))
        # a lone surrogate a rejected row held (in its id, say) is written as its JSON escape
        # ("\\udc80"), so errors.jsonl stays UTF-8 and reads back as the same string
        line = (json.dumps(rej.to_json(), ensure_ascii=False) + "\n").encode("utf-8", "backslashreplace")
        self.fh.write(line)
        self.bytes += len(line)
        self.by_reason[rej.reason] += 1
        where = f"{rej.source}:{rej.source_row}" + (f" (sample {rej.sample_id!r})" if rej.sample_id else "")
        if self.on_error == "fail":
            raise TooManyErrorsError(f"{where} rejected, {rej.reason}: {rej.message}; --on-error fail stops the run at the "
                                     f"first rejected row a task meets ({_on_error_fix({rej.reason}, over)})")
        if self.max_errors is not None and self.total > self.max_errors:
            raise TooManyErrorsError(_too_many(self.total, self.max_errors, f"latest: {where} {rej.reason}: {rej.message}",
                                               self.by_reason))

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())

    def commit(self) -> None:
        self.fh.close()
        os.replace(self.tmp, self.final)

    def abort(self) -> None:
        self.fh.close()
        self.tmp.unlink(missing_ok=True)


#: `` at 0x7f...`` in an object's repr, dropped from messages so errors.jsonl is the same bytes on every run.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _too_many(total: int, limit: int, detail: str, reasons: Iterable[str]) -> str:
    """Why ``--max-errors`` stops a run; ``reasons``: the reason codes of the rejected rows."""
    return f"{total:,} input row{'' if total == 1 else 's'} rejected, more than --max-errors {limit:,} ({detail}); {_max_errors_fix(reasons)}"


def _max_errors_fix(reasons: Iterable[str]) -> str:
    """The way out of ``--max-errors``: a sample pack dropped as oversize is not a fault of the
    input but of the pack's capacities or the ``--oversize`` policy.

    Example:
        >>> _max_errors_fix({"missing_media": 2})
        'fix the input or raise --max-errors'
        >>> _max_errors_fix({"oversize": 3})
        'the samples do not fit a pack: raise --max-tokens or --max-vision-units, keep them with --oversize alone or truncate (text-only), or raise --max-errors'
    """
    reasons = set(reasons)
    if "oversize" not in reasons:
        return "fix the input or raise --max-errors"
    sizes = "raise --max-tokens or --max-vision-units, keep them with --oversize alone or truncate (text-only)"
    if reasons == {"oversize"}:
        return f"the samples do not fit a pack: {sizes}, or raise --max-errors"
    return f"fix the input (samples that do not fit a pack: {sizes}) or raise --max-errors"


def _on_error_fix(reasons: Iterable[str], over: str | None = None, again: str = "") -> str:
    """The way out of ``--on-error fail``: a sample pack rejects as oversize is no fault of the
    input but of the pack's capacities (``over``: the flag(s) the sample passes, when known);
    ``again``: what follows the fix before the run can pass (`` and start over with --overwrite``).

    Example:
        >>> _on_error_fix({"missing_media"})
        'fix the input, or use --on-error skip'
        >>> _on_error_fix({"oversize"}, "--max-tokens")
        'raise --max-tokens, keep such samples with --oversize alone or truncate (text-only), or use --on-error skip'
        >>> _on_error_fix({"oversize"}, "--max-vision-units")
        'raise --max-vision-units, keep such samples with --oversize alone, or use --on-error skip'
    """
    reasons = set(reasons)
    if "oversize" not in reasons:
        return f"fix the input{again}, or use --on-error skip"
    over = over or "--max-tokens or --max-vision-units"
    # truncation cuts text only: it cannot bring a sample's vision units under the capacity
    keep = "alone" if "--max-vision-units" in over and " or " not in over else "alone or truncate (text-only)"
    sizes = f"raise {over}, keep such samples with --oversize {keep}"
    if reasons == {"oversize"}:
        return f"{sizes}{again}, or use --on-error skip"
    return f"fix the input (samples that do not fit a pack: {sizes}){again}, or use --on-error skip"


def _oversize(tokens: int, units: int, max_tokens: int, max_units: int) -> tuple[str, str]:
    """The ``errors.jsonl`` message of a sample that fits no pack, and the capacity flag(s) it passes.

    Example:
        >>> _oversize(5000, 10, 4096, 64)
        ('needs 5,000 tokens and 10 vision units; a pack holds 4,096 and 64', '--max-tokens')
    """
    flags = [f for f, over in (("--max-tokens", tokens > max_tokens), ("--max-vision-units", units > max_units)) if over]
    return (f"needs {tokens:,} tokens and {units:,} vision units; a pack holds {max_tokens:,} and {max_units:,}",
            " and ".join(flags) or "--max-tokens or --max-vision-units")


def _why_rejected(i: int, bad: dict, tokens, units, max_tokens: int, max_units: int) -> tuple[str, str, str | None]:
    """Reason, message and (for an oversize sample) the capacity flag of rejected sample ``i``:
    its entry in ``bad`` (media no longer the ones counted), else :func:`_oversize`."""
    if i in bad:
        return (*bad[i], None)
    return ("oversize", *_oversize(int(tokens[i]), int(units[i]), max_tokens, max_units))


def _none_allowed(total: int, detail: str, reasons: Iterable[str]) -> str:
    """Why ``--on-error fail`` stops a run whose tasks finished before rejected ``total`` rows
    (``reasons``: their reason codes)."""
    return (f"{total:,} input row{'' if total == 1 else 's'} rejected by tasks that finished before ({detail}); --on-error fail allows none: "
            + _on_error_fix(reasons, again=" and start over with --overwrite"))


def _planned(counts: dict, max_errors: int | None, on_error: str) -> None:
    """A dry run's counts held to the limits that would fail the run itself."""
    rejected = int(counts.get("rejected", 0))
    reasons = ", ".join(f"{k} {v:,}" for k, v in counts.get("rejected_by_reason", {}).items())
    if on_error == "fail" and rejected:
        raise TooManyErrorsError(f"{rejected:,} input row{'' if rejected == 1 else 's'} would be rejected ({reasons}); --on-error fail stops at the "
                                 f"first ({_on_error_fix(counts.get('rejected_by_reason', {}))})")
    if max_errors is not None and rejected > max_errors:
        raise TooManyErrorsError(f"{rejected:,} input row{'' if rejected == 1 else 's'} would be rejected, more than --max-errors {max_errors:,} "
                                 f"({reasons}); {_max_errors_fix(counts.get('rejected_by_reason', {}))}")


def _finished(manifest: dict, out_dir: str | Path, max_errors: int | None, on_error: str) -> dict:
    """The finished run found in ``out_dir``, returned as it is unless it rejected more rows than
    this call allows: the same call fails on an empty output, so a gate (``--max-errors``,
    ``--on-error fail``) must not pass because the run was there already."""
    rejected = int((manifest.get("counts") or {}).get("rejected", 0))
    where = f"see {join(str(out_dir), ERRORS)}"
    if on_error == "fail" and rejected:
        raise TooManyErrorsError(_none_allowed(rejected, where, manifest["counts"].get("rejected_by_reason", {})))
    if max_errors is not None and rejected > max_errors:
        raise TooManyErrorsError(_too_many(rejected, max_errors, where, manifest["counts"].get("rejected_by_reason", {})))
    return manifest


def _zero_counts(kind: str) -> dict:
    """The counts every manifest of ``kind`` holds, at zero (a run may have no tasks at all)."""
    if kind == "packed":
        keys = ("samples_in", "samples_packed", "packs", "dropped", "alone", "truncated", "tokens", "vision_units",
                "alone_tokens", "alone_vision_units", "rejected", "rejected_by_reason")
    else:
        keys = ("rows_in", "samples", "rejected", "rejected_by_reason", "tokens", "vision_units", "branches",
                "folded_branches", "split_extra_trees", "merged_records")
    return {k: {} if k == "rejected_by_reason" else 0 for k in keys}


def _add_counts(total: dict, part: dict) -> None:
    for k, v in part.items():
        if isinstance(v, dict):
            sub = total.setdefault(k, {})
            for kk, vv in v.items():
                sub[kk] = sub.get(kk, 0) + vv
        else:
            total[k] = total.get(k, 0) + v


#: The forkserver preloads of the stages' process pools (``executors.run_tasks``'s ``preload``).
_PACKING = "packtool.preload.packing"
_TOKENIZATION = "packtool.preload.tokenization"


class _Driver:
    """Runs the missing tasks of one rank, stops the run when ``--max-errors`` is passed,
    and cleans up after a failure so that nothing half-written stays visible."""

    def __init__(self, out: Path, config_digest: str, n_tasks: int, ex: ExecutorConfig, max_errors: int | None,
                 on_error: str, shown: str | Path) -> None:
        self.out = out
        self.shown = str(shown)
        # the task logs, named under the output directory as the user gave it
        self.where = f"see {join(str(shown), STATE_DIR, 'errors-*.jsonl')}"
        self.digest = config_digest
        self.n_tasks = n_tasks
        self.ex = ex
        self.max_errors = max_errors
        self.on_error = on_error
        self.rejected = 0
        self.by_reason: Counter[str] = Counter()

    def pending(self) -> tuple[list[int], list[dict]]:
        todo, done = [], []
        for t in self.ex.my_tasks(self.n_tasks):
            marker = read_marker(self.out, t, self.digest)
            if marker is None:
                todo.append(t)
            else:
                done.append(marker)
        return todo, done

    def check(self, record: dict) -> None:
        rejected = int(record["counts"].get("rejected", 0))
        self.rejected += rejected
        self.by_reason.update(record["counts"].get("rejected_by_reason", {}))
        # a task of this call stops at its first rejected row under --on-error fail, so rows come
        # only from tasks an earlier attempt (with --on-error skip) finished
        if rejected and self.on_error == "fail":
            raise TooManyErrorsError(_none_allowed(self.rejected, self.where, self.by_reason))
        if self.max_errors is not None and self.rejected > self.max_errors:
            raise TooManyErrorsError(_too_many(self.rejected, self.max_errors, self.where, self.by_reason))

    def run(self, fn, tasks: list, todo: list[int], progress, preload: str) -> None:
        for done in self.pending()[1]:
            self.check(done)
        clear_tasks(self.out, todo)  # what earlier attempts left: one listing, not one a task
        try:
            run_tasks(fn, tasks, self.ex, progress, on_result=self.check, preload=preload)
        except BaseException as exc:
            clear_tasks(self.out, [t for t in todo if read_marker(self.out, t, self.digest) is None])
            if isinstance(exc, ConfigError | OversizeSampleError):
                self._forget_if_nothing_done()
            raise

    def _forget_if_nothing_done(self) -> None:
        """A setting that cannot work with this data (a table too large for the exact packer, a
        template the vocabulary lacks, ``--oversize fail``) stops the run at its first task,
        and would stop the same command every time: where no task of the run is done, its state
        goes too, so the folder is not left looking like a run to resume (``stats`` and
        ``merge`` would say "run the command again"). Only a local run of one rank: another rank
        may still be working on a shared one, and a bucket's state is the ranks' lease."""
        if self.ex.world_size != 1 or is_url(self.shown):
            return
        if any(read_marker(self.out, t, self.digest) is not None for t in range(self.n_tasks)):
            return
        for name in (PLAN, RUN_STATE):
            (self.out / STATE_DIR / name).unlink(missing_ok=True)


def _finish_or_partial(out: Path, run: dict, ex: ExecutorConfig) -> dict:
    """Write the manifest when every task is marked; else report this rank's share."""
    missing = [t for t in range(run["n_tasks"]) if read_marker(out, t, run["config_digest"]) is None]
    if not missing:
        return merge_output(out)
    mine = ex.my_tasks(run["n_tasks"])
    lost = [t for t in mine if t in set(missing)]
    if lost:
        # every task of this rank finished in this call or an earlier one, yet its marker, a
        # shard it names or its error log is gone: removed from the output while the run wrote it
        raise OutputError(
            f"{task_target(out)!r}: the files of {len(lost)} of the {len(mine)} tasks this run finished are gone or "
            f"changed since (first: {lost[:5]}): something removed files from the output while the run wrote it; "
            "run the same command again (it redoes those tasks)"
        )
    counts = _zero_counts(run["kind"])
    shards: list[dict] = []
    for t in mine:
        marker = read_marker(out, t, run["config_digest"])
        if marker is None:
            raise RuntimeError(f"internal error: task {t} of rank {ex.rank} has no completion marker")
        _add_counts(counts, marker["counts"])
        shards.extend(marker["shards"])
    extra = {}
    if run["kind"] == "packed":  # as a full run reports them: the bound of this rank's samples
        caps = extra["capacities"] = run["manifest"]["capacities"]
        counts["lower_bound"] = _pack_bound(counts, caps["max_tokens"], caps["max_vision_units"])
    log.info("rank %d of %d finished %d tasks; %d tasks of other ranks remain", ex.rank, ex.world_size, len(mine), len(missing))
    return {"kind": run["kind"], "partial": True, "rank": ex.rank, "world_size": ex.world_size,
            "tasks": len(mine), "tasks_missing": len(missing), "counts": counts, "shards": shards, **extra}


def _rank_ranges(ranks: list[int]) -> str:
    """Sorted ``ranks`` as a person (or a Slurm ``--array``) reads them: a run of three or more
    consecutive ranks as ``first-last``. Every rank is named: a rank left out of the list would be
    found missing only at the next merge.

    Example:
        >>> _rank_ranges([1, 2, 3, 4, 6, 8, 9, 11, 12, 13])
        '1-4, 6, 8, 9, 11-13'
    """
    parts: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts += [f"{ranks[i]}-{ranks[j]}"] if j - i >= 2 else [str(r) for r in ranks[i:j + 1]]
        i = j + 1
    return ", ".join(parts)


@_environment_errors
def merge_output(out_dir: str | Path, report: dict | None = None) -> dict:
    """Combine the completion markers of every task into ``.packtool/errors.jsonl`` and ``.packtool/manifest.json``.

    ``tokenize`` and ``pack`` call this themselves when their last task finishes; after a
    Slurm or Kubernetes array (``--rank/--world-size``), run ``packtool merge DIR`` once
    every rank is done. Idempotent: merging a finished directory rewrites the same bytes. A
    merged run needs no task files: one whose shards and ``errors.jsonl`` are as its manifest
    lists them is returned as it is (a warning says so) when task markers or logs are gone.

    ``report``, when given, gains ``written``: whether this merge wrote ``errors.jsonl`` or the
    manifest (``False``: the run was merged already, as ``packtool merge`` then says).

    Raises:
        InputError: when a task has no completion marker (names the ranks to re-run: each
            command named is one that redoes the task, never one that would find the run whole).
    """
    report = {} if report is None else report
    if is_url(str(out_dir)):
        with output_dir(str(out_dir), None) as mirror:
            return _merge(mirror, str(out_dir), report)
    return _merge(Path(out_dir), str(out_dir), report)


def _manifest_of(path: Path, kind: str, digest: str) -> bool:
    """Whether ``path`` is the manifest of a finished run of ``kind`` and config ``digest``."""
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("kind") == kind and manifest.get("config_digest") == digest


def _merge_without(out: Path, shown: str, run: dict, missing: list[int], report: dict) -> dict:
    """:func:`_merge` of a run whose tasks ``missing`` left no usable completion marker (the
    marker, a shard it names, or its error log is gone or changed): the manifest when the run is
    merged already and needs nothing of theirs, else an :class:`InputError` naming a command that
    redoes those tasks. Each command named is one that changes the state: a rank's command that
    would find the run whole redoes nothing, so merge never sends a user there."""
    from .publication import remove_state
    from .validate import errors_file_whole

    ws = run.get("world_size", 1)
    ranks = sorted({t % ws for t in missing})
    which = (f"rank{'s' if len(ranks) > 1 else ''} {_rank_ranges(ranks)} of --world-size {ws}" if ws > 1
             else "the command that wrote it")
    n = f"{len(missing)} of {run['n_tasks']} tasks"
    are = "is" if len(missing) == 1 else "are"
    first = f"(first: {missing[:5]})"
    finished = finished_as_is(out, run)
    if finished is not None:
        # the rank's command finds every listed file with its size and would redo nothing. Its
        # shards are whole, and errors.jsonl is what merge would write from the task logs: done
        if errors_file_whole(out, finished):
            log.warning("%s: the run is merged already, and its shards and %s are as its manifest lists them: "
                        "nothing to do (the completion markers or error logs of %s are gone or changed since; the "
                        "merged run needs none of them, and a later repair redoes those tasks)", shown, ERRORS,
                        f"{n} {first}")
            report["written"] = False
            return finished
        # errors.jsonl changed at its size, and its task logs are incomplete: removed, the rank's
        # command finds it missing and repairs it (redoing the tasks whose logs are gone)
        remove_state(out, ERRORS)
        raise InputError(
            f"{shown!r}: the run had finished, but its {ERRORS} is not the one its manifest lists, and the files of "
            f"{n} it is written from are gone or changed since {first}; removed it: run {which} again (it redoes "
            "those tasks and writes it)"
        )
    if _manifest_of(manifest_path(out), run["kind"], run["config_digest"]):
        # files lost after the run finished, which the rank's command finds (a shard or errors.jsonl
        # missing or of another size) and repairs, redoing its own tasks (prepare_run)
        raise InputError(
            f"{shown!r}: the run had finished, but the files of {n} are gone or changed since {first}; run {which} "
            "again (it redoes those tasks and merges)"
        )
    if ws == 1:
        raise InputError(f"{shown!r}: {n} {are} not finished {first}; run the command that wrote it again (it "
                         "resumes the run and merges)")
    raise InputError(f"{shown!r}: {n} {are} not finished {first}; run {which} (the same command resumes) and merge "
                     "again")


def _same_file(path: Path, size: int, sha256: str) -> bool:
    """Whether ``path`` is a file of ``size`` bytes with this sha256 (hashed only at that size)."""
    try:
        if path.stat().st_size != size:
            return False
    except OSError:
        return False
    return sha256_file(path) == sha256


def _merge(out: Path, shown: str, report: dict) -> dict:
    """:func:`merge_output` on the folder holding the run's state; messages name it ``shown``."""
    run = read_run(out, shown)
    digest = run["config_digest"]
    markers = [read_marker(out, t, digest) for t in range(run["n_tasks"])]
    missing = [t for t, m in enumerate(markers) if m is None]
    if missing:
        return _merge_without(out, shown, run, missing, report)
    counts = _zero_counts(run["kind"])
    shards: list[dict] = []
    final = out / ERRORS
    logs = [task_errors_path(out, t) for t in range(len(markers))]
    digest_errors = hashlib.sha256()
    n_error_bytes = 0
    for marker, err in zip(markers, logs, strict=True):
        _add_counts(counts, marker["counts"])
        shards.extend(marker["shards"])
        if err.is_file():
            with open(err, "rb") as src:
                while block := src.read(1 << 20):
                    digest_errors.update(block)
                    n_error_bytes += len(block)
    limit = run.get("max_errors")
    if limit is not None and counts.get("rejected", 0) > limit:
        # ranks each see only their own rejections; the limit holds for the whole run here. It is
        # the ranks' (run.json): `packtool merge` has no --max-errors, a rank's command raises it
        where = f"see {join(shown, STATE_DIR, 'errors-*.jsonl')}"
        raise TooManyErrorsError(_too_many(counts["rejected"], limit, where, counts.get("rejected_by_reason", {}))
                                 + ": merge holds the run to the limit its ranks were given, so re-run one rank's "
                                 "command with a higher --max-errors (it merges the run)")
    report["written"] = False
    if not _same_file(final, n_error_bytes, digest_errors.hexdigest()):  # a merged run is left as it is: no write
        report["written"] = True
        final.parent.mkdir(parents=True, exist_ok=True)
        with temporary(final) as tmp:  # removed if the disk fills meanwhile
            with open(tmp, "wb") as fh:
                for err in logs:
                    if err.is_file():
                        with open(err, "rb") as src:
                            shutil.copyfileobj(src, fh, 1 << 20)
                if fh.tell() != n_error_bytes:
                    raise InputError(f"{shown!r}: a task's error log changed while merge read it; run merge again")
            os.replace(tmp, final)
    for legacy in (LEGACY_ERRORS, LEGACY_MANIFEST):  # a legacy-layout run merged again: one manifest only
        (out / legacy).unlink(missing_ok=True)
    if "rejected_by_reason" in counts:
        counts["rejected_by_reason"] = dict(sorted(counts["rejected_by_reason"].items()))
    if run["kind"] == "tokenized" and any("folded_branches" not in m["counts"] for m in markers):
        # a task an older packtool finished (a run resumed after an upgrade) counted the folded
        # conversations in its branches: the manifest must not claim branches is n_branches' sum
        counts.pop("folded_branches", None)
    extra = dict(run.get("manifest", {}))
    if "mixture" in extra:
        extra["mixture"] = _mixture_record(extra["mixture"], counts)
    if run["kind"] == "packed":
        caps = extra["capacities"]
        counts["lower_bound"] = _pack_bound(counts, caps["max_tokens"], caps["max_vision_units"])
    counts["tasks"] = run["n_tasks"]
    # its size is what a re-run checks (a stat) to find it lost or cut, and repair it from the task logs
    errors_file = {"path": ERRORS, "bytes": n_error_bytes, "sha256": digest_errors.hexdigest()}
    manifest = write_manifest(out, run["kind"], run["config"], digest, shards, report=report, **extra, counts=counts,
                              errors_file=errors_file)
    sweep_stale_tmps(out)  # what writers killed during this run (or a straggler of an earlier one) left
    return manifest


# ============================================================================ tokenize


@dataclass(frozen=True, slots=True)
class Slice:
    """Lines (or Parquet rows) ``start..stop-1`` of one input file (``stop=None``: to its end).

    ``offset`` is the byte offset of line ``start`` in a plain JSONL file (of element ``start``
    in a plain JSON array file: :mod:`.formats.jsonarray`), so a task can seek straight to its
    slice; ``groups`` is the range of Parquet row groups holding rows ``start..stop-1``. Files
    that cannot be cut (compressed files, arrays whose frame does not scan) are one slice from
    line 0 with neither.
    """

    path: str
    start: int
    stop: int | None
    offset: int | None
    groups: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class _TokenizeTask:
    index: int
    slices: tuple[Slice, ...]
    out_dir: str
    cfg: TokenizeConfig
    config_digest: str
    max_errors: int | None
    on_error: str
    cwd: str = "."  # the driver's working directory, which relative paths are relative to
    #: (input name, id name) of the task's inputs whose file name another input shares: their
    #: records without an id are named ID_NAME:ROW (formats.common.file_id_names)
    id_names: tuple[tuple[str, str], ...] = ()
    #: the run this task belongs to (one token per call that starts tasks): a process that
    #: tokenized before probes the media again (``EncodeContext.start_run``); no output depends on it
    run: str = ""
    #: (input name, (size, mtime_ns)) of the task's inputs as the run found them when it started:
    #: a file changed since is refused (:func:`_check_unchanged`), never read as the same input
    stats: tuple[tuple[str, tuple[int, int]], ...] = ()


def _at(path: str, cwd: str) -> str:
    """``path`` as a task opens it: relative to the driver's working directory ``cwd``.

    A Ray worker on another node runs in its own node's directory; a task in the driver's
    directory (in-process, the local pool) opens the path unchanged, so messages that quote
    it read the same as before.
    """
    if is_url(path) or os.path.isabs(path) or os.path.abspath(cwd) == os.getcwd():
        return path
    return os.path.join(cwd, path)


#: A ``.json`` file (JSONL under that name, or an array) is looked into for cutting from this size
#: on; a smaller one is read whole, giving the same rows (it holds about 1,500 LLaVA records, far
#: from a task's 50,000), and costs the planner a ``stat``, not three reads (datasets of a JSON file
#: per sample have millions).
CUT_MIN_BYTES = 1 << 20


def _splittable(path: Path, size: int) -> bool:
    """Whether an input is JSONL to cut at lines: a plain ``.jsonl``/``.ndjson`` file that does not
    hold one JSON array, or a plain ``.json`` file of at least ``CUT_MIN_BYTES`` (its ``size``) the
    reader reads as JSONL."""
    if path.name.lower().endswith(".json"):
        return size >= CUT_MIN_BYTES and is_jsonl_content(path)
    if not is_jsonl_name(path.name, compressed=False):
        return False
    with open(path, "rb") as fh:
        head = fh.read(1 << 12)
    # compressed bytes under a plain name, UTF-16, an array, pretty-printed records: read whole (not cut at newline bytes)
    text = head.removeprefix(UTF8_BOM).lstrip()
    return head_problem(path.name, head) is None and not text.startswith(b"[") and not opens_alone(text)


def _array_cuts(path: Path, size: int, first: int, every: int) -> tuple[int, list[tuple[int, int]]] | None:
    """The element count and cuts (:func:`.formats.jsonarray.scan_file`) of an uncompressed
    input whose first byte (after a byte-order mark and whitespace) is ``[``; ``None`` for any
    other file, for one under ``CUT_MIN_BYTES`` and for an array whose frame is not sound (each is
    read whole, as before)."""
    if not (is_jsonl_name(path.name, compressed=False) or path.name.lower().endswith(".json")):
        return None  # compressed: read whole
    if size < CUT_MIN_BYTES:
        return None
    with open(path, "rb") as fh:
        if not _array_head(fh):
            return None
    from .formats import jsonarray

    return jsonarray.scan_file(path, first, every)


def _array_head(fh) -> bool:
    """Whether the open file's first byte, past a byte-order mark and whitespace, is ``[``."""
    return fh.read(1 << 12).removeprefix(UTF8_BOM).lstrip().startswith(b"[")  # as formats tells


def _is_whole(sl: Slice) -> bool:
    return sl.offset is None and sl.groups is None


def _parquet_groups(path: Path) -> list[int] | None:
    """Rows per row group of a Parquet input, or ``None`` when it is not one (or unreadable)."""
    if not is_parquet_name(path.name):
        return None
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except Exception:  # noqa: BLE001 - the format reader reports an unreadable file when the task runs
        return None
    return [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]


#: Byte ranges of a JSONL input that planning scans in parallel (threads: reading and numpy's
#: byte comparison release the GIL).
SCAN_RANGE_BYTES = 64 << 20
#: The scan keeps the offset of every this-many-th newline of a range, so finding a task's first
#: line afterwards reads at most this many lines again.
SCAN_MARK_EVERY = 256


@dataclass(frozen=True, slots=True)
class _Scan:
    """The newlines of one JSONL file, scanned range by range: each range's first byte, its
    newline count and the offsets of its newlines number ``m-1, 2m-1, ...`` (``m`` the mark
    stride, counted from the range's first newline)."""

    path: Path
    size: int
    ends_with_newline: bool
    starts: np.ndarray
    counts: np.ndarray
    marks: tuple[np.ndarray, ...]
    every: int


def _scan_range(path: Path, start: int, stop: int, every: int) -> tuple[int, np.ndarray]:
    """``(newlines, marks)`` of bytes ``[start, stop)`` of ``path`` (see :class:`_Scan`)."""
    count = 0
    marks = []
    with open(path, "rb") as fh:
        fh.seek(start)
        pos, left = start, stop - start
        while left > 0 and (chunk := fh.read(min(1 << 22, left))):
            nl = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10)
            # newline i of this chunk is newline count + i of the range: marked when (count + i + 1) % every == 0
            marks.append(nl[(-count - 1) % every::every] + pos)
            count += len(nl)
            pos += len(chunk)
            left -= len(chunk)
    return count, (np.concatenate(marks) if marks else np.zeros(0, np.int64))


def _scan_files(paths: list[Path], workers: int, range_bytes: int = SCAN_RANGE_BYTES,
                every: int = SCAN_MARK_EVERY) -> dict[Path, _Scan]:
    """Scan ``paths`` for newlines, all their byte ranges at once on ``workers`` threads."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = []
    sizes = {}
    for path in paths:
        sizes[path] = size = path.stat().st_size
        jobs += [(path, a, min(a + range_bytes, size)) for a in range(0, size, range_bytes)] or [(path, 0, 0)]
    if workers > 1 and len(jobs) > 1:
        with ThreadPoolExecutor(min(workers, len(jobs)), thread_name_prefix="packtool-plan") as pool:
            found = list(pool.map(lambda j: _scan_range(*j, every), jobs))
    else:
        found = [_scan_range(*j, every) for j in jobs]
    ranges: dict[Path, list] = {path: [] for path in paths}  # each path's ranges, in order (one pass, not one per path)
    for j, f in zip(jobs, found, strict=True):
        ranges[j[0]].append((j[1], *f))
    scans = {}
    for path in paths:
        mine = ranges[path]
        last = b"\n"
        if sizes[path]:
            with open(path, "rb") as fh:
                fh.seek(sizes[path] - 1)
                last = fh.read(1)
        scans[path] = _Scan(path, sizes[path], last == b"\n", np.array([m[0] for m in mine], np.int64),
                            np.array([m[1] for m in mine], np.int64), tuple(m[2] for m in mine), every)
    return scans


def _nth_newline(fh, pos: int, n: int) -> int:
    """Offset of the ``n``-th newline (1-based) at or after ``pos``."""
    fh.seek(pos)
    while chunk := fh.read(1 << 16):
        nl = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10)
        if len(nl) >= n:
            return pos + int(nl[n - 1])
        n -= len(nl)
        pos += len(chunk)
    raise RuntimeError("internal error: the file lost lines while it was planned")


def _cuts(scan: _Scan, first: int, every: int) -> tuple[int, list[tuple[int, int]]]:
    """Count the lines of a scanned file and find the byte offsets of lines ``first, first+every, ...``."""
    ends = np.cumsum(scan.counts)
    n_newlines = int(ends[-1]) if len(ends) else 0
    n_lines = n_newlines + (1 if scan.size and not scan.ends_with_newline else 0)
    cuts: list[tuple[int, int]] = []
    target = first
    if target < 1 or target >= n_lines:
        return n_lines, cuts
    m = scan.every
    with open(scan.path, "rb") as fh:
        # line t starts one byte after newline number t-1 (0-based, counted through the file)
        while target - 1 < n_newlines and target < n_lines:
            k = target - 1
            r = int(np.searchsorted(ends, k, side="right"))
            local = k - (int(ends[r - 1]) if r else 0)
            j = (local + 1) // m - 1  # the last mark at or before newline `local` of range r
            if j >= 0 and (j + 1) * m - 1 == local:
                at = int(scan.marks[r][j])
            elif j >= 0:
                at = _nth_newline(fh, int(scan.marks[r][j]) + 1, local - ((j + 1) * m - 1))
            else:
                at = _nth_newline(fh, int(scan.starts[r]), local + 1)
            cuts.append((target, at + 1))
            target += every
    return n_lines, cuts


def _line_offsets(path: Path, first: int, every: int) -> tuple[int, list[tuple[int, int]]]:
    """Count the lines of ``path`` and find the byte offsets of lines ``first, first+every, ...``.

    Example: a file ``b"a\\nb\\nc\\n"`` with ``first=1, every=1`` gives ``(3, [(1, 2), (2, 4)])``.
    """
    return _cuts(_scan_files([path], 1)[path], first, every)


def plan_tokenize_tasks(files: list[Path], rows_per_task: int,
                        workers: int = 1) -> tuple[list[tuple[Slice, ...]], int | None]:
    """Cut sorted input files into tasks of at most ``rows_per_task`` lines each.

    Consecutive JSONL files share a task until it is full and a large JSONL file is cut
    into several tasks, so every task (and its tokenized shard) holds about
    ``rows_per_task`` rows whatever the file sizes; a plain JSON array file is cut at element
    boundaries the same way (one sequential scan of its bytes). Files that cannot be cut (small
    JSON arrays, compressed files) are read whole, up to ``WHOLE_FILES_PER_TASK_BYTES`` of them
    a task, in the same tasks as the rows around them: a folder whose small ``.json`` and
    ``.jsonl`` files alternate is not one task (and one shard, packed alone) a file. Returns the
    tasks and the total line count (``None`` when unknown).

    The JSONL files are scanned first, cut into byte ranges of ``SCAN_RANGE_BYTES`` read on
    ``workers`` threads (one pass over the bytes, whatever the number of workers); finding each
    task's first line then re-reads at most ``SCAN_MARK_EVERY`` lines per task.

    Example:
        files of 3, 5 and 1 lines with ``rows_per_task=4`` give tasks
        ``[(f0 0..3, f1 0..1), (f1 1..5), (f2 0..1)]``.
    """
    groups_of = {path: _parquet_groups(path) for path in dict.fromkeys(files)}
    size_of = {path: path.stat().st_size for path in groups_of}  # one stat a file, whatever asks
    scans = _scan_files([p for p, g in groups_of.items() if g is None and _splittable(p, size_of[p])], workers)
    tasks: list[tuple[Slice, ...]] = []
    current: list[Slice] = []
    fill = whole_bytes = 0
    total: int | None = 0
    for path in files:
        groups = groups_of[path]
        # a JSON array is cut at element boundaries, as JSONL is at lines
        array = (None if groups is not None or path in scans
                 else _array_cuts(path, size_of[path], rows_per_task - fill, rows_per_task))
        if groups is not None:
            # Parquet is cut at row-group boundaries: a task takes whole groups while they fit
            row = 0
            for g, n in enumerate(groups):
                if current and fill + n > rows_per_task:
                    tasks.append(tuple(current))
                    current, fill, whole_bytes = [], 0, 0
                if current and current[-1].path == str(path) and current[-1].groups and current[-1].groups[1] == g:
                    last = current.pop()  # the next group of the same file: widen the slice
                    current.append(Slice(last.path, last.start, row + n, None, (last.groups[0], g + 1)))
                elif n:
                    current.append(Slice(str(path), row, row + n, None, (g, g + 1)))
                row += n
                fill += n
                if fill >= rows_per_task:
                    tasks.append(tuple(current))
                    current, fill, whole_bytes = [], 0, 0
            if total is not None:
                total += row
            continue
        if array is not None:
            n_lines, starts = array
            if not n_lines:
                continue
        elif path not in scans:
            # whole files (compressed inputs, JSON arrays that do not scan) of unknown row count join
            # the task being filled while their bytes add up to less than WHOLE_FILES_PER_TASK_BYTES
            # (a task holds at most that besides its rows_per_task counted rows)
            size = size_of[path]
            if current and whole_bytes + size > WHOLE_FILES_PER_TASK_BYTES:
                tasks.append(tuple(current))
                current, fill, whole_bytes = [], 0, 0
            current.append(Slice(str(path), 0, None, None))
            whole_bytes += size
            total = None
            continue
        else:
            n_lines, cuts = _cuts(scans[path], rows_per_task - fill, rows_per_task)
            starts = [(0, 0), *cuts]
        if total is not None:
            total += n_lines
        for k, (start, offset) in enumerate(starts):
            stop = starts[k + 1][0] if k + 1 < len(starts) else n_lines
            if stop <= start:
                continue
            current.append(Slice(str(path), start, stop, offset))
            fill += stop - start
            if fill >= rows_per_task:
                tasks.append(tuple(current))
                current, fill, whole_bytes = [], 0, 0
    if current:
        tasks.append(tuple(current))
    return tasks, total


def _slice_records(sl: Slice) -> Iterator[tuple[int, object]]:
    """``(row, record_or_SampleError)`` of one slice, read exactly as ``formats`` reads a file."""
    from .formats import iter_records

    if sl.groups is not None:
        from .formats import hf_parquet

        yield from hf_parquet.iter_records(Path(sl.path), row_groups=sl.groups, first_row=sl.start)
        return
    if sl.offset is None:
        yield from iter_records(Path(sl.path))
        return
    with open(sl.path, "rb", buffering=1 << 16) as fh:
        if _array_head(fh):  # a JSON array cut at element boundaries (_array_cuts)
            from .formats import jsonarray

            count = None if sl.stop is None else sl.stop - sl.start
            for row, data in jsonarray.read_elements(fh, sl.offset, sl.start, count, sl.path):
                yield row, jsonarray.parse_element(data)
            return
        fh.seek(sl.offset)
        row = sl.start
        for line in fh:
            if sl.stop is not None and row >= sl.stop:
                break
            if row == 0:  # the file's first line: a byte-order mark before it is skipped, as formats does
                line = line.removeprefix(UTF8_BOM)
            if line.strip():
                yield row, parse_json_line(line)
            row += 1


def _check_unchanged(at: str, name: str, stats: dict[str, tuple[int, int]]) -> None:
    """Refuse an input file whose size or modification time is no longer what the run found when
    it started: a file rewritten while the run goes on (an upstream job writing it again) gave
    tasks of one run rows of two versions, read at the first version's byte offsets (rows lost,
    lines cut mid-record), under a manifest that recorded the first."""
    want = stats.get(name)
    if want is None:
        return
    try:
        now = input_stat(at)
    except FileNotFoundError:
        now = None
    if now is None or tuple(now) != tuple(want):
        raise InputError(
            f"input {name!r} changed while the run read it ({'removed' if now is None else 'size or modification time'});"
            " the run cannot go on with two versions of it: pass --overwrite to start over once it no longer changes"
        )


def _task_samples(task: _TokenizeTask) -> Iterator:
    id_names = dict(task.id_names)
    stats = dict(task.stats)
    for sl in task.slices:
        path = input_copy(sl.path)  # an input fetched from a bucket, on another machine
        at = _at(sl.path, task.cwd) if path == sl.path else path  # rows keep the input's name as given
        name = source_name(sl.path)  # once a slice: it looks at the cache directory (a mkdir call)
        id_name = id_names.get(name)
        local = path == sl.path and not is_url(sl.path)  # a fetched copy is this machine's own
        if local:
            _check_unchanged(at, name, stats)
        for row, rec in _slice_records(sl if at == sl.path else replace(sl, path=at)):
            yield parse_record(rec, name, row, task.cfg.format, id_name)
        if local:  # and not while this task read it
            _check_unchanged(at, name, stats)


_CONTEXTS: dict = {}


def _encode_context(cfg: TokenizeConfig):
    """The tokenizer, template and vision family of ``cfg``, built once per process (again when
    the tokenizer's files changed since: a library caller may rewrite one between runs)."""
    key = (cfg.digest(), _tokenizer_stamp(cfg.tokenizer))
    ctx = _CONTEXTS.get(key)
    if ctx is None:
        from .rows import EncodeContext
        from .templates import get_template
        from .tokenization import load_tokenizer
        from .vision import get_family

        family = get_family(cfg.model, **cfg.vision_settings())
        template = get_template(cfg.template)
        tokenizer = load_tokenizer(cfg.tokenizer if cfg.tokenizer is not None else template.default_tokenizer)
        ctx = EncodeContext(tokenizer, template, family, as_root(cfg.media_root),
                            cfg.system_prompt, max_branches=cfg.max_branches, max_tokens=cfg.max_tokens,
                            reasoning_loss=cfg.reasoning_loss)
        _CONTEXTS.clear()
        _CONTEXTS[key] = ctx
    return ctx


def _tokenizer_files(spec: str | None) -> tuple[Path, Path] | None:
    """The files a ``--tokenizer`` value is read from: its ``tokenizer.json`` and the
    ``tokenizer_config.json`` beside it (whose special tokens it reads where there is one);
    ``None`` for the embedded vocabulary. An ``hf:`` name is its cache's newest snapshot, which a
    download changes."""
    from .tokenization import resolve_hf_cache, tokenizer_path

    try:
        named = resolve_hf_cache(spec[3:]) if spec and spec.startswith("hf:") else tokenizer_path(spec)
    except PacktoolError:
        return None  # loading it says what is wrong
    if named is None:
        return None
    path = Path(named)
    file = path / "tokenizer.json" if path.is_dir() else path
    return file, file.parent / "tokenizer_config.json"


def _tokenizer_stamp(spec: str | None) -> tuple | None:
    """:func:`_tokenizer_files`, each by path, size and modification time."""
    files = _tokenizer_files(spec)
    if files is None:
        return None
    stamp = []
    for f in files:
        try:
            st = f.stat()
        except OSError:
            stamp.append((str(f), None))
        else:
            stamp.append((str(f), st.st_size, st.st_mtime_ns))
    return tuple(stamp)


def _tokenizer_digests(spec: str | None) -> dict[str, str | None] | None:
    """The sha256 of the ``tokenizer_config.json`` of :func:`_tokenizer_files` by its name
    (``None``: not there), which the run's state records: the special tokens' ids may come from
    it, and the vocabulary's fingerprint in the manifest (``vocab_sha256``, compared first) covers
    ``tokenizer.json`` alone."""
    files = _tokenizer_files(spec)
    if files is None:
        return None
    config = files[1]
    return {config.name: hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None}


#: A tokenize task collects garbage (its young generations) once every this many batches.
COLLECT_EVERY = 32


@contextmanager
def _collector_paused(every: int = COLLECT_EVERY) -> Iterator[Callable[[], None]]:
    """Turn automatic garbage collection off for a tokenize task; yield the call the task makes
    after each batch, which collects the two young generations every ``every`` batches.

    A task makes some thirty short-lived containers a sample (records, turns, parts, row
    dicts) and almost no cycles (none per sample on the bench corpora: a rejected line's error
    used to make one, no longer), but the collector's young generation still ran every few
    hundred samples and traced the two batches in flight each time: about 5 us a sample, 8-12%
    of a task, even at a threshold of 10,000 containers. Collected every ``every`` batches
    instead, whatever cycles a record does make (an error's traceback, a caller's objects) are
    freed within that many batches. Automatic collection comes back as it was when the task
    ends, also when it fails; it is process-wide, so an in-process run pauses it for the
    caller's other threads too, as a raised threshold did.
    """
    was = gc.isenabled()
    gc.disable()
    done = 0

    def after_batch() -> None:
        nonlocal done
        done += 1
        if done % every == 0:
            gc.collect(1)

    try:
        yield after_batch
    finally:
        if was:
            gc.enable()


def _clear_if_repeated(out: Path, task, again: bool = False) -> None:
    """Clear what an attempt at ``task`` left, where the driver's clearing before the run
    (:meth:`_Driver.run`) may not have seen it: an attempt ``again`` in this process (a pack task
    planned again without a video that does not decode, :func:`_without_undecodable`), a Ray
    retry (:func:`executors.attempt_may_repeat`), or a bucket output's staging folder, which is
    this process's own."""
    if again or attempt_may_repeat() or is_url(task.out_dir):
        clear_task(out, task.index)


def _tokenize_task(task: _TokenizeTask, report: Callable[[int], None]) -> dict:
    """One tokenize task: its slices → ``part-TTTTT-*.parquet`` + errors + completion marker."""
    from .rows import SampleNames, encode_stored
    from .schema import TOKENIZED
    from .tokenization import tokenizer_path

    out = task_dir(_at(task.out_dir, task.cwd))
    _clear_if_repeated(out, task)
    own = tokenizer_path(task.cfg.tokenizer)  # a tokenizer file given relative to the driver's directory
    ctx = _encode_context(task.cfg if own is None or _at(own, task.cwd) == own
                          else replace(task.cfg, tokenizer=_at(own, task.cwd)))
    ctx.start_run(task.run)
    errors = _TaskErrors(out, task.index, task.max_errors, task.on_error)
    n_rows = n_samples = n_tokens = n_units = 0
    # the names stored so far: a row whose name an earlier row holds (a repeated id, a record
    # named like a split tree) is stored as NAME#d1, ..., not refused, and counted; within the
    # task, as --group-by-media merges, since a run-wide check would read every id again after
    # the last task (stats notes repeats across tasks)
    names = SampleNames()
    tree_counts: Counter[str] = Counter()
    stream = _task_samples(task)
    if task.cfg.group_by_media:
        from .rows import group_by_media

        # merges records within this task (one input slice), never across tasks
        stream = group_by_media(stream, as_root(task.cfg.media_root), tree_counts)
    try:
        with _collector_paused() as after_batch, ShardWriter(
                out, TOKENIZED, rows_per_shard=task.cfg.rows_per_shard, prefix=task_prefix(task.index)) as writer:
            for batch in _batched(stream, BATCH):
                samples = []
                for item in batch:
                    if isinstance(item, Rejected):
                        errors.add(item)
                    else:
                        samples.append(item)
                if not isinstance(ctx.media_root, Path):  # a bucket: the batch's image headers fetched in parallel
                    ctx.media_root.prefetch([r.path for s in samples for r in s.media
                                             if r.kind == "image" and r.data is None and r.path])
                table, rejected = encode_stored(samples, ctx, tree_counts, names)
                for rej in rejected:
                    errors.add(rej)
                if table.num_rows:
                    writer.write_table(table)
                # input rows: a tree --group-by-media merged stands for every record folded into it
                n_in = len(batch) + sum(len(s.meta.get("merged", ())) for s in samples)
                n_rows += n_in
                n_samples += table.num_rows
                n_tokens += int(table.column("n_tokens").to_numpy().sum())
                n_units += int(table.column("n_vision_units").to_numpy().sum())
                report(n_in)
                after_batch()
        errors.commit()
    except BaseException:
        errors.abort()
        raise
    counts = {"rows_in": n_rows, "samples": n_samples, "rejected": errors.total,
              "rejected_by_reason": dict(sorted(errors.by_reason.items())), "tokens": n_tokens, "vision_units": n_units,
              "branches": tree_counts["branches"], "folded_branches": tree_counts["folded_branches"],
              "split_extra_trees": tree_counts["split_extra_trees"], "merged_records": tree_counts["merged_records"]}
    if names.renamed:  # only when there are any: the counts of a run without repeats stay as they were
        counts["repeated_ids"] = names.renamed
    record = {"task": task.index, "config_digest": task.config_digest, "shards": writer.shards, "counts": counts,
              "errors_bytes": errors.bytes, "ran_on": worker_place()}
    publish_task(task.out_dir, out, task.index, record)
    return record


def _tasks_digest(tasks) -> str:
    # inputs by their names: a fetched input's copy lies elsewhere on each machine
    blob = json.dumps([[[source_name(s.path), s.start, s.stop, s.offset, s.groups] for s in t] for t in tasks],
                      separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@_environment_errors
def tokenize_dataset(
    inputs: str | os.PathLike | Iterable[str | os.PathLike],
    out_dir: str | Path,
    cfg: TokenizeConfig,
    progress: Progress = None,
    overwrite: bool = False,
    *,
    workers: int | None = None,
    executor: str = "local",
    ray_address: str | None = None,
    rank: int = 0,
    world_size: int = 1,
    on_error: str = "skip",
    ex: ExecutorConfig | None = None,
) -> dict:
    """Read raw corpora, count vision tokens, apply the chat template, write tokenized shards.

    The sorted inputs are cut into tasks of ``cfg.rows_per_shard`` lines
    (:func:`plan_tokenize_tasks`); ``workers``/``executor``/``rank``/``world_size`` only
    choose where the tasks run (:class:`~packtool.executors.ExecutorConfig`). Re-running
    the same call after a crash skips finished tasks. ``on_error="fail"`` stops at the first
    rejected row; ``cfg.max_errors`` stops the run once more rows than that are rejected.

    Returns the manifest (``counts``: ``rows_in``, ``samples``, ``rejected``,
    ``rejected_by_reason``, ``tokens``, ``vision_units``, ``tasks``); with several ranks,
    a rank that is not the last to finish returns its own share with ``partial: True``
    (``kind``, ``rank``, ``world_size``, ``tasks``, ``tasks_missing``, ``counts`` and ``shards``
    of its own tasks).

    Args:
        inputs: one file, directory or URL, or any iterable of them (a list, a generator).
        out_dir: the output directory (or bucket prefix).
        cfg: the :class:`~packtool.config.TokenizeConfig`.
        progress: called in this process with the number of input rows just read (an
            increment, not a running total); ``progress.set_total(n)``, where it has one, gets
            the rows to expect. An exception it raises stops the run as an interrupt does.
        overwrite: replace a run made with other settings (only the files it wrote), or
            write into a non-empty directory that holds no packtool run.
        workers, executor, ray_address, rank, world_size: where the tasks run (``--workers``
            ... ``--world-size``); ``ex``: the same as one
            :class:`~packtool.executors.ExecutorConfig`, which then replaces them.
        on_error: ``skip`` records a bad row in ``.packtool/errors.jsonl``; ``fail`` stops.

    Raises:
        PacktoolError: a problem the user can fix (its message names the fix); a bad
            setting is a :class:`~packtool.errors.ConfigError` before anything is written.
    """
    _check_on_error(on_error)
    _check_call(cfg, TokenizeConfig)
    # one path given alone is one input, not the characters of its name ("/" among them: the whole disk)
    inputs = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    ex = _executor(ex, workers, executor, ray_address, rank, world_size)
    # inputs in a bucket are listed, not fetched: a rank that reads a stored plan fetches only
    # the inputs of its own tasks
    paths = fetch_inputs(inputs, fetch=False)
    files = expand_inputs([Path(p) for p in paths], present={str(p) for p in paths if is_listed(p)})
    if not as_root(cfg.media_root).is_dir():
        raise ConfigError(f"--media-root {cfg.media_root!r} is not a directory")
    # the manifest records the root as resolved here, so pack (run from anywhere) opens the same files
    cfg = replace(cfg, media_root=str(as_root(cfg.media_root).resolve()))
    start_pool(ex, _TOKENIZATION)  # the workers' forkserver loads while this process sets up
    ctx = _encode_context(cfg)  # fails fast on a bad --model/--template/--tokenizer
    config = cfg.to_dict()
    config["inputs"] = [source_name(f) for f in files]
    digest = config_digest(config)
    family = ctx.family
    manifest_extra = {
        "tokenizer": ctx.tokenizer.identity(),
        "vision": {**family.settings(), "unit": family.unit_name,
                   "default_max_vision_units": family.default_max_vision_units},
        "template": ctx.template.settings(),
    }
    # what the plan depends on, known from a stat of each input: nothing is read yet
    identity = {source_name(f): list(input_stat(f)) for f in files}
    local = {source_name(f): str(f) for f in files}  # a stored plan's input names -> the files here
    key = digest_of({"plan_version": PLAN_VERSION, "config_digest": digest, "inputs": identity})
    # a second run of this rank into the output is refused, naming this one
    with output_dir(out_dir, ex.rank, overwrite) as out:
        with stored_plan(out, "tokenized", key, lambda plan: _tokenize_plan_ok(plan, identity)) as slot:
            if slot.plan is None:
                fetch_listed(files)  # the planner reads every input
                slices, total = plan_tokenize_tasks(files, cfg.rows_per_shard, ex.workers or default_workers())
                log.info("planned %d tokenize tasks from %d inputs", len(slices), len(files))
            else:
                slices = [tuple(Slice(local[p], a, b, o, tuple(g) if g else None) for p, a, b, o, g in t)
                          for t in slot.plan["tasks"]]
                total = slot.plan["total"]
                log.info("read the stored plan of %d tokenize tasks; the inputs are not scanned again", len(slices))
            run = {"kind": "tokenized", "config": config, "config_digest": digest, "world_size": ex.world_size,
                   "n_tasks": len(slices), "tasks_digest": _tasks_digest(slices), "inputs": identity,
                   "manifest": manifest_extra, "max_errors": cfg.max_errors}
            files = _tokenizer_digests(cfg.tokenizer)
            if files is not None:
                run["tokenizer_files"] = files
            done = prepare_run(out, run, overwrite)
            if done is not None:
                log.info("%s already holds this run; nothing to do", out_dir)
                return _finished(done, out_dir, cfg.max_errors, on_error)
            state_prepared(out)
            # inputs by their names (a fetched input by its URL): a rank on another machine, with
            # its copies elsewhere, reads the same plan
            slot.store({"kind": "tokenized", "key": key, "n_tasks": len(slices), "total": total,
                        "tasks": [[[source_name(sl.path), sl.start, sl.stop, sl.offset,
                                    list(sl.groups) if sl.groups else None] for sl in t] for t in slices]})
        driver = _Driver(out, digest, len(slices), ex, cfg.max_errors, on_error, out_dir)
        todo, _ = driver.pending()
        if ex.executor != "ray":  # this machine's tasks read these: fetched once here, not once per worker
            fetch_listed(sl.path for t in todo for sl in slices[t])
        # records without an id are named FILE:ROW; inputs of one file name (a/train.jsonl,
        # b/train.jsonl) would name theirs alike, in every task: they are named by enough of their path
        id_names = file_id_names(config["inputs"])
        run_token = os.urandom(8).hex()
        tasks = [_TokenizeTask(t, slices[t], task_target(out), cfg, digest, cfg.max_errors, on_error, os.getcwd(),
                               tuple((n, id_names[n]) for n in dict.fromkeys(source_name(sl.path) for sl in slices[t])
                                     if n in id_names), run_token,
                               tuple((n, tuple(identity[n])) for n in dict.fromkeys(source_name(sl.path) for sl in slices[t])
                                     if n in identity))
                 for t in todo]
        if total is not None:
            set_total(progress, sum(sum(s.stop - s.start for s in slices[t]) for t in todo))
        driver.run(_tokenize_task, tasks, todo, progress, preload=_TOKENIZATION)
        tasks_ran(out)
        return _finish_or_partial(out, run, ex)


#: Layout of the stored task plan (``.packtool/plan.json``); part of its key.
PLAN_VERSION = 1


def _tokenize_plan_ok(plan: dict, inputs: dict) -> bool:
    """Whether a stored tokenize plan is well formed and reads only this run's ``inputs``.

    The plan file sits in the output directory like any state; a task must never be sent to a
    file the user did not name, however the file was changed.
    """
    def is_count(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    tasks = plan.get("tasks")
    if not isinstance(tasks, list) or plan.get("n_tasks") != len(tasks) or not (
            plan.get("total") is None or is_count(plan.get("total"))):
        return False
    for task in tasks:
        if not isinstance(task, list) or not task:
            return False
        for sl in task:
            if not (isinstance(sl, list) and len(sl) == 5 and sl[0] in inputs and is_count(sl[1])):
                return False
            _, start, stop, offset, groups = sl
            if not ((stop is None or is_count(stop) and stop >= start) and (offset is None or is_count(offset))
                    and (groups is None or isinstance(groups, list) and len(groups) == 2
                         and all(is_count(g) for g in groups) and groups[0] <= groups[1])):
                return False
    return True


# ============================================================================ pack


def lower_bound(total_tokens: int, total_units: int, max_tokens: int, max_units: int, alone: int = 0) -> int:
    """Fewest packs any packer could use: ``max(ceil(Σtokens/max_tokens), ceil(Σunits/max_units))``
    over the samples that fit a pack, plus one pack for each of ``alone`` samples that do not
    (``--oversize alone``; their tokens and units are not in the totals).

    Example:
        >>> lower_bound(10_000, 300, 4096, 128), lower_bound(10_000, 300, 4096, 128, alone=2)
        (3, 5)
    """
    a = math.ceil(total_tokens / max_tokens) if max_tokens else 0
    b = math.ceil(total_units / max_units) if max_units else 0
    return max(a, b) + alone


def _pack_bound(counts: dict, max_tokens: int, max_units: int) -> int:
    """:func:`lower_bound` of a pack run's counts, its alone samples apart."""
    return lower_bound(counts.get("tokens", 0) - counts.get("alone_tokens", 0),
                       counts.get("vision_units", 0) - counts.get("alone_vision_units", 0), max_tokens, max_units,
                       counts.get("alone", 0))


def _prefetch_media(media_root, tables, where: np.ndarray, loader: _MediaLoader | None = None) -> None:
    """Fetch, in parallel, the image files a chunk of packs embeds from a bucket (rows ``where``
    of ``tables``, as ``assemble_packs`` takes them), so embedding costs no round trip per image;
    but those ``loader`` still holds from earlier chunks (it embeds them without a fetch)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from .schema import TOKENIZED, with_media_type

    # tables of two schema versions (a mixture of old and new tokenized directories) differ in media fields
    media_type = TOKENIZED.field("media").type
    media = pa.chunked_array([with_media_type(t, media_type).column("media") for t in tables],
                             type=media_type).combine_chunks().take(pa.array(where))
    flat = pc.list_flatten(media)
    held = loader._recent if loader is not None else ()
    paths = [p for k, p in zip(flat.field("kind").to_pylist(), flat.field("path").to_pylist(), strict=True)
             if k == "image" and p and p not in held]
    media_root.prefetch(paths, whole=True)


#: Bytes of recently embedded media a pack task keeps (``_Recent``): one image used by many
#: records (a VQA corpus asks several questions of each image) is read, or a video's frames
#: decoded, once while it stays among the task's recent items. Per task, so per worker process.
RECENT_MEDIA_BYTES = 64 << 20


class _Recent:
    """The least recently used entries up to ``limit`` bytes in all; an entry over an eighth of
    ``limit`` is never kept (it would push out many small ones and is rarely a repeat).

    Example:
        >>> r = _Recent(16)
        >>> for k in "abcdefgh": r.put(k, k.encode() * 2, 2)
        >>> r.get("a")  # "a" is the most recent now, "b" the least
        b'aa'
        >>> r.put("i", b"ii", 2)  # 18 bytes: the least recent goes
        >>> r.get("b") is None, r.get("c")
        (True, b'cc')
        >>> r.put("j", b"jjj", 3)  # over 16 // 8 bytes: never kept
        >>> r.get("j") is None
        True
    """

    __slots__ = ("limit", "_items", "_bytes")

    def __init__(self, limit: int) -> None:
        from collections import OrderedDict

        self.limit = limit
        self._items: OrderedDict = OrderedDict()
        self._bytes = 0

    def __contains__(self, key) -> bool:
        return key in self._items

    def get(self, key):
        hit = self._items.get(key)
        if hit is not None:
            self._items.move_to_end(key)
            return hit[0]
        return None

    def put(self, key, value, size: int) -> None:
        if size > self.limit // 8 or key in self._items:
            return
        self._items[key] = (value, size)
        self._bytes += size
        while self._bytes > self.limit:
            _, (_, gone) = self._items.popitem(last=False)
            self._bytes -= gone


class _MediaLoader:
    """What ``--media embed`` puts into a packed row for one media item (see ``assemble_packs``'s
    ``media_data``): ``loader(item)`` with the tokenized row's media struct as a dict, or, for an
    image file, ``loader.image(path, size_bytes)`` without building that dict.

    An image is its file's bytes, which must have the size tokenize counted (a file rewritten while
    the task runs stops it, ``InputError``); a video is its recorded frames as JPEG. A file used
    again while it is among the task's recent items (:data:`RECENT_MEDIA_BYTES`) is not read (or
    decoded) again: the task embeds the bytes it read the first time.
    """

    __slots__ = ("media_root", "frame_quality", "rotate", "_read", "_recent")

    def __init__(self, media_root: Path, frame_quality: int = 90, recent_bytes: int = RECENT_MEDIA_BYTES,
                 rotate: bool | None = None) -> None:
        from .media import MediaPathResolver

        self.media_root = media_root
        self.frame_quality = frame_quality
        self.rotate = rotate  # whether tokenize turned videos by their display rotation (see counted_frames)
        self._read = MediaPathResolver(media_root).read if isinstance(media_root, Path) else self._read_remote
        self._recent = _Recent(recent_bytes)

    def _read_remote(self, path: str) -> bytes:
        return self.media_root.file(path).read_bytes()

    def image(self, path: str, size_bytes: int | None) -> bytes:
        data = self._recent.get(path)
        fresh = data is None
        if fresh:
            try:
                data = self._read(path)
            except SampleError as err:
                raise _unreadable(err, checked=size_bytes is not None) from None
        if size_bytes is not None and len(data) != size_bytes:
            # checked before planning; a file rewritten while this task ran is caught here
            raise InputError(f"media file {path!r} changed while pack was running ({len(data):,} bytes, "
                             f"{size_bytes:,} when counted); re-run the same command")
        if fresh:
            self._recent.put(path, data, len(data))
        return data

    def __call__(self, m: dict) -> list[bytes] | None:
        if m.get("kind") == "image":
            if m.get("data") is not None:
                return [m["data"]]
            if m.get("path") is None:  # tokenize rejects such an item: the shard was written or edited elsewhere
                raise InputError("a tokenized row holds an image with neither a path nor inline bytes, which "
                                 "packtool tokenize never writes; tokenize the corpus again (it sends such a row to "
                                 "errors.jsonl) and pack its output")
            return [self.image(m["path"], m.get("size_bytes"))]
        from .media import extract_frames

        # a video's frames depend on its file, the recorded times and size (rotation), and the JPEG quality
        key = None
        if m.get("data") is None and m.get("path") is not None:
            key = ("video", m["path"], tuple(m.get("timestamps") or ()), m.get("width"), m.get("height"))
            frames = self._recent.get(key)
            if frames is not None:
                return frames
        try:
            frames = extract_frames(self.media_root, m, quality=self.frame_quality, rotate=self.rotate)
        except SampleError as err:
            if err.reason == "corrupt_video":  # there and unchanged, but its frames do not decode: a re-run fails again
                from .packer import UndecodableMedia

                where = f"{m['path']!r}" if m.get("path") else "held inline by a tokenized row"
                what = f"video {where} has frames that do not decode ({err.message})"
                raise UndecodableMedia(f"{what}; tokenize reads only its headers: replace the file, or drop its rows "
                                       "and tokenize again", f"{what}; tokenize reads only its headers: replace the "
                                       "file and tokenize again") from None
            raise _unreadable(err, checked=m.get("size_bytes") is not None) from None
        if key is not None:
            self._recent.put(key, frames, sum(map(len, frames)))
        return frames


def _unreadable(err: SampleError, checked: bool) -> InputError:
    """The error that stops a pack task whose media file cannot be read at assembly.

    Pack checks every file tokenize recorded a size for before planning (``checked``) and
    rejects the rows of a missing one; a file removed or swapped while the task runs is caught
    here, where its pack is already planned, so the task stops and publishes nothing.
    """
    then = ("re-run without it: pack checks every file before planning and sends the rows of a missing one to "
            "errors.jsonl" if checked else
            "tokenize again: these tokenized shards record no media sizes, so pack cannot check the files before "
            "planning (a new tokenize run records them, and sends the rows of a missing file to errors.jsonl)")
    return InputError(f"a media file could not be read while pack was running: {err.message}; restore it and re-run "
                      f"the same command to resume, or {then}")


def _media_loader(media_root: Path, frame_quality: int = 90, share: int = 1, rotate: bool | None = None) -> _MediaLoader:
    """The loader of one media root; ``share``: how many a task holds (a mixture's sources), which
    split :data:`RECENT_MEDIA_BYTES` between them, so a task keeps that much whatever its sources;
    ``rotate``: :func:`_rotates` of the tokenized manifest."""
    return _MediaLoader(media_root, frame_quality, RECENT_MEDIA_BYTES // max(share, 1), rotate)


def _rotates(tok_manifest: dict) -> bool | None:
    """Whether tokenize turned videos by their display rotation: its family's ``exif`` setting
    (``None`` for a manifest without one).

    Example:
        >>> _rotates({"vision": {"name": "molmo2", "exif": "apply"}}), _rotates({"vision": {}})
        (True, None)
    """
    exif = (tok_manifest.get("vision") or {}).get("exif")
    return None if exif is None else exif == "apply"


@dataclass(frozen=True, slots=True)
class _PackTask:
    index: int
    src_file: str
    out_dir: str | None  # None: dry run, plan only
    cfg: PackConfig
    max_units: int
    media_root: str
    config_digest: str
    max_errors: int | None
    on_error: str
    check_mtime: bool = True  # False when pack reads media from another root than tokenize counted (copies)
    entry: dict | None = None  # the tokenized manifest's entry for src_file: size, rows, sha256 to check
    cwd: str = "."  # the driver's working directory, which relative paths are relative to
    rotate: bool | None = None  # whether tokenize turned videos by their display rotation (_rotates)


def _media_leaves(pf):
    """The media list of every row of a tokenized shard, holding only the fields pack checks
    (``kind``, ``path``, and ``size_bytes``, ``mtime_ns`` where recorded): one read of four
    small leaves instead of the whole struct (inline bytes and timestamps are not decoded)."""
    names = [f.name for f in pf.schema_arrow.field("media").type.value_type]
    leaves = [f"media.list.element.{n}" for n in ("kind", "path", "size_bytes", "mtime_ns") if n in names]
    return pf.read(columns=leaves, use_threads=False)["media"].combine_chunks()


def _has_media(media) -> np.ndarray:
    """Whether each row holds a media item, from :func:`_media_leaves`."""
    import pyarrow.compute as pc

    return pc.fill_null(pc.list_value_length(media), 0).to_numpy(zero_copy_only=False) > 0


def _group_starts(pf) -> np.ndarray:
    """The first row of each row group of an open Parquet file, then its row count
    (``len`` is groups + 1), so ``searchsorted(starts, row, side="right") - 1`` is a row's group."""
    meta = pf.metadata
    return np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)], dtype=np.int64)


def _cut_to_nothing(pf, tokens: np.ndarray, units: np.ndarray, has_media: np.ndarray, bad: dict, max_tokens: int,
                    max_units: int) -> dict[int, tuple[str, str]]:
    """Rows that ``--oversize truncate`` would cut to no target at all: text-only rows over
    ``max_tokens`` whose first target (``target_ids != -100``) lies at ``max_tokens - 1`` or
    later (the last kept token's target is dropped with the cut). Packed, such a row trains
    nothing, and a pack of only such rows has no loss token, so a trainer dividing by the
    count gets NaN. Cut rows are rare, so only the row groups holding candidates are read.
    Returns ``{row: ("no_loss", message)}``.
    """
    from .packer import assembly_columns
    from .runs import expand_table

    rows = np.flatnonzero((tokens > max_tokens) & (units <= max_units) & ~has_media)
    rows = [int(r) for r in rows if int(r) not in bad]
    if not rows:
        return {}
    starts = _group_starts(pf)
    group_of = np.searchsorted(starts, rows, side="right") - 1
    out = {}
    for g in np.unique(group_of).tolist():
        table = expand_table(pf.read_row_group(g, columns=assembly_columns(pf.schema_arrow), use_threads=False))
        targets = table.column("target_ids")
        for r in (r for r, rg in zip(rows, group_of, strict=True) if rg == g):
            hit = np.flatnonzero(np.asarray(targets[r - int(starts[g])].values) != -100)
            if not len(hit) or hit[0] >= max_tokens - 1:
                first = f"its first target is token {int(hit[0]):,}" if len(hit) else "it has no target"
                out[r] = ("no_loss", f"cut to --max-tokens {max_tokens:,} (of {int(tokens[r]):,} tokens) it keeps no "
                                     f"target to train on ({first}); raise --max-tokens, or shorten its prompt")
    return out


def _media_problems(media, media_root: Path, check_mtime: bool) -> dict[int, tuple[str, str]]:
    """Rows of a tokenized shard whose media file is no longer the one tokenize counted
    (``media`` from :func:`_media_leaves`).

    Tokenize recorded each media file's size and modification time; a file now missing,
    outside the root, of another size, or (under the same root) modified since, would put
    other pixels than were counted into the packs, so its row is rejected (``media_changed``,
    ``missing_media``, ``path_outside_root``) instead, for its first such item. One ``stat``
    per distinct file; the items are compared as arrays (a shard holds a media item per
    sample, mostly). Returns ``{row: (reason, message)}``.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    from .errors import SampleError
    from .media import MediaPathResolver, resolve_media_path

    if isinstance(media_root, Path):  # a file per sample in most corpora: no Path objects per file
        stat_of = MediaPathResolver(media_root).stat
    else:
        def stat_of(path: str):
            return resolve_media_path(path, media_root).stat()
    if "size_bytes" not in [f.name for f in media.type.value_type]:
        return {}  # written before sizes were recorded: nothing to compare
    lengths = pc.fill_null(pc.list_value_length(media), 0).to_numpy(zero_copy_only=False)
    flat = pc.list_flatten(media)
    # inline bytes travel in the row itself: only items with a path and a recorded size are checked
    checked = pc.and_(pc.is_valid(flat.field("size_bytes")), pc.is_valid(flat.field("path")))
    item = np.flatnonzero(checked.to_numpy(zero_copy_only=False))
    if not len(item):
        return {}
    rows = np.repeat(np.arange(len(lengths)), lengths)[item]
    picked = pa.array(item)
    paths, sizes, mtimes = (flat.field(name).take(picked) for name in ("path", "size_bytes", "mtime_ns"))
    paths = pc.dictionary_encode(paths)
    index = paths.indices.to_numpy(zero_copy_only=False)
    distinct = paths.dictionary.to_pylist()
    now_size = np.zeros(len(distinct), dtype=np.int64)
    now_mtime = np.zeros(len(distinct), dtype=np.int64)
    failed: dict[int, SampleError] = {}
    for k, path in enumerate(distinct):
        try:
            st = stat_of(path)
            now_size[k], now_mtime[k] = st.st_size, st.st_mtime_ns
        except SampleError as err:
            failed[k] = err
        except OSError as exc:
            failed[k] = SampleError("missing_media", f"media file {path!r} cannot be read: {exc.strerror}")
    off = now_size[index] != sizes.to_numpy(zero_copy_only=False)
    if check_mtime:
        off |= now_mtime[index] != pc.fill_null(mtimes, 0).to_numpy(zero_copy_only=False)
    if failed:
        off |= np.isin(index, np.fromiter(failed, dtype=np.int64, count=len(failed)))
    bad: dict[int, tuple[str, str]] = {}
    if not off.any():
        return bad
    kinds = flat.field("kind").take(picked)
    for i in np.flatnonzero(off).tolist():  # items in row order: a row's first bad item names it
        row = int(rows[i])
        if row in bad:
            continue
        k = int(index[i])
        if k in failed:
            bad[row] = (failed[k].reason, failed[k].message)
        else:
            path, size, mtime = distinct[k], sizes[i].as_py(), mtimes[i].as_py()
            bad[row] = ("media_changed", f"{kinds[i].as_py()} {path!r} changed since tokenize counted it (then "
                        f"{size:,} bytes, modified at {mtime} ns; now {int(now_size[k]):,} bytes, "
                        f"{int(now_mtime[k])} ns); re-run tokenize to count it again")
    return bad



class _RowStore:
    """Rows of one tokenized shard, read row group by row group, each group once, held only until used.

    Packs take samples roughly in shard order, but a sample may wait in the packing buffer
    for a long time. Each row group is held as read and handed to the assembly as it is
    (no copy); a group is let go once all its rows are packed, and a group the packs have
    passed (a row after its last was asked for, so each of its rows has entered the buffer)
    keeps only its rows still waiting there (a small copy, once), so memory stays about one
    row group plus the rows waiting in the buffer, however long a sample waits. A group is not
    cut down before it is passed: its unpacked rows may then be rows the buffer has not reached
    yet, which the next packs take anyway (with chunks of whole row groups, as ``pack`` takes
    them, both rules copy the same rows; with smaller chunks the earlier rule copied those too).
    """

    def __init__(self, pf, never: list[int] | None = None, file: Path = Path("?")) -> None:
        import pyarrow as pa

        self.pf = pf
        self.file = file
        self._arrow_errors = (pa.ArrowException, OSError)
        self.starts = _group_starts(pf)
        self.loaded = 0  # row groups read so far
        self.reached = 0  # one past the largest row asked for so far
        from .packer import assembly_columns

        # ParquetFile.schema_arrow converts the file's schema again on every access
        self.columns = assembly_columns(pf.schema_arrow)
        # group -> [table, shard row of each held row (ascending), packed flags]
        self.held: dict[int, list] = {}
        # rows no pack will take (dropped samples) count as used from the start
        self.never = np.zeros(int(self.starts[-1]), dtype=bool)
        if never:
            self.never[np.asarray(never, dtype=np.int64)] = True

    def take(self, rows: np.ndarray):
        """The held tables that hold ``rows`` (shard row numbers, any order) and each row's
        position in them, counted across the tables in list order (``assemble_packs`` input)."""
        if len(rows) == 0:
            return None
        top = int(rows.max())
        need = int(np.searchsorted(self.starts, top, side="right"))  # groups 0..need-1
        self.reached = max(self.reached, top + 1)
        while self.loaded < need:
            g = self.loaded
            lo, hi = int(self.starts[g]), int(self.starts[g + 1])
            used = self.never[lo:hi].copy()
            if not used.all():
                try:
                    table = self.pf.read_row_group(g, columns=self.columns, use_threads=False)
                except self._arrow_errors as exc:  # a page whose checksum fails
                    raise shard_error(self.file, exc) from None
                self.held[g] = [table, np.arange(lo, hi, dtype=np.int64), used, False]
            self.loaded += 1
        group_of = np.searchsorted(self.starts, rows, side="right") - 1
        where = np.empty(len(rows), dtype=np.int64)
        tables = []
        base = 0
        groups = np.unique(group_of).tolist()
        for g in groups:
            entry = self.held.get(g)
            mine = group_of == g
            want = rows[mine]
            if entry is None:
                raise RuntimeError("internal error: a pack uses a shard row twice")
            table, ids, used, _ = entry
            pos = np.minimum(np.searchsorted(ids, want), len(ids) - 1)
            if np.any(ids[pos] != want) or used[pos].any() or len(np.unique(pos)) != len(pos):
                raise RuntimeError("internal error: a pack uses a shard row twice")
            used[pos] = True
            where[mine] = base + pos
            tables.append(table)
            base += table.num_rows
        for g in list(self.held):
            table, ids, used, cut = self.held[g]
            n_used = int(used.sum())
            if n_used == len(ids):
                del self.held[g]
            elif self.starts[g + 1] <= self.reached and (not cut or n_used * 4 >= len(ids) * 3):
                keep = np.flatnonzero(~used)  # passed: keep only the rows still waiting in the buffer
                self.held[g] = [table.take(keep), ids[keep], np.zeros(len(keep), dtype=bool), True]
        return tables, where


def _plan_kept(tokens: np.ndarray, units: np.ndarray, has_media: np.ndarray, bad: dict, cfg: PackConfig,
               max_units: int, name: Callable[[int], str] | None = None):
    """``plan_packs`` over the samples not in ``bad`` (media no longer the ones counted); the
    plan's indices are those of the full arrays, and so are those ``name`` takes."""
    from .packer import plan_packs

    if not bad:
        return plan_packs(tokens, units, has_media, cfg, max_units, name=name)
    keep = np.ones(len(tokens), dtype=bool)
    keep[list(bad)] = False
    idx = np.flatnonzero(keep)
    plan = plan_packs(tokens[idx], units[idx], has_media[idx], cfg, max_units,
                      name=None if name is None else lambda i: name(int(idx[i])))
    plan.order = idx[plan.order]
    plan.dropped, plan.alone, plan.truncated = ([int(idx[i]) for i in part]
                                                for part in (plan.dropped, plan.alone, plan.truncated))
    return plan


def _pack_task(task: _PackTask, report: Callable[[int], None]) -> dict:
    """One pack task: one tokenized shard → planned packs → ``part-TTTTT-*.parquet`` + marker.

    The plan needs only the length columns; packs are then assembled ``PACK_CHUNK`` at a
    time from a :class:`_RowStore`, so memory follows the chunk and the packing buffer,
    not the shard.
    """
    import pyarrow.parquet as pq

    if is_url(task.src_file):
        # a shard in a bucket: this task fetches it (checked against the manifest's sha256) and drops it after
        src = fetch_shard(task.src_file, task.entry)
        try:
            return _pack_shard(task, report, src, pq.ParquetFile(src, page_checksum_verification=True))
        finally:
            src.unlink(missing_ok=True)
    src = Path(_at(task.src_file, task.cwd))
    if task.entry is not None:
        # the whole file against the manifest's sha256 (a pass over bytes the task reads anyway):
        # a cut, flipped, emptied or swapped shard stops here, before anything is planned
        pf = open_shard(src.parent, task.entry, sha256=True)
    else:
        pf = pq.ParquetFile(src, page_checksum_verification=True)
    return _pack_shard(task, report, src, pf)


def _pack_shard(task: _PackTask, report: Callable[[int], None], src: Path, pf) -> dict:
    """The pack task on its opened tokenized shard ``pf`` (read from ``src``), packed again
    without any sample whose video does not decode (:func:`_without_undecodable`)."""
    return _without_undecodable(report, lambda once, undecodable: _pack_shard_once(task, once, src, pf, undecodable),
                                lambda known: _undecodable_videos(task, pf, known))


def _without_undecodable(report: Callable[[int], None], attempt: Callable[[Callable[[int], None], dict], dict],
                         scan: Callable[[set[int]], dict[int, tuple[str, str]]]) -> dict:
    """``attempt(report, undecodable)`` until it does not meet a video whose frames do not decode.

    Such a video is found only when its pack is assembled (tokenize and the checks before
    planning read headers): ``attempt`` raises :class:`packer.UndecodableMedia` with the
    sample's ``row`` (its index in what the task plans). That sample is then rejected
    (``corrupt_video``, in ``errors.jsonl``) and the task planned and packed again without it,
    from scratch, so the packs are those a run that had rejected it before planning would
    write, on every attempt and every machine. The first time, ``scan(known)`` looks at every
    other video of the task (``{row: (reason, message)}``), so one more attempt packs it,
    however many such videos there are. One file no longer stops the run. Progress is reported
    once: an attempt reports only rows no earlier attempt did."""
    from .packer import UndecodableMedia

    undecodable: dict[int, tuple[str, str]] = {}
    done = [0, 0]  # rows reported by any attempt so far, and by this one

    def once(n: int) -> None:
        done[1] += n
        if done[1] > done[0]:
            report(done[1] - done[0])
            done[0] = done[1]

    while True:
        done[1] = 0
        try:
            return attempt(once, undecodable)
        except UndecodableMedia as err:
            if err.row is None:  # not from an assembly of this task's rows: nothing to leave out
                raise
            first = not undecodable
            undecodable[err.row] = (err.reason, err.row_message)
            if first:
                undecodable.update(scan(set(undecodable)))


def _undecodable_in(rows: list, loader: Callable[[dict], object]) -> tuple[str, str] | None:
    """``(reason, message)`` of the first video of one row's media list ``rows`` whose frames
    ``loader`` (a pack's media loader) cannot decode; ``None`` when every one decodes."""
    from .packer import UndecodableMedia

    for m in rows or ():
        if m["kind"] != "video":
            continue
        try:
            loader(m)
        except UndecodableMedia as err:
            return err.reason, err.row_message
    return None


def _undecodable_videos(task: _PackTask, pf, known: set[int]) -> dict[int, tuple[str, str]]:
    """``{row: (reason, message)}`` of the shard's rows (but ``known``) holding a video whose
    frames do not decode, each video decoded once as pack embeds it. Run once a task has met
    one such video: a shard with many would otherwise be planned again for each."""
    loader = _media_loader(as_root(task.media_root), task.cfg.frame_quality, rotate=task.rotate)
    found: dict[int, tuple[str, str]] = {}
    starts = _group_starts(pf)
    for g in range(len(starts) - 1):
        rows = pf.read_row_group(g, columns=["media"], use_threads=False).column("media").to_pylist()
        for r, items in enumerate(rows, start=int(starts[g])):
            if r not in known and (why := _undecodable_in(items, loader)) is not None:
                found[r] = why
    return found


def _pack_shard_once(task: _PackTask, report: Callable[[int], None], src: Path, pf,
                     undecodable: dict[int, tuple[str, str]]) -> dict:
    """:func:`_pack_shard`'s one attempt, with the rows in ``undecodable`` rejected up front.

    Raises:
        packer.UndecodableMedia: a sample's media did not decode as its pack was assembled; its
            ``row`` is the sample's row in the shard.
    """
    import pyarrow as pa

    from .packer import PackPlan, UndecodableMedia, assemble_packs
    from .schema import packed_schema

    cfg = task.cfg
    try:
        lengths = pf.read(columns=["n_tokens", "n_vision_units"], use_threads=False)
        tokens = lengths["n_tokens"].to_numpy()
        units = lengths["n_vision_units"].to_numpy()
        media = _media_leaves(pf)
        has_media = _has_media(media)
        bad = _media_problems(media, as_root(task.media_root), task.check_mtime)
        bad.update(undecodable)
        if cfg.oversize == "truncate":
            bad.update(_cut_to_nothing(pf, tokens, units, has_media, bad, cfg.max_tokens, task.max_units))
    except (pa.ArrowException, KeyError) as exc:
        raise shard_error(src, exc) from None
    def name(row: int) -> str:  # for --oversize fail's error only
        sid = pf.read(columns=["sample_id"], use_threads=False)["sample_id"][row].as_py()
        return f"sample {sid!r} (row {row} of {src.name})"

    plan = _plan_kept(tokens, units, has_media, bad, cfg, task.max_units, name)
    if plan.n_packs >= PACK_INDEX_STRIDE:
        raise ConfigError(f"{task.src_file}: {plan.n_packs:,} packs from one tokenized shard; re-run tokenize with a "
                          "smaller --rows-per-shard")
    packed_tokens = int(tokens[plan.order].sum()) if len(plan.order) else 0
    if plan.truncated:
        packed_tokens -= int(sum(int(tokens[i]) - cfg.max_tokens for i in plan.truncated))
    by_reason = Counter({"oversize": len(plan.dropped)} if plan.dropped else {})
    by_reason.update(reason for reason, _ in bad.values())
    counts = {"samples_in": len(tokens), "samples_packed": len(plan.order), "packs": plan.n_packs,
              "dropped": len(plan.dropped), "alone": len(plan.alone), "truncated": len(plan.truncated),
              "tokens": packed_tokens, "vision_units": int(units[plan.order].sum()) if len(plan.order) else 0,
              "alone_tokens": int(tokens[plan.alone].sum()) if plan.alone else 0,
              "alone_vision_units": int(units[plan.alone].sum()) if plan.alone else 0,
              "rejected": len(plan.dropped) + len(bad), "rejected_by_reason": dict(sorted(by_reason.items()))}
    if task.out_dir is None:
        report(len(tokens))
        return {"task": task.index, "counts": counts, "plan": plan}
    out = task_dir(_at(task.out_dir, task.cwd))
    _clear_if_repeated(out, task, again=bool(undecodable))
    errors = _TaskErrors(out, task.index, task.max_errors, task.on_error)
    try:
        if plan.dropped or bad:
            ids = pf.read(columns=["sample_id", "source", "source_row"])
            dropped = set(plan.dropped)
            for i in sorted(dropped | set(bad)):
                reason, message, over = _why_rejected(i, bad, tokens, units, cfg.max_tokens, task.max_units)
                errors.add(Rejected(ids["source"][i].as_py(), ids["source_row"][i].as_py(), ids["sample_id"][i].as_py(),
                                    reason, message), over)
            report(len(plan.dropped) + len(bad))
        root = as_root(task.media_root)
        loader = _media_loader(root, cfg.frame_quality, rotate=task.rotate) if cfg.media == "embed" else None
        store = _RowStore(pf, never=sorted(set(plan.dropped) | set(bad)), file=src)
        truncated = set(plan.truncated)
        with ShardWriter(out, packed_schema(cfg.layout), rows_per_shard=cfg.packs_per_shard, row_group_rows=PACKED_GROUP_ROWS,
                         prefix=task_prefix(task.index)) as writer:
            # chunks restart at each shard's first pack, so with PACK_CHUNK == PACKED_GROUP_ROWS
            # each chunk is one whole row group and the writer need not join chunks (a copy)
            bounds = [s + k for s in range(0, plan.n_packs, cfg.packs_per_shard)
                      for k in range(0, min(cfg.packs_per_shard, plan.n_packs - s), PACK_CHUNK)]
            # no bounds when the plan has no pack (every sample of the shard dropped as oversize)
            for p0, p1 in zip(bounds, [*bounds[1:], plan.n_packs][:len(bounds)], strict=True):
                rows = plan.order[plan.offsets[p0]:plan.offsets[p1]]
                tables, where = store.take(rows)
                sub = PackPlan(where, plan.offsets[p0:p1 + 1] - plan.offsets[p0],
                               truncated=[int(where[k]) for k, r in enumerate(rows.tolist()) if r in truncated]
                               if truncated else [])
                first = task.index * PACK_INDEX_STRIDE + p0
                if loader is not None and not isinstance(root, Path):
                    _prefetch_media(root, tables, where, loader)
                try:
                    packs = assemble_packs(tables, sub, first, loader, cfg.max_tokens, layout=cfg.layout)
                except UndecodableMedia as err:
                    err.row = int(rows[err.sample])
                    raise
                writer.write_table(packs)
                report(len(rows))
        errors.commit()
    except BaseException:
        errors.abort()
        raise
    record = {"task": task.index, "config_digest": task.config_digest, "shards": writer.shards, "counts": counts,
              "errors_bytes": errors.bytes, "ran_on": worker_place()}
    publish_task(task.out_dir, out, task.index, record)
    return record


def _check_media_root(root, given, tok_manifest: dict) -> None:
    """Refuse a local media root that is not a directory where the tokenized rows hold media:
    every row with media would be rejected as missing and the run would "succeed" with none."""
    if not isinstance(root, Path) or root.is_dir():
        return
    if given is not None:
        raise ConfigError(f"--media-root {str(given)!r} is not a directory; give the folder the media paths are "
                          "relative to")
    if tok_manifest.get("counts", {}).get("vision_units", 0):
        raise ConfigError(f"the media root {str(root)!r} that tokenize counted from is not a directory any more; pass "
                          "--media-root with the folder the media files are in now")


def _same_place(a: str | Path, b: str | Path) -> bool:
    a, b = str(a), str(b)
    if is_url(a) or is_url(b):
        return is_url(a) and is_url(b) and place(a) == place(b)
    return Path(a).resolve() == Path(b).resolve()


def _inside(inner: str | Path, outer: str | Path) -> bool:
    """Whether ``inner`` lies under ``outer`` (not ``outer`` itself), local paths resolved, URLs by
    the objects they address (:func:`storage.place`).

    Example:
        >>> _inside("s3://b/tok/packed", "S3A://b/tok/"), _inside("s3://b/tokb", "s3://b/tok"), _inside("t/./a", "t")
        (True, False, True)
    """
    a, b = str(inner), str(outer)
    if is_url(a) or is_url(b):
        if not (is_url(a) and is_url(b)):
            return False
        (pa_, ba, ka), (pb, bb, kb) = place(a), place(b)
        ka, kb = ka.strip("/"), kb.strip("/")
        return (pa_, ba) == (pb, bb) and ka != kb and (not kb or ka.startswith(kb + "/"))
    return Path(b).resolve() in Path(a).resolve().parents


def _not_an_input(out_dir: str | Path, inputs: list) -> None:
    """Refuse an output directory that is one of the tokenized directories the run reads (its
    state logic would take the tokenize run there for an earlier run of its own, and
    ``--overwrite`` would delete the very shards it is about to pack), lies inside one, or holds
    one: the tools that read a folder's Parquet files (``pyarrow.dataset``, pandas, duckdb,
    ``datasets``) would read tokenized and packed shards as one table."""
    for src in inputs:
        if _same_place(out_dir, src):
            raise ConfigError(f"-o {str(out_dir)!r} is the tokenized directory being packed; pack into another "
                              "directory (packed shards never share a directory with their input)")
        inside = _inside(out_dir, src)
        if inside or _inside(src, out_dir):
            where = "lies inside the tokenized directory" if inside else "holds the tokenized directory"
            raise ConfigError(f"-o {str(out_dir)!r} {where} {str(src)!r} being packed: a tool that reads a folder's "
                              "Parquet files (pyarrow.dataset, pandas, duckdb, datasets) would read the packed shards "
                              "with the tokenized ones; pack into a directory beside it")


def _layout_record(cfg: PackConfig) -> dict:
    """The packed manifest's schema version and layout (``runs``: version 6, ``full``: version 7)."""
    from .schema import LAYOUTS

    return {"schema_version": LAYOUTS[cfg.layout], "layout": cfg.layout}


def _relative_source(src: str, out_dir: str | Path) -> dict:
    """``{"relative": ...}``: a local tokenized directory as seen from the local packed directory
    (``../tok``), so readers of the pair find it from any working directory, and again once
    both are moved together; ``{}`` when either is in a bucket."""
    if is_url(src) or is_url(str(out_dir)):
        return {}
    return {"relative": os.path.relpath(Path(src).resolve(), Path(out_dir).resolve())}


@_environment_errors
def pack_dataset(
    src: str | os.PathLike | Iterable[str | os.PathLike] | Mixture,
    out_dir: str | Path,
    cfg: PackConfig,
    progress: Progress = None,
    overwrite: bool = False,
    dry_run: bool = False,
    media_root: str | Path | None = None,
    *,
    workers: int | None = None,
    executor: str = "local",
    ray_address: str | None = None,
    rank: int = 0,
    world_size: int = 1,
    max_errors: int | None = None,
    on_error: str = "skip",
    ex: ExecutorConfig | None = None,
) -> dict:
    """Pack tokenized shards into training sequences with an exact 2-D knapsack per pack.

    Each tokenized shard is one task, packed with its own buffer, so the output does not
    depend on how tasks are scheduled. ``pack_index`` is ``t * 1_000_000_000 + k`` for the
    ``k``-th pack of task ``t`` (which writes ``part-ttttt-*.parquet``): unique and rising in
    manifest order without any task waiting for another; a pack's position in the whole output
    is its row number counted through the manifest's shards. With ``dry_run`` only the length columns are
    read and nothing is written; the returned dict holds the same counts, plus ``plans``:
    the :class:`~packtool.packer.PackPlan` of each tokenized shard in manifest order
    (indices are rows of that shard), from which ``stats.plan_stats`` derives fill and padding.

    Returns the manifest; ``counts`` holds ``samples_in``, ``samples_packed``, ``packs``,
    ``dropped``, ``alone``, ``truncated``, ``tokens``, ``vision_units``, ``rejected``,
    ``rejected_by_reason``, ``lower_bound`` and ``tasks``.

    **Mixtures.** ``src`` may be a :class:`~packtool.mixture.Mixture` (or a list of tokenized
    directories: all at rate 1). The mixture step (:func:`~packtool.mixture.plan_mixture`)
    turns rates or target counts into one stream of sample references, which is cut into tasks
    of ``samples_per_task`` entries; each task packs its slice with its own buffer, so the
    bytes depend only on the mixture and its seed, never on workers or ranks. Copies get ids
    ``id#c1``, ``id#c2``, ...; packed rows hold ``sample_sources`` (schema ``PACKED_MIXTURE``); the manifest's
    ``mixture`` records each source's rate or target, ``available``, ``requested``,
    ``selected`` and ``realised`` counts (samples, tokens, vision units; loss tokens realised)
    and the seed. A single directory given as such is packed exactly as before.

    Args:
        src: a tokenized directory (or bucket prefix), a list of them (a mixture at rate 1
            each), or a :class:`~packtool.mixture.Mixture`.
        out_dir: the output directory (or bucket prefix); unused with ``dry_run``.
        cfg: the :class:`~packtool.config.PackConfig`.
        progress: called in this process with the number of samples just packed (an
            increment); ``progress.set_total(n)``, where it has one, gets the samples to expect.
        overwrite: replace a run made with other settings (only the files it wrote), or
            write into a non-empty directory that holds no packtool run.
        dry_run: plan only, write nothing (see above).
        media_root: where the media are now (default: the root tokenize counted from).
        workers, executor, ray_address, rank, world_size: where the tasks run (``--workers``
            ... ``--world-size``); ``ex``: the same as one
            :class:`~packtool.executors.ExecutorConfig`, which then replaces them.
        max_errors: fail once more rows than this are rejected (``None``: no limit).
        on_error: ``skip`` records a rejected row in ``.packtool/errors.jsonl``; ``fail`` stops.

    Raises:
        PacktoolError: a problem the user can fix (its message names the fix); a bad
            setting is a :class:`~packtool.errors.ConfigError` before anything is written.
    """
    _check_on_error(on_error)
    max_errors = _check_call(cfg, PackConfig, max_errors)
    ex = _executor(ex, workers, executor, ray_address, rank, world_size)
    if not isinstance(src, (str, os.PathLike, Mixture)):  # a list, a tuple, a generator of directories
        src = list(src)
        src = Mixture.from_rates(src) if len(src) != 1 else src[0]
    if not dry_run:
        _not_an_input(out_dir, [s.path for s in src.sources] if isinstance(src, Mixture) else [src])
    start_pool(ex, _PACKING)  # the workers' forkserver loads the kernels while this process reads the plan
    if isinstance(src, Mixture):
        return _pack_mixture(src, out_dir, cfg, progress, overwrite, dry_run, media_root, ex, max_errors, on_error)
    src_name = str(src)
    remote_src = is_url(src_name)
    # a bucket's tokenized shards are fetched by the tasks that read them, each checked by its sha256
    src = src_name.rstrip("/") if remote_src else Path(src)
    tok_manifest = fetch_manifest(src, "tokenized") if remote_src else read_manifest(src, "tokenized")
    max_units = cfg.max_vision_units
    if max_units is None:
        max_units = int(tok_manifest.get("vision", {}).get("default_max_vision_units") or 0)
    if cfg.text_weight < 1:
        raise ConfigError("--text-weight must be at least 1 so every sample has value to the packer")
    counted_root = as_root(str(tok_manifest["config"].get("media_root", "."))).resolve()
    root = as_root(str(media_root)).resolve() if media_root is not None else counted_root
    _check_media_root(root, media_root, tok_manifest)
    # media read from another root are copies: their sizes must match, their times cannot
    check_mtime = root == counted_root
    config = {**cfg.to_dict(), "max_vision_units": max_units, "source_digest": tok_manifest["config_digest"]}
    digest = config_digest(config)
    entries = tok_manifest["shards"]
    capacities = {"max_tokens": cfg.max_tokens, "max_vision_units": max_units}

    def make(t: int, out_dir: str | None) -> _PackTask:
        return _PackTask(t, str(join(src, entries[t]["file"])), out_dir, cfg, max_units, str(root), digest, max_errors,
                         on_error, check_mtime, entries[t], os.getcwd(), _rotates(tok_manifest))

    def check_shards() -> None:  # the cheap checks of every shard before any task starts (sha256 is per task)
        if remote_src:  # one listing: every shard there, of its size
            check_listed(src, entries)
            return
        for entry in entries:
            open_shard(src, entry)

    if dry_run:
        check_shards()
        dry = ExecutorConfig(executor=ex.executor, workers=ex.workers, ray_address=ex.ray_address)
        set_total(progress, sum(e["rows"] for e in entries))
        results = run_tasks(_pack_task, [make(t, None) for t in range(len(entries))], dry, progress, preload=_PACKING)
        counts = _zero_counts("packed")
        for r in results:
            _add_counts(counts, r["counts"])
        _planned(counts, max_errors, on_error)
        counts["lower_bound"] = _pack_bound(counts, cfg.max_tokens, max_units)
        counts["tasks"] = len(entries)
        return {"kind": "packed", "dry_run": True, "config": config, "capacities": capacities, "counts": counts,
                "vision": tok_manifest.get("vision"), "shards": [], "plans": [r["plan"] for r in results]}
    manifest_extra = {**_layout_record(cfg), "capacities": capacities, "tokenizer": tok_manifest.get("tokenizer"),
                      "vision": tok_manifest.get("vision"), "template": tok_manifest.get("template"),
                      "source": {"path": src_name, "config_digest": tok_manifest["config_digest"],
                                 **_relative_source(src_name, out_dir)}}
    run = {"kind": "packed", "config": config, "config_digest": digest, "world_size": ex.world_size,
           "n_tasks": len(entries), "tasks_digest": digest_of({"shards": [e["file"] for e in entries]}),
           "inputs": {e["file"]: e["sha256"] for e in entries}, "manifest": manifest_extra, "max_errors": max_errors}
    files = [e["file"] for e in entries]
    key = digest_of({"plan_version": PLAN_VERSION, "config_digest": digest, "inputs": run["inputs"], "tasks": files})
    with output_dir(out_dir, ex.rank, overwrite) as out:
        # one task per tokenized shard: the plan is the list of shards, checked once per run
        with stored_plan(out, "packed", key, lambda plan: plan.get("tasks") == files) as slot:
            if slot.plan is None:
                check_shards()
            done = prepare_run(out, run, overwrite)
            if done is not None:
                return _finished(done, out_dir, max_errors, on_error)
            state_prepared(out)
            slot.store({"kind": "packed", "key": key, "n_tasks": len(files), "tasks": files})
        driver = _Driver(out, digest, len(entries), ex, max_errors, on_error, out_dir)
        todo, _ = driver.pending()
        set_total(progress, sum(entries[t]["rows"] for t in todo))
        driver.run(_pack_task, [make(t, task_target(out)) for t in todo], todo, progress, preload=_PACKING)
        tasks_ran(out)
        return _finish_or_partial(out, run, ex)


# ============================================================================ pack: mixtures


@dataclass(frozen=True, slots=True)
class _MixSource:
    """One source as a mixture task sees it: its directory, its manifest's shards, its media, and
    the ids of its samples that a copy's name could clash with (``mixture.copy_name``)."""

    path: str
    entries: tuple[dict, ...]
    media_root: str
    check_mtime: bool
    copy_like: frozenset[str] = frozenset()
    rotate: bool | None = None  # whether its tokenize turned videos by their display rotation (_rotates)


@dataclass(frozen=True, slots=True)
class _MixTask:
    """A slice of the mixture stream: entry ``i`` is row ``row[i]`` (counted across the shards of
    source ``src[i]``), copy ``copy[i]``."""

    index: int
    sources: tuple[_MixSource, ...]
    src: np.ndarray
    row: np.ndarray
    copy: np.ndarray
    out_dir: str | None
    cfg: PackConfig
    max_units: int
    config_digest: str
    max_errors: int | None
    on_error: str
    cwd: str = "."  # the driver's working directory, which relative paths are relative to


#: Per-source counts a mixture task adds up (``{source position: n}`` each), moved into the
#: manifest's ``mixture.sources[i]`` by :func:`merge_output`.
_SOURCE_COUNTS = ("samples_in", "tokens_in", "vision_units_in", "samples", "tokens", "vision_units", "loss_tokens",
                  "rejected")


class _MixShards:
    """The shards a mixture task reads: each opened once (sha256 checked when writing), its
    length columns and media checks read once, each row group read when a chunk of packs first
    needs it and let go after the last chunk that needs it (holding only its waiting rows once
    most are packed), so memory follows the samples still to be packed, not the shards."""

    def __init__(self, task: _MixTask, verify: bool) -> None:
        self.task = task
        self.verify = verify
        self.open: dict[tuple[int, int], object] = {}
        self.group_starts: dict[tuple[int, int], np.ndarray] = {}
        self.columns: dict[tuple[int, int], list[str]] = {}  # each shard's assembly columns, named once
        self.cache: dict[int, object] = {}
        self.fetched: list[Path] = []  # this task's copies of shards in a bucket

    def file(self, s: int, k: int) -> str:
        return str(join(_at(self.task.sources[s].path, self.task.cwd), self.task.sources[s].entries[k]["file"]))

    def _open(self, s: int, k: int):
        source = self.task.sources[s]
        if not is_url(source.path):
            return open_shard(Path(_at(source.path, self.task.cwd)), source.entries[k], sha256=self.verify)
        import pyarrow.parquet as pq

        # a copy of this task's own, checked against the manifest's sha256: other tasks read the same shard
        local = fetch_shard(self.file(s, k), source.entries[k], private=True)
        self.fetched.append(local)
        return pq.ParquetFile(local, page_checksum_verification=True)

    def close(self) -> None:
        """Let go of every shard; remove the copies fetched from a bucket."""
        self.open.clear()
        self.cache.clear()
        for path in self.fetched:
            path.unlink(missing_ok=True)

    def get(self, s: int, k: int):
        pf = self.open.get((s, k))
        if pf is None:
            from .packer import assembly_columns

            pf = self._open(s, k)
            self.group_starts[(s, k)] = _group_starts(pf)
            self.columns[(s, k)] = assembly_columns(pf.schema_arrow)
            self.open[(s, k)] = pf
        return pf

    def groups(self, shard_key: np.ndarray, local: np.ndarray) -> np.ndarray:
        """The row group of each entry (``shard_key`` is ``source << 32 | shard``)."""
        groups = np.empty(len(local), np.int64)
        for sk in np.unique(shard_key).tolist():
            at = shard_key == sk
            self.get(sk >> 32, sk & 0xFFFFFFFF)
            groups[at] = np.searchsorted(self.group_starts[(sk >> 32, sk & 0xFFFFFFFF)], local[at], side="right") - 1
        return groups

    def take(self, gid: np.ndarray, pairs: np.ndarray, local: np.ndarray, future: dict[int, np.ndarray]):
        """Tables holding the entries of row groups ``gid`` (``pairs[:, gid]`` is ``(shard_key,
        group)``) at shard rows ``local``, and each entry's position across them.

        ``future[u]`` lists the shard rows later chunks still take from group ``u`` (empty: let it
        go). A group most of whose rows are packed keeps only those rows (a small copy), so a
        sample that waits long in the packing buffer does not hold its whole row group.
        """
        import pyarrow as pa

        wanted, inverse = np.unique(gid, return_inverse=True)
        tables, bases, held = [], [], []
        base = 0
        for u in wanted.tolist():
            sk, g = int(pairs[0, u]), int(pairs[1, u])
            s, k = sk >> 32, sk & 0xFFFFFFFF
            entry = self.cache.get(u)
            if entry is None:
                try:
                    pf = self.get(s, k)
                    table = pf.read_row_group(g, columns=self.columns[(s, k)], use_threads=False)
                except (pa.ArrowException, OSError) as exc:
                    raise shard_error(self.file(s, k), exc) from None
                lo = int(self.group_starts[(s, k)][g])
                entry = self.cache[u] = (table, np.arange(lo, lo + table.num_rows, dtype=np.int64))
            tables.append(entry[0])
            held.append(entry[1])
            bases.append(base)
            base += entry[0].num_rows
        where = np.empty(len(gid), np.int64)
        for j, rows in enumerate(held):
            at = inverse.reshape(-1) == j
            where[at] = bases[j] + np.searchsorted(rows, local[at])
        for u in wanted.tolist():
            later = future.get(u)
            table, rows = self.cache[u]
            if later is None or not len(later):
                del self.cache[u]
            elif len(later) * 4 <= len(rows):
                self.cache[u] = (table.take(np.searchsorted(rows, later)), later)
        return tables, where


def _mix_task(task: _MixTask, report: Callable[[int], None]) -> dict:
    """One mixture pack task: its stream slice → planned packs → ``part-TTTTT-*.parquet`` + marker.

    Like :func:`_pack_task`, but the samples come from several shards of several sources, a
    sample may appear more than once (its copies get ids ``id#c1``, ...), and each packed row carries
    ``sample_sources``. Counts are kept per source for the manifest's ``mixture`` record.
    """
    def attempt(once: Callable[[int], None], undecodable: dict[int, tuple[str, str]]) -> dict:
        shards = _MixShards(task, verify=task.out_dir is not None)
        try:
            return _mix_shards(task, once, shards, undecodable)
        finally:
            shards.close()

    return _without_undecodable(report, attempt, lambda known: _undecodable_mixed(task, known))


def _stream_places(task: _MixTask) -> tuple[np.ndarray, np.ndarray]:
    """Each stream entry's shard in its source (the manifest's order) and its row in that shard."""
    shard = np.empty(len(task.src), np.int64)
    local = np.empty(len(task.src), np.int64)
    for s, ms in enumerate(task.sources):
        at = task.src == s
        if at.any():
            starts = np.concatenate([[0], np.cumsum([e["rows"] for e in ms.entries])]).astype(np.int64)
            shard[at] = np.searchsorted(starts, task.row[at], side="right") - 1
            local[at] = task.row[at] - starts[shard[at]]
    return shard, local


def _undecodable_mixed(task: _MixTask, known: set[int]) -> dict[int, tuple[str, str]]:
    """:func:`_undecodable_videos` for a mixture task: ``{entry: (reason, message)}`` of its
    stream entries (but ``known``) whose sample holds a video whose frames do not decode, each
    sample's media read once from its source shard and decoded with that source's loader (every
    copy of a sample gets the same answer)."""
    shards = _MixShards(task, verify=False)
    try:
        shard, rows = _stream_places(task)
        found: dict[int, tuple[str, str]] = {}
        for s in np.unique(task.src).tolist():
            loader = _media_loader(as_root(task.sources[s].media_root), task.cfg.frame_quality,
                                   rotate=task.sources[s].rotate)
            for k in np.unique(shard[task.src == s]).tolist():
                pf = shards.get(s, k)
                media = pf.read(columns=["media"], use_threads=False).column("media")
                at = np.flatnonzero((task.src == s) & (shard == k))
                answers: dict[int, tuple[str, str] | None] = {}
                for i, r in zip(at.tolist(), rows[at].tolist(), strict=True):
                    if r not in answers:
                        answers[r] = _undecodable_in(media[r].as_py(), loader)
                    if i not in known and answers[r] is not None:
                        found[i] = answers[r]
        return found
    finally:
        shards.close()


def _mix_shards(task: _MixTask, report: Callable[[int], None], shards: _MixShards,
                undecodable: dict[int, tuple[str, str]]) -> dict:
    """:func:`_mix_task`'s one attempt with its shards at hand, the stream entries in
    ``undecodable`` rejected up front.

    Raises:
        packer.UndecodableMedia: a sample's media did not decode as its pack was assembled; its
            ``row`` is the sample's entry in the task's stream.
    """
    import pyarrow as pa

    from .mixture import copy_name
    from .packer import PackPlan, UndecodableMedia, assemble_packs
    from .runs import loss_tokens
    from .schema import packed_schema

    schema = packed_schema(task.cfg.layout, mixture=True)

    cfg = task.cfg
    n = len(task.src)
    n_src = len(task.sources)
    shard, local = _stream_places(task)
    shard_key = task.src.astype(np.int64) << 32 | shard
    tokens = np.zeros(n, np.int64)
    units = np.zeros(n, np.int64)
    has_media = np.zeros(n, bool)
    bad: dict[int, tuple[str, str]] = {}
    for sk in np.unique(shard_key).tolist():
        s, k = sk >> 32, sk & 0xFFFFFFFF
        at = np.flatnonzero(shard_key == sk)
        pf = shards.get(s, k)
        try:
            lengths = pf.read(columns=["n_tokens", "n_vision_units"], use_threads=False)
            tokens[at] = lengths["n_tokens"].to_numpy()[local[at]]
            units[at] = lengths["n_vision_units"].to_numpy()[local[at]]
            media = _media_leaves(pf)
            has_media[at] = _has_media(media)[local[at]]
            problems = _media_problems(media, as_root(task.sources[s].media_root), task.sources[s].check_mtime)
            if cfg.oversize == "truncate":
                # as one directory's pack does: a cut that keeps no target is no_loss, not a pack of 0/0 loss;
                # the shard's rows this task does not take are no candidates (their row groups stay unread)
                in_task = np.zeros(pf.metadata.num_rows, np.int64)
                in_task[local[at]] = lengths["n_tokens"].to_numpy()[local[at]]
                problems.update(_cut_to_nothing(pf, in_task, lengths["n_vision_units"].to_numpy(), _has_media(media),
                                                problems, cfg.max_tokens, task.max_units))
        except (pa.ArrowException, KeyError) as exc:
            raise shard_error(shards.file(s, k), exc) from None
        if problems:
            for i, r in zip(at.tolist(), local[at].tolist(), strict=True):
                if r in problems:
                    bad[i] = problems[r]
    bad.update(undecodable)
    plan = _plan_kept(tokens, units, has_media, bad, cfg, task.max_units)
    if plan.n_packs >= PACK_INDEX_STRIDE:
        raise ConfigError(f"{plan.n_packs:,} packs from one mixture task; lower --samples-per-task")
    eff = tokens.copy()
    if plan.truncated:
        eff[plan.truncated] = np.minimum(eff[plan.truncated], cfg.max_tokens)
    rejected = sorted(set(plan.dropped) | set(bad))
    by_reason = Counter({"oversize": len(plan.dropped)} if plan.dropped else {})
    by_reason.update(reason for reason, _ in bad.values())

    def per_source(idx, weights=None) -> dict:
        idx = np.asarray(idx, np.int64)
        w = None if weights is None else np.asarray(weights, np.float64)
        got = np.bincount(task.src[idx], weights=w, minlength=n_src) if len(idx) else np.zeros(n_src)
        return {str(i): int(v) for i, v in enumerate(got.tolist())}

    every = np.arange(n)
    counts = {"samples_in": n, "samples_packed": len(plan.order), "packs": plan.n_packs,
              "dropped": len(plan.dropped), "alone": len(plan.alone), "truncated": len(plan.truncated),
              "tokens": int(eff[plan.order].sum()), "vision_units": int(units[plan.order].sum()),
              "alone_tokens": int(eff[plan.alone].sum()) if plan.alone else 0,
              "alone_vision_units": int(units[plan.alone].sum()) if plan.alone else 0,
              "rejected": len(rejected), "rejected_by_reason": dict(sorted(by_reason.items())),
              "source_samples_in": per_source(every), "source_tokens_in": per_source(every, tokens),
              "source_vision_units_in": per_source(every, units), "source_samples": per_source(plan.order),
              "source_tokens": per_source(plan.order, eff[plan.order]),
              "source_vision_units": per_source(plan.order, units[plan.order]),
              "source_rejected": per_source(rejected)}
    if task.out_dir is None:
        report(n)
        return {"task": task.index, "counts": counts, "plan": plan}
    out = task_dir(_at(task.out_dir, task.cwd))
    _clear_if_repeated(out, task, again=bool(undecodable))
    errors = _TaskErrors(out, task.index, task.max_errors, task.on_error)
    loss = np.zeros(n_src, np.int64)
    try:
        if rejected:
            ids: dict[int, object] = {}
            for i in rejected:
                s, k = int(task.src[i]), int(shard[i])
                sk = int(shard_key[i])
                if sk not in ids:
                    ids[sk] = shards.get(s, k).read(columns=["sample_id", "source", "source_row"])
                t, r = ids[sk], int(local[i])
                reason, message, over = _why_rejected(i, bad, tokens, units, cfg.max_tokens, task.max_units)
                sid = copy_name(t["sample_id"][r].as_py(), int(task.copy[i]), task.sources[s].copy_like)
                errors.add(Rejected(t["source"][r].as_py(), t["source_row"][r].as_py(), sid, reason,
                                    f"mixture source {_source_name(task, s)}: {message}"), over)
            report(len(rejected))
        copy_like = _copy_like(task.sources)
        roots = [as_root(ms.media_root) for ms in task.sources]
        loaders = ([_media_loader(r, cfg.frame_quality, len(roots), ms.rotate) for r, ms in zip(roots, task.sources, strict=True)]
                   if cfg.media == "embed" else None)
        truncated = set(plan.truncated)
        bounds = [s + k for s in range(0, plan.n_packs, cfg.packs_per_shard)
                  for k in range(0, min(cfg.packs_per_shard, plan.n_packs - s), PACK_CHUNK)]
        # each row group the packs draw from, and per chunk the rows later chunks still take from it
        order = plan.order
        pairs, gid = np.unique(np.stack([shard_key[order], shards.groups(shard_key[order], local[order])]), axis=1,
                               return_inverse=True)
        gid = gid.reshape(-1)
        # positions of each group's entries, ascending: group u's are by_group[first[u]:first[u + 1]]
        by_group = np.argsort(gid, kind="stable")
        first = np.searchsorted(gid[by_group], np.arange(pairs.shape[1] + 1))
        with ShardWriter(out, schema, rows_per_shard=cfg.packs_per_shard, row_group_rows=PACKED_GROUP_ROWS,
                         prefix=task_prefix(task.index)) as writer:
            for p0, p1 in zip(bounds, [*bounds[1:], plan.n_packs][:len(bounds)], strict=True):
                a, b = plan.offsets[p0], plan.offsets[p1]
                rows = order[a:b]
                future = {}
                for u in np.unique(gid[a:b]).tolist():
                    pos = by_group[first[u]:first[u + 1]]
                    future[u] = np.unique(local[order[pos[np.searchsorted(pos, b):]]])
                tables, where = shards.take(gid[a:b], pairs, local[rows], future)
                for s, root in enumerate(roots if loaders is not None else []):
                    if not isinstance(root, Path) and (task.src[rows] == s).any():
                        _prefetch_media(root, tables, where[task.src[rows] == s], loaders[s])
                sub = PackPlan(where, plan.offsets[p0:p1 + 1] - plan.offsets[p0],
                               truncated=[int(where[k]) for k, r in enumerate(rows.tolist()) if r in truncated]
                               if truncated else [])
                try:
                    table = assemble_packs(tables, sub, task.index * PACK_INDEX_STRIDE + p0, None, cfg.max_tokens,
                                           layout=cfg.layout,
                                           media_loaders=None if loaders is None else (loaders, task.src[rows]))
                except UndecodableMedia as err:
                    err.row = int(rows[err.sample])
                    raise
                writer.write_table(_mixture_columns(table, task.src[rows], task.copy[rows], schema, task.sources,
                                                    copy_like))
                per_sample = loss_tokens(table, eff[rows])
                loss += np.bincount(task.src[rows], weights=per_sample, minlength=n_src).astype(np.int64)
                report(len(rows))
        errors.commit()
    except BaseException:
        errors.abort()
        raise
    counts["source_loss_tokens"] = {str(i): int(v) for i, v in enumerate(loss.tolist())}
    record = {"task": task.index, "config_digest": task.config_digest, "shards": writer.shards, "counts": counts,
              "errors_bytes": errors.bytes, "ran_on": worker_place()}
    publish_task(task.out_dir, out, task.index, record)
    return record


def _source_name(task: _MixTask, s: int) -> str:
    return f"{s} ({task.sources[s].path!r})"


def _copy_like_ids(source: _MixSource) -> frozenset[str]:
    """The ids of ``source``'s samples that a copy's name could be (``mixture.COPY_LIKE``, almost
    always none), from the ``sample_id`` column of each of its shards: the driver reads them once
    for a source the mixture copies, so that every task names the copies alike."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from .mixture import COPY_LIKE
    from .storage import filesystem, storage_errors

    found: set[str] = set()
    for entry in source.entries:
        file = join(source.path, entry["file"])
        try:
            if is_url(source.path):  # the one column, by ranged reads: the tasks fetch whole shards
                fs, key = filesystem(str(file))
                with storage_errors(str(file)), fs.open(key, "rb") as fh:
                    ids = pq.ParquetFile(fh).read(columns=["sample_id"], use_threads=False)["sample_id"]
            else:
                ids = open_shard(Path(source.path), entry).read(columns=["sample_id"], use_threads=False)["sample_id"]
        except (pa.ArrowException, OSError, KeyError) as exc:
            raise shard_error(file, exc) from None
        found.update(ids.filter(pc.match_substring_regex(ids, COPY_LIKE)).to_pylist())
    return frozenset(found)


def _copy_like(sources: tuple[_MixSource, ...]):
    """Every source's ``copy_like`` ids as one Arrow array for ``is_in`` (None when there are none, as is usual)."""
    import pyarrow as pa

    taken = set().union(*(ms.copy_like for ms in sources))
    return pa.array(sorted(taken), pa.string()) if taken else None


def _mixture_columns(table, src: np.ndarray, copy: np.ndarray, schema, sources: tuple[_MixSource, ...] = (),
                     copy_like=None):
    """``table`` (``PACKED``) with copies' ids suffixed ``#c1``, ``#c2``, ... and a ``sample_sources``
    column. A copy whose name a sample of its source bears takes ``mixture.copy_name``'s
    ``#cN#dK`` (``copy_like``: :func:`_copy_like` of ``sources``)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from .mixture import copy_name, copy_suffixes

    ids = table.column("sample_ids").combine_chunks()
    offsets = ids.offsets
    flat = pc.list_flatten(ids)
    copied = copy != 0
    if bool(copied.any()):
        joined = pc.binary_join_element_wise(flat, pa.array(copy_suffixes(copy), pa.string()), "")
        if copy_like is not None:
            clash = np.flatnonzero(copied & pc.is_in(joined, value_set=copy_like).to_numpy(zero_copy_only=False))
            if len(clash):  # rare: the names of those, under their own source's ids
                names, plain = joined.to_pylist(), flat.to_pylist()
                for i in clash.tolist():
                    names[i] = copy_name(plain[i], int(copy[i]), sources[int(src[i])].copy_like)
                joined = pa.array(names, pa.string())
        flat = joined
    cols = {name: table.column(name) for name in table.column_names}
    cols["sample_ids"] = pa.ListArray.from_arrays(offsets, flat)
    cols["sample_sources"] = pa.ListArray.from_arrays(offsets, pa.array(np.asarray(src, np.int32)))
    return pa.Table.from_arrays([cols[f.name] for f in schema], schema=schema)


def _compatible(first: tuple[str, dict], other: tuple[str, dict]) -> None:
    """Refuse sources tokenized with another tokenizer, template or vision settings, naming both."""
    (a, ma), (b, mb) = first, other
    for key, what in (("tokenizer", "tokenizer"), ("template", "chat template"), ("vision", "model / vision settings")):
        va, vb = ma.get(key) or {}, mb.get(key) or {}
        if va != vb:
            # the name first: the model or tokenizer itself, then the settings that differ
            keys = sorted((k for k in set(va) | set(vb) if va.get(k) != vb.get(k)), key=lambda k: (k != "name", k))
            diff = "; ".join(f"{k}: {va.get(k)!r} vs {vb.get(k)!r}" for k in keys[:3])
            diff += f" and {len(keys) - 3} more" if len(keys) > 3 else ''
            raise ConfigError(f"mixture sources {a!r} and {b!r} were tokenized with a different {what} ({diff}); "
                              f"one pack holds one model's tokens, so re-tokenize {b!r} with the settings of {a!r} "
                              "(or pack them separately)")


def _source_place(src: str, out_dir: str | Path) -> str:
    """A mixture source as its run's config records it: a local directory by its path from the
    local output directory (``../tok_a``), so the same directories written another way (absolute
    or relative, from another working directory, or both moved together) are the same run and
    resume; a bucket prefix as written, and a local source of a bucket output by its real path.

    Example:
        >>> _source_place("s3://b/tok/", "out")
        's3://b/tok'
    """
    if is_url(src):
        return src.rstrip("/")
    if is_url(str(out_dir)):
        return str(Path(src).resolve())
    return os.path.relpath(Path(src).resolve(), Path(out_dir).resolve())


def _mixture_record(mix: dict, counts: dict, loss: bool = True) -> dict:
    """The manifest's ``mixture``, each source with ``realised`` counts moved out of ``counts``
    (without ``loss_tokens`` for a dry run, which assembles nothing to count them on)."""
    per = {k: counts.pop(f"source_{k}", {}) for k in _SOURCE_COUNTS}
    sources = []
    for i, s in enumerate(mix["sources"]):
        got = {k: int(per[k].get(str(i), 0)) for k in _SOURCE_COUNTS}
        sources.append({**s, "selected": {"samples": got["samples_in"], "tokens": got["tokens_in"],
                                          "vision_units": got["vision_units_in"]},
                        "realised": {"samples": got["samples"], "tokens": got["tokens"],
                                     "vision_units": got["vision_units"],
                                     **({"loss_tokens": got["loss_tokens"]} if loss else {}),
                                     "rejected": got["rejected"]}})
    return {**mix, "sources": sources}


def _pack_mixture(mixture, out_dir: str | Path, cfg: PackConfig, progress: Progress, overwrite: bool, dry_run: bool,
                  media_root: str | Path | None, ex: ExecutorConfig, max_errors: int | None, on_error: str) -> dict:
    """``pack_dataset`` for a :class:`~packtool.mixture.Mixture` (see there)."""
    from .mixture import plan_mixture

    if media_root is not None and len(mixture.sources) > 1:
        raise ConfigError("--media-root applies to one tokenized directory; a mixture reads each source's media "
                          "from the root its tokenize run used (re-tokenize a source whose media moved)")
    manifests = []
    for s in mixture.sources:
        if is_url(s.path):  # a tokenized run in a bucket: its manifest now, each task fetches its shards
            manifests.append(fetch_manifest(s.path.rstrip("/"), "tokenized"))
            continue
        path = Path(s.path)
        if not path.is_dir():
            raise InputError(f"mixture source {s.path!r} is not a directory; give the output directory of "
                             "packtool tokenize (mixture-file paths are relative to the file)")
        manifests.append(read_manifest(path, "tokenized"))
    for s, m in zip(mixture.sources[1:], manifests[1:], strict=True):
        _compatible((mixture.sources[0].path, manifests[0]), (s.path, m))
    first = manifests[0]
    max_units = cfg.max_vision_units
    if max_units is None:
        max_units = int(first.get("vision", {}).get("default_max_vision_units") or 0)
    if cfg.text_weight < 1:
        raise ConfigError("--text-weight must be at least 1 so every sample has value to the packer")
    refs = []
    for s, m in zip(mixture.sources, manifests, strict=True):
        counted = as_root(str(m["config"].get("media_root", "."))).resolve()
        root = as_root(str(media_root)).resolve() if media_root is not None else counted
        _check_media_root(root, media_root, m)
        if is_url(s.path):  # one listing: every shard there, of its size (the sha256 is per task)
            check_listed(s.path.rstrip("/"), m["shards"])
        else:
            for entry in m["shards"]:
                open_shard(Path(s.path), entry)
        refs.append(_MixSource(s.path.rstrip("/") if is_url(s.path) else s.path, tuple(m["shards"]), str(root),
                               root == counted, rotate=_rotates(m)))
    available = [sum(e["rows"] for e in m["shards"]) for m in manifests]
    plan = plan_mixture(mixture, available)
    mix = mixture.to_dict()
    for d, m, n, want in zip(mix["sources"], manifests, available, plan.requested, strict=True):
        d.update(config_digest=m["config_digest"], available=n, requested=want)
    # the config (what a resume compares) names each source as seen from the output, not as this
    # command wrote it: the manifest's mixture keeps the paths as given, for people to read
    places = [_source_place(s.path, out_dir) for s in mixture.sources]
    config = {**cfg.to_dict(), "max_vision_units": max_units,
              "mixture": {**mix, "sources": [{**d, "path": p} for d, p in zip(mix["sources"], places, strict=True)]}}
    digest = config_digest(config)
    capacities = {"max_tokens": cfg.max_tokens, "max_vision_units": max_units}
    for d, m in zip(mix["sources"], manifests, strict=True):
        # the rows tokenize read and rejected, for stats --fail-above-rejected (the manifest's
        # mixture only: the config names the source's run by its config_digest already)
        c = m.get("counts", {})
        d["tokenized"] = {"rows_in": int(c.get("rows_in", int(c.get("samples", 0)) + int(c.get("rejected", 0)))),
                          "rejected": int(c.get("rejected", 0)),
                          "rejected_by_reason": dict(sorted((c.get("rejected_by_reason") or {}).items()))}

    def make(t: int, out_dir: str | None, sources: tuple[_MixSource, ...]) -> _MixTask:
        src, row, copy = plan.tasks[t]
        return _MixTask(t, sources, src, row, copy, out_dir, cfg, max_units, digest, max_errors, on_error, os.getcwd())

    n_tasks = len(plan.tasks)
    if dry_run:
        dry = ExecutorConfig(executor=ex.executor, workers=ex.workers, ray_address=ex.ray_address)
        set_total(progress, sum(len(t[0]) for t in plan.tasks))
        results = run_tasks(_mix_task, [make(t, None, tuple(refs)) for t in range(n_tasks)], dry, progress,
                            preload=_PACKING)
        counts = _zero_counts("packed")
        for r in results:
            _add_counts(counts, r["counts"])
        _planned(counts, max_errors, on_error)
        record = _mixture_record(mix, counts, loss=False)
        counts["lower_bound"] = _pack_bound(counts, cfg.max_tokens, max_units)
        counts["tasks"] = n_tasks
        return {"kind": "packed", "dry_run": True, "config": config, "capacities": capacities, "counts": counts,
                "vision": first.get("vision"), "mixture": record, "shards": []}
    manifest_extra = {**_layout_record(cfg), "capacities": capacities, "tokenizer": first.get("tokenizer"),
                      "vision": first.get("vision"),
                      "template": first.get("template"), "mixture": mix}
    inputs = {str(join(p, e["file"])): e["sha256"] for p, m in zip(places, manifests, strict=True) for e in m["shards"]}
    run = {"kind": "packed", "config": config, "config_digest": digest, "world_size": ex.world_size,
           "n_tasks": n_tasks, "tasks_digest": plan.digest(), "inputs": inputs, "manifest": manifest_extra,
           "max_errors": max_errors}
    with output_dir(out_dir, ex.rank, overwrite) as out:
        done = prepare_run(out, run, overwrite)
        if done is not None:
            return _finished(done, out_dir, max_errors, on_error)
        state_prepared(out)
        driver = _Driver(out, digest, n_tasks, ex, max_errors, on_error, out_dir)
        todo, _ = driver.pending()
        # a source the mixture copies (more entries than samples): the ids its copies must not take
        named = tuple(replace(ms, copy_like=_copy_like_ids(ms)) if want > n else ms
                      for ms, n, want in zip(refs, available, plan.requested, strict=True)) if todo else ()
        set_total(progress, sum(len(plan.tasks[t][0]) for t in todo))
        driver.run(_mix_task, [make(t, task_target(out), named) for t in todo], todo, progress, preload=_PACKING)
        tasks_ran(out)
        return _finish_or_partial(out, run, ex)
