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


def _read_rate(path, cache: Path | None = None, coalesce: bool = True) -> float:
    """Packs/s of one pass over ``path``; with ``cache``, on a cold cache. ``coalesce=False``: the
    reader's fetches as before they were coalesced (one GET per row group, the footer apart)."""
    from packtool.reader import PackedDataset
    from packtool.reader import cache as group_cache

    if cache is not None:
        shutil.rmtree(cache, ignore_errors=True)
    ds = PackedDataset(path, seed=0)
    saved = group_cache.COALESCE_BYTES
    group_cache.COALESCE_BYTES = saved if coalesce else 0
    try:
        t0 = time.perf_counter()
        n = sum(1 for _ in ds)
        return n / (time.perf_counter() - t0)
    finally:
        group_cache.COALESCE_BYTES = saved


def _reader_rates(local: Path, url: str, cache: Path, rounds: int = 5) -> tuple[float, float, float, float]:
    """Local disk, the bucket on a cold cache, the bucket on a warm cache, the bucket on a cold
    cache without coalescing (packs/s): the best of ``rounds`` rounds, the four measured in turn
    in each round, so load on the machine falls on all."""
    _read_rate(local)  # the page cache and imports warmed for the local baseline
    best = [0.0, 0.0, 0.0, 0.0]
    for _ in range(rounds):
        for i, rate in enumerate((_read_rate(local), _read_rate(url, cache), _read_rate(url),
                                  _read_rate(url, cache, coalesce=False))):
            best[i] = max(best[i], rate)
    return best[0], best[1], best[2], best[3]


def _cold_requests(url: str, cache: Path, coalesce: bool = True) -> tuple[int, int]:
    """Requests and bytes of one pass over ``url`` on a cold cache."""
    from packtool.storage import RequestCounter

    RequestCounter.reset()
    _read_rate(url, cache, coalesce)
    return RequestCounter.reset()


def _store_bandwidth(client, base: Path) -> float:
    """MB/s the server gives 4 parallel ranged GETs of one 32 MB object (what bounds a cold read)."""
    from concurrent.futures import ThreadPoolExecutor

    from packtool.storage import filesystem

    client.put_object(Bucket=BUCKET, Key="bandwidth", Body=os.urandom(32 << 20))
    fs, path = filesystem(f"s3://{BUCKET}/bandwidth")
    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: fs.cat_file(path, start=i << 22, end=(i + 1) << 22), range(8)))
    return 32 * 1.048576 / (time.perf_counter() - t0)


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
    # as tokenize does it: the batch's heads and tails fetched on 16 threads, then probed
    remote = RemoteRoot(f"s3://{BUCKET}/probe")
    t0 = time.perf_counter()
    remote.prefetch([f.name for f in files])
    for f in files:
        probe_image(remote.file(f.name))
    batched = time.perf_counter() - t0
    RequestCounter.reset()
    t0 = time.perf_counter()
    for f in files:
        probe_image(f)
    local_s = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in files)
    return {"n": n, "requests": requests / n, "bytes": n_bytes / n, "file_bytes": size / n,
            "remote_per_s": n / elapsed, "batched_per_s": n / batched, "local_per_s": n / local_s}


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


