"""`packtool inspect`: a pack of the demo corpus, a message tree, and a pack holding a real video,
each checked against what the tokens and source records say."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import av
import numpy as np
import pyarrow.parquet as pq
import pytest
from clirun import packtool

from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset
from packtool.inspection import LOSS_CLOSE, LOSS_OPEN, inspect_dir, render_inspection
from packtool.records import MediaRef, Message, Part, Sample
from packtool.rows import EncodeContext, encode_samples
from packtool.runs import read_expanded
from packtool.schema import TOKENIZED
from packtool.shards import ShardWriter, write_manifest
from packtool.templates import get_template
from packtool.tokenization import load_tokenizer
from packtool.vision import get_family

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "examples" / "sample"


def run(*args: str) -> subprocess.CompletedProcess:
    return packtool(*args)  # in this process (tests/clirun.py): what a command prints and writes


def _write_tokenized(out: Path, rows: list[dict], model: str, media_root: Path) -> Path:
    """A tokenized directory written with the library's shard writer and manifest."""
    out.mkdir(parents=True)
    tok = load_tokenizer()
    fam = get_family(model)
    with ShardWriter(out, TOKENIZED, rows_per_shard=100) as w:
        w.write_rows(rows)
    config = {"model": model, "template": "chatml", "tokenizer": None, "media_root": str(media_root)}
    write_manifest(out, "tokenized", config, f"test-{out.name}", w.shards, tokenizer=tok.identity(),
                   vision={**fam.settings(), "unit": fam.unit_name, "default_max_vision_units": fam.default_max_vision_units},
                   template={"name": "chatml"},
                   counts={"rows_in": len(rows), "samples": len(rows), "rejected": 0, "rejected_by_reason": {}})
    return out


def _msg(role: str, *parts: Part) -> Message:
    return Message(role, tuple(parts))


def _text(t: str) -> Part:
    return Part.of_text(t)


# ----------------------------------------------------------------------------------------------
# a pack of the demo corpus


def test_demo_pack_reads_like_the_source_records(demo_dirs):
    view = inspect_dir(demo_dirs["packed"], pack=1)
    records = {json.loads(x)["id"]: json.loads(x) for x in (SAMPLE / "data.jsonl").read_text().splitlines()}
    manifest = json.loads((demo_dirs["packed"] / ".packtool" / "manifest.json").read_text())
    rows = []
    for shard in manifest["shards"]:
        rows += read_expanded(demo_dirs["packed"] / shard["file"], columns=["pack_index", "sample_ids", "cu_seqlens", "target_ids"]).to_pylist()
    row = next(r for r in rows if r["pack_index"] == 1)
    assert view["kind"] == "pack" and view["pack_index"] == 1
    assert [s["sample_id"] for s in view["samples"]] == row["sample_ids"]
    for k, s in enumerate(view["samples"]):
        rec = records[s["sample_id"]]
        a, b = row["cu_seqlens"][k], row["cu_seqlens"][k + 1]
        assert (s["start"], s["end"]) == (a, b)
        assert s["ruler"] == [{"part": "sample", "tokens": [0, b - a - 1], "positions": [0, b - a - 1],
                               "subsegment": k * 100000 + 10000}]
        assert s["n_loss_tokens"] == sum(1 for x in row["target_ids"][a:b] if x != -100)
        turns = s["parts"][0]["turns"]
        roles = {"human": "user", "gpt": "assistant"}
        assert [t["role"] for t in turns] == ["system"] + [roles[c["from"]] for c in rec["conversations"]]
        answers = [c["value"] for c in rec["conversations"] if c["from"] == "gpt"]
        for t, ans in zip([t for t in turns if t["role"] == "assistant"], answers, strict=True):
            assert t["text"] == f"{LOSS_OPEN}{ans}<|im_end|>{LOSS_CLOSE}"
        for t in turns:
            if t["role"] != "assistant":
                assert LOSS_OPEN not in t["text"]
        n_images = len(rec["image"]) if isinstance(rec.get("image"), list) else int("image" in rec)
        assert len(s["media"]) == n_images
        user_text = "".join(t["text"] for t in turns if t["role"] == "user")
        for i, m in enumerate(s["media"], 1):
            label = f"<image {i}: {m['resized_width']}×{m['resized_height']}, {m['n_tokens']:,} tokens>"
            assert label in user_text
        assert "<|image_pad|>" not in user_text and "<|vision_start|>" not in user_text
    text = render_inspection(view)
    assert text.splitlines()[0].startswith("pack 1  (")
    assert f"  assistant    {LOSS_OPEN}" in text and "  ruler  tokens 0.." in text


