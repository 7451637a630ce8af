"""How the stages are cut into tasks: deterministic slices, exact reading, bounded chunks."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.corpus import make_corpus  # noqa: E402
from packtool import (  # noqa: E402
    PackConfig,
    TokenizeConfig,
    pack_dataset,
    pipeline,  # noqa: E402
    tokenize_dataset,
)
from packtool.errors import InputError  # noqa: E402
from packtool.formats import Rejected, iter_samples, parse_record  # noqa: E402
from packtool.pipeline import Slice, _line_offsets, _slice_records, plan_tokenize_tasks  # noqa: E402


def write(path: Path, lines: list[str], end: str = "\n") -> Path:
    path.write_text("\n".join(lines) + end)
    return path


def test_line_offsets_point_at_line_starts(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_bytes(b"a\nbb\n\nccc\nd")
    n, cuts = _line_offsets(f, 1, 2)
    assert n == 5 and cuts == [(1, 2), (3, 6)]
    data = f.read_bytes()
    assert [data[o:].split(b"\n")[0] for _, o in cuts] == [b"bb", b"ccc"]
    assert _line_offsets(f, 5, 5) == (5, [])
    f.write_bytes(b"a\nb\n")
    assert _line_offsets(f, 2, 2) == (2, [])  # no task may start past the last line


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5])
def test_the_parallel_range_scan_finds_the_cuts_of_the_slow_twin(tmp_path, seed):
    """Byte ranges and mark strides far smaller than the defaults, so cuts fall on range edges,
    on marks, before the first mark of a range and in files without a final newline."""
    from packtool.pipeline import _cuts, _scan_files
    from tests.naive import line_offsets

    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 40, size=int(rng.integers(0, 400)))
    data = b"".join(b"x" * int(n) + b"\n" for n in lengths)
    if seed % 2:
        data += b"tail"  # a last line without its newline
    f = tmp_path / "in.jsonl"
    f.write_bytes(data)
    for range_bytes, every_mark, workers in ((1 << 20, 256, 1), (97, 3, 2), (1, 1, 3), (64, 5, 2)):
        scan = _scan_files([f], workers, range_bytes=range_bytes, every=every_mark)[f]
        for first, every in ((1, 1), (1, 7), (5, 13), (40, 40), (3, 1000)):
            assert _cuts(scan, first, every) == line_offsets(data, first, every), (seed, range_bytes, every_mark, first,
                                                                                   every)


def test_small_files_share_a_task_and_a_big_file_is_cut(tmp_path):
    a = write(tmp_path / "a.jsonl", ["{}"] * 3)
    b = write(tmp_path / "b.jsonl", ["{}"] * 5)
    c = write(tmp_path / "c.jsonl", ["{}"])
    tasks, total = plan_tokenize_tasks([a, b, c], 4)
    assert total == 9
    shape = [[(Path(s.path).name, s.start, s.stop) for s in t] for t in tasks]
    assert shape == [[("a.jsonl", 0, 3), ("b.jsonl", 0, 1)], [("b.jsonl", 1, 5)], [("c.jsonl", 0, 1)]]
    assert tasks[1][0].offset == 3  # byte offset of b.jsonl's line 1


def test_files_that_cannot_be_cut_share_tasks_by_size(tmp_path, monkeypatch):
    import gzip

    a = write(tmp_path / "a.jsonl", ["{}"] * 3)
    arr = tmp_path / "b.json.gz"  # compressed: no seeking into it
    arr.write_bytes(gzip.compress(b"[{}, {}]"))
    gz = tmp_path / "c.jsonl.gz"
    gz.write_bytes(gzip.compress(b"{}\n" * 50))
    big = tmp_path / "d.json"  # an array whose frame is broken (an empty element): read whole
    big.write_text("[" + ", ".join(["{}"] * 400) + ",]")
    monkeypatch.setattr(pipeline, "WHOLE_FILES_PER_TASK_BYTES", 1000)
    tasks, total = plan_tokenize_tasks([a, arr, gz, big, a], 10)
    assert total is None
    # whole files join the task being filled, rows or not, until their bytes pass the limit
    assert [[(Path(s.path).name, s.start, s.stop, s.offset) for s in t] for t in tasks] == [
        [("a.jsonl", 0, 3, 0), ("b.json.gz", 0, None, None), ("c.jsonl.gz", 0, None, None)],
        [("d.json", 0, None, None), ("a.jsonl", 0, 3, 0)]]
    sliced = [parse_record(rec, s.path, row, "auto") for t in tasks for s in t for row, rec in _slice_records(s)]
    assert sliced == list(iter_samples([a, arr, gz, big, a]))


def test_small_json_and_jsonl_files_alternating_share_tasks(tmp_path):
    """Small ``.json`` arrays (read whole) between ``.jsonl`` files (cut at lines) go into the
    tasks being filled, not a task each: a folder of both kinds gave one task, one shard and
    (packed apart) one underfilled pack a file."""
    files = []
    for i in range(6):
        if i % 2:
            f = tmp_path / f"part{i}.json"
            f.write_text(json.dumps([{"id": f"{i}-{k}"} for k in range(5)]))
        else:
            f = write(tmp_path / f"part{i}.jsonl", [json.dumps({"id": f"{i}-{k}"}) for k in range(5)])
        files.append(f)
    tasks, total = plan_tokenize_tasks(files, 1000)
    assert total is None  # the arrays' rows are counted when read
    assert [[Path(s.path).name for s in t] for t in tasks] == [[f.name for f in files]]
    sliced = [parse_record(rec, s.path, row, "auto") for t in tasks for s in t for row, rec in _slice_records(s)]
    assert sliced == list(iter_samples(files))
    # a full task is cut as before: the rows after it start the next one, the arrays still join
    tasks, _ = plan_tokenize_tasks(files, 8)
    assert [[(Path(s.path).name, s.start, s.stop) for s in t] for t in tasks] == [
        [("part0.jsonl", 0, 5), ("part1.json", 0, None), ("part2.jsonl", 0, 3)],
        [("part2.jsonl", 3, 5), ("part3.json", 0, None), ("part4.jsonl", 0, 5), ("part5.json", 0, None)]]


def test_slices_read_exactly_what_the_format_reader_reads(tmp_path):
    """Reading a file slice by slice gives the same samples and rejections, row numbers
    included, as ``formats.iter_samples`` reading it whole (bad lines, blank lines, a last
    line without newline)."""
    make_corpus(tmp_path, 50, seed=2)
    f = tmp_path / "data.jsonl"
    lines = f.read_text().splitlines()
    lines[7] = "{not json"
    lines[20] = ""
    lines[31] = '{"id": "x", "conversations": 5}'
    f.write_bytes("\n".join(lines).encode() + b"\n\xff\xfe{}")
    tasks, _ = plan_tokenize_tasks([f], 6)
    assert len(tasks) == 9
    sliced = [parse_record(rec, s.path, row, "auto") for t in tasks for s in t for row, rec in _slice_records(s)]
    whole = list(iter_samples([f]))
    assert len(whole) == 50 and sliced == whole
    reasons = [(x.source_row, x.reason) for x in whole if isinstance(x, Rejected)]
    assert reasons == [(7, "bad_json"), (31, "bad_record"), (50, "bad_encoding")]


def test_slice_offset_none_reads_the_whole_file(tmp_path):
    f = write(tmp_path / "a.json", ['[{"a": 1},', '{"a": 2}]'])
    assert [r for _, r in _slice_records(Slice(str(f), 0, None, None))] == [{"a": 1}, {"a": 2}]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    make_corpus(root, 500, seed=4)
    return root


def hashes(d: Path) -> list[str]:
    return [s["sha256"] for s in json.loads((d / ".packtool" / "manifest.json").read_text())["shards"]]


def test_pack_output_does_not_depend_on_the_assembly_chunk(corpus, tmp_path, monkeypatch):
    tok = tmp_path / "tok"
    tokenize_dataset([corpus / "data.jsonl"], tok, TokenizeConfig(media_root=str(corpus), rows_per_shard=250), workers=1)
    # a low capacity so some samples are dropped as oversize and others wait in the buffer
    cfg = PackConfig(max_tokens=1536, media="reference", packs_per_shard=50, buffer_size=16)
    a = pack_dataset(tok, tmp_path / "a", cfg, workers=1)
    assert a["counts"]["dropped"] > 0 and a["counts"]["packs"] > 2 * pipeline.PACK_CHUNK / 4
    monkeypatch.setattr(pipeline, "PACK_CHUNK", 3)
    b = pack_dataset(tok, tmp_path / "b", cfg, workers=1)
    assert hashes(tmp_path / "a") == hashes(tmp_path / "b")
    assert a["counts"] == b["counts"]
    errors = [json.loads(x) for x in (tmp_path / "b" / ".packtool" / "errors.jsonl").read_text().splitlines()]
    assert len(errors) == a["counts"]["dropped"] and {e["reason"] for e in errors} == {"oversize"}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_row_store_hands_out_each_row_once_and_holds_one_group_plus_the_waiting_rows(tmp_path, seed):
    """Rows asked for as a packing buffer asks for them (shard order, some held back for a
    while): each comes back as itself, the store holds at most the group being read plus the
    rows still waiting, and it copies only those waiting rows, once a group is passed."""
    import pyarrow as pa

    n, group = 600, 50
    rng = np.random.default_rng(seed)
    pq.write_table(pa.table({"sample_id": [f"s{i}" for i in range(n)], "n_tokens": np.arange(n, dtype=np.int32)}),
                   tmp_path / "t.parquet", row_group_size=group)
    store = pipeline._RowStore(pq.ParquetFile(tmp_path / "t.parquet"), never=[5, 6, 7])
    store.columns = ["sample_id", "n_tokens"]
    waiting: list[tuple[int, int]] = []  # (row, due step): rows the "buffer" holds back: 3% of them, for 1 to 40 more takes
    n_late = 0
    copied = 0  # rows of held tables the store made anew (a cut-down copy of a group)
    out: list[str] = []
    row, step = 0, 0
    while row < n or waiting:
        fresh = list(range(row, min(n, row + int(rng.integers(1, 12)))))
        row += len(fresh)
        fresh = [r for r in fresh if r not in (5, 6, 7)]  # rows no pack takes
        late = [r for r in fresh if rng.random() < 0.03]
        n_late += len(late)
        waiting += [(r, step + int(rng.integers(1, 40))) for r in late]
        due = [r for r, until in waiting if until <= step or row >= n]
        waiting = [(r, until) for r, until in waiting if r not in due]
        want = np.array(sorted(set(fresh) - set(late)) + due, dtype=np.int64)
        step += 1
        if not len(want):
            continue
        before = {g: entry[0] for g, entry in store.held.items()}
        tables, where = store.take(want)
        ids = pa.concat_tables(tables)["sample_id"].to_pylist()
        assert [ids[int(w)] for w in where] == [f"s{r}" for r in want.tolist()], f"seed {seed}"
        out += [f"s{r}" for r in want.tolist()]
        copied += sum(entry[0].num_rows for g, entry in store.held.items() if g in before and entry[0] is not before[g])
        held = sum(len(entry[1]) for entry in store.held.values())
        assert held <= 2 * group + len(waiting), f"seed {seed}: {held} rows held, {len(waiting)} waiting"
    assert sorted(out) == sorted(f"s{i}" for i in range(n) if i not in (5, 6, 7)) and not store.held
    # only rows that waited were copied (each at most a few times), never a group's unread rows
    assert copied <= 3 * n_late, f"seed {seed}: {copied} rows copied, {n_late} waited"


def test_every_row_lands_in_exactly_one_place(corpus, tmp_path):
    """Accounting over tasks: rows in = samples + rejected; samples = packed + dropped; the
    ids in packs and errors partition the input ids."""
    src = tmp_path / "in.jsonl"
    lines = (corpus / "data.jsonl").read_text().splitlines()
    lines[3] = "{broken"
    lines[100] = json.dumps({"id": "gone", "image": "images/none.png",
                             "conversations": [{"from": "human", "value": "<image>\nhi"}, {"from": "gpt", "value": "x"}]})
    src.write_text("\n".join(lines) + "\n")
    tok = tokenize_dataset([src], tmp_path / "tok", TokenizeConfig(media_root=str(corpus), rows_per_shard=120), workers=2)
    c = tok["counts"]
    assert c["rows_in"] == 500 and c["samples"] + c["rejected"] == 500
    assert c["rejected_by_reason"] == {"bad_json": 1, "missing_media": 1}
    packed = pack_dataset(tmp_path / "tok", tmp_path / "packed", PackConfig(max_tokens=1536, media="reference"), workers=2)
    p = packed["counts"]
    assert p["samples_in"] == c["samples"] == p["samples_packed"] + p["dropped"]
    import pyarrow.parquet as pq

    packed_ids = [i for s in packed["shards"] for ids in pq.read_table(tmp_path / "packed" / s["file"],
                                                                           columns=["sample_ids"])["sample_ids"].to_pylist()
                  for i in ids]
    errs = [json.loads(x) for d in ("tok", "packed") for x in (tmp_path / d / ".packtool" / "errors.jsonl").read_text().splitlines()]
    assert len(packed_ids) == len(set(packed_ids))
    expected = {json.loads(x)["id"] for i, x in enumerate(lines) if i != 3} | {f"{src}:3"}
    got = set(packed_ids) | {e["sample_id"] or f"{e['source']}:{e['row']}" for e in errs}
    assert len(packed_ids) + len(errs) == 500 and got == expected
    bad = next(e for e in errs if e["reason"] == "bad_json")
    assert (bad["source"], bad["row"]) == (str(src), 3)


def test_row_groups_are_cut_by_bytes_the_same_way_however_rows_arrive(demo_dirs, tmp_path):
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from packtool.schema import PACKED
    from packtool.shards import ShardWriter, row_bytes

    manifest = json.loads((demo_dirs["packed"] / ".packtool" / "manifest.json").read_text())
    table = pq.read_table(demo_dirs["packed"] / manifest["shards"][0]["file"])
    sizes = row_bytes(table)
    stored = pc.binary_length(table["compact_input_ids_i32le"]).to_numpy() // 4
    assert all(sizes > stored * 16) and all(stored < table["n_tokens"].to_numpy())  # 4 compact columns + images
    limit = int(sizes.max()) + 1  # about one pack per row group
    outs = []
    for name, pieces in (("whole", [table]), ("one-by-one", [table.slice(i, 1) for i in range(table.num_rows)])):
        (tmp_path / name).mkdir()
        with ShardWriter(tmp_path / name, PACKED, rows_per_shard=1000, row_group_rows=256, max_group_bytes=limit) as w:
            for piece in pieces:
                w.write_table(piece)
        outs.append(w.shards[0]["sha256"])
        meta = pq.ParquetFile(tmp_path / name / w.shards[0]["file"]).metadata
        assert meta.num_row_groups >= table.num_rows - 1
    assert outs[0] == outs[1]


def test_parquet_inputs_are_cut_at_row_groups_and_read_like_the_format_reader(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
            for i in range(23)]
    rows[5] = {"id": "r5", "conversations": []}
    f = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist(rows), f, row_group_size=4)  # groups of 4,4,4,4,4,3
    small = write(tmp_path / "z.jsonl", ['{"id": "z"}'] * 2)
    tasks, total = plan_tokenize_tasks([f, small], 10)
    assert total == 25
    shape = [[(Path(s.path).name, s.start, s.stop, s.groups) for s in t] for t in tasks]
    assert shape == [[("data.parquet", 0, 8, (0, 2))], [("data.parquet", 8, 16, (2, 4))],
                     [("data.parquet", 16, 23, (4, 6)), ("z.jsonl", 0, 2, None)]]
    sliced = [parse_record(rec, s.path, row, "auto") for t in tasks for s in t for row, rec in _slice_records(s)]
    assert sliced == list(iter_samples([f, small]))
    assert [(x.source_row, x.reason) for x in sliced if isinstance(x, Rejected)] == [
        (5, "empty_conversation"), (0, "bad_record"), (1, "bad_record")]


def test_a_corpus_with_no_good_row_still_gives_whole_empty_outputs(tmp_path):
    from packtool.validate import validate_dir

    src = write(tmp_path / "in.jsonl", ["{bad", "[1, 2]"])
    tok = tokenize_dataset([src], tmp_path / "tok", TokenizeConfig(media_root=str(tmp_path)), workers=2)
    assert tok["counts"]["samples"] == 0 and tok["counts"]["rejected_by_reason"] == {"bad_json": 1, "bad_record": 1}
    packed = pack_dataset(tmp_path / "tok", tmp_path / "packed", PackConfig(), workers=2)
    assert packed["shards"] == [] and packed["counts"]["packs"] == packed["counts"]["samples_packed"] == 0
    assert validate_dir(tmp_path / "tok")["ok"] and validate_dir(tmp_path / "packed")["ok"]
    dry = pack_dataset(tmp_path / "tok", tmp_path / "unused", PackConfig(), dry_run=True)
    assert dry["counts"]["packs"] == 0 and dry["plans"] == []


# ---------------------------------------------------------------- the plan, made once per run

_OPENED: list[str] | None = None  # paths opened while a test listens (None: not listening)


def _listen(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, Path)):
        _OPENED.append(os.path.abspath(args[0]))


sys.addaudithook(_listen)  # audit hooks stay for the life of the process; this one only listens


def opened_during(fn, *args, **kwargs) -> tuple[object, list[str]]:
    """``fn(...)``'s result and every file it opened through Python (``open``, ``os.open``)."""
    global _OPENED
    _OPENED = []
    try:
        return fn(*args, **kwargs), _OPENED
    finally:
        _OPENED = None


