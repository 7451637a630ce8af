"""A hostile user's inputs and faults (issue 13): exit codes that tell the truth, crashes that
cannot happen, paths that cannot escape, media that cannot run code, errors that are the same
bytes on every run. Every fixture is a real file made here; nothing is downloaded."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from clirun import packtool, wait_for_group_exit
from PIL import Image

from packtool.cli import main
from packtool.runs import read_expanded


def png_bytes(w: int = 64, h: int = 48) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (10, 120, 200)).save(buf, format="PNG")
    return buf.getvalue()


def conv(prompt: str = "<image>\nWhat is this?", answer: str = "A picture.") -> list[dict]:
    return [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}]


def rec(rid: str, image: str = "ok.png", **extra) -> dict:
    return {"id": rid, "image": image, "conversations": conv(), **extra}


def jsonl(path: Path, records: list) -> Path:
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records))
    return path


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "ok.png").write_bytes(png_bytes())
    return root


def cli(capfd, *args: str) -> tuple[int, str, str]:
    """Run the CLI in this process (as ``packtool ARGS``); return exit code, stdout, stderr."""
    code = main([str(a) for a in args])
    out, err = capfd.readouterr()
    return code, out, err


def run(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "packtool", *map(str, args)], capture_output=True, text=True, **kw)


# ============================================================================ 3: exit codes


USAGE_CASES = {
    "tokenize_without_output": (["tokenize", "in.jsonl"], "Missing option '--output'"),
    "unknown_format": (["tokenize", "in.jsonl", "-o", "out", "--format", "llava2"], "--format"),
    "unknown_command": (["tokenise", "in.jsonl"], "No such command 'tokenise'"),
    "pack_without_source": (["pack", "-o", "out"], "Missing argument"),
    "max_tokens_zero": (["pack", "tok", "-o", "out", "--max-tokens", "0"], "--max-tokens"),
    "max_tokens_not_a_number": (["pack", "tok", "-o", "out", "--max-tokens", "lots"], "--max-tokens"),
    "unknown_option": (["stats", "packed", "--fill"], "No such option: --fill"),
    "option_without_value": (["tokenize", "in.jsonl", "-o"], "-o"),
    "frame_quality_above_100": (["pack", "tok", "-o", "out", "--frame-quality", "101"], "--frame-quality"),
    "fps_infinite": (["tokenize", "in.jsonl", "-o", "out", "--model", "qwen3-vl", "--fps", "inf"], "--fps"),
    # nan is named as no number, not as a value above the bound (typer's check said "less than or equal to 1")
    "fps_nan": (["tokenize", "in.jsonl", "-o", "out", "--fps", "nan"],
                "Invalid value for '--fps': nan is not a number; give one from 0.01 to 1000"),
    "fill_gate_nan": (["stats", "packed", "--fail-below-fill", "nan"],
                      "Invalid value for '--fail-below-fill': nan is not a number; give one from 0 to 1"),
    "ratio_gate_nan": (["stats", "packed", "--fail-above-ratio", "nan"],
                       "Invalid value for '--fail-above-ratio': nan is not a number; give one from 0 up"),
    # inf had no upper bound to fail on: the gate took it, and stats --json printed "limit": Infinity
    "ratio_gate_inf": (["stats", "packed", "--fail-above-ratio", "inf"],
                       "Invalid value for '--fail-above-ratio': inf is not a number; give one from 0 up"),
    "fill_gate_above_1": (["stats", "packed", "--fail-below-fill", "1.5"],
                          "Invalid value for '--fail-below-fill': Input should be less than or equal to 1"),
    "rejected_gate_negative": (["stats", "packed", "--fail-above-rejected", "-0.1"],
                               "Invalid value for '--fail-above-rejected': Input should be greater than or equal to 0"),
    "qwen_one_frame": (["tokenize", "in.jsonl", "-o", "out", "--max-frames", "1"], "--max-frames 1: --model qwen2.5-vl"),
}


@pytest.mark.parametrize("case", sorted(USAGE_CASES))
def test_usage_errors_exit_2_with_the_message_and_no_traceback(capfd, case):
    args, needle = USAGE_CASES[case]
    code, out, err = cli(capfd, *args)
    assert code == 2, (code, err)
    assert needle in err and "Error:" in err
    assert "Traceback" not in err and out == ""


def test_usage_error_through_the_console_entry_point():
    r = run("tokenize", "in.jsonl")
    assert r.returncode == 2 and "Missing option '--output'" in r.stderr and "Traceback" not in r.stderr


def test_help_and_version_still_exit_0(capfd):
    assert cli(capfd, "--help")[0] == 0
    assert cli(capfd, "--version")[0] == 0


def _corpus(tmp_path: Path, media: Path, n: int) -> Path:
    return jsonl(tmp_path / "in.jsonl", [rec(f"r{i}", conversations=conv(answer="word " * 40)) for i in range(n)])


def _long_stage(tmp_path: Path, media: Path, stage: str) -> tuple[list, Path]:
    """A ``tokenize`` or ``pack`` command (and its output directory) that runs long enough to be
    interrupted or raced: 3,000 rows, small shards, one worker. For ``pack`` the corpus is tokenized first."""
    src = _corpus(tmp_path, media, 3000)
    tok = tmp_path / "tok"
    if stage == "pack":
        assert packtool("tokenize", src, "--media-root", media, "-o", tok, "-q", "--workers", "1").returncode == 0
        return (["pack", tok, "-o", tmp_path / "packed", "--max-tokens", "512", "--buffer-size", "512", "-q",
                 "--workers", "1", "--packs-per-shard", "50"], tmp_path / "packed")
    return ["tokenize", src, "--media-root", media, "-o", tok, "-q", "--workers", "1", "--rows-per-shard", "100"], tok


@pytest.mark.parametrize("stage", ["tokenize", pytest.param("pack", marks=pytest.mark.jit)])
def test_ctrl_c_exits_130_with_a_message_and_the_same_command_resumes(tmp_path, media, stage):
    """SIGINT to the process group (what a terminal's Ctrl-C sends), once the run has started
    (its run.json is written): exit 130, one ``Error:`` line, no traceback; re-running the
    same command finishes with exit 0."""
    cmd, out = _long_stage(tmp_path, media, stage)
    proc = subprocess.Popen([sys.executable, "-m", "packtool", *map(str, cmd)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while not (out / ".packtool" / "run.json").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    assert proc.poll() is None, "the run finished before it could be interrupted"
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, stderr)
    assert stderr.startswith("Error: interrupted") and "re-run the same command" in stderr, stderr
    assert "Traceback" not in stderr and stdout == ""
    assert not (out / ".packtool" / "manifest.json").exists()
    r = run(*cmd)
    assert r.returncode == 0, r.stderr
    assert (out / ".packtool" / "manifest.json").is_file() and not list(out.glob(".*.tmp"))


def _sigterm_stage(tmp_path: Path, media: Path, stage: str, workers: int) -> tuple[list, Path]:
    """A ``tokenize`` or ``pack`` command of several tasks (and its output directory), and its
    uninterrupted run in ``ref/`` beside it, for a resume to be compared with byte for byte."""
    src = _corpus(tmp_path, media, 3000)
    if stage == "tokenize":
        cmd = ["tokenize", src, "--media-root", media, "-q", "--workers", str(workers), "--rows-per-shard", "100"]
    else:
        tok = tmp_path / "tok"
        assert packtool("tokenize", src, "--media-root", media, "-o", tok, "-q", "--workers", "1",
                        "--rows-per-shard", "300").returncode == 0
        cmd = ["pack", tok, "--max-tokens", "512", "--buffer-size", "256", "-q", "--workers", str(workers),
               "--packs-per-shard", "50"]
    assert packtool(*cmd, "-o", tmp_path / "ref").returncode == 0
    return [*cmd, "-o", tmp_path / "out"], tmp_path / "out"


def _started(cmd: list, out: Path) -> subprocess.Popen:
    """The CLI as its own process group (a job), returned once its first task is finished."""
    proc = subprocess.Popen([sys.executable, "-m", "packtool", *map(str, cmd)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not list((out / ".packtool").glob("task-*.json")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    assert proc.poll() is None, "the run finished before it could be stopped"
    return proc


def _same_run(out: Path, ref: Path) -> None:
    """``out`` holds what ``ref`` holds, byte for byte, and no temporary."""
    def files(d: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in [*d.glob("part-*.parquet"), *(d / ".packtool").glob("*.json*")]
                if p.name not in ("run.json", "plan.json") and not p.name.startswith("task-")}

    assert files(out) == files(ref) and (out / ".packtool" / "manifest.json").is_file()
    assert not [p.name for d in (out, out / ".packtool") for p in d.glob(".*.tmp")]


# about 8 s each (three runs of the CLI); the in-process tokenize stays in the quick suite
@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("stage", ["tokenize", pytest.param("pack", marks=[pytest.mark.jit, pytest.mark.slow])])
def test_sigterm_stops_like_ctrl_c_exits_143_and_the_same_command_resumes(tmp_path, media, stage, workers):
    """SIGTERM to the job's process group (what Slurm and Kubernetes send to preempt a job) once a
    task is done: it ended the process on the spot, with no message, the running task's
    temporaries left and a pool's semaphores reported leaked by the resource tracker. Now: exit
    143, one ``Error:`` line naming the resume, nothing half-written visible; the same command
    then finishes with the bytes of an uninterrupted run."""
    cmd, out = _sigterm_stage(tmp_path, media, stage, workers)
    proc = _started(cmd, out)
    os.killpg(proc.pid, signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert (proc.returncode, stdout, stderr) == (
        143, "", "Error: terminated (SIGTERM); finished tasks are kept: re-run the same command to resume\n")
    assert not (out / ".packtool" / "manifest.json").exists()
    assert not [p.name for d in (out, out / ".packtool") for p in d.glob(".*.tmp")]
    markers = {p.name for p in (out / ".packtool").glob("task-*.json")}
    assert markers and {p.name for p in out.glob("part-*.parquet")} <= {p.name for p in (tmp_path / "ref").glob("part-*.parquet")}
    r = run(*cmd)
    assert r.returncode == 0, r.stderr
    _same_run(out, tmp_path / "ref")


@pytest.mark.slow  # about 10 s: three runs of the CLI
def test_a_second_sigterm_ends_the_process_at_once(tmp_path, media):
    """The first SIGTERM stops the run in order; a second one (a scheduler does not wait for
    that, nor need a person) ends the process by its default action, and the same command
    still resumes to the bytes of an uninterrupted run."""
    cmd, out = _sigterm_stage(tmp_path, media, "tokenize", 2)
    proc = _started(cmd, out)
    os.killpg(proc.pid, signal.SIGTERM)
    os.killpg(proc.pid, signal.SIGTERM)
    t0 = time.monotonic()
    _, stderr = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 10
    assert proc.returncode in (143, -signal.SIGTERM) and "Traceback" not in stderr, (proc.returncode, stderr)
    wait_for_group_exit(proc.pid)
    r = run(*cmd)
    assert r.returncode == 0, r.stderr
    _same_run(out, tmp_path / "ref")


# ============================================================================ compressed inputs


def test_truncated_gz_keeps_the_rows_before_the_cut(tmp_path, media, capfd):
    # answers that do not compress away, so the cut lands after many read buffers
    records = b"".join(json.dumps(rec(f"r{i}", conversations=conv(answer=hashlib.sha256(str(i).encode()).hexdigest()
                                                                   * 4))).encode() + b"\n" for i in range(3000))
    whole = gzip.compress(records)
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    code, out, err = cli(capfd, "tokenize", tmp_path / "cut.jsonl.gz", "--media-root", media, "-o", tmp_path / "tok",
                         "-q", "--workers", "1", "--json")
    assert code == 0, err
    assert "Traceback" not in err and "Aborted" not in err
    counts = json.loads(out)
    assert 0 < counts["samples"] < 3000
    errors = [json.loads(x) for x in (tmp_path / "tok" / ".packtool" / "errors.jsonl").read_text().splitlines()]
    assert errors[-1]["reason"] == "corrupt_file" and "truncated" in errors[-1]["message"]
    assert counts["rows_in"] == counts["samples"] + counts["rejected"]


@pytest.mark.parametrize("suffix", [".gz", ".zst"])
def test_a_compressed_file_cut_anywhere_keeps_every_whole_line_before_the_cut(tmp_path, suffix):
    """Each whole line that decompresses before the cut is a row, then one ``corrupt_file`` row:
    none lost with the cut tail (the gzip reader used to drop what it had decompressed of its
    last 64 KiB read, so a small cut file lost every row). Cuts at random points, seeded."""
    import zlib

    from packtool.formats import Rejected, iter_samples

    seed = 7
    rng = np.random.default_rng(seed)
    body = b"".join(json.dumps(rec(f"r{i}", conversations=conv(answer=hashlib.sha256(str(i).encode()).hexdigest()
                                                                 * int(rng.integers(1, 6))))).encode() + b"\n"
                    for i in range(1500))
    if suffix == ".gz":
        whole = gzip.compress(body)
    else:
        import zstandard

        whole = zstandard.ZstdCompressor().compress(body)
    for cut in sorted(rng.integers(100, len(whole) - 16, 6).tolist()) + [len(whole) // 200]:
        path = tmp_path / f"cut-{cut}.jsonl{suffix}"
        path.write_bytes(whole[:cut])
        if suffix == ".gz":
            prefix = zlib.decompressobj(wbits=31).decompress(whole[:cut])
        else:
            prefix = zstandard.ZstdDecompressor().decompressobj().decompress(whole[:cut])
        n_whole = prefix.count(b"\n")
        got = list(iter_samples([path]))
        kept = [g for g in got if not isinstance(g, Rejected)]
        assert [g.sample_id for g in kept] == [f"r{i}" for i in range(n_whole)], f"seed {seed}, cut {cut}"
        assert [(g.source_row, g.reason) for g in got[len(kept):]] == [(n_whole, "corrupt_file")], f"cut {cut}"


def test_gzip_members_joined_and_zero_padding_are_read_and_trailing_bytes_are_corrupt_file(tmp_path):
    """``cat a.gz b.gz`` is one gzip file of two members, and tools pad gzip files with zeros:
    both read whole, as ``gzip`` reads them; other bytes after a member are a ``corrupt_file`` row."""
    from packtool.formats import Rejected, iter_samples

    a, b = (b"".join(json.dumps(rec(f"{k}{i}")).encode() + b"\n" for i in range(3)) for k in "ab")
    (tmp_path / "joined.jsonl.gz").write_bytes(gzip.compress(a) + gzip.compress(b) + bytes(512))
    got = list(iter_samples([tmp_path / "joined.jsonl.gz"]))
    assert [g.sample_id for g in got] == ["a0", "a1", "a2", "b0", "b1", "b2"]
    (tmp_path / "tail.jsonl.gz").write_bytes(gzip.compress(a) + b"trailing junk")
    got = list(iter_samples([tmp_path / "tail.jsonl.gz"]))
    assert [g.sample_id for g in got[:3]] == ["a0", "a1", "a2"]
    assert isinstance(got[3], Rejected) and got[3].reason == "corrupt_file" and "not another member" in got[3].message


def _not_its_compression(name: str) -> bytes:
    one = json.dumps(rec("inner")).encode() + b"\n"
    if name == "bad-crc.jsonl.gz":  # a whole gzip stream whose CRC does not match its bytes
        good = bytearray(gzip.compress(one))
        good[-8] ^= 0xFF
        return bytes(good)
    if name == "cut.jsonl.zst":  # zstandard's own reader would return the first half silently
        import zstandard

        whole = zstandard.ZstdCompressor().compress(one * 2000)
        return whole[: len(whole) // 2]
    if name == "not-parquet.parquet":
        return b"PAR1 this is not a parquet file PAR1"
    if name == "empty.parquet":
        return b""
    return {"not-gzip.jsonl.gz": one, "garbage.jsonl.zst": b"\x00\x01\x02 not zstd"}[name]


@pytest.mark.parametrize("name", ["not-gzip.jsonl.gz", "bad-crc.jsonl.gz", "garbage.jsonl.zst", "cut.jsonl.zst",
                                  "not-parquet.parquet", "empty.parquet"])
def test_a_file_that_is_not_its_compression_is_one_error_row(tmp_path, media, capfd, name):
    (tmp_path / name).write_bytes(_not_its_compression(name))
    jsonl(tmp_path / "good.jsonl", [rec("good")])
    code, out, err = cli(capfd, "tokenize", tmp_path / name, tmp_path / "good.jsonl", "--media-root", media,
                         "-o", tmp_path / "tok", "-q", "--workers", "1", "--json")
    assert code == 0, err
    assert "Traceback" not in err
    errors = [json.loads(x) for x in (tmp_path / "tok" / ".packtool" / "errors.jsonl").read_text().splitlines()]
    assert [e["reason"] for e in errors] == ["corrupt_file"] and errors[0]["source"].endswith(name)
    assert json.loads(out)["rows_in"] == json.loads(out)["samples"] + 1
    if name == "cut.jsonl.zst":
        assert 0 < json.loads(out)["samples"] < 2001 and "truncated" in errors[0]["message"]
    else:
        assert json.loads(out)["samples"] == 1


def _compressed_as(kind: str, body: bytes) -> bytes:
    import bz2
    import lzma

    import zstandard

    return {"gzip": gzip.compress, "zstd": zstandard.ZstdCompressor().compress, "bzip2": bz2.compress,
            "xz": lzma.compress}[kind](body)


@pytest.mark.parametrize(("name", "kind", "fix"), [
    ("train.jsonl.bz2", "bzip2", "recompress it with gzip or zstd"),
    ("train.jsonl.xz", "xz", "recompress it with gzip or zstd"),
    ("train.jsonl", "gzip", "rename it to end in .gz"),
    ("train.json", "zstd", "rename it to end in .zst"),
    ("twice.jsonl.gz", "gzip", "compressed twice"),
])
def test_a_file_compressed_as_its_name_does_not_say_is_one_error_row_naming_the_fix(tmp_path, media, capfd, name,
                                                                                  kind, fix):
    """A named ``.jsonl.bz2`` / ``.xz`` file, or gzip / zstd bytes under a plain name, was read as text:
    one ``bad_encoding`` row per run of bytes between newline bytes ("line is not valid UTF-8"), or
    a ``.jsonl`` cut into tasks at those bytes; so was a ``.gz`` file compressed twice (a download
    saved with its transfer encoding). It is one ``corrupt_file`` row naming the compression and
    the fix, with --workers 1 and 2 alike."""
    body = b"".join(json.dumps(rec(f"r{i}", conversations=conv(answer=hashlib.sha256(str(i).encode()).hexdigest())))
                    .encode() + b"\n" for i in range(400))
    (tmp_path / name).write_bytes(_compressed_as(kind, _compressed_as(kind, body) if "twice" in name else body))
    assert (tmp_path / name).read_bytes().count(b"\n") > 3  # lines to cut at, were it read as JSONL
    jsonl(tmp_path / "good.jsonl", [rec("good")])
    for workers in ("1", "2"):
        out_dir = tmp_path / f"tok{workers}"
        code, out, err = cli(capfd, "tokenize", tmp_path / name, tmp_path / "good.jsonl", "--media-root", media,
                             "-o", out_dir, "-q", "--workers", workers, "--rows-per-shard", "100", "--json")
        assert code == 0, err
        errors = [json.loads(x) for x in (out_dir / ".packtool" / "errors.jsonl").read_text().splitlines()]
        assert [(e["source"], e["row"], e["reason"]) for e in errors] == [(str(tmp_path / name), 0, "corrupt_file")]
        assert f"{kind}-compressed" in errors[0]["message"] and fix in errors[0]["message"], errors[0]["message"]
        assert json.loads(out)["rows_in"] == json.loads(out)["samples"] + 1 == 2


# ============================================================================ 2: pack never crashes on a plan


def _tokenize(capfd, tmp_path: Path, media: Path, records: list, *extra: str) -> Path:
    src = jsonl(tmp_path / "in.jsonl", records)
    tok = tmp_path / "tok"
    code, _, err = cli(capfd, "tokenize", src, "--media-root", media, "-o", tok, "-q", "--workers", "1", *extra)
    assert code == 0, err
    return tok


def _errors(d: Path) -> list[dict]:
    return [json.loads(x) for x in (d / ".packtool" / "errors.jsonl").read_text().splitlines()]


LONG = "and then " * 400  # about 1,200 tokens: oversize at --max-tokens 256


@pytest.mark.parametrize("oversize", ["drop", "alone", "truncate"])
def test_pack_a_shard_whose_every_sample_is_oversize(tmp_path, media, capfd, oversize):
    """Every sample of the shard is too long: drop leaves no pack at all (and must not crash),
    alone and truncate (text-only samples cut to the capacity) give one pack each."""
    records = [{"id": f"long{i}", "conversations": conv("Tell me.", LONG)} for i in range(3)]
    tok = _tokenize(capfd, tmp_path, media, records)
    packed = tmp_path / "packed"
    code, out, err = cli(capfd, "pack", tok, "-o", packed, "--max-tokens", "256", "--oversize", oversize, "-q",
                         "--workers", "1", "--json")
    assert code == 0, err
    counts = json.loads(out)
    expect = {"drop": (0, 0, 3), "alone": (3, 3, 0), "truncate": (3, 3, 0)}[oversize]
    assert (counts["samples_packed"], counts["packs"], counts["dropped"]) == expect
    assert [e["reason"] for e in _errors(packed)] == ["oversize"] * counts["dropped"]
    # what reads the output takes the empty (or tiny) result in its stride
    for args in (["stats", packed], ["stats", tok, packed], ["validate", packed], ["inspect", packed]):
        code, _, err = cli(capfd, *args)
        assert "Traceback" not in err
        assert code == 0 or (args[0] == "inspect" and counts["packs"] == 0 and err.startswith("Error: ")), err


def test_truncate_leaves_out_a_sample_whose_cut_keeps_no_target(tmp_path, media, capfd):
    """A long prompt with a short answer, cut to --max-tokens by --oversize truncate, kept only
    prompt tokens: its pack had no target at all, so a trainer's loss was 0/0 = NaN. It is a
    ``no_loss`` row of errors.jsonl now; a long answer that starts before the cut is still cut
    and packed, and the dry run counts the same."""
    records = [{"id": "long-prompt", "conversations": conv(LONG, "Yes.")},
               {"id": "long-answer", "conversations": conv("Tell me.", LONG)}, rec("fits")]
    tok = _tokenize(capfd, tmp_path, media, records)
    args = ["--max-tokens", "256", "--oversize", "truncate", "-q", "--workers", "1", "--json", "--media", "reference"]
    code, out, err = cli(capfd, "pack", tok, "-o", tmp_path / "packed", *args)
    assert code == 0, err
    counts = json.loads(out)
    assert (counts["samples_packed"], counts["truncated"], counts["rejected_by_reason"]) == (2, 1, {"no_loss": 1})
    (row,) = _errors(tmp_path / "packed")
    assert (row["sample_id"], row["reason"]) == ("long-prompt", "no_loss")
    assert "cut to --max-tokens 256" in row["message"] and "raise --max-tokens" in row["message"]
    packs = [t for f in sorted((tmp_path / "packed").glob("*.parquet"))
             for t in read_expanded(f, ["target_ids"]).column("target_ids").to_pylist()]
    assert packs and all(any(t != -100 for t in targets) for targets in packs)
    code, out, err = cli(capfd, "pack", tok, "--dry-run", *args[:4], "--json")
    assert code == 0, err
    assert json.loads(out)["rejected_by_reason"] == {"no_loss": 1}


def test_pack_one_row_per_tokenized_shard(tmp_path, media, capfd):
    records = [rec("fits-0"), {"id": "long", "conversations": conv("Tell me.", LONG)}, rec("fits-1")]
    tok = _tokenize(capfd, tmp_path, media, records, "--rows-per-shard", "1")
    code, out, err = cli(capfd, "pack", tok, "-o", tmp_path / "packed", "--max-tokens", "256", "-q", "--workers", "1",
                         "--json", "--media", "reference")
    assert code == 0, err
    counts = json.loads(out)
    assert (counts["samples_packed"], counts["dropped"], counts["tasks"]) == (2, 1, 3)
    assert [e["sample_id"] for e in _errors(tmp_path / "packed")] == ["long"]


def test_pack_a_message_tree_of_5000_branches(tmp_path, media, capfd):
    tree = {"id": "tree", "image": "ok.png",
            "message_list": [{"question": f"Question {i}?", "answer": f"Answer {i}."} for i in range(5000)]}
    tok = _tokenize(capfd, tmp_path, media, [tree, rec("small")])
    for oversize in ("drop", "alone"):
        code, out, err = cli(capfd, "pack", tok, "-o", tmp_path / oversize, "--max-tokens", "4096", "--oversize",
                             oversize, "-q", "--workers", "1", "--json", "--media", "reference")
        assert code == 0, err
        counts = json.loads(out)
        assert counts["samples_packed"] + counts["dropped"] == 2
        assert counts["dropped"] == (1 if oversize == "drop" else 0)


def test_every_stage_on_a_corpus_with_no_good_row(tmp_path, media, capfd):
    """All rows rejected at tokenize: an empty tokenized set packs to an empty packed set, and
    stats, sweep, dry runs and validate say so instead of failing."""
    tok = _tokenize(capfd, tmp_path, media, [b"{broken", rec("missing", "nope.png")])
    packed = tmp_path / "packed"
    for args in (["pack", tok, "-o", packed, "--workers", "1"], ["pack", tok, "--dry-run"], ["sweep", tok],
                 ["stats", tok], ["stats", packed], ["stats", tok, packed], ["validate", tok], ["validate", packed]):
        code, _, err = cli(capfd, *args, "-q" if args[0] == "pack" else "--json")
        assert code == 0 and "Traceback" not in err, (args, err)


@pytest.mark.parametrize("policy", ["drop", "alone", "truncate"])
def test_dry_run_and_sweep_of_an_all_oversize_shard(tmp_path, media, capfd, policy):
    tok = _tokenize(capfd, tmp_path, media, [{"id": "long", "conversations": conv("Tell me.", LONG)}])
    for args in (["pack", tok, "--dry-run", "--max-tokens", "256", "--oversize", policy, "--json"],
                 ["sweep", tok, "--max-tokens", "256,512", "--oversize", policy if policy != "fail" else "drop"]):
        code, _, err = cli(capfd, *args)
        assert code == 0 and "Traceback" not in err, (args, err)


def test_oversize_fail_names_the_sample_by_its_id(tmp_path, media, capfd):
    """``--oversize fail`` said "sample at index 1": an index into the shard's kept rows, which
    the user cannot look up. It names the sample's id and its row of the shard now."""
    tok = _tokenize(capfd, tmp_path, media, [rec("short"), {"id": "long-one", "conversations": conv("Tell me.", LONG)}])
    shard = sorted(tok.glob("*.parquet"))[0].name
    code, out, err = cli(capfd, "pack", tok, "-o", tmp_path / "packed", "--max-tokens", "256", "--oversize", "fail",
                         "--workers", "1")
    assert (code, out) == (1, "") and err.startswith(f"Error: sample 'long-one' (row 1 of {shard}) needs "), err
    assert "raise --max-tokens/--max-vision-units or use --oversize drop" in err


# ============================================================================ 5: names from manifests stay inside


@pytest.fixture(scope="module")
def built(tmp_path_factory, media) -> dict[str, Path]:
    """A small tokenized and packed pair (embedded media), made once; tests copy it before changing it."""
    base = tmp_path_factory.mktemp("built")
    src = jsonl(base / "in.jsonl", [rec(f"r{i}") for i in range(6)] + [{"id": "t", "conversations": conv("Hi.", "Yo.")}])
    assert main([str(a) for a in ("tokenize", src, "--media-root", media, "-o", base / "tok", "-q", "--workers", "1",
                                  "--rows-per-shard", "4")]) == 0
    assert main([str(a) for a in ("pack", base / "tok", "-o", base / "packed", "-q", "--workers", "1",
                                  "--max-tokens", "1024", "--packs-per-shard", "2")]) == 0
    return {"tok": base / "tok", "packed": base / "packed", "base": base}


def _copy(built: dict, tmp_path: Path) -> dict[str, Path]:
    import shutil

    out = {}
    for k in ("tok", "packed"):
        shutil.copytree(built[k], tmp_path / k, symlinks=True)
        out[k] = tmp_path / k
    return out


def _readers(d: dict[str, Path], which: str, tmp_path: Path) -> list[list]:
    """Every command that reads directory ``which`` (``tok`` or ``packed``)."""
    target = d[which]
    cmds = [["stats", target], ["validate", target], ["inspect", target]]
    if which == "tok":
        cmds += [["pack", target, "-o", tmp_path / "out", "-q", "--workers", "1"], ["pack", target, "--dry-run", "-q"],
                 ["sweep", target], ["stats", target, d["packed"]], ["inspect", target, "--sample", "r0"]]
    else:
        cmds += [["stats", d["tok"], target], ["inspect", target, "--pack", "0"]]
    return cmds


ESCAPES = ["/etc/passwd", "../other/part-00000-00000.parquet", "..", ".", "", "sub/part-00000-00000.parquet",
           "part-00000-00000.parquet/../../x", "\\\\server\\share\\part.parquet", "manifest.json", "errors.jsonl",
           ".packtool/run.json"]


@pytest.mark.parametrize("which", ["tok", "packed"])
@pytest.mark.parametrize("name", ESCAPES)
def test_a_shard_name_that_leaves_its_directory_is_refused_by_every_reader(built, tmp_path, capfd, which, name):
    d = _copy(built, tmp_path)
    (tmp_path / "other").mkdir()
    for f in d[which].glob("part-*.parquet"):  # the target exists, so only the name check can stop it
        (tmp_path / "other" / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((d[which] / ".packtool" / "manifest.json").read_text())
    manifest["shards"][0]["file"] = name
    (d[which] / ".packtool" / "manifest.json").write_text(json.dumps(manifest))
    for args in _readers(d, which, tmp_path):
        code, _, err = cli(capfd, *args)
        assert code == 1, (args, code, err)
        assert "Traceback" not in err
        assert "not a shard file" in err or "not a shard file" in _ or "not whole" in err, (args, err)
    if which == "packed":
        from packtool.errors import InputError
        from packtool.reader import PackedDataset

        with pytest.raises(InputError, match="not a shard file"):
            list(PackedDataset(d["packed"], shuffle=False))


@pytest.mark.parametrize(("manifest", "what"), [({}, "no 'kind'"), ({"kind": "weird", "schema_version": 5}, "an unknown 'kind'"),
                                              ({"kind": "tokenized"}, "no 'schema_version'")])
def test_a_manifest_without_a_kind_or_version_is_named_not_a_manifest(built, tmp_path, capfd, manifest, what):
    """A manifest ``{}`` read "None schema version None, this packtool reads 5"."""
    d = _copy(built, tmp_path)
    file = d["tok"] / ".packtool" / "manifest.json"
    file.write_text(json.dumps(manifest))
    code, out, err = cli(capfd, "stats", d["tok"])
    assert (code, out) == (1, "")
    assert err == f"Error: {file}: not a packtool manifest ({what}); re-run the command that wrote it\n"


@pytest.mark.parametrize(("version", "fix"), [(99, "a newer packtool wrote it: upgrade packtool (this is {v}) to read it"),
                                              (0, "re-run the stage that wrote it with this packtool")])
def test_a_schema_version_this_packtool_cannot_read_names_the_right_fix(built, tmp_path, capfd, version, fix):
    """A directory from a newer packtool was told to "re-run the stage with this version"."""
    from packtool import __version__
    from packtool.schema import READABLE_VERSIONS

    d = _copy(built, tmp_path)
    file = d["packed"] / ".packtool" / "manifest.json"
    manifest = json.loads(file.read_text())
    manifest["schema_version"] = version
    file.write_text(json.dumps(manifest))
    code, out, err = cli(capfd, "stats", d["packed"])
    assert (code, out) == (1, "")
    readable = READABLE_VERSIONS["packed"]
    listed = ", ".join(str(v) for v in readable[:-1]) + f" or {readable[-1]}"
    assert err == (f"Error: {file}: packed schema version {version}, this packtool reads {listed}; "
                   f"{fix.format(v=__version__)}\n")


@pytest.mark.parametrize("which", ["tok", "packed"])
@pytest.mark.parametrize(("key", "value", "shown"), [("rejected", "x", "rejected is \"x\""),
                                                     ("tokens", None, "tokens is null"),
                                                     ("rejected_by_reason", [1], "rejected_by_reason is [1]"),
                                                     ("rejected_by_reason", {"bad_json": -1}, "rejected_by_reason.bad_json is -1")])
def test_a_count_of_the_wrong_type_is_a_damaged_manifest_to_every_reader(built, tmp_path, capfd, which, key, value, shown):
    """``counts.rejected: "x"`` made validate raise ValueError (a format spec) and stats TypeError."""
    d = _copy(built, tmp_path)
    file = d[which] / ".packtool" / "manifest.json"
    manifest = json.loads(file.read_text())
    manifest["counts"][key] = value
    file.write_text(json.dumps(manifest))
    for args in _readers(d, which, tmp_path):
        code, out, err = cli(capfd, *args)
        assert code == 1 and "Traceback" not in err, (args, err)
        assert f"counts.{shown}, not a whole number; the manifest is damaged" in out + err, (args, out, err)


def test_a_shard_that_is_a_link_out_of_its_directory_is_refused(built, tmp_path, capfd):
    d = _copy(built, tmp_path)
    first = json.loads((d["tok"] / ".packtool" / "manifest.json").read_text())["shards"][0]["file"]
    outside = tmp_path / "elsewhere.parquet"
    (d["tok"] / first).rename(outside)
    os.symlink(outside, d["tok"] / first)
    code, _, err = cli(capfd, "pack", d["tok"], "-o", tmp_path / "out", "-q", "--workers", "1")
    assert code == 1 and "outside" in err and "Traceback" not in err


def test_a_marker_naming_a_file_outside_is_not_trusted(built, tmp_path, capfd):
    """A completion marker whose shard names leave the directory marks nothing: the task is
    redone, and the manifest lists only the task's own shards."""
    d = _copy(built, tmp_path)
    (d["tok"] / ".packtool" / "manifest.json").unlink()
    marker = d["tok"] / ".packtool" / "task-00000.json"
    record = json.loads(marker.read_text())
    good = record["shards"][0]["file"]
    record["shards"][0]["file"] = "../" + good
    (tmp_path / good).write_bytes((d["tok"] / good).read_bytes())
    marker.write_text(json.dumps(record))
    src = built["base"] / "in.jsonl"
    code, _, err = cli(capfd, "tokenize", src, "--media-root", Path(json.loads(
        (built["tok"] / ".packtool" / "manifest.json").read_text())["config"]["media_root"]), "-o", d["tok"], "-q", "--workers", "1",
        "--rows-per-shard", "4")
    assert code == 0, err
    assert (d["tok"] / ".packtool" / "manifest.json").read_bytes() == (built["tok"] / ".packtool" / "manifest.json").read_bytes()


# ============================================================================ 7: media that would run code


def _eps() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (20, 10)).save(buf, format="EPS")
    return buf.getvalue()


def test_the_reader_and_validate_refuse_embedded_eps(tmp_path, monkeypatch):
    """An EPS in a packed shard (or under the media root) is refused by ``decode_media`` and
    reported by validate; Ghostscript is never started (any subprocess would fail the test)."""
    from packtool.errors import InputError
    from packtool.reader import decode_image, decode_video
    from packtool.validate import _check_media_bytes

    def no_programs(*a, **k):
        raise AssertionError(f"an external program was started: {a}")

    monkeypatch.setattr(subprocess, "Popen", no_programs)
    monkeypatch.setattr(subprocess, "check_call", no_programs)
    with pytest.raises(InputError, match="PostScript"):
        decode_image({"kind": "image", "data": _eps()})
    (tmp_path / "x.png").write_bytes(_eps())
    with pytest.raises(InputError, match="PostScript"):
        decode_image({"kind": "image", "path": "x.png", "data": None}, tmp_path)
    with pytest.raises(InputError, match="PostScript"):
        decode_video({"kind": "video", "frames": [_eps()], "timestamps": [0.0]})
    (tmp_path / "list.mp4").write_bytes(b"ffconcat version 1.0\nfile x.png\n")
    with pytest.raises(InputError, match="not a video container packtool reads"):
        decode_video({"kind": "video", "path": "list.mp4", "data": None, "timestamps": [0.0]}, tmp_path)
    problem = _check_media_bytes({"kind": "image", "data": _eps(), "width": 20, "height": 10})
    assert problem and "refused" in problem


def test_an_image_that_does_not_decode_is_named_by_the_reader(tmp_path):
    """tokenize reads headers only, so a JPEG whose scan data is damaged is packed; the reader
    raised Pillow's bare ``OSError`` ("broken data stream", or an ``UnidentifiedImageError`` with an
    object address) from inside a training loop, naming neither the image nor the fix."""
    from packtool.errors import InputError
    from packtool.reader import decode_image, decode_media

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (90, 120, 3), dtype=np.uint8)).save(
        buf, format="JPEG", progressive=True)
    good = buf.getvalue()
    damaged = good[:400] + b"\x00" * 200 + b"\xff\xd9"
    (tmp_path / "cats").mkdir()
    (tmp_path / "cats" / "tom.jpg").write_bytes(damaged)
    row = {"media": [{"kind": "image", "path": "cats/tom.jpg", "data": damaged}], "vision": {"exif": "apply"}}
    for call in (lambda: decode_media(row),
                 lambda: decode_image({"kind": "image", "path": "cats/tom.jpg", "data": None}, tmp_path)):
        with pytest.raises(InputError) as err:
            call()
        message = str(err.value)
        assert "'cats/tom.jpg'" in message and "does not decode" in message and "packtool validate" in message, message
    with pytest.raises(InputError, match="does not decode") as err:
        decode_image({"kind": "image", "path": "x.png", "data": b"\x89PNG\r\n\x1a\n not a png"})
    assert " at 0x" not in str(err.value)
    assert decode_image({"kind": "image", "data": good}).size == (120, 90)


