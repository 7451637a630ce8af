"""JSONL lines and JSON array elements are read by orjson where it gives what ``json.loads``
gives, by json elsewhere: the value of every line, and the error of every line that is none, are
json's either way."""

from __future__ import annotations

import json
import random

import pytest

import packtool.formats as formats
from packtool.errors import SampleError
from packtool.formats import common
from packtool.formats.jsonarray import parse_element

SEED = 20261204


def _outcome(line: bytes, fast: bool, monkeypatch, parse=formats.parse_json_line) -> str:
    """What ``parse`` gives for ``line``, as a string that tells apart every value json can give
    (key order, ``1`` / ``1.0`` / ``-0.0``, NaN) and names an error's reason and message."""
    if not fast:
        monkeypatch.setattr(common, "_fast_loads", None)
    try:
        got = parse(line)
    finally:
        monkeypatch.undo()
    if isinstance(got, SampleError):
        return f"error {got.reason}: {got.message}"
    return f"{type(got).__name__} {got!r}"


def _value(rng: random.Random, depth: int = 0):
    """A random JSON value, leaning on what parsers disagree about: integers past 64 bits, floats at
    the ends of their range, escapes, non-ASCII text, repeated keys (made by the caller's text)."""
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return rng.choice([0, 1, -1, 2**53 + 1, 2**63 - 1, -(2**63), 2**63, 2**64 - 1, 2**64, -(2**63) - 1,
                           10**30, -(10**25), rng.randrange(-10**6, 10**6)])
    if kind == 1:
        return rng.choice([0.0, -0.0, 0.1, 1e-320, 5e-324, 1.7976931348623157e308, 2.5e-308, 1 / 3,
                           rng.uniform(-1e6, 1e6), rng.uniform(-1, 1) * 10.0 ** rng.randrange(-300, 300)])
    if kind == 2:
        return rng.choice([True, False, None])
    if kind in (3, 4, 5):
        alphabet = "ab <image>\n\t\"\\/\u00e9\u4e2d\U0001f600\x00\x1f\u2028" + "0123456789"
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 30)))
    if kind in (6, 7):
        return {rng.choice(["id", "image", "from", "value", "k", "\u00e9"]) + str(rng.randrange(3)): _value(rng, depth + 1)
                for _ in range(rng.randrange(0, 5))}
    return [_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))]


def _lines(rng: random.Random) -> list[bytes]:
    """Lines as JSONL files hold them, and as they go wrong: written by json with and without
    ASCII escapes, with NaN / Infinity, lone surrogate escapes, numbers past float range,
    repeated keys, long digit runs inside strings, deep nesting, cut short, bytes flipped."""
    lines = []
    for _ in range(400):
        value = {"id": _value(rng), "conversations": [_value(rng) for _ in range(rng.randrange(1, 4))]}
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5)
        lines.append(text.encode("utf-8", "surrogatepass") + rng.choice([b"\n", b"\r\n", b"", b"  \n"]))
    fixed = [b'{"x": NaN, "y": Infinity, "z": -Infinity}', b'{"x": 1e400}', b'{"x": -1e400}', b'{"x": 1e-400}',
             b'{"x": "\\ud800"}', b'{"x": "\\udc00\\ud83d"}', b'{"\\ud83d\\ude00": "\\ud83d\\ude00"}',
             b'{"a": 1, "b": 2, "a": 3}', b'{"id": 123456789012345678901234567890}',
             b'{"id": -9223372036854775809}', b'{"id": 9223372036854775807}', b'{"id": "1234567890123456789012"}',
             b'{"x": 1.0000000000000000000001}', b'{"x": 0.30000000000000004441}', b'{"x": 1E5, "y": 1e+05}',
             b"[" * 1100 + b"]" * 1100, b"[" * 500 + b"]" * 500, b'{"x": 1}\x00', b'{"x": "\xff"}', b'{"x": 01}',
             b'{"x": 1,}', b"{'x': 1}", b'{"x": 1} {"y": 2}', b'{"x": 1}\r{"y": 2}', b'\xef\xbb\xbf{"x": 1}',
             b'{"x": "a\tb"}', b'{"x": tru}', b'', b'   ', b'{"x": -}', b'{"x": 2.}', b'{"x": .5}', b'{"x": +1}']
    lines += fixed
    for _ in range(300):  # damaged copies: cut short, or a byte changed
        line = bytearray(rng.choice(lines[:400]))
        if line and rng.random() < 0.5:
            del line[rng.randrange(len(line)):]
        elif line:
            line[rng.randrange(len(line))] = rng.randrange(256)
        lines.append(bytes(line))
    return lines


@pytest.mark.parametrize("parse", [formats.parse_json_line, parse_element], ids=["jsonl line", "array element"])
def test_orjson_reads_as_json_reads(parse, monkeypatch):
    """Every line's outcome (value, or error reason and message) with orjson first equals json's
    alone, as a JSONL line and as a JSON array's element (whose invalid UTF-8 becomes lone
    surrogates, not an error of its own)."""
    pytest.importorskip("orjson")
    rng = random.Random(SEED)
    lines = _lines(rng)
    fast_read = 0
    for i, line in enumerate(lines):
        assert _outcome(line, True, monkeypatch, parse) == _outcome(line, False, monkeypatch, parse), (SEED, i, line[:200])
        fast_read += common.fast_json(line) is not common.FALL_BACK
    assert fast_read > len(lines) // 3, "a third of the lines must take the fast path, or the check proves little"


def test_a_big_integer_id_stays_whole(tmp_path):
    """An id written as an integer past 64 bits names its sample by all its digits (orjson alone
    would read it as a float, 1.2345678901234568e+29)."""
    path = tmp_path / "data.jsonl"
    path.write_text('{"id": 123456789012345678901234567890, "conversations": [{"from": "human", "value": "hi"}, '
                    '{"from": "gpt", "value": "yo"}]}\n', encoding="utf-8")
    (sample,) = formats.iter_samples([path])
    assert sample.sample_id == "123456789012345678901234567890"


@pytest.mark.parametrize("parse", [formats.parse_json_line, parse_element], ids=["jsonl line", "array element"])
@pytest.mark.parametrize("levels", [900, 960, 1000, 1024])
def test_nesting_json_cannot_read_is_not_read_by_orjson(parse, levels, monkeypatch):
    """json reads as many levels as the recursion limit leaves room for below the caller's frames
    (about 990 at the top of a default interpreter, fewer in a deep call stack); orjson reads
    1,024 anywhere. A record nested in between was one json rejects (``bad_json``) and orjson
    read, so a row earlier versions rejected became a sample."""
    pytest.importorskip("orjson")
    deep = b"[" * levels + b"]" * levels
    line = b'{"id": "deep", "meta": ' + deep + b', "conversations": []}'
    for data in (deep, line):
        assert _outcome(data, True, monkeypatch, parse) == _outcome(data, False, monkeypatch, parse)


def test_a_record_nested_past_json_reach_is_rejected_as_before(tmp_path, monkeypatch):
    """End to end: the record's fate is json's, with or without orjson installed."""
    pytest.importorskip("orjson")
    path = tmp_path / "deep.jsonl"
    path.write_bytes(b'{"id": "deep", "meta": ' + b"[" * 1000 + b"]" * 1000 + b', "conversations": [{"from": '
                     b'"human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}\n')
    (fast,) = formats.iter_samples([path])
    monkeypatch.setattr(common, "_fast_loads", None)
    (plain,) = formats.iter_samples([path])
    assert (fast.reason, fast.message) == (plain.reason, plain.message)
    assert fast.reason == "bad_json" and "maximum recursion depth exceeded" in fast.message