@pytest.fixture(scope="module")
def three_inputs(corpus, tmp_path_factory) -> list[Path]:
    """Three JSONL files of 100 rows: with 100 rows per task, task t reads file t alone."""
    d = tmp_path_factory.mktemp("three")
    lines = (corpus / "data.jsonl").read_text().splitlines()
    return [write(d / f"{name}.jsonl", lines[100 * k:100 * (k + 1)]) for k, name in enumerate("abc")]


def test_a_second_rank_reads_the_stored_plan_not_every_input(three_inputs, corpus, tmp_path):
    """Rank 0 plans (reading every input) and stores the plan; rank 1 then opens only the
    input of its own task, once, and the merged run is byte-identical to a one-rank run."""
    a, b, c = (str(p) for p in three_inputs)
    cfg = TokenizeConfig(media_root=str(corpus), rows_per_shard=100)
    whole = tokenize_dataset(three_inputs, tmp_path / "whole", cfg, workers=1)
    assert whole["counts"]["tasks"] == 3
    out = tmp_path / "ranks"
    _, first = opened_during(tokenize_dataset, three_inputs, out, cfg, workers=1, rank=0, world_size=2)
    assert {a, b, c} <= set(first)  # the planner read them all (b only to count its lines)
    plan = json.loads((out / ".packtool" / "plan.json").read_text())
    assert plan["n_tasks"] == 3 and [[s[0] for s in t] for t in plan["tasks"]] == [[a], [b], [c]]
    partial, second = opened_during(tokenize_dataset, three_inputs, out, cfg, workers=1, rank=1, world_size=2)
    assert [p for p in second if p in (a, b, c)] == [b]  # its own slice, read once; a and c untouched
    assert partial["kind"] == "tokenized" and "partial" not in partial  # the last rank wrote the manifest
    pipeline.merge_output(out)  # idempotent: the same bytes again
    for name in ("manifest.json", "errors.jsonl"):
        assert (out / ".packtool" / name).read_bytes() == (tmp_path / "whole" / ".packtool" / name).read_bytes()
    # the same rank 1 without a stored plan (a fresh directory) reads every input: what is saved above
    _, alone = opened_during(tokenize_dataset, three_inputs, tmp_path / "alone", cfg, workers=1, rank=1, world_size=2)
    assert {a, c} <= set(alone)


