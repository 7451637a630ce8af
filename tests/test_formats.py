"""Every input format read from an exact, hand-written fixture in its documented shape.

Fixtures follow each project's public documentation: LLaVA-Instruct records, the
LLaMA-Factory ShareGPT layout (its ``mllm_demo`` record and the default
``conversations``/``from``/``value`` tags), the ms-swift standard ``messages`` format,
the Qwen-VL finetune format, and the Molmo/PixMo ``message_list`` records.
"""

from __future__ import annotations

import base64
import gzip
import io
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from packtool.errors import ConfigError, InputError, SampleError
from packtool.formats import FORMATS, PARSERS, Rejected, detect_format, expand_inputs, iter_samples
from packtool.records import MediaRef, Message, Part, Sample
from packtool.runs import read_expanded


def png_bytes(w: int = 40, h: int = 30, color=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="PNG")
    return buf.getvalue()


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def read_all(path: Path, fmt: str = "auto") -> list:
    return list(iter_samples([path], fmt))


def U(*parts) -> Message:
    return Message("user", tuple(parts))


def A(text: str) -> Message:
    return Message("assistant", (Part.of_text(text),))


T = Part.of_text
IMG = Part.media


# --- LLaVA -------------------------------------------------------------------------

LLAVA = {
    "id": "000000033471",
    "image": "000000033471.jpg",
    "conversations": [
        {"from": "human", "value": "<image>\nWhat are the colors of the bus in the image?"},
        {"from": "gpt", "value": "The bus in the image is white and red."},
        {"from": "human", "value": "What feature can be seen on the back of the bus?"},
        {"from": "gpt", "value": "The back of the bus features an advertisement."},
    ],
}


def test_llava_record(tmp_path):
    [s] = read_all(write_jsonl(tmp_path / "llava.jsonl", [LLAVA]))
    assert s == Sample(
        "000000033471", str(tmp_path / "llava.jsonl"), 0, (MediaRef("image", "000000033471.jpg"),),
        ((U(IMG("image", 0), T("What are the colors of the bus in the image?")),
          A("The bus in the image is white and red."),
          U(T("What feature can be seen on the back of the bus?")),
          A("The back of the bus features an advertisement.")),),
    )


def test_llava_json_array_and_tagless_media_go_first(tmp_path):
    rec = {"image": ["a.png", "b.png"], "conversations": [
        {"from": "human", "value": "Compare them."}, {"from": "gpt", "value": "Same."}]}
    path = tmp_path / "d.json"
    path.write_text(json.dumps([rec, LLAVA]), encoding="utf-8")
    s0, s1 = read_all(path)
    assert s0.sample_id == "d.json:0" and s1.sample_id == "000000033471"
    assert s0.branches[0][0] == U(IMG("image", 0), IMG("image", 1), T("Compare them."))


def test_llava_video_tag(tmp_path):
    rec = {"id": "v", "video": "clip.mp4", "conversations": [
        {"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": "A ball rolls."}]}
    [s] = read_all(write_jsonl(tmp_path / "v.jsonl", [rec]))
    assert s.media == (MediaRef("video", "clip.mp4"),)
    assert s.branches[0][0] == U(IMG("video", 0), T("What happens?"))


def test_llava_video_record_tagged_image_is_its_video(tmp_path):
    """LLaVA-NeXT / LLaVA-Video-178K write ``<image>`` for a record's video: with videos and no
    image, one ``<image>`` per video reads as ``<video>`` and tokenizes to the same row."""
    from video_fixtures import write_video

    from packtool import TokenizeConfig, tokenize_dataset

    write_video(tmp_path / "clip.mp4", 12)
    write_video(tmp_path / "clip2.mp4", 12)

    def rec(rid, prompt, **media):
        return {"id": rid, **media, "conversations": [{"from": "human", "value": prompt},
                                                      {"from": "gpt", "value": "A ball rolls."}]}

    recs = [rec("image-tag", "<image>\nWhat happens?", video="clip.mp4"),
            rec("video-tag", "<video>\nWhat happens?", video="clip.mp4"),
            rec("two", "<image>\nFirst.<image>\nThen?", video=["clip.mp4", "clip2.mp4"]),
            rec("tags-short", "<image>\nWhat happens?", video=["clip.mp4", "clip2.mp4"]),
            rec("tags-over", "<image><image>\nWhat happens?", video="clip.mp4"),
            rec("with-image", "<image><image>\nWhat happens?", video="clip.mp4", image="clip.png")]
    s = read_all(write_jsonl(tmp_path / "v.jsonl", recs))
    assert s[0].media == (MediaRef("video", "clip.mp4"),)
    assert s[0].branches == s[1].branches
    assert s[2].branches[0][0] == U(IMG("video", 0), T("First."), IMG("video", 1), T("Then?"))
    assert [(r.sample_id, r.reason) for r in s[3:]] == [(i, "placeholder_mismatch")
                                                        for i in ("tags-short", "tags-over", "with-image")]
    # the Qwen-VL finetune format keeps its strict one-tag-per-item rule
    [strict] = read_all(tmp_path / "v.jsonl", "qwen-vl")[:1]
    assert isinstance(strict, Rejected) and strict.message == "1 <image> and 0 <video> tags for 0 images and 1 videos"

    m = tokenize_dataset([tmp_path / "v.jsonl"], tmp_path / "tok", TokenizeConfig(media_root=str(tmp_path)), workers=1)
    assert m["counts"]["samples"] == 3 and m["counts"]["rejected_by_reason"] == {"placeholder_mismatch": 3}
    rows = {r["sample_id"]: r for r in read_expanded(next((tmp_path / "tok").glob("part-*.parquet"))).to_pylist()}
    assert [x["kind"] for x in rows["image-tag"]["media"]] == ["video"]
    assert rows["image-tag"]["input_ids"] == rows["video-tag"]["input_ids"]
    assert [x["kind"] for x in rows["two"]["media"]] == ["video", "video"]


# --- ShareGPT (LLaMA-Factory) --------------------------------------------------------

MLLM_DEMO = {
    "messages": [
        {"content": "<image>Who are they?", "role": "user"},
        {"content": "They're Kane and Gretzka from Bayern Munich.", "role": "assistant"},
        {"content": "What are they doing?", "role": "user"},
        {"content": "They are celebrating on the soccer field.", "role": "assistant"},
    ],
    "images": ["mllm_demo_data/1.jpg"],
}

SHAREGPT_DEFAULT_TAGS = {
    "conversations": [
        {"from": "human", "value": "<image>Describe the picture."},
        {"from": "gpt", "value": "A red square."},
    ],
    "system": "Answer briefly.",
    "images": ["shapes/square.png"],
}


def test_sharegpt_default_tags_with_system(tmp_path):
    [s] = read_all(write_jsonl(tmp_path / "s.jsonl", [SHAREGPT_DEFAULT_TAGS]))
    assert detect_format(SHAREGPT_DEFAULT_TAGS) == "sharegpt"
    assert s.media == (MediaRef("image", "shapes/square.png"),)
    assert s.branches == ((Message("system", (T("Answer briefly."),)),
                           U(IMG("image", 0), T("Describe the picture.")), A("A red square.")),)


def test_sharegpt_mllm_demo_forced(tmp_path):
    [s] = read_all(write_jsonl(tmp_path / "m.jsonl", [MLLM_DEMO]), "sharegpt")
    assert s.branches[0] == (U(IMG("image", 0), T("Who are they?")),
                             A("They're Kane and Gretzka from Bayern Munich."),
                             U(T("What are they doing?")), A("They are celebrating on the soccer field."))


def test_sharegpt_is_strict_about_tags(tmp_path):
    rec = {**SHAREGPT_DEFAULT_TAGS, "conversations": [
        {"from": "human", "value": "Describe the picture."}, {"from": "gpt", "value": "A red square."}]}
    [r] = read_all(write_jsonl(tmp_path / "s.jsonl", [rec]))
    assert isinstance(r, Rejected) and r.reason == "placeholder_mismatch"


