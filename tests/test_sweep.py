"""`packtool sweep` and `pack --dry-run`: plans for a grid of settings, checked against real packs."""

from __future__ import annotations

import json
import subprocess

import pyarrow.parquet as pq
import pytest
from clirun import packtool

from packtool import PackConfig, pack_dataset


def run(*args: str) -> subprocess.CompletedProcess:
    return packtool(*args)  # in this process (tests/clirun.py): what a command prints and writes


def _packs(d):
    manifest = json.loads((d / ".packtool" / "manifest.json").read_text())
    return [r for s in manifest["shards"] for r in pq.read_table(d / s["file"], columns=["n_tokens", "n_vision_units"]).to_pylist()]


def test_sweep_grid_matches_real_packs(demo_dirs, tmp_path):
    r = run("sweep", str(demo_dirs["tokenized"]), "--buffer-size", "4,64", "--max-tokens", "4096,8192",
            "--vision-weight", "0,30", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(x["max_tokens"], x["buffer_size"], x["vision_weight"]) for x in rows] == [
        (t, b, w) for t in (4096, 8192) for b in (4, 64) for w in (0, 30)]
    # two settings written for real: the sweep's packs and fill are what pack produces
    for i in (1, 6):
        row = rows[i]
        out = tmp_path / f"p{i}"
        pack_dataset(demo_dirs["tokenized"], out, PackConfig(max_tokens=row["max_tokens"], buffer_size=row["buffer_size"],
                                                             vision_weight=row["vision_weight"]))
        packs = _packs(out)
        assert row["packs"] == len(packs)
        fill = sum(p["n_tokens"] / row["max_tokens"] for p in packs) / len(packs)
        assert abs(row["token_fill_mean"] - fill) < 1e-4
    for row in rows:
        assert row["packs"] >= row["lower_bound"] >= 1
        if row["max_tokens"] == 4096:
            assert row["dropped"] > 0  # the 4,230-token demo sample cannot fit
    assert all(x["buffer_size"] in (4, 64) for x in rows)


def test_sweep_table(demo_dirs):
    r = run("sweep", str(demo_dirs["tokenized"]), "--max-tokens", "8192", "--buffer-size", "8,32")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["max-tokens", "buffer-size", "vision-weight", "max-vision-units", "packs", "bound",
                                "vs", "bound", "fill", "fill", "p5", "vision", "fill", "per", "pack", "dropped", "rejected"]
    assert len(lines) == 3 and lines[1].split()[:3] == ["8,192", "8", "0"]


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--buffer-size", "8,x", "'8,x': give comma-separated integers, e.g. 48,256"),
    ("--max-tokens", "abc", "'abc': give comma-separated integers, e.g. 8192,16384"),
    ("--max-tokens", "8192,", "'8192,' has an empty item; give comma-separated integers, e.g. 8192,16384"),
    ("--vision-weight", "0,,30", "'0,,30' has an empty item; give comma-separated integers, e.g. 0,30"),
    ("--max-vision-units", "", "give at least one integer, e.g. 64,128"),
    # one value is worded as typer words it for pack --max-tokens 0
    ("--max-tokens", "0", "Input should be greater than or equal to 1"),
    ("--buffer-size", "8,0", "0 in '8,0' should be greater than or equal to 1"),
    ("--max-vision-units", "64,3000000000", "3000000000 in '64,3000000000' should be less than or equal to 2147483647"),
    ("--vision-weight", "-1", "Input should be greater than or equal to 0"),
], ids=["not-int", "abc", "trailing-comma", "empty-item", "empty", "zero", "zero-in-list", "above-int32", "negative"])
def test_a_bad_list_value_is_a_usage_error_as_it_is_for_pack(demo_dirs, flag, value, message):
    r = run("sweep", str(demo_dirs["tokenized"]), flag, value)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.startswith("Usage: packtool sweep ")
    assert r.stderr.endswith(f"\n\nError: Invalid value for '{flag}': {message}\n"), r.stderr


