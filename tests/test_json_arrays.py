"""JSON array inputs read element by element and cut into tasks at element boundaries.

The scan (``formats.jsonarray``) is checked against ``json`` on seeded random arrays whose
strings hold every byte the scan watches for (brackets, braces, commas, quotes, backslashes),
with any whitespace between tokens and chunk sizes down to one byte; frames that are not an
array's are read whole, as before; a tokenize run of an array gives the rows a JSONL file of
the same records gives, cut into the same tasks.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.corpus import make_corpus  # noqa: E402
from packtool import (  # noqa: E402
    TokenizeConfig,
    pipeline,  # noqa: E402
    tokenize_dataset,
)
from packtool.formats import Rejected, iter_records, iter_samples, jsonarray, parse_record  # noqa: E402
from packtool.pipeline import _slice_records, plan_tokenize_tasks  # noqa: E402


@pytest.fixture(autouse=True)
def cut_small_files(monkeypatch):
    """The files here are small: the planner looks into them for cutting as into large ones."""
    monkeypatch.setattr(pipeline, "CUT_MIN_BYTES", 0)


_PIECES = ["[", "]", "{", "}", ",", '\\"', "\\\\", "\\n", "\\u005d", "a", " ", "caf\u00e9", "\U0001f600", "1,2", "]}"]


def _string(rng) -> str:
    return '"' + "".join(_PIECES[k] for k in rng.integers(0, len(_PIECES), rng.integers(0, 6))) + '"'


def _value(rng, depth: int = 0) -> str:
    """Random JSON text, with random whitespace between its tokens."""
    ws = ["", " ", "\n", "\t", "\r\n  "]

    def sp() -> str:
        return ws[rng.integers(len(ws))]

    pick = rng.integers(0, 7 if depth < 3 else 4)
    if pick == 0:
        return str(int(rng.integers(-10 ** 6, 10 ** 6)))
    if pick == 1:
        return _string(rng)
    if pick == 2:
        return ["true", "false", "null", "1.5e3"][rng.integers(4)]
    if pick == 3:
        return "[" + sp() + "]" if rng.integers(2) else "{" + sp() + "}"
    if pick <= 4:
        return "[" + ",".join(sp() + _value(rng, depth + 1) + sp() for _ in range(rng.integers(1, 4))) + "]"
    return "{" + ",".join(f"{sp()}{_string(rng)}{sp()}:{sp()}{_value(rng, depth + 1)}{sp()}"
                          for _ in range(rng.integers(1, 4))) + "}"


def _array(rng, n: int) -> bytes:
    ws = ["", " ", "\n", ",\n"[1:], "  \r\n"]
    body = ",".join(ws[rng.integers(len(ws))] + _value(rng) + ws[rng.integers(len(ws))] for _ in range(n))
    lead = b"\xef\xbb\xbf" if rng.integers(3) == 0 else b""
    return lead + ("\n [" + body + "] \n").encode("utf-8")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_scan_finds_the_elements_json_finds(tmp_path, monkeypatch, seed):
    """Each element's bytes (``stream_elements``) parse to the value ``json`` gives for that
    element of the whole array and start where the scan says; ``scan_file`` counts them and
    finds the offsets of the cuts; ``read_elements`` from any cut and ``stream_elements`` from
    the start, in chunks of 1 byte to 1 MiB, give the same bytes."""
    rng = np.random.default_rng(seed)
    for case in range(25):
        n = int(rng.integers(0, 40))
        data = _array(rng, n)
        want = json.loads(data.decode("utf-8-sig"))
        elements = list(jsonarray.stream_elements(io.BufferedReader(io.BytesIO(data))))
        assert [json.loads(x) for _, x in elements] == want and [k for k, _ in elements] == list(range(n)), (seed, case)
        count, starts = jsonarray.scan_stream(io.BufferedReader(io.BytesIO(data)), 1, 1)
        assert count == n and [k for k, _ in starts] == list(range(n))
        assert all(data[at:at + len(x)] == x for (_, at), (_, x) in zip(starts, elements, strict=True))
        path = tmp_path / "a.json"
        path.write_bytes(data)
        first, every = int(rng.integers(1, 6)), int(rng.integers(1, 9))
        count, cuts = jsonarray.scan_file(path, first, every)
        assert count == n and cuts == [starts[k] for k in [0, *range(first, n, every)] if k < n], (seed, case)
        for chunk in (1, 7, 64, 1 << 20):
            monkeypatch.setattr(jsonarray, "CHUNK_BYTES", chunk)
            for k, offset in cuts:
                got = list(jsonarray.read_elements(open(path, "rb"), offset, k, min(every, n - k)))
                assert got == elements[k:k + every], (seed, case, chunk)
            assert list(jsonarray.stream_elements(io.BufferedReader(io.BytesIO(data)))) == elements


@pytest.mark.parametrize("frame", [b"[1,,2]", b"[1,]", b"[,1]", b"[1] x", b"[1", b'["abc]', b"[{]}", b"[}", b"[1]\n[2]\n",
                                   b'[{"a": 1}]]'])
def test_a_frame_that_is_not_an_array_is_read_whole(tmp_path, frame):
    """Empty elements, a trailing comma, bytes after the array, an unclosed bracket or string:
    no scan answer, no cut, and the file is one ``bad_json`` row as it always was."""
    path = tmp_path / "a.json"
    path.write_bytes(frame)
    assert jsonarray.scan_file(path, 1, 1) is None
    tasks, total = plan_tokenize_tasks([path], 1)
    assert total is None and [(s.start, s.stop, s.offset) for t in tasks for s in t] == [(0, None, None)]
    rows = list(iter_records(path))
    assert len(rows) == 1 and rows[0][1].reason == "bad_json" and "the file is not valid JSON" in rows[0][1].message


def test_a_bad_element_is_one_row_and_the_others_are_read(tmp_path):
    """Within a sound frame an element that is not JSON is one ``bad_json`` row (its index), a
    string of invalid UTF-8 is ``bad_encoding`` as before, and every other record is read, cut or
    whole."""
    make_corpus(tmp_path, 12, seed=5)
    recs = (tmp_path / "data.jsonl").read_bytes().splitlines()
    recs[3] = b'{"id": tru}'
    recs[7] = recs[7].replace(b'"from": "gpt", "value": "', b'"from": "gpt", "value": "\xff', 1)
    path = tmp_path / "data.json"
    path.write_bytes(b"[" + b",\n".join(recs) + b"]")
    whole = list(iter_samples([path]))
    assert [(x.source_row, x.reason) for x in whole if isinstance(x, Rejected)] == [(3, "bad_json"), (7, "bad_encoding")]
    assert whole[3].message.startswith("array element is not valid JSON: ")
    assert len(whole) == 12 and sum(not isinstance(x, Rejected) for x in whole) == 10
    tasks, total = plan_tokenize_tasks([path], 5)
    assert total == 12 and len(tasks) == 3
    sliced = [parse_record(rec, s.path, row, "auto") for t in tasks for s in t for row, rec in _slice_records(s)]
    assert sliced == whole


def test_a_json_array_tokenizes_like_the_same_records_in_jsonl(tmp_path):
    """Tokenized from a JSON array (cut into four tasks, two workers) or from JSONL, the shards
    hold the same rows, the input's name aside; files of both kinds share tasks as JSONL files
    do."""
    make_corpus(tmp_path, 40, seed=6)
    jsonl = tmp_path / "data.jsonl"
    array = tmp_path / "data.json"
    array.write_bytes(b"[\n" + b",\n".join(jsonl.read_bytes().splitlines()) + b"\n]\n")
    cfg = TokenizeConfig(media_root=str(tmp_path), rows_per_shard=10)

    def rows(out: Path) -> list[dict]:
        return [r for f in sorted(out.glob("part-*.parquet")) for r in pq.read_table(f).drop_columns(["source"]).to_pylist()]

    a = tokenize_dataset([array], tmp_path / "from-array", cfg, workers=2, progress=None)
    b = tokenize_dataset([jsonl], tmp_path / "from-jsonl", cfg, workers=1, progress=None)
    assert len(a["shards"]) == len(b["shards"]) == 4 and a["counts"] == b["counts"]
    assert rows(tmp_path / "from-array") == rows(tmp_path / "from-jsonl")
    tasks, total = plan_tokenize_tasks([array, jsonl], 30)
    assert total == 80 and [[(Path(s.path).name, s.start, s.stop) for s in t] for t in tasks] == [
        [("data.json", 0, 30)], [("data.json", 30, 40), ("data.jsonl", 0, 20)], [("data.jsonl", 20, 40)]]


def test_an_array_that_changes_after_planning_stops_the_task_naming_it(tmp_path):
    """A task whose planned elements are gone (the file was cut short since planning) stops with
    an error that names the file and says to re-run, not with a row count that silently drops."""
    path = tmp_path / "data.json"
    path.write_bytes(b"[" + b",".join(b'{"id": "%d"}' % k for k in range(20)) + b"]")
    tasks, total = plan_tokenize_tasks([path], 8)
    assert total == 20 and len(tasks) == 3
    path.write_bytes(path.read_bytes()[:60])  # elements 0-4 whole, the rest gone
    from packtool.errors import InputError

    got = []
    with pytest.raises(InputError, match=r"data\.json changed while it was being read: its JSON array no longer holds "
                                         r"element 4 where an earlier read found it; re-run"):
        got.extend(row for row, _ in _slice_records(tasks[0][0]))
    assert got == [0, 1, 2, 3]
    with pytest.raises(InputError, match="element 8 where"):
        list(_slice_records(tasks[1][0]))


def test_a_small_array_or_jsonl_file_named_json_is_read_whole_with_the_same_rows(tmp_path, monkeypatch):
    """Under ``CUT_MIN_BYTES`` a ``.json`` file is not looked into (the planner only stats it):
    one whole slice, reading the rows the cut slices read."""
    make_corpus(tmp_path, 20, seed=9)
    lines = (tmp_path / "data.jsonl").read_bytes().splitlines(keepends=True)
    array = tmp_path / "array.json"
    array.write_bytes(b"[" + b",".join(x.rstrip() for x in lines) + b"]")
    named = tmp_path / "lines.json"
    named.write_bytes(b"".join(lines))
    for path in (array, named):
        cut, total = plan_tokenize_tasks([path], 6)
        assert total == 20 and len(cut) == 4
        monkeypatch.setattr(pipeline, "CUT_MIN_BYTES", path.stat().st_size + 1)
        whole, total = plan_tokenize_tasks([path], 6)
        assert total is None and [(s.start, s.offset) for t in whole for s in t] == [(0, None)]
        read = [[parse_record(rec, s.path, row, "auto") for t in tasks for s in t for row, rec in _slice_records(s)]
                for tasks in (cut, whole)]
        assert read[0] == read[1] and len(read[0]) == 20
        monkeypatch.setattr(pipeline, "CUT_MIN_BYTES", 0)