def test_sharegpt_conversations_of_role_content_turns_without_media(tmp_path):
    """LLaMA-Factory's ``{role, content}`` tags under ``conversations`` with no other ShareGPT key
    (a text-only record) read as ShareGPT, not as LLaVA turns without a ``from``; a turn that
    lacks the role key of the format read says which key, and which it has."""
    rec = {"id": "t", "conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    assert detect_format(rec) == "sharegpt"
    [s] = read_all(write_jsonl(tmp_path / "t.jsonl", [rec]))
    assert s.branches == ((U(T("Hi")), A("Hello.")),)
    mixed = {"id": "m", "messages": [{"role": "user", "content": "Hi"}, {"from": "gpt", "value": "Hello."}]}
    [forced] = read_all(write_jsonl(tmp_path / "f.jsonl", [rec]), "llava")
    [mix] = read_all(write_jsonl(tmp_path / "m.jsonl", [mixed]))
    assert (forced.reason, forced.message) == (
        "bad_record", "turn 0 has no 'from' (its keys: content, role); write every turn with 'from'/'value', or check --format")
    assert (mix.reason, mix.message) == (
        "bad_record", "turn 1 has no 'role' (its keys: from, value); write every turn with 'role'/'content', or check --format")


# --- ms-swift ------------------------------------------------------------------------

def test_swift_paths_data_uris_and_typed_parts(tmp_path):
    raw = png_bytes()
    uri = "data:image/png;base64," + base64.b64encode(raw).decode()
    recs = [
        {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                      {"role": "user", "content": "<image>What is in the picture?"},
                      {"role": "assistant", "content": "A red rectangle."}],
         "images": ["images/red.png"]},
        {"messages": [{"role": "user", "content": "<image><image>Which is larger?"},
                      {"role": "assistant", "content": "The second."}],
         "images": [uri, {"bytes": None, "path": "images/b.png"}]},
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "Red."}]}],
         "images": ["images/red.png"]},
    ]
    s0, s1, s2 = read_all(write_jsonl(tmp_path / "swift.jsonl", recs))
    assert detect_format(recs[0]) == "swift"
    assert s0.branches[0] == (Message("system", (T("You are a helpful assistant."),)),
                              U(IMG("image", 0), T("What is in the picture?")), A("A red rectangle."))
    assert s1.media == (MediaRef("image", None, raw), MediaRef("image", "images/b.png"))
    assert s1.branches[0][0] == U(IMG("image", 0), IMG("image", 1), T("Which is larger?"))
    assert s2.branches[0] == (U(IMG("image", 0), T("Colour?")), A("Red."))


def test_typed_parts_that_name_their_own_media(tmp_path):
    """A part naming its image under transformers' ``url`` / ``path`` / ``base64`` keys or
    OpenAI's ``image_url`` (string or ``{"url", "detail"}``) is that image: not a tag for an
    ``images`` list the record does not have (``placeholder_mismatch``), nor an unknown part."""
    raw = png_bytes(33, 21)
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "b.png").write_bytes(png_bytes(52, 18))
    b64 = base64.b64encode(raw).decode()
    parts = [{"type": "image", "url": "images/b.png"}, {"type": "image", "path": "images/b.png"},
             {"type": "image", "base64": b64}, {"type": "image", "image": None, "url": None, "path": "images/b.png"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64, "detail": "high"}},
             {"type": "image_url", "image_url": "images/b.png"}]
    recs = [{"messages": [{"role": "user", "content": [part, {"type": "text", "text": "Size?"}]},
                          {"role": "assistant", "content": "Small."}]} for part in parts]
    got = read_all(write_jsonl(tmp_path / "parts.jsonl", recs))
    assert all(isinstance(s, Sample) for s in got), got
    assert [s.media for s in got] == [(MediaRef("image", "images/b.png"),)] * 2 + [(MediaRef("image", None, raw),)] + [
        (MediaRef("image", "images/b.png"),), (MediaRef("image", None, raw),), (MediaRef("image", "images/b.png"),)]
    assert all(s.branches[0][0] == U(IMG("image", 0), T("Size?")) for s in got)


def test_typed_parts_naming_their_media_keep_their_place_among_listed_media(tmp_path):
    """A record with both an ``images`` list and parts that name their own image: each tag gets
    the media in the order the tags stand in (the named one where its part is, the listed ones in
    turn), so the text about "the first image" is about the first image the model sees."""
    rec = {"images": ["listed-1.png", "listed-2.png"], "messages": [
        {"role": "system", "content": "Compare <image> with what follows."},
        {"role": "user", "content": [{"type": "text", "text": "Then"}, {"type": "image", "image": "named.png"},
                                     {"type": "text", "text": "and"}, {"type": "image"}]},
        {"role": "assistant", "content": "Alike."}]}
    [s] = read_all(write_jsonl(tmp_path / "mixed.jsonl", [rec]))
    assert [m.path for m in s.media] == ["listed-1.png", "named.png", "listed-2.png"]
    assert s.branches[0][1] == U(T("Then"), IMG("image", 1), T("and"), IMG("image", 2))
    short = {**rec, "images": ["listed-1.png"]}
    [r] = read_all(write_jsonl(tmp_path / "short.jsonl", [short]))
    assert (r.reason, r.message) == ("placeholder_mismatch", "3 <image> and 0 <video> tags for 2 images and 0 videos")


def test_swift_remote_url_is_missing_media(tmp_path):
    rec = {"messages": [{"role": "user", "content": "<image>Hi"}, {"role": "assistant", "content": "Hello"}],
           "images": ["https://example.com/cat.jpg"]}
    [r] = read_all(write_jsonl(tmp_path / "u.jsonl", [rec]))
    assert r.reason == "missing_media" and "remote URL" in r.message


def test_swift_per_message_loss_false_keeps_an_assistant_turn_as_context(tmp_path):
    """ms-swift's ``"loss": false`` on an assistant message: the turn stays, marked context only
    (it was read as any assistant turn, and trained on); ``true`` is the default; another value
    is a bad record."""
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "loss": False},
             {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye", "loss": True}]
    bad = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "loss": "no"}]
    good, rej = read_all(write_jsonl(tmp_path / "l.jsonl", [{"messages": turns}, {"messages": bad}]))
    assert [(m.role, m.loss) for m in good.branches[0]] == [("user", None), ("assistant", False), ("user", None),
                                                            ("assistant", None)]
    assert rej.reason == "bad_record" and rej.message == "turn 1 'loss' must be true or false, got 'no'"


# --- Qwen-VL finetune ------------------------------------------------------------------

QWEN_VL = {
    "image": ["images/a.png", "images/b.png"],
    "conversations": [
        {"from": "human", "value": "<image>\n<image>\nWhat is different?"},
        {"from": "gpt", "value": "The colour."},
    ],
}


def test_qwen_vl_counts_tags_strictly(tmp_path):
    tagless = {**QWEN_VL, "conversations": [{"from": "human", "value": "What is different?"},
                                            {"from": "gpt", "value": "The colour."}]}
    one_tag = {**QWEN_VL, "conversations": [{"from": "human", "value": "<image>\nWhat is different?"},
                                            {"from": "gpt", "value": "The colour."}]}
    path = write_jsonl(tmp_path / "q.jsonl", [QWEN_VL, tagless, one_tag])
    ok, bad1, bad2 = read_all(path, "qwen-vl")
    assert ok.branches[0][0] == U(IMG("image", 0), IMG("image", 1), T("What is different?"))
    assert (bad1.reason, bad2.reason) == ("placeholder_mismatch", "placeholder_mismatch")
    # LLaVA (and so auto) places tag-less media itself, but a partial count is still an error
    ok, placed, bad = read_all(path, "llava")
    assert placed.branches[0][0].parts[:2] == (IMG("image", 0), IMG("image", 1))
    assert isinstance(bad, Rejected) and bad.reason == "placeholder_mismatch"


# --- Molmo / PixMo message_list ----------------------------------------------------------

MOLMO = {
    "id": "pixmo-17",
    "image": "images/17.jpg",
    "message_list": [
        {"question": "What colour is the car?", "answer": "Red.", "style": "user_qa"},
        {"messages": ["How many wheels?", "Four.", "Any people?", "No."], "style": "synthetic_qa"},
        {"text": "A red car parked on a street.", "style": "long_caption"},
    ],
}


def test_molmo_message_list_is_one_tree(tmp_path):
    [s] = read_all(write_jsonl(tmp_path / "molmo.jsonl", [MOLMO]))
    assert detect_format(MOLMO) == "molmo"
    assert s.sample_id == "pixmo-17" and s.media == (MediaRef("image", "images/17.jpg"),)
    assert s.branches == (
        (U(IMG("image", 0), T("What colour is the car?")), A("Red.")),
        (U(IMG("image", 0), T("How many wheels?")), A("Four."), U(T("Any people?")), A("No.")),
        (U(IMG("image", 0)), A("A red car parked on a street.")),
    )


def test_molmo_empty_message_list(tmp_path):
    [r] = read_all(write_jsonl(tmp_path / "m.jsonl", [{"image": "a.jpg", "message_list": []}]))
    assert r.reason == "empty_conversation"


# --- containers: gzip, zstd, Parquet ------------------------------------------------------

def test_gzip_and_zstd_jsonl(tmp_path):
    import zstandard

    payload = "".join(json.dumps(r) + "\n" for r in [LLAVA, MOLMO]).encode()
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(payload))
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(payload))
    (tmp_path / "c.json.zst").write_bytes(zstandard.ZstdCompressor().compress(json.dumps([LLAVA]).encode()))
    files = expand_inputs([tmp_path])
    assert [f.name for f in files] == ["a.jsonl.gz", "b.jsonl.zst", "c.json.zst"]
    got = list(iter_samples(files))
    assert [s.sample_id for s in got] == ["000000033471", "pixmo-17"] * 2 + ["000000033471"]
    assert all(isinstance(s, Sample) for s in got)


