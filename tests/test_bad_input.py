"""The bad-input suite: every broken row gets its reason code in errors.jsonl, the run goes
on, and every input row ends in exactly one place. Each fixture is made here, for real."""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import struct
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset


def conv(prompt: str = "<image>\nWhat is this?", answer: str = "A picture.") -> list[dict]:
    return [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}]


def png_bytes(w: int, h: int, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (w, h), 128 if mode == "L" else (10, 120, 200)).save(buf, format="PNG")
    return buf.getvalue()


def jpeg_bytes(w: int = 320, h: int = 240) -> bytes:
    buf = io.BytesIO()
    Image.effect_noise((w, h), 60).convert("RGB").save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def png_declaring(w: int, h: int) -> bytes:
    """A tiny PNG whose header declares ``w x h`` pixels (a decompression bomb's signature)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b"")


def video(path: Path, n_frames: int = 12, audio_only: bool = False) -> Path:
    import av
    import numpy as np

    with av.open(str(path), "w") as out:
        if audio_only:
            stream = out.add_stream("aac", rate=16000)
            stream.layout = "mono"
            for i in range(20):
                frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), dtype=np.float32), format="fltp", layout="mono")
                frame.sample_rate = 16000
                frame.pts = i * 1024
                for p in stream.encode(frame):
                    out.mux(p)
            for p in stream.encode(None):
                out.mux(p)
            return path
        stream = out.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        out.start_encoding()  # the header, with its video stream, even when no frame follows
        for i in range(n_frames):
            img = np.full((48, 64, 3), (i * 20) % 255, dtype=np.uint8)
            for p in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(p)
        for p in stream.encode(None):
            out.mux(p)
    return path


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "ok.png").write_bytes(png_bytes(64, 48))
    (root / "with space").mkdir()
    (root / "with space" / "a b.png").write_bytes(png_bytes(40, 30))
    jpg = jpeg_bytes()
    (root / "truncated.jpg").write_bytes(jpg[: len(jpg) // 2])
    (root / "wrong-header.png").write_bytes(b"GIF89a" + png_bytes(64, 48)[6:])
    (root / "empty.png").write_bytes(b"")
    (root / "bomb.png").write_bytes(png_declaring(100_000, 100_000))
    (root / "thin.png").write_bytes(png_bytes(1, 70_000, "L"))
    video(root / "ok.mp4")
    video(root / "audio-only.mp4", audio_only=True)
    video(root / "zero-frames.avi", n_frames=0)  # MP4 drops an empty track; AVI keeps it
    whole = video(root / "whole.mp4", n_frames=40).read_bytes()
    (root / "truncated.mp4").write_bytes(whole[: len(whole) // 3])
    # cut short by less than its index at the end (moov): FFmpeg opens it from what is left, and
    # its frames did not all decode, so it passed tokenize and then stopped every pack of it
    from video_fixtures import write_noise_video, write_video

    small = write_video(root / "small.mp4", n_frames=12, fps=6, size=(32, 32)).read_bytes()
    (root / "cut-in-moov.mp4").write_bytes(small[:-200])

    fast = write_noise_video(root / "faststart.mp4", 40, container_options={"movflags": "faststart"}).read_bytes()
    (root / "cut-in-mdat.mp4").write_bytes(fast[:-300])  # the index first: the frames are what is cut
    outside = root.parent / f"{root.name}-outside"
    outside.mkdir()
    (outside / "secret.png").write_bytes(png_bytes(32, 32))
    os.symlink(outside / "secret.png", root / "link.png")
    return root


def image_rec(rid: str, path: str) -> dict:
    return {"id": rid, "image": path, "conversations": conv()}


def video_rec(rid: str, path: str) -> dict:
    return {"id": rid, "video": path, "conversations": conv("<video>\nWhat happens?", "Nothing much.")}


def run_tokenize(media: Path, tmp_path: Path, lines: list[bytes], **kw) -> tuple[dict, dict[str, dict]]:
    """Tokenize ``lines`` (plus one good record before and after) and return the manifest and
    the errors by sample id (or ``row N`` for rows without an id)."""
    good = json.dumps(image_rec("good-first", "ok.png")).encode()
    last = json.dumps(image_rec("good-last", "ok.png")).encode()
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join([good, *lines, last]) + b"\n")
    m = tokenize_dataset([src], tmp_path / "tok", TokenizeConfig(media_root=str(media), **kw), workers=1)
    errors = {}
    for line in (tmp_path / "tok" / ".packtool" / "errors.jsonl").read_text().splitlines():
        e = json.loads(line)
        errors[e["sample_id"] or f"row {e['row']}"] = e
    # the run went on: both good records made it, and every row is accounted for
    assert m["counts"]["samples"] >= 2
    assert m["counts"]["rows_in"] == len(lines) + 2 == m["counts"]["samples"] + m["counts"]["rejected"]
    return m, errors


def assert_rejected(media, tmp_path, rec: dict, reason: str, **kw) -> dict:
    _, errors = run_tokenize(media, tmp_path, [json.dumps(rec).encode()], **kw)
    assert rec["id"] in errors, f"{rec['id']} was not rejected"
    e = errors[rec["id"]]
    assert e["reason"] == reason, e
    assert e["source"].endswith("in.jsonl") and e["row"] == 1 and e["message"]
    return e


IMAGE_CASES = {
    "truncated_jpeg": ("truncated.jpg", "corrupt_image"),
    "png_wrong_header": ("wrong-header.png", "corrupt_image"),
    "zero_byte_file": ("empty.png", "corrupt_image"),
    "decompression_bomb": ("bomb.png", "image_too_large"),
    "image_1x70000": ("thin.png", "bad_aspect_ratio"),
    "dotdot_path": ("../etc/passwd", "path_outside_root"),
    "symlink_outside_root": ("link.png", "path_outside_root"),
    "missing_file": ("nope.png", "missing_media"),
}


@pytest.mark.parametrize("case", sorted(IMAGE_CASES))
def test_bad_image(media, tmp_path, case):
    path, reason = IMAGE_CASES[case]
    assert_rejected(media, tmp_path, image_rec(case, path), reason)


def test_absolute_path_outside_root(media, tmp_path):
    outside = media.parent / f"{media.name}-outside" / "secret.png"
    e = assert_rejected(media, tmp_path, image_rec("abs", str(outside)), "path_outside_root")
    assert "outside --media-root" in e["message"]


def test_file_uris_are_decoded_and_stay_under_the_root(media, tmp_path):
    """``file://`` URIs name local files: percent-escapes decoded, ``localhost`` (or no host)
    accepted, and the path held to --media-root like any absolute path."""
    root = media.resolve().as_posix()
    outside = f"{root}-outside/secret.png"
    recs = [image_rec("escaped", f"file://{root}/with%20space/a%20b.png"),
            image_rec("localhost", f"file://localhost{root}/ok.png"),
            image_rec("outside", f"file://{outside}"),
            image_rec("dotdot", f"file://{root}/%2E%2E/{media.name}-outside/secret.png"),
            image_rec("other-host", f"file://fileserver{root}/ok.png"),
            image_rec("not-utf8", f"file://{root}/%FF.png")]
    m, errors = run_tokenize(media, tmp_path, [json.dumps(r).encode() for r in recs])
    assert m["counts"]["samples"] == 4  # the two good records around them, "escaped" and "localhost"
    assert {k: e["reason"] for k, e in errors.items()} == {
        "outside": "path_outside_root", "dotdot": "path_outside_root", "other-host": "missing_media",
        "not-utf8": "bad_encoding"}
    assert errors["outside"]["message"] == f"media path {outside!r} resolves outside --media-root {root!r}"
    assert errors["other-host"]["message"] == (
        f"image 'file://fileserver{root}/ok.png' names the host 'fileserver', not this machine; write "
        "file:///absolute/path, or a path relative to --media-root")
    rows = {r["sample_id"]: r for f in (tmp_path / "tok").glob("part-*.parquet")
            for r in pq.read_table(f, columns=["sample_id", "media"]).to_pylist()}
    assert [(x["width"], x["height"]) for x in rows["escaped"]["media"]] == [(40, 30)]
    assert [(x["width"], x["height"]) for x in rows["localhost"]["media"]] == [(64, 48)]


def test_windows_separators_name_the_file_when_unambiguous(media, tmp_path):
    """``with space\\a b.png`` reads ``with space/a b.png`` when no file has the backslashed name
    itself, through tokenize and pack; the ``/`` form is held to --media-root, and a path found
    neither way says that it uses backslashes."""
    recs = [image_rec("backslashed", "with space\\a b.png"),
            image_rec("escapes", f"..\\{media.name}-outside\\secret.png"),
            image_rec("nowhere", "imgs\\nope.png")]
    m, errors = run_tokenize(media, tmp_path, [json.dumps(r).encode() for r in recs])
    assert {k: e["reason"] for k, e in errors.items()} == {"escapes": "path_outside_root", "nowhere": "missing_media"}
    root = str(media.resolve())
    assert errors["nowhere"]["message"] == (
        f"media file 'imgs\\\\nope.png' not found under --media-root {root!r}, nor 'imgs/nope.png': the path uses "
        "Windows backslashes; write it with '/' separators, relative to --media-root")
    pack_dataset(tmp_path / "tok", tmp_path / "packed", PackConfig(max_tokens=8192))
    [packed] = [r for f in (tmp_path / "packed").glob("part-*.parquet")
                for r in pq.read_table(f, columns=["sample_ids", "media"]).to_pylist() if "backslashed" in r["sample_ids"]]
    [item] = [x for x in packed["media"] if x["sample_index"] == packed["sample_ids"].index("backslashed")]
    assert item["data"] == (media / "with space" / "a b.png").read_bytes()


def test_a_file_named_with_a_backslash_wins(tmp_path):
    from packtool.media import resolve_media_path

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "b.png").write_bytes(b"slash")
    (tmp_path / "a\\b.png").write_bytes(b"backslash")
    assert resolve_media_path("a\\b.png", tmp_path).read_bytes() == b"backslash"
    (tmp_path / "a\\b.png").unlink()
    assert resolve_media_path("a\\b.png", tmp_path).read_bytes() == b"slash"


VIDEO_CASES = {
    "video_without_video_stream": ("audio-only.mp4", "corrupt_video"),
    "video_with_zero_frames": ("zero-frames.avi", "corrupt_video"),
    "truncated_mp4": ("truncated.mp4", "corrupt_video"),
    "mp4_cut_in_its_index": ("cut-in-moov.mp4", "corrupt_video"),
    "mp4_cut_in_its_frames": ("cut-in-mdat.mp4", "corrupt_video"),
}


@pytest.mark.parametrize("case", sorted(VIDEO_CASES))
def test_bad_video(media, tmp_path, case):
    path, reason = VIDEO_CASES[case]
    e = assert_rejected(media, tmp_path, video_rec(case, path), reason)
    # FFmpeg's words, not PyAV's wrapping of them ("[Errno 1094995529] ...: '<none>'")
    assert "Errno" not in e["message"] and "<none>" not in e["message"], e["message"]
    if case.startswith("mp4_cut"):
        box = "moov" if "index" in case else "mdat"
        assert re.search(rf"truncated file: its '{box}' box needs [0-9,]+ bytes more than the [0-9,]+ the file has",
                         e["message"]), e["message"]


def test_good_video_passes(media, tmp_path):
    m, errors = run_tokenize(media, tmp_path, [json.dumps(video_rec("vid", "ok.mp4")).encode()])
    assert "vid" not in errors and m["counts"]["samples"] == 3


def test_a_rejection_names_which_of_the_records_media_failed(media, tmp_path):
    """A record with several media names the one that failed, by the path the record gave (or,
    for inline bytes, its place among the record's items of its kind), and not the good ones."""
    import base64

    garbage = "data:image/png;base64," + base64.b64encode(b"not an image").decode()
    recs = [{"id": "corrupt", "image": ["ok.png", "truncated.jpg", "with space/a b.png"],
             "conversations": conv("<image><image><image>\nThree.")},
            {"id": "missing", "image": ["ok.png", "with space/a b.png", "nope.png"],
             "conversations": conv("<image><image><image>\nThree.")},
            {"id": "inline", "image": ["ok.png", garbage, "with space/a b.png"],
             "conversations": conv("<image><image><image>\nThree.")},
            {"id": "video", "video": ["ok.mp4", "truncated.mp4"], "conversations": conv("<video><video>\nTwo.")},
            {"id": "absolute", "image": [str(media / "ok.png"), str(media / "truncated.jpg")],
             "conversations": conv("<image><image>\nTwo.")}]
    _, errors = run_tokenize(media, tmp_path, [json.dumps(r).encode() for r in recs])
    assert {k: e["reason"] for k, e in errors.items()} == {
        "corrupt": "corrupt_image", "missing": "missing_media", "inline": "corrupt_image", "video": "corrupt_video",
        "absolute": "corrupt_image"}
    message = {k: e["message"] for k, e in errors.items()}
    assert message["corrupt"].startswith("image 'truncated.jpg': truncated JPEG"), message
    assert message["absolute"].startswith("image 'truncated.jpg': truncated JPEG"), message  # as rows record it
    assert "'nope.png'" in message["missing"], message
    assert message["inline"].startswith("image 2 of 3 (inline bytes): "), message
    assert message["video"].startswith("video 'truncated.mp4': "), message
    for k, text in message.items():
        assert "ok.png" not in text and "a b.png" not in text and "ok.mp4" not in text, (k, text)
        assert str(media) not in text or k == "missing", (k, text)  # only --media-root, which it quotes


def test_placeholder_media_mismatch(media, tmp_path):
    rec = {"id": "mismatch", "image": ["ok.png", "ok.png"], "conversations": conv("<image>\nOne tag, two images.")}
    assert_rejected(media, tmp_path, rec, "placeholder_mismatch")


def test_non_utf8_and_invalid_json_lines(media, tmp_path):
    lines = [b'{"id": "latin1", "conversations": [{"from": "human", "value": "caf\xe9"}]}', b"{not json",
             b'{"id": "cut", "conversations": [']
    m, errors = run_tokenize(media, tmp_path, lines)
    assert {k: e["reason"] for k, e in errors.items()} == {"row 1": "bad_encoding", "row 2": "bad_json",
                                                            "row 3": "bad_json"}
    assert m["counts"]["rejected_by_reason"] == {"bad_encoding": 1, "bad_json": 2}


def test_deeply_nested_json(media, tmp_path):
    line = b'{"id": "deep", "x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    _, errors = run_tokenize(media, tmp_path, [line])
    assert errors["row 1"]["reason"] == "bad_json"


def test_a_50_mb_json_line(media, tmp_path):
    """One 50 MB line is read and judged like any other: here its one answer is far longer
    than any pack, so pack drops it as oversize while its neighbours are packed."""
    rec = {"id": "huge", "conversations": conv("Say it all.", "word " * 10_000_000)}
    line = json.dumps(rec).encode()
    assert len(line) >= 50_000_000
    m, errors = run_tokenize(media, tmp_path, [line], max_tokens=None)
    if "huge" in errors:  # rejected at tokenize: fine as long as the reason is a size reason
        assert errors["huge"]["reason"] in ("oversize", "bad_record")
        return
    packed = pack_dataset(tmp_path / "tok", tmp_path / "packed", PackConfig(max_tokens=4096, media="reference"), workers=1)
    drops = [json.loads(x) for x in (tmp_path / "packed" / ".packtool" / "errors.jsonl").read_text().splitlines()]
    assert [(d["sample_id"], d["reason"]) for d in drops] == [("huge", "oversize")]
    assert packed["counts"]["samples_packed"] == 2


def test_sample_longer_than_any_pack(media, tmp_path):
    rec = {"id": "long", "conversations": conv("Tell me everything.", "and then " * 3000)}
    run_tokenize(media, tmp_path, [json.dumps(rec).encode()])
    packed = pack_dataset(tmp_path / "tok", tmp_path / "packed", PackConfig(max_tokens=2048, media="reference"), workers=1)
    drops = [json.loads(x) for x in (tmp_path / "packed" / ".packtool" / "errors.jsonl").read_text().splitlines()]
    assert [(d["sample_id"], d["reason"], d["row"]) for d in drops] == [("long", "oversize", 1)]
    assert drops[0]["source"].endswith("in.jsonl")
    assert packed["counts"]["dropped"] == 1 and packed["counts"]["samples_packed"] == 2


def test_parquet_input_with_a_missing_column(media, tmp_path):
    good = pa.table({"id": ["p0", "p1"], "image": ["ok.png", "ok.png"],
                     "conversations": [conv(), conv()]})
    pq.write_table(good, tmp_path / "a-good.parquet")
    pq.write_table(pa.table({"id": ["q0", "q1"], "image": ["ok.png", "ok.png"]}), tmp_path / "b-no-conversations.parquet")
    m = tokenize_dataset([tmp_path / "a-good.parquet", tmp_path / "b-no-conversations.parquet"], tmp_path / "tok",
                         TokenizeConfig(media_root=str(media)), workers=1)
    errors = [json.loads(x) for x in (tmp_path / "tok" / ".packtool" / "errors.jsonl").read_text().splitlines()]
    assert m["counts"]["samples"] == 2 and m["counts"]["rows_in"] == 4
    assert [(e["sample_id"], e["reason"], e["row"]) for e in errors] == [("q0", "bad_record", 0), ("q1", "bad_record", 1)]


@pytest.mark.parametrize("column", [
    pa.array([0, 253_402_300_800 * 10**6, 0], pa.timestamp("us")),  # year 10000: past what datetime holds
    pa.array([0, 2**31 - 1, 0], pa.date32()),
])
def test_a_parquet_value_python_cannot_hold_rejects_its_row_only(media, tmp_path, column):
    """Converting such a value raised OverflowError out of tokenize (a traceback); now its row is
    a bad_record naming the column, and the rows around it, in the same record batch, are kept."""
    pq.write_table(pa.table({"id": ["p0", "p1", "p2"], "image": ["ok.png"] * 3, "conversations": [conv()] * 3,
                             "created": column}), tmp_path / "a.parquet")
    m = tokenize_dataset([tmp_path / "a.parquet"], tmp_path / "tok", TokenizeConfig(media_root=str(media)), workers=1)
    [e] = [json.loads(x) for x in (tmp_path / "tok" / ".packtool" / "errors.jsonl").read_text().splitlines()]
    assert (e["row"], e["reason"]) == (1, "bad_record")
    assert e["message"].startswith("column 'created' holds a value Python cannot represent (")
    assert m["counts"]["samples"] == 2 and m["counts"]["rows_in"] == 3


def test_a_parquet_time_zone_the_zone_database_lacks_rejects_its_rows(media, tmp_path):
    """A timestamp column whose time zone name is unknown cannot become Python values in any row
    (ArrowInvalid, a ValueError, which made the whole file one ``corrupt_file`` row)."""
    pq.write_table(pa.table({"id": ["p0", "p1"], "image": ["ok.png"] * 2, "conversations": [conv()] * 2,
                             "at": pa.array([0, 1], pa.timestamp("s", tz="Nowhere/Atlantis"))}), tmp_path / "a.parquet")
    m = tokenize_dataset([tmp_path / "a.parquet"], tmp_path / "tok", TokenizeConfig(media_root=str(media)), workers=1)
    errors = [json.loads(x) for x in (tmp_path / "tok" / ".packtool" / "errors.jsonl").read_text().splitlines()]
    assert [(e["row"], e["reason"], e["message"][:49]) for e in errors] == [
        (r, "bad_record", "column 'at' holds a value Python cannot represent") for r in (0, 1)]
    assert m["counts"]["rejected_by_reason"] == {"bad_record": 2}


_HUGE = "A" * 20_000
#: Records whose rejection message once quoted an input value whole (a 20,000-character role made a
#: 20,000-character line in errors.jsonl, and ``--on-error fail`` printed it).
LONG_VALUE_CASES = {
    "llava_role": ({"conversations": [{"from": _HUGE, "value": "hi"}, {"from": "gpt", "value": "yo"}]},
                   "unknown_role", "turn 0 has role 'AAAA"),
    "swift_part_type": ({"messages": [{"role": "user", "content": [{"type": _HUGE}]},
                                      {"role": "assistant", "content": "yo"}]},
                        "bad_record", "message 0 has a content part of type 'AAAA"),
    "molmo_role": ({"message_list": [{"messages": [{"role": _HUGE, "content": "q"}]}]},
                   "unknown_role", "message_list[0] message 0 has role 'AAAA"),
    "tool_name": ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [
        {"function": {"name": _HUGE, "arguments": "{"}}]}]}, "bad_tool_arguments", "turn 1 tool_calls[0] ('AAAA"),
    "tool_call_id": ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "function": {"name": "f", "arguments": {}}}]}, {"role": "tool", "tool_call_id": _HUGE, "content": "r"},
        {"role": "assistant", "content": "a"}]}, "orphan_tool_result", "turn 2 answers tool call 'AAAA"),
    "unknown_keys": ({_HUGE: 1, "caption": "c"}, "bad_record", "cannot tell the format from keys ['AAAA"),
}


