"""Object storage against local disk, in the same run: the same corpus tokenized, packed and read
once from local paths and once with inputs, media and outputs in a bucket.

The bucket is moto's S3 server on localhost (``bench/s3server.py``): requests cost a local HTTP
round trip, not a data centre's, so the rates say what packtool's client side costs; the request
and byte counts are what a real store would bill. Every stage runs in-process with one worker, so
the two columns differ only in where the bytes live.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from bench.bench_probe import _images  # noqa: E402
from bench.corpus import make_corpus  # noqa: E402
from bench.s3server import s3_server, upload_dir  # noqa: E402

BUCKET = "bench"


def _timed(fn):
    from packtool.storage import RequestCounter

    RequestCounter.reset()
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0, RequestCounter.reset()


def _read_all(path, **kwargs) -> tuple[int, float]:
    from packtool.reader import PackedDataset

    ds = PackedDataset(path, shuffle=False, **kwargs)
    t0 = time.perf_counter()
    n = sum(1 for _ in ds)
    return n, n / (time.perf_counter() - t0)


def probe_costs(root: Path, n: int) -> dict:
    """Requests and bytes per remote image probe (the bucket holds ``root/probe/*``)."""
    from packtool.media import probe_image
    from packtool.storage import RemoteRoot, RequestCounter

    files = sorted((root / "probe").iterdir())
    remote = RemoteRoot(f"s3://{BUCKET}/probe")
    RequestCounter.reset()
    t0 = time.perf_counter()
    for f in files:
        probe_image(remote.file(f.name))
    elapsed = time.perf_counter() - t0
    requests, n_bytes = RequestCounter.reset()
    t0 = time.perf_counter()
    for f in files:
        probe_image(f)
    local_s = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in files)
    return {"n": n, "requests": requests / n, "bytes": n_bytes / n, "file_bytes": size / n,
            "remote_per_s": n / elapsed, "local_per_s": n / local_s}


def run(quick: bool = False) -> str:
    n_rows, n_probe = (600, 16) if quick else (3000, 64)
    saved = os.environ.get("PACKTOOL_CACHE")
    with tempfile.TemporaryDirectory() as tmp, s3_server() as server:
        base = Path(tmp)
        os.environ["PACKTOOL_CACHE"] = str(base / "cache")
        try:
            table = _measure(base, server, n_rows, n_probe)
        finally:
            if saved is None:
                os.environ.pop("PACKTOOL_CACHE", None)
            else:
                os.environ["PACKTOOL_CACHE"] = saved
    return table


def _measure(base: Path, server, n_rows: int, n_probe: int) -> str:
    from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset

    if True:
        corpus = base / "corpus"
        make_corpus(corpus, n_rows, seed=1)
        (base / "probe").mkdir()
        for p in _images(base / "probe", n_probe):
            p.rename(base / "probe" / p.name)
        client = server.client()
        client.create_bucket(Bucket=BUCKET)
        upload_dir(client, corpus, BUCKET, "corpus")
        upload_dir(client, base / "probe", BUCKET, "probe")
        tok_cfg = {"rows_per_shard": 500}
        pack_cfg = PackConfig(max_tokens=8192, packs_per_shard=64)

        _, tok_local_s, _ = _timed(lambda: tokenize_dataset(
            [corpus / "data.jsonl"], base / "tok", TokenizeConfig(media_root=str(corpus), **tok_cfg), workers=1))
        _, tok_s3_s, tok_req = _timed(lambda: tokenize_dataset(
            [f"s3://{BUCKET}/corpus/data.jsonl"], f"s3://{BUCKET}/tok",
            TokenizeConfig(media_root=f"s3://{BUCKET}/corpus", **tok_cfg), workers=1))
        packed, pack_local_s, _ = _timed(lambda: pack_dataset(base / "tok", base / "packed", pack_cfg, workers=1))
        _, pack_s3_s, pack_req = _timed(lambda: pack_dataset(f"s3://{BUCKET}/tok", f"s3://{BUCKET}/packed", pack_cfg,
                                                             workers=1))
        n_packs = packed["counts"]["packs"]
        # the reader: local disk, then the bucket on a cold cache, then the same cache warm
        _read_all(base / "packed")  # page cache and imports warmed for the local baseline
        _, local_rate = _read_all(base / "packed")
        shutil.rmtree(base / "cache" / "reader", ignore_errors=True)
        _, cold_rate = _read_all(f"s3://{BUCKET}/packed")
        _, warm_rate = _read_all(f"s3://{BUCKET}/packed")
        probe = probe_costs(base, n_probe)
        packed_bytes = sum(s["bytes"] for s in packed["shards"])
    rows = [
        f"Corpus: {n_rows:,} LLaVA records (bench/corpus.py), {n_packs:,} packs of 8,192 tokens "
        f"({packed_bytes / 1e6:.1f} MB, media embedded); one worker; bucket = moto S3 server on localhost.",
        "",
        "| what | local disk | bucket | bucket / local |",
        "| --- | ---: | ---: | ---: |",
        f"| tokenize (inputs, media, output in the bucket) | {n_rows / tok_local_s:,.0f} samples/s | "
        f"{n_rows / tok_s3_s:,.0f} samples/s | {tok_local_s / tok_s3_s:.2f} |",
        f"| pack (tokenized input and output in the bucket, media embedded from it) | {n_rows / pack_local_s:,.0f} "
        f"samples/s | {n_rows / pack_s3_s:,.0f} samples/s | {pack_local_s / pack_s3_s:.2f} |",
        f"| reader, cold cache | {local_rate:,.0f} packs/s | {cold_rate:,.0f} packs/s | {cold_rate / local_rate:.2f} |",
        f"| reader, warm cache | {local_rate:,.0f} packs/s | {warm_rate:,.0f} packs/s | {warm_rate / local_rate:.2f} |",
        f"| image probe ({probe['n']} JPEG/PNG, mean {probe['file_bytes'] / 1e3:,.0f} kB) | "
        f"{probe['local_per_s']:,.0f} images/s | {probe['remote_per_s']:,.0f} images/s | "
        f"{probe['remote_per_s'] / probe['local_per_s']:.2f} |",
        "",
        "| requests to the store | requests | MB moved | per sample |",
        "| --- | ---: | ---: | ---: |",
        f"| tokenize | {tok_req[0]:,} | {tok_req[1] / 1e6:.1f} | {tok_req[0] / n_rows:.3f} |",
        f"| pack | {pack_req[0]:,} | {pack_req[1] / 1e6:.1f} | {pack_req[0] / n_rows:.3f} |",
        f"| image probe, per image | {probe['requests']:.2f} | {probe['bytes'] / 1e6:.4f} "
        f"({probe['bytes'] / probe['file_bytes']:.1%} of the file) | |",
    ]
    return "\n".join(rows)
