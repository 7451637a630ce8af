"""gs:// end to end, against a GCS emulator process (gcp-storage-emulator, ``bench/gcsserver.py``).

The CLI runs as subprocesses that reach the emulator through gcsfs over HTTP, as they would
reach Google Cloud Storage; inputs, media and outputs all live in a gs bucket. Skipped where
gcsfs or the emulator is not installed (``pip install 'packtool[gcs]' gcp-storage-emulator``).
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gcsfs")
pytest.importorskip("gcp_storage_emulator")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.corpus import make_corpus  # noqa: E402
from bench.gcsserver import gcs_server  # noqa: E402
from packtool import storage  # noqa: E402
from packtool.reader import PackedDataset  # noqa: E402
from packtool.runs import read_expanded  # noqa: E402
from tests.bucket_ranks import assert_planned_once, manifest_shards, run_two_ranks  # noqa: E402

BUCKET = "data"
TOK_FLAGS = ["--rows-per-shard", "100", "--workers", "2", "--quiet"]
PACK_FLAGS = ["--max-tokens", "4096", "--packs-per-shard", "20", "--workers", "2", "--quiet"]


@pytest.fixture(scope="module")
def gcs():
    with gcs_server() as server:
        server.filesystem().mkdir(BUCKET)
        yield server


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv(storage.CACHE_ENV, str(tmp_path / "cache"))


def cli(gcs, *args: str, cache: Path, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "packtool", *args], env={**gcs.env, storage.CACHE_ENV: str(cache)},
                       capture_output=True, text=True, timeout=300)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def objects(gcs, prefix: str) -> dict[str, bytes]:
    fs = gcs.filesystem()
    root = f"{BUCKET}/{prefix}"
    return {name[len(root) + 1:]: fs.cat_file(name) for name in fs.find(root)}


@pytest.fixture(scope="module")
def runs(gcs, tmp_path_factory):
    """The same corpus tokenized and packed twice: on local paths, and with inputs, media and
    outputs in gs://data."""
    base = tmp_path_factory.mktemp("gcs")
    corpus = base / "corpus"
    corpus.mkdir()
    make_corpus(corpus, 300, seed=15)
    gcs.filesystem().put(str(corpus), f"{BUCKET}/corpus", recursive=True)
    cache = base / "cache"
    cli(gcs, "tokenize", str(corpus / "data.jsonl"), "--media-root", str(corpus), "-o", str(base / "tok"), *TOK_FLAGS,
        cache=cache)
    cli(gcs, "pack", str(base / "tok"), "-o", str(base / "packed"), *PACK_FLAGS, cache=cache)
    tok = cli(gcs, "tokenize", f"gs://{BUCKET}/corpus/data.jsonl", "--media-root", f"gs://{BUCKET}/corpus",
              "-o", f"gs://{BUCKET}/tok", *TOK_FLAGS, "--json", cache=cache)
    pack = cli(gcs, "pack", f"gs://{BUCKET}/tok", "-o", f"gs://{BUCKET}/packed", *PACK_FLAGS, "--json", cache=cache)
    return base, json.loads(tok.stdout), json.loads(pack.stdout)