def _photos(corpus: Path) -> None:
    """Give the corpus's image pool photo-like bytes (smooth noise, JPEG q90 / PNG) at the same
    declared sizes, so packs embed realistic payloads (tens to hundreds of kB per image)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for f in sorted((corpus / "images").iterdir()):
        with Image.open(f) as im:
            w, h = im.size
        if f.suffix == ".jpg":  # a photo: smooth noise
            small = rng.integers(0, 255, (max(1, h // 16), max(1, w // 16), 3), dtype=np.uint8)
            Image.fromarray(small).resize((w, h), Image.Resampling.BILINEAR).save(f, quality=85)
        else:  # a chart or screenshot: flat areas and a few sharp blocks
            img = np.full((h, w, 3), 245, np.uint8)
            for _ in range(12):
                y, x = int(rng.integers(0, h)), int(rng.integers(0, w))
                img[y:y + h // 6, x:x + w // 6] = rng.integers(0, 255, 3, dtype=np.uint8)
            Image.fromarray(img).save(f)


def _measure(base: Path, server, n_rows: int, n_probe: int) -> str:
    from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset

    corpus = base / "corpus"
    make_corpus(corpus, n_rows, seed=1)
    _photos(corpus)
    (base / "probe").mkdir()
    for p in _images(base / "probe", n_probe):
        p.rename(base / "probe" / p.name)
    client = server.client()
    client.create_bucket(Bucket=BUCKET)
    upload_dir(client, corpus, BUCKET, "corpus")
    upload_dir(client, base / "probe", BUCKET, "probe")
    tok_cfg = {"rows_per_shard": 1000}
    pack_cfg = PackConfig(max_tokens=8192)

    # warm-up: the tokenizer, the numba kernel and the imports, so neither column pays for them
    tokenize_dataset([corpus / "data.jsonl"], base / "warm-tok", TokenizeConfig(media_root=str(corpus), **tok_cfg),
                     workers=1)
    pack_dataset(base / "warm-tok", base / "warm-packed", pack_cfg, workers=1)
    _, tok_local_s, _ = _timed(lambda: tokenize_dataset(
        [corpus / "data.jsonl"], base / "tok", TokenizeConfig(media_root=str(corpus), **tok_cfg), workers=1))
    _, tok_s3_s, tok_req = _timed(lambda: tokenize_dataset(
        [f"s3://{BUCKET}/corpus/data.jsonl"], f"s3://{BUCKET}/tok",
        TokenizeConfig(media_root=f"s3://{BUCKET}/corpus", **tok_cfg), workers=1))
    packed, pack_local_s, _ = _timed(lambda: pack_dataset(base / "tok", base / "packed", pack_cfg, workers=1))
    _, pack_s3_s, pack_req = _timed(lambda: pack_dataset(f"s3://{BUCKET}/tok", f"s3://{BUCKET}/packed", pack_cfg,
                                                         workers=1))
    n_packs = packed["counts"]["packs"]
    reader_cache = base / "cache" / "reader"
    embed = _reader_rates(base / "packed", f"s3://{BUCKET}/packed", reader_cache)
    # the same packs with media by reference (what video corpora and a media store use)
    ref_cfg = PackConfig(max_tokens=8192, media="reference")
    ref = pack_dataset(base / "tok", base / "packed-ref", ref_cfg, workers=1)
    pack_dataset(f"s3://{BUCKET}/tok", f"s3://{BUCKET}/packed-ref", ref_cfg, workers=1)
    reference = _reader_rates(base / "packed-ref", f"s3://{BUCKET}/packed-ref", reader_cache)
    cold_req = {(what, coalesce): _cold_requests(f"s3://{BUCKET}/{what}", reader_cache, coalesce)
                for what in ("packed", "packed-ref") for coalesce in (True, False)}
    load = os.getloadavg()[0]
    ceiling = _store_bandwidth(client, base)
    probe = probe_costs(base, n_probe)
    packed_bytes = sum(s["bytes"] for s in packed["shards"])
    ref_bytes = sum(s["bytes"] for s in ref["shards"])
    rows = [
        f"Corpus: {n_rows:,} LLaVA records (bench/corpus.py), {n_packs:,} packs of 8,192 tokens "
        f"({packed_bytes / 1e6:.1f} MB with photo- and chart-like images embedded, {ref_bytes / 1e6:.1f} MB by "
        f"reference); one worker; bucket = moto S3 server on localhost, which serves {ceiling:,.0f} MB/s to 4 "
        "parallel ranged GETs on this machine (the cold reader's ceiling: packs/s x MB/pack).",
        "",
        "| what | local disk | bucket | bucket / local |",
        "| --- | ---: | ---: | ---: |",
        f"| tokenize (inputs, media, output in the bucket) | {n_rows / tok_local_s:,.0f} samples/s | "
        f"{n_rows / tok_s3_s:,.0f} samples/s | {tok_local_s / tok_s3_s:.2f} |",
        f"| pack (tokenized input and output in the bucket, media embedded from it) | {n_rows / pack_local_s:,.0f} "
        f"samples/s | {n_rows / pack_s3_s:,.0f} samples/s | {pack_local_s / pack_s3_s:.2f} |",
        *(f"| reader, {what}, {state} | {rates[0]:,.0f} packs/s | {rate:,.0f} packs/s | {rate / rates[0]:.2f} |"
          for what, rates, size in (("media embedded", embed, packed_bytes), ("media by reference", reference, ref_bytes))
          for state, rate in (("cold cache", rates[1]), ("warm cache", rates[2]),
                              ("cold cache, coalescing off (one GET per row group, the footer apart)", rates[3]))),
        *(f"| image probe ({probe['n']} JPEG/PNG, mean {probe['file_bytes'] / 1e3:,.0f} kB), {how} | "
          f"{probe['local_per_s']:,.0f} images/s | {probe[key]:,.0f} images/s | {probe[key] / probe['local_per_s']:.3f} |"
          for how, key in (("one at a time", "remote_per_s"), ("a batch prefetched on 16 threads", "batched_per_s"))),
        "",
        "| requests to the store | requests | MB moved | per sample |",
        "| --- | ---: | ---: | ---: |",
        f"| tokenize | {tok_req[0]:,} | {tok_req[1] / 1e6:.1f} | {tok_req[0] / n_rows:.3f} |",
        f"| pack | {pack_req[0]:,} | {pack_req[1] / 1e6:.1f} | {pack_req[0] / n_rows:.3f} |",
        f"| image probe, per image | {probe['requests']:.2f} | {probe['bytes'] / 1e6:.4f} "
        f"({probe['bytes'] / probe['file_bytes']:.1%} of the file) | |",
        *(f"| reader, one pass on a cold cache, {what}{'' if coalesce else ', coalescing off'} | {req:,} "
          f"| {n_bytes / 1e6:.1f} | {req / n_packs:.3f} per pack |"
          for (prefix, coalesce), (req, n_bytes) in cold_req.items()
          for what in (("media embedded" if prefix == "packed" else "media by reference"),)),
        "",
        f"1-minute load average at the end: {load:.1f} on {os.cpu_count()} CPUs (the server, the client and "
        "other jobs share them).",
    ]
    return "\n".join(rows)
