"""Generated corpora for benchmarks and tests, deterministic for a given ``seed``.

* ``make_corpus(dir, n)`` writes ``dir/data.jsonl``, a raw LLaVA-like corpus with ``n``
  records and a small pool of real images (Pillow) under ``dir/images``; records cycle
  through the pool, so the corpus can be large while the media stays small.
* ``sample_lengths(mix, n)`` draws per-sample ``(tokens, units, has_media)`` for one of
  the :data:`MIXES` (Molmo2 crop/frame accounting), and ``write_tokenized(dir, mix, n)``
  writes them straight into tokenized shards (``schema.TOKENIZED`` plus a manifest), token
  columns included, so packing benchmarks need neither media nor a tokenizer.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
from PIL import Image

__all__ = ["make_corpus", "make_images", "MIXES", "sample_lengths", "write_tokenized"]

_SIZES = [(640, 480), (1920, 1080), (480, 640), (1024, 1024), (300, 200), (1280, 720), (336, 336), (800, 1200),
          (1000, 750), (512, 384), (224, 224), (768, 1024), (1600, 900), (400, 300), (720, 1280), (900, 600)]
_WORDS = ("the a an image picture shows red green blue small large object person dog cat car tree house sky "
          "water road left right top bottom center near far two three several many with without on under "
          "behind beside holding wearing standing sitting running looking bright dark white black").split()


def make_images(root: Path) -> list[str]:
    """Write the image pool (tiny files with varied declared sizes); return relative paths."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    names = []
    for i, (w, h) in enumerate(_SIZES):
        name = f"images/img{i:02d}.{'jpg' if i % 2 else 'png'}"
        if not (root / name).exists():
            Image.new("RGB", (w, h), (i * 13 % 256, 90, 160)).save(root / name, quality=50)
        names.append(name)
    return names


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n_words))


def make_corpus(root: str | Path, n: int, seed: int = 0, name: str = "data.jsonl") -> Path:
    """Write ``n`` LLaVA records to ``root/name``: 80% one image, 5% two images, 15% text-only;
    one to four Q/A turns with answers of 5 to 120 words."""
    root = Path(root)
    images = make_images(root)
    rng = random.Random(seed)
    path = root / name
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(n):
            r = rng.random()
            n_img = 1 if r < 0.80 else (2 if r < 0.85 else 0)
            turns = []
            for t in range(rng.randint(1, 4)):
                q = _text(rng, rng.randint(4, 20)) + "?"
                if t == 0 and n_img:
                    q = "<image>\n" * n_img + q
                turns.append({"from": "human", "value": q})
                turns.append({"from": "gpt", "value": _text(rng, rng.randint(5, 120)) + "."})
            rec: dict = {"id": f"s{i:08d}", "conversations": turns}
            if n_img == 1:
                rec["image"] = rng.choice(images)
            elif n_img:
                rec["image"] = [rng.choice(images) for _ in range(n_img)]
            fh.write(json.dumps(rec) + "\n")
    return path


# ---------------------------------------------------------------------------------------
# Tokenized corpora with realistic length mixes (Molmo2 accounting: an image is a global
# crop plus overlapping tiles, 144 tokens per crop after pooling; a video frame is one
# crop of 81 tokens, plus a few timestamp tokens).

#: Mix name -> description (see :func:`sample_lengths` for the distributions).
MIXES = {
    "llava": "LLaVA-665K-like: 94% one image (3-13 crops), 6% text-only; short multi-turn text",
    "molmo2": "Molmo2-SFT-like: 75% images (multi-crop, some multi-image), 15% video, 10% text-only",
    "longvideo": "long-video heavy: 55% videos of 32-128 frames with subtitles, 25% images, 20% text",
    "qwen-images": "image-heavy, Qwen2.5-VL accounting (units: patches): 82% one image, 6% two, 12% text-only; "
                   "images 300x250 to 2600x1800",
}

#: Vision-unit capacity per pack of each mix (the family default it stands for).
MIX_MAX_UNITS = {"llava": 128, "molmo2": 128, "longvideo": 128, "qwen-images": 65536}

TOKENS_PER_CROP = 144
TOKENS_PER_FRAME = 81 + 6
_IMAGE_PAD = 151655
_VIDEO_PAD = 151656


