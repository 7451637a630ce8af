"""Input formats: each reader maps its fields to :class:`~packtool.records.Sample` and nothing more.

Two layers:

* **containers** hold records: JSON arrays, JSONL, gzip / zstd compressed JSON and JSONL
  (``.gz``, ``.zst``; zstd needs ``pip install packtool[zstd]``), and Hugging Face
  Parquet files (read in record batches; directories of shards are expanded);
* **record formats** turn one record into a sample: ``llava``, ``qwen-vl``,
  ``sharegpt`` (LLaMA-Factory), ``swift`` (ms-swift) and ``molmo`` (PixMo
  ``message_list`` → one message tree).

``--format auto`` picks the record format per record from its keys
(:func:`detect_format`), so one run can mix every format. A record that cannot be
read or parsed becomes a :class:`Rejected` with a reason code, never an exception.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, InputError, SampleError
from ..records import Sample
from . import hf_parquet, llava, molmo, qwen_vl, sharegpt, swift

__all__ = ["Rejected", "iter_samples", "parse_record", "parse_json_line", "iter_records", "expand_inputs", "PARSERS", "FORMATS", "detect_format", "SUFFIXES"]

log = logging.getLogger(__name__)

#: ``--format`` value → parser ``(record, source, row) -> Sample``.
PARSERS = {
    "llava": llava.parse,
    "qwen-vl": qwen_vl.parse,
    "sharegpt": sharegpt.parse,
    "swift": swift.parse,
    "molmo": molmo.parse,
}
#: Every ``--format`` choice.
FORMATS = ("auto", *PARSERS)


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


_JSON_SUFFIXES = (".json", ".jsonl")
_COMPRESSIONS = ("", ".gz", ".zst")
SUFFIXES = tuple(s + c for s in _JSON_SUFFIXES for c in _COMPRESSIONS) + hf_parquet.SUFFIXES


def _scan_dir(root: Path) -> list[Path]:
    """The supported files under ``root``, sorted; hidden entries and packtool outputs are skipped.

    A corpus directory often holds earlier results (``tokenize data -o data/tok`` run twice):
    their shards are packtool's own rows, not input records, so a directory holding a packtool
    run (a ``.packtool/`` state folder or a manifest) is left out with everything under it, and
    so is every entry whose name starts with ``.`` (``.git``, editor and OS files).
    """
    from ..shards import is_output_dir

    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        skipped = [d for d in dirnames if d.startswith(".") or is_output_dir(here / d)]
        for d in skipped:
            if not d.startswith("."):
                log.info("skipping %s: a packtool output directory, not input", here / d)
        dirnames[:] = sorted(d for d in dirnames if d not in skipped)
        found.extend(here / f for f in filenames if f.endswith(SUFFIXES) and not f.startswith("."))
    return sorted(found)


def expand_inputs(inputs: list[Path]) -> list[Path]:
    """Files named directly, plus the supported files under named directories, sorted.

    Under a directory, hidden entries and packtool output directories are skipped
    (see :func:`_scan_dir`); a named file is always read.

    Raises:
        InputError: an input does not exist, is itself a packtool output, or holds no input files.
    """
    from ..shards import is_output_dir

    files: list[Path] = []
    for p in inputs:
        if p.is_dir():
            if is_output_dir(p):
                raise InputError(f"input {str(p)!r} is a packtool output directory, not raw records; "
                                 "pass the corpus it was made from (pack takes a tokenized directory)")
            files.extend(_scan_dir(p))
        elif p.is_file():
            files.append(p)
        else:
            raise InputError(f"input {str(p)!r} does not exist")
    if not files:
        raise InputError(f"no input files found in {', '.join(map(str, inputs))}; expected {', '.join(SUFFIXES)}")
    return files


def _open_binary(path: Path):
    """A buffered binary stream of the file's (decompressed) bytes, with ``peek``."""
    name = path.name
    if name.endswith(".gz"):
        return io.BufferedReader(gzip.open(path, "rb"), buffer_size=1 << 16)
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise InputError(f"{path}: reading .zst files needs the zstandard package; "
                             f"run `pip install packtool[zstd]` or decompress the file") from None
        raw = open(path, "rb")
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True), buffer_size=1 << 16)
    return open(path, "rb", buffering=1 << 16)


