"""``rows.encode_stored`` builds the runs form straight from a batch's staged pieces; it must
give exactly what ``runs.compact`` gives for the same rows expanded.

Seeded corpora are rendered for all five vision families (Qwen2.5-VL, Qwen3-VL, Molmo2,
LLaVA-OneVision, InternVL) through the real templates and tokenizers (the embedded Qwen
vocabularies; for the others a real byte-level ``tokenizer.json`` holding the family's
special tokens): images of many sizes (tiny ones make placeholder runs shorter than
``MIN_RUN``), videos, tool calls, reasoning, message trees split by ``--max-branches``,
repeated text (runs inside text, with and without loss) and rejected samples in between.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hf_harness import byte_tokenizer
from naive import list_form
from PIL import Image
from video_fixtures import write_video

from packtool.formats import Rejected, parse_record
from packtool.media import probe_video
from packtool.rows import (
    _PAD,
    EncodeContext,
    _assemble_batch,
    _compact_pieces,
    _PieceArrays,
    _stage_samples,
    encode_samples,
    encode_stored,
)
from packtool.runs import MIN_RUN, TOKEN_COLUMNS, compact, compact_table
from packtool.schema import TOKENIZED, TOKENIZED_ROWS
from packtool.shards import rows_table
from packtool.templates import get_template
from packtool.tokenization import load_tokenizer
from packtool.vision import get_family

SEEDS = range(6)
#: (family, template, tokenizer: None for a byte-level one with the family's special tokens)
FAMILIES = [("qwen2.5-vl", "chatml", "qwen2"), ("qwen3-vl", "qwen3-vl", "qwen3"), ("molmo2", "molmo2", None),
            ("llava-ov", "chatml", None), ("internvl", "chatml", None)]
#: (width, height): 28x28 is one Qwen placeholder, far below MIN_RUN
SIZES = [(28, 28), (30, 60), (56, 84), (120, 90), (333, 250), (640, 480), (900, 1400)]
_WORDS = "the a red cat sat on mat big blue sky two dogs run".split()
_REPEATS = ["aaaaaaaaaaaaaaaa", "!!!!!!!!!!!!", " the the the the the the the the the the", "\n\n\n\n\n\n\n\n\n\n",
            "0000000000000000000", "        x"]
SCHEMA = {"name": "get_weather", "parameters": {"type": "object"}}


@pytest.fixture(scope="module")
def media_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rows-media")
    for i, (w, h) in enumerate(SIZES):
        Image.new("RGB", (w, h), (i * 30, 90, 160)).save(root / f"im{i}.{'jpg' if i % 2 else 'png'}")
    write_video(root / "v.mp4", 12)
    return root


def _images() -> list[str]:
    return [f"im{i}.{'jpg' if i % 2 else 'png'}" for i in range(len(SIZES))]


def _byte_tokenizer(family: str, template: str, media_root: Path, directory: Path):
    """A byte-level tokenizer holding every special token the family's layouts and the template use."""
    fam = get_family(family)
    names = {"<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>"}
    layouts = [fam.image_in_sample(h, w, n) for w, h in SIZES for n in (1, 2, 3)]
    layouts.append(fam.video(probe_video(media_root / "v.mp4", apply_rotation=fam.exif == "apply")))
    for lay in layouts:
        names.update(value for kind, value, _ in lay.segments if kind in ("special", "pad"))
    return load_tokenizer(str(byte_tokenizer(directory, sorted(names))))


def _text(rng: random.Random) -> str:
    words = " ".join(rng.choices(_WORDS, k=rng.randint(1, 12)))
    return words + rng.choice(_REPEATS) + " end" if rng.random() < 0.4 else words