def test_cli_inspect_sample_in_a_pack_and_errors(demo_dirs):
    r = run("inspect", str(demo_dirs["packed"]), "--sample", "demo-010")
    assert r.returncode == 0, r.stderr
    assert "] demo-010  tokens" in r.stdout and r.stdout.count("  assistant   ") == 3
    r = run("inspect", str(demo_dirs["packed"]), "--pack", "999")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == (f"Error: --pack 999: {str(demo_dirs['packed'])!r} has no such pack; its 4 packs are numbered "
                        "0..3 (pack_index = task × 1000000000 + k); pass one of those\n")
    r = run("inspect", str(demo_dirs["packed"]), "--sample", "nope")
    assert r.returncode == 1 and "'nope' is in no pack" in r.stderr and "errors.jsonl" in r.stderr
    r = run("inspect", str(demo_dirs["tokenized"]), "--pack", "0")
    assert r.returncode == 1 and "use --sample" in r.stderr
    # flags that contradict each other are a usage error (it exited 1, as a failed run does)
    r = run("inspect", str(demo_dirs["packed"]), "--pack", "0", "--sample", "demo-010")
    assert (r.returncode, r.stdout) == (2, "") and r.stderr.startswith("Usage: packtool inspect ")
    assert r.stderr.endswith("\n\nError: give --pack or --sample, not both\n")
    r = run("inspect", str(demo_dirs["packed"]), "--tokenizer", "qwen3")  # the same check as validate's
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr == ("Error: --tokenizer 'qwen3': 'qwen3' adds <tool_response>, </tool_response>, <think> and "
                        "</think> to the 'qwen2' vocabulary the directory was made with; pass --tokenizer qwen2 or "
                        "leave it out\n")
    r = run("inspect", str(demo_dirs["tokenized"]), "--sample", "demo-003", "--json")
    view = json.loads(r.stdout)
    assert view["kind"] == "sample" and view["samples"][0]["sample_id"] == "demo-003"


def test_a_sample_tokenize_rejected_or_pack_dropped_is_refused_with_its_reason(tmp_path):
    # it said only "sample 'gone' is not in 'tok' (e.g. 'demo-000', ...)", and of a packed directory
    # "a dropped sample is listed in errors.jsonl", leaving the reason to be looked up
    lines = (SAMPLE / "data.jsonl").read_text().splitlines()[:8]
    lines.append(json.dumps({"id": "gone", "image": "images/nope.png",
                             "conversations": [{"from": "human", "value": "<image>\nHi"}, {"from": "gpt", "value": "Hello."}]}))
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    tok, packed = tmp_path / "tok", tmp_path / "packed"
    tokenize_dataset([tmp_path / "in.jsonl"], tok, TokenizeConfig(media_root=str(SAMPLE)))
    pack_dataset(tok, packed, PackConfig(max_tokens=2048))
    (missing,) = [json.loads(x) for x in (tok / ".packtool" / "errors.jsonl").read_text().splitlines()]
    dropped = json.loads((packed / ".packtool" / "errors.jsonl").read_text().splitlines()[0])
    assert missing["sample_id"] == "gone" and dropped["reason"] == "oversize"
    rejected = (f"tokenize rejected it (missing_media: {missing['message']}; {tmp_path / 'in.jsonl'} row 8), "
                f"as {tok / '.packtool' / 'errors.jsonl'} lists")
    r = run("inspect", str(tok), "--sample", "gone")
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr == f"Error: sample 'gone' is not in {str(tok)!r}: {rejected}\n"
    r = run("inspect", str(packed), "--sample", "gone")
    assert r.stderr == f"Error: sample 'gone' is in no pack of {str(packed)!r}: {rejected}\n"
    r = run("inspect", str(packed), "--sample", dropped["sample_id"])
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr == (f"Error: sample {dropped['sample_id']!r} is in no pack of {str(packed)!r}: pack dropped it "
                        f"(oversize: {dropped['message']}; {dropped['source']} row {dropped['row']}), as "
                        f"{packed / '.packtool' / 'errors.jsonl'} lists\n")
    r = run("inspect", str(packed), "--sample", "never-was")  # in no list: examples, as before
    assert r.stderr.startswith(f"Error: sample 'never-was' is in no pack of {str(packed)!r} (e.g. 'demo-")


