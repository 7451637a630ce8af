"""Input formats: each reader maps its fields to :class:`~packtool.records.Sample` and nothing more.

Files are read record by record (JSON arrays, JSONL, gzip JSONL); every record is then
given to the format's ``parse(record, source, row)``. ``--format auto`` looks at the
keys of each record. A record that cannot be read or parsed becomes a
:class:`Rejected` with a reason code, never an exception.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, InputError, SampleError
from ..records import Sample
from . import llava

__all__ = ["Rejected", "iter_samples", "expand_inputs", "PARSERS", "detect_format"]

PARSERS = {"llava": llava.parse}


@dataclass(frozen=True, slots=True)
class Rejected:
    """An input row that did not become a sample."""

    source: str
    source_row: int
    sample_id: str | None
    reason: str
    message: str

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "row": self.source_row,
            "sample_id": self.sample_id,
            "reason": self.reason,
            "message": self.message,
        }


_SUFFIXES = (".json", ".jsonl", ".jsonl.gz", ".json.gz")


def expand_inputs(inputs: list[Path]) -> list[Path]:
    """Files named directly, plus the supported files under named directories, sorted."""
    files: list[Path] = []
    for p in inputs:
        if p.is_dir():
            files.extend(sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(_SUFFIXES)))
        elif p.is_file():
            files.append(p)
        else:
            raise InputError(f"input {str(p)!r} does not exist")
    if not files:
        raise InputError(f"no input files found in {', '.join(map(str, inputs))}; expected {', '.join(_SUFFIXES)}")
    return files


def _open_text(path: Path):
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def _iter_records(path: Path) -> Iterator[tuple[int, object]]:
    """Yield ``(row, record_or_SampleError)``: JSON arrays element by element, JSONL line by line."""
    with _open_text(path) as fh:
        head = fh.read(1 << 12).lstrip()
        fh.seek(0)
        if head.startswith(b"["):
            try:
                data = json.loads(fh.read())
            except (ValueError, RecursionError) as exc:
                raise InputError(f"{path}: not valid JSON ({exc}); fix the file or convert it to JSONL") from None
            if not isinstance(data, list):
                raise InputError(f"{path}: expected a JSON array of records")
            yield from enumerate(data)
            return
        for row, line in enumerate(fh):
            if not line.strip():
                continue
            try:
                yield row, json.loads(line)
            except UnicodeDecodeError as exc:
                yield row, SampleError("bad_json", f"line is not valid UTF-8: {exc}")
            except (ValueError, RecursionError) as exc:
                yield row, SampleError("bad_json", f"line is not valid JSON: {str(exc)[:200]}")


def detect_format(record: dict) -> str:
    if "conversations" in record:
        return "llava"
    raise SampleError("bad_record", f"cannot tell the format from keys {sorted(record)[:8]}; pass --format")


def iter_samples(files: list[Path], fmt: str = "auto") -> Iterator[Sample | Rejected]:
    """Every record of every file, as a Sample or a Rejected row, in input order."""
    if fmt != "auto" and fmt not in PARSERS:
        raise ConfigError(f"unknown --format {fmt!r}; choose auto or one of: {', '.join(sorted(PARSERS))}")
    for path in files:
        source = str(path)
        for row, rec in _iter_records(path):
            sid = rec.get("id") if isinstance(rec, dict) else None
            sid = str(sid) if sid is not None else None
            try:
                if isinstance(rec, SampleError):
                    raise rec
                if not isinstance(rec, dict):
                    raise SampleError("bad_record", f"record is a {type(rec).__name__}, not an object")
                parser = PARSERS[detect_format(rec) if fmt == "auto" else fmt]
                yield parser(rec, source, row)
            except SampleError as err:
                yield Rejected(source, row, sid, err.reason, err.message)