@pytest.mark.parametrize("case", sorted(LONG_VALUE_CASES))
def test_a_rejection_quotes_a_long_input_value_cut_short(media, tmp_path, case):
    rec, reason, start = LONG_VALUE_CASES[case]
    _, errors = run_tokenize(media, tmp_path, [json.dumps({"id": case, **rec}).encode()])
    e = errors[case]
    assert e["reason"] == reason and e["message"].startswith(start), e["message"][:200]
    assert "…" in e["message"] and len(e["message"]) < 400, len(e["message"])


def test_max_errors_fails_the_run_and_leaves_nothing_half_done(media, tmp_path):
    lines = [b"{bad"] * 5
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join([json.dumps(image_rec("g", "ok.png")).encode(), *lines]) + b"\n")
    from packtool.errors import TooManyErrorsError

    with pytest.raises(TooManyErrorsError, match=r"5 input rows rejected, more than --max-errors 4"):
        tokenize_dataset([src], tmp_path / "tok", TokenizeConfig(media_root=str(media), max_errors=4), workers=1)
    assert not (tmp_path / "tok" / ".packtool" / "manifest.json").exists()
    assert not [p for p in (tmp_path / "tok").rglob("*") if p.name.endswith(".tmp") or p.suffix == ".parquet"]
    m = tokenize_dataset([src], tmp_path / "tok", TokenizeConfig(media_root=str(media), max_errors=5), workers=1)
    assert m["counts"]["rejected"] == 5


