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

from packtool.schema import PACKED
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
    rows = pq.read_table(f).to_pylist()
    edit(rows[0])
    pq.write_table(pa.Table.from_pylist(rows, schema=PACKED), f)
    manifest = json.loads((d / ".packtool" / "manifest.json").read_text())
    manifest["shards"][0].update(bytes=f.stat().st_size, sha256=sha256_file(f))
    (d / ".packtool" / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("kind", ["tokenized", "packed"])
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
    assert [p["what"] for p in report["problems"]] == ["written with schema version '0', this packtool reads 2"]
    manifest["schema_version"] = 0
    (packed / ".packtool" / "manifest.json").write_text(json.dumps(manifest))
    assert "schema version 0" in validate_dir(packed)["problems"][0]["what"]
