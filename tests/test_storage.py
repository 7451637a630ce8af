"""Object storage: every path a URL, against a real S3-compatible server process.

The server is moto's server mode started as its own process on a free localhost port
(``bench/s3server.py``); the CLI runs as subprocesses that reach it over HTTP the way they
would reach S3 or MinIO. gs:// runs end to end against a GCS emulator in tests/test_gcs.py.
"""

from __future__ import annotations

import io
import json
import os
import posixpath
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.corpus import make_corpus  # noqa: E402
from bench.s3server import s3_server, upload_dir  # noqa: E402
from packtool import storage  # noqa: E402
from packtool.errors import ConfigError, SampleError  # noqa: E402
from packtool.media import probe_image, probe_video  # noqa: E402
from packtool.reader import PackedDataset  # noqa: E402
from packtool.runs import read_expanded
from tests.bucket_ranks import assert_planned_once, manifest_shards, run_two_ranks  # noqa: E402
from tests.video_fixtures import write_video  # noqa: E402

BUCKET = "data"
#: Rows per tokenized shard and packs per packed shard: several tasks and shards from a small corpus.
TOK_FLAGS = ["--rows-per-shard", "100", "--workers", "2", "--quiet"]
PACK_FLAGS = ["--max-tokens", "4096", "--packs-per-shard", "20", "--workers", "2", "--quiet"]


# --------------------------------------------------------------------------- without a server


def test_urls_are_recognised_and_split():
    assert storage.is_url("s3://b/p") and storage.is_url("gs://b/p")
    assert not storage.is_url("tok") and not storage.is_url("file:///tmp/x") and not storage.is_url(Path("s3/x"))
    assert storage.split_url("s3://data/corpus/tok/") == ("s3", "data", "corpus/tok")
    assert storage.split_url("gs://data") == ("gs", "data", "")
    assert storage.join("s3://b/tok/", ".packtool/manifest.json") == "s3://b/tok/.packtool/manifest.json"
    assert storage.join("tok", ".packtool") == Path("tok/.packtool")
    with pytest.raises(ConfigError, match="s4://b/x.*use one of those"):
        storage.is_url("s4://b/x")
    with pytest.raises(ConfigError, match="names no bucket"):
        storage.split_url("s3:///key")


def test_storage_options_parse_nested_and_typed_values(monkeypatch):
    monkeypatch.setenv(storage.OPTIONS_ENV, "{}")  # restored afterwards: set_options writes the environment
    got = storage.set_options(["endpoint_url=http://127.0.0.1:9000", "anon=false",
                               "client_kwargs.region_name=eu-west-1", "config_kwargs.retries.max_attempts=2"])
    assert got == {"endpoint_url": "http://127.0.0.1:9000", "anon": False, "client_kwargs": {"region_name": "eu-west-1"},
                   "config_kwargs": {"retries": {"max_attempts": 2}}}
    assert storage.storage_options() == got  # kept in the environment, so pool workers see them
    with pytest.raises(ConfigError, match="write KEY=VALUE"):
        storage.set_options(["endpoint_url"])
    monkeypatch.setenv(storage.OPTIONS_ENV, "[1]")
    with pytest.raises(ConfigError, match="not a JSON object"):
        storage.storage_options()


def test_a_malformed_storage_option_is_a_usage_error(monkeypatch, capfd):
    """Exit 2 with the usage lines, as for any bad flag value (it exited 1, as a failed run)."""
    from packtool.cli import main

    monkeypatch.setenv(storage.OPTIONS_ENV, "{}")
    code = main(["--storage-option", "foo", "stats", "nowhere"])
    err = capfd.readouterr().err
    assert code == 2 and err.startswith("Usage: packtool")
    assert "--storage-option 'foo': write KEY=VALUE, e.g. endpoint_url=http://127.0.0.1:9000" in err


def test_gs_urls_need_gcsfs_or_get_its_file_system(monkeypatch):
    monkeypatch.setenv(storage.OPTIONS_ENV, "{}")  # restored afterwards: set_options writes the environment
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match=r"needs the gcsfs package; pip install 'packtool\[gcs\]'"):
            storage.filesystem("gs://bucket/tok")
    else:
        # anonymous: without it gcsfs probes for credentials, the metadata server included (15 s offline)
        monkeypatch.setenv(storage.OPTIONS_ENV, '{"token": "anon"}')
        fs, path = storage.filesystem("gs://bucket/tok")
        assert "gs" in fs.protocol and path == "bucket/tok"


def test_a_gcs_key_file_that_is_not_there_is_one_error_line(monkeypatch, tmp_path):
    """``--storage-option token=key.json`` naming no file gave a traceback: gcsfs took the path
    for a raw access token and asked Google to check it; a ``GOOGLE_APPLICATION_CREDENTIALS``
    naming no file was skipped for anonymous access, failing later as access denied."""
    pytest.importorskip("gcsfs")
    monkeypatch.setattr(storage, "_FILESYSTEMS", {})
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    missing = str(tmp_path / "key.json")
    monkeypatch.setenv(storage.OPTIONS_ENV, json.dumps({"token": missing}))
    with pytest.raises(ConfigError) as err:
        storage.filesystem("gs://bucket/tok")
    assert str(err.value) == (f"--storage-option token={missing!r}: no such file; pass the path of a service-account "
                              "key file (JSON), or token=anon for public buckets")
    monkeypatch.setenv(storage.OPTIONS_ENV, "{}")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", missing)
    with pytest.raises(ConfigError) as err:
        storage.filesystem("gs://bucket/tok")
    assert str(err.value) == (f"GOOGLE_APPLICATION_CREDENTIALS={missing!r}: no such file; point it at a "
                              "service-account key file (JSON), or unset it")


@pytest.mark.slow  # gcsfs retries a refused connection six times, backing off: about 35 s
def test_an_unreachable_gcs_endpoint_is_one_error_line_naming_its_variable(tmp_path):
    """A gs:// endpoint that refuses connections printed gcsfs's logged traceback, then an error
    naming the S3 endpoint (AWS_ENDPOINT_URL's value) and the S3 variable as the fix."""
    pytest.importorskip("gcsfs")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}", "AWS_ENDPOINT_URL": "http://127.0.0.1:1",
           storage.CACHE_ENV: str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "packtool", "--storage-option", "token=anon", "stats", "gs://data/x"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"Error: cannot reach the object store for 'gs://data/x' at http://127.0.0.1:{port} (")
    assert r.stderr.endswith("); check the endpoint (STORAGE_EMULATOR_HOST or --storage-option endpoint_url=...) and "
                             "the network\n")


def test_source_names_map_fetched_copies_back_to_their_urls(monkeypatch, tmp_path):
    monkeypatch.setenv(storage.CACHE_ENV, str(tmp_path))
    assert storage.source_name(tmp_path / "inputs" / "s3" / "data" / "corpus" / "a.jsonl") == "s3://data/corpus/a.jsonl"
    assert storage.source_name("corpus/a.jsonl") == "corpus/a.jsonl"


# --------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        server.client().create_bucket(Bucket=BUCKET)
        yield server


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv(storage.CACHE_ENV, str(tmp_path / "cache"))


