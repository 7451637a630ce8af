"""Input formats: each reader maps its fields to :class:`~packtool.records.Sample` and nothing more.

Two layers:

* **containers** hold records: JSON arrays (read element by element: :mod:`.jsonarray`),
  JSONL (``.jsonl`` or ``.ndjson``), gzip / zstd
  compressed JSON and JSONL (``.gz``, ``.zst``; zstd needs ``pip install packtool[zstd]``),
  and Hugging Face Parquet files (read in record batches; directories of shards are
  expanded); suffixes match in any case;
* **record formats** turn one record into a sample: ``llava``, ``qwen-vl``,
  ``sharegpt`` (LLaMA-Factory), ``swift`` (ms-swift), ``molmo`` (PixMo
  ``message_list`` → one message tree) and ``cauldron`` (The Cauldron's ``images`` +
  ``texts`` of ``{user, assistant}`` exchanges).

``--format auto`` picks the record format per record from its keys
(:func:`detect_format`), so one run can mix every format. A record that cannot be
read or parsed becomes a :class:`Rejected` with a reason code, never an exception.
"""

from __future__ import annotations

import gzip
import io
import itertools
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import ConfigError, InputError, SampleError, quoted
from ..records import Sample
from . import cauldron, hf_parquet, jsonarray, llava, molmo, qwen_vl, sharegpt, swift
from .common import FALL_BACK, check_sample, decode_turn_fields, fast_json, printable, record_id

__all__ = ["Rejected", "iter_samples", "parse_record", "parse_json_line", "iter_records", "expand_inputs", "PARSERS",
           "FORMATS", "detect_format", "SUFFIXES", "UTF8_BOM", "is_input_name", "is_parquet_name", "is_jsonl_name",
           "compressed_as", "head_problem", "opens_alone"]

log = logging.getLogger(__name__)