def test_on_error_fail_stops_at_the_first_bad_row(media, tmp_path):
    from packtool.errors import TooManyErrorsError

    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join([json.dumps(image_rec("g", "ok.png")).encode(),
                                json.dumps(image_rec("bad", "nope.png")).encode()]) + b"\n")
    with pytest.raises(TooManyErrorsError, match=r"in.jsonl:1 \(sample 'bad'\) rejected, missing_media: .*--on-error fail"):
        tokenize_dataset([src], tmp_path / "tok", TokenizeConfig(media_root=str(media)), workers=1, on_error="fail")
    assert not (tmp_path / "tok" / ".packtool" / "manifest.json").exists()


def test_readme_lists_every_reason_code():
    from packtool.errors import REASON_CODES

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Reason codes", 1)[1].split("\n## ", 1)[0]
    listed = {line.split("`")[1] for line in section.splitlines() if line.startswith("| `")}
    assert listed == set(REASON_CODES)


# ---------------------------------------------------------------- what a record carries (issue 13, class 1)
# Every field that reaches a shard or errors.jsonl is checked where the record is parsed: a row
# that cannot be represented is one errors.jsonl line, never a stopped run.

RECORD_CASES = {
    # name: (JSONL line, reason)
    "nul_in_image_path": (b'{"id": "nul_in_image_path", "image": "ok.png\\u0000.jpg", "conversations": %s}', "bad_record"),
    "nul_in_video_path": (b'{"id": "nul_in_video_path", "video": "ok\\u0000.mp4", "conversations": %v}', "bad_record"),
    "surrogate_in_image_path": (b'{"id": "surrogate_in_image_path", "image": "ok\\udc80.png", "conversations": %s}',
                                "bad_encoding"),
    "surrogate_in_video_list": (b'{"id": "surrogate_in_video_list", "videos": ["\\ud800.mp4"], "conversations": %v}',
                                "bad_encoding"),
    "surrogate_in_struct_path": (b'{"id": "surrogate_in_struct_path", "image": {"path": "\\udfff.png"}, '
                                 b'"conversations": %s}', "bad_encoding"),
    "surrogate_in_sample_id": (b'{"id": "surrogate_in_sample_id\\udc80", "image": "ok.png", "conversations": %s}',
                               "bad_encoding"),
    "surrogate_in_sample_id_key": (b'{"sample_id": "x\\udc80", "image": "ok.png", "conversations": %s}', "bad_encoding"),
    "surrogate_in_role": (b'{"id": "surrogate_in_role", "conversations": [{"from": "\\udc80", "value": "hi"}, '
                          b'{"from": "gpt", "value": "yo"}]}', "unknown_role"),
    "surrogate_in_system": (b'{"id": "surrogate_in_system", "system": "\\udc80", "conversations": %s, "images": ["ok.png"]}',
                            "bad_encoding"),
    "nul_in_data_uri": (b'{"id": "nul_in_data_uri", "image": "data:image/png;base64,\\u0000", "conversations": %s}',
                        "bad_record"),
    "media_path_is_a_number": (b'{"id": "media_path_is_a_number", "image": 12, "conversations": %s}', "bad_record"),
    "media_list_of_lists": (b'{"id": "media_list_of_lists", "images": [["ok.png"]], "conversations": %s}', "bad_record"),
    "conversations_is_a_string": (b'{"id": "conversations_is_a_string", "conversations": "hello"}', "bad_record"),
    "turn_is_a_number": (b'{"id": "turn_is_a_number", "conversations": [1, 2]}', "bad_record"),
    "message_list_of_nulls": (b'{"id": "message_list_of_nulls", "image": "ok.png", "message_list": [null]}', "bad_record"),
    "messages_content_is_a_dict": (b'{"id": "messages_content_is_a_dict", "messages": [{"role": "user", "content": '
                                   b'{"a": 1}}, {"role": "assistant", "content": "x"}]}', "bad_record"),
    "very_long_media_path": (b'{"id": "very_long_media_path", "image": "' + b"a/" * 5000 + b'x.png", "conversations": %s}',
                             "missing_media"),
    "media_path_is_the_root": (b'{"id": "media_path_is_the_root", "image": ".", "conversations": %s}', "missing_media"),
    "media_path_is_a_directory": (b'{"id": "media_path_is_a_directory", "image": "/", "conversations": %s}',
                                  "path_outside_root"),
    # nested past MAX_NESTING: the template's json.dumps of such a value, deep in the call stack,
    # raised RecursionError (a traceback, the run lost) for values the parser had read near the limit
    "tool_schema_nested_too_deep": (b'{"id": "tool_schema_nested_too_deep", "tools": [{"name": "f", "parameters": '
                                    + b"[" * 150 + b"]" * 150 + b'}], "messages": [{"role": "user", "content": "Q"}, '
                                    b'{"role": "assistant", "content": "A"}]}', "bad_record"),
    "tool_arguments_nested_too_deep": (b'{"id": "tool_arguments_nested_too_deep", "tools": [{"name": "f"}], "messages": '
                                       b'[{"role": "user", "content": "Q"}, {"role": "assistant", "tool_calls": '
                                       b'[{"function": {"name": "f", "arguments": {"a": ' + b"[" * 150 + b"]" * 150
                                       + b'}}}]}]}', "bad_record"),
}

