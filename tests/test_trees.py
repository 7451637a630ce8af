"""Message trees: isolation of branches, splitting under --max-branches / --max-tokens,
and --group-by-media merging.

The isolation test runs a tiny two-layer causal attention in numpy over a tree row with
the DESIGN.md mask (query q attends key j iff j <= q and sub[q] <= sub[j]) and over each
branch alone (prefix + branch, plain causal mask); the outputs at that branch's tokens,
and the targets, must be identical.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from packtool.formats import Rejected, molmo
from packtool.formats.llava import parse as parse_llava
from packtool.records import MediaRef, Sample
from packtool.rows import EncodeContext, SampleNames, encode_samples, encode_stored, group_by_media
from packtool.schema import PREFIX_SUBSEGMENT
from packtool.templates import get_template
from packtool.tokenization import load_tokenizer
from packtool.vision import get_family

TREE = {
    "id": "pixmo-17",
    "image": "img.png",
    "message_list": [
        {"question": "What colour is the car?", "answer": "Red.", "style": "user_qa"},
        {"messages": ["How many wheels does it have?", "Four.", "Any people nearby?", "No, the street is empty."]},
        {"question": "What colour is the sky?", "answer": "Blue, with a few clouds.", "style": "user_qa"},
    ],
}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    r = tmp_path_factory.mktemp("trees")
    Image.new("RGB", (84, 56), (200, 10, 10)).save(r / "img.png")
    Image.new("RGB", (56, 56), (10, 10, 200)).save(r / "other.png")
    return r


def ctx_for(root: Path, **kw) -> EncodeContext:
    return EncodeContext(load_tokenizer(None), get_template("chatml"), get_family("qwen2.5-vl"), root, **kw)


def encode(samples, ctx, counts=None):
    rows, rejected = encode_samples(samples, ctx, counts)
    assert rejected == []
    return rows


def attention(ids, pos, allowed, layers: int = 2, d: int = 16, seed: int = 0) -> np.ndarray:
    """A tiny causal transformer: token + position embeddings, ``layers`` attention layers."""
    rng = np.random.default_rng(seed)
    emb = rng.standard_normal((4099, d))
    pemb = rng.standard_normal((4096, d))
    ws = [rng.standard_normal((3, d, d)) / np.sqrt(d) for _ in range(layers)]
    x = emb[np.asarray(ids) % 4099] + pemb[np.asarray(pos)]
    for wq, wk, wv in ws:
        scores = (x @ wq) @ (x @ wk).T / np.sqrt(d)
        scores = np.where(allowed, scores, -np.inf)
        w = np.exp(scores - scores.max(axis=1, keepdims=True))
        x = x + (w / w.sum(axis=1, keepdims=True)) @ (x @ wv)
    return x


def tree_mask(sub: np.ndarray) -> np.ndarray:
    n = len(sub)
    q, j = np.arange(n)[:, None], np.arange(n)[None, :]
    return (j <= q) & (sub[:, None] <= sub[None, :])


def test_tree_layout_and_isolation(root):
    ctx = ctx_for(root)
    sample = molmo.parse(TREE, "t.jsonl", 0)
    [row] = encode([sample], ctx)
    ids, tgt, pos, sub = (row[k] for k in ("input_ids", "target_ids", "position_ids", "subsegment_ids"))
    assert row["n_branches"] == 3
    p = int(np.count_nonzero(sub == PREFIX_SUBSEGMENT))
    assert sub[:p].tolist() == [PREFIX_SUBSEGMENT] * p and sorted(set(sub[p:].tolist())) == [0, 1, 2]
    [m] = row["media"]
    assert m["token_offset"] + m["n_tokens"] <= p  # the image is encoded once, in the prefix
    out = attention(ids, pos, tree_mask(sub))
    for b in range(3):
        alone = Sample("b", "t", 0, sample.media, (sample.branches[b],))
        [single] = encode([alone], ctx)
        keep = (sub == PREFIX_SUBSEGMENT) | (sub == b)
        assert ids[keep].tolist() == single["input_ids"].tolist()
        assert pos[keep].tolist() == list(range(len(single["input_ids"])))
        ref = attention(single["input_ids"], single["position_ids"], tree_mask(single["subsegment_ids"]))
        at = np.flatnonzero(sub == b)
        np.testing.assert_allclose(out[at], ref[p:], rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(out[:p], ref[:p], rtol=1e-10, atol=1e-10)
        assert tgt[at].tolist() == single["target_ids"][p:].tolist()
        assert tgt[at][-1] == -100  # no branch predicts past its own end
    # the prefix targets agree with every branch alone too (no loss right after the prefix)
    assert tgt[p - 1] == -100


def test_tree_mask_is_not_trivially_causal(root):
    """Sanity for the test above: with a plain causal mask, later branches do see earlier ones."""
    [row] = encode([molmo.parse(TREE, "t.jsonl", 0)], ctx_for(root))
    sub, n = row["subsegment_ids"], len(row["subsegment_ids"])
    causal = np.tril(np.ones((n, n), dtype=bool))
    a = attention(row["input_ids"], row["position_ids"], causal)
    b = attention(row["input_ids"], row["position_ids"], tree_mask(sub))
    assert not np.allclose(a[sub == 2], b[sub == 2])


def branch_tokens(row) -> list[list[int]]:
    sub, ids = row["subsegment_ids"], row["input_ids"]
    pre = ids[sub == PREFIX_SUBSEGMENT].tolist()
    return [pre + ids[sub == b].tolist() for b in sorted(set(sub.tolist()) - {PREFIX_SUBSEGMENT})]


def test_max_branches_splits_into_trees_on_the_same_media(root):
    sample = molmo.parse(TREE, "t.jsonl", 0)
    [whole] = encode([sample], ctx_for(root))
    counts = Counter()
    rows = encode([sample], ctx_for(root, max_branches=2), counts)
    assert [r["sample_id"] for r in rows] == ["pixmo-17", "pixmo-17#1"]
    assert [r["n_branches"] for r in rows] == [2, 1]
    assert all(r["media"][0]["path"] == "img.png" for r in rows)
    assert branch_tokens(rows[0]) + [rows[1]["input_ids"].tolist()] == branch_tokens(whole)
    assert counts == Counter(trees=2, branches=3, split_extra_trees=1)



def test_a_name_is_stored_once_whichever_row_came_first(root):
    """A split tree is named ID#1; a record whose own id is ``ID#1`` gave a second row of that
    name, and so did a repeated id (inspect and stats then took two samples for one). With the
    task's :class:`SampleNames` the later row yields (``NAME#d1``), in whichever batch it comes,
    and its split trees follow its new name; both encoders name alike."""
    def plain(sid: str) -> Sample:
        return parse_llava({"id": sid, "image": "other.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "Blue."}]}, "t.jsonl", 1)

    def tree(sid: str) -> Sample:  # three branches: two trees under max_branches=2
        return molmo.parse({**TREE, "id": sid}, "t.jsonl", 0)

    ctx = ctx_for(root, max_branches=2)
    cases = [  # batches of samples -> the names stored, and how many rows got a derived name
        ([[tree("a"), plain("a#1")]], ["a", "a#1", "a#1#d1"], 1),
        ([[plain("a#1")], [tree("a")]], ["a#1", "a", "a#1#d1"], 1),
        ([[tree("x"), plain("y")], [tree("x"), plain("x")]], ["x", "x#1", "y", "x#d1", "x#d1#1", "x#d2"], 2),
        ([[plain("x#d1"), tree("x"), tree("x")]], ["x#d1", "x", "x#1", "x#d2", "x#d2#1"], 1),
    ]
    for batches, want, renamed in cases:
        names, names_stored = SampleNames(), SampleNames()
        got = [r["sample_id"] for b in batches for r in encode_samples(b, ctx, names=names)[0]]
        stored = [sid for b in batches for sid in encode_stored(b, ctx, names=names_stored)[0]["sample_id"].to_pylist()]
        assert (got, stored, names.renamed, names_stored.renamed) == (want, want, renamed, renamed), batches
    # without names (a batch encoded alone, as the library's callers do): the names as before
    assert [r["sample_id"] for r in encode_samples([tree("a"), plain("a#1")], ctx)[0]] == ["a", "a#1", "a#1"]


@pytest.mark.parametrize("max_branches", [None, 20_000])
def test_a_tree_holds_at_most_ten_thousand_branches(root, max_branches):
    """Branch b's subsegment id is b and the prefix's is 10000: a tree of 10,001 annotations
    gave its last branch the prefix's id, so the branches after it could not see the image
    (validate: "its shared prefix (subsegment 10000) is not at its start")."""
    record = {**TREE, "message_list": [{"question": f"Q{i}?", "answer": "A."} for i in range(PREFIX_SUBSEGMENT + 1)]}
    counts = Counter()
    rows = encode([molmo.parse(record, "t.jsonl", 0)], ctx_for(root, max_branches=max_branches), counts)
    assert [(r["sample_id"], r["n_branches"]) for r in rows] == [("pixmo-17", PREFIX_SUBSEGMENT), ("pixmo-17#1", 1)]
    sub = rows[0]["subsegment_ids"]
    assert np.count_nonzero(sub == PREFIX_SUBSEGMENT) == np.argmax(sub != PREFIX_SUBSEGMENT)  # the prefix, first
    assert sub[-1] == PREFIX_SUBSEGMENT - 1 and (rows[1]["subsegment_ids"] == PREFIX_SUBSEGMENT).all()
    assert counts["split_extra_trees"] == 1

def test_max_tokens_splits_branches_that_would_not_fit(root):
    sample = molmo.parse(TREE, "t.jsonl", 0)
    [whole] = encode([sample], ctx_for(root))
    sub = whole["subsegment_ids"]
    p = int(np.count_nonzero(sub == PREFIX_SUBSEGMENT))
    rest = [int(np.count_nonzero(sub == b)) for b in range(3)]
    cap = p + rest[0] + rest[1]  # branches 0 and 1 fit together; branch 2 does not
    counts = Counter()
    rows = encode([sample], ctx_for(root, max_tokens=cap), counts)
    assert [r["n_branches"] for r in rows] == [2, 1]
    assert rows[0]["n_tokens"] == cap and rows[1]["n_tokens"] == p + rest[2]
    assert counts["split_extra_trees"] == 1
    # a cap below any branch: every branch alone, none dropped
    rows = encode([sample], ctx_for(root, max_tokens=p + 1))
    assert len(rows) == 3 and [t for r in rows for t in branch_tokens(r) or [r["input_ids"].tolist()]] == branch_tokens(whole)


def llava(i, image, question, answer, tag_first=True):
    value = f"<image>\n{question}" if tag_first else f"{question}\n<image>"
    return parse_llava({"id": f"r{i}", "image": image, "conversations": [
        {"from": "human", "value": value}, {"from": "gpt", "value": answer}]}, "g.jsonl", i)


def test_group_by_media_merges_same_file(root):
    items = [llava(0, "img.png", "What colour?", "Red."), llava(1, "other.png", "Shape?", "Square."),
             Rejected("g.jsonl", 2, None, "bad_json", "x"), llava(3, "./img.png", "How big?", "Small.")]
    counts = Counter()
    merged = list(group_by_media(items, root, counts))
    assert [getattr(s, "sample_id", None) for s in merged] == ["r0", "r1", None]
    assert len(merged[0].branches) == 2 and merged[0].meta["merged"] == ("r3",)
    assert counts["merged_records"] == 1
    rows = encode([merged[0], merged[1]], ctx_for(root))
    assert [r["n_branches"] for r in rows] == [2, 1]
    # off by default: nothing merges unless asked
    assert [s.sample_id for s in items if isinstance(s, Sample)] == ["r0", "r1", "r3"]


def test_one_image_named_absolutely_and_relatively_is_one_tree_recorded_relative(root):
    """Records naming one image by absolute path, ``file://`` URI and relative path merge into one tree,
    whose row names the image relative to the root whichever record came first (it held the first
    record's absolute path, which tied the rows to where the media were)."""
    items = [llava(0, str(root / "img.png"), "What colour?", "Red."), llava(1, "img.png", "How big?", "Small."),
             llava(2, f"file://{root}/img.png", "Shape?", "Oblong."), llava(3, str(root / "other.png"), "Q?", "A.")]
    merged = list(group_by_media(items, root))
    assert [(s.sample_id, len(s.branches)) for s in merged] == [("r0", 3), ("r3", 1)]
    rows = encode(merged, ctx_for(root))
    assert [[m["path"] for m in r["media"]] for r in rows] == [["img.png"], ["other.png"]]


def test_group_by_media_uses_bytes_hash_for_inline_media(root):
    blob = (root / "img.png").read_bytes()
    a = llava(0, "img.png", "Q1?", "A1.")
    b = llava(1, "img.png", "Q2?", "A2.")
    a = Sample(a.sample_id, a.source, a.source_row, (MediaRef("image", "x.png", blob),), a.branches)
    b = Sample(b.sample_id, b.source, b.source_row, (MediaRef("image", "y.png", blob),), b.branches)
    c = Sample("c", "g", 2, (MediaRef("image", None, blob + b"\0"),), b.branches)
    merged = list(group_by_media([a, b, c], root))
    assert [len(s.branches) for s in merged] == [2, 1]


def test_inline_media_probed_once_keep_each_samples_path(root):
    """The probe memo keys inline bytes by the bytes alone and shares a path's entry between
    samples: two samples with the same bytes under different names each keep their own name,
    and two naming the same file get equal media entries."""
    blob = (root / "img.png").read_bytes()
    a = llava(0, "img.png", "Q1?", "A1.")
    b = llava(1, "img.png", "Q2?", "A2.")
    a_inline = Sample("a", a.source, 0, (MediaRef("image", "x.png", blob),), a.branches)
    b_inline = Sample("b", b.source, 1, (MediaRef("image", "y.png", blob),), b.branches)
    ctx = ctx_for(root)
    rows = encode([a_inline, b_inline, a, b], ctx)
    assert [r["media"][0]["path"] for r in rows] == ["x.png", "y.png", "img.png", "img.png"]
    assert [r["media"][0]["data"] is not None for r in rows] == [True, True, False, False]
    assert rows[2]["media"][0] == rows[3]["media"][0]
    assert len(ctx.probe_cache) == 2  # one entry for the bytes, one for the file


def test_merged_records_with_different_media_placement_become_separate_trees(root):
    a = llava(0, "img.png", "What colour?", "Red.")
    b = llava(1, "img.png", "How big?", "Small.", tag_first=False)
    [merged] = list(group_by_media([a, b], root))
    counts = Counter()
    rows = encode([merged], ctx_for(root), counts)
    assert len(rows) == 2 and counts["split_extra_trees"] == 1
    for r in rows:
        [m] = r["media"]
        assert r["input_ids"][m["token_offset"]] == 151655


def test_a_batch_encodes_each_sample_as_it_would_alone(root):
    """``encode_samples`` builds a batch's ids, targets and positions as whole arrays: every
    row equals the row of its sample encoded alone, across one-branch samples, a message tree,
    a text-only sample, a sample split by --max-branches and rejected samples in between
    (their pieces are rolled back)."""
    ctx = ctx_for(root, max_branches=2)
    llava = [
        {"id": "a", "image": "img.png", "conversations": [{"from": "human", "value": "<image>\nWhat is it?"},
                                                         {"from": "gpt", "value": "A red block."}]},
        {"id": "bad", "image": "img.png", "conversations": [{"from": "human", "value": "<image><image> two tags"},
                                                           {"from": "gpt", "value": "No."}]},
        {"id": "t", "conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "hi"},
                                      {"from": "human", "value": "Again, twice."}, {"from": "gpt", "value": "hi hi"}]},
        {"id": "missing", "image": "nope.png", "conversations": [{"from": "human", "value": "<image>?"},
                                                                {"from": "gpt", "value": "?"}]},
        {"id": "b", "image": "other.png", "conversations": [{"from": "human", "value": "Colour? <image>"},
                                                           {"from": "gpt", "value": "Blue."}]},
    ]
    samples = [parse_llava({**rec, "image": ["img.png", "img.png"]} if rec["id"] == "bad" else rec, "x.jsonl", i)
               for i, rec in enumerate(llava)]
    # "bad": two placeholders but one image, which encoding rejects (placeholder_mismatch)
    samples[1] = Sample("bad", "x.jsonl", 1, samples[1].media[:1], samples[1].branches)
    tree = molmo.parse(TREE, "m.jsonl", 0)
    samples.insert(3, tree)
    rows, rejected = encode_samples(samples, ctx)
    assert sorted(r.sample_id for r in rejected) == ["bad", "missing"]
    alone = []
    for s in samples:
        one, _ = encode_samples([s], ctx)
        alone.extend(one)
    assert [r["sample_id"] for r in rows] == [r["sample_id"] for r in alone] == ["a", "t", "pixmo-17", "pixmo-17#1",
                                                                                  "b"]
    for got, want in zip(rows, alone, strict=True):
        assert got.keys() == want.keys()
        for key, value in want.items():
            if isinstance(value, np.ndarray):
                assert got[key].dtype == value.dtype and got[key].tolist() == value.tolist(), (want["sample_id"], key)
            else:
                assert got[key] == value, (want["sample_id"], key)
    # one-branch rows: all prefix, positions from 0, the last token predicts nothing
    a = rows[0]
    assert a["subsegment_ids"].tolist() == [PREFIX_SUBSEGMENT] * a["n_tokens"]
    assert a["position_ids"].tolist() == list(range(a["n_tokens"])) and a["target_ids"][-1] == -100