@pytest.mark.parametrize("name", ["inline.json", "inline.json.gz"])
def test_jsonl_named_json_with_lines_longer_than_a_peek(tmp_path, name):
    """JSONL saved as ``.json`` whose records carry inline images (data URIs of 100+ KiB): each
    line is its own row, not the whole file one ``bad_json`` row telling the user to convert to
    the JSONL it already is."""
    import numpy as np

    noise = np.random.default_rng(7).integers(0, 256, (200, 200, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noise).save(buf, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    assert len(uri) > 1 << 16
    records = [{"id": f"s{i}", "messages": [{"role": "user", "content": "<image>What is it?"},
                                            {"role": "assistant", "content": "Noise."}], "images": [uri]}
               for i in range(3)]
    body = "".join(json.dumps(r) + "\n" for r in records).encode()
    (tmp_path / name).write_bytes(gzip.compress(body) if name.endswith(".gz") else body)
    got = read_all(tmp_path / name)
    assert [(s.sample_id, s.source_row) for s in got] == [("s0", 0), ("s1", 1), ("s2", 2)], got
    assert all(s.media[0].data == buf.getvalue() for s in got)


@pytest.mark.parametrize("name", ["lead.json", "lead.json.gz"])
@pytest.mark.parametrize("eol", ["\n", "\r\n"])
def test_jsonl_named_json_after_blank_lines(tmp_path, name, eol):
    """JSONL saved as ``.json`` that opens with blank lines (files joined, an editor's stray
    newline): its records are read line by line, keeping their line numbers, not the whole file
    one ``bad_json`` row."""
    body = (eol * 2 + "".join(json.dumps({**LLAVA, "id": f"s{i}"}) + eol for i in range(3))).encode()
    (tmp_path / name).write_bytes(gzip.compress(body) if name.endswith(".gz") else body)
    got = read_all(tmp_path / name)
    assert [(type(s).__name__, s.sample_id, s.source_row) for s in got] == [
        ("Sample", "s0", 2), ("Sample", "s1", 3), ("Sample", "s2", 4)]


@pytest.mark.parametrize("name", ["broken.json", "broken.json.gz"])
@pytest.mark.parametrize("first", [b'{"id": "cut", "conversations": [{"fr', b'{"id": "caf\xe9", "conversations": []}'],
                         ids=["truncated", "latin1"])
def test_jsonl_named_json_with_a_broken_first_line(tmp_path, name, first):
    """JSONL saved as ``.json`` whose first line is broken (cut short, or not UTF-8) loses that line
    only, as under a ``.jsonl`` name, not every record of the file; one pretty-printed object that
    is not valid JSON is still one ``bad_json`` row for the whole file."""
    body = first + b"\n" + "".join(json.dumps({**LLAVA, "id": f"s{i}"}) + "\n" for i in range(3)).encode()
    (tmp_path / name).write_bytes(gzip.compress(body) if name.endswith(".gz") else body)
    (tmp_path / "same.jsonl").write_bytes(body)
    rows = [(type(s).__name__, getattr(s, "reason", None), s.sample_id, s.source_row) for s in read_all(tmp_path / name)]
    assert rows == [(type(s).__name__, getattr(s, "reason", None), s.sample_id, s.source_row)
                    for s in read_all(tmp_path / "same.jsonl")]
    assert [r[2:] for r in rows] == [(None, 0), ("s0", 1), ("s1", 2), ("s2", 3)]
    pretty = json.dumps(LLAVA, indent=2).encode().replace(b'"gpt"', b"'gpt'")
    (tmp_path / "pretty.json").write_bytes(pretty)
    [bad] = read_all(tmp_path / "pretty.json")
    assert bad.reason == "bad_json" and bad.message.startswith("the file is not valid JSON (")


@pytest.mark.parametrize("name", ["a.jsonl", "a.json", "a.jsonl.gz"])
@pytest.mark.parametrize("first", [b"[1, 2]", b"[]", b'[{"id": "x"}]'])
def test_jsonl_whose_first_line_is_an_array_loses_that_line_only(tmp_path, name, first):
    """A JSONL file whose first line is a JSON array (``[1, 2]``, ``[]``) was taken for one JSON
    array, failed to parse as one, and became a single ``bad_json`` row: every record after it
    was lost without a word. Its lines are read as JSONL, as a broken first line is: the first
    is one rejected row, the records after it are kept with their line numbers."""
    body = first + b"\n" + "".join(json.dumps({**LLAVA, "id": f"s{i}"}) + "\n" for i in range(3)).encode()
    (tmp_path / name).write_bytes(gzip.compress(body) if name.endswith(".gz") else body)
    rows = [(type(s).__name__, getattr(s, "reason", None), s.sample_id, s.source_row) for s in read_all(tmp_path / name)]
    assert rows == [("Rejected", "bad_record", None, 0), ("Sample", None, "s0", 1), ("Sample", None, "s1", 2),
                    ("Sample", None, "s2", 3)]
    cut = b"[" + b"".join(json.dumps({**LLAVA, "id": f"s{i}"}).encode() + b",\n" for i in range(3))
    (tmp_path / "cut.json").write_bytes(cut)  # an array cut short stays one row for the whole file
    [bad] = read_all(tmp_path / "cut.json")
    assert bad.reason == "bad_json" and bad.message.startswith("the file is not valid JSON (")


@pytest.mark.parametrize("name", ["a.jsonl", "a.json", "a.jsonl.gz"])
def test_pretty_printed_records_one_after_another_are_one_row_that_says_so(tmp_path, name):
    """``jq '.[]' data.json > data.jsonl`` (no ``-c``) writes each record over several lines. As
    JSONL that was a ``bad_json`` row per line ("Expecting property name ...", "Extra data ..."),
    47 rows for three records, none saying why; under ``.json``, one row that said "convert it to
    JSONL". It is one ``bad_json`` row that names the cause and the fix, also when tokenize plans
    the file (it cut a ``.jsonl`` into tasks at its lines). One pretty-printed record is still read."""
    from packtool import TokenizeConfig, tokenize_dataset

    (tmp_path / "a.png").write_bytes(png_bytes())
    body = "".join(json.dumps({**LLAVA, "id": f"s{i}", "image": "a.png"}, indent=2) + "\n" for i in range(3)).encode()
    (tmp_path / name).write_bytes(gzip.compress(body) if name.endswith(".gz") else body)
    [bad] = read_all(tmp_path / name)
    assert (bad.reason, bad.source_row) == ("bad_json", 0)
    assert bad.message.startswith("the file is not valid JSON (Extra data: line 23 column 1 (char ")
    assert bad.message.endswith("): it holds JSON values one after another, written over several lines each "
                                "(pretty-printed, as jq writes them without -c), not one record per line; write "
                                "one record per line (`jq -c . FILE`), or wrap them in a JSON array"), bad.message
    m = tokenize_dataset([tmp_path / name], tmp_path / "tok", TokenizeConfig(media_root=str(tmp_path), rows_per_shard=4),
                         workers=1)
    assert (m["counts"]["rows_in"], m["counts"]["rejected_by_reason"]) == (1, {"bad_json": 1})
    (tmp_path / "one.jsonl").write_bytes(json.dumps(LLAVA, indent=2).encode())
    [one] = read_all(tmp_path / "one.jsonl")
    assert isinstance(one, Sample) and one.sample_id == LLAVA["id"]
    # JSONL after one pretty-printed record: the lines of that record are its rows, the records after it are read
    first = json.dumps({**LLAVA, "id": "s0"}, indent=2) + "\n"
    (tmp_path / "mixed.jsonl").write_text(first + "".join(json.dumps({**LLAVA, "id": f"s{i}"}) + "\n" for i in (1, 2)))
    got = read_all(tmp_path / "mixed.jsonl")
    n = first.count("\n")
    assert [g.reason for g in got[:-2]] == ["bad_json"] * n
    assert [(g.sample_id, g.source_row) for g in got[-2:]] == [("s1", n), ("s2", n + 1)]


def test_zstd_missing_names_the_extra(tmp_path, monkeypatch):
    import sys

    (tmp_path / "b.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import now fails as if not installed
    with pytest.raises(InputError, match=r"pip install packtool\[zstd\]"):
        list(iter_samples([tmp_path / "b.jsonl.zst"]))


IMAGE_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
TURN = pa.struct([("from", pa.string()), ("value", pa.string())])


def test_hf_parquet_image_struct_and_shards(tmp_path):
    red, blue = png_bytes(color=(255, 0, 0)), png_bytes(color=(0, 0, 255))
    data = tmp_path / "ds" / "data"
    data.mkdir(parents=True)
    conv = [{"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": "Red."}]
    for i, blob in enumerate([red, blue]):
        t = pa.table({"id": [f"r{i}a", f"r{i}b"],
                      "image": pa.array([{"bytes": blob, "path": f"{i}.png"}, {"bytes": None, "path": "disk.png"}],
                                        IMAGE_STRUCT),
                      "conversations": pa.array([conv, conv], pa.list_(TURN))})
        pq.write_table(t, data / f"train-{i:05d}-of-00002.parquet", row_group_size=1)
    files = expand_inputs([tmp_path / "ds"])
    assert [f.name for f in files] == ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]
    got = list(iter_samples(files))
    assert [(s.sample_id, s.source_row) for s in got] == [("r0a", 0), ("r0b", 1), ("r1a", 0), ("r1b", 1)]
    assert got[0].media == (MediaRef("image", "0.png", red),)
    assert got[1].media == (MediaRef("image", "disk.png", None),)  # no bytes: the path is used
    assert got[2].media[0].data == blue


def test_hf_parquet_messages_with_image_list(tmp_path):
    msg = pa.struct([("role", pa.string()), ("content", pa.string())])
    t = pa.table({"messages": pa.array([MLLM_DEMO["messages"]], pa.list_(msg)),
                  "images": pa.array([[{"bytes": png_bytes(), "path": "1.jpg"}]], pa.list_(IMAGE_STRUCT))})
    pq.write_table(t, tmp_path / "train.parquet")
    [s] = read_all(tmp_path / "train.parquet")
    assert s.media[0].path == "1.jpg" and s.media[0].data[:4] == b"\x89PNG"
    assert s.branches[0][1] == A("They're Kane and Gretzka from Bayern Munich.")


def test_hf_parquet_raw_binary_image_columns(tmp_path):
    """Some HF datasets store an image as a plain ``binary`` column (or a list of them), not an
    ``{bytes, path}`` struct: the bytes are the image, read inline."""
    from packtool import TokenizeConfig, tokenize_dataset

    red, blue = png_bytes(40, 30, (255, 0, 0)), png_bytes(64, 32, (0, 0, 255))
    conv = [{"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": "Red."}]
    pq.write_table(pa.table({"id": ["one", "empty"], "image": pa.array([red, b""], pa.binary()),
                             "conversations": pa.array([conv, conv], pa.list_(TURN))}), tmp_path / "a.parquet")
    msg = pa.struct([("role", pa.string()), ("content", pa.string())])
    pq.write_table(pa.table({"id": ["two"], "messages": pa.array([MLLM_DEMO["messages"]], pa.list_(msg)),
                             "images": pa.array([[blue]], pa.list_(pa.large_binary()))}), tmp_path / "b.parquet")
    one, empty, two = iter_samples([tmp_path / "a.parquet", tmp_path / "b.parquet"])
    assert one.media == (MediaRef("image", None, red),) and two.media == (MediaRef("image", None, blue),)
    assert (empty.reason, empty.message) == ("missing_media", "image bytes are empty")

    m = tokenize_dataset([tmp_path / "a.parquet", tmp_path / "b.parquet"], tmp_path / "tok",
                         TokenizeConfig(media_root=str(tmp_path)), workers=1)
    assert m["counts"]["samples"] == 2 and m["counts"]["rejected_by_reason"] == {"missing_media": 1}
    rows = {r["sample_id"]: r for f in sorted((tmp_path / "tok").glob("part-*.parquet"))
            for r in pq.read_table(f, columns=["sample_id", "media"]).to_pylist()}
    assert [(x["kind"], x["width"], x["height"]) for x in rows["one"]["media"]] == [("image", 40, 30)]
    assert [(x["kind"], x["width"], x["height"]) for x in rows["two"]["media"]] == [("image", 64, 32)]


def test_hf_parquet_turns_stored_as_json_text(tmp_path):
    """A ``conversations`` / ``messages`` column of JSON text reads as the list it holds (each
    tag style detected as from a list); a string that is not a JSON list says so."""
    conv = [{"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": "Red."}]
    pq.write_table(pa.table({
        "id": ["llava", "not-json", "object"],
        "image": pa.array([png_bytes()] * 3, pa.binary()),
        "conversations": [json.dumps(conv), "<image>\nColour? Red.", json.dumps({"from": "human"})]}),
        tmp_path / "conv.parquet")
    pq.write_table(pa.table({"id": ["swift", "sharegpt"],
                             "messages": [json.dumps(MLLM_DEMO["messages"]), json.dumps(conv)],
                             "images": pa.array([[png_bytes()]] * 2, pa.list_(pa.binary()))}),
                   tmp_path / "msgs.parquet")
    llava, not_json, obj, swift, sharegpt = iter_samples([tmp_path / "conv.parquet", tmp_path / "msgs.parquet"])
    assert llava.branches[0] == (U(IMG("image", 0), T("Colour?")), A("Red."))
    assert sharegpt.branches == llava.branches
    assert swift.branches[0][:2] == (U(IMG("image", 0), T("Who are they?")), A("They're Kane and Gretzka from Bayern Munich."))
    assert [(r.sample_id, r.reason, r.message) for r in (not_json, obj)] == [
        ("not-json", "bad_record", "'conversations' is a string that is not a JSON list ('<image>\\nColour? Red.'); "
                                   "store the turns as a list, or as the JSON text of one"),
        ("object", "bad_record", "'conversations' is a string that is not a JSON list ('{\"from\": \"human\"}'); "
                                 "store the turns as a list, or as the JSON text of one")]


def test_hf_parquet_turns_stored_as_json_bytes(tmp_path):
    """A binary column of JSON text (some writers store strings so) reads as the string column
    does; bytes that are not UTF-8 reject their row only, naming the field."""
    conv = [{"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": "Rouge \u00e9."}]
    pq.write_table(pa.table({
        "id": ["bytes", "latin1", "text"],
        "image": pa.array([png_bytes()] * 3, pa.binary()),
        "conversations": pa.array([json.dumps(conv, ensure_ascii=False).encode(),
                                   json.dumps(conv, ensure_ascii=False).encode("latin-1"),
                                   json.dumps(conv).encode()], pa.binary())}), tmp_path / "conv.parquet")
    good, latin1, text = iter_samples([tmp_path / "conv.parquet"])
    assert good.branches[0] == (U(IMG("image", 0), T("Colour?")), A("Rouge \u00e9.")) and text.branches == good.branches
    assert (latin1.sample_id, latin1.reason) == ("latin1", "bad_encoding")
    assert latin1.message.startswith("'conversations' holds bytes that are not UTF-8 text (invalid continuation byte")


def test_hf_parquet_mixing_formats_reads_each_row_by_its_own_keys(tmp_path):
    """A Parquet file (or a data frame saved as JSONL) mixing formats holds every format's columns
    in every row, null where a row's format has none: a null key is absent to ``--format auto``,
    and a Molmo ``message_list`` of mixed entry styles (one list<struct> of all their fields) reads
    each entry by the fields it fills."""
    records = [LLAVA, {**MLLM_DEMO, "id": "swift"}, {**SHAREGPT_DEFAULT_TAGS, "id": "sharegpt"}, MOLMO,
               {**MLLM_DEMO, "messages": [{"from": "human", "value": "<image>Who?"}, {"from": "gpt", "value": "Kane."}],
                "id": "sharegpt-messages"}]
    table = pa.concat_tables([pa.Table.from_pylist([r]) for r in records], promote_options="default")
    assert {"message_list", "messages", "conversations", "system", "images"} <= set(table.column_names)
    pq.write_table(table, tmp_path / "mixed.parquet")
    write_jsonl(tmp_path / "frame.jsonl", table.to_pylist())
    for name in ("mixed.parquet", "frame.jsonl"):
        llava, swift, sharegpt, molmo, sharegpt_messages = read_all(tmp_path / name)
        assert [type(s).__name__ for s in (llava, swift, sharegpt, molmo, sharegpt_messages)] == ["Sample"] * 5, name
        assert llava.branches == read_all(write_jsonl(tmp_path / "l.jsonl", [LLAVA]))[0].branches
        assert swift.branches == read_all(write_jsonl(tmp_path / "s.jsonl", [MLLM_DEMO]))[0].branches
        assert sharegpt.branches == read_all(write_jsonl(tmp_path / "g.jsonl", [SHAREGPT_DEFAULT_TAGS]))[0].branches
        assert molmo.branches == read_all(write_jsonl(tmp_path / "m.jsonl", [MOLMO]))[0].branches
        assert sharegpt_messages.branches[0] == (U(IMG("image", 0), T("Who?")), A("Kane."))
    [r] = read_all(write_jsonl(tmp_path / "none.jsonl", [{"id": "x", "messages": None, "caption": "A cat."}]))
    assert (r.reason, r.message) == ("bad_record", "cannot tell the format from keys ['caption', 'id']; packtool "
                                                   "reads conversations (llava, qwen-vl, sharegpt), messages (swift, "
                                                   "sharegpt), message_list (molmo) or texts of {user, assistant} "
                                                   "exchanges (cauldron); write the records in one of these layouts")


# --- The Cauldron ----------------------------------------------------------------------

#: A Cauldron ``texts`` entry as ``datasets`` stores it.
EXCHANGE = pa.struct([("user", pa.string()), ("assistant", pa.string()), ("source", pa.string())])


def write_cauldron(path: Path, rows: list[dict]) -> Path:
    """``rows`` as a Cauldron subset's Parquet file: ``images`` a ``Sequence(Image)`` (a list of
    ``{bytes, path}`` structs), ``texts`` a list of ``{user, assistant, source}`` structs."""
    schema = pa.schema([("images", pa.list_(IMAGE_STRUCT)), ("texts", pa.list_(EXCHANGE))])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def cauldron_rows(red: bytes, blue: bytes, green: bytes) -> list[dict]:
    """Two Cauldron rows: two images and one exchange; one image and three exchanges."""
    return [
        {"images": [{"bytes": red, "path": None}, {"bytes": blue, "path": None}],
         "texts": [{"user": "Which one is red?", "assistant": "The first.", "source": "nlvr2"}]},
        {"images": [{"bytes": green, "path": None}],
         "texts": [{"user": "Colour?", "assistant": "Green.", "source": "vqav2"},
                   {"user": "Shape?", "assistant": "A square.", "source": "vqav2"},
                   {"user": "How many?", "assistant": "One.", "source": "vqav2"}]},
    ]


def test_cauldron_parquet_rows_are_exchanges_with_their_images_first(tmp_path):
    """Each ``texts`` entry is a user turn and the assistant turn answering it; the images, which
    the Cauldron never tags, open the first user turn in their order; ``source`` is not kept."""
    red, blue, green = png_bytes(40, 30, (255, 0, 0)), png_bytes(64, 32, (0, 0, 255)), png_bytes(color=(0, 255, 0))
    path = write_cauldron(tmp_path / "train-00000-of-00001.parquet", cauldron_rows(red, blue, green))
    two, three = read_all(path)
    assert two == Sample("train-00000-of-00001.parquet:0", str(path), 0,
                         (MediaRef("image", None, red), MediaRef("image", None, blue)),
                         ((U(IMG("image", 0), IMG("image", 1), T("Which one is red?")), A("The first.")),))
    assert three.media == (MediaRef("image", None, green),)
    assert three.branches == ((U(IMG("image", 0), T("Colour?")), A("Green."), U(T("Shape?")), A("A square."),
                               U(T("How many?")), A("One.")),)
    assert [detect_format(r) for r in pq.read_table(path).to_pylist()] == ["cauldron", "cauldron"]
    assert read_all(path, "cauldron") == [two, three]


def test_cauldron_tokenize_run_places_every_image_before_the_first_question(tmp_path):
    """``packtool tokenize`` on a Cauldron Parquet file and malformed rows beside it: the good
    rows become samples whose image tokens (in image order) open the first user turn, each bad row
    an errors.jsonl line with its reason, and the run goes on."""
    from clirun import packtool

    from packtool.tokenization import load_tokenizer

    red, blue, green = png_bytes(40, 30, (255, 0, 0)), png_bytes(120, 60, (0, 0, 255)), png_bytes(color=(0, 255, 0))
    rows = [*cauldron_rows(red, blue, green),
            {"images": [{"bytes": red, "path": None}],
             "texts": [{"user": "Colour?", "assistant": None, "source": "vqav2"}]},
            {"images": [{"bytes": red, "path": None}], "texts": []}]
    write_cauldron(tmp_path / "c.parquet", rows)
    write_jsonl(tmp_path / "c.jsonl", [{"id": "no-answer", "images": [], "texts": [{"user": "Hi?"}]},
                                       {"id": "two-tags", "images": ["red.png"],
                                        "texts": [{"user": "<image><image>Both?", "assistant": "Yes."}]}])
    r = packtool("tokenize", tmp_path / "c.parquet", tmp_path / "c.jsonl", "-o", tmp_path / "tok",
                 "--media-root", tmp_path, "--json")
    assert r.returncode == 0, r.stderr
    counts = json.loads(r.stdout)
    assert (counts["rows_in"], counts["samples"], counts["rejected_by_reason"]) == (
        6, 2, {"bad_record": 2, "empty_conversation": 1, "placeholder_mismatch": 1})
    errors = [json.loads(line) for line in (tmp_path / "tok" / ".packtool" / "errors.jsonl").read_text().splitlines()]
    assert [(Path(e["source"]).name, e["row"], e["sample_id"], e["reason"], e["message"]) for e in errors] == [
        ("c.parquet", 2, None, "bad_record", "texts[0] 'assistant' is null; every entry needs a 'user' and an "
                                             "'assistant' text"),
        ("c.parquet", 3, None, "empty_conversation", "'texts' is empty"),
        ("c.jsonl", 0, "no-answer", "bad_record", "texts[0] has no 'assistant' text (its keys: 'user'); write every "
                                                  "entry as {\"user\": ..., \"assistant\": ...}"),
        ("c.jsonl", 1, "two-tags", "placeholder_mismatch", "2 <image> and 0 <video> tags for 1 images and 0 videos")]

    tokens = {r["sample_id"]: r for r in read_expanded(next((tmp_path / "tok").glob("part-*.parquet"))).to_pylist()}
    two, three = tokens["c.parquet:0"], tokens["c.parquet:1"]
    # qwen2.5-vl: 40x30 grows to the 3,136-pixel floor, 84x56 (6 tokens); 120x60 rounds to 112x56 (8 tokens)
    assert [(m["width"], m["height"], m["resized_width"], m["resized_height"], m["n_tokens"])
            for m in two["media"]] == [(40, 30, 84, 56, 6), (120, 60, 112, 56, 8)]
    pads = lambda n: "<|vision_start|>" + "<|image_pad|>" * n + "<|vision_end|>"  # noqa: E731
    text = load_tokenizer().decode
    system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    assert text(two["input_ids"]) == (f"{system}<|im_start|>user\n{pads(6)}{pads(8)}Which one is red?<|im_end|>\n"
                                      "<|im_start|>assistant\nThe first.<|im_end|>\n")
    # 11 system tokens (<|im_start|> system \n You are a helpful assistant . <|im_end|> \n), then <|im_start|>
    # user \n <|vision_start|>: the first image's pads start at 15, the second's after 6 pads, <|vision_end|>
    # and <|vision_start|>
    assert [(m["token_offset"], m["n_tokens"]) for m in two["media"]] == [(15, 6), (23, 8)]
    pad = load_tokenizer().special_id("<|image_pad|>")
    assert all(two["input_ids"][m["token_offset"] + k] == pad for m in two["media"] for k in range(m["n_tokens"]))
    assert text(three["input_ids"]) == (f"{system}<|im_start|>user\n{pads(6)}Colour?<|im_end|>\n"
                                        "<|im_start|>assistant\nGreen.<|im_end|>\n<|im_start|>user\nShape?<|im_end|>\n"
                                        "<|im_start|>assistant\nA square.<|im_end|>\n<|im_start|>user\nHow many?"
                                        "<|im_end|>\n<|im_start|>assistant\nOne.<|im_end|>\n")
    assert [m["token_offset"] for m in three["media"]] == [15]


def test_cauldron_jsonl_text_only_and_tagged_rows(tmp_path):
    """A JSON copy names its images by path (or data URI); ``images`` empty or null is a text-only
    row; an ``<image>`` tag places the image where it stands, as in ``llava``; an ``id``, a
    top-level ``system`` prompt and ``image`` / ``video`` keys are read as every format reads them."""
    exchanges = [{"user": "Hi.", "assistant": "Hello.", "source": "x"},
                 {"user": "<image>\nAnd this?", "assistant": "A cat.", "source": "x"}]
    recs = [{"id": "paths", "images": ["a.png", "b.png"], "texts": exchanges[:1]},
            {"id": "none", "images": None, "texts": exchanges[:1]},
            {"id": "empty", "images": [], "texts": exchanges[:1], "system": "Be brief."},
            {"id": "tagged", "images": ["a.png"], "texts": exchanges},
            {"id": "singular", "image": "a.png", "video": "clip.mp4", "texts": exchanges[:1]}]
    paths, none, empty, tagged, singular = read_all(write_jsonl(tmp_path / "c.jsonl", recs))
    assert paths.media == (MediaRef("image", "a.png"), MediaRef("image", "b.png"))
    assert paths.branches == ((U(IMG("image", 0), IMG("image", 1), T("Hi.")), A("Hello.")),)
    assert none.media == empty.media == () and none.branches == ((U(T("Hi.")), A("Hello.")),)
    assert empty.branches == ((Message("system", (T("Be brief."),)), U(T("Hi.")), A("Hello.")),)
    assert tagged.branches == ((U(T("Hi.")), A("Hello."), U(IMG("image", 0), T("And this?")), A("A cat.")),)
    assert [s.sample_id for s in (paths, none, empty, tagged)] == ["paths", "none", "empty", "tagged"]
    # media under the other formats' names are read, not dropped: images first, then videos
    assert singular.media == (MediaRef("image", "a.png"), MediaRef("video", "clip.mp4"))
    assert singular.branches == ((U(IMG("image", 0), IMG("video", 1), T("Hi.")), A("Hello.")),)


@pytest.mark.parametrize("texts, reason, message", [
    (None, "bad_record", "record has no 'texts' list of {user, assistant} turns"),
    ("Hi", "bad_record", "'texts' must be a list of {user, assistant} turns, got str 'Hi'"),
    ({"user": "Q", "assistant": "A"}, "bad_record", "'texts' must be a list of {user, assistant} turns, got dict "
                                                    "{'user': 'Q', 'assistant': 'A'}"),
    ([], "empty_conversation", "'texts' is empty"),
    (["Hi"], "bad_record", "texts[0] is a str, not an object with 'user' and 'assistant' texts"),
    ([{"user": "Q", "assistant": "A"}, {"question": "Q2", "answer": "A2"}], "bad_record",
     "texts[1] has no 'user' text (its keys: 'answer', 'question'); write every entry as "
     "{\"user\": ..., \"assistant\": ...}"),
    ([{"user": 3, "assistant": "A"}], "bad_record", "texts[0] 'user' must be a string, got int"),
    ([{"user": "Q", "assistant": ["A"]}], "bad_record", "texts[0] 'assistant' must be a string, got list"),
    ([{"user": "Q", "assistant": None}], "bad_record", "texts[0] 'assistant' is null; every entry needs a 'user' and "
                                                       "an 'assistant' text"),
    ([{"user": "\ud800", "assistant": "A"}], "bad_encoding",
     "texts[0] 'user' is not valid UTF-8 text: surrogates not allowed at 0"),
])
def test_cauldron_malformed_texts_are_rejected_with_the_reason(tmp_path, texts, reason, message):
    [r] = read_all(write_jsonl(tmp_path / "bad.jsonl", [{"id": "x", "images": ["a.png"], "texts": texts}]), "cauldron")
    assert (r.sample_id, r.reason, r.message) == ("x", reason, message)


def test_cauldron_detection_leaves_every_other_format_as_it_was():
    """``texts`` of ``{user, assistant}`` exchanges (or none yet) is the Cauldron; a record that
    also holds another format's turns keeps that format; ``texts`` of another shape is no format."""
    exchange = [{"user": "Colour?", "assistant": "Red.", "source": "vqav2"}]
    assert [detect_format(r) for r in (
        {"images": [{"bytes": b"x", "path": None}], "texts": exchange},
        {"images": None, "texts": exchange},
        {"texts": [{"user": None, "assistant": "Red."}]},
        {"texts": []},
        {**LLAVA, "texts": exchange},
        {**SHAREGPT_DEFAULT_TAGS, "texts": exchange},
        {**MLLM_DEMO, "texts": exchange},
        {**MOLMO, "texts": exchange},
        {**LLAVA, "conversations": None, "texts": exchange},
    )] == ["cauldron", "cauldron", "cauldron", "cauldron", "llava", "sharegpt", "swift", "molmo", "cauldron"]
    for texts in ("Colour? Red.", ["Colour?", "Red."], [{"question": "Colour?", "answer": "Red."}], None):
        with pytest.raises(SampleError, match=r"^cannot tell the format from keys \['images'"):
            detect_format({"images": ["a.png"], "texts": texts})


def test_a_record_no_format_reads_names_every_format():
    """No ``--format`` reads a record without turns, so the message names none to pass: it lists
    the layouts packtool reads, each with the formats that read it, every format among them."""
    import re

    with pytest.raises(SampleError) as err:
        detect_format({"id": "x", "caption": "A cat.", "url": "http://x/a.png"})
    assert "--format" not in err.value.message
    named = {name for group in re.findall(r"\(([^)]*)\)", err.value.message.split("packtool reads ")[1])
             for name in group.split(", ")}
    assert named == set(PARSERS)


def test_directory_inputs_match_suffixes_in_any_case_and_read_ndjson(tmp_path):
    """``.ndjson`` is JSONL, and ``.JSONL`` / ``.PARQUET`` / ``.JSON`` are what their lower-case
    names are; a directory that yields no input file says what it skipped and why."""
    from packtool import TokenizeConfig, tokenize_dataset

    data = tmp_path / "data"
    data.mkdir()
    (tmp_path / "a.png").write_bytes(png_bytes())
    rec = {"image": "a.png", "conversations": LLAVA["conversations"][:2]}
    write_jsonl(data / "a.ndjson", [{"id": "ndjson0", **rec}, {"id": "ndjson1", **rec}])
    write_jsonl(data / "B.JSONL", [{"id": "upper-jsonl", **rec}])
    (data / "C.JSON").write_text(json.dumps({"id": "upper-json", **rec}), encoding="utf-8")
    (data / "d.NDJSON.GZ").write_bytes(gzip.compress(json.dumps({"id": "gz", **rec}).encode()))
    pq.write_table(pa.table({"id": ["upper-parquet"], "image": ["a.png"],
                             "conversations": pa.array([rec["conversations"]], pa.list_(TURN))}), data / "E.PARQUET")
    (data / "README.md").write_text("# a corpus")
    files = expand_inputs([data])
    assert [f.name for f in files] == ["B.JSONL", "C.JSON", "E.PARQUET", "a.ndjson", "d.NDJSON.GZ"]
    assert [s.sample_id for s in iter_samples(files)] == ["upper-jsonl", "upper-json", "upper-parquet", "ndjson0",
                                                         "ndjson1", "gz"]
    # tokenize cuts an uncompressed .ndjson by lines, as it does .jsonl (a task each of its rows here;
    # C.JSON, read whole, shares the task of the Parquet row after it)
    m = tokenize_dataset([data], tmp_path / "tok", TokenizeConfig(media_root=str(tmp_path), rows_per_shard=1), workers=1)
    assert (m["counts"]["samples"], m["counts"]["rejected"], m["counts"]["tasks"]) == (6, 0, 5)
    assert [sh["rows"] for sh in m["shards"]] == [1] * 6  # a shard holds --rows-per-shard rows at most

    skipped = tmp_path / "skipped"
    (skipped / "tok" / ".packtool").mkdir(parents=True)  # an earlier run's output
    (skipped / "tok" / ".packtool" / "manifest.json").write_text("{}")
    (skipped / ".train.jsonl").write_text("{}")
    (skipped / "train.csv").write_text("a,b")
    with pytest.raises(InputError) as err:
        expand_inputs([data, skipped])
    assert str(err.value) == (
        f"no input files found in {str(skipped)!r} (skipped '.train.jsonl' (hidden), 'tok' (a packtool output "
        "directory), 'train.csv' (not an input file suffix)); expected .json, .json.gz, .json.zst, .jsonl, .jsonl.gz, "
        ".jsonl.zst, .ndjson, .ndjson.gz, .ndjson.zst, .parquet, in any case")
    (skipped / "empty").mkdir()
    with pytest.raises(InputError, match=r"no input files found in '.*empty' \(it is empty\)"):
        expand_inputs([skipped / "empty"])
    # a pipe (named, or a shell's <(zcat ...)) is read more than once by no one: said so, not "does not exist"
    pipes = tmp_path / "pipes"
    pipes.mkdir()
    os.mkfifo(pipes / "stream.jsonl")
    with pytest.raises(InputError) as err:
        expand_inputs([pipes / "stream.jsonl"])
    assert str(err.value).startswith(f"input {str(pipes / 'stream.jsonl')!r} is not a regular file (a pipe or a "
                                     "device): tokenize reads an input more than once")
    with pytest.raises(InputError, match=r"\(skipped 'stream.jsonl' \(not a regular file\)\)"):
        expand_inputs([pipes])


def test_a_directory_warns_of_the_inputs_it_skips_for_their_compression(tmp_path, caplog):
    """A corpus folder's ``.jsonl.xz`` / ``.json.bz2`` files were skipped as any ``README.md`` is,
    said only under ``--verbose``: part of the corpus left out of the run without a word. They are
    named in a warning (and in the error of a folder that holds nothing else), with the fix."""
    import bz2
    import logging
    import lzma

    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "a.jsonl", [LLAVA])
    (data / "b.jsonl.xz").write_bytes(lzma.compress(json.dumps(LLAVA).encode()))
    (data / "c.JSON.BZ2").write_bytes(bz2.compress(json.dumps(LLAVA).encode()))
    (data / "notes.txt.xz").write_bytes(lzma.compress(b"not records"))  # no input inside: skipped as before
    with caplog.at_level(logging.INFO, logger="packtool.formats"):
        files = expand_inputs([data])
    assert [f.name for f in files] == ["a.jsonl"]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"{data}: skipped 'b.jsonl.xz' (compressed as .xz, which packtool does not read), 'c.JSON.BZ2' (compressed "
        "as .bz2, which packtool does not read); decompress them, or recompress them with gzip or zstd (.gz, .zst)"]
    (data / "a.jsonl").unlink()
    with pytest.raises(InputError, match=r"skipped 'b.jsonl.xz' \(compressed as .xz, which packtool does not read\), "
                                         r"'c.JSON.BZ2' \(compressed as .bz2, .*'notes.txt.xz' \(not an input file suffix\)"):
        expand_inputs([data])