def test_a_stored_plan_of_other_inputs_or_a_tampered_one_is_not_used(three_inputs, corpus, tmp_path):
    cfg = TokenizeConfig(media_root=str(corpus), rows_per_shard=100)
    out = tmp_path / "tok"
    tokenize_dataset(three_inputs, out, cfg, workers=1, rank=0, world_size=2)
    state = out / ".packtool" / "plan.json"
    plan = json.loads(state.read_text())
    outside = tmp_path / "secret.jsonl"
    outside.write_text('{"id": "not an input"}\n')
    plan["tasks"][1] = [[str(outside), 0, 1, 0, None]]
    state.write_text(json.dumps(plan))
    _, opened = opened_during(tokenize_dataset, three_inputs, out, cfg, workers=1, rank=1, world_size=2)
    assert str(outside) not in opened and str(three_inputs[0]) in opened  # planned again from the inputs
    assert json.loads(state.read_text())["tasks"][1] == [[str(three_inputs[1]), 0, 100, 0, None]]
    assert (out / ".packtool" / "manifest.json").is_file()


def test_a_second_pack_rank_checks_only_its_own_shards(corpus, tmp_path, monkeypatch):
    tok = tmp_path / "tok"
    tokenize_dataset([corpus / "data.jsonl"], tok, TokenizeConfig(media_root=str(corpus), rows_per_shard=100), workers=1)
    cfg = PackConfig(max_tokens=4096, media="reference")
    pack_dataset(tok, tmp_path / "whole", cfg, workers=1)
    seen: list[str] = []
    real = pipeline.open_shard

    def spy(directory, entry, **kw):
        seen.append(entry["file"])
        return real(directory, entry, **kw)

    monkeypatch.setattr(pipeline, "open_shard", spy)
    pack_dataset(tok, tmp_path / "ranks", cfg, workers=1, rank=0, world_size=2)
    # the planner checks every shard's footer, then reads its own tasks' shards (0, 2, 4) whole
    assert sorted(seen) == sorted([f"part-{t:05d}-00000.parquet" for t in (0, 1, 2, 3, 4, 0, 2, 4)])
    seen.clear()
    pack_dataset(tok, tmp_path / "ranks", cfg, workers=1, rank=1, world_size=2)
    assert seen == ["part-00001-00000.parquet", "part-00003-00000.parquet"]  # its tasks' shards, each read once
    assert hashes(tmp_path / "ranks") == hashes(tmp_path / "whole")


