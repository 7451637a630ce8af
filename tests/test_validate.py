"""``packtool validate`` passes whole directories and catches damage of every layer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packtool.runs import MIN_RUN, compact_table, expand_table
from packtool.schema import PACKED, PACKED_FULL
from packtool.shards import sha256_file
from packtool.validate import validate_dir


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "packtool", *args], capture_output=True, text=True)


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


def rewrite_runs(d: Path, edit) -> None:
    """Replace the first shard by one whose stored (compact) row 0 is edited, re-listed."""
    f = shard(d)
    rows = pq.read_table(f).to_pylist()
    edit(rows[0])
    pq.write_table(pa.Table.from_pylist(rows, schema=PACKED), f)
    relist(d, f)


def relist(d: Path, f: Path) -> None:
    manifest = json.loads((d / ".packtool" / "manifest.json").read_text())
    manifest["shards"][0].update(bytes=f.stat().st_size, sha256=sha256_file(f))
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


def test_media_span_off_its_placeholders_is_caught(packed):
    def edit(row):
        row["media"][0]["token_offset"] -= 1  # now starts on <|vision_start|>

    rewrite_row(packed, edit)
    report = validate_dir(packed)
    assert any("not one repeated placeholder token" in p["what"] for p in report["problems"])


def test_corrupt_embedded_image_is_caught(packed):
    def edit(row):
        data = row["media"][0]["data"]
        row["media"][0]["data"] = data[: len(data) // 2]

    rewrite_row(packed, edit)
    report = validate_dir(packed)
    assert any("do not decode" in p["what"] for p in report["problems"])
    assert validate_dir(packed, check_media=False)["ok"]


def test_capacity_and_counts_are_checked(packed):
    manifest = json.loads((packed / ".packtool" / "manifest.json").read_text())
    manifest["capacities"]["max_tokens"] = 100
    manifest["counts"]["packs"] += 1
    (packed / ".packtool" / "manifest.json").write_text(json.dumps(manifest))
    report = validate_dir(packed, max_problems=50)
    whats = [p["what"] for p in report["problems"]]
    assert any("more than the pack capacity 100" in w for w in whats)


def test_row_counts_and_errors_file_are_checked(packed):
    manifest = json.loads((packed / ".packtool" / "manifest.json").read_text())
    manifest["counts"]["packs"] += 1
    (packed / ".packtool" / "manifest.json").write_text(json.dumps(manifest))
    assert any("rows, the shards hold" in p["what"] for p in validate_dir(packed)["problems"])
    (packed / ".packtool" / "errors.jsonl").write_text('{"reason": "no_such_reason"}\n')
    assert any("unknown reason code" in p["what"] for p in validate_dir(packed)["problems"])


def test_missing_manifest_is_a_problem_not_a_crash(tmp_path):
    r = run("validate", str(tmp_path))
    assert r.returncode == 1
    assert "manifest.json" in r.stdout and "Traceback" not in r.stderr


def test_schema_version_of_the_shards_is_checked(packed):
    f = shard(packed)
    table = pq.read_table(f)
    table = table.replace_schema_metadata({**table.schema.metadata, b"packtool.schema_version": b"0"})
    pq.write_table(table, f)
    manifest = json.loads((packed / ".packtool" / "manifest.json").read_text())
    manifest["shards"][0].update(bytes=f.stat().st_size, sha256=sha256_file(f))
    (packed / ".packtool" / "manifest.json").write_text(json.dumps(manifest))
    report = validate_dir(packed)
    assert [p["what"] for p in report["problems"]] == ["written with schema version '0', this packtool reads 2 or 3"]
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
    (lambda row: row["run_lengths"].pop(), "run_starts has"),
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
        "compact_input_ids is not in canonical runs form (a run is split or not stored as one)"], report
