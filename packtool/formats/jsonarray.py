"""The elements of a JSON array file, found without parsing it whole.

LLaVA's own training sets (``llava_v1_5_mix665k.json``, LLaVA-Instruct) and many others are one
JSON array. Parsed whole, such a file is one task however large (a gigabyte of text, held three
times over: bytes, decoded text, records) and one broken record loses all of them. A
byte scan finds where each element of the array starts and ends instead: strings (with their
escapes) are skipped and brackets counted, so the commas at depth one are the element bounds.
Each element is then parsed alone, as a JSONL line is, from a stream (a chunk and an element in
memory at a time), and planning cuts a large plain array into tasks at element boundaries, as it
cuts JSONL at line boundaries.

The scan checks only the array's frame: a ``[`` first (after a byte-order mark and whitespace),
brackets that close in order of depth, strings that end, no empty element (``[1,,2]``, ``[1,]``)
and nothing but whitespace after the closing ``]``. A file that fails it is read whole, as
before, and is one ``bad_json`` row. Within a sound frame, an element that is not valid JSON
(a broken literal, ``{]``, invalid UTF-8 outside a string) is one ``bad_json`` row and the
others are read, as for JSONL.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np

from ..errors import InputError, SampleError
from .common import FALL_BACK, fast_json

#: Bytes scanned per call of the compiled scan (the outputs are sized by it).
CHUNK_BYTES = 1 << 20

# the scan's state (an int64 array carried from chunk to chunk)
_DEPTH, _IN_STR, _ESC, _PHASE, _INDEX, _SEEN = range(6)
_STATE_SIZE = 6
# phases: before the opening '[', expecting an element, inside an element, after the closing ']',
# and a frame that is not a JSON array's (final)
_BEFORE, _EXPECT, _INSIDE, _AFTER, _BROKEN = range(5)


def new_state(inside: bool = False, index: int = 0) -> np.ndarray:
    """A scan state at a file's start, or (``inside``) at the start of element ``index``."""
    state = np.zeros(_STATE_SIZE, dtype=np.int64)
    if inside:
        state[_DEPTH] = 1
        state[_PHASE] = _EXPECT
        state[_SEEN] = 1
        state[_INDEX] = index
    return state


def _scan(buf, base, state, starts, ends):
    """The compiled :func:`_scan_bytes` (numba is imported when a JSON array is first read, not
    with every input format)."""
    global _scan
    from numba import njit

    _scan = njit(cache=True)(_scan_bytes)
    return _scan(buf, base, state, starts, ends)


def _scan_bytes(buf, base, state, starts, ends):  # pragma: no cover - compiled
    """Scan ``buf`` (bytes ``base..`` of the file) from ``state``; write the offsets where
    elements start to ``starts`` and where they end (their ``,`` or the closing ``]``) to
    ``ends``; returns ``(n_starts, n_ends)``. ``state`` is updated in place; the scan stops at a
    broken frame (phase ``_BROKEN``)."""
    depth = state[_DEPTH]
    in_str = state[_IN_STR]
    esc = state[_ESC]
    phase = state[_PHASE]
    seen = state[_SEEN]
    ns = 0
    ne = 0
    for i in range(buf.shape[0]):
        c = buf[i]
        if in_str:
            if esc:
                esc = 0
            elif c == 92:  # backslash
                esc = 1
            elif c == 34:  # quote
                in_str = 0
            continue
        if c == 32 or c == 10 or c == 13 or c == 9:
            continue
        if phase == _INSIDE:
            if c == 34:
                in_str = 1
            elif c == 91 or c == 123:  # [ {
                depth += 1
            elif c == 93 or c == 125:  # ] }
                if depth == 1:
                    if c != 93:
                        phase = _BROKEN
                        break
                    ends[ne] = base + i
                    ne += 1
                    depth = 0
                    phase = _AFTER
                else:
                    depth -= 1
            elif c == 44 and depth == 1:  # comma
                ends[ne] = base + i
                ne += 1
                phase = _EXPECT
        elif phase == _EXPECT:
            if c == 93 and not seen:  # []
                depth = 0
                phase = _AFTER
            elif c == 44 or c == 93 or c == 125:  # an empty element, a trailing comma
                phase = _BROKEN
                break
            else:
                starts[ns] = base + i
                ns += 1
                seen = 1
                phase = _INSIDE
                if c == 34:
                    in_str = 1
                elif c == 91 or c == 123:
                    depth += 1
        elif phase == _BEFORE:
            if c == 91:
                depth = 1
                phase = _EXPECT
            else:
                phase = _BROKEN
                break
        else:  # after the array: nothing but whitespace
            phase = _BROKEN
            break
    state[_DEPTH] = depth
    state[_IN_STR] = in_str
    state[_ESC] = esc
    state[_PHASE] = phase
    state[_SEEN] = seen
    return ns, ne