def test_a_task_opens_the_drivers_relative_paths_from_any_directory(corpus, tmp_path, monkeypatch):
    """A Ray worker on another node runs in its own directory, not the driver's: a task still
    opens the inputs, the output and a tokenizer file named relative to the driver's directory,
    and writes what a task run there writes."""
    import shutil

    from tests.test_templates import LLAMA3_SPECIALS, byte_level_tokenizer

    driver, elsewhere = tmp_path / "driver", tmp_path / "elsewhere"
    elsewhere.mkdir()
    byte_level_tokenizer(driver / "tok", LLAMA3_SPECIALS)
    shutil.copy(corpus / "data.jsonl", driver / "in.jsonl")
    monkeypatch.chdir(driver)
    cfg = TokenizeConfig(media_root=str(corpus), rows_per_shard=200, tokenizer="tok", template="llama3", model="fixed:3")
    here = tokenize_dataset(["in.jsonl"], "here", cfg, workers=1)
    real = pipeline.run_tasks

    def in_another_directory(fn, tasks, ex, *args, **kwargs):
        os.chdir(elsewhere)  # as a worker on another node: the tasks were made in the driver's
        pipeline._CONTEXTS.clear()  # and a fresh worker has loaded no tokenizer yet
        try:
            return real(fn, tasks, ex, *args, **kwargs)
        finally:
            os.chdir(driver)

    monkeypatch.setattr(pipeline, "run_tasks", in_another_directory)
    there = tokenize_dataset(["in.jsonl"], "there", cfg, workers=1)
    assert here["counts"]["tasks"] == 3 and here["counts"]["samples"] > 400
    assert there["counts"] == here["counts"] and hashes(driver / "there") == hashes(driver / "here")
    assert list(elsewhere.iterdir()) == []