_CONV = json.dumps(conv()).encode()
_VCONV = json.dumps(conv("<video>\nWhat happens?")).encode()


@pytest.mark.parametrize("case", sorted(RECORD_CASES))
def test_a_record_that_cannot_be_represented_is_one_error_row(media, tmp_path, case):
    line, reason = RECORD_CASES[case]
    line = line.replace(b"%s", _CONV).replace(b"%v", _VCONV)
    m, errors = run_tokenize(media, tmp_path, [line])
    assert len(errors) == 1, errors
    (e,) = errors.values()
    assert e["reason"] == reason, e
    assert e["row"] == 1 and e["message"]
    assert m["counts"]["rejected_by_reason"] == {reason: 1}


def test_tools_nested_near_the_recursion_limit_are_error_rows_at_any_depth(media, tmp_path):
    """Whatever depth the JSON parser still reads (it depends on the stack the parse runs on),
    a deeply nested tool schema is one error row: ``bad_json`` where the parser gives up,
    ``bad_record`` where it read it. Between the two, the template's dump raised
    ``RecursionError`` and the run ended with a traceback."""
    lines = [b'{"id": "d%d", "tools": [{"name": "f", "parameters": ' % d + b"[" * d + b"]" * d
             + b'}], "messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}'
             for d in range(880, 1010, 3)]
    m, errors = run_tokenize(media, tmp_path, lines)
    assert m["counts"]["samples"] == 2 and len(errors) == len(lines)
    assert {e["reason"] for e in errors.values()} <= {"bad_json", "bad_record"}