# --- bad rows ---------------------------------------------------------------------------

def test_bad_rows_get_reason_codes(tmp_path):
    ok = json.dumps(LLAVA).encode()
    lines = [
        b'{"id": "broken", "conversations": [',                                             # bad_json
        json.dumps({"id": "nokeys", "image": "a.png"}).encode(),                           # bad_record
        json.dumps({"id": "empty", "conversations": []}).encode(),                          # empty_conversation
        json.dumps({"id": "role", "conversations": [{"from": "robot", "value": "hi"}]}).encode(),  # unknown_role
        json.dumps({"id": "count", "image": "a.png", "conversations": [
            {"from": "human", "value": "<image><image>"}, {"from": "gpt", "value": "x"}]}).encode(),  # placeholder
        b'{"id": "latin1", "conversations": [{"from": "human", "value": "caf\xe9"}]}',     # bad_encoding
        b'{"id": "surrogate", "conversations": [{"from": "human", "value": "\\ud800"}, {"from": "gpt", "value": "x"}]}',
        b'[1, 2]',                                                                          # bad_record
        ok,
    ]
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    got = read_all(path)
    assert [(g.sample_id, g.reason) if isinstance(g, Rejected) else g.sample_id for g in got] == [
        (None, "bad_json"), ("nokeys", "bad_record"), ("empty", "empty_conversation"), ("role", "unknown_role"),
        ("count", "placeholder_mismatch"), (None, "bad_encoding"), ("surrogate", "bad_encoding"),
        (None, "bad_record"), "000000033471",
    ]
    assert [g.source_row for g in got] == list(range(9))