# ============================================================================ 8: the same errors, byte for byte


def _uri(data: bytes, mime: str = "image/png") -> str:
    import base64

    return f"data:{mime};base64," + base64.b64encode(data).decode()


def test_errors_of_inline_media_are_the_same_bytes_on_every_run(tmp_path, media):
    """Inline bytes that fail (garbage, truncated, a format outside the allow-list, a broken
    video) give messages without object addresses or temporary names, so errors.jsonl is
    byte-identical between runs and between --workers 1 and 2."""
    from packtool import TokenizeConfig, tokenize_dataset

    png = png_bytes()
    bad = [_uri(b"not an image at all"), _uri(png[: len(png) // 2]), _uri(_eps()), _uri(b"\x00" * 64),
           _uri(b"GIF89a" + b"\x00" * 20), _uri(b"RIFF\x00\x00\x00\x00WEBPVP8 ")]
    records = []
    for i, uri in enumerate(bad * 3):
        records.append(rec(f"img{i}", uri))
        records.append({"id": f"vid{i}", "video": _uri(b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 50, "video/mp4"),
                        "conversations": conv("<video>\nWhat?", "This.")})
        records.append(rec(f"good{i}"))
    src = jsonl(tmp_path / "in.jsonl", records)
    outs = []
    for k, workers in enumerate((1, 2, 1)):
        out = tmp_path / f"tok{k}"
        tokenize_dataset([src], out, TokenizeConfig(media_root=str(media), rows_per_shard=7), workers=workers)
        outs.append((out / ".packtool" / "errors.jsonl").read_bytes())
    assert outs[0] == outs[1] == outs[2]
    text = outs[0].decode()
    assert " at 0x" not in text and ".tmp" not in text and "<_io." not in text
    assert text.count("\n") == 2 * len(bad) * 3


def test_an_object_address_in_any_message_is_dropped(tmp_path):
    """The safety net under every reader: whatever library text a message quotes, errors.jsonl
    holds no `` at 0x...`` address."""
    from packtool.formats import Rejected
    from packtool.pipeline import _TaskErrors

    (tmp_path / ".packtool").mkdir()
    errors = _TaskErrors(tmp_path, 0, None, "skip")
    errors.add(Rejected("in.jsonl", 3, "x", "corrupt_image", "cannot identify <_io.BytesIO object at 0x7f3a2b1c>"))
    errors.commit()
    line = json.loads((tmp_path / ".packtool" / "errors-00000.jsonl").read_text())
    assert line["message"] == "cannot identify <_io.BytesIO object>"


# ============================================================================ 11: temporaries of dead runs


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_resume_sweeps_the_temporaries_of_dead_writers_only(built, tmp_path, media):
    """A run killed while writing the manifest, a marker, errors or a shard leaves
    ``.NAME.PID@HOST.tmp`` files; the resume removes those of dead processes on this host and
    leaves a live writer's, and another host's, alone."""
    import socket

    from packtool import TokenizeConfig, tokenize_dataset

    d = _copy(built, tmp_path)
    tok = d["tok"]
    (tok / ".packtool" / "manifest.json").unlink()
    host, dead = socket.gethostname(), _dead_pid()
    stale = [tok / f".manifest.json.{dead}@{host}.tmp", tok / f".errors.jsonl.{dead}@{host}.tmp",
             tok / f".part-00000-00000.parquet.{dead}@{host}.tmp", tok / ".packtool" / f".task-00001.json.{dead}@{host}.tmp",
             tok / ".packtool" / f".run.json.{dead}.tmp"]
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    kept = [tok / f".manifest.json.{live.pid}@{host}.tmp", tok / f".manifest.json.{dead}@another-host.tmp"]
    for f in stale + kept:
        f.write_text("half")
    cfg = json.loads((built["tok"] / ".packtool" / "manifest.json").read_text())["config"]
    try:
        tokenize_dataset([built["base"] / "in.jsonl"], tok, TokenizeConfig(media_root=cfg["media_root"], rows_per_shard=4),
                         workers=1)
    finally:
        live.kill()
        live.wait()
    assert not [f for f in stale if f.exists()]
    assert all(f.exists() for f in kept)
    assert (tok / ".packtool" / "manifest.json").read_bytes() == (built["tok"] / ".packtool" / "manifest.json").read_bytes()


# ============================================================================ 4: reruns trust no stale state


def test_a_rerun_after_an_input_changed_is_refused_not_answered_from_the_old_output(tmp_path, media, capfd):
    src = jsonl(tmp_path / "in.jsonl", [rec("a"), rec("b")])
    args = ["tokenize", src, "--media-root", media, "-o", tmp_path / "tok", "-q", "--workers", "1"]
    assert cli(capfd, *args)[0] == 0
    with open(src, "ab") as fh:
        fh.write(json.dumps(rec("c")).encode() + b"\n")
    code, out, err = cli(capfd, *args)
    assert code == 1 and out == ""
    assert "input files changed" in err and "in.jsonl" in err and "--overwrite" in err, err
    code, out, err = cli(capfd, *args, "--overwrite", "--json")
    assert code == 0 and json.loads(out)["samples"] == 3


def test_a_repack_after_the_tokenized_set_was_redone_is_refused(tmp_path, media, capfd):
    src = jsonl(tmp_path / "in.jsonl", [rec("a"), rec("b")])
    tok_args = ["tokenize", src, "--media-root", media, "-o", tmp_path / "tok", "-q", "--workers", "1"]
    pack_args = ["pack", tmp_path / "tok", "-o", tmp_path / "packed", "-q", "--workers", "1", "--media", "reference"]
    assert cli(capfd, *tok_args)[0] == 0 and cli(capfd, *pack_args)[0] == 0
    jsonl(src, [rec("a"), rec("b"), rec("c")])
    assert cli(capfd, *tok_args, "--overwrite")[0] == 0
    code, _, err = cli(capfd, *pack_args)
    assert code == 1 and "input files changed" in err, err


def test_a_failed_start_does_not_block_the_corrected_retry(tmp_path, media, capfd):
    """A run that stopped before finishing any task (here: --on-error fail at the first row)
    holds nothing worth keeping; the retry with corrected settings starts over instead of
    being refused as a different unfinished run."""
    src = jsonl(tmp_path / "in.jsonl", [rec("bad", "nope.png"), rec("good")])
    out = tmp_path / "tok"
    code, _, err = cli(capfd, "tokenize", src, "--media-root", media, "-o", out, "-q", "--workers", "1",
                       "--on-error", "fail")
    assert code == 1 and "--on-error fail" in err
    code, _, err = cli(capfd, "tokenize", src, "--media-root", media, "-o", out, "-q", "--workers", "1",
                       "--model", "qwen2-vl")
    assert code == 0, err


def test_a_relative_media_root_means_the_same_files_from_any_directory(tmp_path, media, monkeypatch, capfd):
    """tokenize records the media root it resolved; pack run from another directory embeds the
    very files tokenize counted."""
    work = tmp_path / "work"
    (work / "media").mkdir(parents=True)
    (work / "media" / "ok.png").write_bytes(png_bytes(64, 48))
    src = jsonl(work / "in.jsonl", [rec("a")])
    monkeypatch.chdir(work)
    assert cli(capfd, "tokenize", src, "--media-root", "media", "-o", tmp_path / "tok", "-q", "--workers", "1")[0] == 0
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "media").mkdir(parents=True)
    (elsewhere / "media" / "ok.png").write_bytes(png_bytes(300, 200))  # a different file of the same name
    monkeypatch.chdir(elsewhere)
    code, _, err = cli(capfd, "pack", tmp_path / "tok", "-o", tmp_path / "packed", "-q", "--workers", "1")
    assert code == 0, err
    from packtool.reader import PackedDataset

    (row,) = list(PackedDataset(tmp_path / "packed", shuffle=False))
    assert row["media"][0]["data"] == png_bytes(64, 48)


def _media_corpus(tmp_path: Path, capfd) -> tuple[Path, Path]:
    root = tmp_path / "media"
    root.mkdir()
    for name in ("a.png", "b.png", "c.png"):
        (root / name).write_bytes(png_bytes(64, 48))
    records = [rec("ra", "a.png"), rec("rb", "b.png"), rec("rc", "c.png"), rec("ra2", "a.png")]
    return root, _tokenize(capfd, tmp_path, root, records)


@pytest.mark.parametrize("media_mode", ["embed", "reference"])
def test_media_changed_since_tokenize_is_a_row_error_never_a_substitution(tmp_path, capfd, media_mode):
    root, tok = _media_corpus(tmp_path, capfd)
    (root / "a.png").write_bytes(png_bytes(300, 200))  # another image: another size
    st = (root / "b.png").stat()
    os.utime(root / "b.png", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same bytes, touched
    (root / "c.png").unlink()
    code, out, err = cli(capfd, "pack", tok, "-o", tmp_path / "packed", "-q", "--workers", "1", "--json",
                         "--media", media_mode)
    assert code == 0, err
    assert json.loads(out)["samples_packed"] == 0
    got = {(e["sample_id"], e["reason"]) for e in _errors(tmp_path / "packed")}
    assert got == {("ra", "media_changed"), ("ra2", "media_changed"), ("rb", "media_changed"), ("rc", "missing_media")}
    code, out, err = cli(capfd, "stats", tok, tmp_path / "packed", "--json")
    assert code == 0 and json.loads(out)["rejected"]["pack"] == {"media_changed": 3, "missing_media": 1}


def test_a_media_file_unreadable_at_assembly_stops_the_run_naming_it(tmp_path, capfd, monkeypatch):
    """Tokenized shards that record no media sizes (another tool's, or written before sizes were
    recorded) cannot be checked before planning, so a missing file is met while packs are
    assembled. In a worker process as in one, the run stops with the file and the fix; it
    used to read as a killed worker (the error could not be unpickled by the driver)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.corpus import write_tokenized

    write_tokenized(tmp_path / "tok", "llava", 600, seed=1, rows_per_shard=200)  # images/... that do not exist
    monkeypatch.chdir(tmp_path)
    for workers in ("1", "2"):
        code, out, err = cli(capfd, "pack", tmp_path / "tok", "-o", tmp_path / f"packed{workers}", "-q",
                             "--workers", workers, "--max-vision-units", "128")
        assert code == 1, (workers, err)
        assert "Error: a media file could not be read while pack was running: media file 'images/llava_" in err
        assert "record no media sizes" in err and "worker process died" not in err and "Traceback" not in err
        assert not list((tmp_path / f"packed{workers}").glob("*.parquet"))


def _digests(folder: Path) -> dict[str, str]:
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file()}


def test_packing_into_the_tokenized_directory_is_refused_before_anything_is_removed(tmp_path, media, capfd, monkeypatch):
    """``pack tok -o tok --overwrite`` took the tokenize run there for an earlier run of its own and
    deleted its shards and manifest before failing; a mixture into one of its sources did too.
    Refused now, however the path is spelled, and the tokenized directories stay byte for byte."""
    monkeypatch.chdir(tmp_path)
    data = jsonl(tmp_path / "d.jsonl", [rec(f"s{i}") for i in range(5)])
    for name in ("tok", "tokb"):
        assert cli(capfd, "tokenize", data, "-o", name, "--media-root", media, "-q")[0] == 0
    before = {name: _digests(tmp_path / name) for name in ("tok", "tokb")}
    for args in (["tok", "-o", "tok", "--overwrite"], ["tok/", "-o", "./tok/../tok"], ["tok", "-o", tmp_path / "tok"],
                 ["tok", "tokb", "--rates", "1,1", "-o", "tokb", "--overwrite"]):
        code, out, err = cli(capfd, "pack", *args, "-q")
        assert code == 1 and out == "", (args, err)
        assert "is the tokenized directory being packed; pack into another directory" in err, args
        assert {name: _digests(tmp_path / name) for name in before} == before, args
    code, out, _ = cli(capfd, "pack", "tok", "-o", "tok", "--dry-run", "--json")  # writes nothing: allowed
    assert code == 0 and json.loads(out)["samples_in"] == 5


def test_packing_inside_the_tokenized_directory_or_around_it_is_refused(tmp_path, media, capfd, monkeypatch):
    """``pack tok -o tok/packed`` succeeded, and every tool that reads a folder's Parquet files
    (``pyarrow.dataset("tok")``, pandas, duckdb) then read the packed shards as tokenized rows; so
    did a packed directory holding its input. Refused now, before anything is written; a dry
    run, which writes nothing, still plans."""
    monkeypatch.chdir(tmp_path)
    data = jsonl(tmp_path / "d.jsonl", [rec(f"s{i}") for i in range(5)])
    for name in ("tok", "out/tokb"):
        assert cli(capfd, "tokenize", data, "-o", name, "--media-root", media, "-q")[0] == 0
    before = _digests(tmp_path)
    cases = {("tok", "-o", "tok/packed"): "lies inside the tokenized directory 'tok'",
             ("tok/", "-o", "./tok/../tok/a/b"): "lies inside the tokenized directory 'tok'",
             ("out/tokb", "-o", "out"): "holds the tokenized directory 'out/tokb'",
             ("tok", "out/tokb", "--rates", "1,1", "-o", "out"): "holds the tokenized directory 'out/tokb'"}
    for args, where in cases.items():
        code, out, err = cli(capfd, "pack", *args, "-q")
        assert code == 1 and out == "", (args, err)
        assert err == (f"Error: -o {str(Path(args[args.index('-o') + 1]))!r} {where} being packed: a tool that reads a folder's "
                       "Parquet files (pyarrow.dataset, pandas, duckdb, datasets) would read the packed shards with "
                       "the tokenized ones; pack into a directory beside it\n"), args
        assert _digests(tmp_path) == before, args
    code, out, _ = cli(capfd, "pack", "tok", "-o", "tok/packed", "--dry-run", "--json")  # writes nothing: allowed
    assert code == 0 and json.loads(out)["samples_in"] == 5
    assert cli(capfd, "pack", "tok", "-o", "packed", "-q")[0] == 0  # beside it, as before


def test_an_output_name_that_is_not_utf8_is_refused_before_anything_is_written(tmp_path, media, capfd):
    """An output directory named with a byte UTF-8 cannot decode (Python holds it as a lone
    surrogate) reached Arrow's file system as a UnicodeEncodeError traceback, after the run's
    state was written; refused now, for tokenize and pack alike, leaving nothing behind."""
    data = jsonl(tmp_path / "d.jsonl", [rec("a")])
    assert cli(capfd, "tokenize", data, "-o", tmp_path / "tok", "--media-root", media, "-q")[0] == 0
    bad = str(tmp_path / "out") + os.fsdecode(b"\xe9")
    for args in (["tokenize", data, "--media-root", media], ["pack", tmp_path / "tok"]):
        code, out, err = cli(capfd, *args, "-o", bad, "-q")
        assert (code, out) == (1, ""), err
        assert err == (f"Error: output directory '{tmp_path}/out\\udce9' is not valid UTF-8, which the Parquet writer "
                       "needs; choose a name in UTF-8\n")
        assert not os.path.lexists(bad)


def test_a_media_root_that_is_not_a_directory_stops_pack_and_rejected_rows_are_summarised(tmp_path, capfd):
    """A --media-root that does not exist, or a counted root since moved, made every row with
    media ``missing_media`` and the run exit 0 with no packs; refused now. A run that rejects
    rows says so in its summary, as tokenize's does (it printed only the packs)."""
    import shutil

    root, tok = _media_corpus(tmp_path, capfd)
    code, out, err = cli(capfd, "pack", tok, "-o", tmp_path / "p1", "--media-root", tmp_path / "nowhere")
    assert (code, out) == (1, "") and err == (f"Error: --media-root {str(tmp_path / 'nowhere')!r} is not a directory; "
                                              "give the folder the media paths are relative to\n")
    (root / "c.png").unlink()
    for args in ([], ["--dry-run"]):
        code, out, err = cli(capfd, "pack", tok, "-o", tmp_path / "p2", "--workers", "1", *args)
        assert code == 0, err
        where = (" (a run lists them in errors.jsonl)" if args else
                 f"; see {tmp_path / 'p2' / '.packtool' / 'errors.jsonl'}")
        assert out.splitlines()[1] == f"1 row rejected (missing_media 1){where}", out
    shutil.move(root, tmp_path / "moved")
    code, out, err = cli(capfd, "pack", tok, "-o", tmp_path / "p3")
    assert code == 1 and f"the media root {str(root)!r} that tokenize counted from is not a directory any more; " \
                         "pass --media-root" in err
    code, out, err = cli(capfd, "pack", tok, "-o", tmp_path / "p3", "--media-root", tmp_path / "moved", "--json")
    assert code == 0 and json.loads(out)["samples_packed"] == 3, err


def test_media_copied_to_another_root_are_checked_by_size_only(tmp_path, capfd):
    """``pack --media-root COPY``: copies carry new modification times, so only sizes are
    compared there; a copy of another size is still refused."""
    import shutil

    root, tok = _media_corpus(tmp_path, capfd)
    copy = tmp_path / "copy"
    copy.mkdir()
    time.sleep(0.01)
    for f in root.iterdir():
        shutil.copy(f, copy / f.name)  # no -p: new mtimes
    (copy / "c.png").write_bytes(png_bytes(10, 10))
    code, out, err = cli(capfd, "pack", tok, "-o", tmp_path / "packed", "-q", "--workers", "1", "--json",
                         "--media-root", copy)
    assert code == 0, err
    assert json.loads(out)["samples_packed"] == 3
    assert [(e["sample_id"], e["reason"]) for e in _errors(tmp_path / "packed")] == [("rc", "media_changed")]


def test_a_media_file_swapped_for_a_link_out_of_the_root_after_tokenize(tmp_path, capfd):
    root, tok = _media_corpus(tmp_path, capfd)
    secret = tmp_path / "secret.png"
    secret.write_bytes(png_bytes(64, 48))
    (root / "b.png").unlink()
    os.symlink(secret, root / "b.png")
    code, _, err = cli(capfd, "pack", tok, "-o", tmp_path / "packed", "-q", "--workers", "1")
    assert code == 0, err
    assert [(e["sample_id"], e["reason"]) for e in _errors(tmp_path / "packed")] == [("rb", "path_outside_root")]


# ============================================================================ 6: inputs are checked against their manifest


def _flip(f: Path, at: float = 0.5) -> None:
    data = bytearray(f.read_bytes())
    data[int(len(data) * at)] ^= 0x10
    f.write_bytes(bytes(data))


def _damage(d: Path, how: str) -> str:
    files = sorted(p.name for p in d.glob("part-*.parquet"))
    first = d / files[0]
    if how == "truncated":
        first.write_bytes(first.read_bytes()[: first.stat().st_size // 2])
    elif how == "bit_flipped":
        _flip(first)
    elif how == "zero_length":
        first.write_bytes(b"")
    elif how == "swapped":
        a, b = first.read_bytes(), (d / files[1]).read_bytes()
        first.write_bytes(b)
        (d / files[1]).write_bytes(a)
    elif how == "replaced":  # another valid Parquet file
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"x": [1]}), first)
    return files[0]


DAMAGE = ["truncated", "bit_flipped", "zero_length", "swapped", "replaced"]


@pytest.mark.parametrize("how", DAMAGE)
def test_pack_checks_each_tokenized_shard_against_its_manifest(built, tmp_path, capfd, how):
    d = _copy(built, tmp_path)
    name = _damage(d["tok"], how)
    code, out, err = cli(capfd, "pack", d["tok"], "-o", tmp_path / "out", "-q", "--workers", "1")
    assert code == 1, (code, out, err)
    assert err.startswith("Error: ") and name in err and "Traceback" not in err, err
    assert not (tmp_path / "out" / ".packtool" / "manifest.json").exists()


@pytest.mark.parametrize("which", ["tok", "packed"])
@pytest.mark.parametrize("how", DAMAGE)
def test_readers_of_a_damaged_shard_say_so(built, tmp_path, capfd, which, how):
    d = _copy(built, tmp_path)
    _damage(d[which], how)
    for args in _readers(d, which, tmp_path):
        code, _, err = cli(capfd, *args)
        assert "Traceback" not in err, (args, err)
        if how == "bit_flipped" and args[0] in ("stats", "inspect", "sweep") or args[:2] == ["pack", d["tok"]] and \
                "--dry-run" in args and how == "bit_flipped":
            # these read a few columns: a flipped bit in a page they do not read goes unseen (validate sees it)
            assert code in (0, 1) and (code == 0 or err.startswith("Error: ")), (args, code, err)
        else:
            assert code == 1 and err.startswith("Error: "), (args, code, err)
        if code == 1:  # one line, which a CI log's grep for "Error:" shows whole
            assert err.count("\n") == 1 and err.endswith("\n"), (args, err)


def test_the_reader_default_check_catches_one_flipped_bit(built, tmp_path):
    """PackedDataset(verify=False) still checks sizes and Parquet page checksums: a flipped bit
    in a page raises InputError instead of yielding garbage position_ids."""
    import pyarrow.parquet as pq

    from packtool.errors import InputError
    from packtool.reader import PackedDataset

    d = _copy(built, tmp_path)
    first = sorted(d["packed"].glob("part-*.parquet"))[0]
    pristine = first.read_bytes()
    # a byte near the end of each token column's pages in the first row group, inside the page
    # data the checksum covers (fixed fractions of the file would land in the footer of a
    # shard this small, where no token is stored)
    group = pq.ParquetFile(first).metadata.row_group(0)
    chunks = [group.column(c) for c in range(group.num_columns)]
    middles = [(c.data_page_offset + c.total_compressed_size - 3) / len(pristine) for c in chunks
               if c.path_in_schema.split(".")[0] in ("compact_input_ids_i32le", "compact_target_ids_i32next",
                                                     "compact_position_ids_i32le", "run_starts_i32le", "cu_seqlens")]
    assert len(middles) == 5
    caught = 0
    for at in middles:
        first.write_bytes(pristine)
        _flip(first, at)
        try:
            rows = list(PackedDataset(d["packed"], shuffle=False))
        except InputError as exc:
            assert first.name in str(exc)
            caught += 1
            continue
        clean = list(PackedDataset(built["packed"], shuffle=False))
        for a, b in zip(rows, clean, strict=True):  # whatever got through is the true data
            assert all(np.array_equal(a[k], b[k]) for k in ("input_ids", "position_ids", "target_ids"))
    assert caught == len(middles)


# ============================================================================ 9: the machine says no


@pytest.fixture
def small_fs(tmp_path):
    """A real, small file system (tmpfs) to fill up or make read-only; skipped where this
    process may not mount (not root, or no CAP_SYS_ADMIN)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _remount(mnt: Path, opts: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{opts}", str(mnt)], check=True, capture_output=True)


def _big_corpus(tmp_path: Path, n: int = 1200) -> Path:
    return jsonl(tmp_path / "in.jsonl", [rec(f"r{i}", conversations=conv(answer=hashlib.sha256(str(i).encode())
                                                                          .hexdigest() * 8)) for i in range(n)])


def test_disk_full_in_tokenize_and_pack_is_one_error_line_then_the_same_command_resumes(tmp_path, media, capfd,
                                                                                          small_fs):
    src = _big_corpus(tmp_path)
    tok = small_fs / "tok"
    args = ["tokenize", src, "--media-root", media, "-o", tok, "-q", "--workers", "1", "--rows-per-shard", "100"]
    code, out, err = cli(capfd, *args)
    assert code == 1, err
    assert err.startswith("Error: no space left writing to") and str(tok) in err and "Traceback" not in err, err
    assert err.count("\n") == 1
    _remount(small_fs, "size=64m")
    code, _, err = cli(capfd, *args)
    assert code == 0, err
    assert not [p for d in (tok, tok / ".packtool") for p in d.glob(".*.tmp")]
    # pack into a file system that fills up
    _remount(small_fs, "size=2m")
    filler = small_fs / "filler"
    filler.write_bytes(b"\0" * (2_000_000 - sum(f.stat().st_size for f in small_fs.rglob("*") if f.is_file()) - 80_000))
    pargs = ["pack", tok, "-o", small_fs / "packed", "-q", "--workers", "1", "--max-tokens", "1024", "--packs-per-shard", "20"]
    code, _, err = cli(capfd, *pargs)
    assert code == 1 and err.startswith("Error: no space left") and "Traceback" not in err, err
    filler.unlink()
    code, _, err = cli(capfd, *pargs)
    assert code == 0, err


def test_output_under_a_read_only_directory(tmp_path, media, capfd, small_fs):
    _remount(small_fs, "ro")
    src = jsonl(tmp_path / "in.jsonl", [rec("a")])
    code, _, err = cli(capfd, "tokenize", src, "--media-root", media, "-o", small_fs / "sub" / "tok", "-q")
    assert code == 1 and err.startswith("Error: cannot write to") and "-o" in err and "Traceback" not in err, err


def test_one_input_file_named_twice_is_refused(tmp_path, media, capfd, monkeypatch):
    """The same file given twice (again, through a link, or also under a named directory) was
    read twice: every sample doubled, under duplicate ids, without a word."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    jsonl(tmp_path / "sub" / "d.jsonl", [rec("a"), rec("b")])
    os.symlink("sub/d.jsonl", tmp_path / "link.jsonl")
    for args, what in ((["sub/d.jsonl", "sub/d.jsonl"], "is named twice"),
                       (["sub/d.jsonl", "link.jsonl"], "is the same file as 'sub/d.jsonl'"),
                       (["sub", "sub/d.jsonl"], "is named twice")):
        code, out, err = cli(capfd, "tokenize", *args, "-o", "tok", "--media-root", media, "-q")
        assert (code, out) == (1, ""), (args, err)
        assert err.startswith(f"Error: input '{args[1]}' {what}, so every record in it would be read twice; name each "
                              "file once"), (args, err)
        assert not (tmp_path / "tok").exists()
    code, out, _ = cli(capfd, "tokenize", "sub", "-o", "tok", "--media-root", media, "--json")
    assert code == 0 and json.loads(out)["samples"] == 2


def test_an_unreadable_input_file_names_it(tmp_path, media, capfd, monkeypatch):
    """Permission bits do not stop root (tests may run as root), so the refusal is injected
    where the file is opened: exactly what the kernel returns to a user without the right."""
    import builtins

    src = jsonl(tmp_path / "in.jsonl", [rec("a")])
    real_open = builtins.open

    def guarded(file, *a, **k):
        if os.fspath(file) == str(src):
            raise PermissionError(13, "Permission denied", str(src))
        return real_open(file, *a, **k)

    monkeypatch.setattr(builtins, "open", guarded)
    code, _, err = cli(capfd, "tokenize", src, "--media-root", media, "-o", tmp_path / "tok", "-q", "--workers", "1")
    assert code == 1 and err == f"Error: cannot read {str(src)!r} (Permission denied); make it readable or leave it " \
                                "out of the inputs\n", err


def test_an_unreadable_directory_inside_an_input_directory_is_not_skipped(tmp_path, media, capfd, monkeypatch):
    d = tmp_path / "inputs"
    (d / "locked").mkdir(parents=True)
    jsonl(d / "a.jsonl", [rec("a")])
    jsonl(d / "locked" / "b.jsonl", [rec("b")])
    real_scandir = os.scandir

    def guarded(path="."):
        if os.fspath(path) == str(d / "locked"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", guarded)
    code, _, err = cli(capfd, "tokenize", d, "--media-root", media, "-o", tmp_path / "tok", "-q", "--workers", "1")
    assert code == 1 and "cannot list" in err and "locked" in err and "Traceback" not in err, err


def test_a_link_loop_inside_an_input_directory_is_listed_once(tmp_path, media, capfd):
    d = tmp_path / "inputs"
    d.mkdir()
    jsonl(d / "a.jsonl", [rec("a")])
    os.symlink(d, d / "loop")
    code, out, err = cli(capfd, "tokenize", d, "--media-root", media, "-o", tmp_path / "tok", "-q", "--workers", "1",
                         "--json")
    assert code == 0 and json.loads(out)["samples"] == 1, err


# ============================================================================ 10: one run per output directory


@pytest.mark.parametrize("stage", ["tokenize", pytest.param("pack", marks=pytest.mark.jit)])
def test_a_second_run_into_the_same_directory_is_refused_naming_the_first(tmp_path, media, capfd, stage):
    import socket

    cmd, out = _long_stage(tmp_path, media, stage)
    first = subprocess.Popen([sys.executable, "-m", "packtool", *map(str, cmd)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (out / ".packtool" / "run.json").exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    assert first.poll() is None, "the first run finished before the second could start"
    code, _, err = cli(capfd, *cmd)
    assert code == 1, err
    assert f"pid {first.pid} on {socket.gethostname()}" in err and "another packtool run" in err
    assert "Traceback" not in err
    _, stderr = first.communicate(timeout=120)
    assert first.returncode == 0, stderr
    assert cli(capfd, "validate", out, "--no-check-media")[0] == 0


def test_a_killed_run_leaves_no_lock_behind(tmp_path, media):
    src = _corpus(tmp_path, media, 3000)
    cmd = ["tokenize", src, "--media-root", media, "-o", tmp_path / "tok", "-q", "--workers", "1", "--rows-per-shard",
           "100"]
    proc = subprocess.Popen([sys.executable, "-m", "packtool", *map(str, cmd)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    while not (tmp_path / "tok" / ".packtool" / "run.json").exists() and proc.poll() is None:
        time.sleep(0.002)
    proc.kill()
    proc.wait()
    r = run(*cmd)
    assert r.returncode == 0, r.stderr


# ============================================================================ every bad input, through the CLI


def test_every_bad_input_through_the_cli_prints_no_traceback(tmp_path, capfd):
    """Every bad row, media file and compressed file of the suites above goes through the real
    console entry point in one tokenize run (then pack, stats, validate); and every damaged or
    escaping manifest through the commands that read it. Exit codes are 0 (rows rejected and
    counted) or 1 with one ``Error:`` line; stderr never holds a traceback."""
    import base64

    from test_bad_input import (
        _CONV,
        _VCONV,
        IMAGE_CASES,
        RECORD_CASES,
        SUPPORTED_IMAGES,
        UNSUPPORTED_IMAGES,
        VIDEO_CASES,
        VIDEO_TRICKS,
        image_rec,
        jpeg_bytes,
        png_declaring,
        video,
        video_rec,
    )
    from test_bad_input import png_bytes as thin_png

    root = tmp_path / "media"
    root.mkdir()
    (root / "ok.png").write_bytes(png_bytes(64, 48))
    jpg = jpeg_bytes()
    (root / "truncated.jpg").write_bytes(jpg[: len(jpg) // 2])
    (root / "wrong-header.png").write_bytes(b"GIF89a" + png_bytes(64, 48)[6:])
    (root / "empty.png").write_bytes(b"")
    (root / "bomb.png").write_bytes(png_declaring(100_000, 100_000))
    (root / "thin.png").write_bytes(thin_png(1, 70_000, "L"))
    video(root / "ok.mp4")
    video(root / "audio-only.mp4", audio_only=True)
    video(root / "zero-frames.avi", n_frames=0)
    whole = video(root / "whole.mp4", n_frames=40).read_bytes()
    (root / "truncated.mp4").write_bytes(whole[: len(whole) // 3])
    (tmp_path / "outside.png").write_bytes(png_bytes())
    os.symlink(tmp_path / "outside.png", root / "link.png")
    video(tmp_path / "outside.mp4")
    for name, make in {**UNSUPPORTED_IMAGES, **SUPPORTED_IMAGES}.items():
        (root / name).write_bytes(make())
    for name, payload in VIDEO_TRICKS.items():
        (root / name).write_bytes(payload if payload is not None else png_bytes())

    lines = [json.dumps(rec("good-first")).encode()]
    lines += [line.replace(b"%s", _CONV).replace(b"%v", _VCONV) for line, _ in RECORD_CASES.values()]
    lines += [json.dumps(image_rec(k, path)).encode() for k, (path, _) in IMAGE_CASES.items()]
    lines += [json.dumps(video_rec(k, path)).encode() for k, (path, _) in VIDEO_CASES.items()]
    lines += [json.dumps(image_rec(name, name)).encode() for name in [*UNSUPPORTED_IMAGES, *SUPPORTED_IMAGES]]
    lines += [json.dumps(video_rec(name, name)).encode() for name in VIDEO_TRICKS]
    lines += [json.dumps(image_rec(f"inline{i}", f"data:image/png;base64,{base64.b64encode(b).decode()}")).encode()
              for i, b in enumerate([b"junk", png_bytes()[:40], _eps()])]
    lines += [b"{not json", b'{"id": "latin1", "conversations": [{"from": "human", "value": "caf\xe9"}]}', b"[1, 2]",
              b'"a string"', b"null", b"{" * 100_000, json.dumps(rec("good-last")).encode()]
    inputs = [jsonl(tmp_path / "bad.jsonl", lines)]
    for name in ("not-gzip.jsonl.gz", "bad-crc.jsonl.gz", "garbage.jsonl.zst", "cut.jsonl.zst", "not-parquet.parquet",
                 "empty.parquet"):
        (tmp_path / name).write_bytes(_not_its_compression(name))
        inputs.append(tmp_path / name)
    (tmp_path / "array.json").write_bytes(b"[" + json.dumps(rec("arr")).encode() + b", 7, {\"id\": \"x\\udc80\"}]")
    (tmp_path / "broken.json").write_bytes(b"[{\"id\": 1},")
    inputs += [tmp_path / "array.json", tmp_path / "broken.json"]

    tok, packed = tmp_path / "tok", tmp_path / "packed"
    r = run("tokenize", *inputs, "--media-root", root, "-o", tok, "--workers", "2", "--json", "--rows-per-shard", "16")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    counts = json.loads(r.stdout)
    assert counts["rows_in"] == counts["samples"] + counts["rejected"]
    assert counts["rejected"] >= len(lines) - 2 - len(SUPPORTED_IMAGES) - 1
    reasons = set(json.loads((tok / ".packtool" / "manifest.json").read_text())["counts"]["rejected_by_reason"])
    assert {"bad_json", "bad_encoding", "bad_record", "corrupt_file", "unsupported_media", "corrupt_image",
            "corrupt_video", "missing_media", "path_outside_root", "image_too_large", "bad_aspect_ratio"} <= reasons
    for args in (["pack", tok, "-o", packed, "--max-tokens", "1024", "--workers", "2"], ["stats", tok, packed],
                 ["validate", packed], ["validate", tok], ["inspect", packed]):
        r = run(*args)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (args, r.stderr)

    # damaged and escaping directories, every reader
    import shutil

    for k, damage in enumerate(["escape", "truncated", "zero_length", "not_json", "not_an_object", "no_shards"]):
        d = {"tok": tmp_path / f"tok{k}", "packed": tmp_path / f"packed{k}"}
        shutil.copytree(tok, d["tok"])
        shutil.copytree(packed, d["packed"])
        for which in ("tok", "packed"):
            m = d[which] / ".packtool" / "manifest.json"
            if damage == "escape":
                doc = json.loads(m.read_text())
                doc["shards"][0]["file"] = "/etc/passwd"
                m.write_text(json.dumps(doc))
            elif damage in ("truncated", "zero_length"):
                _damage(d[which], damage)
            elif damage == "not_json":
                m.write_bytes(b"{\xff")
            elif damage == "not_an_object":
                m.write_text("[1, 2, 3]")
            else:
                doc = json.loads(m.read_text())
                del doc["shards"]
                m.write_text(json.dumps(doc))
            for args in _readers(d, which, tmp_path / f"scratch{k}{which}"):
                # in this process (cli.main, the same boundary the console script calls): fast, and an
                # escaping exception fails the test just as a traceback on stderr would
                code, _, err = cli(capfd, *args)
                assert "Traceback" not in err, (damage, args, err)
                assert code == 1 and err.startswith("Error: "), (damage, args, code, err)