def cli(s3, *args: str, cache: Path, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    run_env = {**(env or s3.env), storage.CACHE_ENV: str(cache)}
    r = subprocess.run([sys.executable, "-m", "packtool", *args], env=run_env, capture_output=True, text=True,
                       timeout=300)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def objects(s3, prefix: str) -> dict[str, bytes]:
    client = s3.client()
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        for o in page.get("Contents", []):
            out[o["Key"][len(prefix) + 1:]] = client.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read()
    return out


@pytest.fixture(scope="module")
def corpus(s3, tmp_path_factory):
    """A corpus of 600 records (images) plus two video records, local and in s3://data/corpus."""
    root = tmp_path_factory.mktemp("corpus")
    make_corpus(root, 600, seed=15)
    (root / "videos").mkdir()
    write_video(root / "videos" / "clip.mp4", 45, fps=15, size=(96, 64))
    with open(root / "data.jsonl", "a", encoding="utf-8") as fh:
        for i in range(2):
            fh.write(json.dumps({"id": f"v{i}", "video": "videos/clip.mp4", "conversations": [
                {"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": f"Grey frames {i}."}]}) + "\n")
    upload_dir(s3.client(), root, BUCKET, "corpus")
    return root


@pytest.fixture(scope="module")
def local_run(s3, corpus, tmp_path_factory):
    """The reference: the same commands on local paths."""
    base = tmp_path_factory.mktemp("local")
    cache = base / "cache"
    cli(s3, "tokenize", str(corpus / "data.jsonl"), "--media-root", str(corpus), "-o", str(base / "tok"), *TOK_FLAGS,
        cache=cache)
    cli(s3, "pack", str(base / "tok"), "-o", str(base / "packed"), *PACK_FLAGS, cache=cache)
    return base


@pytest.fixture(scope="module")
def bucket_run(s3, corpus, local_run, tmp_path_factory):
    """tokenize -> pack with inputs, media and outputs all in the bucket."""
    cache = tmp_path_factory.mktemp("bucket") / "cache"
    tok = cli(s3, "tokenize", f"s3://{BUCKET}/corpus/data.jsonl", "--media-root", f"s3://{BUCKET}/corpus",
              "-o", f"s3://{BUCKET}/tok", *TOK_FLAGS, "--json", cache=cache)
    pack = cli(s3, "pack", f"s3://{BUCKET}/tok", "-o", f"s3://{BUCKET}/packed", *PACK_FLAGS, "--json", cache=cache)
    return json.loads(tok.stdout), json.loads(pack.stdout), cache


def _media_but_times(table) -> list:
    """The media column without ``mtime_ns`` (an object's time is its upload time, not the file's)."""
    return [[{k: v for k, v in m.items() if k != "mtime_ns"} for m in row] for row in table["media"].to_pylist()]


@pytest.mark.slow  # about 30 s: two tokenize and two pack runs of the real CLI, a server process
def test_bucket_pipeline_writes_the_bytes_of_a_local_run(s3, corpus, local_run, bucket_run):
    tok_json, pack_json, _ = bucket_run
    local_tok = json.loads((local_run / "tok" / ".packtool" / "manifest.json").read_text())
    local_packed = json.loads((local_run / "packed" / ".packtool" / "manifest.json").read_text())
    assert tok_json["rows_in"] == 602 and tok_json["samples"] == local_tok["counts"]["samples"]
    assert pack_json["packs"] == local_packed["counts"]["packs"] > 10

    # packed shards: the same bytes, object for object
    packed = objects(s3, "packed")
    remote_manifest = json.loads(packed[".packtool/manifest.json"])
    assert manifest_shards(remote_manifest) == manifest_shards(local_packed)
    shards = sorted(n for n in packed if n.startswith("part-"))
    assert shards == sorted(s["file"] for s in local_packed["shards"]) and len(shards) > 3
    for name in shards:
        assert packed[name] == (local_run / "packed" / name).read_bytes(), name
    # rejected rows name their input by URL where the local run names its path
    local_errors = (local_run / "packed" / ".packtool" / "errors.jsonl").read_text()
    assert local_errors.count('"reason": "oversize"') >= 1
    assert packed[".packtool/errors.jsonl"].decode() == local_errors.replace(str(corpus / "data.jsonl"),
                                                                           f"s3://{BUCKET}/corpus/data.jsonl")
    # nothing but the run's own objects: no lease left, no temporaries
    assert not [n for n in packed if "lease" in n or n.endswith(".tmp")]

    # tokenized shards: the same rows; only the recorded source (a URL) and media times differ
    tok = objects(s3, "tok")
    for s in local_tok["shards"]:
        a = read_expanded(local_run / "tok" / s["file"])
        b = read_expanded(io.BytesIO(tok[s["file"]]))
        for col in ("sample_id", "source_row", "input_ids", "target_ids", "position_ids", "subsegment_ids"):
            assert a[col].equals(b[col]), (s["file"], col)
        assert set(b["source"].to_pylist()) == {f"s3://{BUCKET}/corpus/data.jsonl"}
        assert _media_but_times(a) == _media_but_times(b), s["file"]
    assert any(m["kind"] == "video" for row in pq.read_table(io.BytesIO(tok[local_tok["shards"][-1]["file"]]))
               ["media"].to_pylist() for m in row)


@pytest.mark.slow
def test_validate_stats_and_inspect_read_the_bucket(s3, corpus, local_run, bucket_run):
    _, _, cache = bucket_run
    report = json.loads(cli(s3, "validate", f"s3://{BUCKET}/packed", "--json", cache=cache).stdout)
    assert report["ok"] and report["shards"] > 3 and report["rows"] > 10
    remote = json.loads(cli(s3, "stats", f"s3://{BUCKET}/packed", "--json", cache=cache).stdout)
    local = json.loads(cli(s3, "stats", str(local_run / "packed"), "--json", cache=cache).stdout)
    # the bucket's packed manifest names its tokenized source by URL: stats found it, and the
    # figures are the local run's, with URLs where the local run shows paths
    assert remote["tokenized"] == f"s3://{BUCKET}/tok" and remote["packed"] == f"s3://{BUCKET}/packed"
    assert remote["sources"][0]["source"] == f"s3://{BUCKET}/corpus/data.jsonl"
    assert remote == {**local, "tokenized": remote["tokenized"], "packed": remote["packed"],
                      "sources": [{**local["sources"][0], "source": remote["sources"][0]["source"]}]}
    shown = cli(s3, "inspect", f"s3://{BUCKET}/packed", "--pack", "0", cache=cache).stdout
    assert shown == cli(s3, "inspect", str(local_run / "packed"), "--pack", "0", cache=cache).stdout


@pytest.mark.slow
def test_reader_streams_the_bucket_in_the_local_order_with_a_small_cache(s3, local_run, bucket_run, tmp_path):
    for world_size in (1, 2):
        for rank in range(world_size):
            local = PackedDataset(local_run / "packed", rank=rank, world_size=world_size, seed=3)
            remote = PackedDataset(f"s3://{BUCKET}/packed", rank=rank, world_size=world_size, seed=3,
                                   cache_bytes=64 << 10, prefetch=2)
            a, b = list(local), list(remote)
            assert [r["pack_index"] for r in a] == [r["pack_index"] for r in b] and len(a) > 5
            assert all(np.array_equal(x["input_ids"], y["input_ids"]) and x["media"] == y["media"] for x, y in zip(a, b, strict=True))
            cache = remote._group_cache()
            largest = max(n for (_, g), n in cache._lru.items() if g >= 0)
            # the cap held, the newest groups (and the footers of their shards, 64 KiB each at most) aside
            assert cache.used_bytes <= (64 << 10) + cache.keep * (largest + (64 << 10))
            assert len([k for k in cache._lru if k[1] >= 0]) <= cache.keep + 1 < sum(len(remote._group_rows(s)) for s in range(len(remote._shards)))
            # evicted groups gave their disk back: the sparse files hold little more than what is listed
            on_disk = sum(f.stat().st_blocks * 512 for f in cache.dir.glob("*.parquet"))
            assert on_disk <= cache.used_bytes + 64 * 4096, (on_disk, cache.used_bytes)
    # exact resume: a state saved mid-epoch continues where the local reader continues
    remote = PackedDataset(f"s3://{BUCKET}/packed", seed=3)
    it = iter(remote)
    for _ in range(7):
        next(it)
    state = remote.state_dict()
    again = PackedDataset(f"s3://{BUCKET}/packed", seed=3)
    again.load_state_dict(state)
    # (a local run's state does not load here: its tokenized config named local paths, so its digest differs)
    local = [r["pack_index"] for r in PackedDataset(local_run / "packed", seed=3)]
    assert [r["pack_index"] for r in again] == local[7:]


@pytest.mark.slow
def test_a_cold_reader_fetches_each_small_shard_in_one_get_and_refuses_one_of_another_size(s3, local_run, bucket_run,
                                                                                              tmp_path, monkeypatch):
    from packtool.errors import InputError
    from packtool.storage import RequestCounter

    manifest = json.loads(objects(s3, "packed")[".packtool/manifest.json"])
    n_shards = len(manifest["shards"])
    assert n_shards > 3 and max(s["bytes"] for s in manifest["shards"]) < (8 << 20)
    want = [r["pack_index"] for r in PackedDataset(local_run / "packed", seed=3)]
    RequestCounter.reset()
    got = [r["pack_index"] for r in PackedDataset(f"s3://{BUCKET}/packed", seed=3, cache_bytes=1 << 30)]
    # the manifest, then one GET per shard (footer and every row group): no HEAD, no footer apart
    assert got == want and RequestCounter.reset()[0] == 1 + n_shards
    # a shard cut short or grown since the manifest was written: both sizes named, not a decode error
    client = s3.client()
    for name, body in objects(s3, "packed").items():
        client.put_object(Bucket=BUCKET, Key=f"resized/{name}", Body=body)
    first = manifest["shards"][0]
    data = objects(s3, "packed")[first["file"]]
    for k, body in enumerate((data[:-10], data + b"\0" * 10, data[:-1], data + b"\0")):
        monkeypatch.setenv(storage.CACHE_ENV, str(tmp_path / f"resized-{k}"))
        client.put_object(Bucket=BUCKET, Key=f"resized/{first['file']}", Body=body)
        with pytest.raises(InputError, match=f"is {len(body):,} bytes but the manifest says {len(data):,}"):
            list(PackedDataset(f"s3://{BUCKET}/resized", seed=0, shuffle=False))


def test_group_cache_coalesces_neighbouring_groups_up_to_its_limit(s3, tmp_path):
    """A shard of 8 row groups of about 130 kB: fetched whole under the limit, else its footer
    apart and each GET carrying as many following groups as fit the limit."""
    import pyarrow as pa

    from packtool.reader.cache import GroupCache
    from packtool.storage import RequestCounter

    rng = np.random.default_rng(7)
    table = pa.table({"x": rng.integers(0, 2**62, size=8 * 16_000, dtype=np.int64)})
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=16_000, compression="none")
    data = buf.getvalue()
    sha = __import__("hashlib").sha256(data).hexdigest()
    s3.client().put_object(Bucket=BUCKET, Key="groups/part.parquet", Body=data)
    url = f"s3://{BUCKET}/groups/part.parquet"
    group = len(data) // 8
    for limit, want_gets in ((8 << 20, 1), (2 * group + 1000, 1 + 4), (0, 1 + 8)):
        cache = GroupCache(max_bytes=1 << 30, directory=tmp_path / f"c{limit}", coalesce_bytes=limit)
        RequestCounter.reset()
        got = [pq.ParquetFile(cache.path(url, len(data), sha, g)).read_row_group(g) for g in range(8)]
        assert RequestCounter.reset()[0] == want_gets, limit
        assert pa.concat_tables(got).equals(table)
        # every group recorded with its own size, so eviction gives back each one apart
        assert sorted(g for (_, g) in cache._lru if g >= 0) == list(range(8))