def test_a_record_merged_into_a_tree_is_looked_up_by_the_trees_id(tmp_path):
    # --group-by-media stores a merged record under the id of the first record of its image; a search
    # for its own id said only "not in" (a packed directory: "a dropped sample is listed in
    # errors.jsonl", which holds nothing about it)
    recs = [{"id": f"r{i}", "image": "images/img00.png",
             "conversations": [{"from": "human", "value": f"<image>\n{q}"}, {"from": "gpt", "value": "Yes."}]}
            for i, q in enumerate(["Is it red?", "Is it round?", "Is it small?"])]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    tok, packed = tmp_path / "tok", tmp_path / "packed"
    tokenize_dataset([tmp_path / "in.jsonl"], tok, TokenizeConfig(media_root=str(SAMPLE), group_by_media=True))
    pack_dataset(tok, packed, PackConfig(max_tokens=2048))
    note = ("; --group-by-media merged 2 records into the trees of others, each named after the first record of its "
            "media (trees split off: ID#1, ID#2, ...): a merged record is in the tree of the first record with the "
            "same images or videos")
    r = run("inspect", str(tok), "--sample", "r1")
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr == f"Error: sample 'r1' is not in {str(tok)!r} (e.g. 'r0'){note}\n"
    r = run("inspect", str(packed), "--sample", "r2")
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr == (f"Error: sample 'r2' is in no pack of {str(packed)!r} (e.g. 'r0'); a dropped sample is listed "
                        f"in .packtool/errors.jsonl{note}\n")
    r = run("inspect", str(tok), "--sample", "r0")
    assert r.returncode == 0 and "3 branches" in r.stdout and "small?" in r.stdout


def test_an_id_samples_of_several_tasks_share_is_listed_with_every_sample(tmp_path):
    """A task names its samples apart (a repeat becomes ID#d1), tasks do not: inspect --sample
    showed the first sample of the name and said nothing of the others. It lists them all, with
    their shard rows and input rows, --source keeps one input's, and the names a task derived
    from the id are named too."""
    lines = (SAMPLE / "data.jsonl").read_text().splitlines()
    recs = [{**json.loads(line), "id": rid} for line, rid in zip(lines, "aabacdc", strict=False)]
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    one.write_text("".join(json.dumps(r) + "\n" for r in recs[:6]))
    two.write_text("".join(json.dumps(r) + "\n" for r in recs[6:]))
    tok, packed = tmp_path / "tok", tmp_path / "packed"
    # tasks of 3 rows: [a a b] [a c d] [c]: each task stores a name once
    tokenize_dataset([one, two], tok, TokenizeConfig(media_root=str(SAMPLE), rows_per_shard=3))
    manifest = json.loads((tok / ".packtool" / "manifest.json").read_text())
    stored = [pq.read_table(tok / e["file"])["sample_id"].to_pylist() for e in manifest["shards"]]
    assert (stored, manifest["counts"]["repeated_ids"]) == ([["a", "a#d1", "b"], ["a", "c", "d"], ["c"]], 1)
    view = inspect_dir(tok, sample="a")
    assert [(m["file"], m["row"], m["source_row"], m["shown"]) for m in view["matches"]] == [
        ("part-00000-00000.parquet", 0, 0, True), ("part-00001-00000.parquet", 0, 3, False)]
    assert view["repeats"] == ["a#d1"]
    assert render_inspection(view).splitlines()[1:3] == [
        f"note: 2 samples are named 'a': part-00000-00000.parquet row 0 (from {one} row 0) (shown), "
        f"part-00001-00000.parquet row 0 (from {one} row 3); tokenize names samples apart only within one task (input "
        "slice), and these come from different tasks of one input: give the records ids of their own",
        "note: tokenize stored later samples with this id under names of their own (a task holds each name once): "
        "a#d1; inspect them by those names"]
    view = inspect_dir(tok, sample="c")
    assert render_inspection(view).splitlines()[1].endswith(f"(from {two} row 0); pick a source with --source FILE")
    view = inspect_dir(tok, sample="c", source=str(two))
    assert (view["file"], view["samples"][0]["source"], "matches" in view) == ("part-00002-00000.parquet", str(two), False)
    # one sample of the name: the view as it always was
    assert {"matches", "repeats"} & set(inspect_dir(tok, sample="b")) == set()
    pack_dataset(tok, packed, PackConfig(max_tokens=2048))
    view = inspect_dir(packed, sample="c")
    assert len(view["matches"]) == 2 and [v["sample_id"] for v in view["samples"]] == ["c"]
    assert render_inspection(view).splitlines()[1].endswith("; see another with --pack N")
    r = run("inspect", str(packed), "--sample", "c", "--source", str(two))
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr == (f"Error: --source picks one source of a mixture, and {str(packed)!r} packs one tokenized "
                        "directory; leave --source out (the samples of a name are listed with their packs)\n")