def test_a_sample_past_the_int32_counts_is_an_oversize_row(media, tmp_path):
    """``fixed:N`` bounds one item by int32, not a sample: two items of a huge N made a row whose
    n_tokens Arrow could not store, and the run ended with an ``ArrowInvalid`` traceback. Such
    a sample is an ``oversize`` row; one item of the same N still fits and is kept."""
    two = json.dumps({"id": "two", "images": ["ok.png", "ok.png"],
                      "conversations": conv("<image><image>What?")}).encode()
    m, errors = run_tokenize(media, tmp_path, [two], model="fixed:1100000000")
    assert [(k, e["reason"]) for k, e in errors.items()] == [("two", "oversize")]
    assert "more than a shard's int32 counts hold (2,147,483,647)" in errors["two"]["message"]
    n_tokens = pq.read_table(next((tmp_path / "tok").glob("part-*.parquet")), columns=["n_tokens"])
    assert all(1_100_000_000 < n < 2**31 for n in n_tokens.column("n_tokens").to_pylist())


def test_a_latin1_byte_in_a_json_array_file_rejects_only_its_records(media, tmp_path):
    """A JSON array file is decoded element by element; the records holding the invalid byte
    (in a text, an id, a media path) are rejected, the others in the same file are kept."""
    good = json.dumps(image_rec("good", "ok.png")).encode()
    texts = b'{"id": "in-text", "image": "ok.png", "conversations": [{"from": "human", "value": "<image>caf\xe9"}, {"from": "gpt", "value": "x"}]}'
    ids = b'{"id": "caf\xe9", "image": "ok.png", "conversations": ' + _CONV + b"}"
    paths = b'{"id": "in-path", "image": "caf\xe9.png", "conversations": ' + _CONV + b"}"
    src = tmp_path / "array.json"
    src.write_bytes(b"[" + b",\n".join([good, texts, ids, paths, good.replace(b'"good"', b'"good2"')]) + b"]")
    m = tokenize_dataset([src], tmp_path / "tok", TokenizeConfig(media_root=str(media)), workers=1)
    errors = [json.loads(x) for x in (tmp_path / "tok" / ".packtool" / "errors.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [(e["row"], e["reason"]) for e in errors] == [(1, "bad_encoding"), (2, "bad_encoding"), (3, "bad_encoding")]
    assert m["counts"]["samples"] == 2 and m["counts"]["rows_in"] == 5


def test_errors_jsonl_is_utf8_whatever_the_rejected_row_held(media, tmp_path):
    """errors.jsonl stays valid UTF-8 JSON lines: a lone surrogate in a rejected row's id is
    written as its JSON escape, and reads back as the same string."""
    line = b'{"id": "x\\udc80", "image": "nope.png", "conversations": ' + _CONV + b"}"
    run_tokenize(media, tmp_path, [line])
    raw = (tmp_path / "tok" / ".packtool" / "errors.jsonl").read_bytes()
    raw.decode("utf-8")
    (e,) = [json.loads(x) for x in raw.splitlines()]
    assert e["sample_id"] == "x\udc80" and e["reason"] == "bad_encoding"


def test_an_input_file_name_that_is_not_utf8(media, tmp_path):
    """A file name with a non-UTF-8 byte (possible on Linux) is read; its rows name it with the
    byte escaped, since Arrow strings and JSON need UTF-8."""
    name = os.fsdecode(b"caf\xe9.jsonl")
    src = tmp_path / name
    src.write_bytes(json.dumps(image_rec("a", "ok.png")).encode() + b"\n" + json.dumps(image_rec("b", "nope.png")).encode() + b"\n")
    m = tokenize_dataset([src], tmp_path / "tok", TokenizeConfig(media_root=str(media)), workers=1)
    assert m["counts"]["samples"] == 1 and m["counts"]["rejected"] == 1
    (e,) = [json.loads(x) for x in (tmp_path / "tok" / ".packtool" / "errors.jsonl").read_text(encoding="utf-8").splitlines()]
    assert e["source"].endswith("caf\\udce9.jsonl") and e["reason"] == "missing_media"
    rows = pq.read_table(next((tmp_path / "tok").glob("part-*.parquet")), columns=["source"]).column("source").to_pylist()
    assert rows == [e["source"]]


# ---------------------------------------------------------------- media formats (issue 13, class 7)
# Images are opened with an allow-list of the formats the model families' processors read;
# Pillow's other formats (EPS and PDF hand work to Ghostscript) are unsupported_media. Videos
# are opened with the demuxer their first bytes name, so a playlist or concat list (which make
# FFmpeg open other files or URLs) is never interpreted.


def _pil_bytes(fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 30, 30)).save(buf, format=fmt, **kw)
    return buf.getvalue()


UNSUPPORTED_IMAGES = {
    "eps.eps": lambda: _pil_bytes("EPS"),
    "eps_named.png": lambda: _pil_bytes("EPS"),
    "pdf.pdf": lambda: _pil_bytes("PDF"),
    "ico.ico": lambda: _pil_bytes("ICO"),
    "ppm.ppm": lambda: _pil_bytes("PPM"),
    "tga.tga": lambda: _pil_bytes("TGA"),
    "pcx.pcx": lambda: _pil_bytes("PCX"),
    "svg.svg": lambda: b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>',
    # editors open SVG with a comment, a doctype or a byte-order mark before the <svg> element
    "svg_comment.svg": lambda: b'<!-- Generator: Inkscape -->\n<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>',
    "svg_doctype.svg": lambda: (b'<!DOCTYPE svg PUBLIC "-//W3C//DTD SVG 1.1//EN" '
                                b'"http://www.w3.org/Graphics/SVG/1.1/DTD/svg11.dtd">\n<svg width="10" height="10"/>'),
    "svg_bom.svg": lambda: b'\xef\xbb\xbf<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>',
    # phone photos: HEIF/AVIF are ISO-BMFF files like MP4, but images (ftyp brand heic, avif)
    "heic.heic": lambda: _ftyp(b"heic", b"mif1heic"),
    "avif.avif": lambda: _ftyp(b"avif", b"avifmif1miaf"),
}


def _ftyp(brand: bytes, compatible: bytes) -> bytes:
    """The first boxes of a HEIF-family image: ``ftyp`` (major brand, compatible brands), then ``meta``."""
    ftyp = b"ftyp" + brand + b"\x00\x00\x00\x00" + compatible
    meta = b"meta" + b"\x00" * 4 + b"\x00\x00\x00\x21hdlr" + b"\x00" * 8 + b"pict" + b"\x00" * 13
    return (len(ftyp) + 4).to_bytes(4, "big") + ftyp + (len(meta) + 4).to_bytes(4, "big") + meta + b"\x00" * 200
SUPPORTED_IMAGES = {
    "jpeg.jpg": lambda: _pil_bytes("JPEG"),
    "png.png": lambda: _pil_bytes("PNG"),
    "webp.webp": lambda: _pil_bytes("WEBP"),
    "gif.gif": lambda: _pil_bytes("GIF"),
    "bmp.bmp": lambda: _pil_bytes("BMP"),
    "tiff.tiff": lambda: _pil_bytes("TIFF"),
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_IMAGES))
def test_image_formats_outside_the_allow_list_are_unsupported(media, tmp_path, name):
    root = tmp_path / "m"
    root.mkdir()
    (root / "ok.png").write_bytes(png_bytes(64, 48))
    (root / "with space").mkdir()
    (root / "with space" / "a b.png").write_bytes(png_bytes(40, 30))
    (root / name).write_bytes(UNSUPPORTED_IMAGES[name]())
    e = assert_rejected(root, tmp_path, image_rec(name, name), "unsupported_media")
    assert "JPEG" in e["message"] and "PNG" in e["message"]
    assert "video" not in e["message"], e  # a HEIC photo is not to be listed as a video
    kind = {"svg": "SVG", "heic": "HEIF", "avif": "AVIF"}.get(name.split(".")[-1])
    assert kind is None or kind in e["message"], e