def test_a_bad_record_leaves_its_merged_tree_alone(root):
    """One record of a --group-by-media tree with a bad conversation (here no assistant turn) is
    rejected alone, as it would be without grouping: every other record of that image stayed out of
    the shards too, each told "the conversation has no assistant turn", which was not true of it."""
    no_answer = parse_llava({"id": "r0", "image": "img.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat colour?"}]}, "g.jsonl", 0)
    items = [no_answer, llava(1, "img.png", "How big?", "Small."), llava(2, "img.png", "Shape?", "Oblong."),
             llava(3, "other.png", "Q?", "A."), llava(4, "gone.png", "Q?", "A."), llava(5, "gone.png", "Q2?", "A2.")]
    counts = Counter()
    merged = list(group_by_media(items, root, counts))
    assert counts["merged_records"] == 3
    rows, rejected = encode_samples(merged, ctx_for(root), counts)
    # the tree is named after its first record kept, and holds the two good records' branches
    assert [(r["sample_id"], r["source_row"], r["n_branches"]) for r in rows] == [("r1", 1, 2), ("r3", 3, 1)]
    assert [(r.sample_id, r.reason) for r in rejected] == [("r0", "no_loss"), ("r4", "missing_media"),
                                                           ("r5", "missing_media")]
    assert "in the tree of" not in rejected[0].message
    # rows_in = samples - split_extra_trees + merged_records + rejected
    assert counts["merged_records"] == 1 and len(items) == len(rows) - 0 + 1 + len(rejected)
    alone = [encode_samples([s], ctx_for(root))[0] for s in items[1:3]]
    assert branch_tokens(rows[0]) == [a[0]["input_ids"].tolist() for a in alone]