@pytest.fixture(scope="module")
def three_tasks(tmp_path_factory) -> Path:
    """The demo corpus tokenized 10 rows a shard and packed: three pack tasks, so pack numbers
    jump by 1,000,000,000 from one task to the next."""
    base = tmp_path_factory.mktemp("tasks")
    tok, packed = base / "tok10", base / "packed"
    assert run("tokenize", str(SAMPLE / "data.jsonl"), "--media-root", str(SAMPLE), "-o", str(tok),
               "--rows-per-shard", "10", "--workers", "1", "-q").returncode == 0
    assert run("pack", str(tok), "-o", str(packed), "--max-tokens", "8192", "--workers", "1", "-q").returncode == 0
    return packed


def test_pack_numbers_of_several_tasks_are_what_the_error_lists(three_tasks):
    manifest = json.loads((three_tasks / ".packtool" / "manifest.json").read_text())
    runs, firsts = [], []
    for entry in manifest["shards"]:
        numbers = pq.read_table(three_tasks / entry["file"], columns=["pack_index"])["pack_index"].to_pylist()
        task = int(entry["file"].split("-")[1])
        assert numbers == list(range(task * 1_000_000_000, task * 1_000_000_000 + len(numbers)))
        runs.append(f"{numbers[0]}..{numbers[-1]}" if len(numbers) > 1 else f"{numbers[0]}")
        firsts.append(numbers[0])
    assert firsts == [0, 1_000_000_000, 2_000_000_000]
    for n in firsts:  # the numbers the error lists are the ones --pack takes
        r = run("inspect", str(three_tasks), "--pack", str(n))
        assert r.returncode == 0 and r.stdout.startswith(f"pack {n}  ("), r.stderr
    r = run("inspect", str(three_tasks), "--pack", "2")
    assert r.returncode == 1 and r.stdout == ""
    n_packs = sum(e["rows"] for e in manifest["shards"])
    assert r.stderr == (f"Error: --pack 2: {str(three_tasks)!r} has no such pack; its {n_packs} packs are numbered "
                        f"{', '.join(runs[:-1])} and {runs[-1]} (pack_index = task × 1000000000 + k); pass one of those\n")


def test_pack_numbers_read_as_runs():
    from packtool.inspection import _number_ranges

    assert _number_ranges([5]) == "5"
    assert _number_ranges([0, 2, 4]) == "0, 2 and 4"
    many = [t * 1_000_000_000 + k for t in range(7) for k in range(2)]
    assert _number_ranges(many) == ("0..1, 1000000000..1000000001, 2000000000..2000000001, 3000000000..3000000001, …, "
                                    "6000000000..6000000001 (7 runs)")