def test_a_granularity_above_a_max_tokens_is_a_usage_error_before_anything_is_planned(demo_dirs, tmp_path, monkeypatch):
    """It planned every cell before it (and pack ran its tasks) to fail with exit 1."""
    import packtool.pipeline as pipeline

    planned = []
    real = pipeline.pack_dataset
    monkeypatch.setattr(pipeline, "pack_dataset", lambda *a, **k: planned.append(a[3] if len(a) > 3 else k) or real(*a, **k))
    want = "--token-granularity 2048 exceeds --max-tokens 1024; lower the granularity"
    r = run("sweep", str(demo_dirs["tokenized"]), "--max-tokens", "16384,1024", "--token-granularity", "2048")
    assert (r.returncode, r.stdout, planned) == (2, "", []) and r.stderr.endswith(f"Error: {want}\n"), r.stderr
    r = run("pack", str(demo_dirs["tokenized"]), "-o", str(tmp_path / "p"), "--max-tokens", "1024",
            "--token-granularity", "2048")
    assert r.returncode == 2 and r.stderr.endswith(f"Error: {want}\n") and not (tmp_path / "p").exists(), r.stderr


def test_a_value_given_twice_is_planned_once(demo_dirs):
    r = run("sweep", str(demo_dirs["tokenized"]), "--max-tokens", "8192,4096,8192", "--buffer-size", "8,8", "--json")
    assert r.returncode == 0, r.stderr
    assert [(x["max_tokens"], x["buffer_size"]) for x in json.loads(r.stdout)] == [(8192, 8), (4096, 8)]


def test_pack_dry_run_prints_the_stats_of_the_plan(demo_dirs, tmp_path):
    r = run("pack", str(demo_dirs["tokenized"]), "--dry-run", "--max-tokens", "8192", "-q")
    assert r.returncode == 0, r.stderr
    assert "planned (dry run)" in r.stdout and "token fill" in r.stdout and "padding, batch 8" in r.stdout
    r = run("pack", str(demo_dirs["tokenized"]), "--dry-run", "--max-tokens", "8192", "-q", "--json")
    out = json.loads(r.stdout)
    assert out["dry_run"] is True and out["stats"]["kind"] == "plan"
    written = run("stats", str(demo_dirs["packed"]), "--json")
    s = json.loads(written.stdout)
    for key in ("packs", "token_fill", "vision_fill", "samples_per_pack", "padding"):
        assert out["stats"][key] == s[key], key
    assert not any(tmp_path.iterdir())


def test_sweep_counts_the_samples_truncate_rejects_as_the_pack_does(tmp_path):
    """--oversize truncate rejects a sample whose cut keeps no target (no_loss): sweep showed
    dropped 0 for a setting whose pack loses half the samples. Its rejected column counts them,
    as pack --dry-run, the written pack and stats of it do."""
    rows = [{"id": f"t{i}", "conversations": [{"from": "human", "value": "word " * 80 if i % 2 == 0 else "hi"},
                                              {"from": "gpt", "value": "ok." if i % 2 == 0 else "answer " * 80}]}
            for i in range(6)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok, out = tmp_path / "tok", tmp_path / "packed"
    assert run("tokenize", str(tmp_path / "t.jsonl"), "-o", str(tok), "-q").returncode == 0
    flags = ("--max-tokens", "64", "--oversize", "truncate")
    r = run("sweep", str(tok), *flags, "--json")
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)
    assert (row["packs"], row["dropped"], row["rejected"]) == (3, 0, 3)
    dry = json.loads(run("pack", str(tok), "--dry-run", *flags, "-q", "--json").stdout)
    assert (dry["rejected"], dry["rejected_by_reason"]) == (3, {"no_loss": 3})
    assert run("pack", str(tok), "-o", str(out), *flags, "-q").returncode == 0
    s = json.loads(run("stats", str(out), "--json").stdout)
    assert (s["packs"], sum(s["rejected"]["pack"].values())) == (row["packs"], row["rejected"])
    assert s["samples"] + row["rejected"] == len(rows)
    table = run("sweep", str(tok), *flags).stdout.splitlines()
    assert table[0].split()[-2:] == ["dropped", "rejected"] and table[1].split()[-2:] == ["0", "3"]
