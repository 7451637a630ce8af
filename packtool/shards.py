"""Shard writer and reader as a pair: atomic shards, manifest last, sha256 per shard.

A shard is written as ``.part-NNNNN.parquet.tmp`` and renamed into place only once
closed; ``manifest.json`` is written (atomically too) after every shard is in place.
Readers trust the manifest: a shard not listed there does not exist.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from . import __version__
from .errors import InputError, OutputError, ResumeMismatchError
from .config import config_diff
from .schema import SCHEMA_VERSION

__all__ = [
    "ShardWriter",
    "shard_name",
    "write_manifest",
    "read_manifest",
    "sha256_file",
    "prepare_output",
    "iter_shard_tables",
    "MANIFEST",
    "ERRORS",
]

MANIFEST = "manifest.json"
ERRORS = "errors.jsonl"

# Fixed writer options: the same rows always give the same bytes.
_WRITE_OPTS = dict(compression="zstd", compression_level=3, use_dictionary=False, write_statistics=False,
                   data_page_version="2.0", store_schema=True)


def shard_name(index: int, prefix: str = "part") -> str:
    return f"{prefix}-{index:05d}.parquet"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class ShardWriter:
    """Writes rows to numbered Parquet shards of at most ``rows_per_shard`` rows each.

    Example:
        >>> with ShardWriter(out, schema, rows_per_shard=1000) as w:   # doctest: +SKIP
        ...     w.write_rows(rows)
        >>> w.shards   # [{"file": "part-00000.parquet", "rows": ..., "bytes": ..., "sha256": ...}]
    """

    def __init__(self, out_dir: Path, schema: pa.Schema, rows_per_shard: int, row_group_rows: int = 1024,
                 prefix: str = "part", first_index: int = 0) -> None:
        self.out_dir = Path(out_dir)
        self.schema = schema
        self.rows_per_shard = rows_per_shard
        self.row_group_rows = max(1, min(row_group_rows, rows_per_shard))
        self.prefix = prefix
        self.shards: list[dict] = []
        self._index = first_index
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self._writer: pq.ParquetWriter | None = None
        self._rows_in_shard = 0

    def write_table(self, table: pa.Table) -> None:
        """Append rows; shards and row groups are cut at fixed row counts, so output is deterministic."""
        table = table.cast(self.schema) if table.schema != self.schema else table
        offset = 0
        while offset < table.num_rows:
            room = self.rows_per_shard - self._rows_in_shard - self._pending_rows
            take = min(room, table.num_rows - offset)
            self._pending.append(table.slice(offset, take))
            self._pending_rows += take
            offset += take
            self._flush_groups(final=False)
            if self._rows_in_shard + self._pending_rows >= self.rows_per_shard:
                self._close_shard()

    def write_rows(self, rows: list[dict]) -> None:
        if rows:
            self.write_table(pa.Table.from_pylist(rows, schema=self.schema))

    def _flush_groups(self, final: bool) -> None:
        while self._pending_rows >= self.row_group_rows or (final and self._pending_rows):
            table = pa.concat_tables(self._pending)
            n = min(self.row_group_rows, table.num_rows)
            if self._writer is None:
                tmp = self.out_dir / f".{shard_name(self._index, self.prefix)}.tmp"
                self._writer = pq.ParquetWriter(tmp, self.schema, **_WRITE_OPTS)
            self._writer.write_table(table.slice(0, n).combine_chunks(), row_group_size=n)
            self._rows_in_shard += n
            rest = table.slice(n)
            self._pending = [rest] if rest.num_rows else []
            self._pending_rows = rest.num_rows

    def _close_shard(self) -> None:
        self._flush_groups(final=True)
        if self._writer is None:
            return
        self._writer.close()
        self._writer = None
        name = shard_name(self._index, self.prefix)
        tmp = self.out_dir / f".{name}.tmp"
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
            (self.out_dir / f".{shard_name(self._index, self.prefix)}.tmp").unlink(missing_ok=True)


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
    _atomic_write_text(out_dir / MANIFEST, json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return manifest


def read_manifest(path: Path, kind: str | None = None) -> dict:
    """Read ``path/manifest.json`` and check its kind and schema version."""
    file = Path(path) / MANIFEST
    if not file.is_file():
        raise InputError(f"{str(path)!r} has no {MANIFEST}; is it the output of packtool tokenize/pack, and did that run finish?")
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise InputError(f"{file}: manifest is not valid JSON ({exc}); re-run the command that wrote it") from None
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise InputError(
            f"{file}: schema version {manifest.get('schema_version')!r}, this packtool reads {SCHEMA_VERSION}; "
            "re-run the stage with this version"
        )
    if kind is not None and manifest.get("kind") != kind:
        raise InputError(f"{str(path)!r} holds {manifest.get('kind')} shards, expected {kind} shards")
    return manifest


def prepare_output(out_dir: Path, kind: str, config: dict, digest: str, overwrite: bool) -> dict | None:
    """Make ``out_dir`` ready for a run; return the existing manifest when the same run already finished.

    A directory holding a finished run with another config is refused (naming the settings that
    differ) unless ``overwrite``; leftovers of an unfinished run are removed.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputError(f"output {str(out_dir)!r} exists and is not a directory; choose another -o")
    manifest_file = out_dir / MANIFEST
    if manifest_file.is_file() and not overwrite:
        old = json.loads(manifest_file.read_text(encoding="utf-8"))
        if old.get("kind") == kind and old.get("config_digest") == digest:
            return old
        diff = config_diff(old.get("config", {}), config) or [f"kind: {old.get('kind')} -> {kind}"]
        raise ResumeMismatchError(
            f"{str(out_dir)!r} already holds a finished run with a different configuration "
            f"({'; '.join(diff)}); use another -o, or pass --overwrite to replace it"
        )
    if out_dir.is_dir():
        for f in out_dir.iterdir():
            if f.name == MANIFEST or f.name == ERRORS or f.name.startswith((".part-", "part-")) or f.name.endswith(".tmp"):
                f.unlink()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise OutputError(f"cannot write to output {str(out_dir)!r}: {exc.strerror}; choose a writable -o") from None
    return None


def iter_shard_tables(path: Path, manifest: dict, columns: list[str] | None = None) -> Iterator[pa.Table]:
    """Yield each listed shard as a table (``columns`` to read only some), in manifest order."""
    for entry in manifest["shards"]:
        file = Path(path) / entry["file"]
        if not file.is_file():
            raise InputError(f"shard {str(file)!r} listed in the manifest is missing; re-run the stage that wrote it")
        yield pq.read_table(file, columns=columns)