def test_inspect_of_a_packed_dir_without_packs_says_so(demo_dirs, tmp_path):
    empty = tmp_path / "empty"
    r = run("pack", str(demo_dirs["tokenized"]), "-o", str(empty), "--max-tokens", "16", "--workers", "1", "-q")
    assert r.returncode == 0 and r.stdout.startswith("0 samples in 0 packs"), r.stderr
    r = run("inspect", str(empty))
    why = ("all 30 of its samples were dropped as oversize (listed in .packtool/errors.jsonl); pack again with a "
           "larger --max-tokens or --max-vision-units, or with --oversize alone")
    assert (r.returncode, r.stdout, r.stderr) == (1, "", f"Error: {str(empty)!r} holds no packs: {why}\n")
    r = run("inspect", str(empty), "--pack", "0")
    assert (r.returncode, r.stdout, r.stderr) == (1, "", f"Error: --pack 0: {str(empty)!r} holds no packs: {why}\n")
    # --sample: it said "is in no pack of … (e.g. ); a dropped sample is listed in …"
    r = run("inspect", str(empty), "--sample", "demo-000")
    assert (r.returncode, r.stdout, r.stderr) == (1, "", f"Error: sample 'demo-000' is in no pack of {str(empty)!r}, "
                                                         f"which holds no packs: {why}\n")


# ----------------------------------------------------------------------------------------------
# a message tree


@pytest.fixture(scope="module")
def tree_dir(tmp_path_factory) -> Path:
    img = Part.media("image", 0)
    questions = [("What colour is it?", "Red."), ("What shape is it?", "A circle."), ("Is there text?", "No.")]
    branches = tuple((_msg("user", img, _text(q)), _msg("assistant", _text(a))) for q, a in questions)
    tree = Sample("tree-0", "mem.jsonl", 0, (MediaRef("image", "images/img00.png"),), branches)
    plain = Sample("plain-1", "mem.jsonl", 1, (), ((_msg("user", _text("Hi")), _msg("assistant", _text("Hello."))),))
    ctx = EncodeContext(load_tokenizer(), get_template("chatml"), get_family("qwen2.5-vl"), SAMPLE)
    rows, rejected = encode_samples([tree, plain], ctx)
    assert not rejected and rows[0]["n_branches"] == 3
    return _write_tokenized(tmp_path_factory.mktemp("tree") / "tok", rows, "qwen2.5-vl", SAMPLE)


def test_tree_shows_prefix_then_each_branch(tree_dir):
    view = inspect_dir(tree_dir, sample="tree-0")
    s = view["samples"][0]
    row = read_expanded(next(tree_dir.glob("*.parquet"))).to_pylist()[0]
    sub, pos = np.array(row["subsegment_ids"]), np.array(row["position_ids"])
    p = int((sub == 10000).sum())
    assert [r["part"] for r in s["ruler"]] == ["prefix", "branch 0", "branch 1", "branch 2"]
    assert s["ruler"][0] == {"part": "prefix", "tokens": [0, p - 1], "positions": [0, p - 1], "subsegment": 10000}
    for b, r in enumerate(s["ruler"][1:]):
        idx = np.flatnonzero(sub == b)
        assert r["tokens"] == [int(idx[0]), int(idx[-1])] and r["positions"] == [p, int(pos[idx[-1]])]
    assert s["n_branches"] == 3 and s["n_loss_tokens"] == int((np.array(row["target_ids"]) != -100).sum())
    prefix_turns = s["parts"][0]["turns"]
    assert [t["role"] for t in prefix_turns] == ["system", "user"]
    assert prefix_turns[1]["text"].startswith("<image 1: 644×476, 391 tokens>")
    for (q, a), part in zip([("What colour is it?", "Red."), ("What shape is it?", "A circle."), ("Is there text?", "No.")],
                            s["parts"][1:], strict=True):
        roles = [(t["role"], t["continued"]) for t in part["turns"]]
        assert roles == [("user", True), ("assistant", False)]
        whole = prefix_turns[1]["text"] + part["turns"][0]["text"]
        assert whole == f"<image 1: 644×476, 391 tokens>{q}<|im_end|>"
        assert part["turns"][1]["text"] == f"{LOSS_OPEN}{a}<|im_end|>{LOSS_CLOSE}"
    text = render_inspection(view)
    assert "  prefix:" in text and "  branch 2:" in text and "user (cont.)" in text
    assert "sub 10000  prefix" in text and "sub 2  branch 2" in text
    assert "3 branches" in text


