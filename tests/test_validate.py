"""``packtool validate`` passes whole directories and catches damage of every layer."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from clirun import packtool
from naive import list_form

from packtool.runs import (
    COMPACT_COLUMNS,
    MIN_RUN,
    RUN_COLUMNS,
    blob_table,
    compact_table,
    expand_table,
)
from packtool.schema import PACKED, PACKED_FULL, PACKED_V3
from packtool.shards import sha256_file
from packtool.validate import validate_dir


def run(*args: str) -> subprocess.CompletedProcess:
    return packtool(*args)  # in this process (tests/clirun.py): what a command prints and writes


@pytest.fixture()
def packed(demo_dirs, tmp_path) -> Path:
    d = tmp_path / "packed"
    shutil.copytree(demo_dirs["packed"], d)
    return d


def shard(d: Path) -> Path:
    return d / json.loads((d / ".packtool" / "manifest.json").read_text())["shards"][0]["file"]


def rewrite_row(d: Path, edit) -> None:
    """Replace the first shard by one whose row 0 is edited, and re-list it in the manifest
    (size and hash updated), so only the row checks can notice."""
    f = shard(d)
    rows = expand_table(pq.read_table(f)).to_pylist()
    edit(rows[0])
    pq.write_table(compact_table(pa.Table.from_pylist(rows, schema=PACKED_FULL)).cast(PACKED), f)
    relist(d, f)


def rewrite_runs(d: Path, edit, as_lists: bool = True) -> None:
    """Replace the first shard by one whose stored (compact) row 0 is edited, re-listed. The
    row is edited as lists (the stored blobs' values, under version 3's names) and stored as
    blobs again, or, ``as_lists=False``, edited as the stored bytes."""
    f = shard(d)
    table = pq.read_table(f)
    rows = (list_form(table) if as_lists else table).to_pylist()
    edit(rows[0])
    pq.write_table(blob_table(pa.Table.from_pylist(rows, schema=PACKED_V3)).cast(PACKED) if as_lists
                   else pa.Table.from_pylist(rows, schema=PACKED), f)
    relist(d, f)


def relist(d: Path, f: Path) -> None:
    manifest = json.loads((d / ".packtool" / "manifest.json").read_text())
    next(e for e in manifest["shards"] if e["file"] == f.name).update(bytes=f.stat().st_size, sha256=sha256_file(f))
    (d / ".packtool" / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("kind", ["tokenized", "packed", "packed-full"])
def test_whole_directories_pass(demo_dirs, kind):
    r = run("validate", str(demo_dirs[kind]))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.endswith(": OK\n")
    report = validate_dir(demo_dirs[kind])
    assert report["ok"] and report["rows"] > 0 and report["shards"] == 1


def test_flipped_byte_is_caught(packed):
    f = shard(packed)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    r = run("validate", str(packed))
    assert r.returncode == 1
    assert f"{f.name}: sha256" in r.stdout and "differs from the manifest" in r.stdout


def test_deleted_shard_is_caught(packed):
    f = shard(packed)
    f.unlink()
    r = run("validate", str(packed), "--json")
    assert r.returncode == 1
    report = json.loads(r.stdout)
    assert report["ok"] is False
    assert {"where": f.name, "what": "listed in the manifest but missing"} in report["problems"]


def test_a_shard_file_the_manifest_does_not_list_is_caught(packed):
    """A directory is a Parquet dataset to pandas, duckdb, ``datasets`` and pyarrow, which read
    every visible ``.parquet`` file in it: a copy of a shard left beside the listed ones (or one
    of another run) doubles rows for them, and validate said OK."""
    import pandas as pd

    f = shard(packed)
    n = len(pd.read_parquet(packed))
    shutil.copy(f, packed / "part-00009-00000.parquet")
    (packed / ".part-00001-00000.parquet.123@host.tmp").write_bytes(b"PAR1")  # hidden: no reader opens it
    assert len(pd.read_parquet(packed)) > n
    r = run("validate", str(packed), "--json")
    assert r.returncode == 1
    report = json.loads(r.stdout)
    assert report["problems"] == [{"where": "part-00009-00000.parquet", "what": (
        "not listed in the manifest, yet tools that read the directory as a Parquet dataset (pandas, duckdb, "
        "datasets) read its rows with the listed shards'; remove it")}]
    (packed / "part-00009-00000.parquet").unlink()
    assert run("validate", str(packed)).returncode == 0


def test_cu_seqlens_disagreeing_with_position_ids_is_caught(packed):
    def edit(row):
        cu = row["cu_seqlens"]
        assert len(cu) >= 3, "the demo's first pack holds several samples"
        cu[1] += 1  # the first sample now seems to end one token later than its positions say

    rewrite_row(packed, edit)
    report = validate_dir(packed)
    assert not report["ok"]
    whats = [p["what"] for p in report["problems"]]
    assert any("position_ids restart at 0 where cu_seqlens does not start a sample" in w for w in whats), whats


def test_loss_across_a_sample_boundary_is_caught(packed):
    def edit(row):
        end = row["cu_seqlens"][1]
        row["target_ids"][end - 1] = row["input_ids"][end]  # predict the next sample's first token

    rewrite_row(packed, edit)
    report = validate_dir(packed)
    assert any("target_ids[" in p["what"] and "boundary" in p["what"] for p in report["problems"])


def test_an_answer_right_after_the_media_is_no_loss_on_placeholders(tmp_path):
    """LLaVA pretraining (``plain``, ``fixed:N``): the answer follows the image's pad run with no
    end marker, so the span's last position predicts the answer's first token. That is the
    answer's loss, not the placeholder's; a target on a placeholder is still caught."""
    from PIL import Image

    from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset

    Image.new("RGB", (64, 48), (9, 99, 199)).save(tmp_path / "a.png")
    src = tmp_path / "pre.jsonl"
    src.write_text(json.dumps({"id": "pre", "image": "a.png", "conversations": [
        {"from": "human", "value": "<image>\n"}, {"from": "gpt", "value": "A blue box."}]}) + "\n")
    tokenize_dataset([src], tmp_path / "tok", TokenizeConfig(media_root=str(tmp_path), model="fixed:4",
                                                             template="plain"), workers=1)
    pack_dataset(tmp_path / "tok", tmp_path / "packed", PackConfig(max_tokens=64), workers=1)
    for d in ("tok", "packed"):
        report = validate_dir(tmp_path / d)
        assert (report["ok"], report["problems"]) == (True, []), d

    def edit(row):
        off = row["media"][0]["token_offset"]
        row["target_ids"][off + 1] = row["input_ids"][off + 2]  # predict the image's third pad token

    rewrite_row(tmp_path / "packed", edit)
    report = validate_dir(tmp_path / "packed")
    assert [p["what"] for p in report["problems"]] == ["media 0: placeholder tokens are targets"]


def test_a_tree_with_no_shared_prefix_restarts_positions_at_each_branch(tmp_path):
    """A text-only tree under ``plain`` (no BOS, no system turn) whose questions differ from their
    first token has an empty prefix: each branch continues from the prefix length 0. That is
    not a position restart inside a sample; a restart inside a branch still is."""
    from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset

    src = tmp_path / "tree.jsonl"
    src.write_text(json.dumps({"id": "t", "message_list": [{"question": "Colour?", "answer": "Red."},
                                                            {"question": "Shape?", "answer": "Round."}]}) + "\n")
    tokenize_dataset([src], tmp_path / "tok", TokenizeConfig(template="plain"), workers=1)
    pack_dataset(tmp_path / "tok", tmp_path / "packed", PackConfig(max_tokens=64), workers=1)
    for d in ("tok", "packed"):
        report = validate_dir(tmp_path / d)
        assert (report["ok"], report["problems"]) == (True, []), d

    def edit(row):
        assert row["subsegment_ids"][0] == 0, "the tree has no prefix"
        assert row["position_ids"][-1] > 0
        row["position_ids"][-1] = 0  # inside the last branch

    rewrite_row(tmp_path / "packed", edit)
    whats = [p["what"] for p in validate_dir(tmp_path / "packed")["problems"]]
    assert any("position_ids restart at 0 where cu_seqlens does not start a sample" in w for w in whats), whats


@pytest.mark.parametrize("change", ["swap", "overlap"])
def test_media_spans_out_of_row_order_or_overlapping_are_caught(tmp_path, change):
    """Two images of one layout: every span alone holds a right layout, but the trainer hands
    pixels over in media order and the model fills placeholders in row order, so spans listed
    out of row order (or one span claimed twice, the other image's placeholders by none) are damage."""
    from PIL import Image

    from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset

    for name, colour in (("a.png", (9, 99, 199)), ("b.png", (199, 99, 9))):
        Image.new("RGB", (64, 48), colour).save(tmp_path / name)
    src = tmp_path / "two.jsonl"
    src.write_text(json.dumps({"id": "two", "image": ["a.png", "b.png"], "conversations": [
        {"from": "human", "value": "<image> and <image>?"}, {"from": "gpt", "value": "Two boxes."}]}) + "\n")
    tokenize_dataset([src], tmp_path / "tok", TokenizeConfig(media_root=str(tmp_path), model="fixed:4"), workers=1)
    pack_dataset(tmp_path / "tok", tmp_path / "packed", PackConfig(max_tokens=128), workers=1)
    assert validate_dir(tmp_path / "packed")["ok"]

    def edit(row):
        a, b = row["media"]
        a["token_offset"], b["token_offset"] = (b["token_offset"], a["token_offset"]) if change == "swap" else (
            a["token_offset"], a["token_offset"])

    rewrite_row(tmp_path / "packed", edit)
    whats = [p["what"] for p in validate_dir(tmp_path / "packed")["problems"]]
    assert len(whats) == 1 and whats[0].startswith("media 1: span ") and "not in row order" in whats[0], whats


def test_media_span_off_its_placeholders_is_caught(packed):
    def edit(row):
        row["media"][0]["token_offset"] -= 1  # now starts on <|vision_start|>

    rewrite_row(packed, edit)
    report = validate_dir(packed)
    assert not report["ok"]
    assert any("media 0: image span" in p["what"] and "is not the qwen2.5-vl placeholder layout" in p["what"]
               for p in report["problems"]), report["problems"]


def _cut_first_image(row) -> None:
    data = row["media"][0]["data"]
    row["media"][0]["data"] = data[: len(data) // 2]


def test_corrupt_embedded_image_is_caught(packed):
    rewrite_row(packed, _cut_first_image)
    report = validate_dir(packed)
    assert any("do not decode" in p["what"] for p in report["problems"])
    assert validate_dir(packed, check_media=False)["ok"]


def test_each_distinct_embedded_image_is_decoded_once(packed, monkeypatch):
    """The demo packs embed 10 images in 26 image samples: validate decoded every copy (a corpus of
    a few hundred images in 20,000 rows validated a hundred times slower than it packed). Each
    distinct byte string is decoded once; a copy that differs is still decoded and judged."""
    import packtool.media as media
    import packtool.validate as validate

    decoded = []
    real = media.open_image
    monkeypatch.setattr(media, "open_image", lambda blob, *a, **k: (decoded.append(bytes(blob)), real(blob, *a, **k))[1])
    monkeypatch.setattr(validate, "_DECODED", {})
    manifest = json.loads((packed / ".packtool" / "manifest.json").read_text())
    blobs = [m["data"] for sh in manifest["shards"] for row in pq.read_table(packed / sh["file"])["media"].to_pylist()
             for m in row if m.get("data")]
    assert len(blobs) > len(set(blobs)) > 1
    assert validate_dir(packed)["ok"]
    assert sorted(decoded) == sorted(set(blobs))
    rewrite_row(packed, _cut_first_image)  # one copy cut short: decoded once more, and found
    report = validate_dir(packed)
    assert any("do not decode" in p["what"] for p in report["problems"])


def test_capacity_and_counts_are_checked(packed):
    manifest = json.loads((packed / ".packtool" / "manifest.json").read_text())
    manifest["capacities"]["max_tokens"] = 100
    manifest["counts"]["packs"] += 1
    (packed / ".packtool" / "manifest.json").write_text(json.dumps(manifest))
    report = validate_dir(packed, max_problems=50)
    whats = [p["what"] for p in report["problems"]]
    assert any("more than the pack capacity 100" in w for w in whats)


@pytest.mark.parametrize(("kind", "key"), [("tokenized", "max_tokens"), ("packed", "buffer_size"),
                                          ("packed", "max_tokens")])
def test_a_config_edited_in_the_manifest_is_caught(demo_dirs, tmp_path, kind, key):
    """A manifest whose config was changed by hand (max_tokens raised) passed validate: the
    recorded config_digest is recomputed from the recorded config."""
    from packtool.config import digest_of

    d = tmp_path / kind
    shutil.copytree(demo_dirs[kind], d)
    path = d / ".packtool" / "manifest.json"
    manifest = json.loads(path.read_text())
    # the digest is the sha256 of the config's canonical JSON (tokenize leaves out max_errors)
    config = {k: v for k, v in manifest["config"].items() if k != "max_errors"}
    assert manifest["config_digest"] == digest_of(config)
    old = manifest["config_digest"]
    manifest["config"][key] = 16384
    path.write_text(json.dumps(manifest))
    new = digest_of({k: v for k, v in manifest["config"].items() if k != "max_errors"})
    r = run("validate", str(d), "--no-check-media")
    assert r.returncode == 1
    lines = [f"  .packtool/manifest.json: config_digest {old} is not the digest of the config it records ({new}): the "
             "config was changed after the run wrote it; put the manifest back as written, or re-run the command that "
             "made the directory"]
    if kind == "packed" and key == "max_tokens":  # the capacities the shards were packed to no longer agree either
        lines.append("  .packtool/manifest.json: capacities.max_tokens 8192 differs from the config's max_tokens 16384 "
                     "(the manifest was changed after the run wrote it); put the manifest back as written, or re-run "
                     "the command that made the directory")
    assert r.stdout.splitlines()[1:] == lines
    assert r.stderr == f"Error: {d} is not whole: {len(lines)} problem(s) listed above\n"
    r = run("validate", str(d), "--no-check-media", "--json")
    report = json.loads(r.stdout)
    assert not report["ok"] and [p["where"] for p in report["problems"]] == [".packtool/manifest.json"] * len(lines)
    assert r.stderr == f"Error: {d} is not whole: {len(lines)} problem(s) listed in the JSON report on stdout\n"
    # max_errors changes no output byte: a tokenized config may record another one
    if kind == "tokenized":
        manifest["config"].update(max_tokens=None, max_errors=7)
        path.write_text(json.dumps(manifest))
        assert validate_dir(d, check_media=False)["ok"]


def test_capacities_edited_in_the_manifest_are_caught(packed):
    """stats and inspect measure fill against the manifest's capacities: raised by hand (the
    config and its digest left alone), they passed validate while stats showed a wrong fill."""
    path = packed / ".packtool" / "manifest.json"
    manifest = json.loads(path.read_text())
    assert manifest["capacities"] == {k: manifest["config"][k] for k in ("max_tokens", "max_vision_units")}
    manifest["capacities"]["max_tokens"] = 16384
    path.write_text(json.dumps(manifest))
    r = run("validate", str(packed), "--no-check-media")
    assert r.returncode == 1
    assert r.stdout.splitlines()[1:] == [
        "  .packtool/manifest.json: capacities.max_tokens 16384 differs from the config's max_tokens 8192 (the "
        "manifest was changed after the run wrote it); put the manifest back as written, or re-run the command that "
        "made the directory"]


def test_row_counts_and_errors_file_are_checked(packed):
    manifest = json.loads((packed / ".packtool" / "manifest.json").read_text())
    manifest["counts"]["packs"] += 1
    (packed / ".packtool" / "manifest.json").write_text(json.dumps(manifest))
    assert any("rows, the shards hold" in p["what"] for p in validate_dir(packed)["problems"])
    (packed / ".packtool" / "errors.jsonl").write_text('{"reason": "no_such_reason"}\n')
    assert any("unknown reason code" in p["what"] for p in validate_dir(packed)["problems"])


def test_an_errors_file_changed_at_its_size_is_found_by_its_sha256_and_merge_writes_it_again(demo_dirs, tmp_path):
    """The manifest records errors.jsonl's size and sha256: a row's message edited in place (same
    size, same line count and reasons) is found, and the fix named works."""
    sample = demo_dirs["sample"]
    src = tmp_path / "in.jsonl"
    src.write_text((sample / "data.jsonl").read_text() + "{broken\n")
    out = tmp_path / "tok"
    assert run("tokenize", str(src), "--media-root", str(sample), "-o", str(out), "-q", "--workers", "1").returncode == 0
    errors = out / ".packtool" / "errors.jsonl"
    whole = errors.read_bytes()
    errors.write_bytes(whole.replace(b"not valid JSON", b"not valid JSOM"))
    assert len(errors.read_bytes()) == len(whole) != errors.read_bytes()
    problems = validate_dir(out)["problems"]
    assert [p["where"] for p in problems] == [".packtool/errors.jsonl"]
    assert problems[0]["what"].startswith("sha256 ") and problems[0]["what"].endswith(
        "(the file changed after it was written); `packtool merge` on the directory writes it again from the tasks' "
        "error logs")
    assert run("merge", str(out)).returncode == 0
    assert errors.read_bytes() == whole and validate_dir(out)["ok"]


@pytest.mark.parametrize(("line", "what"), [
    (b"3\n", "a JSON int, not a rejected row (an object)"),
    (b'["bad_json"]\n', "a JSON list, not a rejected row (an object)"),
    (b'{"reason": "bad_json", "message": "caf\xe9"}\n', "not valid JSON"),  # Latin-1, not UTF-8
])
def test_errors_file_lines_that_are_no_rejected_rows_are_problems_not_a_crash(packed, line, what):
    (packed / ".packtool" / "errors.jsonl").write_bytes(line)
    r = run("validate", str(packed), "--json")
    assert r.returncode == 1 and r.stderr == f"Error: {packed} is not whole: 1 problem(s) listed in the JSON report on stdout\n"
    assert json.loads(r.stdout)["problems"] == [{"where": ".packtool/errors.jsonl: line 0", "what": what}]


@pytest.mark.parametrize("as_json", [False, True])
def test_qwen3_tokenizer_for_a_qwen2_directory_is_an_error_not_a_damaged_directory(demo_dirs, as_json):
    d = demo_dirs["packed"]
    r = run("validate", str(d), "--tokenizer", "qwen3", *(["--json"] if as_json else []))
    assert (r.returncode, r.stdout) == (1, "")  # no report: nothing was checked, so nothing is "not whole"
    assert r.stderr == ("Error: --tokenizer 'qwen3': 'qwen3' adds <tool_response>, </tool_response>, <think> and "
                        "</think> to the 'qwen2' vocabulary the directory was made with; pass --tokenizer qwen2 or "
                        "leave it out\n")
    assert run("validate", str(d), "--tokenizer", "qwen2").returncode == 0


def test_qwen2_tokenizer_for_a_qwen3_directory_names_the_tokens_it_lacks(demo_dirs, tmp_path):
    from packtool import TokenizeConfig, tokenize_dataset

    tok = tmp_path / "tok"
    tokenize_dataset([demo_dirs["sample"] / "data.jsonl"], tok, TokenizeConfig(media_root=str(demo_dirs["sample"]),
                                                                              tokenizer="qwen3"))
    r = run("validate", str(tok), "--tokenizer", "qwen2")
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr == ("Error: --tokenizer 'qwen2': 'qwen2' lacks <tool_response>, </tool_response>, <think> and "
                        "</think> of the 'qwen3' vocabulary the directory was made with; pass --tokenizer qwen3 or "
                        "leave it out\n")
    r = run("validate", str(tok), "--tokenizer", "qwen3")
    assert r.returncode == 0 and r.stdout.endswith(": OK\n"), r.stdout + r.stderr


def test_tokenizer_that_cannot_be_loaded_is_an_error_not_a_damaged_directory(demo_dirs, tmp_path):
    missing = tmp_path / "no-such-model"
    r = run("validate", str(demo_dirs["packed"]), "--json", "--tokenizer", str(missing))
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr == (f"Error: --tokenizer {str(missing)!r}: no tokenizer.json there; pass the file or a model "
                        "directory (the directory was made with 'qwen2': pass --tokenizer qwen2 or leave it out)\n")


def test_missing_manifest_is_a_problem_not_a_crash(tmp_path):
    """An unfinished run (its state, no manifest) is a finding of the report; a directory that
    holds no output at all is an error, with nothing checked (tests/test_cli.py)."""
    (tmp_path / ".packtool").mkdir()
    (tmp_path / ".packtool" / "run.json").write_text("{}")
    r = run("validate", str(tmp_path))
    assert r.returncode == 1
    assert "manifest.json" in r.stdout and "its run has not finished" in r.stdout and "Traceback" not in r.stderr


def test_schema_version_of_the_shards_is_checked(packed):
    f = shard(packed)
    table = pq.read_table(f)
    table = table.replace_schema_metadata({**table.schema.metadata, b"packtool.schema_version": b"0"})
    pq.write_table(table, f)
    manifest = json.loads((packed / ".packtool" / "manifest.json").read_text())
    manifest["shards"][0].update(bytes=f.stat().st_size, sha256=sha256_file(f))
    (packed / ".packtool" / "manifest.json").write_text(json.dumps(manifest))
    report = validate_dir(packed)
    assert [p["what"] for p in report["problems"]] == ["written with schema version '0', this packtool reads 2, 3, 4, 5, 6 or 7"]
    manifest["schema_version"] = 0
    (packed / ".packtool" / "manifest.json").write_text(json.dumps(manifest))
    assert "schema version 0" in validate_dir(packed)["problems"][0]["what"]


def _first_run(row) -> int:
    lengths = row["run_lengths"]
    assert lengths, "the demo's first pack holds image spans, stored as runs"
    return 0


@pytest.mark.parametrize("edit, what", [
    (lambda row: row["run_starts"].__setitem__(0, len(row["compact_input_ids"]) + 3), "outside the compact row"),
    (lambda row: row["run_starts"].insert(1, row["run_starts"][0]) or row["run_lengths"].insert(1, MIN_RUN),
     "not after the run before it"),
    (lambda row: row["run_lengths"].pop(), "run_starts_i32le has"),
    (lambda row: row["run_lengths"].__setitem__(0, MIN_RUN - 1), f"fewer than {MIN_RUN}"),
])
def test_bad_run_tables_are_caught(packed, edit, what):
    def change(row):
        _first_run(row)
        edit(row)

    rewrite_runs(packed, change)
    report = validate_dir(packed)
    assert not report["ok"]
    assert report["problems"][0]["where"].endswith(": row 0") and what in report["problems"][0]["what"], report


def test_runs_not_in_canonical_form_are_caught(packed):
    """A run stored as two (same expanded row, other bytes) breaks determinism: reported."""
    def split(row):
        k = _first_run(row)
        start, n = row["run_starts"][k], row["run_lengths"][k]
        half = n // 2
        for name in ("compact_input_ids", "compact_target_ids", "compact_subsegment_ids"):
            row[name].insert(start + 1, row[name][start])
        row["compact_position_ids"].insert(start + 1, row["compact_position_ids"][start] + half)
        row["run_starts"][k + 1:] = [s + 1 for s in row["run_starts"][k + 1:]]
        row["run_starts"].insert(k + 1, start + 1)
        row["run_lengths"][k:k + 1] = [half, n - half]

    before = expand_table(pq.read_table(shard(packed))).slice(0, 1).to_pylist()
    rewrite_runs(packed, split)
    assert expand_table(pq.read_table(shard(packed))).slice(0, 1).to_pylist() == before  # the same tokens
    report = validate_dir(packed)
    assert [p["what"] for p in report["problems"]][:1] == [
        "compact_input_ids_i32le is not in canonical runs form (a run is split or not stored as one)"], report


@pytest.mark.parametrize("column, edit, what", [
    # a blob cut short by 3 bytes, or one with a byte more: no longer whole int32 values
    (RUN_COLUMNS[1], lambda b: b[:-3], "run_lengths_i32le holds {n} bytes, not whole int32 values (a multiple of 4)"),
    (COMPACT_COLUMNS[2], lambda b: b + b"\x01",
     "compact_position_ids_i32le holds {n} bytes, not whole int32 values (a multiple of 4)"),
    # one whole value gone from one compact column: the four no longer have one length
    (COMPACT_COLUMNS[1], lambda b: b[:-4], "compact_target_ids_i32next holds {v} values, compact_input_ids_i32le {m}"),
])
def test_corrupted_blobs_are_caught(packed, column, edit, what):
    """A stored blob that is not whole int32 values, or compact columns of unequal lengths,
    is one clear problem line for its row (the row is not expanded)."""
    seen = {}

    def change(row):
        row[column] = edit(row[column])
        seen.update(n=len(row[column]), v=len(row[column]) // 4, m=len(row[COMPACT_COLUMNS[0]]) // 4)

    rewrite_runs(packed, change, as_lists=False)
    report = validate_dir(packed)
    assert not report["ok"]
    assert [(p["where"].rsplit(": ", 1)[-1], p["what"]) for p in report["problems"]] == [("row 0", what.format(**seen))]


def test_a_directory_of_schema_version_3_validates(packed):
    """Shards in the list form of the runs layout (schema v3, as older packtool wrote them) are
    read by their own version's rules; a shard of one runs version listed as the other is a
    clear problem."""
    f = shard(packed)
    manifest = json.loads((packed / ".packtool" / "manifest.json").read_text())
    for entry in manifest["shards"]:
        g = packed / entry["file"]
        pq.write_table(list_form(pq.read_table(g)).cast(PACKED_V3), g)
        relist(packed, g)
    assert validate_dir(packed)["problems"][0] == {"where": f.name, "what": "written with schema version 3, the manifest says 6"}
    manifest = json.loads((packed / ".packtool" / "manifest.json").read_text())
    manifest["schema_version"] = 3
    (packed / ".packtool" / "manifest.json").write_text(json.dumps(manifest))
    report = validate_dir(packed)
    assert report["ok"] and report["problems"] == [], report["problems"]
    assert report["rows"] == sum(e["rows"] for e in manifest["shards"]) > 0
    # a v6 shard among them, listed as version 3: named, with both versions
    pq.write_table(blob_table(pq.read_table(f)).cast(PACKED), f)
    relist(packed, f)
    assert validate_dir(packed)["problems"][0] == {"where": f.name, "what": "written with schema version 6, the manifest says 3"}


def test_a_blob_column_must_say_its_encoding(packed):
    f = shard(packed)
    table = pq.read_table(f)
    i = table.schema.get_field_index(COMPACT_COLUMNS[0])
    table = table.cast(table.schema.set(i, table.schema.field(i).remove_metadata()))
    pq.write_table(table, f)
    relist(packed, f)
    what = [p["what"] for p in validate_dir(packed)["problems"]]
    assert what[:1] == ["columns ['compact_input_ids_i32le'] do not say 'packtool.encoding: int32-le' in their field "
                        "metadata; not a shard of this version"], what


# Every family's media spans, as its own layout builder lays them out: Qwen2.5-VL and
# LLaVA-OneVision one pad run; Qwen3-VL videos a pad run per temporal patch with timestamp
# text and vision markers between; Molmo2 rows of patches closed by column tokens and a
# low-res crop before the tiles; InternVL videos a tile per frame with frame labels.
FAMILIES = ["internvl", "llava-ov", "molmo2", "qwen2.5-vl", "qwen3-vl"]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict:
    """Per family (built on first use): its tokenized directory and both packed layouts of the
    shared corpus (text, single and multi-image samples, a video, a tree)."""
    from hf_harness import FAMILY_SETTINGS, FAMILY_SPECIALS, byte_tokenizer, standard_corpus

    from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset

    base = tmp_path_factory.mktemp("families")
    (base / "corpus").mkdir()
    (base / "tok").mkdir()
    corpus, vocab = standard_corpus(base / "corpus"), byte_tokenizer(base / "tok", FAMILY_SPECIALS)
    built: dict = {}

    class Dirs:
        """``dirs(family)``: its directories; ``dirs.vocab``: the tokenizer.json they share."""

        def __call__(self, family: str) -> dict:
            return get(family)

    Dirs.vocab = vocab

    def get(family: str) -> dict:
        if family not in built:
            d = base / family
            tokenize_dataset(corpus["inputs"], d / "tokenized", TokenizeConfig(
                media_root=str(corpus["root"]), model=family, tokenizer=str(vocab), **FAMILY_SETTINGS[family]))
            for layout in ("runs", "full"):
                pack_dataset(d / "tokenized", d / layout, PackConfig(max_tokens=4096, layout=layout))
            built[family] = {k: d / k for k in ("tokenized", "runs", "full")}
        return built[family]

    return Dirs()


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_validates_clean(family_dirs, family):
    for kind, d in family_dirs(family).items():
        r = run("validate", str(d), "--json")
        report = json.loads(r.stdout)
        assert (r.returncode, report["ok"], report["problems"]) == (0, True, []), (family, kind, r.stderr)
        assert report["rows"] > 0 and report["kind"] == ("tokenized" if kind == "tokenized" else "packed")


def _first_span(d: Path, kind: str) -> tuple[int, int, int, int]:
    """``(shard, row, media index, token)`` of the first ``kind`` media span in packed ``d``; the
    token is the middle one of the span's marker tokens (row, column or frame markers) when
    it has some, else its middle placeholder."""
    manifest = json.loads((d / ".packtool" / "manifest.json").read_text())
    for s, entry in enumerate(manifest["shards"]):
        rows = expand_table(pq.read_table(d / entry["file"])).to_pylist()
        for r, row in enumerate(rows):
            for j, m in enumerate(row["media"]):
                if m["kind"] == kind:
                    span = row["input_ids"][m["token_offset"]:m["token_offset"] + m["n_tokens"]]
                    inside = [t for t, x in enumerate(span) if x != span[0] and x >= 256]  # byte vocabulary: specials
                    return s, r, j, m["token_offset"] + (inside[len(inside) // 2] if inside else len(span) // 2)
    raise AssertionError(f"no {kind} in {d}")


def _damage(d: Path, media: str, layout: str) -> dict:
    """Change one id in the first ``media`` span of packed ``d`` (see :func:`_first_span`), re-list
    the shard; returns where: ``file``, ``row``, ``j``, ``offset``, ``n``, ``token`` and ``new`` id."""
    s, r, j, t = _first_span(d, media)
    manifest = json.loads((d / ".packtool" / "manifest.json").read_text())
    f = d / manifest["shards"][s]["file"]
    rows = expand_table(pq.read_table(f)).to_pylist()
    ids = rows[r]["input_ids"]
    new = next(x for x in range(ids[t] + 1, ids[t] + 4) if x not in ids[t - 1:t + 2])
    ids[t] = new
    table = pa.Table.from_pylist(rows, schema=PACKED_FULL)
    pq.write_table(compact_table(table).cast(PACKED) if layout == "runs" else table, f)
    relist(d, f)
    m = rows[r]["media"][j]
    return dict(file=f.name, row=r, j=j, offset=m["token_offset"], n=m["n_tokens"], token=t, new=new)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["runs", "full"])
@pytest.mark.parametrize("family,media", [(f, k) for f in FAMILIES for k in ("image", "video")])
def test_one_changed_id_in_a_span_is_caught(family_dirs, tmp_path, family, media, layout):
    d = tmp_path / "packed"
    shutil.copytree(family_dirs(family)[layout], d)
    at = _damage(d, media, layout)
    r = run("validate", str(d), "--json", "--tokenizer", str(family_dirs.vocab))
    report = json.loads(r.stdout)
    assert (r.returncode, report["ok"]) == (1, False), report
    assert "is not whole: 1 problem(s)" in r.stderr
    [problem] = report["problems"]
    assert problem["where"] == f"{at['file']}: row {at['row']}"
    assert problem["what"].startswith(
        f"media {at['j']}: {media} span {at['offset']}..{at['offset'] + at['n']} is not the {family} placeholder "
        f"layout: token {at['token'] - at['offset']} is {at['new']}, the layout puts "), problem


@pytest.mark.slow
def test_changed_marker_is_caught_without_the_tokenizer(family_dirs, tmp_path):
    """Without ``--tokenizer`` the ids are learnt from the spans themselves; a Molmo2 image's
    column token changed in one of its rows disagrees with the others."""
    family = "molmo2"
    d = tmp_path / "packed"
    shutil.copytree(family_dirs(family)["runs"], d)
    at = _damage(d, "image", "runs")
    report = validate_dir(d)
    assert not report["ok"]
    assert [p["where"] for p in report["problems"]] == [f"{at['file']}: row {at['row']}"], report["problems"]
    assert f"is not the {family} placeholder layout" in report["problems"][0]["what"]


def test_tokenizer_of_another_vocabulary_is_refused(family_dirs):
    """A --tokenizer of another vocabulary is a mistake in the command: an error before anything
    is checked, not a problem of the directory."""
    from packtool.errors import ConfigError
    from packtool.tokenization import load_tokenizer

    d = family_dirs("qwen2.5-vl")["runs"]
    recorded = json.loads((d / ".packtool" / "manifest.json").read_text())["tokenizer"]
    mine = load_tokenizer("qwen2").identity()["vocab_sha256"]
    want = (f"--tokenizer 'qwen2': 'qwen2' is another vocabulary than the {recorded['name']!r} the directory was made "
            f"with (sha256 {mine[:12]}… against {recorded['vocab_sha256'][:12]}…); pass the tokenizer it was made "
            f"with (recorded as {recorded['name']!r}) or leave it out")
    with pytest.raises(ConfigError) as exc:
        validate_dir(d, tokenizer="qwen2")
    assert str(exc.value) == want
    r = run("validate", str(d), "--json", "--tokenizer", "qwen2")
    assert (r.returncode, r.stdout, r.stderr) == (1, "", f"Error: {want}\n")
    assert validate_dir(d, tokenizer=str(family_dirs.vocab))["ok"]


@pytest.mark.slow
def test_changed_timestamp_text_in_a_qwen3_video_is_caught(family_dirs, tmp_path):
    d = tmp_path / "packed"
    shutil.copytree(family_dirs("qwen3-vl")["full"], d)
    s, r, j, _ = _first_span(d, "video")
    f = d / json.loads((d / ".packtool" / "manifest.json").read_text())["shards"][s]["file"]

    def edit(row):
        m = row["media"][j]
        span = row["input_ids"][m["token_offset"]:m["token_offset"] + m["n_tokens"]]
        t = m["token_offset"] + next(k for k, x in enumerate(span) if x < 256)  # the first timestamp byte
        row["input_ids"][t] = ord("7") if row["input_ids"][t] != ord("7") else ord("8")

    rows = pq.read_table(f).to_pylist()
    edit(rows[r])
    pq.write_table(pa.Table.from_pylist(rows, schema=PACKED_FULL), f)
    relist(d, f)
    [problem] = validate_dir(d, tokenizer=str(family_dirs.vocab))["problems"]
    assert "is not the qwen3-vl placeholder layout: text '<" in problem["what"] and "seconds>'" in problem["what"]
    assert "it encodes as" in problem["what"]


@pytest.mark.parametrize("field,change,what", [("grid_h", 2, "recorded grid"), ("width", -10**6, "cannot be rebuilt")])
def test_media_record_that_the_family_would_not_lay_out_is_caught(packed, field, change, what):
    def edit(row):
        row["media"][0][field] += change

    rewrite_row(packed, edit)
    report = validate_dir(packed)
    assert any("media 0: image span" in p["what"] and what in p["what"] for p in report["problems"]), report["problems"]


@pytest.mark.parametrize("n_frames,fps", [(20, 10.0), (7, 3.0), (91, 29.97), (5, 1.0)])
def test_qwen3_video_segments_from_recorded_times_match_the_processor_times(n_frames, fps):
    """``video_segments`` rebuilds Qwen3-VL's timestamp text from the recorded frame times; it must
    equal the text from the frame indices (:func:`frame_pair_times`), odd frame counts included."""
    from packtool.vision import VideoMeta, get_family
    from packtool.vision.qwen3 import frame_pair_times

    fam = get_family("qwen3-vl")
    lay = fam.video(VideoMeta(64, 48, n_frames / fps, fps, n_frames))
    idx = [round(t * fps) for t in lay.timestamps]
    want = [f"<{t:.1f} seconds>" for t in frame_pair_times(idx, fps)]
    assert [v for k, v, _ in fam.video_segments(lay.grid, lay.timestamps) if k == "text"] == want
    assert len(want) == lay.grid[0]


def test_video_source_fields_are_checked():
    """``source_fps`` / ``source_frames`` (schema version 6): a video's pair, or nulls (packed from
    version 5); set on an image, one without the other, or a rate no video has, is named."""
    from packtool.validate import _source_problem

    video = {"kind": "video", "timestamps": [0.0, 0.5, 0.9, 1.4]}
    assert _source_problem({**video, "source_fps": 10.0, "source_frames": 15}) is None
    assert _source_problem({**video, "source_fps": None, "source_frames": None}) is None
    assert _source_problem(video) is None  # a shard of version 5 or older has no such fields
    assert "only videos record them" in _source_problem({"kind": "image", "source_fps": 10.0, "source_frames": 15})
    assert "one without the other" in _source_problem({**video, "source_fps": 10.0, "source_frames": None})
    assert "no video has them" in _source_problem({**video, "source_fps": 0.0, "source_frames": 15})
    assert "no video has them" in _source_problem({**video, "source_fps": float("nan"), "source_frames": 15})


def _chat(i: int, image: str, *turns: str) -> dict:
    convs = [{"from": "human" if k % 2 == 0 else "gpt", "value": ("<image>\n" if k == 0 else "") + t}
             for k, t in enumerate(turns)]
    return {"id": f"r{i}", "image": image, "conversations": convs}


@pytest.fixture()
def folded(tmp_path) -> Path:
    """A tokenized directory whose message trees fold two conversations into their shared prefix:
    on a.png, r0 is a prefix of r1 and r2 (which repeat each other); on b.png, r4 repeats r3.
    Its rows store 3 branches (n_branches 2 and 1), its counts say branches 3, folded_branches 2."""
    from PIL import Image

    Image.new("RGB", (84, 56), (200, 10, 10)).save(tmp_path / "a.png")
    Image.new("RGB", (56, 56), (10, 10, 200)).save(tmp_path / "b.png")
    records = [_chat(0, "a.png", "What colour?", "Red."), _chat(1, "a.png", "What colour?", "Red.", "Shape?", "Oblong."),
               _chat(2, "a.png", "What colour?", "Red.", "Shape?", "Oblong."), _chat(3, "b.png", "Colour?", "Blue."),
               _chat(4, "b.png", "Colour?", "Blue.")]
    src = tmp_path / "f.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "tok"
    r = run("tokenize", str(src), "--media-root", str(tmp_path), "-o", str(out), "--group-by-media", "-q",
            "--workers", "1")
    assert r.returncode == 0, r.stderr
    counts = json.loads((out / ".packtool" / "manifest.json").read_text())["counts"]
    assert (counts["branches"], counts["folded_branches"]) == (3, 2)
    return out


def edit_counts(d: Path, **changes) -> None:
    """Change the manifest's counts (None: remove the count); the config digest does not cover them."""
    f = d / ".packtool" / "manifest.json"
    manifest = json.loads(f.read_text())
    for k, v in changes.items():
        if v is None:
            manifest["counts"].pop(k)
        else:
            manifest["counts"][k] = v
    f.write_text(json.dumps(manifest, indent=2) + "\n")


def test_branches_are_checked_against_the_shards_n_branches(folded):
    """counts.branches is the sum of the rows' n_branches: validate did not check it, so a
    manifest whose branches the rows do not hold passed. Now it reads that one column of each
    shard and reports a difference as it reports the row counts, in text and in --json."""
    assert run("validate", str(folded)).returncode == 0
    edit_counts(folded, branches=5)  # what the rows held with the folded ones counted too
    r = run("validate", str(folded), "--json")
    assert r.returncode == 1
    report = json.loads(r.stdout)
    assert (report["ok"], report["shards"]) == (False, 1)
    assert report["problems"] == [{"where": ".packtool/manifest.json",
                                   "what": "counts say 5 branches, the shards' n_branches add up to 3"}]
    r = run("validate", str(folded))
    assert r.returncode == 1
    assert "  .packtool/manifest.json: counts say 5 branches, the shards' n_branches add up to 3\n" in r.stdout
    # files only (no row checks): the column is still read
    assert validate_dir(folded, check_rows=False)["problems"] == report["problems"]


def test_a_manifest_from_before_folded_branches_is_not_failed_for_its_branches(folded):
    """A manifest written before folded_branches existed counted every conversation of a tree as a
    branch, those folded into its shared prefix too: branches 5 where the rows store 3 (what the
    packtool before the change wrote for this corpus). Such an output is whole, and passes; the
    count is checked only in a manifest that has folded_branches."""
    edit_counts(folded, branches=5, folded_branches=None)
    r = run("validate", str(folded), "--json")
    assert (r.returncode, json.loads(r.stdout)["problems"]) == (0, [])


def test_a_run_resumed_over_tasks_of_an_older_packtool_is_not_failed_for_its_branches(folded):
    """A tokenize run resumed after an upgrade keeps the tasks an older packtool finished, whose
    markers count folded conversations in branches and have no folded_branches: the merged manifest
    had folded_branches (0, from the new tasks only) beside such a branches, and validate failed a
    whole output. The merge now leaves folded_branches out when any task lacks it."""
    marker = folded / ".packtool" / "task-00000.json"
    record = json.loads(marker.read_text())
    record["counts"]["branches"] += record["counts"].pop("folded_branches")  # as the older packtool wrote it
    marker.write_text(json.dumps(record))
    (folded / ".packtool" / "manifest.json").unlink()
    assert run("merge", str(folded)).returncode == 0
    counts = json.loads((folded / ".packtool" / "manifest.json").read_text())["counts"]
    assert counts["branches"] == 5 and "folded_branches" not in counts
    r = run("validate", str(folded), "--json")
    assert (r.returncode, json.loads(r.stdout)["problems"]) == (0, [])