def test_inline_eps_bytes_are_unsupported(media, tmp_path):
    import base64

    uri = "data:image/eps;base64," + base64.b64encode(_pil_bytes("EPS")).decode()
    assert_rejected(media, tmp_path, image_rec("inline-eps", uri), "unsupported_media")


@pytest.mark.parametrize("name", sorted(SUPPORTED_IMAGES))
def test_image_formats_on_the_allow_list_pass(tmp_path, name):
    root = tmp_path / "m"
    root.mkdir()
    (root / "ok.png").write_bytes(png_bytes(64, 48))
    (root / "with space").mkdir()
    (root / "with space" / "a b.png").write_bytes(png_bytes(40, 30))
    (root / name).write_bytes(SUPPORTED_IMAGES[name]())
    _, errors = run_tokenize(root, tmp_path, [json.dumps(image_rec(name, name)).encode()])
    assert name not in errors


def test_a_directory_or_pipe_named_like_an_image_is_said_to_be_no_file(tmp_path):
    """A directory ``x.png/`` given as an image was reported "not found": it is there, only not a file."""
    root = tmp_path / "m"
    root.mkdir()
    (root / "ok.png").write_bytes(png_bytes(64, 48))
    (root / "x.png").mkdir()
    os.mkfifo(root / "pipe.png")
    _, errors = run_tokenize(root, tmp_path, [json.dumps(image_rec("dir", "x.png")).encode(),
                                              json.dumps(image_rec("pipe", "pipe.png")).encode()])
    assert (errors["dir"]["reason"], errors["pipe"]["reason"]) == ("missing_media", "missing_media")
    assert "'x.png'" in errors["dir"]["message"] and "is a directory, not a file" in errors["dir"]["message"]
    assert "is a pipe, socket or device, not a file" in errors["pipe"]["message"]