def test_tree_of_answers_to_one_question_names_each_branch_role(tmp_path):
    # branches that share the whole question split inside the answer's header
    # (<|im_start|>assistant | \n): the prefix showed a role-less "assistant" line and every branch
    # a role-less answer
    img = Part.media("image", 0)
    answers = ["Red.", "It is a red circle.", "A circle, coloured red."]
    branches = tuple((_msg("user", img, _text("Describe it.")), _msg("assistant", _text(a))) for a in answers)
    follow_up = (_msg("user", img, _text("Describe it.")), _msg("assistant", _text("Round.")),
                 _msg("user", _text("Any text?")), _msg("assistant", _text("No.")))
    tree = Sample("same-q", "mem.jsonl", 0, (MediaRef("image", "images/img00.png"),), (*branches, follow_up))
    ctx = EncodeContext(load_tokenizer(), get_template("chatml"), get_family("qwen2.5-vl"), SAMPLE)
    rows, rejected = encode_samples([tree], ctx)
    assert not rejected and rows[0]["n_branches"] == 4
    view = inspect_dir(_write_tokenized(tmp_path / "tok", rows, "qwen2.5-vl", SAMPLE), sample="same-q")
    s = view["samples"][0]
    prefix, *parts = s["parts"]
    assert [(t["role"], t["text"]) for t in prefix["turns"]] == [
        ("system", "You are a helpful assistant.<|im_end|>"),
        ("user", "<image 1: 644×476, 391 tokens>Describe it.<|im_end|>")]
    for a, part in zip(answers, parts, strict=False):
        assert [(t["role"], t["continued"], t["text"]) for t in part["turns"]] == [
            ("assistant", False, f"{LOSS_OPEN}{a}<|im_end|>{LOSS_CLOSE}")]
    assert [(t["role"], t["text"]) for t in parts[3]["turns"]] == [
        ("assistant", f"{LOSS_OPEN}Round.<|im_end|>{LOSS_CLOSE}"), ("user", "Any text?<|im_end|>"),
        ("assistant", f"{LOSS_OPEN}No.<|im_end|>{LOSS_CLOSE}")]
    text = render_inspection(view)
    assert f"  branch 1:\n    assistant    {LOSS_OPEN}It is a red circle.<|im_end|>{LOSS_CLOSE}\n" in text
    assert "\n                 assistant\n" not in text


def test_tree_without_a_shared_prefix_counts_its_branches(tmp_path):
    # branches that differ from their first token (a text-only tree, plain template) have no prefix
    # run; the count took one run off for it and showed "8 tokens  4 carry loss" with no branches
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "t", "message_list": [
        {"question": "Alpha?", "answer": "A."}, {"question": "Beta?", "answer": "B."}]}) + "\n")
    tok = tmp_path / "tok"
    tokenize_dataset([tmp_path / "in.jsonl"], tok, TokenizeConfig(template="plain"))
    s = inspect_dir(tok, sample="t")["samples"][0]
    assert [r["part"] for r in s["ruler"]] == ["branch 0", "branch 1"] and s["n_branches"] == 2
    r = run("inspect", str(tok), "--sample", "t")
    assert r.returncode == 0 and "\nt  4 tokens  2 carry loss  2 branches\n" in r.stdout  # plain keeps no question


def test_tree_stats_count_branches(tree_dir):
    from packtool.stats import compute_stats

    s = compute_stats(tree_dir)
    assert s["branches_per_sample"]["histogram"] == {"1": 1, "3": 1}


def test_cli_inspect_tokenized_default_is_first_sample(tree_dir):
    r = run("inspect", str(tree_dir))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("sample tree-0  (") and "branch 1:" in r.stdout


# ----------------------------------------------------------------------------------------------
# a pack with a real video