#: ``--format`` value → parser ``(record, source, row) -> Sample``.
PARSERS = {
    "llava": llava.parse,
    "qwen-vl": qwen_vl.parse,
    "sharegpt": sharegpt.parse,
    "swift": swift.parse,
    "molmo": molmo.parse,
    "cauldron": cauldron.parse,
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


#: The UTF-8 byte-order mark that Windows tools (Notepad, PowerShell, .NET writers) put at the
#: start of a text file. At a file's first byte it is skipped; anywhere else it is a bad row.
UTF8_BOM = b"\xef\xbb\xbf"

#: JSON Lines under either of its names (``.ndjson`` is the same format).
_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_JSON_SUFFIXES = (".json", *_JSONL_SUFFIXES)
_COMPRESSIONS = ("", ".gz", ".zst")
#: Input file suffixes, matched in any case (``TRAIN.JSONL``, ``part-0.PARQUET``).
SUFFIXES = tuple(s + c for s in _JSON_SUFFIXES for c in _COMPRESSIONS) + hf_parquet.SUFFIXES


def is_input_name(name: str) -> bool:
    """Whether a file name ends in one of :data:`SUFFIXES`, in any case.

    Example:
        >>> is_input_name("TRAIN.JSONL"), is_input_name("a.ndjson.gz"), is_input_name("README.md")
        (True, True, False)
    """
    return name.lower().endswith(SUFFIXES)


def is_parquet_name(name: str) -> bool:
    """Whether a file name says Parquet, in any case."""
    return name.lower().endswith(hf_parquet.SUFFIXES)


def is_jsonl_name(name: str, compressed: bool = True) -> bool:
    """Whether a file name says JSON Lines (``.jsonl``, ``.ndjson``), in any case; with
    ``compressed`` also under ``.gz`` / ``.zst``.

    Example:
        >>> is_jsonl_name("a.NDJSON.gz"), is_jsonl_name("a.jsonl.gz", compressed=False)
        (True, False)
    """
    name = name.lower()
    if compressed:
        name = name.removesuffix(".gz").removesuffix(".zst")
    return name.endswith(_JSONL_SUFFIXES)


def _scan_dir(root: Path, skipped: list[tuple[str, str]] | None = None) -> list[Path]:
    """The supported files under ``root``, sorted; hidden entries and packtool outputs are skipped.

    A corpus directory often holds earlier results (``tokenize data -o data/tok`` run twice):
    their shards are packtool's own rows, not input records, so a directory holding a packtool
    run (a ``.packtool/`` state folder or a manifest) is left out with everything under it, and
    so is every entry whose name starts with ``.`` (``.git``, editor and OS files). Each entry
    left out, and why, is appended to ``skipped`` when given.
    """
    files = []
    for f in _walk(root, skipped):
        if is_input_name(f.name):
            files.append(f)
        elif skipped is not None:
            skipped.append((str(f), _why_not_input(f.name)))
    return sorted(files)


#: Compression suffixes packtool does not read.
_UNREAD_COMPRESSIONS = (".bz2", ".xz", ".lzma", ".lz4", ".zip", ".7z", ".br", ".gzip", ".zstd")
_UNREAD = "which packtool does not read"


def _why_not_input(name: str) -> str:
    """Why a directory scan skips a file: a name that is an input's under a compression packtool
    does not read (``train.jsonl.xz``) says so, and :func:`expand_inputs` warns of it."""
    stem, dot, suffix = name.rpartition(".")
    if dot and "." + suffix.lower() in _UNREAD_COMPRESSIONS and is_input_name(stem):
        return f"compressed as .{suffix.lower()}, {_UNREAD}"
    return "not an input file suffix"


def expand_inputs(inputs: list[Path], present: set[str] = frozenset()) -> list[Path]:
    """Files named directly, plus the supported files under named directories, sorted.

    Under a directory, hidden entries, packtool output directories and files without an input
    suffix are skipped (see :func:`_scan_dir`); a named file is always read. Paths in ``present``
    are files known to exist elsewhere (objects listed in a bucket, fetched when read).

    Raises:
        InputError: an input does not exist, is itself a packtool output, or is a directory holding
            no input file (the message lists what was skipped there, and why).
    """
    from ..shards import is_output_dir

    if not inputs:
        raise InputError("no inputs given; name at least one input file or directory")
    files: list[Path] = []
    for p in inputs:
        if str(p) in present:
            files.append(p)
        elif p.is_dir():
            if is_output_dir(p):
                raise InputError(f"input {str(p)!r} is a packtool output directory, not raw records; "
                                 "pass the corpus it was made from (pack takes a tokenized directory)")
            skipped: list[tuple[str, str]] = []
            found = _scan_dir(p, skipped)
            if not found:
                raise InputError(f"no input files found in {str(p)!r} ({_skipped_summary(p, skipped)}); expected "
                                 f"{', '.join(SUFFIXES)}, in any case")
            if skipped:
                log.info("%s: %d entries skipped (%s)", p, len(skipped), _skipped_summary(p, skipped))
            if unread := [entry for entry in skipped if entry[1].endswith(_UNREAD)]:  # records left out: not only -v
                log.warning("%s: %s; decompress them, or recompress them with gzip or zstd (.gz, .zst)", p,
                            _skipped_summary(p, unread, limit=10))
            files.extend(found)
        elif p.is_file():
            files.append(p)
        elif p.exists():  # a pipe (``<(zcat ...)``), a socket, a device
            raise InputError(f"input {str(p)!r} is not a regular file (a pipe or a device): tokenize reads an input "
                             "more than once (to plan its tasks, then in them); write it to a file first, e.g. "
                             "`zcat data.jsonl.gz > data.jsonl` (or pass the .gz file itself)")
        else:
            raise InputError(f"input {str(p)!r} does not exist")
    if not files:
        raise InputError(f"no input files found in {', '.join(map(str, inputs))}; expected {', '.join(SUFFIXES)}")
    seen: dict[object, Path] = {}
    for f in files:  # one file named twice (again, through a link, or under a named directory) would be read twice
        key = str(f) if str(f) in present else f.resolve()
        if key in seen:
            what = "is named twice" if str(seen[key]) == str(f) else f"is the same file as {str(seen[key])!r}"
            raise InputError(f"input {str(f)!r} {what}, so every record in it would be read twice; name each file once")
        seen[key] = f
    return files


def _skipped_summary(root: Path, skipped: list[tuple[str, str]], limit: int = 5) -> str:
    """What a directory scan left out, for a message: ``'notes.txt' (not an input file suffix), ...``."""
    if not skipped:
        return "it is empty"
    shown = ", ".join(f"{printable(os.path.relpath(path, root))!r} ({why})" for path, why in sorted(skipped)[:limit])
    more = len(skipped) - limit
    return f"skipped {shown}" + (f" and {more} more" if more > 0 else "")


class _FrameStream(io.RawIOBase):
    """The decompressed bytes of a file of one or more compressed frames (zstd frames, gzip
    members); ``EOFError`` when the input ends inside a frame, raised only once every byte
    decompressed before the break has been read, so each whole line before it is still a row.

    ``zstandard``'s ``stream_reader`` returns a truncated stream's bytes without saying so,
    which would lose the tail of a file silently; ``gzip.open`` says so, but its error
    throws away what it had decompressed of the last read (a cut file's first 64 KiB of
    lines, or all of a small one, lost with the cut tail). ``new()`` makes a frame's
    decompressor (``decompress``, ``eof``, ``unused_data``); ``between(data)`` gets what
    follows a frame and returns it with any padding dropped, raising where it is no frame.
    """

    def __init__(self, raw, new: Callable[[], Any], what: str, between: Callable[[bytes], bytes] | None = None) -> None:
        self.raw = raw
        self.new = new
        self.what = what
        self.between = between
        self.obj = new()
        self.in_frame = False
        self.buf = memoryview(b"")
        self.failed: Exception | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not len(self.buf):
            if self.failed is not None:  # raised once the bytes decompressed before it are read
                raise self.failed
            data = self.raw.read(1 << 16)
            if not data:
                if self.in_frame:
                    raise EOFError(f"the file ends inside a {self.what} frame")
                return 0
            out = []
            try:
                while data:
                    if self.obj.eof:  # the next frame of a multi-frame file
                        data = self.between(data) if self.between is not None else data
                        if not data:
                            break
                        self.obj = self.new()
                    out.append(self.obj.decompress(data))
                    data = self.obj.unused_data if self.obj.eof else b""
            except Exception as exc:  # damaged bytes: what came before them is still rows
                self.failed = exc
            self.in_frame = not self.obj.eof
            self.buf = memoryview(b"".join(out))
        n = min(len(b), len(self.buf))
        b[:n] = self.buf[:n]
        self.buf = self.buf[n:]
        return n

    def close(self) -> None:
        self.raw.close()
        super().close()


def _gzip_member_gap(data: bytes) -> bytes:
    """What follows a gzip member: the next member, after any zero padding (as ``gzip`` reads it)."""
    data = data.lstrip(b"\0")
    if data and not b"\x1f\x8b".startswith(data[:2]):
        raise gzip.BadGzipFile(f"bytes after a gzip member are not another member (they start {data[:4]!r})")
    return data


def _walk(root: Path, skipped: list[tuple[str, str]] | None = None) -> Iterator[Path]:
    """Every file under ``root`` but hidden entries and packtool output directories (see :func:`_scan_dir`),
    which are appended to ``skipped`` with the reason when it is given.

    A directory that cannot be listed is an error, not a silent gap (``os.walk`` and
    ``Path.rglob`` skip unreadable directories without a word); a link back up the tree
    is listed once.
    """
    from ..shards import is_output_dir

    seen: set[str] = set()
    stack = [root]
    while stack:
        d = stack.pop()
        real = os.path.realpath(d)
        if real in seen:
            continue
        seen.add(real)
        try:
            entries = list(os.scandir(d))
        except OSError as exc:
            raise InputError(f"cannot list {str(d)!r} inside input {str(root)!r} ({exc.strerror}); make it "
                             "readable or leave it out of the inputs") from None
        for e in entries:
            if e.name.startswith("."):
                if skipped is not None:
                    skipped.append((e.path, "hidden"))
                continue
            if e.is_dir():
                if is_output_dir(Path(e.path)):
                    log.info("skipping %s: a packtool output directory, not input", e.path)
                    if skipped is not None:
                        skipped.append((e.path, "a packtool output directory"))
                    continue
                stack.append(Path(e.path))
            elif e.is_file():
                yield Path(e.path)
            elif skipped is not None:  # a pipe, socket or device (read more than once, it would hang or differ)
                skipped.append((e.path, "not a regular file"))


def _open_binary(path: Path):
    """A buffered binary stream of the file's (decompressed) bytes, with ``peek``."""
    name = path.name.lower()
    if name.endswith(".gz"):
        import zlib

        return io.BufferedReader(_FrameStream(open(path, "rb"), lambda: zlib.decompressobj(wbits=31), "gzip",
                                              _gzip_member_gap), buffer_size=1 << 16)
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise InputError(f"{path}: reading .zst files needs the zstandard package; "
                             f"run `pip install packtool[zstd]` or decompress the file") from None
        return io.BufferedReader(_FrameStream(open(path, "rb"), zstandard.ZstdDecompressor().decompressobj, "zstd"),
                                 buffer_size=1 << 16)
    return open(path, "rb", buffering=1 << 16)


#: The first bytes of compressed files, by compression (none can start a JSON text).
_MAGIC = ((b"\x1f\x8b", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"),
          (b"PK\x03\x04", "zip"), (b"7z\xbc\xaf\x27\x1c", "7z"), (b"\x04\x22\x4d\x18", "lz4"))
#: The suffix that makes packtool decompress a file, by compression.
_READ_AS = {"gzip": ".gz", "zstd": ".zst"}


def compressed_as(head: bytes) -> str | None:
    """The compression whose magic number ``head`` (a file's first bytes) starts with, or ``None``.

    Example:
        >>> compressed_as(b"BZh91AY&SY"), compressed_as(b'{"id": 1}')
        ('bzip2', None)
    """
    for magic, kind in _MAGIC:
        if head.startswith(magic):
            return kind
    return None


#: Byte-order marks of the encodings packtool does not read (UTF-32's first: it starts with UTF-16 LE's).
_OTHER_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
               (b"\xfe\xff", "UTF-16"))


def head_problem(name: str, head: bytes) -> SampleError | None:
    """The one row a whole JSON or JSONL file earns when its first bytes (``head``, decompressed
    when its name says so) show it is no text packtool reads, or ``None``: bytes compressed
    otherwise than its name says (:func:`compressed_as`) or twice, or UTF-16 / UTF-32 text (a
    byte-order mark; PowerShell 5 writes UTF-16). Read as UTF-8 lines, such a file was a
    ``bad_encoding`` or ``bad_json`` row per run of bytes between 0x0A bytes.
    """
    for mark, encoding in _OTHER_BOMS:
        if head.startswith(mark):
            return SampleError("bad_encoding", f"the file is {encoding} text (it starts with a {encoding} byte-order "
                                               "mark, as Windows PowerShell's > and Out-File write it); packtool reads "
                                               f"UTF-8: re-encode it, e.g. `iconv -f {encoding} -t UTF-8 IN > OUT`")
    kind = compressed_as(head)
    if kind is None:
        return None
    if name.lower().endswith((".gz", ".zst")):  # ``head`` is what the file decompresses to
        return SampleError("corrupt_file", f"the file is compressed twice: it decompresses to {kind}-compressed "
                                           "bytes (a download saved with its transfer encoding?); decompress it "
                                           "once, so that its one compression suffix says what its bytes are")
    return _compressed_file(name, kind)


def _compressed_file(name: str, kind: str) -> SampleError:
    """The ``corrupt_file`` row of a file whose bytes are ``kind``-compressed though its name does
    not make packtool decompress them (read as text, every run of bytes between newline bytes
    was a ``bad_encoding`` row)."""
    if kind in _READ_AS:
        fix = f"rename it to end in {_READ_AS[kind]} ({name}{_READ_AS[kind]})"
    else:
        fix = "decompress it, or recompress it with gzip or zstd (.gz, .zst), which packtool reads"
    return SampleError("corrupt_file", f"the file is {kind}-compressed, but its name does not say .gz or .zst, so "
                                       f"it is not read; {fix}")


def _decode_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean a compressed file's bytes are not what its name says (not an
    environment fault such as a permission or I/O error, which stops the run)."""
    import zlib

    errors: list[type[BaseException]] = [EOFError, gzip.BadGzipFile, zlib.error]
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:
        pass
    return tuple(errors)


def _corrupt_file(path: Path, exc: BaseException) -> SampleError:
    name = path.name.lower()
    kind = "zstd" if name.endswith(".zst") else "gzip" if name.endswith(".gz") else "file"
    if isinstance(exc, EOFError):
        what = f"the {kind} stream is truncated ({exc})"
    else:
        what = f"the file cannot be decompressed as {kind} ({exc})"
    return SampleError("corrupt_file", f"{what}; rows from here to the end of the file are lost: re-copy or "
                                      "re-compress the file")


def _json_records(path: Path) -> Iterator[tuple[int, object]]:
    """JSON arrays element by element, JSONL line by line; a bad line is a SampleError, and a
    file whose compressed bytes break off or are not its compression ends with one
    ``corrupt_file`` SampleError (the rows before it are kept)."""
    next_row = 0
    try:
        for row, rec in _json_records_unchecked(path):
            next_row = row + 1
            yield row, rec
    except _decode_errors() as exc:
        yield next_row, _corrupt_file(path, exc)


def _json_records_unchecked(path: Path) -> Iterator[tuple[int, object]]:
    with _open_binary(path) as fh:
        if (problem := head_problem(path.name, fh.peek(8)[:8])) is not None:
            yield 0, problem
            return
        # a leading byte-order mark is no part of the first record: sniff and read past it
        head = fh.peek(1 << 12)[: 1 << 12].removeprefix(UTF8_BOM).lstrip()
        lead: list[bytes] = []
        if head.startswith(b"{") and (not is_jsonl_name(path.name) or opens_alone(head)):
            lead = _first_lines(fh)
            whole_json = not _looks_like_jsonl(lead[-1].removeprefix(UTF8_BOM))
        else:
            whole_json = head.startswith(b"[")
        if whole_json and not lead:
            # an array: its frame checked in one pass (a compressed file is decompressed twice), then
            # each element parsed alone as it is read, never the whole file in memory
            with _open_binary(path) as first:
                sound = jsonarray.scan_stream(first) is not None
            if sound:
                for row, data in jsonarray.stream_elements(fh, str(path)):
                    yield row, jsonarray.parse_element(data)
                return
        if whole_json:
            raw = b"".join(lead) + fh.read()
            # Invalid UTF-8 becomes lone surrogates, so only the records holding it are rejected.
            text = raw.removeprefix(UTF8_BOM).decode("utf-8", errors="surrogateescape")
            try:
                data = json.loads(text)
            except (ValueError, RecursionError) as exc:
                if _second_line_is_record(raw) or (is_jsonl_name(path.name) and not _pretty_stream(exc)):
                    # JSONL whose first line is broken or not a record (``[1, 2]`` too, under any
                    # name): only that line is lost, not every record after it
                    yield from _jsonl_rows(io.BytesIO(raw))
                    return
                # one unreadable file is one rejected row (its records cannot be told apart), not a stopped run
                yield 0, SampleError("bad_json", f"the file is not valid JSON ({str(exc)[:200]})" + _why_not_json(exc))
                return
            if isinstance(data, dict):
                data = [data]
            if not isinstance(data, list):
                yield 0, SampleError("bad_json", f"the file holds a JSON {type(data).__name__}, not an array of records")
                return
            yield from enumerate(data)
            return
        yield from _jsonl_rows(itertools.chain(lead, fh))


def opens_alone(head: bytes) -> bool:
    """Whether ``head`` (a file's first bytes, from its first that is not whitespace) opens an
    object alone on its line: no record fits in ``{``, so its records are written over several
    lines (pretty-printed), and its lines are no rows: the file is read as one JSON text.

    Example:
        >>> opens_alone(b'{\\n  "id": "a",'), opens_alone(b'{"id": "a"}\\n')
        (True, False)
    """
    return head.partition(b"\n")[0].strip() == b"{"


def _why_not_json(exc: BaseException) -> str:
    """The end of the ``bad_json`` message of a file that is not one JSON text: pretty-printed
    records one after another (``jq '.[]'`` without ``-c``) are said to be so."""
    if _pretty_stream(exc):
        return (": it holds JSON values one after another, written over several lines each (pretty-printed, as jq "
                "writes them without -c), not one record per line; write one record per line (`jq -c . FILE`), or "
                "wrap them in a JSON array")
    return "; fix it or convert it to JSONL, one record per line"


def _pretty_stream(exc: BaseException) -> bool:
    """Whether the error of parsing a file whole shows records pretty-printed one after another:
    json stopped at "extra data" after a first value written over several lines, and the next
    value is one too (a JSONL file that opens with one such record is read line by line)."""
    if not (isinstance(exc, json.JSONDecodeError) and exc.msg == "Extra data"):
        return False
    doc, pos = exc.doc, exc.pos
    if "\n" not in doc[:pos].strip():  # json stops at the end of the first value: one record, not the file
        return False
    try:
        _, end = json.JSONDecoder().raw_decode(doc, pos)
    except (ValueError, RecursionError):
        return False
    return "\n" in doc[pos:end]


def _jsonl_rows(lines) -> Iterator[tuple[int, object]]:
    """``(row, record_or_SampleError)`` of JSONL lines; blank lines keep their row numbers."""
    for row, line in enumerate(lines):
        if row == 0:
            line = line.removeprefix(UTF8_BOM)
        if line.strip():
            yield row, parse_json_line(line)


def _second_line_is_record(raw: bytes) -> bool:
    """Whether the second line of ``raw`` that holds anything is a whole JSON object: JSONL, not
    one pretty-printed object (whose second line is a ``"key": value`` fragment)."""
    seen = 0
    for line in io.BytesIO(raw):
        if line.strip() and line.strip() != UTF8_BOM:
            seen += 1
            if seen == 2:
                return isinstance(parse_json_line(line), dict)
    return False


def parse_json_line(line: bytes) -> object:
    """One JSONL line as a value, or the ``SampleError`` (``bad_encoding``/``bad_json``) it earns.

    The value is what ``json.loads`` gives: :func:`~.common.fast_json` first, json where it
    declines (which reads the line or words the error).

    Example:
        >>> parse_json_line(b'{"id": 12345678901234567890123, "x": NaN}')
        {'id': 12345678901234567890123, 'x': nan}
    """
    value = fast_json(line)
    if value is not FALL_BACK:
        return value
    try:
        return json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return SampleError("bad_encoding", f"line is not valid UTF-8: {exc}")
    except (ValueError, RecursionError) as exc:
        if line.startswith(UTF8_BOM):  # json's own words ("decode using utf-8-sig") do not help here
            return SampleError("bad_json", "line starts with a UTF-8 byte-order mark, which only the first line of a "
                                           "file may carry (two files joined?); remove the mark (bytes EF BB BF)")
        if isinstance(exc, json.JSONDecodeError) and exc.msg == "Extra data" and exc.doc[:exc.pos].rstrip(" \t").endswith("\r"):
            return SampleError("bad_json", "line holds more than one JSON value, split by a bare carriage return: the "
                                           "file's lines end in CR alone (\\r, old Mac line ends), which JSONL does not; "
                                           "end them with \\n (e.g. `tr '\\r' '\\n' < IN > OUT`)")
        text = exc.doc.rstrip("\r\n") if isinstance(exc, json.JSONDecodeError) else None
        if text is not None and exc.pos >= len(text):
            # cut short: the error sits at the line end, which json counts as a next line ("line 2
            # column 1"); named on the line itself instead
            exc = json.JSONDecodeError(exc.msg, text, len(text))
        return SampleError("bad_json", f"line is not valid JSON: {str(exc)[:200]}")


def _first_lines(fh) -> list[bytes]:
    """The lines of a file that starts with ``{`` up to its first that holds anything: whether
    that line is a whole JSON value tells one object (pretty-printed or on one line) from JSONL
    under another name, however long it is (a record with an inline image runs past any peek);
    the blank lines before it are kept, so that they keep their row numbers."""
    lead = []
    while (line := fh.readline()) and not line.removeprefix(UTF8_BOM).strip():
        lead.append(line)
    lead.append(line)
    return lead


def is_jsonl_content(path: Path) -> bool:
    """Whether a plain (uncompressed) ``.json`` file holds JSONL, as the reader decides: it starts
    with ``{`` and its first line that holds anything is a whole JSON value."""
    with open(path, "rb") as fh:
        if not fh.read(1 << 12).removeprefix(UTF8_BOM).lstrip().startswith(b"{"):
            return False
        fh.seek(0)
        return _looks_like_jsonl(_first_lines(fh)[-1].removeprefix(UTF8_BOM))


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
    if is_parquet_name(path.name):
        return hf_parquet.iter_records(path)
    return _json_records(path)


def detect_format(record: dict) -> str:
    """The record format of one record, from its keys.

    ``message_list`` → ``molmo``; ``messages`` → ``swift`` (ms-swift and LLaMA-Factory
    role/content records read the same), or ``sharegpt`` when its turns use
    ``from``/``value``; ``conversations`` with ``images``, ``videos``, ``system`` or
    ``tools``, or whose turns use ``role``/``content``, → ``sharegpt`` (LLaMA-Factory);
    other ``conversations`` → ``llava``; with none of these, ``texts`` holding
    ``{user, assistant}`` exchanges (or empty) → ``cauldron``.

    A key holding null counts as absent: a Parquet file (or a data frame saved as JSONL) that
    mixes formats has every format's columns in every row, null where the row's format has none;
    so does an empty ``images`` / ``videos`` list (no media) or ``system`` / ``tools`` string (none),
    which such a table may hold instead.

    Example:
        >>> detect_format({"image": "a.jpg", "conversations": []})
        'llava'
        >>> detect_format({"message_list": None, "messages": None, "conversations": []})
        'llava'
        >>> detect_format({"images": [], "texts": [{"user": "Colour?", "assistant": "Red.", "source": "vqav2"}]})
        'cauldron'

    Raises:
        SampleError: ``bad_record`` for a record no format reads; the message lists the layouts
            packtool reads.
    """
    if record.get("message_list") is not None:
        return "molmo"
    msgs = record.get("messages")
    if msgs is not None:
        if isinstance(msgs, list) and msgs and isinstance(msgs[0], dict) and msgs[0].get("from") is not None:
            return "sharegpt"
        return "swift"
    convs = record.get("conversations")
    if convs is not None:
        if any(record.get(k) not in (None, [], "") for k in ("images", "videos", "system", "tools")):
            return "sharegpt"
        if isinstance(convs, list) and convs and isinstance(convs[0], dict) and convs[0].get("from") is None \
                and convs[0].get("role") is not None:
            return "sharegpt"  # LLaMA-Factory's {role, content} tags, which LLaVA never writes
        return "llava"
    texts = record.get("texts")
    if isinstance(texts, list) and (not texts or cauldron.is_exchange(texts[0])):
        return "cauldron"
    keys = sorted(k for k, v in record.items() if v is not None)
    raise SampleError("bad_record", f"cannot tell the format from keys [{', '.join(quoted(k, 40) for k in keys[:8])}]; "
                      f"packtool reads {_LAYOUTS}; write the records in one of these layouts")


#: The turn fields each record format reads (every one of :data:`PARSERS`), for the message of a
#: record that holds none of them: no ``--format`` reads such a record, so none is suggested.
_LAYOUTS = "{}, {}, {} or {}".format(*(f"{field} ({', '.join(names)})" for field, names in (
    ("conversations", ("llava", "qwen-vl", "sharegpt")),
    ("messages", ("swift", "sharegpt")),
    ("message_list", ("molmo",)),
    ("texts of {user, assistant} exchanges", ("cauldron",)),
)))


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ConfigError(f"unknown --format {fmt!r}; choose one of: {', '.join(FORMATS)}")


def parse_record(rec: object, source: str, row: int, fmt: str = "auto", id_name: str | None = None) -> Sample | Rejected:
    """One record (or the SampleError its line raised) as a Sample or a Rejected row.

    ``id_name`` names a record without an id ``ID_NAME:ROW`` instead of ``FILE:ROW``: tokenize
    gives it for an input whose file name another input shares (:func:`common.file_id_names`).
    """
    source = printable(source)
    try:
        sid = record_id(rec) if isinstance(rec, dict) else None
    except SampleError:  # the parser rejects the record for its id, below
        sid = None
    if isinstance(rec, SampleError):  # the line itself was not a record (bad JSON...): not raised
        # here, where the traceback's frame would hold the error in ``rec``, a cycle only the
        # garbage collector frees
        return Rejected(source, row, sid, rec.reason, rec.message)
    try:
        if not isinstance(rec, dict):
            raise SampleError("bad_record", f"record is a {type(rec).__name__}, not an object")
        rec = decode_turn_fields(rec)
        parser = PARSERS[detect_format(rec) if fmt == "auto" else fmt]
        sample = check_sample(parser(rec, source, row))
        if id_name is not None and sid is None:
            sample = replace(sample, sample_id=f"{printable(id_name)}:{row}")
        return sample
    except SampleError as err:
        return Rejected(source, row, sid, err.reason, err.message)
    except (TypeError, AttributeError, KeyError, IndexError, ValueError) as exc:  # a field of an unexpected type or shape
        return Rejected(source, row, sid, "bad_record", f"unexpected field type or shape: {type(exc).__name__}: "
                                                        f"{str(exc)[:200]}")
    except RecursionError:
        return Rejected(source, row, sid, "bad_record", "record is nested too deeply")


def iter_samples(files: list[Path], fmt: str = "auto") -> Iterator[Sample | Rejected]:
    """Every record of every file, as a Sample or a Rejected row, in input order."""
    check_format(fmt)
    for path in files:
        source = str(path)
        for row, rec in iter_records(path):
            yield parse_record(rec, source, row, fmt)
