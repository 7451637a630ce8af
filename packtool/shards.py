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

import contextlib
import hashlib
import json
import logging
import os
import re
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import __version__
from .config import config_diff
from .errors import InputError, NoOutputError, OutputError, ResumeMismatchError
from .runs import COMPACT_COLUMNS, compact_table, is_runs_table, runs_version
from .schema import READABLE_VERSIONS, SCHEMA_VERSION, expanded_form
from .storage import join

__all__ = [
    "ShardWriter",
    "rows_table",
    "shard_name",
    "write_manifest",
    "read_manifest",
    "why_no_packs",
    "sha256_file",
    "prepare_run",
    "finished_as_is",
    "run_lock",
    "read_run",
    "task_prefix",
    "marker_path",
    "task_errors_path",
    "clear_task",
    "clear_tasks",
    "temporary",
    "write_marker",
    "read_marker",
    "atomic_write_text",
    "tmp_path",
    "sweep_stale_tmps",
    "iter_shard_tables",
    "open_shard",
    "read_shard",
    "shard_error",
    "shard_path",
    "shard_name_problem",
    "SHARD_NAME",
    "MANIFEST",
    "ERRORS",
    "STATE_DIR",
    "LEGACY_MANIFEST",
    "LEGACY_ERRORS",
    "manifest_path",
    "errors_path",
    "is_output_dir",
]

log = logging.getLogger(__name__)

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
#: The task plan of the run, in the state folder (:func:`stored_plan`).
PLAN = "plan.json"

# Fixed writer options: the same rows always give the same bytes.
# Page checksums (CRC32 per data page) let every read notice a damaged page for the cost of a CRC.
_WRITE_OPTS = dict(compression="zstd", compression_level=1, use_dictionary=False, write_statistics=False,
                   data_page_version="2.0", store_schema=True, write_page_checksum=True)
#: Leaves stored with LZ4 (``LZ4_RAW``) instead of zstd: the token id blob. Token ids as int32
#: give zstd's match finder many short matches, so level 1 runs at 50-100 MB/s on them (real
#: text or the bench's), against 200-600 for LZ4; on one packed shard of the bench's images
#: corpus the column wrote in 252 ms and read in 71 ms with LZ4 against 476 and 148 with zstd,
#: stored 40% larger (10.5 MB against 7.5; 1.35x on tokens of real Python source). The other
#: token blobs (targets against the next input, positions, subsegments) are mostly runs that zstd
#: stores 3-6x smaller at the same speed, so they keep zstd.
FAST_LEAVES = (COMPACT_COLUMNS[0],)
#: Media payload leaves: an image file's bytes (embedded, or inline in a tokenized row) and a
#: video's JPEG frames. These are JPEG, PNG, WebP...: zstd shrinks real ones by nothing while
#: it costs a CPU second per 0.76 GB, over a quarter of an embedding pack of real images.
PAYLOAD_LEAVES = ("media.list.element.data", "media.list.element.frames.list.element")
#: A shard stores a payload leaf uncompressed unless zstd takes a sample of its first row group's
#: bytes (``PAYLOAD_SAMPLE_BYTES``, about one data page) below this share of their size.
PAYLOAD_KEEP_SHARE = 0.9
PAYLOAD_SAMPLE_BYTES = 1 << 20


def writer_options(schema: pa.Schema, first_group: pa.Table) -> dict:
    """The ``ParquetWriter`` options of a shard whose first row group is ``first_group``.

    Every column is zstd (level 1), except the token id blob (``FAST_LEAVES``, LZ4) and a media
    payload leaf (``PAYLOAD_LEAVES``) whose bytes zstd would not shrink by a tenth:
    already-compressed image files and frames are stored as they are. The choice reads only the
    shard's first row group, so the same rows give the same bytes on any worker, rank or resume;
    a shard whose first group holds no payload bytes (``--media reference``, text) keeps zstd
    for every other column. ``--layout full`` shards (no blob) are zstd throughout, as before.

    Example:
        >>> import numpy as np
        >>> from packtool.schema import media_type
        >>> schema = pa.schema([pa.field("media", media_type([pa.field("data", pa.binary())]))])
        >>> def opts(blob):
        ...     table = pa.table({"media": [[{"kind": "image", "path": "a.png", "data": blob}]]}, schema=schema)
        ...     return writer_options(schema, table)["compression"]
        >>> opts(bytes(100_000))  # compresses: zstd everywhere, as for any other shard
        'zstd'
        >>> opts(np.random.default_rng(0).bytes(100_000))["media.list.element.data"]
        'none'
    """
    plain = [leaf for leaf in _payload_leaves(schema) if not _shrinks(_payload_sample(first_group, leaf))]
    fast = [name for name in FAST_LEAVES if name in schema.names]
    if not plain and not fast:
        return _WRITE_OPTS
    codec = {p: "none" if p in plain else "lz4" if p in fast else "zstd" for p in _leaf_paths(schema)}
    return dict(_WRITE_OPTS, compression=codec,
                compression_level={p: _WRITE_OPTS["compression_level"] for p, c in codec.items() if c == "zstd"})


def _leaf_paths(schema: pa.Schema) -> list[str]:
    """The Parquet column paths of ``schema``'s leaves (``media.list.element.data``...)."""
    key = schema.to_string(show_field_metadata=False, show_schema_metadata=False)
    if key not in _LEAVES:
        buf = pa.BufferOutputStream()
        pq.write_table(schema.empty_table(), buf)
        parquet_schema = pq.ParquetFile(pa.BufferReader(buf.getvalue())).schema
        _LEAVES[key] = [parquet_schema.column(i).path for i in range(len(parquet_schema))]
    return _LEAVES[key]


_LEAVES: dict[str, list[str]] = {}


def _payload_leaves(schema: pa.Schema) -> list[str]:
    if "media" not in schema.names:
        return []
    item = schema.field("media").type.value_type
    names = [item.field(i).name for i in range(item.num_fields)]
    return [leaf for leaf in PAYLOAD_LEAVES if leaf.split(".")[3] in names]


def _payload_sample(table: pa.Table, leaf: str) -> bytes:
    """The first ``PAYLOAD_SAMPLE_BYTES`` of the values of ``leaf`` in ``table``, in row order:
    one slice of the column's value buffer (null values hold no bytes), no copy per value."""
    import pyarrow.compute as pc

    values = pc.list_flatten(table.column("media").combine_chunks()).field(leaf.split(".")[3])
    if leaf.endswith("frames.list.element"):
        values = pc.list_flatten(values)
    _, offsets, data = values.buffers()
    if not len(values) or data is None:
        return b""
    offs = np.frombuffer(offsets, dtype=np.int32, count=values.offset + len(values) + 1)[values.offset:]
    lo, hi = int(offs[0]), int(offs[-1])
    return data[lo:min(hi, lo + PAYLOAD_SAMPLE_BYTES)].to_pybytes()


def _shrinks(sample: bytes) -> bool:
    """Whether zstd (the shards' codec and level) stores ``sample`` in under
    ``PAYLOAD_KEEP_SHARE`` of its size; ``True`` for no bytes (nothing to decide on)."""
    if not sample:
        return True
    codec = pa.Codec(_WRITE_OPTS["compression"], compression_level=_WRITE_OPTS["compression_level"])
    return codec.compress(sample).size < PAYLOAD_KEEP_SHARE * len(sample)


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


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file's bytes. ``hashlib.file_digest`` reads into one reused buffer: a
    fresh 1 MiB ``bytes`` per read (what a read loop makes) is an ``mmap`` and ``munmap`` each,
    page faults included, which cost about a tenth of a shard's hashing."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def tmp_path(path: Path) -> Path:
    """The temporary name ``path`` is written under by this process: ``.NAME.PID@HOST.tmp``.

    The pid keeps two writers of one file apart (a resumed run and a straggler of the killed
    one); pid and host tell :func:`sweep_stale_tmps` whether the writer is still alive.
    """
    return path.with_name(f".{path.name}.{os.getpid()}@{_HOST}.tmp")


