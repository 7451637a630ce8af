"""Tokenize throughput (samples/s, one process) on a generated LLaVA-style corpus.

The corpus is 200k LLaVA records (``--quick``: 20k; issue 16's target is set on 200k) referencing a pool of a few hundred
real PNG/JPEG images made with Pillow, so every image is referenced many times, as in
real instruction-tuning sets. Three measurements in the same run:

* ``tokenize_dataset``: the whole library call (read, parse, probe, template, encode,
  write Parquet, manifest), one worker process, and two (the target: the wall rate on both
  cores, start-up included);
* ``encode only``: the same records through ``formats`` + ``rows.encode_stored`` (the
  table a shard stores), without writing, to show what the writer costs;
* baseline: a straightforward per-sample script (open each image with Pillow, render
  the chat string with the image placeholders expanded, encode it with tiktoken in one
  call per sample), the way a one-off conversion script usually does it.

Beside them, a tenth as many records that each have an image file of their own (a captioning
corpus), tokenized by one process and run through the same per-sample script: there every
sample pays a path lookup and a header probe, which the pool above answers from memory.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

from PIL import Image

N_FULL, N_QUICK = 200_000, 20_000
N_IMAGES = 300

_WORDS = ("the a an image picture shows red green blue small large object person dog cat car tree house sky "
          "water road left right top bottom center near far two three several many with without on under "
          "behind beside holding wearing standing sitting running looking bright dark white black").split()
_QUESTIONS = ["What is shown in the image?", "Describe the picture in detail.", "What colour is the main object?",
              "How many objects are there?", "What is happening in this scene?"]


def make_images(root: Path, n: int = N_IMAGES) -> list[str]:
    """``n`` small real images of varied sizes (Pillow), PNG and JPEG; relative paths."""
    rng = random.Random(1)
    (root / "images").mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(n):
        w, h = rng.randint(64, 1600), rng.randint(64, 1200)
        name = f"images/{i:04d}.{'jpg' if i % 2 else 'png'}"
        Image.new("RGB", (w, h), (i % 256, 90, 160)).save(root / name, **({"quality": 40} if i % 2 else {}))
        names.append(name)
    return names


def make_corpus(root: Path, n: int, seed: int = 0, distinct: bool = False) -> Path:
    """``n`` LLaVA records: one image each, one to three Q/A turns, answers of 5-60 words.
    The images are :func:`make_images`'s pool, or with ``distinct`` one small file of its own
    for each record (:func:`_own_image`), as in a captioning corpus."""
    images = None if distinct else make_images(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    path = root / "data.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(n):
            turns = []
            for t in range(rng.randint(1, 3)):
                q = rng.choice(_QUESTIONS) if rng.random() < 0.7 else " ".join(rng.choices(_WORDS, k=rng.randint(4, 14))) + "?"
                turns.append({"from": "human", "value": ("<image>\n" if t == 0 else "") + q})
                turns.append({"from": "gpt", "value": " ".join(rng.choices(_WORDS, k=rng.randint(5, 60))) + "."})
            image = rng.choice(images) if images else _own_image(root, i)
            fh.write(json.dumps({"id": f"s{i:07d}", "image": image, "conversations": turns}) + "\n")
    return path


def _own_image(root: Path, i: int) -> str:
    """Record ``i``'s own image: a PNG or JPEG of 200-700 by 150-600 pixels, under ``root/own/``."""
    name = f"own/{i // 1000:03d}/{i:07d}.{'jpg' if i % 2 else 'png'}"
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (200 + (37 * i) % 500, 150 + (53 * i) % 450), (i % 256, 90, 160)).save(root / name)
    return name


def _rates(n: int, t0: float, c0: float) -> tuple[float, float]:
    """(samples per wall second, samples per CPU second of this process)."""
    return n / (time.perf_counter() - t0), n / max(time.process_time() - c0, 1e-9)


def _baseline(path: Path, root: Path, limit: int) -> tuple[float, float]:
    """Samples/s of a per-sample script: Pillow open, render string, one encode per sample."""
    from packtool.tokenization import QwenTiktoken
    from packtool.vision import get_family

    enc = QwenTiktoken()._enc
    fam = get_family("qwen2.5-vl")
    roles = {"human": "user", "gpt": "assistant"}
    t0, c0 = time.perf_counter(), time.process_time()
    n = 0
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            rec = json.loads(line)
            with Image.open(root / rec["image"]) as im:
                w, h = im.size
            pads = "<|vision_start|>" + "<|image_pad|>" * fam.image(h, w).n_tokens + "<|vision_end|>"
            text = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            for turn in rec["conversations"]:
                text += f"<|im_start|>{roles[turn['from']]}\n{turn['value'].replace('<image>', pads)}<|im_end|>\n"
            enc.encode(text, allowed_special="all")
            n += 1
            if n >= limit:
                break
    return _rates(n, t0, c0)