@pytest.mark.parametrize("fmt", ["llava", "qwen-vl", "sharegpt", "swift", "molmo"])
def test_a_role_that_is_not_a_string_is_a_bad_record(tmp_path, fmt):
    """A role / ``from`` of another JSON type is a malformed record (``bad_record``, saying the
    type), not a role the template does not know; a string no reader maps stays ``unknown_role``."""
    def turns(role):
        if fmt == "swift":
            return {"messages": [{"role": role, "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
        if fmt == "molmo":
            return {"message_list": [{"messages": [{"role": role, "content": "Hi"},
                                                   {"role": "assistant", "content": "Hello."}]}]}
        return {"conversations": [{"from": role, "value": "Hi"}, {"from": "gpt", "value": "Hello."}]}

    roles = [3, ["human"], True, {"r": 1}, 1.5, "narrator", "human" if fmt not in ("swift", "molmo") else "user"]
    got = read_all(write_jsonl(tmp_path / "roles.jsonl", [{"id": f"r{k}", **turns(r)} for k, r in enumerate(roles)]),
                   fmt)
    assert [g.reason if isinstance(g, Rejected) else g.sample_id for g in got] == [
        *["bad_record"] * 5, "unknown_role", "r6"]
    key, where = {"swift": ("'role'", "turn 0"), "molmo": ("'role'", "message_list[0] message 0")}.get(
        fmt, ("'from'", "turn 0"))
    assert [g.message for g in got[:6]] == [
        f"{where} {key} must be a string, got int 3", f"{where} {key} must be a string, got list ['human']",
        f"{where} {key} must be a string, got bool True", f"{where} {key} must be a string, got dict {{'r': 1}}",
        f"{where} {key} must be a string, got float 1.5", f"{where} has role 'narrator'"]


def test_a_parquet_role_column_of_numbers_is_a_bad_record(tmp_path):
    turn = pa.struct([("from", pa.int64()), ("value", pa.string())])
    pq.write_table(pa.table({"id": ["a"], "conversations": pa.array([[{"from": 0, "value": "Hi"},
                                                                      {"from": 1, "value": "Hello."}]],
                                                                    pa.list_(turn))}), tmp_path / "t.parquet")
    [r] = read_all(tmp_path / "t.parquet")
    assert (r.sample_id, r.reason, r.message) == ("a", "bad_record", "turn 0 'from' must be a string, got int 0")


@pytest.mark.parametrize("fmt", ["llava", "sharegpt", "swift", "molmo"])
def test_sample_ids_are_strings_or_whole_numbers(tmp_path, fmt):
    """An id ``true`` was stored as ``"True"``, ``3.0`` as ``"3.0"``, a list as its Python repr;
    a whole number is its decimal digits, anything else but a string is a ``bad_record`` row."""
    turns = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]
    body = {"llava": {"conversations": turns}, "sharegpt": {"conversations": turns, "system": "Be brief."},
            "swift": {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]},
            "molmo": {"message_list": [{"question": "Colour?", "answer": "Red."}]}}[fmt]
    ids = ["a", 17, -3, 10**20, True, False, 3.0, [1], {"k": 1}, None]
    records = [{"id": i, **body} for i in ids] + [{"sample_id": 5, **body}]
    got = read_all(write_jsonl(tmp_path / "ids.jsonl", records), fmt)
    assert [g.reason if isinstance(g, Rejected) else g.sample_id for g in got] == [
        "a", "17", "-3", "100000000000000000000", *["bad_record"] * 5, "ids.jsonl:9", "5"]
    messages = [g.message for g in got if isinstance(g, Rejected)]
    assert messages[0] == "sample id true is true/false, not a string; write ids as strings (or whole numbers)"
    assert [m.split(" is ")[1].split(",")[0] for m in messages[2:]] == ["a decimal number", "a list", "an object"]
    assert all(g.sample_id is None for g in got if isinstance(g, Rejected))


def test_unknown_format_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="--format"):
        read_all(write_jsonl(tmp_path / "a.jsonl", [LLAVA]), "alpaca")
    assert set(FORMATS) == {"auto", *PARSERS}


