"""Shard writer and reader as a pair: atomic shards, manifest last, sha256 per shard.

A shard is written as ``.part-NNNNN.parquet.<pid>.tmp`` and renamed into place only once
closed; ``.packtool/manifest.json`` is written (atomically too) after every shard is in place.
Readers trust the manifest: a shard not listed there does not exist.

Everything that is not a shard lives in the hidden ``.packtool/`` folder (manifest, rejected
rows, run state), so the output directory itself is a Parquet dataset: pandas, pyarrow,
duckdb and Hugging Face ``datasets`` open it by its path and see only the shards' rows.
Directories written before that layout (``manifest.json`` and ``errors.jsonl`` beside the
shards) are still read.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import __version__
from .config import config_diff
from .errors import InputError, OutputError, ResumeMismatchError
from .schema import READABLE_VERSIONS, SCHEMA_VERSION

__all__ = [
    "ShardWriter",
    "shard_name",
    "write_manifest",
    "read_manifest",
    "sha256_file",
    "prepare_run",
    "read_run",
    "task_prefix",
    "marker_path",
    "task_errors_path",
    "clear_task",
    "write_marker",
    "read_marker",
    "atomic_write_text",
    "iter_shard_tables",
    "MANIFEST",
    "ERRORS",
    "STATE_DIR",
    "LEGACY_MANIFEST",
    "LEGACY_ERRORS",
    "manifest_path",
    "errors_path",
    "is_output_dir",
]

#: Per-run state (run settings, completion markers, per-task errors) and the run's published
#: files; hidden, so dataset readers that open the directory see only the shards.
STATE_DIR = ".packtool"
#: The manifest, relative to the output directory: written last, lists every shard.
MANIFEST = f"{STATE_DIR}/manifest.json"
#: Every rejected input row of the run, one JSON line each, relative to the output directory.
ERRORS = f"{STATE_DIR}/errors.jsonl"
#: Where directories written by packtool before the hidden layout keep them (still read).
LEGACY_MANIFEST = "manifest.json"
LEGACY_ERRORS = "errors.jsonl"
RUN_STATE = "run.json"

# Fixed writer options: the same rows always give the same bytes.
_WRITE_OPTS = dict(compression="zstd", compression_level=1, use_dictionary=False, write_statistics=False,
                   data_page_version="2.0", store_schema=True)


def manifest_path(out_dir: str | Path) -> Path:
    """The manifest file of an output directory: ``.packtool/manifest.json``, or the top-level
    ``manifest.json`` of a directory written before the hidden layout, when only that exists."""
    out_dir = Path(out_dir)
    legacy = out_dir / LEGACY_MANIFEST
    current = out_dir / MANIFEST
    return legacy if not current.is_file() and legacy.is_file() else current


def errors_path(out_dir: str | Path) -> Path:
    """The rejected-rows file of an output directory (``.packtool/errors.jsonl``; legacy: ``errors.jsonl``)."""
    out_dir = Path(out_dir)
    legacy = out_dir / LEGACY_ERRORS
    current = out_dir / ERRORS
    return legacy if not current.is_file() and legacy.is_file() else current


def is_output_dir(path: str | Path) -> bool:
    """Whether ``path`` is a packtool output directory (finished or not, any layout)."""
    path = Path(path)
    return (path / STATE_DIR / RUN_STATE).is_file() or (path / MANIFEST).is_file() or (path / LEGACY_MANIFEST).is_file()


def shard_name(index: int, prefix: str = "part") -> str:
    return f"{prefix}-{index:05d}.parquet"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to a unique temporary name, fsync, and rename it over ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def row_bytes(table: pa.Table) -> np.ndarray:
    """Payload bytes of each row: list values at their width, binaries at their length.

    A function of the rows alone (not of how they were batched), so row groups cut by it
    are the same whatever produced the table.

    Example:
        >>> row_bytes(pa.table({"ids": pa.array([[1, 2, 3], []], pa.list_(pa.int32()))})).tolist()
        [12, 0]
    """
    sizes = np.zeros(table.num_rows, dtype=np.int64)
    for col in table.columns:
        chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]  # no copy into one chunk
        parts = [_array_bytes(c) for c in chunks if len(c)]
        if parts:
            sizes += np.concatenate(parts)
    return sizes


def _array_bytes(arr: pa.Array) -> np.ndarray:
    import pyarrow.compute as pc

    t = arr.type
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False).astype(np.int64)
        vt = t.value_type
        if pa.types.is_integer(vt) or pa.types.is_floating(vt):  # fixed width: no need to look inside
            return lengths * (vt.bit_width // 8)
        inner = _array_bytes(pc.list_flatten(arr))
        ends = np.cumsum(lengths)
        csum = np.concatenate([[0], np.cumsum(inner)])
        return csum[ends] - csum[ends - lengths]
    if pa.types.is_struct(t):
        out = np.zeros(len(arr), dtype=np.int64)
        for i in range(t.num_fields):
            out += _array_bytes(arr.field(i))
        return out
    if pa.types.is_binary(t) or pa.types.is_string(t) or pa.types.is_large_binary(t) or pa.types.is_large_string(t):
        return pc.fill_null(pc.binary_length(arr), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    width = getattr(t, "bit_width", 64)
    return np.full(len(arr), max(1, width // 8), dtype=np.int64)


class ShardWriter:
    """Writes rows to numbered Parquet shards of at most ``rows_per_shard`` rows each.

    Row groups hold ``row_group_rows`` rows, or fewer when their payload would pass
    ``max_group_bytes`` (packs with embedded media), so memory stays bounded; both cuts
    depend only on the rows, so the bytes are deterministic.

    Example:
        >>> with ShardWriter(out, schema, rows_per_shard=1000) as w:   # doctest: +SKIP
        ...     w.write_rows(rows)
        >>> w.shards   # [{"file": "part-00000.parquet", "rows": ..., "bytes": ..., "sha256": ...}]
    """

    def __init__(self, out_dir: Path, schema: pa.Schema, rows_per_shard: int, row_group_rows: int = 1024,
                 prefix: str = "part", first_index: int = 0, max_group_bytes: int = 64 << 20) -> None:
        self.out_dir = Path(out_dir)
        self.schema = schema
        self.rows_per_shard = rows_per_shard
        self.row_group_rows = max(1, min(row_group_rows, rows_per_shard))
        self.prefix = prefix
        self.shards: list[dict] = []
        self._index = first_index
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self._pending_bytes = np.zeros(0, dtype=np.int64)
        self.max_group_bytes = max_group_bytes
        self._writer: pq.ParquetWriter | None = None
        self._rows_in_shard = 0

    def _tmp(self) -> Path:
        # the pid keeps two writers of one shard (a resumed run and a straggler of the
        # killed one) apart; both rename identical bytes into place
        return self.out_dir / f".{shard_name(self._index, self.prefix)}.{os.getpid()}.tmp"

    def write_table(self, table: pa.Table) -> None:
        """Append rows; shards and row groups are cut at fixed row counts, so output is deterministic."""
        table = table.cast(self.schema) if table.schema != self.schema else table
        sizes = row_bytes(table)
        offset = 0
        while offset < table.num_rows:
            room = self.rows_per_shard - self._rows_in_shard - self._pending_rows
            take = min(room, table.num_rows - offset)
            self._pending.append(table.slice(offset, take))
            self._pending_rows += take
            self._pending_bytes = np.concatenate([self._pending_bytes, sizes[offset:offset + take]])
            offset += take
            self._flush_groups(final=False)
            if self._rows_in_shard + self._pending_rows >= self.rows_per_shard:
                self._close_shard()

    def write_rows(self, rows: list[dict]) -> None:
        if rows:
            self.write_table(pa.Table.from_pylist(rows, schema=self.schema))

    def _group_cut(self) -> int:
        """Rows of the next row group: up to ``row_group_rows``, within ``max_group_bytes`` (at least 1)."""
        n = min(self.row_group_rows, self._pending_rows)
        over = np.flatnonzero(np.cumsum(self._pending_bytes[:n]) > self.max_group_bytes)
        return max(1, int(over[0])) if len(over) else n

    def _flush_groups(self, final: bool) -> None:
        while self._pending_rows and (final or self._pending_rows >= self.row_group_rows
                                      or self._group_cut() < self._pending_rows):
            table = pa.concat_tables(self._pending)
            n = self._group_cut()
            if self._writer is None:
                tmp = self._tmp()
                self._writer = pq.ParquetWriter(tmp, self.schema, **_WRITE_OPTS)
            self._writer.write_table(table.slice(0, n).combine_chunks(), row_group_size=n)
            self._rows_in_shard += n
            rest = table.slice(n)
            self._pending = [rest] if rest.num_rows else []
            self._pending_rows = rest.num_rows
            self._pending_bytes = self._pending_bytes[n:]

    def _close_shard(self) -> None:
        self._flush_groups(final=True)
        if self._writer is None:
            return
        self._writer.close()
        self._writer = None
        name = shard_name(self._index, self.prefix)
        tmp = self._tmp()
        final = self.out_dir / name
        os.replace(tmp, final)
        self.shards.append({"file": name, "rows": self._rows_in_shard, "bytes": final.stat().st_size, "sha256": sha256_file(final)})
        self._index += 1
        self._rows_in_shard = 0

    def close(self) -> list[dict]:
        self._close_shard()
        return self.shards

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        elif self._writer is not None:
            self._writer.close()
            self._tmp().unlink(missing_ok=True)


def write_manifest(out_dir: Path, kind: str, config: dict, config_digest: str, shards: list[dict], **extra) -> dict:
    manifest = {
        "kind": kind,
        "schema_version": SCHEMA_VERSION,
        "packtool_version": __version__,
        "config": config,
        "config_digest": config_digest,
        **extra,
        "shards": shards,
    }
    (Path(out_dir) / STATE_DIR).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(out_dir) / MANIFEST, json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return manifest


def read_manifest(path: Path, kind: str | None = None) -> dict:
    """Read ``path/.packtool/manifest.json`` (or a legacy ``path/manifest.json``) and check its kind and schema version."""
    file = manifest_path(path)
    if not file.is_file():
        raise InputError(f"{str(path)!r} has no {MANIFEST}; is it the output of packtool tokenize/pack, and did that run finish?")
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise InputError(f"{file}: manifest is not valid JSON ({exc}); re-run the command that wrote it") from None
    readable = READABLE_VERSIONS.get(manifest.get("kind"), (SCHEMA_VERSION,))
    if manifest.get("schema_version") not in readable:
        raise InputError(
            f"{file}: {manifest.get('kind')} schema version {manifest.get('schema_version')!r}, this packtool reads "
            f"{' or '.join(map(str, readable))}; re-run the stage with this version"
        )
    if kind is not None and manifest.get("kind") != kind:
        raise InputError(f"{str(path)!r} holds {manifest.get('kind')} shards, expected {kind} shards")
    return manifest


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        for child in path.iterdir():
            _remove(child)
        path.rmdir()
    else:
        path.unlink(missing_ok=True)


#: Temporaries of this run's writers: ``.part-TTTTT-KKKKK.parquet.<pid>.tmp`` and ``.<file>.<pid>.tmp``.
_OWN_TMP = re.compile(r"^\.(part-\d{5}-\d{5}\.parquet|manifest\.json|errors\.jsonl)\.\d+\.tmp$")


def _own_files(out_dir: Path) -> set[str]:
    """The names a packtool run in ``out_dir`` wrote, as its manifest, run state and markers name them.

    Shards listed by the manifest or by a task's completion marker, the shards of every task
    the run planned (an unfinished task leaves shards but no marker), the legacy manifest and
    errors files, and the writers' temporaries.
    """
    names: set[str] = set()
    for file in (out_dir / MANIFEST, out_dir / LEGACY_MANIFEST):
        try:
            names.update(s["file"] for s in json.loads(file.read_text(encoding="utf-8")).get("shards", []))
        except (OSError, ValueError, TypeError, KeyError):
            pass
    state = out_dir / STATE_DIR
    for marker in state.glob("task-*.json"):
        try:
            names.update(s["file"] for s in json.loads(marker.read_text(encoding="utf-8")).get("shards", []))
        except (OSError, ValueError, TypeError, KeyError):
            pass
    try:
        n_tasks = int(json.loads((state / RUN_STATE).read_text(encoding="utf-8")).get("n_tasks", 0))
    except (OSError, ValueError, TypeError):
        n_tasks = 0
    prefixes = {task_prefix(t) for t in range(n_tasks)}
    for f in out_dir.iterdir():
        if (f.name.startswith("part-") and f.name[:10] in prefixes and re.fullmatch(r"part-\d{5}-\d{5}\.parquet", f.name)) \
                or _OWN_TMP.match(f.name):
            names.add(f.name)
    names.update(n for n in (LEGACY_MANIFEST, LEGACY_ERRORS) if (out_dir / n).is_file() and (out_dir / LEGACY_MANIFEST).is_file())
    # only plain names directly inside out_dir: a manifest cannot point anywhere else
    return {n for n in names if isinstance(n, str) and n and "/" not in n and "\\" not in n and n not in (".", "..")}


def _wipe(out_dir: Path) -> None:
    """Remove what a packtool run wrote into ``out_dir`` (the names its own manifest, markers and
    run state give, and its ``.packtool/`` folder) and nothing else: files of other programs stay."""
    for name in sorted(_own_files(out_dir)):
        _remove(out_dir / name)
    _remove(out_dir / STATE_DIR)


def _foreign_entries(out_dir: Path) -> list[str]:
    """Visible entries of ``out_dir`` that no packtool run wrote (hidden ones are not counted)."""
    if not out_dir.is_dir():
        return []
    own = _own_files(out_dir) if is_output_dir(out_dir) else set()
    return sorted(f.name for f in out_dir.iterdir() if not f.name.startswith(".") and f.name not in own)


def _check_writable(out_dir: Path) -> None:
    try:
        (out_dir / STATE_DIR).mkdir(parents=True, exist_ok=True)
        probe = out_dir / STATE_DIR / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise OutputError(f"cannot write to output {str(out_dir)!r}: {exc.strerror}; choose a writable -o") from None


def _run_diff(old: dict, new: dict) -> list[str]:
    diff = []
    if old.get("kind") != new.get("kind"):
        diff.append(f"kind: {old.get('kind')} -> {new.get('kind')}")
    # max_errors decides when to stop, not what is written: a resume may change it
    diff += [d for d in config_diff(old.get("config", {}), new.get("config", {})) if not d.startswith("max_errors:")]
    if old.get("world_size") != new.get("world_size"):
        diff.append(f"world_size: {old.get('world_size')} -> {new.get('world_size')}")
    old_in, new_in = old.get("inputs", {}), new.get("inputs", {})
    changed = [k for k in sorted(set(old_in) | set(new_in)) if old_in.get(k) != new_in.get(k)]
    if changed:
        diff.append(f"input files changed since the first attempt: {', '.join(changed[:3])}"
                    + (f" and {len(changed) - 3} more" if len(changed) > 3 else ""))
    if not diff and old.get("tasks_digest") != new.get("tasks_digest"):
        diff.append("the task split differs")
    return diff


def prepare_run(out_dir: Path, run: dict, overwrite: bool) -> dict | None:
    """Make ``out_dir`` ready for the run described by ``run``; return the manifest when it already finished.

    ``run`` holds ``kind``, ``config``, ``config_digest``, ``world_size``, ``n_tasks``,
    ``tasks_digest`` and ``inputs`` (input sizes, to notice inputs that changed). It is
    stored as ``.packtool/run.json`` so an interrupted run can be resumed: the same
    command finds it, keeps every task that left a completion marker, and redoes the rest.
    A directory holding a run (finished or not) with other settings is refused, naming the
    settings that differ, unless ``overwrite``; so is a non-empty directory that holds no
    packtool run (hidden entries aside). ``overwrite`` removes only what a run wrote there
    (the files its manifest, markers and run state name, and ``.packtool/``), never other files. Several ranks may call this at once: they
    all write the same ``run.json``.

    Example:
        >>> prepare_run(Path("tok"), run, overwrite=False)   # doctest: +SKIP
        None   # ready: run the tasks that have no marker
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputError(f"output {str(out_dir)!r} exists and is not a directory; choose another -o")
    manifest_file = manifest_path(out_dir)
    state_file = out_dir / STATE_DIR / RUN_STATE
    if manifest_file.is_file():
        try:
            old = json.loads(manifest_file.read_text(encoding="utf-8"))
        except ValueError:
            old = {}
        same = old.get("kind") == run["kind"] and old.get("config_digest") == run["config_digest"]
        if same:
            return old
        if not overwrite:
            diff = _run_diff(old, {k: v for k, v in run.items() if k in ("kind", "config")})
            raise ResumeMismatchError(
                f"{str(out_dir)!r} already holds a finished run with a different configuration "
                f"({'; '.join(diff) or 'config digest'}); use another -o, or pass --overwrite to replace it"
            )
        _wipe(out_dir)
    elif state_file.is_file():
        try:
            old = json.loads(state_file.read_text(encoding="utf-8"))
        except ValueError:
            old = {}
        diff = _run_diff(old, run)
        if diff and not overwrite:
            raise ResumeMismatchError(
                f"{str(out_dir)!r} holds an unfinished run with other settings ({'; '.join(diff)}); "
                "resume it with the same command, use another -o, or pass --overwrite to start over"
            )
        if diff:
            _wipe(out_dir)
    elif overwrite and out_dir.is_dir():
        _wipe(out_dir)
    elif foreign := _foreign_entries(out_dir):
        shown = ", ".join(repr(n) for n in foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise OutputError(
            f"output {str(out_dir)!r} is not empty and holds no packtool run ({shown}); choose a new or empty -o, "
            "or pass --overwrite to write there anyway (files packtool did not write are never removed)"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    _check_writable(out_dir)
    if not state_file.is_file() or json.loads(state_file.read_text(encoding="utf-8")) != run:
        atomic_write_text(state_file, json.dumps(run, indent=2) + "\n")
    return None


def read_run(out_dir: Path) -> dict:
    """The ``run.json`` of an output directory (for ``merge``)."""
    state_file = Path(out_dir) / STATE_DIR / RUN_STATE
    if not state_file.is_file():
        raise InputError(f"{str(out_dir)!r} holds no packtool run ({STATE_DIR}/{RUN_STATE} missing); "
                         "run tokenize or pack into it first")
    return json.loads(state_file.read_text(encoding="utf-8"))


def task_prefix(task: int) -> str:
    """Shard name prefix of one task: its shards are ``part-TTTTT-KKKKK.parquet``."""
    return f"part-{task:05d}"


def marker_path(out_dir: Path, task: int) -> Path:
    return Path(out_dir) / STATE_DIR / f"task-{task:05d}.json"


def task_errors_path(out_dir: Path, task: int) -> Path:
    return Path(out_dir) / STATE_DIR / f"errors-{task:05d}.jsonl"


def clear_task(out_dir: Path, task: int) -> None:
    """Remove whatever an unfinished attempt at ``task`` left: its shards, temporaries and marker.

    Only this task's own names are touched, so other ranks may be writing meanwhile.
    """
    out_dir = Path(out_dir)
    prefix = task_prefix(task)
    marker_path(out_dir, task).unlink(missing_ok=True)
    for f in out_dir.glob(f"{prefix}-*.parquet"):
        f.unlink(missing_ok=True)
    for f in out_dir.glob(f".{prefix}-*.tmp"):
        f.unlink(missing_ok=True)
    state = out_dir / STATE_DIR
    for f in state.glob(f".errors-{task:05d}.jsonl*.tmp"):
        f.unlink(missing_ok=True)
    task_errors_path(out_dir, task).unlink(missing_ok=True)


def write_marker(out_dir: Path, task: int, record: dict) -> None:
    """The completion marker, written last: after it, the task's shards and errors are final."""
    atomic_write_text(marker_path(out_dir, task), json.dumps(record, indent=1) + "\n")


def read_marker(out_dir: Path, task: int, config_digest: str) -> dict | None:
    """The marker of a finished task of this configuration, or ``None``."""
    path = marker_path(out_dir, task)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if record.get("config_digest") != config_digest or record.get("task") != task:
        return None
    for s in record.get("shards", []):
        f = Path(out_dir) / s["file"]
        if not f.is_file() or f.stat().st_size != s["bytes"]:
            return None
    return record


def iter_shard_tables(path: Path, manifest: dict, columns: list[str] | None = None) -> Iterator[pa.Table]:
    """Yield each listed shard as a table (``columns`` to read only some), in manifest order."""
    for entry in manifest["shards"]:
        file = Path(path) / entry["file"]
        if not file.is_file():
            raise InputError(f"shard {str(file)!r} listed in the manifest is missing; re-run the stage that wrote it")
        yield pq.read_table(file, columns=columns)
