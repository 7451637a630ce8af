"""kill -9 at random moments of tokenize and pack: what is visible is whole, and the same
command resumes to the bytes of an uninterrupted run."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clirun import wait_for_group_exit  # noqa: E402

from bench.corpus import make_corpus  # noqa: E402
from packtool.shards import sha256_file  # noqa: E402

KILLS = 5
#: Draws of a kill point per kill before the test gives up (a draw past the end of the run is redrawn).
DRAWS = 20
#: Kill points come from this seed: a fresh one per session unless PACKTOOL_CRASH_SEED replays one.
SEED = int(os.environ.get("PACKTOOL_CRASH_SEED") or random.SystemRandom().randrange(2**32))


def command(stage: str, src: Path, out: Path, corpus: Path) -> list[str]:
    common = ["--quiet", "--workers", "2"]
    if stage == "tokenize":
        return [sys.executable, "-m", "packtool", "tokenize", str(src), "--media-root", str(corpus), "-o", str(out),
                "--rows-per-shard", "200", *common]
    return [sys.executable, "-m", "packtool", "pack", str(src), "-o", str(out), "--max-tokens", "4096",
            "--media", "reference", "--packs-per-shard", "40", *common]


def finish(cmd: list[str], replay: str = "") -> float:
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"{r.stderr} {replay}"
    return time.monotonic() - t0


def visible(d: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in d.glob("part-*.parquet")} if d.is_dir() else {}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("crash")
    corpus = base / "corpus"
    make_corpus(corpus, 3000, seed=9)
    ref = {}
    times = {}
    for stage, src in (("tokenize", corpus / "data.jsonl"), ("pack", base / "ref-tokenize")):
        out = base / f"ref-{stage}"
        times[stage] = finish(command(stage, src, out, corpus))
        ref[stage] = out
    return corpus, base, ref, times


@pytest.mark.slow  # about 40 s: 10 killed runs and 10 resumes of the real CLI
@pytest.mark.parametrize("stage", ["tokenize", "pack"])
def test_sigkill_at_random_points_then_resume_gives_identical_shards(setup, stage):
    corpus, base, ref, times = setup
    src = corpus / "data.jsonl" if stage == "tokenize" else ref["tokenize"]
    ref_hashes = {s["file"]: s["sha256"] for s in json.loads((ref[stage] / ".packtool" / "manifest.json").read_text())["shards"]}
    n_tasks = len(list((ref[stage] / ".packtool").glob("task-*.json")))
    assert len(ref_hashes) >= 15 and n_tasks == 15
    rng = random.Random(f"{SEED}-{stage}")
    replay = f"(replay: PACKTOOL_CRASH_SEED={SEED} pytest {__file__} -k {stage})"
    print(f"{stage}: kill points from seed {SEED}")
    interrupted = 0
    for k in range(KILLS):
        out = base / f"{stage}-{k}"
        cmd = command(stage, src, out, corpus)
        # a random point of the work itself (start-up is most of a small run's time): after a
        # random number of finished tasks, plus a random fraction of a task. Tasks of a fast stage
        # can all finish inside that fraction; a draw that lands after the run ended tests
        # nothing, so it is drawn again (from the same seeded generator) on a fresh directory.
        for _ in range(DRAWS):
            after, extra = rng.randrange(0, n_tasks), rng.uniform(0.0, 0.1)
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            t0 = time.monotonic()
            while proc.poll() is None and len(list((out / ".packtool").glob("task-*.json"))) < after:
                time.sleep(0.005)
            time.sleep(extra)
            at = time.monotonic() - t0
            landed = proc.poll() is None
            if landed:
                # even kills: the whole process group (a job killed); odd: only the driver (its
                # workers notice and stop on their own)
                if k % 2 == 0:
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            wait_for_group_exit(proc.pid)
            if landed:
                interrupted += 1
                break
            shutil.rmtree(out)
        done = len(list((out / ".packtool").glob("task-*.json"))) if (out / ".packtool").is_dir() else 0
        tmp = len(list(out.glob(".*.tmp"))) if out.is_dir() else 0
        print(f"{stage} kill {k} at {at:.2f}s of {times[stage]:.2f}s: {done} tasks marked, {len(visible(out))} shards, "
              f"{tmp} temporaries")
        # whatever is visible now is a complete shard, byte for byte the one the full run writes
        for name, digest in visible(out).items():
            assert ref_hashes.get(name) == digest, f"kill at {at:.2f}s left a partial or foreign {name} {replay}"
            pq.read_metadata(out / name)
        if (out / ".packtool" / "manifest.json").exists():
            assert (out / ".packtool" / "manifest.json").read_bytes() == (ref[stage] / ".packtool" / "manifest.json").read_bytes() or stage == "pack"
        finish(cmd, replay)
        got = {s["file"]: s["sha256"] for s in json.loads((out / ".packtool" / "manifest.json").read_text())["shards"]}
        assert got == ref_hashes, f"resume after a kill at {at:.2f}s differs from the uninterrupted run {replay}"
        assert visible(out) == ref_hashes, replay
        assert (out / ".packtool" / "errors.jsonl").read_bytes() == (ref[stage] / ".packtool" / "errors.jsonl").read_bytes(), replay
        # the resume swept what the killed run was writing (manifest, markers, errors, shards)
        left = [p.name for d in (out, out / ".packtool") for p in d.glob(".*.tmp")]
        assert not left, f"kill at {at:.2f}s: temporaries left after the resume: {left} {replay}"
    assert interrupted == KILLS, f"every kill must land while the command runs {replay}"