def test_split_placeholders_matches_its_slow_twin():
    """Seeded strings of tags, newlines, near-tags and words: the fast paths (no tag, one tag
    in front) and the general loop all split as the character-by-character twin does."""
    import random

    from packtool.formats.common import split_placeholders
    from tests.naive import split_tags

    seed = 1616
    rng = random.Random(seed)
    atoms = ["<image>", "<video>", "\n", "\n\n", "a", " b ", "<", "<imag", "e>", ">", "  "]
    for case in range(3000):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 7)))
        counters, offsets = {"image": 0, "video": 0}, {"image": 0, "video": 100}
        got = [(p.kind, p.text, p.index) for p in split_placeholders(text, counters, offsets)]
        want = [(k, t, n + offsets[k] if k != "text" else n) for k, t, n in split_tags(text)]
        assert got == want, f"seed {seed}, case {case}: {text!r}"
        assert counters == {k: sum(1 for w in want if w[0] == k) for k in ("image", "video")}


# --- a UTF-8 byte-order mark -------------------------------------------------------------

BOM = b"\xef\xbb\xbf"


BOM_CASES = [(f"a.{kind}{comp}", shape) for comp in ("", ".gz", ".zst") for kind, shape in
             [("jsonl", "lines"), ("json", "lines"), ("json", "array"), ("json", "object")]]