def parse_element(data: bytes) -> object:
    """One element's bytes as a value, or the ``bad_json`` ``SampleError`` it earns. Invalid
    UTF-8 becomes lone surrogates, as when the file was parsed whole: a string holding it is
    rejected with its record (``bad_encoding``), invalid bytes elsewhere make the element
    ``bad_json``."""
    value = fast_json(data)
    if value is not FALL_BACK:
        return value
    try:
        return json.loads(data.decode("utf-8", errors="surrogateescape"))
    except (ValueError, RecursionError) as exc:
        return SampleError("bad_json", f"array element is not valid JSON: {str(exc)[:200]}")


def _outputs(n: int) -> tuple[np.ndarray, np.ndarray]:
    # an element is at least one byte and its comma: at most n // 2 + 1 of either in n bytes
    return np.empty(n // 2 + 2, dtype=np.int64), np.empty(n // 2 + 2, dtype=np.int64)


def _skip_bom(fh) -> int:
    if fh.peek(3)[:3] == b"\xef\xbb\xbf":
        fh.read(3)
        return 3
    return 0


def scan_file(path, first: int, every: int) -> tuple[int, list[tuple[int, int]]] | None:
    """Count the elements of a JSON array file and find the byte offsets where elements
    ``0, first, first + every, ...`` start (``[(0, offset), (first, offset), ...]``, those the
    array has), or ``None`` when its frame is not a sound JSON array's (see the module
    docstring)."""
    with open(path, "rb") as fh:
        return scan_stream(fh, first, every)


def scan_stream(fh, first: int = 1, every: int = 0) -> tuple[int, list[tuple[int, int]]] | None:
    """:func:`scan_file` of an open binary stream (with ``peek``: a plain or a decompressed
    file), read from its start to its end; ``every=0``: no cut but element 0's."""
    state = new_state()
    cuts: list[tuple[int, int]] = []
    target = 0  # element 0 is always a cut
    starts, ends = _outputs(CHUNK_BYTES)
    base = _skip_bom(fh)
    while chunk := fh.read(CHUNK_BYTES):
        index = int(state[_INDEX])
        ns, _ = _scan(np.frombuffer(chunk, dtype=np.uint8), base, state, starts, ends)
        if state[_PHASE] == _BROKEN:
            return None
        while target < index + ns:
            cuts.append((target, int(starts[target - index])))
            target = (max(first, 1) if target == 0 else target + every) if every else 1 << 62
        state[_INDEX] = index + ns
        base += len(chunk)
    if state[_PHASE] != _AFTER:
        return None
    return int(state[_INDEX]), cuts


def stream_elements(fh, name: str = "the input") -> Iterator[tuple[int, bytes]]:
    """``(index, bytes)`` of every element of the JSON array an open binary stream holds from
    its start (with ``peek``), holding no more than a chunk and an element at a time; the
    caller has found its frame sound (:func:`scan_stream`), so a frame that breaks here is a
    file that changed (``InputError``)."""
    base = _skip_bom(fh)
    yield from _elements(fh, new_state(), base, None, name)


def read_elements(fh, offset: int, index: int, count: int | None, name: str = "the input") -> Iterator[tuple[int, bytes]]:
    """``(index, bytes)`` of ``count`` elements (``None``: to the array's end) of a JSON array
    file whose element ``index`` starts at byte ``offset`` (a planned slice: the frame was
    found sound when it was planned).

    Raises:
        InputError: the file (``name`` in the message) no longer holds those elements: it
            changed since the run planned it.
    """
    fh.seek(offset)
    yield from _elements(fh, new_state(inside=True, index=index), offset, count, name)


def _elements(fh, state: np.ndarray, pos: int, count: int | None, name: str) -> Iterator[tuple[int, bytes]]:
    """The elements the stream ``fh`` holds from byte ``pos`` on, scanned from ``state``."""
    starts, ends = _outputs(CHUNK_BYTES)
    pending = bytearray()  # bytes from `held` on: the element being read
    held = pos
    open_start = -1  # where the element whose end is still to come starts
    left = count
    while left is None or left > 0:
        chunk = fh.read(CHUNK_BYTES)
        if not chunk:
            break
        ns, ne = _scan(np.frombuffer(chunk, dtype=np.uint8), pos, state, starts, ends)
        if state[_PHASE] == _BROKEN:
            break
        pending += chunk
        pos += len(chunk)
        found = starts[:ns].tolist()
        if open_start >= 0:
            found.insert(0, open_start)
        done = ends[:ne].tolist()
        for a, b in zip(found, done):  # noqa: B905 - the last start may still wait for its end
            yield int(state[_INDEX]), bytes(pending[a - held:b - held])
            state[_INDEX] += 1
            if left is not None:
                left -= 1
                if not left:
                    return
        open_start = found[len(done)] if len(found) > len(done) else -1
        keep = open_start if open_start >= 0 else pos
        del pending[:keep - held]
        held = keep
        if state[_PHASE] == _AFTER:
            return
    raise InputError(f"{name} changed while it was being read: its JSON array no longer holds element "
                     f"{int(state[_INDEX])} where an earlier read found it; re-run with the file left as it is")