def _text_tokens(rng: np.random.Generator, n: int, median: float, sigma: float, lo: int, hi: int) -> np.ndarray:
    return np.clip(rng.lognormal(np.log(median), sigma, n), lo, hi).astype(np.int64)


def _crops(rng: np.random.Generator, n: int) -> np.ndarray:
    # global crop + tiles of a COCO-like size mix
    return rng.choice([3, 5, 7, 9, 10, 13], size=n, p=[0.10, 0.40, 0.22, 0.13, 0.10, 0.05]).astype(np.int64)


def _qwen_images(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The ``qwen-images`` mix: ``(tokens, units, vision_tokens, n_images, first_image_tokens)``
    with Qwen2.5-VL's own resize rule (units are patches, 4 per placeholder token; 2 special
    tokens per image)."""
    from packtool.vision.qwen import Qwen25VL

    fam = Qwen25VL()
    r = rng.random(n)
    n_img = np.where(r < 0.82, 1, np.where(r < 0.88, 2, 0))
    units = np.zeros(n, dtype=np.int64)
    vt = np.zeros(n, dtype=np.int64)
    first = np.zeros(n, dtype=np.int64)
    for k in range(2):
        w = rng.integers(300, 2601, n)
        h = rng.integers(250, 1801, n)
        has = n_img > k
        # a grid of sizes, so the resize rule runs once per distinct size, not once per image
        wq, hq = (w // 20) * 20, (h // 10) * 10
        for (hh, ww) in set(zip(hq[has].tolist(), wq[has].tolist(), strict=True)):
            lay = fam.image(hh, ww)
            sel = has & (hq == hh) & (wq == ww)
            units[sel] += lay.units
            vt[sel] += lay.n_tokens
        if k == 0:
            first = vt.copy()
    text = np.where(n_img == 0, _text_tokens(rng, n, 600, 1.0, 20, 20000), _text_tokens(rng, n, 160, 1.0, 12, 6000))
    return text + vt + 2 * n_img, units, vt, n_img, first


def sample_lengths(mix: str, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-sample ``(tokens, units, vision_tokens, kind)`` for a mix; ``kind`` 0 text, 1 image, 2 video.

    ``units`` are crops (images) or frames (videos); ``vision_tokens`` is the part of
    ``tokens`` that is vision placeholders. A few samples exceed 16,384 tokens or 128 units
    (oversize), as in real corpora.

    Example:
        >>> t, u, vt, k = sample_lengths("llava", 1000)
        >>> bool((t >= vt).all()) and set(np.unique(k)) <= {0, 1}
        True
    """
    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r}; choose one of {sorted(MIXES)}")
    rng = np.random.default_rng(seed)
    if mix == "qwen-images":
        tokens, units, vt, n_img, _ = _qwen_images(rng, n)
        return tokens, units, vt, np.minimum(n_img, 1)
    r = rng.random(n)
    kind = np.zeros(n, dtype=np.int64)
    units = np.zeros(n, dtype=np.int64)
    vt = np.zeros(n, dtype=np.int64)
    if mix == "llava":
        kind[r >= 0.06] = 1
        text = np.where(kind == 1, _text_tokens(rng, n, 110, 0.85, 12, 3000), _text_tokens(rng, n, 420, 0.9, 20, 6000))
        units[kind == 1] = _crops(rng, int((kind == 1).sum()))
        vt = units * TOKENS_PER_CROP
    elif mix == "molmo2":
        kind[r >= 0.10] = 1
        kind[r >= 0.85] = 2
        img = kind == 1
        n_img = rng.choice([1, 2, 3, 4], size=n, p=[0.82, 0.1, 0.05, 0.03])
        crops = np.where(n_img == 1, _crops(rng, n), n_img * rng.integers(1, 6, n))
        frames = np.clip(rng.lognormal(np.log(40), 0.7, n), 4, 180).astype(np.int64)
        units = np.where(img, crops, np.where(kind == 2, frames, 0))
        vt = np.where(img, units * TOKENS_PER_CROP, units * TOKENS_PER_FRAME)
        text = np.where(kind == 0, _text_tokens(rng, n, 600, 1.0, 20, 20000),
                        np.where(img, _text_tokens(rng, n, 220, 1.1, 12, 8000), _text_tokens(rng, n, 260, 1.0, 20, 6000)))
    else:
        kind[r >= 0.20] = 1
        kind[r >= 0.45] = 2
        img = kind == 1
        frames = np.clip(rng.normal(88, 28, n), 32, 140).astype(np.int64)
        units = np.where(img, _crops(rng, n), np.where(kind == 2, frames, 0))
        vt = np.where(img, units * TOKENS_PER_CROP, units * TOKENS_PER_FRAME)
        text = np.where(kind == 2, _text_tokens(rng, n, 450, 0.8, 30, 6000), _text_tokens(rng, n, 300, 1.0, 12, 12000))
    vt = np.where(kind == 0, 0, vt)
    return text + vt, units, vt, kind