def test_a_task_pauses_the_collector_and_collects_between_batches():
    """A tokenize task turns automatic collection off for its run, collects the young
    generations itself every ``every`` batches, and puts the caller's setting back afterwards,
    also when the task fails (a caller that had it off keeps it off)."""
    import gc

    from packtool.pipeline import _collector_paused

    runs: list[int] = []

    def count(phase, info):
        if phase == "start":
            runs.append(info["generation"])

    was = gc.isenabled()
    gc.callbacks.append(count)
    try:
        gc.enable()
        with pytest.raises(ValueError), _collector_paused(every=3) as after_batch:
            assert not gc.isenabled()
            runs.clear()  # what ran before the task is not the task's
            for _ in range(7):
                after_batch()
            seen = list(runs)
            raise ValueError("task failed")
        assert seen == [1, 1]  # after batches 3 and 6, none on its own
        assert gc.isenabled()
        gc.disable()
        with _collector_paused(every=3):
            pass
        assert not gc.isenabled()
    finally:
        gc.callbacks.remove(count)
        if was:
            gc.enable()


def test_a_leading_byte_order_mark_is_read_the_same_cut_or_whole(tmp_path, monkeypatch):
    """A JSONL file that starts with a UTF-8 byte-order mark is cut into tasks at the same
    byte offsets as without it (shifted by its 3 bytes) and every slice, the first included,
    reads what the format reader reads: no row lost, row numbers unchanged. A mark inside the
    file is still a bad row; a ``.jsonl`` file holding a marked JSON array is cut at the same
    elements, its offsets counting the mark."""
    make_corpus(tmp_path, 30, seed=3)
    f = tmp_path / "data.jsonl"
    lines = f.read_bytes().splitlines(keepends=True)
    lines[13] = b"\xef\xbb\xbf" + lines[13]
    f.write_bytes(b"\xef\xbb\xbf" + b"".join(lines))
    tasks, total = plan_tokenize_tasks([f], 7)
    assert total == 30 and [s.offset for t in tasks for s in t] == [0, *(3 + sum(map(len, lines[:k])) for k in (7, 14, 21, 28))]
    sliced = [parse_record(rec, s.path, row, "auto") for t in tasks for s in t for row, rec in _slice_records(s)]
    whole = list(iter_samples([f]))
    assert sliced == whole and len(whole) == 30
    assert [(x.source_row, x.reason) for x in whole if isinstance(x, Rejected)] == [(13, "bad_json")]

    monkeypatch.setattr(pipeline, "CUT_MIN_BYTES", 0)  # a small file, looked into as a large one is
    arr = tmp_path / "array.jsonl"
    arr.write_bytes(b"\xef\xbb\xbf[\n" + b",\n".join(line.rstrip(b"\n") for k, line in enumerate(lines) if k != 13) + b"\n]\n")
    tasks, total = plan_tokenize_tasks([arr], 7)
    kept = [line.rstrip(b"\n") for k, line in enumerate(lines) if k != 13]
    assert total == 29 and [(s.start, s.offset) for t in tasks for s in t] == [
        (k, 5 + sum(len(x) + 2 for x in kept[:k])) for k in (0, 7, 14, 21, 28)]  # mark, "[\n"; ",\n" each
    got = [parse_record(rec, s.path, row, "auto") for t in tasks for s in t for row, rec in _slice_records(s)]
    assert len(got) == 29 and not any(isinstance(x, Rejected) for x in got) and got == list(iter_samples([arr]))