_HOST = socket.gethostname().replace("/", "_") or "localhost"
#: ``.NAME.PID@HOST.tmp`` (and ``.NAME.PID.tmp``, the name before hosts were recorded)
_TMP = re.compile(r"\..+\.(?P<pid>[0-9]+)(@(?P<host>[^/]+))?\.tmp")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def sweep_stale_tmps(out_dir: Path) -> list[str]:
    """Remove the temporary files that writers which are no longer alive left in ``out_dir``
    (and its state folder): a run killed while writing a shard, a marker or the manifest.

    Only files of dead processes on this host are removed; a live writer's file, or one from
    another host (ranks sharing the directory), is left alone. Returns the names removed.
    """
    removed = []
    for d in (Path(out_dir), Path(out_dir) / STATE_DIR):
        if not d.is_dir():
            continue
        for f in d.glob(".*.tmp"):
            m = _TMP.fullmatch(f.name)
            if m is None or (m["host"] is not None and m["host"] != _HOST) or _alive(int(m["pid"])):
                continue
            try:
                f.unlink()
                removed.append(f.name)
            except FileNotFoundError:  # its writer renamed it, or another sweep got there first
                pass
    return sorted(removed)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to a unique temporary name, fsync, and rename it over ``path``."""
    with temporary(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)


@contextlib.contextmanager
def temporary(path: Path) -> Iterator[Path]:
    """This process's temporary name for ``path`` (:func:`tmp_path`), removed when the block
    fails (a full disk, an interrupt): a failed write leaves nothing behind, not even a file the
    user is told to make room for. The block renames it into place when it succeeds."""
    tmp = tmp_path(path)
    try:
        yield tmp
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


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
    """:func:`row_bytes` of one array, from its offsets and validity (no value is visited)."""
    t = arr.type
    if len(arr) == 0:  # e.g. the media structs of a chunk of text-only rows: no field to visit
        return np.zeros(0, dtype=np.int64)
    if t.id in _BINARY_TYPE_IDS:  # the offsets say it (a null counts 0)
        width = np.int64 if pa.types.is_large_binary(t) or pa.types.is_large_string(t) else np.int32
        off = np.frombuffer(arr.buffers()[1], dtype=width)[arr.offset:arr.offset + len(arr) + 1]
        return _zero_nulls(arr, np.diff(off).astype(np.int64))
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        off = np.frombuffer(arr.buffers()[1], dtype=np.int64 if pa.types.is_large_list(t) else np.int32)
        off = off[arr.offset:arr.offset + len(arr) + 1].astype(np.int64)
        vt = t.value_type
        if pa.types.is_integer(vt) or pa.types.is_floating(vt):
            return _zero_nulls(arr, np.diff(off) * (vt.bit_width // 8))
        first, n = int(off[0]), int(off[-1] - off[0])
        inner = _array_bytes(arr.values.slice(first, n)) if n else np.zeros(0, dtype=np.int64)
        csum = np.concatenate([[0], np.cumsum(inner)])  # bytes of the values before each one
        return _zero_nulls(arr, csum[off[1:] - first] - csum[off[:-1] - first])
    if pa.types.is_struct(t):
        fixed, variable = _struct_parts(t)
        out = np.full(len(arr), fixed, dtype=np.int64)
        for i in variable:
            out += _array_bytes(arr.field(i))
        return out
    width = getattr(t, "bit_width", 64)
    return np.full(len(arr), max(1, width // 8), dtype=np.int64)


def _zero_nulls(arr: pa.Array, sizes: np.ndarray) -> np.ndarray:
    """``sizes`` with 0 at ``arr``'s null slots (whose offsets Arrow leaves unspecified)."""
    if arr.null_count:
        bits = np.unpackbits(np.frombuffer(arr.buffers()[0], dtype=np.uint8), bitorder="little")
        sizes[~bits[arr.offset:arr.offset + len(arr)].astype(bool)] = 0
    return sizes


def _struct_parts(t: pa.StructType) -> tuple[int, list[int]]:
    """A struct type's bytes per value over its fixed-width fields, and its other fields' indices
    (one pass over the field types; a packed row's media struct has 18 fields, 13 fixed)."""
    fixed, variable = 0, []
    for i, f in enumerate(t):
        ft = f.type
        if ft.id in _VARIABLE_TYPE_IDS:
            variable.append(i)
        else:
            fixed += max(1, getattr(ft, "bit_width", 64) // 8)
    return fixed, variable


_BINARY_TYPE_IDS = {x.id for x in (pa.binary(), pa.string(), pa.large_binary(), pa.large_string())}
_VARIABLE_TYPE_IDS = {x.id for x in (pa.binary(), pa.string(), pa.large_binary(), pa.large_string(), pa.list_(pa.int8()),
                                     pa.large_list(pa.int8()), pa.list_(pa.int8(), 1), pa.struct([]),
                                     pa.map_(pa.int8(), pa.int8()))}


def rows_table(rows: list[dict], schema: pa.Schema) -> pa.Table:
    """``pa.Table.from_pylist(rows, schema=schema)``, column by column: a ``list<int32>`` column
    whose values are all numpy arrays is built from their concatenation and offsets (one
    copy) instead of value by value; every other column goes through ``pa.array``.

    Example:
        >>> t = rows_table([{"a": np.arange(3, dtype=np.int32)}, {"a": np.zeros(1, np.int32)}],
        ...                pa.schema([("a", pa.list_(pa.int32()))]))
        >>> t.column("a").to_pylist()
        [[0, 1, 2], [0]]
    """
    cols = []
    for f in schema:
        vals = [r[f.name] for r in rows]
        if (pa.types.is_list(f.type) and f.type.value_type == pa.int32()
                and all(isinstance(v, np.ndarray) and v.dtype == np.int32 for v in vals)):
            offsets = np.zeros(len(vals) + 1, dtype=np.int64)
            np.cumsum([len(v) for v in vals], out=offsets[1:])
            if offsets[-1] < 2**31:
                cols.append(pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(np.concatenate(vals))))
                continue
        cols.append(pa.array(vals, type=f.type))
    return pa.Table.from_arrays(cols, schema=schema)