@pytest.mark.slow  # a server process, two tokenize and two pack runs of the real CLI
def test_gs_pipeline_writes_the_bytes_of_a_local_run_and_reads_back_in_its_order(gcs, runs):
    base, tok_json, pack_json = runs
    local_tok = json.loads((base / "tok" / ".packtool" / "manifest.json").read_text())
    local_packed = json.loads((base / "packed" / ".packtool" / "manifest.json").read_text())
    assert tok_json["rows_in"] == 300 and tok_json["samples"] == local_tok["counts"]["samples"]
    assert pack_json["packs"] == local_packed["counts"]["packs"] > 5

    packed = objects(gcs, "packed")
    assert manifest_shards(json.loads(packed[".packtool/manifest.json"])) == manifest_shards(local_packed)
    shards = sorted(n for n in packed if n.startswith("part-"))
    assert shards == sorted(s["file"] for s in local_packed["shards"]) and len(shards) > 2
    for name in shards:
        assert packed[name] == (base / "packed" / name).read_bytes(), name
    assert not [n for n in packed if "lease" in n or "plan.lock" in n or n.endswith(".tmp")]

    # tokenized shards: the same rows; the recorded source is the URL
    tok = objects(gcs, "tok")
    for s in local_tok["shards"]:
        a = read_expanded(base / "tok" / s["file"])
        b = read_expanded(io.BytesIO(tok[s["file"]]))
        for col in ("sample_id", "source_row", "input_ids", "target_ids", "position_ids"):
            assert a[col].equals(b[col]), (s["file"], col)
        assert set(b["source"].to_pylist()) == {f"gs://{BUCKET}/corpus/data.jsonl"}

    # validate and stats read the bucket as they read the local run
    cache = base / "cache"
    report = json.loads(cli(gcs, "validate", f"gs://{BUCKET}/packed", "--json", cache=cache).stdout)
    assert report["ok"] and report["shards"] == len(shards)
    remote = json.loads(cli(gcs, "stats", f"gs://{BUCKET}/packed", "--json", cache=cache).stdout)
    here = json.loads(cli(gcs, "stats", str(base / "packed"), "--json", cache=cache).stdout)
    assert remote["tokenized"] == f"gs://{BUCKET}/tok" and remote["sources"][0]["source"] == f"gs://{BUCKET}/corpus/data.jsonl"
    assert remote == {**here, "tokenized": remote["tokenized"], "packed": remote["packed"],
                      "sources": [{**here["sources"][0], "source": remote["sources"][0]["source"]}]}

    # the reader streams the bucket in the local order, rank split included
    for rank in range(2):
        local = list(PackedDataset(base / "packed", rank=rank, world_size=2, seed=3))
        remote = list(PackedDataset(f"gs://{BUCKET}/packed", rank=rank, world_size=2, seed=3, cache_bytes=64 << 10))
        assert [r["pack_index"] for r in remote] == [r["pack_index"] for r in local] and len(local) > 2
        assert all(np.array_equal(x["input_ids"], y["input_ids"]) for x, y in zip(local, remote, strict=True))


@pytest.mark.slow
def test_a_second_run_into_a_gs_prefix_is_refused_while_the_first_holds_it(gcs, runs):
    """The run lease is an object made by a conditional create (``ifGenerationMatch=0``): held
    by a live run, a second run of the same rank is refused, naming the holder."""
    from packtool.publication import BucketLock

    fs, root = storage.filesystem(f"gs://{BUCKET}/held")
    lease = BucketLock(fs, f"{root}/.packtool/lease-00000.json", ttl_s=120.0)
    assert lease.try_take() is None
    try:
        r = cli(gcs, "tokenize", f"gs://{BUCKET}/corpus/data.jsonl", "--media-root", f"gs://{BUCKET}/corpus", "-o",
                f"gs://{BUCKET}/held", *TOK_FLAGS, cache=runs[0] / "held-cache", check=False)
        assert r.returncode == 1
        assert f"'gs://{BUCKET}/held' is being written by another packtool run (pid " in r.stderr
        assert "wait for it to finish, or choose another -o" in r.stderr
        assert json.loads(fs.cat_file(f"{root}/.packtool/lease-00000.json"))["token"] == lease.token
    finally:
        lease.release()
    assert not [n for n in objects(gcs, "held") if n.startswith("part-")]


@pytest.mark.slow  # two CLI processes at once against the emulator
def test_two_ranks_into_a_gs_prefix_plan_once_and_write_what_one_run_writes(gcs, runs, tmp_path):
    prefix = f"ranks-{tmp_path.name}"  # new on every call, so the test can be repeated
    base = [sys.executable, "-m", "packtool", "-v", "tokenize", f"gs://{BUCKET}/corpus/data.jsonl", "--media-root",
            f"gs://{BUCKET}/corpus", "-o", f"gs://{BUCKET}/{prefix}", *TOK_FLAGS, "--world-size", "2"]
    assert_planned_once(run_two_ranks(base, gcs.env, tmp_path), n_tasks=3)
    done = objects(gcs, prefix)
    assert ".packtool/plan.lock" not in done and not [n for n in done if "lease" in n]
    one = json.loads(objects(gcs, "tok")[".packtool/manifest.json"])
    assert manifest_shards(json.loads(done[".packtool/manifest.json"])) == manifest_shards(one)