def test_one_input_path_given_alone_is_one_input_not_the_characters_of_its_name(tmp_path, monkeypatch):
    # "data.jsonl" iterated is "d", "a", ... and "." (the whole working directory); "/x.jsonl" would be the disk
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "data.jsonl", ['{"id": "a", "conversations": [{"from": "human", "value": "hi"}, '
                                    '{"from": "gpt", "value": "yes"}]}'])
    cfg = TokenizeConfig(media_root=str(tmp_path))
    listed = tokenize_dataset(["data.jsonl"], tmp_path / "listed", cfg)
    sha = [s["sha256"] for s in listed["shards"]]
    for name, inputs in [("str", "data.jsonl"), ("path", Path("data.jsonl")), ("gen", (p for p in ["data.jsonl"]))]:
        got = tokenize_dataset(inputs, tmp_path / name, cfg)
        assert got["counts"]["samples"] == 1 and [s["sha256"] for s in got["shards"]] == sha, name
    with pytest.raises(InputError, match="no inputs given"):
        tokenize_dataset([], tmp_path / "none", cfg)


def test_a_stage_called_with_arguments_of_the_wrong_kind_says_which_before_writing(demo_dirs, tmp_path):
    from packtool.errors import ConfigError

    tok, out = demo_dirs["tokenized"], tmp_path / "out"
    sample = demo_dirs["sample"]
    cases = [
        (lambda: tokenize_dataset([sample / "data.jsonl"], out, {"media_root": str(sample)}),
         "cfg must be a packtool.TokenizeConfig, got dict"),
        (lambda: tokenize_dataset([sample / "data.jsonl"], out, PackConfig()),
         "cfg must be a packtool.TokenizeConfig, got PackConfig"),
        (lambda: pack_dataset(tok, out, TokenizeConfig()), "cfg must be a packtool.PackConfig, got TokenizeConfig"),
        (lambda: pack_dataset(tok, out, 8192), "cfg must be a packtool.PackConfig, got int"),
        (lambda: pack_dataset(tok, out, PackConfig(), max_errors=-1), "--max-errors -1: choose an integer of 0 or more"),
        (lambda: pack_dataset(tok, out, PackConfig(), max_errors="3"), "--max-errors '3': choose an integer of 0 or"),
        (lambda: pack_dataset(tok, out, PackConfig(), rank="0", world_size=2),
         r"ExecutorConfig\(rank=...\) must be an integer, got '0' \(str\)"),
        (lambda: pack_dataset(tok, out, PackConfig(), workers=2.0), r"\(workers=...\) must be an integer or None"),
        (lambda: TokenizeConfig(max_errors=-1), "--max-errors -1: choose 0 or more"),
    ]
    for call, message in cases:
        with pytest.raises(ConfigError, match=message):
            call()
        assert not out.exists()
    # a generator of one directory is that directory; numpy counts are counts
    one = pack_dataset((d for d in [tok]), tmp_path / "gen", PackConfig(max_tokens=8192), max_errors=np.int64(0))
    assert [s["sha256"] for s in one["shards"]] == [s["sha256"] for s in pack_dataset(
        tok, tmp_path / "dir", PackConfig(max_tokens=8192))["shards"]]