class ShardWriter:
    """Writes rows to numbered Parquet shards of at most ``rows_per_shard`` rows each.

    Row groups hold ``row_group_rows`` rows, or fewer when their payload would pass
    ``max_group_bytes`` (packs with embedded media), so memory stays bounded; both cuts
    depend only on the rows, so the bytes are deterministic.

    Example::

        with ShardWriter(out, schema, rows_per_shard=1000) as w:
            w.write_rows(rows)
        w.shards   # [{"file": "part-00000.parquet", "rows": ..., "bytes": ..., "sha256": ...}]
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
        return tmp_path(self.out_dir / shard_name(self._index, self.prefix))

    def write_table(self, table: pa.Table) -> None:
        """Append rows; shards and row groups are cut at fixed row counts, so output is deterministic."""
        if is_runs_table(self.schema) and runs_version(table) != runs_version(self.schema):
            table = compact_table(table)  # expanded (or version 3) rows given to a runs-form writer
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
        """Append rows given as dicts of the schema's fields (see :func:`rows_table`); a runs-form
        schema takes expanded rows (``input_ids``, ...) and stores them compacted."""
        if rows:
            self.write_table(rows_table(rows, expanded_form(self.schema)))

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
            group = table.slice(0, n).combine_chunks()
            if self._writer is None:
                tmp = self._tmp()
                self._writer = pq.ParquetWriter(tmp, self.schema, **writer_options(self.schema, group))
            self._writer.write_table(group, row_group_size=n)
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


def write_manifest(out_dir: Path, kind: str, config: dict, config_digest: str, shards: list[dict],
                   schema_version: int = SCHEMA_VERSION, report: dict | None = None, **extra) -> dict:
    """Write the manifest of ``extra`` fields and ``shards``, and return it; the same text as the
    manifest there already is left as it is (``report``, when given: ``written`` is set where the
    file was written)."""
    manifest = {
        "kind": kind,
        "schema_version": schema_version,
        "packtool_version": __version__,
        "config": config,
        "config_digest": config_digest,
        **extra,
        "shards": shards,
    }
    text = json.dumps(manifest, indent=2, sort_keys=False) + "\n"
    try:  # the same manifest again (merge of a merged run): left as it is, not written
        if (Path(out_dir) / MANIFEST).read_text(encoding="utf-8") == text:
            return manifest
    except (OSError, UnicodeDecodeError):
        pass
    (Path(out_dir) / STATE_DIR).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(out_dir) / MANIFEST, text)
    if report is not None:
        report["written"] = True
    return manifest


def either(items) -> str:
    """``"a, b or c"``: a list of alternatives for a message.

    Example:
        >>> either([2, 3, 4]), either([4])
        ('2, 3 or 4', '4')
    """
    items = [str(x) for x in items]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def read_manifest(path: Path, kind: str | None = None, shown: str | None = None) -> dict:
    """Read ``path/.packtool/manifest.json`` (or a legacy ``path/manifest.json``) and check its kind and schema version.

    Messages name the directory ``shown``: by default ``path``, or the URL a fetched copy of a
    bucket's output came from.
    """
    from .storage import source_name

    local = manifest_path(path)
    shown = source_name(path) if shown is None else shown
    if Path(path).name == STATE_DIR and local == Path(path) / LEGACY_MANIFEST:
        # the hidden folder's own manifest.json looks like a legacy top-level one: its shards are a level up
        raise InputError(f"{shown!r} is the {STATE_DIR} folder packtool keeps inside an output directory; pass the "
                         f"directory that holds it ({str(Path(path).parent)!r})")
    if not local.is_file():
        raise _no_manifest(Path(path), kind)
    file = local if shown == str(path) else f"{shown.rstrip('/')}/{local.relative_to(path).as_posix()}"
    try:
        manifest = json.loads(local.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise InputError(f"{file}: manifest is not valid JSON ({exc}); re-run the command that wrote it") from None
    if not isinstance(manifest, dict):
        raise InputError(f"{file}: holds a JSON {type(manifest).__name__}, not a manifest; re-run the command that "
                         "wrote it")
    if manifest.get("kind") not in READABLE_VERSIONS or "schema_version" not in manifest:
        missing = "kind" if manifest.get("kind") not in READABLE_VERSIONS else "schema_version"
        raise InputError(f"{file}: not a packtool manifest ({'no' if missing not in manifest else 'an unknown'} "
                         f"{missing!r}); re-run the command that wrote it")
    readable = READABLE_VERSIONS[manifest["kind"]]
    version = manifest.get("schema_version")
    if version not in readable:
        newer = isinstance(version, int) and not isinstance(version, bool) and version > max(readable)
        fix = (f"a newer packtool wrote it: upgrade packtool (this is {__version__}) to read it" if newer
               else "re-run the stage that wrote it with this packtool")
        raise InputError(
            f"{file}: {manifest.get('kind')} schema version {version!r}, this packtool reads {either(readable)}; {fix}"
        )
    if kind is not None and manifest.get("kind") != kind:
        fix = (f"pack it first (`packtool pack {shown} -o PACKED`) and pass the packed directory" if kind == "packed"
               else "pass the tokenized directory it was packed from")
        raise InputError(f"{shown!r} holds {manifest.get('kind')} shards, expected {kind} shards; {fix}")
    _check_manifest(Path(path), file, manifest)
    return manifest


def _no_manifest(path: Path, kind: str | None) -> InputError:
    """Why ``path`` has no manifest, told from what it does hold, and the command that gives it one.

    A path with no output at all (missing, empty, other files) is a :class:`NoOutputError`; an
    unfinished run or shards without their manifest are an output in trouble (``InputError``).
    """
    makers = {"tokenized": f"`packtool tokenize INPUT -o {path}`", "packed": f"`packtool pack TOKENIZED -o {path}`"}
    make = makers[kind] if kind in makers else " or ".join(makers.values())
    where = f"no {MANIFEST} found in {str(path)!r}"
    if not path.exists():
        return NoOutputError(f"{where} (the directory does not exist); run {make} first")
    if not path.is_dir():
        out = path.parent.parent if path.parent.name == STATE_DIR else path.parent
        if (out / MANIFEST).is_file():  # a shard, or the manifest itself, of a finished output: pass its directory
            return NoOutputError(f"{str(path)!r} is a file of the output directory {str(out)!r}; pass the directory "
                                 "(its shards are read through the manifest beside them)")
        return NoOutputError(f"{where} (it is a file, not an output directory); pass the -o directory of a finished "
                             f"run, or run {make} first")
    if (path / STATE_DIR / RUN_STATE).is_file():
        return InputError(f"{where}: its run has not finished (the manifest is written last, once every task is "
                          "done); run the command that started it again to resume it, or, when ranks ran apart, "
                          f"`packtool merge {path}` once every rank is done")
    names = os.listdir(path)
    n_shards = sum(1 for n in names if SHARD_NAME.fullmatch(n))
    if n_shards:
        return InputError(f"{where}, though it holds {n_shards} shard file(s): shards are read only through the "
                          "manifest written beside them (were they copied without the hidden .packtool folder?); "
                          "copy .packtool/ along with them, or re-run the command that wrote them")
    what = "the directory is empty" if not names else "nor any shard: it is not a packtool output"
    return NoOutputError(f"{where} ({what}); run {make} first")


def why_no_packs(samples_in: int, dropped: int, rejected: int) -> str:
    """Why a finished pack run wrote no pack, from its counts, and what to do about it.

    Example:
        >>> why_no_packs(30, 30, 30)
        'all 30 of its samples were dropped as oversize (listed in .packtool/errors.jsonl); pack again with a larger --max-tokens or --max-vision-units, or with --oversize alone'
    """
    if not samples_in:
        return ("it was packed from a tokenized directory with no samples; tokenize a corpus with good rows, then "
                "pack it again")
    if dropped == samples_in:
        return (f"all {samples_in:,} of its samples were dropped as oversize (listed in {ERRORS}); pack again with a "
                "larger --max-tokens or --max-vision-units, or with --oversize alone")
    return (f"none of its {samples_in:,} samples was packed ({dropped:,} dropped as oversize, {rejected:,} rejected "
            f"in all; listed in {ERRORS}); fix what it lists and pack again")


#: What a shard may be called: ``part-NNNNN.parquet`` or ``part-TTTTT-KKKKK.parquet``, beside its manifest.
SHARD_NAME = re.compile(r"part-[0-9]{5,}(-[0-9]{5,})?\.parquet")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def shard_name_problem(name: object) -> str | None:
    """Why ``name`` (a shard ``file`` read from a manifest or marker) is not a shard of its
    directory, or ``None``. Only plain ``part-*.parquet`` names pass, so no manifest can point
    a reader at ``/etc/passwd``, ``../other/...`` or the run's own state files.

    Example:
        >>> shard_name_problem("../x/part-00000-00000.parquet")
        "'../x/part-00000-00000.parquet' is not a shard file of this directory (part-NNNNN[-NNNNN].parquet)"
    """
    if isinstance(name, str) and SHARD_NAME.fullmatch(name):
        return None
    return f"{name!r} is not a shard file of this directory (part-NNNNN[-NNNNN].parquet)"


def shard_path(directory: Path, name: object) -> Path:
    """``directory / name`` for a shard name read from a manifest, refused when it leaves the
    directory: a name that is not a plain ``part-*.parquet`` file name, or a symbolic link
    resolving elsewhere.

    Raises:
        InputError: naming the manifest entry and the fix.
    """
    problem = shard_name_problem(name)
    if problem is not None:
        raise InputError(f"{str(directory / MANIFEST)!r} lists {problem}; a manifest may only name the shards "
                         "beside it: re-run the stage that wrote it")
    file = Path(directory) / str(name)
    if file.is_symlink():
        target = Path(os.path.realpath(file))
        if target.parent != Path(os.path.realpath(directory)):
            raise InputError(f"shard {str(file)!r} is a link to {str(target)!r}, outside its directory; copy the "
                             "file in its place")
    return file


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_manifest(path: Path, file: Path | str, manifest: object) -> None:
    """The fields every reader relies on, with their types; each shard name inside ``path``."""
    def bad(what: str) -> InputError:
        return InputError(f"{file}: {what}; the manifest is damaged: re-run the stage that wrote it")

    if not isinstance(manifest, dict):
        raise bad(f"holds a JSON {type(manifest).__name__}, not an object")
    for key, typ in (("kind", str), ("config", dict), ("config_digest", str), ("shards", list)):
        if not isinstance(manifest.get(key), typ):
            raise bad(f"{key!r} is missing or not a {typ.__name__}")
    for key in ("counts", "capacities", "vision", "tokenizer", "template", "source"):
        if manifest.get(key) is not None and not isinstance(manifest[key], dict):
            raise bad(f"{key!r} is not an object")
    # every count is a whole number, or a table of them (rejected_by_reason): stats and validate
    # add and format them
    for key, value in (manifest.get("counts") or {}).items():
        items = [(f"{key}.{k}", v) for k, v in value.items()] if isinstance(value, dict) else [(key, value)]
        for name, v in items:
            if not _is_count(v):
                raise bad(f"counts.{name} is {json.dumps(v)[:40]}, not a whole number")
    for i, entry in enumerate(manifest["shards"]):
        if not isinstance(entry, dict):
            raise bad(f"shard {i} is not an object")
        shard_path(path, entry.get("file"))
        if not _is_count(entry.get("rows")) or not _is_count(entry.get("bytes")):
            raise bad(f"shard {i} ({entry.get('file')}) has no whole-number rows and bytes")
        if not isinstance(entry.get("sha256"), str) or not _SHA256.fullmatch(entry["sha256"]):
            raise bad(f"shard {i} ({entry.get('file')}) has no sha256")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        for child in path.iterdir():
            _remove(child)
        path.rmdir()
    else:
        path.unlink(missing_ok=True)


#: A task's (or a shard's) index as names write it (``f"{i:05d}"``): five digits, or more without a
#: leading zero (task 100000 and up: a run of that many tasks is a corpus of some terabytes).
_TASK_ID = r"\d{5}|[1-9]\d{5,}"
#: A task's shard, ``part-TTTTT-KKKKK.parquet`` (its ``KKKKK``-th shard of task ``TTTTT``).
TASK_SHARD = re.compile(rf"part-(?P<task>{_TASK_ID})-(?:{_TASK_ID})\.parquet", re.ASCII)
#: A task's completion marker or error log in ``.packtool/`` (what a bucket's copy of the state holds per task).
TASK_STATE_FILE = re.compile(rf"task-(?:{_TASK_ID})\.json|errors-(?:{_TASK_ID})\.jsonl", re.ASCII)


#: Temporaries of this run's writers: ``.part-TTTTT-KKKKK.parquet.<pid>@<host>.tmp`` and ``.<file>.<pid>@<host>.tmp``.
_OWN_TMP = re.compile(rf"^\.({TASK_SHARD.pattern}|manifest\.json|errors\.jsonl)\.\d+(@[^/\\]+)?\.tmp$", re.ASCII)


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
        except (OSError, ValueError, TypeError, KeyError, AttributeError):  # a damaged manifest names nothing
            pass
    state = out_dir / STATE_DIR
    for marker in state.glob("task-*.json"):
        try:
            names.update(s["file"] for s in json.loads(marker.read_text(encoding="utf-8")).get("shards", []))
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            pass
    try:
        n_tasks = int(json.loads((state / RUN_STATE).read_text(encoding="utf-8")).get("n_tasks", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        n_tasks = 0
    prefixes = {task_prefix(t) for t in range(n_tasks)}
    for f in out_dir.iterdir():
        shard = TASK_SHARD.fullmatch(f.name)
        if shard and f"part-{shard['task']}" in prefixes or _OWN_TMP.match(f.name):
            names.add(f.name)
    names.update(n for n in (LEGACY_MANIFEST, LEGACY_ERRORS) if (out_dir / n).is_file() and (out_dir / LEGACY_MANIFEST).is_file())
    # only plain names directly inside out_dir: a manifest cannot point anywhere else
    return {n for n in names if isinstance(n, str) and n and "/" not in n and "\\" not in n and n not in (".", "..")}


def _wipe(out_dir: Path) -> None:
    """Remove what a packtool run wrote into ``out_dir`` (the names its own manifest, markers and
    run state give, and its ``.packtool/`` folder) and nothing else: files of other programs stay.
    The run locks in ``.packtool/`` stay too: the run wiping holds one (:func:`run_lock`).

    The manifest goes first, so that a wipe cut short (a kill, a full disk) never leaves a
    manifest naming shards that are gone: what remains is an unfinished run."""
    names = _own_files(out_dir)  # read from the manifest, among others
    (out_dir / MANIFEST).unlink(missing_ok=True)
    for name in sorted(names):
        _remove(out_dir / name)
    state = out_dir / STATE_DIR
    if state.is_dir() and not state.is_symlink():
        for child in state.iterdir():
            if not child.name.endswith(".lock"):
                _remove(child)
    elif state.exists() or state.is_symlink():
        _remove(state)


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


def _changed_inputs(old: object, new: object) -> list[str]:
    """Input files whose recorded identity (size and mtime; a shard's sha256) differs, sorted."""
    old_in = old if isinstance(old, dict) else {}
    new_in = new if isinstance(new, dict) else {}
    if not old_in:  # a state from before inputs were recorded: nothing to compare
        return []
    return [k for k in sorted(set(old_in) | set(new_in)) if old_in.get(k) != new_in.get(k)]


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _read_state(state_file: Path) -> dict:
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


#: What a run's recorded set-up (``run["manifest"]``) says that decides its tokens beside its
#: settings: the vocabulary's fingerprint (a tokenizer file changed in place keeps its path, the
#: setting), the vision family's and the template's settings.
_SETUP_KEYS = ("tokenizer", "vision", "template")


def _setup_diff(old: dict, new: dict) -> list[str]:
    """The differences of two runs' set-ups (:data:`_SETUP_KEYS` of their ``run.json``
    ``manifest``), as :func:`config_diff` names them: a run resumed after its tokenizer file
    changed would store two vocabularies' ids under one manifest. A run state without a set-up
    (an older packtool's) is not compared."""
    a, b = old.get("manifest"), new.get("manifest")
    if not isinstance(a, dict) or not isinstance(b, dict):
        return []
    b = json.loads(json.dumps(b))  # as run.json stores it: tuples as lists
    diff = config_diff({k: a.get(k) for k in _SETUP_KEYS}, {k: b.get(k) for k in _SETUP_KEYS})
    files_a, files_b = old.get("tokenizer_files"), new.get("tokenizer_files")
    if not diff and isinstance(files_a, dict) and isinstance(files_b, dict):
        # tokenizer_config.json alone changed: the special tokens' ids, which the vocabulary's
        # fingerprint (tokenizer.json) does not cover
        diff = [f"{name}: sha256 {_short_sha(files_a.get(name))} -> {_short_sha(files_b.get(name))}"
                for name in sorted(set(files_a) | set(files_b)) if files_a.get(name) != files_b.get(name)]
    return diff[:3] + ([f"and {len(diff) - 3} more set-up differences"] if len(diff) > 3 else [])


def _template_hint(diff: list[str]) -> str:
    """For a run whose template differs: a run of an earlier packtool made with ``--model qwen3-vl``
    or ``molmo2`` and no ``--template`` holds ``chatml``, which the same command no longer gives."""
    if any(d.startswith("model: ") for d in diff):  # another model: its template follows it
        return ""
    for d in diff:
        if d.startswith("template: ") and " -> " in d:
            was = d[len("template: "):].split(" -> ")[0].strip("'")
            return f" (without --template a model now gets its own; pass --template {was} to resume the run as it was)"
    return ""


def _short_sha(sha: object) -> str:
    return f"{sha[:12]}…" if isinstance(sha, str) else "none (no such file)"


def _run_diff(old: dict, new: dict) -> list[str]:
    diff = []
    if old.get("kind") != new.get("kind"):
        diff.append(f"kind: {old.get('kind')} -> {new.get('kind')}")
    # max_errors decides when to stop, not what is written: a resume may change it
    settings = [d for d in config_diff(old.get("config", {}), new.get("config", {})) if not d.startswith("max_errors:")]
    diff += settings[:5] + ([f"and {len(settings) - 5} more settings"] if len(settings) > 5 else [])
    if old.get("world_size") != new.get("world_size"):
        diff.append(f"world_size: {old.get('world_size')} -> {new.get('world_size')}")
    changed = _changed_inputs(old.get("inputs"), new.get("inputs"))
    if changed:
        diff.append(f"input files changed since the first attempt: {_some(changed)}")
    if not settings:  # otherwise it follows from them (another model: another vision family)
        diff += _setup_diff(old, new)
    if not diff and old.get("tasks_digest") != new.get("tasks_digest"):
        diff.append("the task split differs")
    return diff


def _live_ranks(out_dir: Path) -> list[dict]:
    """The holders of other ranks' run locks in ``out_dir`` that are alive now (a held ``flock``),
    each with its ``rank`` and, as its lock file records them, ``pid``, ``host`` and ``started``.
    This process's own lock is left out (it is the one asking)."""
    import fcntl

    live = []
    for path in sorted((Path(out_dir) / STATE_DIR).glob("rank-*.lock")):
        if not re.fullmatch(r"rank-\d+\.lock", path.name):
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            try:
                holder = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
            except ValueError:
                holder = {}
            holder = holder if isinstance(holder, dict) else {}
            if holder.get("pid") == os.getpid() and holder.get("host") == _HOST:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                live.append({**holder, "rank": int(path.stem.split("-")[-1])})
        finally:
            os.close(fd)  # releases the probe's shared lock, if it took one
    return live


@contextlib.contextmanager
def run_lock(out_dir: Path, rank: int = 0) -> Iterator[None]:
    """Hold the output directory for one run of ``rank`` (ranks of one run share it).

    An exclusive ``flock`` on ``.packtool/rank-RRRRR.lock``, which holds the holder's pid, host
    and start time (``--overwrite`` wipes the folder but keeps the locks). The kernel drops the lock when its process ends, however it ends, so a
    run killed with SIGKILL leaves no stale lock: the same command resumes at once.

    Raises:
        OutputError: another live run of this rank holds ``out_dir`` (naming its pid and host).
    """
    import fcntl
    import time

    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputError(f"output {str(out_dir)!r} exists and is not a directory; choose another -o")
    made_out, made_state = not out_dir.exists(), not (out_dir / STATE_DIR).exists()
    (out_dir / STATE_DIR).mkdir(parents=True, exist_ok=True)
    path = out_dir / STATE_DIR / f"rank-{rank:05d}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
            except ValueError:
                holder = {}
            raise OutputError(
                f"{str(out_dir)!r} is being written by another packtool run (pid {holder.get('pid', '?')} on "
                f"{holder.get('host', '?')}, started {holder.get('started', '?')}); wait for it to finish, or "
                "choose another -o"
            ) from None
        info = {"pid": os.getpid(), "host": _HOST, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode("utf-8"), 0)
        try:
            yield
        except BaseException:
            # a run refused before it wrote anything (a foreign -o, bad settings) leaves no trace of itself
            if made_state:
                with contextlib.suppress(OSError):
                    path.unlink()
                    (out_dir / STATE_DIR / "plan.lock").unlink(missing_ok=True)
                    (out_dir / STATE_DIR).rmdir()
                    if made_out:
                        out_dir.rmdir()
            raise
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def stored_plan(out_dir: Path, kind: str, key: str, check: Callable[[dict], bool]) -> Iterator[PlanSlot]:
    """The task plan of the run in ``out_dir``, made by one process however many ranks start.

    Planning a tokenize run reads every input (line counts and byte offsets), which a run of
    many ranks must not repeat once per rank. The first process to take an exclusive ``flock``
    on ``.packtool/plan.lock`` plans and stores ``.packtool/plan.json`` (written whole or not at
    all); every other rank waits for that lock, then reads the stored plan. ``key`` is a digest
    of what the plan depends on (the configuration and the inputs' sizes and modification
    times), so a stored plan of other settings or changed inputs is not used; ``check`` vets a
    plan read back (its tasks name only this run's inputs), and a plan it rejects is made again.

    Usage: ``slot.plan`` is the stored plan or ``None``; the caller plans when it is ``None``,
    prepares the run (:func:`prepare_run`, which may clear the folder) and calls
    ``slot.store(plan)`` inside the block, so the plan is on disk before the lock is let go.

    Example:
        >>> with stored_plan(out, "tokenized", key, check) as slot:   # doctest: +SKIP
        ...     plan = slot.plan or make_plan()
        ...     prepare_run(out, run, overwrite)
        ...     slot.store(plan)
    """
    import fcntl

    state = Path(out_dir) / STATE_DIR
    fd = os.open(state / "plan.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # blocks while another rank plans: seconds to minutes, once per run
        plan = _read_state(state / PLAN)
        found = plan.get("kind") == kind and plan.get("key") == key and check(plan)
        if plan and not found:
            log.info("%s: the stored task plan is of other settings or inputs; planning again", out_dir)
        yield PlanSlot(state / PLAN, plan if found else None)
    finally:
        os.close(fd)


class PlanSlot:
    """What :func:`stored_plan` hands out: the plan found (or ``None``) and how to store one."""

    def __init__(self, path: Path, plan: dict | None) -> None:
        self.path = path
        self.plan = plan

    def store(self, plan: dict) -> None:
        """Write ``plan`` unless the same plan is there already (another rank's, or ours)."""
        if _read_state(self.path) != plan:
            atomic_write_text(self.path, json.dumps(plan, separators=(",", ":")) + "\n")


def prepare_run(out_dir: Path, run: dict, overwrite: bool) -> dict | None:
    """Make ``out_dir`` ready for the run described by ``run``; return the manifest when it already finished.

    ``run`` holds ``kind``, ``config``, ``config_digest``, ``world_size``, ``n_tasks``,
    ``tasks_digest`` and ``inputs`` (input sizes, to notice inputs that changed). It is
    stored as ``.packtool/run.json`` so an interrupted run can be resumed: the same
    command finds it, keeps every task that left a completion marker, and redoes the rest.

    A finished run of the same settings and inputs is returned as it is when every shard its
    manifest lists is there with the listed size: one ``stat`` per shard (a bucket: its
    listing), no hash, since hashing costs about 2 s per GB on every re-run; ``packtool
    validate``, which hashes every shard, finds a same-size change. A listed shard that is
    missing, or of another size (cut short, replaced), is repaired: missing and changed are
    treated alike, since either way the file is not the one the manifest lists. The run is
    resumed: the task that wrote the shard is redone (all its shards, written again with the
    same bytes) while the other tasks and their files are kept, and the merge writes the
    manifest again; a warning names the shards and the tasks. The manifest is removed first,
    so a repair cut short is an unfinished run that the same command resumes; a bucket keeps
    its manifest object until the new one replaces it, and its shards are written over, never
    deleted first. A damaged run whose shards are not named by their task (a run of an older
    packtool) is refused unless ``overwrite``. A lost or cut ``errors.jsonl`` (its size against
    the manifest's ``errors_file``: one more ``stat``) is repaired the same way: it is the tasks'
    error logs end to end, so the merge writes it again from them; a task whose own log is gone
    too is redone, and the manifest is kept when no task is. A manifest that is damaged itself (not JSON,
    fields or shard names readers refuse) is no finished run: the run is resumed from its run
    state and markers, and the merge writes the manifest again.

    ``overwrite`` starts a finished run over even when nothing it compares changed (a run
    whose media were fixed since: tokenize records the inputs, not every media file). A
    directory holding a run (finished or not) with other settings is refused, naming the
    settings that differ, unless ``overwrite``; so is a non-empty directory that holds no
    packtool run (hidden entries aside). ``overwrite`` removes only what a run wrote there
    (the files its manifest, markers and run state name, and ``.packtool/``), never other files. Several ranks may call this at once: they
    all write the same ``run.json``.

    Example:
        >>> prepare_run(Path("tok"), run, overwrite=False)   # doctest: +SKIP
        None   # ready: run the tasks that have no marker
    """
    from .publication import listed_sizes, task_target

    out_dir = Path(out_dir)
    shown = task_target(out_dir)  # the URL when out_dir is a bucket's local mirror
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputError(f"output {str(out_dir)!r} exists and is not a directory; choose another -o")
    stray = [n for n in _foreign_entries(out_dir) if SHARD_NAME.fullmatch(n)]
    if stray:
        # named like shards but no run's: the writer would replace one (a file packtool did not
        # write), or it would sit among the shards, read with them by every tool that reads the
        # folder as a Parquet dataset (validate refuses such a folder); refused before anything changes
        names = ", ".join(repr(n) for n in stray[:3]) + (f" and {len(stray) - 3} more" if len(stray) > 3 else "")
        raise OutputError(
            f"output {str(out_dir)!r} holds files named like packtool shards that no packtool run there lists "
            f"({names}); move them out of the folder, or choose another -o"
        )
    manifest_file = manifest_path(out_dir)
    state_file = out_dir / STATE_DIR / RUN_STATE
    unreadable = manifest_file.is_file() and state_file.is_file() and not _readable_manifest(out_dir, manifest_file)
    # a damaged manifest is no finished run to compare with: the run state decides below, as for an
    # unfinished run, and the merge writes the manifest over (a bucket's mirror keeps it until then)
    if manifest_file.is_file() and not unreadable:
        try:
            old = json.loads(manifest_file.read_text(encoding="utf-8"))
        except ValueError:
            old = {}
        old = old if isinstance(old, dict) else {}
        state = _read_state(state_file)
        setup = _setup_diff(state, run)  # the vocabulary (a tokenizer file changed in place) ...
        same = old.get("kind") == run["kind"] and old.get("config_digest") == run["config_digest"] and not setup
        changed = _changed_inputs(state.get("inputs"), run.get("inputs")) if same else []
        damaged = _damaged_shards(out_dir, old) if same and not changed else []
        errors = _damaged_errors(out_dir, old) if same and not changed else None
        if same and not changed and not damaged and errors is None and not overwrite:
            return old  # with --overwrite it is done again (media fixed since, say): wiped below
        repair = all(TASK_SHARD.fullmatch(name) for name, _ in damaged) and bool(damaged or errors)
        if repair:
            # resumed below: the tasks whose shards their markers no longer find are redone, the
            # rest kept, and the merge writes errors.jsonl and the manifest again. errors.jsonl is
            # the tasks' error logs end to end, so a lost or cut one is written again from them, and
            # a task whose log (or marker) is gone too is redone (named here; markers are read only
            # on this repair path: the check of a whole run stays one stat per file)
            lost = _lost_logs(out_dir, run, {_task_of(name) for name, _ in damaged})
            log.warning("%s", _repair_line(shown, damaged, len(old["shards"]), run.get("world_size", 1), errors, lost))
            if (damaged or lost) and listed_sizes(out_dir) is None:
                # a redone task first removes all its shards: the manifest goes before them (as in
                # _wipe), so a repair cut short leaves an unfinished run, not a manifest naming
                # files packtool removed. A bucket's mirror keeps it: there a task's shards are only
                # written over, never removed, and a manifest gone from the mirror would read as a
                # replaced run, whose objects push_state deletes
                manifest_file.unlink()
        elif damaged and not overwrite:
            raise ResumeMismatchError(
                f"{shown!r} holds a finished run of these settings, but {_damage(damaged)}; a run of an older "
                "packtool cannot redo only those: pass --overwrite to redo the run, or use another -o"
            )
        elif same and not overwrite:
            raise ResumeMismatchError(
                f"{shown!r} holds a finished run of these settings, but input files changed since "
                f"(size or modification time): {_some(changed)}; pass --overwrite to redo it, or use another -o"
            )
        elif not same and not overwrite:
            diff = _run_diff(old, {k: v for k, v in run.items() if k in ("kind", "config")}) or setup
            raise ResumeMismatchError(
                f"{shown!r} already holds a finished run with a different configuration "
                f"({'; '.join(diff) or 'config digest'}){_template_hint(diff)}; use another -o, or pass --overwrite to "
                "replace it"
            )
        else:
            _wipe(out_dir)
    elif state_file.is_file():
        old = _read_state(state_file)
        diff = _run_diff(old, run)
        live = _live_ranks(out_dir) if diff else []
        if diff and not live and not any((out_dir / STATE_DIR).glob("task-*.json")):
            # a run that stopped before finishing any task (a failed start) holds nothing to keep;
            # one whose other ranks are still running has simply not finished a task yet
            log.info("%s: replacing an unfinished run that finished no task (%s)", out_dir, "; ".join(diff))
            _wipe(out_dir)
            diff = []
        if diff and not overwrite:
            running = (f"; its rank {live[0]['rank']} is running now (pid {live[0].get('pid', '?')} on "
                       f"{live[0].get('host', '?')})" if live else "")
            raise ResumeMismatchError(
                f"{shown!r} holds an unfinished run with other settings ({'; '.join(diff)}){running}"
                f"{_template_hint(diff)}; resume it with the same command, use another -o, or pass --overwrite to start over"
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
    if unreadable and manifest_file.is_file():  # resumed, not refused nor wiped
        log.warning("%s: the manifest of its run is damaged; resuming the run from its completion markers "
                    "(finished tasks are kept) to write it again", shown)
    out_dir.mkdir(parents=True, exist_ok=True)
    _check_writable(out_dir)
    swept = sweep_stale_tmps(out_dir)
    if swept:
        log.info("removed %d temporary files of runs that died: %s", len(swept), ", ".join(swept[:5]))
    if _read_state(state_file) != run:
        atomic_write_text(state_file, json.dumps(run, indent=2) + "\n")
    return None


def finished_as_is(out_dir: Path, run: dict) -> dict | None:
    """The manifest of ``run`` when ``out_dir`` holds it finished and the command that wrote it,
    run again, would return it as it is (redoing no task): what :func:`prepare_run` checks, a
    readable manifest of the same kind and config whose listed shards and ``errors.jsonl`` are
    there with their listed sizes. ``None`` when that command would repair or resume the run.

    ``packtool merge`` asks this before it sends a user to a rank's command: a run that command
    finds whole is one it leaves as it is, so telling the user to run it would change nothing.
    (Inputs changed since are not looked at: that command refuses them, naming --overwrite.)
    """
    file = manifest_path(out_dir)
    if not file.is_file() or not _readable_manifest(out_dir, file):
        return None
    manifest = json.loads(file.read_text(encoding="utf-8"))
    if manifest.get("kind") != run["kind"] or manifest.get("config_digest") != run["config_digest"]:
        return None
    if _damaged_shards(out_dir, manifest) or _damaged_errors(out_dir, manifest) is not None:
        return None
    return manifest


def _readable_manifest(out_dir: Path, file: Path) -> bool:
    """Whether ``file`` is a manifest readers can use: JSON, with the fields and shard names
    :func:`_check_manifest` requires."""
    try:
        _check_manifest(Path(out_dir), file, json.loads(file.read_text(encoding="utf-8")))
    except (ValueError, InputError):  # InputError: what read_manifest says of it
        return False
    return True


def _damaged_shards(out_dir: Path, manifest: dict) -> list[tuple[str, str]]:
    """The shards ``manifest`` lists that are not in ``out_dir`` as listed: ``(name, what)``,
    ``what`` being ``"missing"`` or ``"N bytes, listed M"``.

    One ``stat`` per shard (a bucket's mirror: the listing's sizes), never a hash: a same-size
    change is for ``packtool validate`` (which hashes every shard) to find. Entries that name
    no shard of this directory are skipped: readers refuse such a manifest, naming the entry.
    """
    from .publication import listed_sizes

    shards = manifest.get("shards")
    if not isinstance(shards, list):
        return []
    listed = listed_sizes(out_dir)  # the shards' sizes in the bucket when out_dir mirrors one
    damaged = []
    for entry in shards:
        name = entry.get("file") if isinstance(entry, dict) else None
        if not isinstance(name, str) or shard_name_problem(name):
            continue
        if listed is not None:
            size = listed.get(name)
        else:
            f = Path(out_dir) / name
            size = f.stat().st_size if f.is_file() else None
        if size is None:
            damaged.append((name, "missing"))
        elif size != entry.get("bytes"):
            listed_bytes = entry.get("bytes")
            damaged.append((name, f"{size:,} bytes, listed {listed_bytes:,}" if _is_count(listed_bytes)
                            else f"{size:,} bytes"))
    return damaged


def _damaged_errors(out_dir: Path, manifest: dict) -> str | None:
    """What is wrong with the finished run's ``errors.jsonl`` (``"missing"``, or ``"N bytes,
    listed M"``), or ``None`` when it is there with the size its manifest records: one ``stat``,
    no hash (``packtool validate`` compares its sha256). A manifest written before packtool
    recorded the size has only a lost file found."""
    f = errors_path(out_dir)  # a bucket's mirror holds the object's copy
    if not f.is_file():
        return "missing"
    record = manifest.get("errors_file")
    want = record.get("bytes") if isinstance(record, dict) else None
    size = f.stat().st_size
    return f"{size:,} bytes, listed {want:,}" if _is_count(want) and size != want else None


def _task_of(shard: str) -> int:
    """The task that wrote ``part-TTTTT-KKKKK.parquet``."""
    return int(TASK_SHARD.fullmatch(shard)["task"])


def _lost_logs(out_dir: Path, run: dict, skip: set[int]) -> dict[int, str]:
    """The tasks of a finished run (but those in ``skip``) that the merge cannot use any more:
    ``{task: "log"}`` when its marker is there but its error log is lost or cut
    (:func:`read_marker`), ``{task: "marker"}`` when its marker is gone or damaged."""
    lost = {}
    for t in range(run.get("n_tasks", 0)):
        if t in skip or read_marker(out_dir, t, run["config_digest"]) is not None:
            continue
        marker = _read_state(marker_path(out_dir, t))
        lost[t] = "log" if marker.get("config_digest") == run["config_digest"] and marker.get("task") == t else "marker"
    return lost


def _damage(damaged: list[tuple[str, str]]) -> str:
    """``damaged`` (:func:`_damaged_shards`) in words: ``"2 listed shards are missing or changed:
    part-00001.parquet (missing), ..."``."""
    n = len(damaged)
    shown = _some([f"{name} ({what})" for name, what in damaged])
    return f"{n} listed shard{'s are' if n > 1 else ' is'} missing or changed: {shown}"


def _repair_line(shown: str, damaged: list[tuple[str, str]], n_shards: int, world_size: int = 1,
                 errors: str | None = None, lost: dict[int, str] | None = None) -> str:
    """The one line a repair says: what is damaged (shards; ``errors``, what is wrong with
    ``errors.jsonl``) and which tasks are redone (by which ranks, when the run is split into
    ``world_size`` ranks: each redoes its own): those that wrote a damaged shard, and ``lost``,
    those whose error log (``"log"``) or marker (``"marker"``) is missing or changed.

    Example:
        >>> _repair_line("tok", [("part-00001-00000.parquet", "missing")], 4)
        'tok: 1 of 4 shards of the finished run is missing or changed: part-00001-00000.parquet (missing); redoing task 1, which wrote it, and keeping the rest'
        >>> _repair_line("tok", [("part-00003-00000.parquet", "missing")], 4, world_size=2)[-79:]
        'task 3, which wrote it, is redone by rank 1 of --world-size 2; the rest is kept'
        >>> _repair_line("tok", [], 4, errors="missing")
        "tok: the finished run's .packtool/errors.jsonl is missing; writing it again from the tasks' error logs (no task is redone)"
        >>> _repair_line("tok", [], 4, errors="10 bytes, listed 200", lost={2: "log"})
        "tok: the finished run's .packtool/errors.jsonl is 10 bytes, listed 200; redoing task 2, whose error log is missing or changed, and keeping the rest"
    """
    lost = lost or {}
    tasks = sorted({_task_of(name) for name, _ in damaged} | set(lost))
    many = len(damaged) > 1
    parts = []
    if damaged:
        parts.append(f"{len(damaged)} of {n_shards} shards of the finished run {'are' if many else 'is'} missing or "
                     f"changed: {_some([f'{name} ({how})' for name, how in damaged])}")
    if errors is not None:
        whose = "its" if damaged else "the finished run's"
        parts.append(f"{whose} {ERRORS} is {errors}")
    what = f"{shown}: {', and '.join(parts)}; "
    if not tasks:
        return f"{what}writing it again from the tasks' error logs (no task is redone)"
    plural = len(tasks) > 1
    if not lost:
        why = f"which wrote {'them' if many else 'it'}"
    elif not damaged and set(lost.values()) == {"log"}:
        why = f"whose error log{'s are' if plural else ' is'} missing or changed"
    else:
        why = f"whose shards, error log{'s' if plural else ''} or marker{'s' if plural else ''} are missing or changed"
    task = f"task{'s' if plural else ''} {_some([str(t) for t in tasks])}, {why}"
    if world_size <= 1:
        return f"{what}redoing {task}, and keeping the rest"
    ranks = sorted({t % world_size for t in tasks})
    return (f"{what}{task}, {'are' if plural else 'is'} redone by rank{'s' if len(ranks) > 1 else ''} "
            f"{_some([str(r) for r in ranks])} of --world-size {world_size}; the rest is kept")


def read_run(out_dir: Path, shown: str | None = None) -> dict:
    """The ``run.json`` of an output directory (for ``merge``); messages name it ``shown``
    (default: ``out_dir``), the URL when ``out_dir`` is a bucket's local mirror."""
    shown = str(out_dir) if shown is None else shown
    state_file = Path(out_dir) / STATE_DIR / RUN_STATE
    if not state_file.is_file():
        raise InputError(f"{shown!r} holds no packtool run ({STATE_DIR}/{RUN_STATE} missing); "
                         "run tokenize or pack into it first")
    run = _read_state(state_file)
    extra = run.get("manifest")
    caps = extra.get("capacities") if isinstance(extra, dict) else None
    if not (isinstance(run.get("config_digest"), str) and _is_count(run.get("n_tasks")) and run.get("kind") in
            ("tokenized", "packed") and isinstance(run.get("config"), dict) and isinstance(extra, dict)
            and (run["kind"] == "tokenized" or isinstance(caps, dict) and _is_count(caps.get("max_tokens"))
                 and _is_count(caps.get("max_vision_units")))):
        raise InputError(f"{str(join(shown, STATE_DIR, RUN_STATE))!r} is damaged; run the tokenize or pack command again (it resumes, "
                         "or pass --overwrite to start over)")
    return run


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
    # the marker's own temporary: a worker stopped between writing it and renaming it into place
    for f in state.glob(f".{marker_path(out_dir, task).name}.*.tmp"):
        f.unlink(missing_ok=True)
    task_errors_path(out_dir, task).unlink(missing_ok=True)


#: The names an attempt at a task leaves (what :func:`clear_task` removes), the task's index the
#: first group: in the output folder its shards and their temporaries, in ``.packtool`` its error
#: log, its completion marker and their temporaries.
_TASK_FILES = (
    (None, (re.compile(rf"part-({_TASK_ID})-.*\.parquet", re.ASCII), re.compile(rf"\.part-({_TASK_ID})-.*\.tmp", re.ASCII))),
    (STATE_DIR, (re.compile(rf"errors-({_TASK_ID})\.jsonl", re.ASCII), re.compile(rf"task-({_TASK_ID})\.json", re.ASCII),
                 re.compile(rf"\.errors-({_TASK_ID})\.jsonl.*\.tmp", re.ASCII),
                 re.compile(rf"\.task-({_TASK_ID})\.json\..*\.tmp", re.ASCII))),
)


def clear_tasks(out_dir: Path, tasks) -> None:
    """:func:`clear_task` of each of ``tasks`` from one listing of the output folder and one of
    ``.packtool``: a run's driver clears what earlier attempts left of every task it is about to
    run before starting them, so that a task need not list the folder itself (which made each
    task's start cost grow with the shards already written: quadratic in a run of thousands of
    tasks, and on a shared file system a listing of thousands of entries a task)."""
    want = set(tasks)
    if not want:
        return
    out_dir = Path(out_dir)
    for sub, patterns in _TASK_FILES:
        folder = out_dir / sub if sub else out_dir
        try:
            names = os.listdir(folder)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for name in names:
            for pattern in patterns:
                m = pattern.fullmatch(name)
                if m is not None:
                    if int(m.group(1)) in want:
                        (folder / name).unlink(missing_ok=True)
                    break


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
    if not isinstance(record, dict) or record.get("config_digest") != config_digest or record.get("task") != task:
        return None
    shards = record.get("shards")
    if not isinstance(shards, list) or not isinstance(record.get("counts"), dict):
        return None
    from .publication import listed_sizes

    listed = listed_sizes(out_dir)  # the shards' sizes in the bucket when out_dir mirrors one
    for s in shards:
        # a marker naming anything but its own task's shards marks nothing: the task is redone
        if not isinstance(s, dict) or not isinstance(s.get("file"), str) or shard_name_problem(s["file"]) \
                or not s["file"].startswith(task_prefix(task) + "-"):
            return None
        if listed is not None:
            if listed.get(s["file"]) != s.get("bytes"):
                return None
            continue
        f = Path(out_dir) / s["file"]
        if f.is_symlink() or not f.is_file() or f.stat().st_size != s.get("bytes"):
            return None
    return record if _log_whole(out_dir, task, record) else None


def _log_whole(out_dir: Path, task: int, record: dict) -> bool:
    """Whether the task's rejected rows (``errors-TTTTT.jsonl``, of which ``errors.jsonl`` is made)
    are there as its marker records them: one ``stat``.

    The marker's ``errors_bytes`` is the log's size; an empty log may be absent (a bucket stores
    none). A marker written before packtool recorded the size has only its ``rejected`` count to
    go by: its log must be there when it rejected any row. A link is never followed (the run's
    state stays inside its directory).
    """
    f = task_errors_path(out_dir, task)
    if f.is_symlink():
        return False
    size = f.stat().st_size if f.is_file() else None
    want = record.get("errors_bytes")
    if want is None:
        return size is not None or not record["counts"].get("rejected")
    return _is_count(want) and (size or 0) == want


def shard_error(file: Path, exc: BaseException) -> InputError:
    """The error for a shard whose bytes cannot be read (a damaged page, a cut file)."""
    why = " ".join(str(exc).split())[:300]  # Arrow's text may hold newlines: the error stays one line
    return InputError(f"shard {str(file)!r} cannot be read ({why}); the file is damaged: "
                      "re-run the stage that wrote it, or copy it again")


def open_shard(directory: Path, entry: dict, *, sha256: bool = False) -> pq.ParquetFile:
    """Open one shard a manifest lists, after checking it is the file the manifest describes.

    Always (a ``stat`` and the footer): present, the listed size, the listed row count; pages
    are read with their CRC32 checked, so a damaged page raises instead of decoding to wrong
    values. With ``sha256`` the whole file is hashed first (catches a same-size swap too).

    Raises:
        InputError: naming the shard, what differs, and the fix.
    """
    file = Path(directory) / entry["file"]
    if not file.is_file():
        raise InputError(f"shard {str(file)!r} listed in {MANIFEST} is missing; re-run the stage that wrote it")
    size = file.stat().st_size
    if size != entry["bytes"]:
        raise InputError(f"shard {str(file)!r} is {size:,} bytes but {MANIFEST} says {entry['bytes']:,}; it was cut "
                         "short, replaced or modified: re-run the stage that wrote it, or copy it again")
    if sha256 and sha256_file(file) != entry["sha256"]:
        raise InputError(f"shard {str(file)!r} does not match the sha256 in {MANIFEST}; it was replaced or "
                         "modified: re-run the stage that wrote it, or copy it again")
    try:
        pf = pq.ParquetFile(file, page_checksum_verification=True)
    except PermissionError as exc:
        raise InputError(f"cannot read shard {str(file)!r} ({exc.strerror}); make it readable") from None
    except (pa.ArrowException, OSError) as exc:
        raise shard_error(file, exc) from None
    if pf.metadata.num_rows != entry["rows"]:
        raise InputError(f"shard {str(file)!r} holds {pf.metadata.num_rows:,} rows but {MANIFEST} says "
                         f"{entry['rows']:,}; re-run the stage that wrote it")
    return pf


def read_shard(directory: Path, entry: dict, columns: list[str] | None = None) -> pa.Table:
    """Columns of one listed shard (:func:`open_shard`'s checks, damaged pages as ``InputError``)."""
    pf = open_shard(directory, entry)
    try:
        return pf.read(columns=columns, use_threads=False)
    except (pa.ArrowException, OSError) as exc:
        raise shard_error(Path(directory) / entry["file"], exc) from None


def iter_shard_tables(path: Path, manifest: dict, columns: list[str] | None = None) -> Iterator[pa.Table]:
    """Yield each listed shard as a table (``columns`` to read only some), in manifest order."""
    for entry in manifest["shards"]:
        yield read_shard(Path(path), entry, columns)
