"""End-to-end invariants on the demo corpus: every sample accounted for, capacities held,
loss exactly on assistant content, sequence bookkeeping consistent, media spans on placeholders."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from packtool.runs import read_expanded
from packtool.schema import PREFIX_SUBSEGMENT, SUBSEGMENT_STRIDE
from packtool.tokenization import load_tokenizer

IMAGE_PAD, VISION_START, VISION_END, IM_END = 151655, 151652, 151653, 151645


def _packed_rows(packed_dir):
    manifest = json.loads((packed_dir / ".packtool" / "manifest.json").read_text())
    rows = []
    for shard in manifest["shards"]:
        rows.extend(read_expanded(packed_dir / shard["file"]).to_pylist())
    return manifest, rows


def _records(sample_dir):
    return [json.loads(line) for line in (sample_dir / "data.jsonl").read_text().splitlines() if line.strip()]


def _errors(d):
    f = d / ".packtool" / "errors.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []


def test_every_input_sample_lands_in_exactly_one_place(demo_dirs):
    records = _records(demo_dirs["sample"])
    _, rows = _packed_rows(demo_dirs["packed"])
    packed_ids = [sid for r in rows for sid in r["sample_ids"]]
    rejected = [e["sample_id"] for e in _errors(demo_dirs["tokenized"]) + _errors(demo_dirs["packed"])]
    assert len(packed_ids) == len(set(packed_ids)), "a sample appears in two packs"
    assert sorted(packed_ids + rejected) == sorted(r["id"] for r in records)
    assert len(packed_ids) == len(records)  # the demo corpus is clean and fits


def test_no_pack_exceeds_either_capacity(demo_dirs):
    manifest, rows = _packed_rows(demo_dirs["packed"])
    caps = manifest["capacities"]
    for r in rows:
        assert len(r["input_ids"]) == r["n_tokens"] <= caps["max_tokens"]
        assert sum(m["vision_units"] for m in r["media"]) == r["n_vision_units"] <= caps["max_vision_units"]


def _sample_slices(row):
    cu = row["cu_seqlens"]
    return [(cu[k], cu[k + 1]) for k in range(len(cu) - 1)]


def test_loss_is_exactly_on_assistant_content_and_end_token(demo_dirs):
    tok = load_tokenizer()
    by_id = {r["id"]: r for r in _records(demo_dirs["sample"])}
    _, rows = _packed_rows(demo_dirs["packed"])
    for r in rows:
        ids = np.asarray(r["input_ids"])
        tgt = np.asarray(r["target_ids"])
        for k, (a, b) in enumerate(_sample_slices(r)):
            seg_ids, seg_tgt = ids[a:b], tgt[a:b]
            # pre-shifted: a target is either ignored or the next token of the same sample
            lossy = seg_tgt != -100
            assert seg_tgt[-1] == -100, "the last token of a sample must predict nothing"
            np.testing.assert_array_equal(seg_tgt[:-1][lossy[:-1]], seg_ids[1:][lossy[:-1]])
            # the tokens that carry loss, run by run, decode to each assistant answer + <|im_end|>
            carries = np.concatenate([[False], lossy[:-1]])
            runs, cur = [], []
            for t, c in zip(seg_ids.tolist(), carries.tolist(), strict=True):
                if c:
                    cur.append(t)
                elif cur:
                    runs.append(cur)
                    cur = []
            if cur:
                runs.append(cur)
            rec = by_id[r["sample_ids"][k]]
            expected = [t["value"] + "<|im_end|>" for t in rec["conversations"] if t["from"] == "gpt"]
            assert [tok.decode(run) for run in runs] == expected


def test_cu_seqlens_position_ids_and_subsegments_agree(demo_dirs):
    _, rows = _packed_rows(demo_dirs["packed"])
    assert rows
    for r in rows:
        pos = np.asarray(r["position_ids"])
        sub = np.asarray(r["subsegment_ids"])
        cu = r["cu_seqlens"]
        assert cu[0] == 0 and cu[-1] == len(r["input_ids"])
        assert len(cu) == len(r["sample_ids"]) + 1
        starts = set(cu[:-1])
        for t in range(len(pos)):
            assert (pos[t] == 0) == (t in starts), f"position reset at {t} disagrees with cu_seqlens"
        for k, (a, b) in enumerate(_sample_slices(r)):
            np.testing.assert_array_equal(pos[a:b], np.arange(b - a))  # demo samples are single-branch
            assert set(sub[a:b] // SUBSEGMENT_STRIDE) == {k}
            assert set(sub[a:b] % SUBSEGMENT_STRIDE) == {PREFIX_SUBSEGMENT}


def test_media_spans_point_at_vision_placeholders(demo_dirs):
    _, rows = _packed_rows(demo_dirs["packed"])
    n_media = 0
    for r in rows:
        ids = r["input_ids"]
        cu = r["cu_seqlens"]
        for m in r["media"]:
            off, n = m["token_offset"], m["n_tokens"]
            assert ids[off - 1] == VISION_START and ids[off + n] == VISION_END
            assert set(ids[off : off + n]) == {IMAGE_PAD}
            assert cu[m["sample_index"]] <= off < off + n <= cu[m["sample_index"] + 1]
            assert n == m["grid_h"] * m["grid_w"] // 4
            assert len(m["data"]) > 100 and m["frames"] is None  # embedded original bytes
            n_media += 1
        assert sum(1 for t in ids if t == IMAGE_PAD) == sum(m["n_tokens"] for m in r["media"])
    records = _records(demo_dirs["sample"])
    expected = sum(len(x["image"]) if isinstance(x.get("image"), list) else int("image" in x) for x in records)
    assert n_media == expected


@pytest.mark.parametrize("kind", ["tokenized", "packed"])
def test_manifest_lists_every_shard_with_size_and_hash(demo_dirs, kind):
    import hashlib

    d = demo_dirs[kind]
    manifest = json.loads((d / ".packtool" / "manifest.json").read_text())
    assert manifest["kind"] == kind and manifest["config_digest"]
    assert manifest["tokenizer"]["name"] == "qwen2"
    listed = {s["file"] for s in manifest["shards"]}
    assert listed == {p.name for p in d.glob("*.parquet")}
    for s in manifest["shards"]:
        data = (d / s["file"]).read_bytes()
        assert len(data) == s["bytes"] and hashlib.sha256(data).hexdigest() == s["sha256"]
        assert pq.ParquetFile(d / s["file"]).metadata.num_rows == s["rows"]