def _list_array(lengths: np.ndarray, values: np.ndarray):
    import pyarrow as pa

    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values.astype(np.int32, copy=False)))


def _batch_table(tokens, units, vt, kind, first: int, rng: np.random.Generator, mix: str, split=None, pool=None):
    """One batch of tokenized rows, built column-wise (no per-token Python).

    ``split`` (``qwen-images``): ``(n_images, first_image_tokens)`` per row, so a two-image row
    gets two media entries; ``pool``: image paths the media entries cycle through."""
    import pyarrow as pa

    from packtool.schema import PREFIX_SUBSEGMENT, TOKENIZED_ROWS

    n = len(tokens)
    total = int(tokens.sum())
    row_start = np.concatenate([[0], np.cumsum(tokens)[:-1]])
    pos = np.arange(total, dtype=np.int64) - np.repeat(row_start, tokens)
    # layout per row: 8 prompt tokens, vision span, rest text; answer = last 40% of the text
    vis_off = np.where(kind > 0, 8, 0)
    in_vis = (pos >= np.repeat(vis_off, tokens)) & (pos < np.repeat(vis_off + vt, tokens))
    text_ids = np.minimum(rng.zipf(1.3, total), 150000).astype(np.int64) + 200
    pad = np.repeat(np.where(kind == 2, _VIDEO_PAD, _IMAGE_PAD), tokens)
    input_ids = np.where(in_vis, pad, text_ids)
    answer_from = np.repeat(tokens - ((tokens - vt - vis_off) * 2) // 5, tokens)
    target = np.full(total, -100, dtype=np.int64)
    is_ans = pos >= answer_from
    nxt = np.concatenate([input_ids[1:], [0]])
    target[is_ans] = nxt[is_ans]
    last = np.cumsum(tokens) - 1
    target[last] = 151645  # end of turn
    media = []
    for k in range(n):
        if kind[k] == 0:
            media.append([])
            continue
        is_video = kind[k] == 2
        frames = int(units[k]) if is_video else 1
        if split is not None:
            n_img, t0 = int(split[0][k]), int(split[1][k])
            spans = [(int(vis_off[k]), t0), (int(vis_off[k]) + t0, int(vt[k]) - t0)][:n_img]
            media.append([{
                "kind": "image", "path": pool[(first + k + j) % len(pool)], "token_offset": off, "n_tokens": nt,
                "width": 640, "height": 480, "resized_width": 644, "resized_height": 476, "grid_t": 1,
                "grid_h": 34, "grid_w": 46, "vision_units": 4 * nt, "timestamps": None, "data": None,
            } for j, (off, nt) in enumerate(spans)])
            continue
        media.append([{
            "kind": "video" if is_video else "image",
            "path": f"{'videos' if is_video else 'images'}/{mix}_{first + k:08d}.{'mp4' if is_video else 'jpg'}",
            "token_offset": int(vis_off[k]), "n_tokens": int(vt[k]), "width": 640, "height": 480,
            "resized_width": 640, "resized_height": 480, "grid_t": frames, "grid_h": 28, "grid_w": 36,
            "vision_units": int(units[k]),
            "timestamps": [i * 0.5 for i in range(frames)] if is_video else None, "data": None,
        }])
    cols = {
        "sample_id": pa.array([f"{mix}-{first + k:08d}" for k in range(n)]),
        "source": pa.array([f"{mix}.jsonl"] * n),
        "source_row": pa.array(np.arange(first, first + n, dtype=np.int64)),
        "n_tokens": pa.array(tokens.astype(np.int32)),
        "n_vision_units": pa.array(units.astype(np.int32)),
        "n_branches": pa.array(np.ones(n, dtype=np.int32)),
        "input_ids": _list_array(tokens, input_ids),
        "target_ids": _list_array(tokens, target),
        "position_ids": _list_array(tokens, pos),
        "subsegment_ids": _list_array(tokens, np.full(total, PREFIX_SUBSEGMENT)),
        "media": pa.array(media, type=TOKENIZED_ROWS.field("media").type),
    }
    # expanded rows; a ShardWriter of schema.TOKENIZED stores them in runs form, as tokenize does
    return pa.Table.from_arrays(list(cols.values()), schema=TOKENIZED_ROWS)


def write_tokenized(out_dir: str | Path, mix: str, n: int, seed: int = 0, rows_per_shard: int = 50_000,
                    max_vision_units: int = 128, expanded: bool = False) -> dict:
    """Write ``n`` samples of ``mix`` as tokenized shards with a manifest; returns the manifest.

    Shards are in runs form (schema version 6, what ``tokenize`` writes), or with
    ``expanded`` every token stored (version 2, what it wrote before the runs form). A finished directory
    with the same ``(mix, n, seed, rows_per_shard, expanded)`` is reused.
    """
    from packtool.config import digest_of
    from packtool.shards import ShardWriter, is_output_dir, read_manifest, write_manifest

    out = Path(out_dir)
    # the qwen-images mix references a small pool of real images, so `--media embed` has bytes to read
    root = str(out.resolve()) if mix == "qwen-images" else "."
    config = {"generated": mix, "n": n, "seed": seed, "rows_per_shard": rows_per_shard, "media_root": root,
              "layout": "full" if expanded else "runs"}
    # the schema version is part of the digest: a corpus cached by an older packtool (another
    # stored form) is written again, so a bench never measures reading an old layout
    from packtool.schema import FULL_V2_VERSION, SCHEMA_VERSION

    config["schema_version"] = FULL_V2_VERSION if expanded else SCHEMA_VERSION
    digest = digest_of(config)
    if is_output_dir(out):
        old = read_manifest(out, "tokenized")
        if old.get("config_digest") == digest:
            return old
    out.mkdir(parents=True, exist_ok=True)
    split = pool = None
    if mix == "qwen-images":
        tokens, units, vt, n_img, first_vt = _qwen_images(np.random.default_rng(seed), n)
        kind = np.minimum(n_img, 1)
        split = (n_img, first_vt)
        pool = make_images(out)
        max_vision_units = MIX_MAX_UNITS[mix]
    else:
        tokens, units, vt, kind = sample_lengths(mix, n, seed)
    rng = np.random.default_rng(seed + 1)
    from packtool.schema import TOKENIZED, TOKENIZED_ROWS_V2, with_media_type

    with ShardWriter(out, TOKENIZED_ROWS_V2 if expanded else TOKENIZED, rows_per_shard=rows_per_shard) as writer:
        for a in range(0, n, 4096):
            b = min(n, a + 4096)
            part = None if split is None else (split[0][a:b], split[1][a:b])
            table = _batch_table(tokens[a:b], units[a:b], vt[a:b], kind[a:b], a, rng, mix, part, pool)
            if expanded:  # version 2's media struct: no source_* fields
                table = with_media_type(table, TOKENIZED_ROWS_V2.field("media").type)
            writer.write_table(table)
    counts = {"rows_in": n, "samples": n, "rejected": 0, "rejected_by_reason": {}, "tokens": int(tokens.sum()),
              "vision_units": int(units.sum())}
    if mix == "qwen-images":
        vision = {"family": "qwen2.5-vl", "unit": "patches", "default_max_vision_units": max_vision_units}
    else:
        vision = {"family": "molmo2-generated", "unit": "crop", "default_max_vision_units": max_vision_units}
    return write_manifest(out, "tokenized", config, digest, writer.shards, FULL_V2_VERSION if expanded else SCHEMA_VERSION,
                          vision=vision, counts=counts,
                          tokenizer={"name": "generated"}, template={"name": "generated"})