def _records(rng: random.Random, tools: bool, reasoning: bool, n: int = 28) -> list[dict]:
    """A seeded mix of record shapes (see the module docstring)."""
    images = _images()
    out: list[dict] = []
    for i in range(n):
        r = rng.random()
        if r < 0.08:  # a missing image: rejected by encoding (missing_media), its pieces rolled back
            out.append({"id": f"bad{i}", "conversations": [{"from": "human", "value": "<image>\n" + _text(rng)},
                                                          {"from": "gpt", "value": _text(rng)}], "image": "gone.png"})
        elif r < 0.22:  # a message tree on one image
            out.append({"id": f"tree{i}", "image": rng.choice(images), "message_list": [
                {"question": _text(rng), "answer": _text(rng), "style": "user_qa"}
                for _ in range(rng.randint(2, 4))]})
        elif r < 0.32 and tools:
            out.append({"id": f"tool{i}", "images": [rng.choice(images)], "tools": [SCHEMA], "messages": [
                {"role": "user", "content": "<image>" + _text(rng)},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": json.dumps({"city": _text(rng)})}}]},
                {"role": "tool", "tool_call_id": "c1", "content": _text(rng)},
                {"role": "assistant", "content": _text(rng)}]})
        elif r < 0.42 and reasoning:
            out.append({"id": f"think{i}", "messages": [
                {"role": "user", "content": _text(rng)},
                {"role": "assistant", "content": _text(rng), "reasoning_content": _text(rng)},
                {"role": "user", "content": _text(rng)},
                {"role": "assistant", "content": _text(rng), "reasoning_content": _text(rng)}]})
        else:  # LLaVA: no media, one to three images, or a video
            turns = []
            for _ in range(rng.randint(1, 3)):
                turns += [{"from": "human", "value": _text(rng)}, {"from": "gpt", "value": _text(rng)}]
            rec = {"id": f"s{i}", "conversations": turns}
            kind = rng.random()
            if kind < 0.15:
                rec["video"] = "v.mp4"
                turns[0]["value"] = "<video>\n" + turns[0]["value"]
            elif kind < 0.85:
                picked = rng.sample(images, rng.randint(1, 3))
                rec["image"] = picked
                turns[0]["value"] = "<image>\n" * len(picked) + turns[0]["value"]
            out.append(rec)
    return out


def _expected(samples, ctx, counts):
    """What the shard writer stored before: the expanded rows, compacted by ``runs.compact``."""
    rows, rejected = encode_samples(samples, ctx, counts)
    return compact_table(rows_table(rows, TOKENIZED_ROWS)).cast(TOKENIZED), rejected


@pytest.fixture(scope="module")
def contexts(media_root, tmp_path_factory) -> dict[str, EncodeContext]:
    out = {}
    for family, template, tok in FAMILIES:
        tokenizer = (load_tokenizer(tok) if tok else
                     _byte_tokenizer(family, template, media_root, tmp_path_factory.mktemp(family)))
        out[family] = EncodeContext(tokenizer, get_template(template), get_family(family), media_root)
    return out


@pytest.mark.parametrize("family", [f for f, _, _ in FAMILIES])
@pytest.mark.parametrize("seed", SEEDS)
def test_stored_rows_equal_compacted_expanded_rows(family, seed, contexts):
    rng = random.Random(seed)
    base = contexts[family]
    qwen = family.startswith("qwen")
    ctx = EncodeContext(base.tokenizer, base.template, base.family, base.media_root,
                        max_branches=rng.choice([None, 1, 2]), reasoning_loss=rng.random() < 0.5,
                        probe_cache=base.probe_cache)
    samples = [parse_record(rec, "corpus.jsonl", i)
               for i, rec in enumerate(_records(rng, tools=qwen, reasoning=family == "qwen3-vl"))]
    samples = [s for s in samples if not isinstance(s, Rejected)]
    want_counts, got_counts = Counter(), Counter()
    want, want_rejected = _expected(samples, ctx, want_counts)
    got, got_rejected = encode_stored(samples, ctx, got_counts)
    assert got.schema == TOKENIZED, f"seed {seed}"
    assert got_rejected == want_rejected and got_counts == want_counts, f"seed {seed}"
    for name in TOKENIZED.names:
        assert got.column(name).equals(want.column(name)), f"seed {seed} family {family}: column {name} differs"
    assert got.equals(want)
    # the corpus has what the test is about: trees, short placeholder runs, runs of text tokens
    assert any(len(s.branches) > 1 for s in samples) and got_rejected, f"seed {seed}"
    lists = list_form(got)
    starts, tgt = lists.column("run_starts").to_pylist(), lists.column("compact_target_ids").to_pylist()
    assert any(t[k] != -100 for st, t in zip(starts, tgt, strict=True) for k in st), f"seed {seed}: no run with loss"
    if family == "qwen2.5-vl":  # the one family whose small images are fewer placeholders than MIN_RUN
        pieces, _, _ = _stage_samples(samples, ctx)
        arrays = _PieceArrays(pieces, ctx.tokenizer.encode_blobs(pieces.texts))
        assert np.any((arrays.kind == _PAD) & (arrays.count < MIN_RUN)), f"seed {seed}"