def _encode_only(path: Path, root: Path) -> tuple[tuple[float, float], int]:
    from packtool.formats import Rejected, iter_samples
    from packtool.rows import EncodeContext, encode_stored
    from packtool.templates import get_template
    from packtool.tokenization import load_tokenizer
    from packtool.vision import get_family

    ctx = EncodeContext(load_tokenizer(None), get_template("chatml"), get_family("qwen2.5-vl"), root)
    t0, c0 = time.perf_counter(), time.process_time()
    n = 0
    batch = []
    for s in iter_samples([path]):
        if not isinstance(s, Rejected):
            batch.append(s)
        if len(batch) == 512:
            n += encode_stored(batch, ctx)[0].num_rows
            batch = []
    n += encode_stored(batch, ctx)[0].num_rows
    return _rates(n, t0, c0), n


def _full(path: Path, root: Path, out: Path, workers: int = 1, n_rows: int = N_FULL) -> tuple[tuple[float, float], int, dict]:
    from packtool import TokenizeConfig, tokenize_dataset

    # one worker: one task; two workers: 8 tasks (the whole file, cut by byte offset)
    cfg = TokenizeConfig(media_root=str(root), rows_per_shard=1_000_000 if workers == 1 else -(-n_rows // 8))
    t0, c0 = time.perf_counter(), time.process_time()
    manifest = tokenize_dataset([path], out, cfg, workers=workers, progress=None)
    n = manifest["counts"]["samples"]
    return _rates(n, t0, c0), n, manifest


def run(quick: bool = False) -> str:
    n = N_QUICK if quick else N_FULL
    tmp = Path(tempfile.mkdtemp(prefix="bench-tokenize-"))
    try:
        path = make_corpus(tmp, n)
        _encode_only(path, tmp)  # warm: tokenizer load, numba-free imports, page cache
        full, n_full, manifest = _full(path, tmp, tmp / "tok", n_rows=n)
        two, n_two, _ = _full(path, tmp, tmp / "tok2", workers=2, n_rows=n)
        # the same records as one JSON array (as LLaVA's own training sets come): cut at elements
        array = tmp / "data.json"
        array.write_bytes(b"[\n" + b",\n".join(path.read_bytes().splitlines()) + b"\n]\n")
        two_array, n_array, _ = _full(array, tmp, tmp / "tok2-array", workers=2, n_rows=n)
        array.unlink()
        enc, n_enc = _encode_only(path, tmp)
        base = _baseline(path, tmp, min(n, 20_000))
        # every record its own image: each sample pays a path lookup and a header probe
        n_own = min(n // 10, 10_000)
        own_root = tmp / "own-corpus"
        own_path = make_corpus(own_root, n_own, seed=1, distinct=True)
        own, n_own_done, _ = _full(own_path, own_root, tmp / "tok-own", n_rows=n_own)
        own_base = _baseline(own_path, own_root, n_own)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    c = manifest["counts"]
    size = sum(sh["bytes"] for sh in manifest["shards"])
    if n_full != n or n_enc != n or n_two != n or n_array != n or n_own_done != n_own:
        raise RuntimeError(f"internal error: expected {n} samples, tokenized {n_full} / encoded {n_enc}")
    lines = [
        f"LLaVA-style JSONL, {n:,} samples, {N_IMAGES} images referenced, qwen2.5-vl + chatml, 1 process unless stated "
        "(per CPU-second: the rate on an idle core)",
        "",
        "| what | samples/s | samples per CPU-s | vs. baseline (CPU) |",
        "| --- | ---: | ---: | ---: |",
        f"| packtool tokenize (read → Parquet shards) | {full[0]:,.0f} | {full[1]:,.0f} | {full[1] / base[1]:.2f}x |",
        f"| packtool tokenize, `--workers 2` (8 tasks) | {two[0]:,.0f} | (wall only) | {two[0] / full[0]:.2f}x the 1-worker wall rate |",
        f"| packtool tokenize, `--workers 2`, the same records as one JSON array (8 tasks) | {two_array[0]:,.0f} | "
        f"(wall only) | {two_array[0] / two[0]:.2f}x the JSONL rate |",
        f"| packtool encode only (no writing) | {enc[0]:,.0f} | {enc[1]:,.0f} | {enc[1] / base[1]:.2f}x |",
        f"| baseline: per-sample script (Pillow open + one encode, nothing written) | {base[0]:,.0f} | {base[1]:,.0f} | 1.00x |",
        f"| packtool tokenize, every record its own image ({n_own:,} records and files) | {own[0]:,.0f} | {own[1]:,.0f} | "
        f"{own[1] / own_base[1]:.2f}x the same script on them |",
        f"| baseline on those records | {own_base[0]:,.0f} | {own_base[1]:,.0f} | 1.00x |",
        "",
        f"Tokenized shards: {size / c['tokens']:.3f} bytes per token, {size / c['samples']:,.0f} per sample "
        f"({c['tokens'] / c['samples']:,.0f} tokens per sample). Load average at the end: {os.getloadavg()[0]:.2f}.",
        "",
        "How to read it: the target is the `--workers 2` row (wall samples/s, both cores); `samples per CPU-s` is "
        "the rate one free core would give, the figure to compare across runs on a shared machine.",
    ]
    return "\n".join(lines)