def _make_video(path: Path, n_frames: int = 12, fps: int = 4, size: tuple[int, int] = (96, 64)) -> list[float]:
    """A real MPEG-4 video made with PyAV; returns the presentation times of its frames."""
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(n_frames):
            img = np.full((size[1], size[0], 3), (i * 20) % 255, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    with av.open(str(path)) as src:
        vs = src.streams.video[0]
        return [float(f.pts * vs.time_base) for f in src.decode(vs)]


@pytest.fixture(scope="module")
def video_pack(tmp_path_factory) -> dict:
    """Two LLaVA records on one real video, tokenized for Qwen2.5-VL and packed with frames embedded."""
    base = tmp_path_factory.mktemp("video")
    (base / "media").mkdir()
    _make_video(base / "media" / "clip.mp4")
    qa = [("vid-0", "What happens?", "It gets brighter."), ("vid-1", "How long is it?", "Three seconds.")]
    recs = [{"id": i, "video": "clip.mp4", "conversations": [{"from": "human", "value": f"<video>\n{q}"},
                                                              {"from": "gpt", "value": a}]} for i, q, a in qa]
    (base / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    tok, packed = base / "tok", base / "packed"
    tokenize_dataset([base / "data.jsonl"], tok, TokenizeConfig(media_root=str(base / "media"), model="qwen2.5-vl"))
    pack_dataset(tok, packed, PackConfig(max_tokens=2048))
    return {"tokenized": tok, "packed": packed, "qa": qa}


def test_pack_with_video_lists_frames_and_collapses_placeholders(video_pack):
    view = inspect_dir(video_pack["packed"], pack=0)
    (row,) = read_expanded(next(video_pack["packed"].glob("*.parquet"))).to_pylist()
    assert view["n_samples"] == 2 and [s["sample_id"] for s in view["samples"]] == ["vid-0", "vid-1"]
    video_pad = load_tokenizer().special_id("<|video_pad|>")
    for s, m_row, (_, q, a) in zip(view["samples"], row["media"], video_pack["qa"], strict=True):
        (m,) = s["media"]
        assert m["label"] == "video 1" and m["kind"] == "video" and m["path"] == "clip.mp4"
        assert m["timestamps"] == m_row["timestamps"] and len(m["timestamps"]) == len(m_row["frames"]) > 1
        assert (m["source_frames"], m["source_fps"]) == (m_row["source_frames"], m_row["source_fps"])
        assert m["source_frames"] >= len(m["timestamps"]) and m["source_fps"] > 0
        assert (m["width"], m["height"]) == (96, 64) and m["n_tokens"] == m_row["n_tokens"]
        assert m["grid"] == [m_row["grid_t"], m_row["grid_h"], m_row["grid_w"]]
        assert m["token_offset"] == m_row["token_offset"] - s["start"]
        span = row["input_ids"][m_row["token_offset"]:m_row["token_offset"] + m_row["n_tokens"]]
        assert set(span) == {video_pad}
        turns = s["parts"][0]["turns"]
        user = next(t for t in turns if t["role"] == "user")
        label = f"<video 1: {m_row['resized_width']}×{m_row['resized_height']}, {m_row['n_tokens']:,} tokens>"
        assert user["text"] == f"{label}{q}<|im_end|>"
        assert turns[-1]["role"] == "assistant" and turns[-1]["text"] == f"{LOSS_OPEN}{a}<|im_end|>{LOSS_CLOSE}"
        assert [seg["loss"] for seg in turns[-1]["segments"]] == [True, True]
    text = render_inspection(view)
    ts = view["samples"][0]["media"][0]["timestamps"]
    assert f"media  video 1  clip.mp4  96×64 -> {row['media'][0]['resized_width']}×{row['media'][0]['resized_height']}" in text
    assert f"{len(ts)} frames at " + ", ".join(f"{x:g}" for x in ts[:4]) in text
    m0 = row["media"][0]
    assert f" s (of {m0['source_frames']:,} at {m0['source_fps']:g} fps)" in text
    assert "sub 1*100000+10000  sample" in text
    assert "<|video_pad|>" not in text and "<|vision_start|>" not in text


def test_stats_of_the_video_pack(video_pack):
    from packtool.stats import compute_stats

    s = compute_stats(video_pack["packed"])
    (row,) = pq.read_table(next(video_pack["packed"].glob("*.parquet")), columns=["media"]).to_pylist()
    assert s["vision_unit"] == "patches" and s["samples_per_pack"]["histogram"] == {"2": 1}
    assert s["vision_tokens"] == sum(m["n_tokens"] for m in row["media"])
    assert s["vision_units"] == sum(m["vision_units"] for m in row["media"])