def test_records_without_ids_in_inputs_of_one_file_name_are_named_by_their_paths(tmp_path, monkeypatch):
    """A record without an id is named FILE:ROW; a corpus laid out as a/train.jsonl, b/train.jsonl
    named every row of the one like the same row of the other, in different tasks, which no
    task could tell apart. Such inputs name their records by enough of their path; an input of
    its own file name, and a record with an id, are named as before."""
    root = Path(__file__).resolve().parents[1] / "examples" / "sample"
    lines = (root / "data.jsonl").read_text().splitlines()[:2]
    bare = [json.dumps({k: v for k, v in json.loads(line).items() if k != "id"}) for line in lines]
    monkeypatch.chdir(tmp_path)
    for d in ("x/a", "x/b", "y/b"):
        (tmp_path / "corpus" / d).mkdir(parents=True)
        write(tmp_path / "corpus" / d / "train.jsonl", bare)
    write(tmp_path / "corpus" / "val.jsonl", [bare[0], lines[1]])
    tokenize_dataset(["corpus"], "tok", TokenizeConfig(media_root=str(root), rows_per_shard=3), workers=1)
    manifest = json.loads((tmp_path / "tok" / ".packtool" / "manifest.json").read_text())
    ids = [i for e in manifest["shards"] for i in pq.read_table(tmp_path / "tok" / e["file"])["sample_id"].to_pylist()]
    assert ids == ["val.jsonl:0", "demo-001", "a/train.jsonl:0", "a/train.jsonl:1", "x/b/train.jsonl:0",
                   "x/b/train.jsonl:1", "y/b/train.jsonl:0", "y/b/train.jsonl:1"]
    assert manifest["counts"]["tasks"] == 3 and "repeated_ids" not in manifest["counts"]