@pytest.mark.slow
def test_sigkill_mid_pack_on_the_bucket_then_resume_gives_the_same_bytes(s3, local_run, bucket_run, tmp_path):
    seed = random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    prefix = "killed"
    cache = tmp_path / "cache"
    cmd = [sys.executable, "-m", "packtool", "pack", f"s3://{BUCKET}/tok", "-o", f"s3://{BUCKET}/{prefix}", *PACK_FLAGS]
    n_tasks = json.loads((local_run / "packed" / ".packtool" / "run.json").read_text())["n_tasks"]
    after = rng.randrange(1, max(2, n_tasks - 1))
    client = s3.client()
    proc = subprocess.Popen(cmd, env={**s3.env, storage.CACHE_ENV: str(cache)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)

    def markers() -> int:
        listed = client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/.packtool/task-")
        return listed.get("KeyCount", 0)

    deadline = time.monotonic() + 120
    while proc.poll() is None and markers() < after and time.monotonic() < deadline:
        time.sleep(0.02)
    landed = proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert landed, f"the run ended before {after} tasks were marked (seed {seed})"
    killed = objects(s3, prefix)
    assert ".packtool/manifest.json" not in killed, f"a killed run published a manifest (seed {seed})"
    assert any(n.startswith(".packtool/lease-") for n in killed)  # left behind by the dead run
    ref = {s["file"]: (local_run / "packed" / s["file"]).read_bytes()
           for s in json.loads((local_run / "packed" / ".packtool" / "manifest.json").read_text())["shards"]}
    for name, data in killed.items():  # whatever the killed run uploaded is whole
        if name.startswith("part-"):
            assert data == ref[name], f"{name} differs after the kill (seed {seed})"
    # the same command resumes: the dead run's lease (this host, its pid gone) is taken over
    r = cli(s3, *cmd[3:], cache=cache)
    assert r.returncode == 0
    done = objects(s3, prefix)
    assert {n: d for n, d in done.items() if n.startswith("part-")} == ref, f"resume differs (seed {seed})"
    assert not [n for n in done if "lease" in n]


@pytest.mark.slow  # two CLI processes at once against the server
def test_ranks_on_machines_of_their_own_plan_once_through_the_bucket(s3, bucket_run, tmp_path):
    """Two ranks into one prefix, each with its own local state (as on two machines): the plan
    lives in the bucket, so one rank plans and the other reads its plan; together they write
    what one run writes. The prefix is new on every call, so the test can be repeated."""
    prefix = f"ranks-{tmp_path.name}"
    base = [sys.executable, "-m", "packtool", "-v", "tokenize", f"s3://{BUCKET}/corpus/data.jsonl", "--media-root",
            f"s3://{BUCKET}/corpus", "-o", f"s3://{BUCKET}/{prefix}", *TOK_FLAGS, "--world-size", "2"]
    # exactly one rank plans, the other reads its plan (the lock trace is in the logs shown on failure)
    assert_planned_once(run_two_ranks(base, s3.env, tmp_path), n_tasks=7)
    # no local state held the plan: neither machine's folders have one
    assert not list(tmp_path.rglob("plan.json")) and not list(tmp_path.rglob("plan.lock"))
    done = objects(s3, prefix)
    plan = json.loads(done[".packtool/plan.json"])
    assert {sl[0] for task in plan["tasks"] for sl in task} == {f"s3://{BUCKET}/corpus/data.jsonl"}
    assert ".packtool/plan.lock" not in done
    one = json.loads(objects(s3, "tok")[".packtool/manifest.json"])
    assert manifest_shards(json.loads(done[".packtool/manifest.json"])) == manifest_shards(one)


@pytest.mark.slow  # two mixture packs of the real CLI
def test_a_mixture_from_and_into_the_bucket_writes_the_bytes_of_the_local_mixture(s3, local_run, bucket_run, tmp_path):
    # two sources: the bucket's own tokenized run (media in the bucket) and a copy of the local
    # run's (media on local disk), against the local run's directory and a copy of it (the same
    # directory twice is refused)
    upload_dir(s3.client(), local_run / "tok", BUCKET, "tok-l")
    shutil.copytree(local_run / "tok", tmp_path / "tok-copy")
    mix = ["--rates", "1.0,0.5", "--samples-per-task", "250", "--max-tokens", "4096", "--packs-per-shard", "20",
           "--workers", "2", "--quiet"]
    local = tmp_path / "mixed"
    cli(s3, "pack", str(local_run / "tok"), str(tmp_path / "tok-copy"), "-o", str(local), *mix, cache=tmp_path / "c1")
    r = cli(s3, "pack", f"s3://{BUCKET}/tok", f"s3://{BUCKET}/tok-l", "-o", f"s3://{BUCKET}/mixed", *mix, "--json",
            cache=tmp_path / "c2")
    want = json.loads((local / ".packtool" / "manifest.json").read_text())
    got = objects(s3, "mixed")
    manifest = json.loads(got[".packtool/manifest.json"])
    assert manifest_shards(manifest) == manifest_shards(want) and len(want["shards"]) > 3
    for entry in want["shards"]:
        assert got[entry["file"]] == (local / entry["file"]).read_bytes(), entry["file"]
    assert json.loads(r.stdout)["packs"] == want["counts"]["packs"]
    assert [s["realised"] for s in manifest["mixture"]["sources"]] == [s["realised"] for s in want["mixture"]["sources"]]
    assert [s["path"] for s in manifest["mixture"]["sources"]] == [f"s3://{BUCKET}/tok", f"s3://{BUCKET}/tok-l"]
    assert not [n for n in got if "lease" in n or n.endswith(".tmp")]
    # the tasks removed the copies of the source shards they fetched
    assert not list((tmp_path / "c2" / "shards").glob("*.parquet"))
    # stats reads the mixture in the bucket as it reads the local one
    remote = json.loads(cli(s3, "stats", f"s3://{BUCKET}/mixed", "--json", cache=tmp_path / "c2").stdout)
    here = json.loads(cli(s3, "stats", str(local), "--json", cache=tmp_path / "c2").stdout)
    def unnamed(report: dict) -> list[dict]:
        return [{k: v for k, v in s.items() if k not in ("source", "path")} for s in report["mixture"]["sources"]]

    assert unnamed(remote) == unnamed(here) and remote["packs"] == here["packs"]
    assert [s["source"] for s in remote["mixture"]["sources"]] == [f"s3://{BUCKET}/tok", f"s3://{BUCKET}/tok-l"]


@pytest.mark.slow
def test_copies_of_a_bucket_source_avoid_its_ids_as_a_local_sources_do(s3, tmp_path):
    """The pack driver reads a copied source's ids of a copy's shape from the bucket (the one
    column, not the shards): a record ``x#c1`` beside ``x`` gives copy 1 of ``x`` the name
    ``x#c1#d1``, as from local disk."""
    from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset
    from packtool.mixture import Mixture

    records = [{"id": sid, "conversations": [{"from": "human", "value": f"About {sid}?"},
                                             {"from": "gpt", "value": "Fine."}]} for sid in ("x", "x#c1", "y")]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenize_dataset([tmp_path / "a.jsonl"], tmp_path / "tok", TokenizeConfig(rows_per_shard=2))
    upload_dir(s3.client(), tmp_path / "tok", BUCKET, "copies-tok")
    names = []
    for src in (str(tmp_path / "tok"), f"s3://{BUCKET}/copies-tok"):
        out = tmp_path / f"out{len(names)}"
        pack_dataset(Mixture.from_rates([src], "2"), out, PackConfig(max_tokens=64), workers=1)
        names.append(sorted(i for f in sorted(out.glob("part-*.parquet"))
                            for row in pq.read_table(f, columns=["sample_ids"])["sample_ids"].to_pylist() for i in row))
    assert names[0] == names[1] == ["x", "x#c1", "x#c1#c1", "x#c1#d1", "y", "y#c1"]


def test_a_rank_that_reads_the_stored_plan_fetches_only_its_own_inputs(s3, corpus, tmp_path):
    lines = (corpus / "data.jsonl").read_text().splitlines(keepends=True)
    client = s3.client()
    client.put_object(Bucket=BUCKET, Key="split/a.jsonl", Body="".join(lines[:200]).encode())
    client.put_object(Bucket=BUCKET, Key="split/b.jsonl", Body="".join(lines[200:]).encode())
    # tasks: a 0..200, b 0..200, b 200..400, b 400..402; rank 1 of 2 takes the second and the fourth
    base = ["-v", "tokenize", f"s3://{BUCKET}/split", "--media-root", f"s3://{BUCKET}/corpus", "-o",
            f"s3://{BUCKET}/split-tok", "--rows-per-shard", "200", "--workers", "2", "--quiet", "--world-size", "2"]
    first = cli(s3, *base, "--rank", "0", cache=tmp_path / "node0")
    assert "planned 4 tokenize tasks from 2 inputs" in first.stderr
    second = cli(s3, *base, "--rank", "1", cache=tmp_path / "node1")
    assert "read the stored plan of 4 tokenize tasks" in second.stderr
    fetched = sorted(p.name for p in (tmp_path / "node1" / "inputs").rglob("*.jsonl"))
    assert fetched == ["b.jsonl"]  # a.jsonl was listed (its size and time are in the plan's key), never read
    assert sorted(p.name for p in (tmp_path / "node0" / "inputs").rglob("*.jsonl")) == ["a.jsonl", "b.jsonl"]
    manifest = json.loads(objects(s3, "split-tok")[".packtool/manifest.json"])
    assert manifest["counts"]["rows_in"] == 602 and manifest["counts"]["tasks"] == 4


def _lease(s3, prefix: str, **holder) -> None:
    s3.client().put_object(Bucket=BUCKET, Key=f"{prefix}/.packtool/lease-00000.json", Body=json.dumps(holder).encode())


@pytest.mark.slow
def test_a_second_run_into_a_held_prefix_is_refused_and_a_dead_ones_lease_is_taken(s3, bucket_run, tmp_path):
    cache = tmp_path / "cache"
    args = ("pack", f"s3://{BUCKET}/tok", "-o", f"s3://{BUCKET}/held", *PACK_FLAGS)
    host = socket.gethostname().replace("/", "_")
    # a live run on this host (this test's own pid)
    _lease(s3, "held", pid=os.getpid(), host=host, started="then", expires=time.time() + 3600)
    r = cli(s3, *args, cache=cache, check=False)
    assert r.returncode == 1
    assert r.stderr.strip() == (f"Error: 's3://{BUCKET}/held' is being written by another packtool run (pid {os.getpid()} on "
                                f"{host}, started then); wait for it to finish, or choose another -o")
    assert "part-" not in "".join(objects(s3, "held"))  # refused before writing anything
    # a run on another host that still renews its lease
    _lease(s3, "held", pid=1, host="elsewhere", started="then", expires=time.time() + 3600)
    assert "pid 1 on elsewhere" in cli(s3, *args, cache=cache, check=False).stderr
    # ... and one that stopped renewing (its host died): taken over, the run finishes
    _lease(s3, "held", pid=1, host="elsewhere", started="then", expires=time.time() - 1)
    cli(s3, *args, cache=cache)
    assert ".packtool/manifest.json" in objects(s3, "held")


@pytest.mark.slow
def test_overwrite_on_a_bucket_replaces_the_run_and_foreign_prefixes_are_refused(s3, bucket_run, tmp_path):
    cache = tmp_path / "cache"
    base = ("pack", f"s3://{BUCKET}/tok", "-o", f"s3://{BUCKET}/over", "--packs-per-shard", "5", "--quiet")
    cli(s3, *base, "--max-tokens", "4096", cache=cache)
    first = objects(s3, "over")
    r = cli(s3, *base, "--max-tokens", "2048", cache=cache, check=False)
    assert r.returncode == 1 and "already holds a finished run with a different configuration (max_tokens: 4096 -> 2048" in r.stderr
    cli(s3, *base, "--max-tokens", "2048", "--overwrite", cache=cache)
    second = objects(s3, "over")
    manifest = json.loads(second[".packtool/manifest.json"])
    assert manifest["config"]["max_tokens"] == 2048
    # exactly the new run's shards: none of the first run's survive beside them
    assert sorted(n for n in second if n.startswith("part-")) == sorted(s["file"] for s in manifest["shards"])
    assert second != first
    s3.client().put_object(Bucket=BUCKET, Key="foreign/notes.txt", Body=b"mine")
    r = cli(s3, "pack", f"s3://{BUCKET}/tok", "-o", f"s3://{BUCKET}/foreign", "--quiet", cache=cache, check=False)
    assert r.returncode == 1 and r.stderr.startswith(f"Error: output 's3://{BUCKET}/foreign' is not empty and holds no packtool run ('notes.txt')")


def test_missing_bucket_credentials_and_endpoint_are_one_error_line(s3, tmp_path):
    cache = tmp_path / "cache"
    sample = Path(__file__).resolve().parents[1] / "examples" / "sample"
    args = ("tokenize", str(sample / "data.jsonl"), "--media-root", str(sample), "--quiet")
    r = cli(s3, *args, "-o", "s3://no-such-bucket/tok", cache=cache, check=False)
    assert (r.returncode, r.stderr) == (1, "Error: bucket 'no-such-bucket' does not exist ('s3://no-such-bucket/tok'); "
                                           "create it or fix -o\n")
    bare = {k: v for k, v in s3.env.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    bare.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"),
                AWS_EC2_METADATA_DISABLED="true")
    r = cli(s3, *args, "-o", f"s3://{BUCKET}/nocred", cache=cache, check=False, env=bare)
    assert r.returncode == 1 and r.stderr.startswith(f"Error: no credentials for 's3://{BUCKET}/nocred'; set AWS_ACCESS_KEY_ID")
    r = cli(s3, "--storage-option", "endpoint_url=http://127.0.0.1:9", "--storage-option",
            "config_kwargs.retries.max_attempts=1", *args, "-o", f"s3://{BUCKET}/x", cache=cache, check=False)
    assert r.returncode == 1 and r.stderr.startswith(f"Error: cannot reach the object store for 's3://{BUCKET}/x' at "
                                                     "http://127.0.0.1:9")
    assert "Traceback" not in r.stderr
    r = cli(s3, "pack", f"s3://{BUCKET}/nothing-here", "-o", str(tmp_path / "p"), cache=cache, check=False)
    assert (r.returncode, r.stderr) == (1, f"Error: 's3://{BUCKET}/nothing-here' has no .packtool/manifest.json; is it the "
                                           "output of packtool tokenize/pack, and did that run finish?\n")


def test_pack_into_its_own_input_spelled_another_way_is_refused_and_deletes_nothing(s3, tmp_path):
    """``pack s3://b/tok -o s3a://b/tok --overwrite`` (or ``S3://b/tok/``, ``s3://b//tok``) was not
    seen to be the input: the run replaced the tokenized run there, deleting its shards, and then
    failed on the shard it had deleted."""
    from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset

    sample = Path(__file__).resolve().parents[1] / "examples" / "sample"
    tokenize_dataset([sample / "data.jsonl"], tmp_path / "tok", TokenizeConfig(media_root=str(sample)), workers=1)
    prefix = f"self-{tmp_path.name}/tok"
    n = upload_dir(s3.client(), tmp_path / "tok", BUCKET, prefix)
    for out in (f"s3a://{BUCKET}/{prefix}", f"S3://{BUCKET}/{prefix}/", f"s3://{BUCKET}//{prefix}"):
        with pytest.raises(ConfigError, match=r"is the tokenized directory being packed; pack into another directory"):
            pack_dataset(f"s3://{BUCKET}/{prefix}", out, PackConfig(max_tokens=8192), overwrite=True, workers=1)
    assert len(objects(s3, prefix)) == n


def test_inputs_and_media_root_in_a_missing_bucket_name_the_bucket(s3, tmp_path):
    """An input or --media-root in a bucket that does not exist gave "input ... does not exist" /
    "--media-root ... is not a directory", not the missing bucket that -o and pack name."""
    sample = Path(__file__).resolve().parents[1] / "examples" / "sample"
    r = cli(s3, "tokenize", "s3://no-such-bucket/corpus/data.jsonl", "--media-root", str(sample), "-o",
            str(tmp_path / "tok"), "--quiet", cache=tmp_path / "cache", check=False)
    assert (r.returncode, r.stderr) == (1, "Error: bucket 'no-such-bucket' does not exist "
                                           "('s3://no-such-bucket/corpus/data.jsonl'); create it or fix the path\n")
    r = cli(s3, "tokenize", str(sample / "data.jsonl"), "--media-root", "s3://no-such-bucket/corpus", "-o",
            str(tmp_path / "tok"), "--quiet", cache=tmp_path / "cache", check=False)
    assert (r.returncode, r.stderr) == (1, "Error: bucket 'no-such-bucket' does not exist ('s3://no-such-bucket/corpus'); "
                                           "create it or fix the path\n")
    r = cli(s3, "tokenize", f"s3://{BUCKET}/no-such-key.jsonl", "--media-root", str(sample), "-o",
            str(tmp_path / "tok"), "--quiet", cache=tmp_path / "cache", check=False)
    assert (r.returncode, r.stderr) == (1, f"Error: input 's3://{BUCKET}/no-such-key.jsonl' does not exist\n")


def test_an_undefined_aws_profile_is_one_error_line_naming_the_fix(s3, tmp_path):
    """``AWS_PROFILE`` naming a profile the AWS config files lack gave "object store error ...:
    ProfileNotFound ...; fix the cause and run the same command again (finished tasks are kept)"."""
    env = {k: v for k, v in s3.env.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    env.update(AWS_PROFILE="nope", AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
               AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_EC2_METADATA_DISABLED="true")
    r = cli(s3, "stats", f"s3://{BUCKET}/packed", cache=tmp_path / "cache", check=False, env=env)
    assert (r.returncode, r.stderr) == (1, "Error: AWS profile 'nope' (AWS_PROFILE or --storage-option profile=...) is "
                                           "not defined in ~/.aws/config or ~/.aws/credentials (AWS_CONFIG_FILE, "
                                           "AWS_SHARED_CREDENTIALS_FILE); name a profile defined there, or unset it "
                                           "and set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or pass "
                                           "--storage-option key=... --storage-option secret=...\n")


def test_merge_of_a_bucket_names_the_url_not_its_local_mirror(s3, tmp_path):
    """``merge s3://...`` named the mirror folder it ran on (``~/.cache/packtool/mirror/<key>-<host>-<pid>``,
    gone when the command ends) in its errors."""
    from packtool import TokenizeConfig, tokenize_dataset

    sample = Path(__file__).resolve().parents[1] / "examples" / "sample"
    tokenize_dataset([sample / "data.jsonl"], tmp_path / "part", TokenizeConfig(media_root=str(sample), rows_per_shard=10),
                     rank=0, world_size=2, workers=1)
    prefix = f"merge-{tmp_path.name}"
    upload_dir(s3.client(), tmp_path / "part", BUCKET, prefix)
    r = cli(s3, "merge", f"s3://{BUCKET}/{prefix}/", "--json", cache=tmp_path / "cache", check=False)
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr == (f"Error: 's3://{BUCKET}/{prefix}/': 1 of 3 tasks is not finished (first: [1]); run rank 1 of "
                        "--world-size 2 (the same command resumes) and merge again\n")
    r = cli(s3, "merge", f"s3://{BUCKET}/no-run-here", cache=tmp_path / "cache", check=False)
    assert (r.returncode, r.stderr) == (1, f"Error: 's3://{BUCKET}/no-run-here' holds no packtool run (.packtool/run.json "
                                           "missing); run tokenize or pack into it first\n")
    from packtool.pipeline import merge_output

    with pytest.raises(storage.StorageError) as err:  # it said "holds no packtool run"
        merge_output("s3://no-such-bucket/tok")
    assert str(err.value) == "bucket 'no-such-bucket' does not exist ('s3://no-such-bucket/tok'); create it or fix the path"


def test_inspect_of_a_bucket_names_the_url_not_its_local_copy(s3, tmp_path):
    """``inspect s3://...`` gave ``"dir": "~/.cache/packtool/outputs/<key>"`` in --json and named that
    folder in its errors."""
    from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset

    sample = Path(__file__).resolve().parents[1] / "examples" / "sample"
    tokenize_dataset([sample / "data.jsonl"], tmp_path / "tok", TokenizeConfig(media_root=str(sample)), workers=1)
    pack_dataset(tmp_path / "tok", tmp_path / "packed", PackConfig(max_tokens=8192, media="reference"), workers=1)
    url = f"s3://{BUCKET}/inspect-{tmp_path.name}/packed"
    upload_dir(s3.client(), tmp_path / "packed", BUCKET, url.split("/", 3)[3])
    r = cli(s3, "inspect", url, "--json", cache=tmp_path / "cache")
    assert json.loads(r.stdout)["dir"] == url
    r = cli(s3, "inspect", url, "--pack", "9", cache=tmp_path / "cache", check=False)
    assert (r.returncode, r.stderr) == (1, f"Error: --pack 9: {url!r} has no such pack; its 4 packs are numbered 0..3 "
                                           "(pack_index = task × 1000000000 + k); pass one of those\n")


def test_a_finished_bucket_run_refused_on_rerun_names_the_url_not_its_local_mirror(s3, tmp_path):
    """Re-running into a bucket prefix that holds a finished run with other settings, or whose
    inputs changed since, named ``~/.cache/packtool/mirror/<key>-<host>-<pid>`` (gone when the
    command ends) instead of the -o the user gave."""

    from packtool import TokenizeConfig, tokenize_dataset
    from packtool.errors import ResumeMismatchError

    sample = Path(__file__).resolve().parents[1] / "examples" / "sample"
    shutil.copy(sample / "data.jsonl", tmp_path / "data.jsonl")
    url = f"s3://{BUCKET}/rerun-{tmp_path.name}/tok"
    cfg = TokenizeConfig(media_root=str(sample))
    tokenize_dataset([tmp_path / "data.jsonl"], url, cfg, workers=1)
    with pytest.raises(ResumeMismatchError) as err:
        tokenize_dataset([tmp_path / "data.jsonl"], url + "/", TokenizeConfig(media_root=str(sample), rows_per_shard=7),
                         workers=1)
    assert str(err.value) == (f"{url!r} already holds a finished run with a different configuration (rows_per_shard: "
                              "50000 -> 7); use another -o, or pass --overwrite to replace it")
    os.utime(tmp_path / "data.jsonl", ns=(1, 1))
    with pytest.raises(ResumeMismatchError) as err:
        tokenize_dataset([tmp_path / "data.jsonl"], url, cfg, workers=1)
    assert str(err.value).startswith(f"{url!r} holds a finished run of these settings, but input files changed since")


def test_a_finished_bucket_run_that_lost_a_shard_is_repaired_and_no_shard_is_deleted(s3, tmp_path, caplog):
    """A finished run in a bucket that lost a shard object (or had one cut short) was returned as
    finished by the same command, the shard still gone. Now the task that wrote it is redone and
    its shards written over the old ones: every other object stays as it was, none is deleted,
    and the prefix ends as the first run left it."""
    from packtool import TokenizeConfig, tokenize_dataset

    sample = Path(__file__).resolve().parents[1] / "examples" / "sample"
    prefix = f"repair-{tmp_path.name}/tok"
    url = f"s3://{BUCKET}/{prefix}"
    cfg = TokenizeConfig(media_root=str(sample), rows_per_shard=10)
    tokenize_dataset([sample / "data.jsonl"], url, cfg, workers=1)
    whole = objects(s3, prefix)
    shards = sorted(n for n in whole if n.startswith("part-"))
    assert len(shards) == 3
    client = s3.client()
    client.delete_object(Bucket=BUCKET, Key=f"{prefix}/{shards[1]}")
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/{shards[2]}", Body=whole[shards[2]][:500])
    untouched = client.head_object(Bucket=BUCKET, Key=f"{prefix}/{shards[0]}")["LastModified"]
    caplog.set_level("WARNING", logger="packtool.shards")
    m = tokenize_dataset([sample / "data.jsonl"], url, cfg, workers=1)
    assert [r.getMessage() for r in caplog.records] == [
        f"{url}: 2 of 3 shards of the finished run are missing or changed: {shards[1]} (missing), {shards[2]} (500 "
        f"bytes, listed {len(whole[shards[2]]):,}); redoing tasks 1, 2, which wrote them, and keeping the rest"]
    after = objects(s3, prefix)
    assert after == whole
    assert m == json.loads(whole[".packtool/manifest.json"])
    assert client.head_object(Bucket=BUCKET, Key=f"{prefix}/{shards[0]}")["LastModified"] == untouched
    # a damaged manifest object: the run is resumed from its markers, and no shard is deleted
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/.packtool/manifest.json", Body=b'{"kind": "tok')
    tokenize_dataset([sample / "data.jsonl"], url, cfg, workers=1)
    assert objects(s3, prefix) == whole


def test_a_finished_bucket_run_that_lost_its_errors_file_writes_it_again(s3, tmp_path, caplog):
    """A finished run in a bucket whose errors.jsonl object was deleted or cut short: the same
    command uploads it again, written from the tasks' error logs (the manifest object is the same
    bytes, so it is left as it is); when a task's log object is gone too, that task is redone. The
    prefix ends as the first run left it."""
    from packtool import TokenizeConfig, tokenize_dataset

    sample = Path(__file__).resolve().parents[1] / "examples" / "sample"
    src = tmp_path / "data.jsonl"
    src.write_text((sample / "data.jsonl").read_text() + "{broken\n")  # row 30: task 3
    prefix = f"errors-{tmp_path.name}/tok"
    url = f"s3://{BUCKET}/{prefix}"
    cfg = TokenizeConfig(media_root=str(sample), rows_per_shard=10)
    tokenize_dataset([src], url, cfg, workers=1)
    whole = objects(s3, prefix)
    errors = whole[".packtool/errors.jsonl"]
    assert errors.count(b"\n") == 1 and ".packtool/errors-00003.jsonl" in whole
    client = s3.client()
    manifest_at = client.head_object(Bucket=BUCKET, Key=f"{prefix}/.packtool/manifest.json")["LastModified"]
    caplog.set_level("WARNING", logger="packtool.shards")
    client.delete_object(Bucket=BUCKET, Key=f"{prefix}/.packtool/errors.jsonl")
    tokenize_dataset([src], url, cfg, workers=1)
    assert [r.getMessage() for r in caplog.records] == [
        f"{url}: the finished run's .packtool/errors.jsonl is missing; writing it again from the tasks' error logs "
        "(no task is redone)"]
    assert objects(s3, prefix) == whole
    assert client.head_object(Bucket=BUCKET, Key=f"{prefix}/.packtool/manifest.json")["LastModified"] == manifest_at
    caplog.clear()
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/.packtool/errors.jsonl", Body=errors[:20])
    client.delete_object(Bucket=BUCKET, Key=f"{prefix}/.packtool/errors-00003.jsonl")
    tokenize_dataset([src], url, cfg, workers=1)
    assert [r.getMessage() for r in caplog.records] == [
        f"{url}: the finished run's .packtool/errors.jsonl is 20 bytes, listed {len(errors)}; redoing task 3, whose "
        "error log is missing or changed, and keeping the rest"]
    assert objects(s3, prefix) == whole


def test_merge_of_a_finished_bucket_run_that_lost_a_task_log_ends(s3, tmp_path, caplog):
    """A finished run in a bucket that lost task 3's error log: with errors.jsonl whole, merge has
    nothing to do and changes no object; with errors.jsonl edited at its size too, merge removes
    the errors.jsonl object (not only its mirror's copy), so that rank 1's command finds it missing
    and redoes task 3: the prefix ends as the first run left it."""
    from packtool import TokenizeConfig, tokenize_dataset
    from packtool.errors import InputError
    from packtool.pipeline import merge_output

    sample = Path(__file__).resolve().parents[1] / "examples" / "sample"
    src = tmp_path / "data.jsonl"
    src.write_text((sample / "data.jsonl").read_text() + "{broken\n")  # row 30: task 3, rank 1's
    prefix = f"merged-{tmp_path.name}/tok"
    url = f"s3://{BUCKET}/{prefix}"
    cfg = TokenizeConfig(media_root=str(sample), rows_per_shard=10)
    for rank in (0, 1):
        tokenize_dataset([src], url, cfg, workers=1, rank=rank, world_size=2)
    whole = objects(s3, prefix)
    client = s3.client()
    client.delete_object(Bucket=BUCKET, Key=f"{prefix}/.packtool/errors-00003.jsonl")
    caplog.set_level("WARNING", logger="packtool.pipeline")
    manifest = merge_output(url)
    assert manifest == json.loads(whole[".packtool/manifest.json"])
    assert [r.getMessage() for r in caplog.records] == [
        f"{url}: the run is merged already, and its shards and .packtool/errors.jsonl are as its manifest lists them: "
        "nothing to do (the completion markers or error logs of 1 of 4 tasks (first: [3]) are gone or changed since; "
        "the merged run needs none of them, and a later repair redoes those tasks)"]
    assert objects(s3, prefix) == {k: v for k, v in whole.items() if k != ".packtool/errors-00003.jsonl"}
    edited = whole[".packtool/errors.jsonl"].replace(b"not valid JSON", b"not valid JSOM")
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/.packtool/errors.jsonl", Body=edited)
    with pytest.raises(InputError, match="removed it: run rank 1 of --world-size 2 again"):
        merge_output(url)
    assert ".packtool/errors.jsonl" not in objects(s3, prefix)
    tokenize_dataset([src], url, cfg, workers=1, rank=1, world_size=2)
    assert objects(s3, prefix) == whole


def test_bucket_urls_in_records_resolve_under_a_bucket_media_root(s3, tmp_path):
    """A record naming its image by ``s3://`` URL under a bucket --media-root was rejected as
    ``missing_media`` ("is a remote URL; download it under --media-root first") before the root
    was asked, though the URL lies under it."""
    from packtool import TokenizeConfig, tokenize_dataset

    images = Path(__file__).resolve().parents[1] / "examples" / "sample" / "images"
    prefix = f"urls-{tmp_path.name}"
    client = s3.client()
    for name, key in (("img00.png", "media/img00.png"), ("img01.jpg", "media/img01.jpg"), ("img02.png", "other/img02.png")):
        client.upload_file(str(images / name), BUCKET, f"{prefix}/{key}")
    media = [f"s3://{BUCKET}/{prefix}/media/img00.png", "img01.jpg", f"s3://{BUCKET}/{prefix}/other/img02.png"]
    with open(tmp_path / "data.jsonl", "w", encoding="utf-8") as fh:
        for i, m in enumerate(media):
            fh.write(json.dumps({"id": f"u{i}", "image": m, "conversations": [
                {"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": f"Shape {i}."}]}) + "\n")

    def rejected(out: Path) -> dict[str, tuple[str, str]]:
        lines = (out / ".packtool" / "errors.jsonl").read_text(encoding="utf-8").splitlines()
        return {e["sample_id"]: (e["reason"], e["message"]) for e in map(json.loads, lines)}

    m = tokenize_dataset([tmp_path / "data.jsonl"], tmp_path / "tok",
                         TokenizeConfig(media_root=f"s3://{BUCKET}/{prefix}/media"), workers=1)
    assert m["counts"]["samples"] == 2
    assert rejected(tmp_path / "tok") == {"u2": ("path_outside_root", f"media path {media[2]!r} resolves outside "
                                                                      f"--media-root 's3://{BUCKET}/{prefix}/media'")}
    # recorded as keys under the root, as local absolute paths are: a copy of the media under another
    # prefix (a mirror, another bucket) serves the same rows
    rows = pq.read_table(next((tmp_path / "tok").glob("part-*.parquet")), columns=["sample_id", "media"]).to_pylist()
    assert {r["sample_id"]: [m["path"] for m in r["media"]] for r in rows} == {"u0": ["img00.png"], "u1": ["img01.jpg"]}
    # a local root: the URLs are refused, naming the fix
    m = tokenize_dataset([tmp_path / "data.jsonl"], tmp_path / "tok-local", TokenizeConfig(media_root=str(images)),
                         workers=1)
    assert m["counts"]["samples"] == 1
    got = rejected(tmp_path / "tok-local")
    assert sorted(got) == ["u0", "u2"] and {r for r, _ in got.values()} == {"missing_media"}
    assert got["u0"][1] == (f"media {media[0]!r} is a bucket URL but --media-root {str(images.resolve())!r} is a local "
                            "directory; pass the bucket prefix holding it as --media-root, or download it under "
                            "--media-root")


def test_the_reader_decodes_media_packed_by_reference_under_a_bucket_media_root(s3, tmp_path):
    """``decode_media(row, media_root="s3://...")`` for a run packed with --media reference
    looked for the files under the local folder ``./s3:/...`` and said "not found under
    media_root '/cwd/s3:/...'; pass the right media_root" though the right one was passed."""
    import shutil

    from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset
    from packtool.errors import InputError
    from packtool.reader import decode_media

    sample = Path(__file__).resolve().parents[1] / "examples" / "sample"
    write_video(tmp_path / "clip.mp4", 30, fps=15, size=(96, 64))
    prefix = f"ref-{tmp_path.name}"
    upload_dir(s3.client(), sample / "images", BUCKET, f"{prefix}/images")
    s3.client().upload_file(str(tmp_path / "clip.mp4"), BUCKET, f"{prefix}/clip.mp4")
    lines = (sample / "data.jsonl").read_text(encoding="utf-8").splitlines()[:4]
    lines.append(json.dumps({"id": "v0", "video": "clip.mp4", "conversations": [
        {"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": "Grey frames."}]}))
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    root = f"s3://{BUCKET}/{prefix}"
    tokenize_dataset([tmp_path / "data.jsonl"], tmp_path / "tok", TokenizeConfig(media_root=root), workers=1)
    pack_dataset(tmp_path / "tok", tmp_path / "packed", PackConfig(max_tokens=16384, media="reference"), workers=1)
    rows = list(PackedDataset(tmp_path / "packed"))
    assert sum(len(r["media"]) for r in rows) == 5 and {m["kind"] for r in rows for m in r["media"]} == {"image", "video"}
    # the same pixels as from local copies of the files
    shutil.copytree(sample / "images", tmp_path / "local" / "images")
    shutil.copy(tmp_path / "clip.mp4", tmp_path / "local" / "clip.mp4")
    for row in rows:
        remote, local = decode_media(row, root + "/"), decode_media(row, tmp_path / "local")
        for a, b in zip(remote, local, strict=True):
            if hasattr(a, "frames"):
                assert a.timestamps == b.timestamps and len(a.frames) == len(b.frames) > 1
                a, b = a.frames[-1], b.frames[-1]
            assert a.size == b.size and a.tobytes() == b.tobytes()
    with pytest.raises(InputError) as err:
        decode_media(rows[0], f"s3://{BUCKET}/no-{prefix}")
    path = rows[0]["media"][0]["path"]
    assert str(err.value) == (f"media file {path!r} not found under media_root 's3://{BUCKET}/no-{prefix}'; pass the "
                              "right media_root")


def test_a_damaged_or_other_kind_of_manifest_in_a_bucket_names_the_url_not_its_local_copy(s3, tmp_path):
    """A bucket manifest that is not valid JSON, lacks a field or is of the other kind was named
    by its local copy (``~/.cache/packtool/outputs/<key>/.packtool/manifest.json``, or
    ``.../manifests/<key>`` for pack's input and the reader)."""
    from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset
    from packtool.errors import InputError

    sample = Path(__file__).resolve().parents[1] / "examples" / "sample"
    tokenize_dataset([sample / "data.jsonl"], tmp_path / "tok", TokenizeConfig(media_root=str(sample)), workers=1)
    base = f"manifests-{tmp_path.name}"
    upload_dir(s3.client(), tmp_path / "tok", BUCKET, f"{base}/tok")
    s3.client().put_object(Bucket=BUCKET, Key=f"{base}/cut/.packtool/manifest.json", Body=b'{"kind": "pack')
    s3.client().put_object(Bucket=BUCKET, Key=f"{base}/bare/.packtool/manifest.json",
                           Body=b'{"kind": "tokenized", "schema_version": 5}')
    url = f"s3://{BUCKET}/{base}"
    with pytest.raises(InputError, match=f"^{url}/cut/.packtool/manifest.json: manifest is not valid JSON"):
        storage.fetch_output(f"{url}/cut")
    with pytest.raises(InputError, match=f"^{url}/cut/.packtool/manifest.json: manifest is not valid JSON"):
        PackedDataset(f"{url}/cut")
    with pytest.raises(InputError) as err:
        storage.fetch_output(f"{url}/bare/")
    assert str(err.value) == (f"{url}/bare/.packtool/manifest.json: 'config' is missing or not a dict; the manifest is "
                              "damaged: re-run the stage that wrote it")
    with pytest.raises(InputError) as err:
        PackedDataset(f"{url}/tok")
    assert str(err.value) == (f"'{url}/tok' holds tokenized shards, expected packed shards; pack it first "
                              f"(`packtool pack {url}/tok -o PACKED`) and pass the packed directory")
    with pytest.raises(InputError) as err:
        pack_dataset(f"{url}/bare", tmp_path / "packed", PackConfig(max_tokens=8192), workers=1)
    assert str(err.value).startswith(f"{url}/bare/.packtool/manifest.json: 'config' is missing")


def test_a_bucket_prefix_of_inputs_skips_packtool_outputs_under_it_as_a_local_directory_does(s3, tmp_path):
    """``tokenize s3://b/corpus/`` read the shards of a run written into ``s3://b/corpus/tok`` as
    Parquet records (each rejected as ``bad_record``), and ``tokenize s3://b/corpus/tok`` was not
    refused; a local directory skips outputs under it and refuses to be one."""
    from packtool import TokenizeConfig, tokenize_dataset
    from packtool.errors import InputError

    sample = Path(__file__).resolve().parents[1] / "examples" / "sample"
    tokenize_dataset([sample / "data.jsonl"], tmp_path / "tok", TokenizeConfig(media_root=str(sample)), workers=1)
    prefix = f"nested-{tmp_path.name}/corpus"
    s3.client().upload_file(str(sample / "data.jsonl"), BUCKET, f"{prefix}/data.jsonl")
    upload_dir(s3.client(), tmp_path / "tok", BUCKET, f"{prefix}/tok")
    url = f"s3://{BUCKET}/{prefix}"
    found = storage.fetch_inputs([url + "/"], fetch=False)
    assert [storage.source_name(f) for f in found] == [f"{url}/data.jsonl"]
    with pytest.raises(InputError) as err:
        storage.fetch_inputs([f"{url}/tok"], fetch=False)
    assert str(err.value) == (f"input '{url}/tok' is a packtool output directory, not raw records; pass the corpus it "
                              "was made from (pack takes a tokenized directory)")


def test_stats_of_a_bucket_pair_in_the_wrong_order_names_the_url(s3, tmp_path):
    """``stats PACKED TOKENIZED`` with bucket URLs named the packed output's local copy in its
    error; it names the URL as given."""
    from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset

    sample = Path(__file__).resolve().parents[1] / "examples" / "sample"
    tokenize_dataset([sample / "data.jsonl"], tmp_path / "tok", TokenizeConfig(media_root=str(sample)), workers=1)
    pack_dataset(tmp_path / "tok", tmp_path / "packed", PackConfig(max_tokens=8192, media="reference"), workers=1)
    base = f"s3://{BUCKET}/stats-{tmp_path.name}"
    for name in ("tok", "packed"):
        upload_dir(s3.client(), tmp_path / name, BUCKET, f"{base}/{name}".split("/", 3)[3])
    r = cli(s3, "stats", f"{base}/packed", f"{base}/tok", cache=tmp_path / "cache", check=False)
    assert (r.returncode, r.stderr) == (1, f"Error: {base + '/packed'!r} holds packed shards; `stats TOKENIZED PACKED` "
                                           "takes the tokenized directory first\n")


# --------------------------------------------------------------------------- media probes


def _noise_jpeg(w: int, h: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def test_remote_image_probes_read_only_the_header_and_tail(s3, tmp_path):
    client = s3.client()
    files = {"big.jpg": _noise_jpeg(1600, 1200, 1)}
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(2).integers(0, 256, (700, 900, 3), dtype=np.uint8)).save(buf, format="PNG")
    files["big.png"] = buf.getvalue()
    for name, data in files.items():
        client.put_object(Bucket=BUCKET, Key=f"probe/{name}", Body=data)
        (tmp_path / name).write_bytes(data)
    root = storage.RemoteRoot(f"s3://{BUCKET}/probe")
    for name, data in files.items():
        storage.RequestCounter.reset()
        got = probe_image(root.file(name))
        requests, n_bytes = storage.RequestCounter.reset()
        assert got == probe_image(tmp_path / name)
        assert len(data) > 1_000_000
        # the directory listing (once per directory), the header block, the 4 KiB tail
        assert requests <= 3 and n_bytes <= 64 << 10, (name, requests, n_bytes)


def test_remote_video_probe_matches_the_local_one(s3, tmp_path):
    path = write_video(tmp_path / "clip.mp4", 60, fps=30, size=(128, 96))
    s3.client().put_object(Bucket=BUCKET, Key="probe/clip.mp4", Body=path.read_bytes())
    storage.RequestCounter.reset()
    remote = probe_video(storage.RemoteRoot(f"s3://{BUCKET}/probe").file("clip.mp4"))
    requests, _ = storage.RequestCounter.reset()
    assert remote == probe_video(path) and requests >= 2


def test_a_remote_video_demuxed_to_count_its_frames_is_not_held_whole_in_memory(s3, tmp_path, monkeypatch):
    """A Matroska video stores no frame count, so its probe reads the whole file; the reader kept
    every block it fetched, so a probe held the whole video in memory (a 4 GB video, 4 GB per
    worker) until the file was let go. It keeps the latest ``max_held`` bytes."""
    import av

    rng = np.random.default_rng(7)
    path = tmp_path / "noise.mkv"
    with av.open(str(path), "w", format="matroska") as out:  # noise does not compress: ~300 KB a frame
        st = out.add_stream("libx264", rate=10)
        st.width, st.height, st.pix_fmt = 640, 480, "yuv420p"
        st.options = {"preset": "ultrafast", "crf": "10"}
        for _ in range(36):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8), format="rgb24")
            for pkt in st.encode(frame):
                out.mux(pkt)
        for pkt in st.encode():
            out.mux(pkt)
    size = path.stat().st_size
    s3.client().put_object(Bucket=BUCKET, Key="probe/noise.mkv", Body=path.read_bytes())
    monkeypatch.setattr(storage.RangedReader, "max_held", 1 << 20, raising=False)
    remote = storage.RemoteRoot(f"s3://{BUCKET}/probe").file("noise.mkv")
    storage.RequestCounter.reset()
    assert probe_video(remote) == probe_video(path)
    _, n_bytes = storage.RequestCounter.reset()
    held = sum(len(data) for _, data in remote.ranges)
    assert size > 8 << 20 and n_bytes >= size  # read whole, to count its frames
    assert held < size // 2, (held, size)