def test_a_merged_record_that_places_fewer_media_is_rejected_as_alone(root):
    """Records merge on their media list; each must place every item itself. A record placing one of
    its two images was accepted inside a tree (another record placed the second), giving a row that
    counted the vision units of an image it does not hold."""
    both = parse_llava({"id": "r0", "image": ["img.png", "other.png"], "conversations": [
        {"from": "human", "value": "<image><image>\nCompare."}, {"from": "gpt", "value": "Red, blue."}]}, "g.jsonl", 0)
    one = llava(1, "img.png", "Colour?", "Red.")
    one = Sample(one.sample_id, one.source, one.source_row, both.media, one.branches)
    [merged] = list(group_by_media([both, one], root))
    rows, rejected = encode_samples([merged], ctx_for(root))
    assert [(r["sample_id"], r["n_branches"], len(r["media"])) for r in rows] == [("r0", 1, 2)]
    assert [(r.sample_id, r.reason) for r in rejected] == [("r1", "placeholder_mismatch")]
    _, alone = encode_samples([one], ctx_for(root))
    assert [(r.reason, r.message) for r in alone] == [(rejected[0].reason, rejected[0].message)]


def test_grouped_tokenize_reports_progress_of_every_input_row(root, tmp_path):
    """Progress counts input rows (its total is the rows planned): with --group-by-media it counted
    the trees, so a bar over a corpus of many annotations per image stopped far short of its total."""
    import json

    from packtool import TokenizeConfig, tokenize_dataset

    recs = [{"id": f"r{i}", "image": "img.png" if i % 4 else "other.png",
             "conversations": [{"from": "human", "value": f"<image>\nQ{i}?"}, {"from": "gpt", "value": f"A{i}."}]}
            for i in range(12)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    seen: list[int] = []
    m = tokenize_dataset([data], tmp_path / "tok", TokenizeConfig(media_root=str(root), group_by_media=True),
                         progress=seen.append, workers=1)
    assert (m["counts"]["rows_in"], m["counts"]["samples"], m["counts"]["merged_records"]) == (12, 2, 10)
    assert sum(seen) == 12


def chat(i, image, *turns):
    """A LLaVA record on ``image`` whose turns alternate question, answer (the image before the first)."""
    convs = [{"from": "human" if k % 2 == 0 else "gpt", "value": ("<image>\n" if k == 0 else "") + t}
             for k, t in enumerate(turns)]
    return {"id": f"r{i}", "image": image, "conversations": convs}


#: Records on two images: on img.png, r0 is a prefix of r1 and r2 (which repeat each other); on
#: other.png, r3 and r4 are the same conversation. r0 and r4 lie wholly inside their tree's prefix.
FOLDING = [chat(0, "img.png", "What colour?", "Red."),
           chat(1, "img.png", "What colour?", "Red.", "Shape?", "Oblong."),
           chat(2, "img.png", "What colour?", "Red.", "Shape?", "Oblong."),
           chat(3, "other.png", "Colour?", "Blue."),
           chat(4, "other.png", "Colour?", "Blue.")]


def test_a_branch_inside_the_shared_prefix_is_counted_as_folded(root):
    """A merged record that is a prefix of every other branch of its tree, or a tree's repeated
    conversation, has no tokens of its own: it was dropped from the row's n_branches while the
    counts still said it was a branch. Now the counts say what the rows hold (branches = the sum
    of n_branches) and count the others as folded; its tokens are the prefix's, trained once."""
    counts = Counter()
    samples = list(group_by_media([parse_llava(r, "f.jsonl", i) for i, r in enumerate(FOLDING)], root, counts))
    rows = encode(samples, ctx_for(root), counts)
    assert [(r["sample_id"], r["n_branches"]) for r in rows] == [("r0", 2), ("r3", 1)]
    assert counts["branches"] == sum(r["n_branches"] for r in rows) == 3
    assert counts["folded_branches"] == 2 and counts["branches"] + counts["folded_branches"] == len(FOLDING)
    tree, pair = rows
    [r0] = encode([parse_llava(FOLDING[0], "f.jsonl", 0)], ctx_for(root))
    prefix = tree["subsegment_ids"] == PREFIX_SUBSEGMENT
    # r0 is the prefix, its answer's targets as r0 alone has them (it trains once); r1 and r2 are branches
    assert tree["input_ids"][prefix].tolist() == r0["input_ids"].tolist()
    assert tree["target_ids"][prefix].tolist() == r0["target_ids"].tolist()
    [r1] = encode([parse_llava(FOLDING[1], "f.jsonl", 1)], ctx_for(root))
    assert branch_tokens(tree) == [r1["input_ids"].tolist()] * 2
    [r3] = encode([parse_llava(FOLDING[3], "f.jsonl", 3)], ctx_for(root))
    assert pair["input_ids"].tolist() == r3["input_ids"].tolist()  # the repeat adds nothing
    assert pair["target_ids"].tolist() == r3["target_ids"].tolist()  # its answer trains once
    # without --group-by-media nothing folds
    counts = Counter()
    rows = encode([parse_llava(r, "f.jsonl", i) for i, r in enumerate(FOLDING)], ctx_for(root), counts)
    assert counts["branches"] == len(rows) == 5 and counts["folded_branches"] == 0


def test_tokenize_reports_folded_branches_and_its_counts_match_the_shards(root, tmp_path):
    """End to end: the manifest's branches are the shards' n_branches, folded_branches is in the
    counts and --json, and the summary says in one note what happened to the folded records. A
    Molmo tree on a third image folds nothing."""
    import json
    import shutil

    import pyarrow.parquet as pq
    from clirun import packtool

    media = tmp_path / "media"
    media.mkdir()
    for name in ("img.png", "other.png"):
        shutil.copy(root / name, media / name)
    Image.new("RGB", (70, 42), (10, 200, 10)).save(media / "third.png")
    data = tmp_path / "f.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [*FOLDING, {**TREE, "image": "third.png"}]))
    out = tmp_path / "tok"
    args = ["tokenize", str(data), "--media-root", str(media), "-o", str(out), "--group-by-media", "--workers", "1"]
    r = packtool(*args, "-q")
    assert (r.returncode, r.stderr) == (0, "")
    assert r.stdout == (f"3 samples from 6 rows in 1 shard -> {out}\n"
                        "note: 2 branches lie wholly inside the shared prefix of their message tree (a repeat, or a "
                        "prefix of every other branch): their tokens train once, in the prefix, not as a branch of "
                        "their own (counts: folded_branches)\n")
    counts = json.loads((out / ".packtool" / "manifest.json").read_text())["counts"]
    stored = pq.read_table(out / "part-00000-00000.parquet", columns=["sample_id", "n_branches"]).to_pylist()
    assert stored == [{"sample_id": "r0", "n_branches": 2}, {"sample_id": "r3", "n_branches": 1},
                      {"sample_id": "pixmo-17", "n_branches": 3}]
    assert (counts["branches"], counts["folded_branches"], counts["merged_records"]) == (6, 2, 3)
    assert json.loads(packtool(*args, "--json").stdout)["folded_branches"] == 2