def test_jsonl_under_a_json_name_is_cut_as_jsonl(tmp_path, monkeypatch):
    """A ``.json`` file the reader reads as JSONL (it starts with ``{`` and its first line that
    holds anything is a whole JSON value; here after a mark and blank lines) is cut at lines like
    a ``.jsonl`` file, every slice reading what the format reader reads; one pretty-printed
    object, or JSONL whose first line is broken, stays one whole slice."""
    monkeypatch.setattr(pipeline, "CUT_MIN_BYTES", 0)  # small files, looked into as large ones are
    make_corpus(tmp_path, 30, seed=8)
    lines = (tmp_path / "data.jsonl").read_bytes().splitlines(keepends=True)
    named = tmp_path / "data.json"
    named.write_bytes(b"\xef\xbb\xbf\n \n" + b"".join(lines))
    tasks, total = plan_tokenize_tasks([named], 8)
    assert total == 32 and [(s.start, s.stop, s.offset) for t in tasks for s in t] == [
        (0, 8, 0), *((k, min(k + 8, 32), 3 + 3 + sum(map(len, lines[:k - 2]))) for k in (8, 16, 24))]
    sliced = [parse_record(rec, s.path, row, "auto") for t in tasks for s in t for row, rec in _slice_records(s)]
    assert sliced == list(iter_samples([named])) and len(sliced) == 30
    pretty = write(tmp_path / "one.json", ['{"id": "x",', ' "conversations": []}'])
    broken = tmp_path / "broken.json"
    broken.write_bytes(b"{not json\n" + b"".join(lines[:3]))
    for path in (pretty, broken):
        tasks, total = plan_tokenize_tasks([path], 2)
        assert total is None and [(s.start, s.offset) for t in tasks for s in t] == [(0, None)]


def _media_problems_one_by_one(media, root: Path, check_mtime: bool) -> dict:
    """The rule ``_media_problems`` applies, item by item: a row is named by its first item
    with a recorded size whose file is gone, outside the root, or not the one counted."""
    import pyarrow.compute as pc

    from packtool.errors import SampleError
    from packtool.media import resolve_media_path

    lengths = pc.fill_null(pc.list_value_length(media), 0).to_pylist()
    items = pc.list_flatten(media).to_pylist()
    rows = [r for r, n in enumerate(lengths) for _ in range(n)]
    bad = {}
    for row, it in zip(rows, items, strict=True):
        if it["size_bytes"] is None or it["path"] is None or row in bad:
            continue
        try:
            st = resolve_media_path(it["path"], root).stat()
        except SampleError as err:
            bad[row] = (err.reason, err.message)
            continue
        except OSError as exc:
            bad[row] = ("missing_media", f"media file {it['path']!r} cannot be read: {exc.strerror}")
            continue
        if st.st_size != it["size_bytes"] or (check_mtime and st.st_mtime_ns != it["mtime_ns"]):
            bad[row] = ("media_changed", f"{it['kind']} {it['path']!r} changed since tokenize counted it (then "
                        f"{it['size_bytes']:,} bytes, modified at {it['mtime_ns']} ns; now {st.st_size:,} bytes, "
                        f"{st.st_mtime_ns} ns); re-run tokenize to count it again")
    return bad


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_media_checks_of_a_shard_name_each_rows_first_changed_file(tmp_path, seed):
    """``_media_problems`` compares a shard's items as arrays, one stat per distinct file: the
    rows it names and their messages equal those of the item-by-item rule, on rows mixing good,
    resized, touched, missing, outside-the-root and inline items, one to four items a row."""
    import random

    import pyarrow as pa

    rng = random.Random(seed)
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "outside.png").write_bytes(b"x" * 10)
    files = []
    for i in range(12):
        p = root / f"{i}.png"
        p.write_bytes(b"p" * (100 + i))
        st = p.stat()
        files.append((p.name, st.st_size, st.st_mtime_ns))
    choices = [
        lambda f: (f[0], f[1], f[2]),  # as counted
        lambda f: (f[0], f[1] + 1, f[2]),  # another size
        lambda f: (f[0], f[1], f[2] - 5),  # modified since
        lambda f: ("gone.png", 7, 1),  # missing
        lambda f: ("../outside.png", 10, 1),  # outside the root
        lambda f: (f[0], None, None),  # inline bytes: not checked
        lambda f: ("sub/../" + f[0], f[1], f[2]),  # a path with .. inside the root
    ]
    weights = [10, 1, 1, 1, 1, 2, 1]
    rows = []
    for _ in range(300):
        row = []
        for _ in range(rng.choice([0, 1, 1, 1, 2, 4])):
            path, size, mtime = rng.choices(choices, weights)[0](rng.choice(files))
            row.append({"kind": rng.choice(["image", "video"]), "path": path, "size_bytes": size, "mtime_ns": mtime})
        rows.append(row)
    (root / "sub").mkdir()
    item = pa.struct([("kind", pa.string()), ("path", pa.string()), ("size_bytes", pa.int64()), ("mtime_ns", pa.int64())])
    media = pa.array(rows, type=pa.list_(item))
    for check_mtime in (True, False):
        want = _media_problems_one_by_one(media, root, check_mtime)
        got = pipeline._media_problems(media, root, check_mtime)
        assert got == want, f"seed {seed}, check_mtime {check_mtime}"
        assert {r for r, _ in want.items()} and {reason for reason, _ in want.values()} >= (
            {"media_changed", "missing_media", "path_outside_root"} if check_mtime else {"missing_media"})
    assert pipeline._media_problems(pa.array([[], None], type=pa.list_(item)), root, True) == {}