def _json_records(path: Path) -> Iterator[tuple[int, object]]:
    """JSON arrays element by element, JSONL line by line; a bad line is a SampleError."""
    with _open_binary(path) as fh:
        head = fh.peek(1 << 12)[: 1 << 12].lstrip()
        whole_json = head.startswith(b"[") or (head.startswith(b"{") and ".jsonl" not in path.name
                                               and not _looks_like_jsonl(fh.peek(1 << 16)))
        if whole_json:
            # Invalid UTF-8 becomes lone surrogates, so only the records holding it are rejected.
            text = fh.read().decode("utf-8", errors="surrogateescape")
            try:
                data = json.loads(text)
            except (ValueError, RecursionError) as exc:
                raise InputError(f"{path}: not valid JSON ({exc}); fix the file or convert it to JSONL") from None
            if isinstance(data, dict):
                data = [data]
            if not isinstance(data, list):
                raise InputError(f"{path}: expected a JSON array of records")
            yield from enumerate(data)
            return
        for row, line in enumerate(fh):
            if line.strip():
                yield row, parse_json_line(line)


def parse_json_line(line: bytes) -> object:
    """One JSONL line as a value, or the ``SampleError`` (``bad_encoding``/``bad_json``) it earns."""
    try:
        return json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return SampleError("bad_encoding", f"line is not valid UTF-8: {exc}")
    except (ValueError, RecursionError) as exc:
        return SampleError("bad_json", f"line is not valid JSON: {str(exc)[:200]}")


def _looks_like_jsonl(head: bytes) -> bool:
    """True when the first line of ``head`` is a complete JSON value (so the file is JSONL)."""
    first, sep, _ = head.partition(b"\n")
    if not sep:
        return False
    try:
        json.loads(first)
    except ValueError:
        return False
    return True


def iter_records(path: Path) -> Iterator[tuple[int, object]]:
    """``(row, record_or_SampleError)`` for every record of one input file."""
    if path.name.endswith(hf_parquet.SUFFIXES):
        return hf_parquet.iter_records(path)
    return _json_records(path)


def detect_format(record: dict) -> str:
    """The record format of one record, from its keys.

    ``message_list`` → ``molmo``; ``messages`` → ``swift`` (ms-swift and LLaMA-Factory
    role/content records read the same), or ``sharegpt`` when its turns use
    ``from``/``value``; ``conversations`` with ``images``, ``videos`` or ``system`` →
    ``sharegpt`` (LLaMA-Factory); other ``conversations`` → ``llava``.

    Example:
        >>> detect_format({"image": "a.jpg", "conversations": []})
        'llava'
    """
    if "message_list" in record:
        return "molmo"
    if "messages" in record:
        msgs = record["messages"]
        if isinstance(msgs, list) and msgs and isinstance(msgs[0], dict) and "from" in msgs[0]:
            return "sharegpt"
        return "swift"
    if "conversations" in record:
        if "images" in record or "videos" in record or "system" in record:
            return "sharegpt"
        return "llava"
    raise SampleError("bad_record", f"cannot tell the format from keys {sorted(record)[:8]}; "
                      f"expected conversations, messages or message_list (or pass --format)")


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ConfigError(f"unknown --format {fmt!r}; choose one of: {', '.join(FORMATS)}")


def parse_record(rec: object, source: str, row: int, fmt: str = "auto") -> Sample | Rejected:
    """One record (or the SampleError its line raised) as a Sample or a Rejected row."""
    sid = rec.get("id") if isinstance(rec, dict) else None
    sid = str(sid) if sid is not None else None
    try:
        if isinstance(rec, SampleError):
            raise rec
        if not isinstance(rec, dict):
            raise SampleError("bad_record", f"record is a {type(rec).__name__}, not an object")
        parser = PARSERS[detect_format(rec) if fmt == "auto" else fmt]
        return parser(rec, source, row)
    except SampleError as err:
        return Rejected(source, row, sid, err.reason, err.message)
    except (TypeError, AttributeError) as exc:  # a field of an unexpected type
        return Rejected(source, row, sid, "bad_record", f"unexpected field type: {exc}")
    except RecursionError:
        return Rejected(source, row, sid, "bad_record", "record is nested too deeply")


def iter_samples(files: list[Path], fmt: str = "auto") -> Iterator[Sample | Rejected]:
    """Every record of every file, as a Sample or a Rejected row, in input order."""
    check_format(fmt)
    for path in files:
        source = str(path)
        for row, rec in iter_records(path):
            yield parse_record(rec, source, row, fmt)