@pytest.mark.parametrize("name,shape", BOM_CASES)
def test_a_leading_byte_order_mark_is_skipped(tmp_path, name, shape):
    """Windows tools (Notepad, PowerShell's ``Out-File``, .NET writers) start a UTF-8 file with
    ``EF BB BF``: the first record is read as if it were not there, in every container, and
    the rows keep their numbers."""
    import zstandard

    if shape == "lines":
        body = "".join(json.dumps(r) + "\n" for r in [LLAVA, MOLMO]).encode()
    elif shape == "array":
        body = b" \n" + json.dumps([LLAVA, MOLMO], indent=1).encode()  # whitespace after the mark too
    else:
        body = json.dumps(LLAVA, indent=1).encode()
    data = BOM + body
    if name.endswith(".gz"):
        data = gzip.compress(data)
    elif name.endswith(".zst"):
        data = zstandard.ZstdCompressor().compress(data)
    (tmp_path / name).write_bytes(data)
    got = read_all(tmp_path / name)
    assert all(isinstance(s, Sample) for s in got), got
    want = ["000000033471"] if shape == "object" else ["000000033471", "pixmo-17"]
    assert [s.sample_id for s in got] == want
    assert [s.source_row for s in got] == list(range(len(want)))


@pytest.mark.parametrize("name", ["a.jsonl", "a.json", "a.jsonl.gz"])
@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32"])
def test_a_utf16_or_utf32_file_is_one_bad_encoding_row_that_says_so(tmp_path, name, encoding):
    """PowerShell 5's ``>`` and ``Out-File`` write UTF-16 with a byte-order mark: read as UTF-8,
    its first line was ``bad_encoding`` ("can't decode byte 0xff") and every other one ``bad_json``,
    and a ``.jsonl`` was cut into tasks at its 0x0A bytes. The file is one ``bad_encoding`` row
    naming its encoding and the fix, also when tokenize plans it."""
    from packtool import TokenizeConfig, tokenize_dataset

    mark = "\ufeff" if encoding == "utf-16-be" else ""  # utf-16 and utf-32 write their own
    body = (mark + "".join(json.dumps({**LLAVA, "id": f"s{i}"}) + "\r\n" for i in range(40))).encode(encoding)
    (tmp_path / name).write_bytes(gzip.compress(body) if name.endswith(".gz") else body)
    [bad] = read_all(tmp_path / name)
    shown = encoding.upper()[:6]
    assert (bad.reason, bad.source_row, bad.message) == ("bad_encoding", 0, (
        f"the file is {shown} text (it starts with a {shown} byte-order mark, as Windows PowerShell's > and Out-File "
        f"write it); packtool reads UTF-8: re-encode it, e.g. `iconv -f {shown} -t UTF-8 IN > OUT`"))
    m = tokenize_dataset([tmp_path / name], tmp_path / "tok", TokenizeConfig(media_root=str(tmp_path),
                                                                            rows_per_shard=4), workers=1)
    assert (m["counts"]["rows_in"], m["counts"]["rejected_by_reason"]) == (1, {"bad_encoding": 1})