@pytest.mark.parametrize("container", ["mp4", "avi", "mkv", "ts"])
def test_a_video_given_as_an_image_says_to_list_it_as_a_video(tmp_path, container):
    """A video in an image slot was a ``corrupt_image`` ("not an image Pillow can identify");
    the file is fine, only referenced as the wrong kind."""
    root = tmp_path / "m"
    root.mkdir()
    (root / "ok.png").write_bytes(png_bytes(64, 48))
    video(root / f"clip.{container}")
    e = assert_rejected(root, tmp_path, image_rec("clip", f"clip.{container}"), "unsupported_media")
    assert "the image is a video" in e["message"] and "list it as a video" in e["message"], e
    (tmp_path / "as-video").mkdir()
    _, errors = run_tokenize(root, tmp_path / "as-video", [json.dumps(video_rec("clip", f"clip.{container}")).encode()])
    assert "clip" not in errors, errors.get("clip")


VIDEO_TRICKS = {
    # an HLS playlist naming a file outside the media root
    "playlist.m3u8": b"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\n../outside.mp4\n#EXT-X-ENDLIST\n",
    "playlist_named.mp4": b"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\n../outside.mp4\n#EXT-X-ENDLIST\n",
    "concat.ffconcat": b"ffconcat version 1.0\nfile ../outside.mp4\n",
    "concat_named.mp4": b"ffconcat version 1.0\nfile ../outside.mp4\n",
    "text.mp4": b"just some text, not a video at all\n" * 10,
    "image_as_video.mp4": None,  # a PNG given as a video
}


