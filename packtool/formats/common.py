"""Helpers every format reader shares: media entries, text checks, sample ids.

A media entry in the wild is one of:

* a path string, relative to ``--media-root`` (``"images/cat.jpg"``), or a ``file://`` URI
  (``file:///data/a%20b.jpg``, ``file://localhost/data/c.jpg``) of a file under it;
* a data URI (``"data:image/png;base64,iVBOR..."``), decoded to inline bytes;
* a Hugging Face ``Image`` struct ``{"bytes": b"...", "path": "cat.jpg"}`` (Parquet
  image columns, ms-swift); the bytes win when present, else the path is used;
* the file's raw bytes (a Parquet ``binary`` column, as some datasets store images).

Remote URLs are rejected: packtool works offline.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import unquote

from ..errors import SampleError, quoted
from ..records import MediaRef, Message, Part, Sample, ToolCall
from .tools import CALL_ROLES, RESULT_ROLES, parse_call_text, parse_tool_call

__all__ = ["media_ref", "media_refs", "as_list", "check_text", "check_sample", "printable", "record_id",
           "sample_id_of", "file_id_names", "split_placeholders", "build_sample", "Turn", "read_turns", "decode_turn_fields",
           "TURN_FIELDS"]


try:  # a compiled parser, about twice as fast as json's on record lines; json where it is missing
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - orjson is a dependency
    _fast_loads = None

#: ``data.translate(_SHAPE)``, the bytes' shape: every ASCII digit as ``0``, every ``[`` and ``{``
#: as ``[`` (the levels it may nest), every other byte a space.
_SHAPE = bytes(0x30 if 0x30 <= b <= 0x39 else 0x5B if b in b"[{" else 0x20 for b in range(256))
#: orjson reads an integer beyond 64 bits as a float (json keeps it whole, and an id may be one);
#: such an integer is a run of 19 digits at least, and a line holding such a run goes to json.
_LONG_RUN = b"0" * 19
#: What :func:`fast_json` gives where json must read the bytes.
FALL_BACK = object()
#: Brackets below which bytes cannot nest deep enough to trouble json at any sane stack depth
#: (the stack is then not measured).
_FEW_BRACKETS = 64
#: Frames json's own Python calls (``loads``, ``decode``, ``raw_decode``) and the caller's add,
#: with room to spare.
_JSON_FRAMES = 16


def _json_reads_nesting(n_open: int) -> bool:
    """Whether json can read ``n_open`` levels of nesting from here. Its C scanner counts each
    level against the recursion limit, on top of the frames already on the stack (``[`` x 995
    is a RecursionError at the top level of a default interpreter, at fewer levels deeper in
    a call stack), where orjson reads 1,024 levels anywhere: between the two, orjson would give
    a value for bytes json rejects.

    Example:
        >>> _json_reads_nesting(10), _json_reads_nesting(1000)
        (True, False)
    """
    if n_open < _FEW_BRACKETS:
        return True
    depth, frame = 0, sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    return n_open + depth + _JSON_FRAMES < sys.getrecursionlimit()


def fast_json(data: bytes) -> object:
    """``data`` (one JSON value's UTF-8 bytes) read by orjson, about twice as fast as json on
    records, or :data:`FALL_BACK` where orjson could give other than ``json.loads``: what it
    refuses (``NaN``, ``1e400``, a lone surrogate escape, invalid UTF-8, nesting past 1,024
    levels, anything malformed), bytes holding 19 digits in a row (an integer past 64 bits,
    which orjson reads as a float; in a string, harmless), and bytes whose ``[`` and ``{`` could
    nest deeper than json reads from this call (:func:`_json_reads_nesting`). The caller reads
    those with json.

    Example:
        >>> fast_json(b'{"id": 7}'), fast_json(b'{"id": 12345678901234567890123}') is FALL_BACK
        ({'id': 7}, True)
    """
    if _fast_loads is None:
        return FALL_BACK
    shape = data.translate(_SHAPE)
    if shape.find(_LONG_RUN) >= 0 or not _json_reads_nesting(shape.count(b"[")):
        return FALL_BACK
    try:
        return _fast_loads(data)
    except ValueError:  # orjson.JSONDecodeError
        return FALL_BACK


@dataclass(frozen=True, slots=True)
class Turn:
    """One turn as a reader found it, before ``<image>``/``<video>`` tags are split out."""

    role: str
    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str | None = None
    tool_call_id: str | None = None
    loss: bool | None = None  # an assistant turn's own "loss" (False: context only), None: the role's rule


def as_list(value) -> list:
    """``None`` → ``[]``; a scalar → ``[value]``; a list stays a list."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _decode_data_uri(uri: str) -> bytes:
    head, sep, payload = uri.partition(",")
    if not sep:
        raise SampleError("bad_record", "data URI has no ',' separating header and payload")
    if not head.endswith(";base64"):
        raise SampleError("bad_record", f"data URI {head[:40]!r} is not base64-encoded")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise SampleError("bad_record", f"data URI payload is not valid base64: {exc}") from None


def _file_uri_path(uri: str, kind: str) -> str:
    """The local path a ``file://`` URI names: percent-escapes decoded, the host empty or ``localhost``.

    The path is absolute, so it must still lie under ``--media-root`` (else ``path_outside_root``).

    Example:
        >>> _file_uri_path("file:///data/a%20b.jpg", "image")
        '/data/a b.jpg'
        >>> _file_uri_path("file://localhost/data/c.jpg", "image")
        '/data/c.jpg'
    """
    host, _, path = uri[len("file://"):].partition("/")
    if host.lower() not in ("", "localhost"):
        raise SampleError("missing_media", f"{kind} {uri[:80]!r} names the host {host[:40]!r}, not this machine; write "
                                           "file:///absolute/path, or a path relative to --media-root")
    try:
        return unquote("/" + path, errors="strict")
    except UnicodeDecodeError:
        raise SampleError("bad_encoding", f"{kind} {uri[:80]!r} has percent-escapes that are not UTF-8") from None


def media_ref(kind: str, entry) -> MediaRef:
    """One media entry (path, data URI, ``{bytes, path}`` struct or raw bytes) as a :class:`MediaRef`."""
    if isinstance(entry, str):
        if not entry:
            raise SampleError("missing_media", f"empty {kind} path")
        if entry.startswith("data:"):
            return MediaRef(kind, None, _decode_data_uri(entry))
        if entry.startswith(("http://", "https://")):
            raise SampleError("missing_media", f"{kind} {entry[:80]!r} is a remote URL; download it under --media-root first")
        # a bucket URL (s3://, gs://) is a path: a bucket --media-root takes it when it lies under the root
        if entry.startswith("file://"):
            entry = _file_uri_path(entry, kind)
        return MediaRef.of_path(kind, entry)
    if isinstance(entry, dict):
        data = entry.get("bytes")
        path = entry.get("path")
        if isinstance(data, (bytes, bytearray, memoryview)) and len(data):
            return MediaRef(kind, path if isinstance(path, str) and path else None, bytes(data))
        if isinstance(data, str) and data:  # JSON cannot hold bytes; accept base64 text
            return MediaRef(kind, None, _decode_data_uri("data:;base64," + data))
        if isinstance(path, str) and path:
            return media_ref(kind, path)
        raise SampleError("missing_media", f"{kind} struct has neither bytes nor a path")
    if isinstance(entry, (bytes, bytearray, memoryview)):  # a Parquet binary column: the file's bytes
        if not len(entry):
            raise SampleError("missing_media", f"{kind} bytes are empty")
        return MediaRef(kind, None, bytes(entry))
    if entry is None:
        raise SampleError("missing_media", f"{kind} entry is null")
    raise SampleError("bad_record", f"{kind} entries must be paths, data URIs, {{bytes, path}} structs or raw bytes, "
                                    f"got {type(entry).__name__}")


def media_refs(record: dict, image_keys: tuple[str, ...], video_keys: tuple[str, ...]) -> tuple[list[MediaRef], list[MediaRef]]:
    """Images and videos of a record, from the first key present in each group."""
    return ([media_ref("image", e) for e in _first_present(record, image_keys)],
            [media_ref("video", e) for e in _first_present(record, video_keys)])


def _first_present(record: dict, keys: tuple[str, ...]) -> list:
    """:func:`as_list` of the first of ``keys`` whose value is neither null nor an empty list (a
    table that mixes formats may hold ``images: []`` beside a LLaVA row's ``image``); ``[]`` if none is."""
    for k in keys:
        value = record.get(k)
        if value is not None and not (isinstance(value, list | tuple) and not value):
            return as_list(value)
    return []


def check_text(text, where: str) -> str:
    """``text`` if it is a string that UTF-8 can encode; else a ``bad_record``/``bad_encoding`` error.

    JSON may carry lone surrogate escapes (``"\\ud800"``) that decode to a Python
    string no tokenizer can encode; they are rejected here, not deep in the tokenizer.
    """
    if not isinstance(text, str):
        raise SampleError("bad_record", f"{where} must be a string, got {type(text).__name__}")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise SampleError("bad_encoding", f"{where} is not valid UTF-8 text: {exc.reason} at {exc.start}") from None
    return text



def system_of(record: dict) -> str | None:
    """A record's top-level ``system`` prompt (ShareGPT's, and LLaVA records that carry one), or
    ``None`` where it has none or an empty one.

    Raises:
        SampleError: ``bad_encoding`` / ``bad_record`` for a value that is not text.
    """
    system = record.get("system")
    return None if system is None else check_text(system, "'system'") or None

def printable(text: str) -> str:
    """``text`` with whatever UTF-8 cannot encode (lone surrogates, e.g. a file name's undecodable
    byte as Python reads it) written as a ``\\udcXX`` escape: a label Arrow and JSON can store.

    Example:
        >>> printable("caf\\udce9.jsonl")
        'caf\\\\udce9.jsonl'
    """
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _check_path(path: str, kind: str) -> None:
    if path.isascii() and "\x00" not in path:  # nothing to check (and no message to format)
        return
    if "\x00" in path:
        raise SampleError("bad_record", f"{kind} path {path[:80]!r} holds a NUL byte, which no file name can")
    check_text(path, f"{kind} path {path[:80]!r}")


def check_sample(sample: Sample) -> Sample:
    """Check everything a parsed sample carries into a shard, for every format at once.

    The sample id and media paths go into Arrow string columns and file-system calls; each
    message text into the tokenizer. A string UTF-8 cannot encode (a lone surrogate from a
    JSON escape or an undecodable byte) is ``bad_encoding``; a NUL byte in a path, a path
    or id of the wrong type is ``bad_record``. A record rejected here never reaches a writer,
    so one bad record cannot stop a run.

    Raises:
        SampleError: ``bad_encoding`` or ``bad_record``.
    """
    sid = sample.sample_id
    if not (type(sid) is str and sid.isascii()):
        check_text(sid, f"sample id {sid[:80]!r}")
    for ref in sample.media:
        if ref.path is not None:
            if not isinstance(ref.path, str):
                raise SampleError("bad_record", f"{ref.kind} path must be a string, got {type(ref.path).__name__}")
            _check_path(ref.path, ref.kind)
    for branch in sample.branches:
        for message in branch:
            for part in message.parts:
                if part.kind == "text" and not part.text.isascii():
                    check_text(part.text, f"a {message.role} message")
            if message.tool_calls:
                for call in message.tool_calls:
                    check_text(call.name, "a tool call's name")
                    _check_depth(call.arguments, f"the arguments of tool call {call.name!r}")
                    check_text(json.dumps(call.arguments, ensure_ascii=False), f"the arguments of tool call {call.name!r}")
            if message.reasoning is not None:
                check_text(message.reasoning, "an assistant's reasoning_content")
    if sample.tools:
        for i, tool in enumerate(sample.tools):
            _check_depth(tool, f"tools[{i}]")
            check_text(json.dumps(tool, ensure_ascii=False), f"tools[{i}]")
    return sample


#: The deepest nesting of lists and objects a tool schema or a tool call's arguments may have.
#: Real schemas nest a few levels; the template writes them out with ``json.dumps`` deep in the
#: call stack, where a value the JSON parser read near Python's recursion limit (about 970
#: levels) raised ``RecursionError`` and stopped the run.
MAX_NESTING = 100


def _check_depth(value, what: str) -> None:
    """``bad_record`` when ``value`` nests lists and objects more than :data:`MAX_NESTING` deep
    (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list | tuple):
            if depth > MAX_NESTING:
                raise SampleError("bad_record", f"{what} nests lists and objects more than {MAX_NESTING} levels deep")
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))


def read_turns(msgs, role_key: str, text_key: str, field: str, role_map: dict[str, str],
               text_of: Callable[[dict, int], str]) -> list[Turn | tuple[str, str]]:
    """A list of message objects as turns, tool calls and results included (see :mod:`.tools`).

    ``role_map`` maps lower-cased role / ``from`` values of ordinary turns to
    ``system``/``user``/``assistant``; call and result roles (:data:`.tools.CALL_ROLES`,
    :data:`.tools.RESULT_ROLES`) are known to every reader. ``text_of(message, i)``
    returns a message's text with ``<image>``/``<video>`` tags. An ordinary turn (no tool
    call, result or reasoning) comes back as a plain ``(role, text)`` pair, which
    :func:`build_sample` takes as it takes a :class:`Turn`: most turns are ordinary, and
    the pair costs a fraction of the dataclass.

    Raises:
        SampleError: ``bad_record`` (a role / ``from`` value that is not a string among others),
            ``empty_conversation``, ``unknown_role`` (a string no map knows), ``bad_tool_call``,
            ``bad_tool_arguments``, ``bad_encoding``.
    """
    if not isinstance(msgs, list):
        raise SampleError("bad_record", f"record has no {field!r} list")
    if not msgs:
        raise SampleError("empty_conversation", f"{field!r} is empty")
    turns: list[Turn] = []
    for i, msg in enumerate(msgs):
        if not isinstance(msg, dict):
            raise SampleError("bad_record", f"turn {i} is a {type(msg).__name__}, not an object")
        raw = msg.get(role_key)
        if isinstance(raw, str):
            key = raw.lower()
        elif raw is None:
            key = ""
        else:  # a malformed record, not a role to map: 3 or ["user"] would otherwise read as one
            raise SampleError("bad_record", f"turn {i} {role_key!r} must be a string, got {type(raw).__name__} "
                                            f"{quoted(raw, 40)}")
        if key in CALL_ROLES:
            lead, calls = parse_call_text(check_text(msg.get(text_key), f"turn {i} {text_key!r}"), f"turn {i} ({raw})")
            prev = turns[-1] if turns else None
            if isinstance(prev, tuple):
                prev = Turn(*prev)
            if prev is not None and prev.role == "assistant":  # several calls of one assistant turn
                turns[-1] = Turn("assistant", prev.text + lead, prev.tool_calls + calls, prev.reasoning)
            else:
                turns.append(Turn("assistant", lead, calls))
            continue
        if key in RESULT_ROLES:
            call_id = msg.get("tool_call_id")
            turns.append(Turn("tool", text_of(msg, i), tool_call_id=str(call_id) if call_id is not None else None))
            continue
        role = role_map.get(key)
        if role is None and raw is None:  # the turns use other keys: another format, or a mix of tag styles
            keys = ", ".join(str(k)[:40] for k in sorted(map(str, msg))[:6]) or "none"
            raise SampleError("bad_record", f"turn {i} has no {role_key!r} (its keys: {keys}); write every turn with "
                                            f"{role_key!r}/{text_key!r}, or check --format")
        if role is None:
            raise SampleError("unknown_role", f"turn {i} has role {quoted(raw)}")
        if role != "assistant":
            turns.append((role, text_of(msg, i)))
            continue
        calls: tuple[ToolCall, ...] = ()
        listed = msg.get("tool_calls")
        if listed is not None:
            if not isinstance(listed, list):
                raise SampleError("bad_tool_call", f"turn {i} 'tool_calls' must be a list of calls")
            calls = tuple(parse_tool_call(c, f"turn {i} tool_calls[{k}]") for k, c in enumerate(listed))
        if msg.get("function_call") is not None:  # OpenAI's legacy single call
            calls += (parse_tool_call(msg["function_call"], f"turn {i} function_call"),)
        text = "" if calls and msg.get(text_key) is None else text_of(msg, i)
        reasoning = msg.get("reasoning_content")
        loss = msg.get("loss")
        if loss is not None and not isinstance(loss, bool):
            raise SampleError("bad_record", f"turn {i} 'loss' must be true or false, got {quoted(loss, 40)}")
        if reasoning is not None:  # "" (an export's field for an answer that had none) is no reasoning
            reasoning = check_text(reasoning, f"turn {i} 'reasoning_content'") or None
        if reasoning is None and not calls and loss is not False:
            turns.append(("assistant", text))
            continue
        turns.append(Turn("assistant", text, calls, reasoning, loss=False if loss is False else None))
    return turns


#: Fields that hold a record's turns (or Molmo's entries): a list, or, as some Parquet writers
#: store them, a string column of JSON text holding the list.
TURN_FIELDS = ("conversations", "messages", "message_list")


def decode_turn_fields(record: dict) -> dict:
    """``record`` with a turn field (:data:`TURN_FIELDS`) stored as JSON text (a string, or UTF-8
    bytes as a binary Parquet column holds it) parsed into its list.

    Example:
        >>> decode_turn_fields({"conversations": '[{"from": "human", "value": "Hi"}]'})
        {'conversations': [{'from': 'human', 'value': 'Hi'}]}

    Raises:
        SampleError: ``bad_record`` when such a string is not a JSON list.
    """
    for key in TURN_FIELDS:
        text = record.get(key)
        if isinstance(text, bytes | bytearray):  # a binary column of JSON text: UTF-8, as JSON is
            try:
                text = bytes(text).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise SampleError("bad_encoding", f"{key!r} holds bytes that are not UTF-8 text ({exc.reason} at byte "
                                                  f"{exc.start}); store the turns as a list, or as UTF-8 JSON text") from None
        if isinstance(text, str):
            try:
                value = json.loads(text)
            except (ValueError, RecursionError):
                value = text
            if not isinstance(value, list):
                raise SampleError("bad_record", f"{key!r} is a string that is not a JSON list ({text[:60]!r}); store "
                                                "the turns as a list, or as the JSON text of one")
            record = {**record, key: value}
    return record


def record_id(record: dict) -> str | None:
    """A record's own id (``id``, else ``sample_id``) as packtool stores it, or ``None`` when
    it has none: a string as it is, a whole number as its decimal digits.

    Example:
        >>> record_id({"id": "coco-1"}), record_id({"id": 17}), record_id({"sample_id": "a"}), record_id({})
        ('coco-1', '17', 'a', None)

    Raises:
        SampleError: ``bad_record`` for an id that is ``true``/``false``, a decimal number, a list
            or an object: ``str`` of them (``"True"``, ``"1.0"``, ``"[1]"``) is no id a user wrote.
    """
    sid = record.get("id")
    if sid is None:
        sid = record.get("sample_id")
    if sid is None or isinstance(sid, str):
        return sid
    if isinstance(sid, int) and not isinstance(sid, bool):
        return str(sid)
    kind = {bool: "true/false", float: "a decimal number", list: "a list", dict: "an object"}.get(type(sid),
                                                                                                  type(sid).__name__)
    shown = json.dumps(sid, default=str)
    raise SampleError("bad_record", f"sample id {shown[:80]} is {kind}, not a string; write ids as strings "
                                    "(or whole numbers)")


def sample_id_of(record: dict, source: str, row: int) -> str:
    """:func:`record_id`, or ``FILE:ROW`` for a record without one."""
    sid = record_id(record)
    return sid if sid is not None else f"{Path(source).name}:{row}"


def file_id_names(sources: list[str]) -> dict[str, str]:
    """The name records without an id are named after (``NAME:ROW``) in each input whose file
    name another input shares (``a/train.jsonl``, ``b/train.jsonl``): its path cut to the fewest
    trailing parts that tell it apart from those inputs, else the whole path. An input whose file
    name is its own is not listed: its records keep ``FILE:ROW``.

    Example:
        >>> file_id_names(["x/a/train.jsonl", "x/b/train.jsonl", "y/b/train.jsonl", "val.jsonl"])
        {'x/a/train.jsonl': 'a/train.jsonl', 'x/b/train.jsonl': 'x/b/train.jsonl', 'y/b/train.jsonl': 'y/b/train.jsonl'}
    """
    groups: dict[str, list[list[str]]] = {}
    for src in dict.fromkeys(sources):
        parts = src.split("/")
        groups.setdefault(Path(src).name, []).append(parts)
    out = {}
    for group in groups.values():
        if len(group) < 2:
            continue
        for parts in group:
            for k in range(2, len(parts) + 1):
                tail = parts[-k:]
                if sum(other[-k:] == tail for other in group) == 1:
                    break
            out["/".join(parts)] = "/".join(parts[-k:])
    return out


_TAG = re.compile(r"<(image|video)>")


def split_placeholders(text: str, counters: dict[str, int], offsets: dict[str, int]) -> list[Part]:
    """Split ``text`` at ``<image>``/``<video>`` tags into parts; tags become media parts.

    ``counters`` counts tags per kind seen so far; ``offsets`` maps kind to its first
    media index (images first, then videos). Newlines hugging a tag (LLaVA writes
    ``"<image>\\nWhat..."``) are dropped.

    Example:
        >>> [(p.kind, p.text, p.index) for p in split_placeholders("<image>\\nWhat?", {"image": 0, "video": 0}, {"image": 0, "video": 1})]
        [('image', '', 0), ('text', 'What?', -1)]
    """
    if "<" not in text:
        return [Part.of_text(text)] if text else []
    if text.startswith(("<image>", "<video>")) and "<" not in text[7:]:
        # one tag in front, LLaVA's usual "<image>\nQuestion": what the loop below gives, without the regex
        kind = text[1:6]
        parts = [Part.media(kind, offsets[kind] + counters[kind])]
        counters[kind] += 1
        rest = text[7:].lstrip("\n")
        if rest:
            parts.append(Part.of_text(rest))
        return parts
    parts: list[Part] = []
    pos = 0
    for m in _TAG.finditer(text):
        before = text[pos : m.start()]
        if pos:
            before = before.lstrip("\n")
        before = before.rstrip("\n")
        if before.strip():
            parts.append(Part.of_text(before))
        kind = m.group(1)
        parts.append(Part.media(kind, offsets[kind] + counters[kind]))
        counters[kind] += 1
        pos = m.end()
    rest = text[pos:]
    if pos:
        rest = rest.lstrip("\n")
    if rest:
        parts.append(Part.of_text(rest))
    return parts


def build_sample(
    turns: list[tuple[str, str] | Turn],
    images: list[MediaRef],
    videos: list[MediaRef],
    sample_id: str,
    source: str,
    row: int,
    strict: bool = False,
    system: str | None = None,
    tools: tuple[dict, ...] = (),
    image_tags_for_video: bool = False,
) -> Sample:
    """One single-branch sample from ``(role, text)`` turns (or :class:`Turn` s) with ``<image>``/``<video>`` tags.

    With ``strict`` the tag count must equal the media count (Qwen-VL finetune,
    ms-swift, LLaMA-Factory); otherwise media without any tag go to the start of the
    first user turn, as LLaVA does. ``system`` (a record's top-level prompt) opens the conversation
    unless its first turn is a system turn of its own. With ``image_tags_for_video``, a record with videos,
    no image and no ``<video>`` tag may mark its videos with ``<image>`` tags, one per
    video: LLaVA-NeXT / LLaVA-OneVision training code (and so LLaVA-Video-178K) writes
    ``<image>`` for a video.

    Raises:
        SampleError: ``empty_conversation``, ``placeholder_mismatch``.
    """
    if not turns:
        raise SampleError("empty_conversation", "the conversation has no turns")
    offsets = {"image": 0, "video": len(images)}
    counters = {"image": 0, "video": 0}
    messages: list[Message] = []
    if system and (turns[0].role if isinstance(turns[0], Turn) else turns[0][0]) != "system":
        # a top-level system prompt; a conversation's own system turn wins, as LLaMA-Factory and ms-swift read it
        messages.append(Message("system", (Part.of_text(system),)))
    for t in turns:
        if isinstance(t, Turn):
            messages.append(Message(t.role, tuple(split_placeholders(t.text, counters, offsets)), t.tool_calls,
                                    t.reasoning, t.tool_call_id, t.loss))
        else:  # a plain (role, text) pair: the common case, kept cheap
            text = t[1]
            if "<" in text:
                parts = tuple(split_placeholders(text, counters, offsets))
            else:  # no tag: what split_placeholders gives, without the call
                parts = (Part.of_text(text),) if text else ()
            messages.append(Message.plain(t[0], parts))
    media = tuple(images + videos)
    if not strict and counters["image"] + counters["video"] == 0 and media:
        first_user = next((i for i, m in enumerate(messages) if m.role == "user"), None)
        if first_user is None:
            raise SampleError("placeholder_mismatch", "record has media but no user turn to put them in")
        lead = tuple(Part.media(m.kind, i) for i, m in enumerate(media))
        msg = messages[first_user]
        messages[first_user] = replace(msg, parts=lead + msg.parts)
    elif (image_tags_for_video and videos and not images and not counters["video"]
          and counters["image"] == len(videos)):
        # with no image, an image tag's media index (offset 0) is the video's: only the kind changes
        messages = [replace(m, parts=tuple(Part.media("video", p.index) if p.kind == "image" else p for p in m.parts))
                    for m in messages]
    elif counters["image"] != len(images) or counters["video"] != len(videos):
        raise SampleError(
            "placeholder_mismatch",
            f"{counters['image']} <image> and {counters['video']} <video> tags for "
            f"{len(images)} images and {len(videos)} videos",
        )
    return Sample(sample_id, source, row, media, (tuple(messages),), tools=tools)