def test_remote_media_paths_stay_under_the_root(s3):
    s3.client().put_object(Bucket=BUCKET, Key="probe/a.jpg", Body=_noise_jpeg(8, 8, 3))
    s3.client().put_object(Bucket=BUCKET, Key="secret/b.jpg", Body=_noise_jpeg(8, 8, 4))
    root = storage.RemoteRoot(f"s3://{BUCKET}/probe/")
    assert root.file("a.jpg").url == f"s3://{BUCKET}/probe/a.jpg"
    assert root.file(f"s3://{BUCKET}/probe/a.jpg").stat().st_size > 0  # an absolute URL under the root
    for bad in ("../secret/b.jpg", f"s3://{BUCKET}/secret/b.jpg", "s3://other/probe/a.jpg", "/etc/passwd"):
        with pytest.raises(SampleError) as err:
            root.file(bad)
        assert err.value.reason == "path_outside_root", bad
    with pytest.raises(SampleError) as err:
        root.file("missing.jpg")
    assert err.value.reason == "missing_media"


def test_of_processes_racing_for_one_bucket_lock_exactly_one_takes_it(s3):
    """The run lease and the plan lock are objects made by a conditional put: of several takers
    starting together (threads here, each with its own lock and token), exactly one holds it;
    the others are told who does. Five rounds, a fresh key each."""
    import threading

    from packtool.publication import BucketLock

    fs, path = storage.filesystem(f"s3://{BUCKET}/locks")
    for round_ in range(5):
        key = f"{path}/race-{round_}.json"
        locks = [BucketLock(fs, key, ttl_s=120.0) for _ in range(6)]
        start = threading.Barrier(len(locks))
        results: list = [None] * len(locks)

        def take(i: int, locks: list = locks, start: threading.Barrier = start, results: list = results) -> None:
            start.wait()
            results[i] = locks[i].try_take()

        threads = [threading.Thread(target=take, args=(i,)) for i in range(len(locks))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        winners = [i for i, r in enumerate(results) if r is None]
        try:
            assert len(winners) == 1, f"round {round_}: {len(winners)} takers hold the lock"
            held = json.loads(fs.cat_file(key))
            assert held["token"] == locks[winners[0]].token
            assert all(r["token"] == held["token"] for r in results if r is not None)
        finally:
            for lock in locks:
                lock.release()
        assert not fs.exists(key)


def _machine(s3):
    """A file system of its own, as a process on another machine has (its own listing cache)."""
    import fsspec

    return fsspec.filesystem("s3", skip_instance_cache=True, endpoint_url=s3.endpoint)


def test_a_rank_whose_listing_predates_the_lock_sees_its_holder_and_its_plan(s3):
    """The plan-once race of issue 15: each rank lists ``.packtool/`` when it pulls the run state,
    and s3fs answers a read of a key that a cached listing lacks with "not found", asking no
    one. The lock record and the stored plan, written by the other rank after that listing,
    must still be seen: the waiting rank names the holder, then takes the stored plan."""
    from packtool.publication import BucketLock, RemoteOutput

    url = f"s3://{BUCKET}/stale-listing"
    state = f"{BUCKET}/stale-listing/.packtool"
    here, there = _machine(s3), _machine(s3)
    for rank, fs in enumerate((here, there)):  # each rank's lease, then its listing of the state
        fs.pipe_file(f"{state}/lease-{rank:05d}.json", b"{}")
    for fs in (here, there):
        fs.ls(state, detail=True, refresh=True)
    assert f"{state}/plan.lock" not in [e["name"] for e in here.dircache[state]]

    planner = BucketLock(there, f"{state}/plan.lock", ttl_s=120.0, rank=1)
    assert planner.try_take() is None
    try:
        waiter = BucketLock(here, f"{state}/plan.lock", ttl_s=120.0, rank=0)
        holder = waiter.try_take()  # before the fix: None five times, then "keeps changing hands"
        assert holder is not None and holder["token"] == planner.token
        plan = {"kind": "tokenized", "key": "k1", "tasks": []}
        there.pipe_file(f"{state}/plan.json", json.dumps(plan).encode())
        out = RemoteOutput(url, rank=0)
        out.fs = here  # the waiting rank's own file system, listing cached
        with out.plan_slot("tokenized", "k1", lambda p: True, wait_s=0.01) as slot:
            assert slot.plan == plan
        assert json.loads(there.cat_file(f"{state}/plan.lock"))["token"] == planner.token  # never taken from it
    finally:
        planner.release()
    assert not there.exists(f"{state}/plan.lock")


def test_the_state_and_shards_of_tasks_past_99999_are_pulled_and_published(s3):
    """A run of more than 99,999 tasks names their files with six digits and more
    (``task-123456.json``): a bucket run pulls those markers and error logs as it pulls
    five-digit ones (a marker it skipped would read as a task never run), and deletes their
    shards that no manifest entry names before it publishes. Names of no task are left alone."""
    from packtool.publication import RemoteOutput
    from packtool.shards import MANIFEST

    root = f"{BUCKET}/six-digit-tasks"
    fs = _machine(s3)
    state = ["task-00001.json", "errors-00001.jsonl", "task-123456.json", "errors-123456.jsonl",
             "task-012345.json", "task-1.json", "notes.json"]
    for name in state:
        fs.pipe_file(f"{root}/.packtool/{name}", name.encode())
    for name in ("part-00001-00000.parquet", "part-123456-00000.parquet", "part-123456-00001.parquet",
                 "part-012345-00000.parquet"):
        fs.pipe_file(f"{root}/{name}", b"x")
    out = RemoteOutput(f"s3://{root}", rank=None)
    out.fs = fs
    out.pull(markers_only=True)
    pulled = {p.name: p.read_bytes() for p in (out.mirror / ".packtool").iterdir()}
    assert pulled == {n: n.encode() for n in state[:4]}
    listed = ["part-00001-00000.parquet", "part-123456-00000.parquet"]
    (out.mirror / MANIFEST).write_text(json.dumps({"shards": [{"file": n} for n in listed]}))
    out.publish()
    left = sorted(posixpath.basename(p) for p in fs.ls(root, detail=False, refresh=True) if p.endswith(".parquet"))
    assert left == ["part-00001-00000.parquet", "part-012345-00000.parquet", "part-123456-00000.parquet"]
    assert json.loads(fs.cat_file(f"{root}/{MANIFEST}"))["shards"] == [{"file": n} for n in listed]


def test_a_lock_made_by_our_own_refused_retry_is_ours(s3):
    """A client that lost the answer to its create retries it and is refused (the key exists):
    the record there carries this taker's token, so the lock is held, not waited for forever."""
    from packtool.publication import BucketLock

    fs = _machine(s3)
    key = f"{BUCKET}/own-retry/.packtool/plan.lock"
    lock = BucketLock(fs, key, ttl_s=120.0)
    fs.pipe_file(key, lock._body(), mode="create")  # the first attempt, whose answer was lost
    try:
        assert lock.try_take() is None
        assert json.loads(fs.cat_file(key))["token"] == lock.token
    finally:
        lock.release()
    assert not fs.exists(key)


@pytest.mark.slow
def test_a_manifest_published_after_this_process_listed_the_prefix_is_read(s3, bucket_run):
    """A process that listed an output's state while the run went on (a rank that finished its
    share; the last rank publishes the manifest) then reads the output: the manifest is read
    from the store, not judged absent from that listing."""
    url = f"s3://{BUCKET}/late-manifest"
    fs, root = storage.filesystem(url)  # this process's own file system, as the stages use it
    fs.pipe_file(f"{root}/.packtool/lease-00000.json", b"{}")
    fs.ls(f"{root}/.packtool", detail=True, refresh=True)
    packed = objects(s3, "packed")
    other = _machine(s3)  # the last rank, on another machine, publishes
    for name, body in sorted(packed.items(), key=lambda kv: kv[0].endswith("manifest.json")):
        other.pipe_file(f"{root}/{name}", body)
    want = json.loads(packed[".packtool/manifest.json"])
    assert storage.fetch_manifest(url)["shards"] == want["shards"]  # before the fix: "has no manifest.json"
    local = storage.fetch_output(url)
    assert json.loads((local / ".packtool" / "manifest.json").read_text())["shards"] == want["shards"]
    assert all((local / s["file"]).read_bytes() == packed[s["file"]] for s in want["shards"])