@pytest.mark.parametrize("name", sorted(VIDEO_TRICKS))
def test_video_files_that_are_not_video_containers(media, tmp_path, name):
    root = tmp_path / "m"
    root.mkdir()
    (root / "ok.png").write_bytes(png_bytes(64, 48))
    (root / "with space").mkdir()
    (root / "with space" / "a b.png").write_bytes(png_bytes(40, 30))
    video(tmp_path / "outside.mp4")
    (root / name).write_bytes(VIDEO_TRICKS[name] if VIDEO_TRICKS[name] is not None else png_bytes(64, 48))
    assert_rejected(root, tmp_path, video_rec(name, name), "unsupported_media")


@pytest.mark.parametrize("container", ["mp4", "avi", "mkv", "webm", "mov", "ts"])
def test_video_containers_on_the_allow_list_pass(tmp_path, container):
    import av
    import numpy as np

    root = tmp_path / "m"
    root.mkdir()
    (root / "ok.png").write_bytes(png_bytes(64, 48))
    (root / "with space").mkdir()
    (root / "with space" / "a b.png").write_bytes(png_bytes(40, 30))
    path = root / f"v.{container}"
    codec = "libvpx" if container == "webm" else "mpeg4"
    if codec not in av.codecs_available:
        pytest.skip(f"{codec} encoder not in this PyAV build")
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(12):
            for p in stream.encode(av.VideoFrame.from_ndarray(np.full((48, 64, 3), i * 20, np.uint8), format="rgb24")):
                out.mux(p)
        for p in stream.encode(None):
            out.mux(p)
    _, errors = run_tokenize(root, tmp_path, [json.dumps(video_rec("v", path.name)).encode()])
    assert "v" not in errors, errors.get("v")


def test_a_byte_order_mark_at_the_start_of_an_input_costs_no_row(media, tmp_path):
    """Files saved by Windows tools start with a UTF-8 byte-order mark: tokenize reads their
    first record like any other (plain JSONL cut into several tasks, a JSON array, gzip), and
    only a mark inside a file rejects its line, with its own row number."""
    bom = b"\xef\xbb\xbf"
    recs = [json.dumps(image_rec(f"r{i}", "ok.png")).encode() for i in range(5)]
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.jsonl").write_bytes(bom + b"\n".join(recs) + b"\n")
    (src / "b.json").write_bytes(bom + b"[" + b",".join(recs) + b"]")
    (src / "c.jsonl.gz").write_bytes(gzip.compress(bom + b"\n".join(recs)))
    (src / "d.jsonl").write_bytes(bom + recs[0] + b"\n" + bom + recs[1] + b"\n" + recs[2] + b"\n")
    m = tokenize_dataset([src], tmp_path / "tok", TokenizeConfig(media_root=str(media), rows_per_shard=2), workers=1)
    errors = [json.loads(line) for line in (tmp_path / "tok" / ".packtool" / "errors.jsonl").read_text().splitlines()]
    assert [(os.path.basename(e["source"]), e["row"], e["reason"]) for e in errors] == [("d.jsonl", 1, "bad_json")]
    assert m["counts"]["rows_in"] == 18 and m["counts"]["samples"] == 17
