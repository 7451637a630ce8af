"""The scale and safety flags as a user meets them on the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "packtool", *args], capture_output=True, text=True)


@pytest.fixture()
def corpus(demo_dirs, tmp_path) -> tuple[Path, Path]:
    """The demo corpus with one broken line appended (31 rows)."""
    sample = demo_dirs["sample"]
    src = tmp_path / "in.jsonl"
    src.write_text((sample / "data.jsonl").read_text() + "{broken\n")
    return src, sample


def test_ranks_then_merge(corpus, tmp_path):
    src, sample = corpus
    out = tmp_path / "tok"
    base = ["tokenize", str(src), "--media-root", str(sample), "-o", str(out), "--rows-per-shard", "8", "--quiet",
            "--world-size", "2"]
    r = run(*base, "--rank", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout == (f"rank 0 of 2: 2 tasks done, 2 tasks of other ranks remain; when all are done run: "
                        f"packtool merge {out}\n")
    r = run("merge", str(out))
    assert r.returncode == 1
    assert r.stderr == (f"Error: {str(out)!r}: 2 of 4 tasks are not finished (first: [1, 3]); run rank 1 of "
                        "--world-size 2 (the same command resumes) and merge again\n")
    r = run(*base, "--rank", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("30 samples from 31 rows in 4 shards")
    r = run("merge", str(out))
    assert (r.returncode, r.stdout) == (0, f"tokenized: 4 tasks, 4 shards -> {out / '.packtool' / 'manifest.json'}\n")
    assert json.loads((out / ".packtool" / "manifest.json").read_text())["counts"]["rejected_by_reason"] == {"bad_json": 1}


def test_on_error_fail_and_max_errors_exit_1_with_the_row(corpus, tmp_path):
    src, sample = corpus
    common = [str(src), "--media-root", str(sample), "--quiet"]
    r = run("tokenize", *common, "-o", str(tmp_path / "a"), "--on-error", "fail")
    assert r.returncode == 1
    assert r.stderr.startswith(f"Error: {src}:30 rejected, bad_json: line is not valid JSON")
    assert "--on-error fail stops at the first rejected row" in r.stderr
    assert not (tmp_path / "a" / ".packtool" / "manifest.json").exists()
    r = run("tokenize", *common, "-o", str(tmp_path / "b"), "--max-errors", "0")
    assert r.returncode == 1
    assert r.stderr.startswith("Error: 1 input rows rejected, more than --max-errors 0")
    r = run("tokenize", *common, "-o", str(tmp_path / "b"), "--max-errors", "1", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["rejected"] == 1


@pytest.mark.parametrize(("flags", "message"), [
    (["--rank", "2", "--world-size", "2"], "Error: --rank 2 is outside 0..1"),
    (["--executor", "spark"], "Error: --executor 'spark': choose local or ray"),
    (["--on-error", "ignore"], "Error: --on-error 'ignore': choose skip or fail"),
])
def test_bad_flags_name_the_fix(corpus, tmp_path, flags, message):
    src, sample = corpus
    r = run("tokenize", str(src), "--media-root", str(sample), "-o", str(tmp_path / "t"), "--quiet", *flags)
    assert r.returncode == 1 and r.stderr.startswith(message), r.stderr


def test_resume_refusal_names_the_setting(demo_dirs, tmp_path):
    out = tmp_path / "packed"
    assert run("pack", str(demo_dirs["tokenized"]), "-o", str(out), "--quiet", "--workers", "1").returncode == 0
    r = run("pack", str(demo_dirs["tokenized"]), "-o", str(out), "--quiet", "--max-tokens", "4096")
    assert r.returncode == 1
    assert "already holds a finished run with a different configuration (max_tokens: 16384 -> 4096)" in r.stderr
    assert "--overwrite" in r.stderr
    r = run("pack", str(demo_dirs["tokenized"]), "-o", str(out), "--quiet", "--max-tokens", "4096", "--overwrite")
    assert r.returncode == 0, r.stderr
    assert run("validate", str(out)).returncode == 0