def test_a_byte_order_mark_after_the_first_line_is_a_bad_row(tmp_path):
    """Only the file's first bytes may carry the mark: one inside the file (two files
    concatenated) rejects its own line, with a message saying what is wrong."""
    lines = [json.dumps(LLAVA).encode(), BOM + json.dumps(MOLMO).encode(), b"", json.dumps(LLAVA).encode()]
    path = tmp_path / "cat.jsonl"
    path.write_bytes(BOM + b"\n".join(lines) + b"\n")
    got = read_all(path)
    assert [(g.source_row, g.reason if isinstance(g, Rejected) else g.sample_id) for g in got] == [
        (0, "000000033471"), (1, "bad_json"), (3, "000000033471")]
    assert "byte-order mark" in got[1].message


def test_lines_ended_by_a_bare_carriage_return_are_one_bad_row_that_says_so(tmp_path):
    """A file whose lines end in CR alone (old Mac line ends) is one JSONL line holding every
    record: its row says why and how to convert the file; a stray CR inside a CRLF file does
    not get that message, nor does other trailing data."""
    path = tmp_path / "mac.jsonl"
    path.write_bytes(b"\r".join([json.dumps(LLAVA).encode(), json.dumps(MOLMO).encode()]) + b"\r")
    [r] = read_all(path)
    assert isinstance(r, Rejected) and r.reason == "bad_json" and r.source_row == 0
    assert "lines end in CR alone" in r.message and "tr '\\r' '\\n'" in r.message
    crlf = tmp_path / "win.jsonl"
    crlf.write_bytes(json.dumps(LLAVA).encode() + b"\r\n" + json.dumps(LLAVA).encode() + b" x\r\n")
    good, bad = read_all(crlf)
    assert not isinstance(good, Rejected) and bad.reason == "bad_json" and "CR alone" not in bad.message


def test_a_byte_order_mark_inside_a_json_array_file_is_bad_json(tmp_path):
    path = tmp_path / "a.json"
    path.write_bytes(b"[" + BOM + json.dumps(LLAVA).encode() + b"]")
    [r] = read_all(path)
    assert isinstance(r, Rejected) and r.reason == "bad_json" and r.source_row == 0


def test_a_line_cut_short_is_named_on_its_own_line():
    """json counted the line's own newline, so a line cut mid-record said "line 2 column 1" of a
    JSONL row that has one line; the position is now on the line, where the text stops."""
    from packtool.formats import parse_json_line

    for line in (b'{"id": "a", "x": [1, 2\n', b'{"id": "a", "x": [1, 2\r\n', b'{"id": "a", "x": [1, 2'):
        err = parse_json_line(line)
        assert err.reason == "bad_json"
        assert err.message == "line is not valid JSON: Expecting ',' delimiter: line 1 column 23 (char 22)", line
    err = parse_json_line(b'{"id" "a"}\n')  # an error inside the line keeps its place
    assert err.message == "line is not valid JSON: Expecting ':' delimiter: line 1 column 7 (char 6)"


def test_llava_keeps_a_top_level_system_prompt():
    """ShareGPT records read under --format llava lost their top-level ``system`` silently; the
    LLaVA reader keeps it, as the ShareGPT one does."""
    from packtool.formats import llava, sharegpt

    rec = {"id": "a", "system": "Be brief.", "conversations": [{"from": "human", "value": "hi"},
                                                               {"from": "gpt", "value": "yo"}]}
    s = llava.parse(rec, "f.jsonl", 0)
    assert [(m.role, m.parts[0].text) for m in s.branches[0]] == [("system", "Be brief."), ("user", "hi"),
                                                                  ("assistant", "yo")]
    assert s.branches == sharegpt.parse(rec, "f.jsonl", 0).branches
    with pytest.raises(SampleError, match="'system'"):
        llava.parse({**rec, "system": 3}, "f.jsonl", 0)


def test_messages_records_keep_a_top_level_system_prompt(tmp_path):
    """A ``messages`` record's top-level ``system`` (LLaMA-Factory's system column, ms-swift's
    ``system`` key) is its system prompt: ``--format auto`` reads such a record as swift, which
    dropped it silently (the template's default system text took its place). A conversation that
    opens with its own system turn keeps that one, as both tools do (it was ``bad_turn_order``
    under sharegpt and llava, two system turns)."""
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Arr."}]
    rec = {"id": "a", "system": "You are a pirate.", "messages": turns}
    own = {**rec, "messages": [{"role": "system", "content": "Be brief."}, *turns]}
    [s, o] = read_all(write_jsonl(tmp_path / "s.jsonl", [rec, own]))
    assert s.branches == ((Message("system", (T("You are a pirate."),)), U(T("Hi")), A("Arr.")),)
    assert o.branches == ((Message("system", (T("Be brief."),)), U(T("Hi")), A("Arr.")),)
    for fmt in ("swift", "sharegpt"):
        assert [x.branches for x in read_all(tmp_path / "s.jsonl", fmt)] == [s.branches, o.branches]
    legacy = {"id": "b", "system": "You are a pirate.",
              "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                {"from": "gpt", "value": "Arr."}]}
    for fmt in ("auto", "llava"):
        [b] = read_all(write_jsonl(tmp_path / "b.jsonl", [legacy]), fmt)
        assert b.branches == o.branches
    [bad] = read_all(write_jsonl(tmp_path / "n.jsonl", [{**rec, "system": 3}]))
    assert (bad.reason, bad.message) == ("bad_record", "'system' must be a string, got int")


def test_an_empty_media_list_counts_as_absent(tmp_path):
    """A table that mixes formats may hold ``[]`` rather than null in the media columns a row's
    format does not use (``images: []`` beside a LLaVA row's ``image``), and ``""`` in its text
    columns (``system``, ``tools``: a LLaVA row read as ShareGPT had to tag its image). The empty list won over
    the other key: a swift row lost its image silently (trained without it), and a LLaVA row
    read as ShareGPT was ``placeholder_mismatch`` "for 0 images"."""
    conv = [{"from": "human", "value": "<image>Q"}, {"from": "gpt", "value": "A"}]
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    recs = [{"id": "llava", "image": "a.png", "images": [], "videos": [], "conversations": conv},
            {"id": "untagged", "image": "a.png", "images": [], "conversations": [{**conv[0], "value": "Q"}, conv[1]]},
            {"id": "swift", "image": "a.png", "images": [], "messages": msgs},
            {"id": "molmo", "image": [], "images": ["a.png"], "message_list": [{"question": "Q", "answer": "A"}]},
            # a table filled with "" (fillna("")) where a row's format has no system prompt or tools
            {"id": "filled", "image": "a.png", "system": "", "tools": "", "conversations": [{**conv[0], "value": "Q"},
                                                                                            conv[1]]}]
    got = read_all(write_jsonl(tmp_path / "e.jsonl", recs))
    assert [detect_format(r) for r in recs] == ["llava", "llava", "swift", "molmo", "llava"]
    want = (U(IMG("image", 0), T("Q")), A("A"))
    for s in got:
        assert isinstance(s, Sample), s
        assert (s.media, s.branches) == ((MediaRef("image", "a.png"),), (want,)), s.sample_id