@pytest.mark.parametrize("min_run", [2, 3, MIN_RUN, 40])
@pytest.mark.parametrize("seed", SEEDS)
def test_compact_pieces_is_runs_compact_at_any_threshold(seed, min_run, contexts):
    """The per-segment compaction against ``runs.compact`` on the expanded one-branch rows,
    at thresholds where text runs, short placeholder runs and the breaks between them all matter."""
    rng = np.random.default_rng(seed)
    family = FAMILIES[seed % len(FAMILIES)][0]
    ctx = contexts[family]
    samples = [parse_record(rec, "corpus.jsonl", i) for i, rec in
               enumerate(_records(random.Random(seed), tools=family.startswith("qwen"), reasoning=family == "qwen3-vl"))]
    samples = [s for s in samples if not isinstance(s, Rejected)]
    pieces, staged, _ = _stage_samples(samples, ctx)
    arrays = _PieceArrays(pieces, ctx.tokenizer.encode_blobs(pieces.texts))
    ids, loss, starts = _assemble_batch(arrays)
    ranges = [br[0] for _, _, br in staged if len(br) == 1]
    ranges = [ranges[i] for i in sorted(rng.choice(len(ranges), size=len(ranges) // 2 + 1, replace=False))]
    got = _compact_pieces(arrays, ranges, min_run)
    rows = []
    for p0, p1 in ranges:
        a, b = starts[p0], starts[p1]
        tgt = np.full(b - a, -100, np.int32)
        tgt[:-1] = np.where(loss[a + 1:b], ids[a + 1:b], -100)
        rows.append({"input_ids": ids[a:b], "target_ids": tgt, "position_ids": np.arange(b - a, dtype=np.int32),
                     "subsegment_ids": np.full(b - a, 10_000, np.int32)})
    offsets = np.concatenate([[0], np.cumsum([len(r["input_ids"]) for r in rows])])
    want = compact({name: np.concatenate([r[name] for r in rows]) for name in TOKEN_COLUMNS}, offsets, min_run)
    for name in TOKEN_COLUMNS:
        assert got.columns[name].dtype == want.columns[name].dtype
        assert np.array_equal(got.columns[name], want.columns[name]), f"seed {seed} min_run {min_run} {name}"
    for field in ("offsets", "run_starts", "run_lengths", "run_offsets"):
        assert np.array_equal(getattr(got, field), getattr(want, field)), f"seed {seed} min_run {min_run} {field}"
    assert len(want.run_starts) > 0, f"seed {seed}"


def test_an_empty_batch_and_a_batch_of_rejects_give_empty_tables(contexts):
    ctx = contexts["qwen2.5-vl"]
    table, rejected = encode_stored([], ctx)
    assert table.num_rows == 0 and table.schema == TOKENIZED and rejected == []
    bad = parse_record({"id": "x", "image": "missing.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "No."}]}, "c.jsonl", 0)
    table, rejected = encode_stored([bad], ctx)
    assert table.num_rows == 0 and [r.reason for r in rejected] == ["missing_media"]


def test_a_batch_of_trees_only(contexts):
    """No one-branch row at all: the runs form comes from ``runs.compact`` alone, rows in order."""
    ctx = contexts["qwen2.5-vl"]
    ctx = EncodeContext(ctx.tokenizer, ctx.template, ctx.family, ctx.media_root, max_branches=2,
                        probe_cache=ctx.probe_cache)
    rng = random.Random(7)
    samples = [parse_record({"id": f"t{i}", "image": _images()[i % len(SIZES)], "message_list": [
        {"question": _text(rng), "answer": _text(rng), "style": "user_qa"} for _ in range(3)]}, "m.jsonl", i)
        for i in range(4)]
    got, _ = encode_stored(samples, ctx)
    want, _ = _expected(samples, ctx, Counter())
    assert got.num_rows == 8 and got.equals(want)
    assert got.column("sample_id").to_pylist() == [f"t{i}{k}" for i in range(4) for k in ("", "#1")]


def test_media_of_a_local_root_resolve_through_one_realpath_a_directory(tmp_path, monkeypatch):
    """Probing resolves each directory's real path once (``MediaPathResolver``), and stores what
    resolving every path in full stores: the same rows, the same rejects (a link out of the root,
    a missing file, a ``..`` name), and the size and time of each file."""
    import os
    import os.path

    from packtool.formats.llava import parse
    from packtool.rows import EncodeContext, encode_stored
    from packtool.templates import get_template
    from packtool.tokenization import load_tokenizer
    from packtool.vision import get_family

    root = tmp_path / "root"
    for d in ("a", "b"):
        (root / d).mkdir(parents=True)
        for i in range(6):
            Image.new("RGB", (30 + i, 20 + 3 * i), (i, 9, 99)).save(root / d / f"{i}.png")
    outside = tmp_path / "secret.png"
    Image.new("RGB", (8, 8)).save(outside)
    (root / "a" / "out.png").symlink_to(outside)
    (root / "b" / "in.png").symlink_to(root / "a" / "1.png")
    paths = [f"{d}/{i}.png" for d in ("a", "b") for i in range(6)] + ["a/out.png", "b/in.png", "a/missing.png",
                                                                       "a/../b/2.png", "b/.."]
    samples = [parse({"id": f"s{k}", "image": p, "conversations": [{"from": "human", "value": "<image>\nWhat?"},
                                                                 {"from": "gpt", "value": "A box."}]}, "x.jsonl", k)
               for k, p in enumerate(paths)]

    def encode(fast: bool):
        ctx = EncodeContext(load_tokenizer(None), get_template("chatml"), get_family("qwen2.5-vl"), root)
        if not fast:
            object.__setattr__(ctx, "paths", None)
        calls = []
        real = os.path.realpath
        monkeypatch.setattr(os.path, "realpath", lambda p, *a, **k: (calls.append(p), real(p, *a, **k))[1])
        try:
            table, rejected = encode_stored(samples, ctx)
        finally:
            monkeypatch.setattr(os.path, "realpath", real)
        return table, sorted((r.sample_id, r.reason, r.message) for r in rejected), calls

    fast, fast_rejected, fast_calls = encode(True)
    slow, slow_rejected, slow_calls = encode(False)
    assert fast.equals(slow)
    assert fast_rejected == slow_rejected
    assert [r[:2] for r in fast_rejected] == [("s12", "path_outside_root"), ("s14", "missing_media"),
                                              ("s16", "missing_media")]
    media = fast.column("media").to_pylist()
    by_id = dict(zip(fast.column("sample_id").to_pylist(), media, strict=True))
    st = os.stat(root / "b" / "3.png")
    assert (by_id["s9"][0]["size_bytes"], by_id["s9"][0]["mtime_ns"]) == (st.st_size, st.st_mtime_ns)
    # the twelve plain files: one realpath for each of the two directories, not one for each file
    assert len(slow_calls) >= 12 and len(fast_calls) < len(slow_calls) - 8, (fast_calls, slow_calls)
