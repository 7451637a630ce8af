"""Video fixtures made with PyAV: probe fallbacks, the frame times each family chooses, and frame extraction.

Frame ``i`` of every fixture is a flat grey of level ``(i * step) % 256``, so the
grey level of an extracted JPEG tells which frame it is.
"""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from video_fixtures import grey_level, write_noise_video, write_video

from packtool.errors import SampleError
from packtool.media import extract_frames, probe_video
from packtool.vision import get_family

VFR_PTS = [0, 10, 20, 100, 110, 400, 410, 420, 900, 1000, 1010, 1500, 1600, 1700, 1710, 1720, 1800, 1900, 1950, 2000]


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    d = tmp_path_factory.mktemp("videos")
    write_video(d / "cfr.mp4", 90, 30)  # 3 s, 30 fps
    write_video(d / "vfr.mp4", 20, 30, pts=VFR_PTS, time_base=Fraction(1, 1000))  # ms timestamps, irregular
    write_video(d / "nodur.h264", 45, 15, fmt="h264")  # raw stream: no duration, no frame count, no timing
    write_video(d / "clip.webm", 45, 15, fmt="webm", codec="libvpx")  # no stream frame count
    write_video(d / "rot.mp4", 30, 30, size=(64, 48), rotation=90)  # display matrix: 90 degrees
    write_video(d / "one.mp4", 1, 30)
    write_video(d / "long.mp4", 600, 1, size=(32, 32), step=1)  # 10 minutes at 1 fps
    return d


def test_probe_constant_rate(videos):
    m = probe_video(videos / "cfr.mp4")
    assert (m.width, m.height, m.n_frames, m.fps, m.start_s, m.rotation) == (64, 48, 90, 30.0, 0.0, 0)
    assert m.duration_s == pytest.approx(3.0)
    assert probe_video((videos / "cfr.mp4").read_bytes()) == m  # inline bytes probe the same


def test_probe_variable_rate(videos):
    m = probe_video(videos / "vfr.mp4")
    assert m.n_frames == 20
    assert m.duration_s == pytest.approx(2.0, abs=0.05)  # last pts 2.000 s plus its frame duration
    assert m.fps == pytest.approx(20 / m.duration_s, rel=0.05)  # the average rate, not the nominal 30


def test_probe_fallbacks_without_duration_or_frame_count(videos):
    raw = probe_video(videos / "nodur.h264")  # frames counted from packets; duration = frames / rate
    assert raw.n_frames == 45 and raw.duration_s == pytest.approx(45 / raw.fps)
    webm = probe_video(videos / "clip.webm")  # duration from the container; frames = duration * rate
    assert (webm.n_frames, webm.fps) == (45, 15.0) and webm.duration_s == pytest.approx(3.0)


def test_probe_rotation(videos):
    m = probe_video(videos / "rot.mp4")
    assert (m.width, m.height, m.rotation) == (64, 48, 90)
    r = probe_video(videos / "rot.mp4", apply_rotation=True)
    assert (r.width, r.height) == (48, 64)
    frames = extract_frames(videos, {"path": "rot.mp4", "timestamps": [0.0], "width": 48, "height": 64})
    from io import BytesIO

    from PIL import Image

    assert Image.open(BytesIO(frames[0])).size == (48, 64)  # rotated like the recorded size


def test_probe_one_frame_and_corrupt(videos, tmp_path):
    m = probe_video(videos / "one.mp4")
    assert m.n_frames == 1
    with pytest.raises(SampleError) as err:
        get_family("qwen2.5-vl").video(m)
    assert err.value.reason == "video_too_short"
    assert get_family("molmo2").video(m).timestamps == (0.0, pytest.approx(1 / 30))
    (tmp_path / "bad.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"junk" * 10)
    with pytest.raises(SampleError) as err:
        probe_video(tmp_path / "bad.mp4")
    assert err.value.reason == "corrupt_video"


def test_documented_frame_counts_and_times(videos):
    cfr, long = probe_video(videos / "cfr.mp4"), probe_video(videos / "long.mp4")
    q = get_family("qwen2.5-vl")
    # 3 s at 2 fps = 6 frames: round(linspace(0, 89, 6)) = 0, 18, 36, 53, 71, 89  (r(17.8), r(35.6), r(53.4), r(71.2))
    assert [round(t * 30) for t in q.video(cfr).timestamps] == [0, 18, 36, 53, 71, 89]
    assert len(q.video(long).timestamps) == 600  # 1200 wanted at 2 fps, capped by the 600 frames
    m = get_family("molmo2")
    assert m.video(cfr).timestamps == (0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0)
    assert len(m.video(long).timestamps) == 128
    assert len(get_family("qwen3-vl").video(cfr).timestamps) == 6
    assert len(get_family("llava-ov").video(long).timestamps) == 32


def test_extracted_frames_are_the_recorded_times(videos):
    # dense request: one linear decode
    cfr = get_family("qwen2.5-vl").video(probe_video(videos / "cfr.mp4"))
    jpegs = extract_frames(videos, {"path": "cfr.mp4", "timestamps": list(cfr.timestamps), "width": 64, "height": 48})
    assert [round(grey_level(j) / 8) for j in jpegs] == [i * 8 % 256 // 8 for i in (0, 18, 36, 53, 71, 89)]
    # variable rate: the frame on screen at t is the last one whose pts <= t
    jpegs = extract_frames(videos, {"path": "vfr.mp4", "timestamps": [0.0, 0.05, 0.105, 1.0, 5.0]})
    assert [round(grey_level(j) / 8) for j in jpegs] == [0, 2, 3, 9, 19]
    # sparse request over 10 minutes: seek per time
    long = get_family("molmo2").video(probe_video(videos / "long.mp4"))
    jpegs = extract_frames(videos, {"path": "long.mp4", "timestamps": list(long.timestamps), "width": 32, "height": 32})
    expect = [min(int(t + 1e-6), 599) % 256 for t in long.timestamps]
    got = [grey_level(j) for j in jpegs]
    assert len(got) == 128 and all(abs(g - e) <= 3 for g, e in zip(got, expect, strict=True)), list(zip(got, expect, strict=True))


@pytest.mark.parametrize(("fmt", "codec"), [("matroska", "libx264"), ("flv", "flv")])
def test_frames_of_a_millisecond_clock_are_the_counted_indices(tmp_path, fmt, codec):
    """Matroska (WebM too) and FLV store frame times in milliseconds: frame 2 of a 30 fps clip at
    0.067 s, after the 0.0667 s its index stands for. The frame taken at ``i / 30`` is still frame
    ``i`` (it was frame ``i - 1``, one early, for every third frame), on the dense and the sparse path."""
    path = write_video(tmp_path / f"clip.{fmt}", 64, 30, fmt=fmt, codec=codec, step=4)
    for idx in ([0, 2, 5, 8, 14, 21, 41], [2, 62]):  # dense, then sparse (2 s apart: a seek per time)
        jpegs = extract_frames(tmp_path, {"path": path.name, "timestamps": [i / 30 for i in idx], "width": 64,
                                          "height": 48})
        assert [round(grey_level(j) / 4) for j in jpegs] == idx


def test_packed_shard_embeds_the_recorded_frames(videos, tmp_path):
    from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset

    rec = {"id": "v1", "video": "cfr.mp4", "conversations": [{"from": "human", "value": "<video>\nWhat happens?"},
                                                             {"from": "gpt", "value": "It gets brighter."}]}
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(rec) + "\n")
    tok, packed = tmp_path / "tok", tmp_path / "packed"
    tokenize_dataset([data], tok, TokenizeConfig(media_root=str(videos)))
    row = pq.read_table(next(tok.glob("**/*.parquet"))).to_pylist()[0]
    media = row["media"][0]
    assert media["kind"] == "video" and len(media["timestamps"]) == 6 and media["grid_t"] == 3
    assert media["n_tokens"] == get_family("qwen2.5-vl").video(probe_video(videos / "cfr.mp4")).n_tokens
    pack_dataset(tok, packed, PackConfig(max_tokens=4096, media="embed", frame_quality=80))
    prow = pq.read_table(next(packed.glob("**/part-*.parquet"))).to_pylist()[0]
    frames = prow["media"][0]["frames"]
    assert len(frames) == 6
    assert prow["media"][0]["timestamps"] == media["timestamps"]
    levels = [round(grey_level(f) / 8) for f in frames]
    assert levels == [round(t * 30) * 8 % 256 // 8 for t in media["timestamps"]]


@pytest.mark.parametrize("family", ["qwen2.5-vl", "molmo2", "internvl"])
def test_frames_of_a_raw_stream_are_extracted_by_position(videos, family):
    """A raw H.264 stream has no frame times; probe counts frame n at n / rate, and so does extraction
    (it used to skip every frame as untimed, and pack stopped)."""
    lay = get_family(family).video(probe_video(videos / "nodur.h264"))
    jpegs = extract_frames(videos, {"path": "nodur.h264", "timestamps": list(lay.timestamps), "width": 64, "height": 48})
    rate = probe_video(videos / "nodur.h264").fps
    assert [round(grey_level(j) / 8) for j in jpegs] == [min(int(t * rate + 1e-6), 44) * 8 % 256 // 8
                                                         for t in lay.timestamps]


def test_probe_of_a_video_cut_anywhere_is_a_row_error(videos):
    """A file cut short at any byte, inside the header too (where a stream may be listed with
    no codec yet), probes or raises ``SampleError``: never another exception that stops the run."""
    whole = (videos / "cfr.mp4").read_bytes()
    outcomes = set()
    for n in range(0, len(whole), 3):
        try:
            probe_video(whole[:n])
            outcomes.add("probed")
        except SampleError as err:
            outcomes.add(err.reason)
    assert outcomes <= {"probed", "corrupt_video", "unsupported_media"}


# --------------------------------------------------------------------------- containers, constant and variable rate

#: (extension, PyAV format, codec) of each container; Matroska, WebM, MPEG-TS and FLV store no frame
#: count and AVI one that counts the empty chunks it pads a variable-rate stream with
CONTAINERS = [("mp4", "mp4", "libx264"), ("mkv", "matroska", "libx264"), ("webm", "webm", "libvpx-vp9"),
              ("ts", "mpegts", "libx264"), ("flv", "flv", "flv"), ("avi", "avi", "mpeg4")]


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """Per container a constant-rate clip (36 frames at 12 fps) and a variable-rate one (the 20
    frames of ``VFR_PTS``, nominally 30 fps), each with the grey level of every decoded frame."""
    import av

    d = tmp_path_factory.mktemp("clips")
    out = {}
    for ext, fmt, codec in CONTAINERS:
        if codec not in av.codecs_available:
            continue
        write_video(d / f"cfr.{ext}", 36, 12, fmt=fmt, codec=codec, step=7)
        write_video(d / f"vfr.{ext}", 20, 30, fmt=fmt, codec=codec, pts=VFR_PTS, time_base=Fraction(1, 1000), step=12)
        for name, step in ((f"cfr.{ext}", 7), (f"vfr.{ext}", 12)):
            with av.open(str(d / name)) as c:  # the truth: every frame a full decode gives, in display order
                out[name] = [round(float(f.to_ndarray(format="gray").mean()) / step) for f in c.decode(video=0)]
    return d, out


@pytest.mark.parametrize("name", [f"{k}.{ext}" for ext, _, _ in CONTAINERS for k in ("cfr", "vfr")])
@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl", "internvl"])
def test_counted_frames_are_the_decoded_frames_at_the_sampled_indices(clips, name, family):
    """The probe counts the frames a decode gives (a variable-rate Matroska clip of 20 frames probed
    as 61, MPEG-TS as 201, AVI as 2,033), and the frames pack extracts are the decoded frames at
    the indices the family's processor samples, in every container at either rate (a variable-rate
    MP4 gave frames 0, 7, 10, 17 for 0, 6, 13, 19)."""
    from packtool.vision.internvl import internvl_frame_indices
    from packtool.vision.qwen import uniform_indices

    d, truth = clips
    if name not in truth:
        pytest.skip("codec not in this PyAV build")
    step = 7 if name.startswith("cfr") else 12
    meta = probe_video(d / name)
    assert meta.n_frames == len(truth[name]) == (36 if name.startswith("cfr") else 20)
    if name.startswith("cfr"):
        assert (meta.fps, meta.frame_times) == (12.0, ())  # constant rate: i / fps, the header's rate
    else:
        assert meta.fps == pytest.approx(20 / meta.duration_s, rel=0.02)  # the average, not the nominal 30
        assert meta.frame_times == pytest.approx([t / 1000 for t in VFR_PTS], abs=1e-3)
    lay = get_family(family).video(meta)
    n = len(lay.timestamps)
    idx = (internvl_frame_indices(meta.n_frames, n) if family == "internvl"
           else uniform_indices(meta.n_frames, n).tolist())
    jpegs = extract_frames(d, {"path": name, "timestamps": list(lay.timestamps), "width": 64, "height": 48})
    assert [round(grey_level(j) / step) for j in jpegs] == [truth[name][i] for i in idx]
    if family == "qwen3-vl":  # the timestamp text is the processor's: index / fps of each frame pair
        from packtool.vision.qwen3 import frame_pair_times

        text = [s[1] for s in lay.segments if s[0] == "text"]
        assert text == [f"<{t:.1f} seconds>" for t in frame_pair_times(idx, meta.fps)]


def test_a_variable_rate_matroska_clip_tokenizes_packs_and_validates(clips, tmp_path):
    """Tokenize -> pack --media embed -> validate of a variable-rate MKV under qwen3-vl: the packed
    frames are the decoded frames at the processor's indices, and the timestamp text rebuilt from
    the recorded row is the one tokenize wrote (validate finds nothing)."""
    from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset
    from packtool.validate import validate_dir
    from packtool.vision.qwen import uniform_indices

    d, truth = clips
    rec = {"id": "v", "video": "vfr.mkv", "conversations": [{"from": "human", "value": "<video>\nWhat happens?"},
                                                           {"from": "gpt", "value": "It flickers."}]}
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(rec) + "\n")
    tok, packed = tmp_path / "tok", tmp_path / "packed"
    tokenize_dataset([data], tok, TokenizeConfig(model="qwen3-vl", media_root=str(d)))
    media = pq.read_table(next(tok.glob("**/*.parquet"))).to_pylist()[0]["media"][0]
    assert (media["source_frames"], len(media["timestamps"])) == (20, 4)
    pack_dataset(tok, packed, PackConfig(max_tokens=4096, media="embed"))
    frames = pq.read_table(next(packed.glob("**/part-*.parquet"))).to_pylist()[0]["media"][0]["frames"]
    assert [round(grey_level(f) / 12) for f in frames] == [truth["vfr.mkv"][i] for i in uniform_indices(20, 4)]
    for out in (tok, packed):
        report = validate_dir(out)
        assert report["ok"], report


def _cut_without_reencoding(src, dst, shift: int) -> None:
    """Remux ``src`` into the MP4 ``dst`` with every time moved ``shift`` ticks earlier, as a
    stream copy cut mid-GOP (``ffmpeg -ss T -c copy``) writes it: the frames before the cut
    stay in the file, hidden by the edit list, and a decode drops them."""
    import av

    with av.open(str(src)) as inp, av.open(str(dst), "w", format="mp4") as out:
        ost = out.add_stream_from_template(inp.streams.video[0])
        for pkt in inp.demux(inp.streams.video[0]):
            if pkt.dts is None:
                continue
            pkt.pts -= shift
            pkt.dts -= shift
            pkt.stream = ost
            out.mux(pkt)


@pytest.mark.parametrize("rate", ["cfr", "vfr"])
def test_an_mp4_cut_without_reencoding_counts_the_frames_a_decode_gives(tmp_path, rate):
    """An MP4 cut without re-encoding stores the frames before the cut (up to its keyframe), which
    its edit list hides and a decode drops: a constant-rate one was counted from its headers as
    30 frames where a decode gives 25 (the last sampled frame taken 4 frames early), a variable-rate
    one counted the hidden frames too, and every frame time was shifted by them (frames 0, 6, 16,
    25 taken for 0, 8, 17, 25)."""
    import av
    import numpy as np

    from packtool.media import counted_frames
    from packtool.vision.qwen import uniform_indices

    pts = VFR_PTS + [2100 + 30 * k for k in range(10)] if rate == "vfr" else [33 * i for i in range(30)]
    write_video(tmp_path / "src.mkv", 30, 30, fmt="matroska", pts=pts, time_base=Fraction(1, 1000), step=8)
    _cut_without_reencoding(tmp_path / "src.mkv", tmp_path / "cut.mp4", 105 if rate == "vfr" else 165)
    with av.open(str(tmp_path / "cut.mp4")) as c:  # the truth: every frame a full decode gives
        decoded = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert len(decoded) < 30  # the fixture hides frames
    meta = probe_video(tmp_path / "cut.mp4")
    assert meta.n_frames == len(decoded)
    lay = get_family("qwen2.5-vl").video(meta)
    idx = uniform_indices(meta.n_frames, len(lay.timestamps)).tolist()
    got = counted_frames(tmp_path / "cut.mp4", {"timestamps": list(lay.timestamps), "width": 64, "height": 48})
    assert [np.array_equal(np.asarray(img.convert("RGB")), decoded[i]) for img, i in zip(got, idx, strict=True)] \
        == [True] * len(idx)


# --------------------------------------------------------------------------- streams that do not start at zero

def _flv_metadata_duration(path, seconds: float) -> None:
    """Rewrite the ``duration`` of an FLV's ``onMetaData``, as muxers that store the last
    timestamp there (the start offset included) write it."""
    import struct

    data = bytearray(path.read_bytes())
    at = data.index(b"duration\x00") + len(b"duration\x00")
    data[at:at + 8] = struct.pack(">d", seconds)
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def late_clips(tmp_path_factory):
    """Per container 20 frames at 10 fps whose first is shown at 2 s (an ``ffmpeg -ss 2 -c copy``
    cut keeps such times), with the grey level and time (from the first frame) of every frame a
    full decode gives; and a 36-frame, 12 fps MPEG-PS clip, which starts at 0.583 s."""
    import av

    d = tmp_path_factory.mktemp("late")
    pts = [2000 + 100 * i for i in range(20)]
    for ext, fmt, codec in [("mkv", "matroska", "libx264"), ("webm", "webm", "libvpx-vp9"), ("flv", "flv", "flv"),
                            ("asf", "asf", "wmv2"), ("ts", "mpegts", "libx264"), ("mp4", "mp4", "libx264")]:
        if codec in av.codecs_available:
            write_video(d / f"late.{ext}", 20, 10, fmt=fmt, codec=codec, pts=pts, time_base=Fraction(1, 1000), step=12)
    write_video(d / "late_end.flv", 20, 10, fmt="flv", codec="flv", pts=pts, time_base=Fraction(1, 1000), step=12)
    _flv_metadata_duration(d / "late_end.flv", 4.0)
    write_video(d / "clip.mpg", 36, 12, fmt="mpeg", codec="mpeg2video", step=7)
    truth = {}
    for path in d.iterdir():
        with av.open(str(path)) as c:
            frames = [(f.time, float(f.to_ndarray(format="gray").mean())) for f in c.decode(video=0)]
        truth[path.name] = [(t - frames[0][0], g) for t, g in frames]
    return d, truth


LATE = ["late.mkv", "late.webm", "late.flv", "late_end.flv", "late.asf", "late.ts", "late.mp4"]


@pytest.mark.parametrize("name", LATE)
def test_a_stream_that_starts_late_lasts_as_long_as_its_frames(late_clips, name):
    """A stream whose first frame is at 2 s lasts its frames' 2 s, as a decode (frame times from
    the first frame) and the processors' ``frames / fps`` see it. Matroska, WebM and ASF headers
    (and some FLV muxers) store the end time counted from zero: the 20 frames probed as 4 s and
    Molmo2 sampled 9 frames to 4.0 s (the last four past the end, copies of the last frame)."""
    d, truth = late_clips
    if name not in truth:
        pytest.skip("codec not in this PyAV build")
    meta = probe_video(d / name)
    decoded = truth[name]
    assert (meta.n_frames, meta.fps, meta.frame_times) == (20, 10.0, ())
    assert meta.start_s == pytest.approx(2.0)
    assert meta.duration_s == pytest.approx(len(decoded) / 10.0) == pytest.approx(decoded[-1][0] + 0.1)
    lay = get_family("molmo2").video(meta)
    assert lay.timestamps == (0.0, 0.5, 1.0, 1.5, 2.0)
    assert lay.n_tokens == 5 * 81
    jpegs = extract_frames(d, {"path": name, "timestamps": list(lay.timestamps)})
    on_screen = [max(i for i, (t, _) in enumerate(decoded) if t <= s + 1e-6) for s in lay.timestamps]
    assert [round(grey_level(j) / 12) for j in jpegs] == [round(decoded[i][1] / 12) for i in on_screen]


@pytest.mark.parametrize("name", LATE)
@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl", "llava-ov", "internvl"])
def test_frames_of_a_stream_that_starts_late_are_the_decoded_frames_at_the_sampled_indices(late_clips, name,
                                                                                           family):
    """The families that sample by index take, from a stream starting at 2 s, the decoded frames at
    the indices their processors sample."""
    from packtool.vision.internvl import internvl_frame_indices
    from packtool.vision.qwen import uniform_indices

    d, truth = late_clips
    if name not in truth:
        pytest.skip("codec not in this PyAV build")
    lay = get_family(family).video(probe_video(d / name))
    n = len(lay.timestamps)
    idx = (internvl_frame_indices(20, n) if family == "internvl" else
           np.linspace(0, 19, n, dtype=int).tolist() if family == "llava-ov" else uniform_indices(20, n).tolist())
    jpegs = extract_frames(d, {"path": name, "timestamps": list(lay.timestamps)})
    assert [round(grey_level(j) / 12) for j in jpegs] == [round(truth[name][i][1] / 12) for i in idx]


def test_an_mpeg_ps_clip_lasts_as_long_as_its_frames(late_clips):
    """An MPEG-PS header's duration is a guess from the bit rate: 36 frames at 12 fps probed as
    1.67 s, and Molmo2 sampled 4 of the clip's 3 s."""
    d, truth = late_clips
    meta = probe_video(d / "clip.mpg")
    assert (meta.n_frames, meta.fps, len(truth["clip.mpg"])) == (36, 12.0, 36)
    assert meta.duration_s == pytest.approx(3.0)
    assert get_family("molmo2").video(meta).timestamps == (0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0)


@pytest.mark.parametrize("fps", [10, 1])  # 4 s: every request dense; 40 s: InternVL's 8 frames 5 s apart, sparse
@pytest.mark.parametrize("family", ["qwen2.5-vl", "molmo2", "llava-ov", "internvl"])
def test_frames_of_an_avi_with_b_frames_are_the_decoded_frames_at_the_sampled_times(tmp_path, fps, family):
    """AVI stores no presentation times: FFmpeg makes them up in decode order, so the frames of an
    H.264 stream with B-frames leave the decoder in display order with times out of order, and the
    frame taken for a time was often another (frames 0, 5, 11, 16, 21, 28, 32, 39 for Qwen's
    0, 6, 11, 17, 22, 28, 33, 39). The frames taken are the decoded frames a frame-indexed reader
    gives at the sampled indices (Molmo2: at its times, ``i / fps``)."""
    import av

    from packtool.vision.internvl import internvl_frame_indices
    from packtool.vision.qwen import uniform_indices

    path = write_video(tmp_path / "bf.avi", 40, fps, fmt="avi", step=6, b_frames=3)
    with av.open(str(path)) as c:  # the truth: every frame a full decode gives, in display order
        assert c.streams.video[0].codec_context.has_b_frames
        decoded = [round(float(f.to_ndarray(format="gray").mean()) / 6) for f in c.decode(video=0)]
    meta = probe_video(path)
    assert (meta.n_frames, meta.fps, meta.duration_s, meta.frame_times) == (40, float(fps), pytest.approx(40 / fps), ())
    lay = get_family(family).video(meta)
    n = len(lay.timestamps)
    idx = {"qwen2.5-vl": lambda: uniform_indices(40, n).tolist(), "llava-ov": lambda: np.linspace(0, 39, n, dtype=int),
           "internvl": lambda: internvl_frame_indices(40, n),
           "molmo2": lambda: [min(int(t * fps + 1e-6), 39) for t in lay.timestamps]}[family]()
    jpegs = extract_frames(tmp_path, {"path": "bf.avi", "timestamps": list(lay.timestamps)})
    assert [round(grey_level(j) / 6) for j in jpegs] == [decoded[i] for i in idx]


@pytest.mark.parametrize(("fmt", "n", "fps"), [("mpegts", 600, 30), ("mpegts", 60, 1), ("matroska", 600, 30)])
def test_frames_taken_by_seeking_are_the_decoded_frames_at_the_sampled_indices(tmp_path, fmt, n, fps):
    """InternVL's 8 frames of a 20 s clip are 2.5 s apart, so each is found by a seek. An MPEG-TS
    seek stops at a packet before the time but the decoder starts at the next keyframe: every frame
    taken was the keyframe after the sampled one (60, 120, 210 ... for 37, 112, 187 ...), and past
    the last keyframe there was none (``corrupt_video``, the row dropped at pack time)."""
    import av

    from packtool.media import counted_frames
    from packtool.vision.internvl import internvl_frame_indices

    path = write_video(tmp_path / "clip.bin", n, fps, fmt=fmt, step=1)
    with av.open(str(path)) as c:  # the truth: every frame a full decode gives
        decoded = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    lay = get_family("internvl").video(probe_video(path))
    times = list(lay.timestamps)
    assert min(b - a for a, b in zip(times, times[1:], strict=False)) >= 2.0  # sparse: a seek per time
    got = counted_frames(path, {"timestamps": times})
    idx = internvl_frame_indices(n, 8)
    assert [np.array_equal(np.asarray(img.convert("RGB")), decoded[i]) for img, i in zip(got, idx, strict=True)] \
        == [True] * 8


def test_a_seek_to_the_start_of_a_transport_stream_with_b_frames_takes_the_first_frames(tmp_path):
    """An MPEG-TS seek goes by decode time and packet position: in an H.264 stream with B-frames
    the seek to the first frame's time lands on a packet after the first keyframe, and the decoder
    starts at the next one, so the times of a sparse request before the keyframe at 4 s, 0 s among
    them, took that keyframe. They are the frames a full decode shows at those times."""
    from packtool.media import counted_frames

    path = write_noise_video(tmp_path / "bf.ts", 100, 10, fmt="mpegts",
                             options={"preset": "superfast", "bf": "3", "g": "40", "sc_threshold": "0"})
    times, images, eps = _every_frame(path)
    for picks in ([0.0, 2.5, 5.0, 7.5], [1.2, 3.3, 9.9], [0.0, 14.9], [0.35, 6.0]):  # 2 s or more apart: a seek per time
        got = [img.tobytes() for img in counted_frames(path, {"timestamps": picks})]
        assert [images.index(g) if g in images else None for g in got] == [_on_screen(times, t, eps) for t in picks], \
            picks


# --------------------------------------------------------------------------- frames the decoder skips

#: name -> (PyAV format, codec, encoder options, variable rate): 100 frames at 10 fps, a keyframe
#: at least every 4 s (so a seek lands mid-GOP and decodes forward), B-frames where the codec has them
SKIP_CLIPS = {
    "x264.mp4": ("mp4", "libx264", {"preset": "superfast", "bf": "3", "g": "40", "sc_threshold": "0"},
                 False),  # no scene cuts: keyframes at 0, 4 and 8 s
    "x264.mkv": ("matroska", "libx264", {"preset": "superfast", "bf": "3", "g": "40"}, False),
    "x264-flat.mp4": ("mp4", "libx264", {"preset": "superfast", "bf": "2", "g": "40",
                                         "x264-params": "b-pyramid=none"}, False),
    "x264-vfr.mp4": ("mp4", "libx264", {"preset": "superfast", "bf": "3", "g": "40"}, True),
    "x264-vfr.mkv": ("matroska", "libx264", {"preset": "superfast", "bf": "3", "g": "40"}, True),
    "mpeg4.mp4": ("mp4", "mpeg4", {"bf": "2", "g": "40"}, False),
    "mpeg4.mkv": ("matroska", "mpeg4", {"bf": "2", "g": "40"}, False),
    "x265.mp4": ("mp4", "libx265", {"preset": "ultrafast", "x265-params": "bframes=3:keyint=40:log-level=error"}, False),
    "x265.mkv": ("matroska", "libx265", {"preset": "ultrafast", "x265-params": "bframes=3:keyint=40:log-level=error"},
                 False),
    "vp9.webm": ("webm", "libvpx-vp9", {"deadline": "realtime", "cpu-used": "8", "g": "40"}, False),
    # an open GOP: the keyframe at 4 s is followed in decode order by frames shown at 3.8 and 3.9 s
    # that refer to the GOP before, which a decode from that keyframe (an MP4 seek to 3.9 s) drops
    "x264-open.mp4": ("mp4", "libx264", {"preset": "superfast", "bf": "3", "g": "40", "sc_threshold": "0",
                                         "x264-params": "open-gop=1"}, False),
    "x264-deep.mov": ("mov", "libx264", {"preset": "superfast", "bf": "8", "g": "40",
                                         "x264-params": "b-pyramid=normal:b-adapt=0"}, False),  # 8 B-frames in a row
    # keyframes that are P-frames refreshing a column at a time: a decode from one puts out frames only
    # once the refresh is through, so the plan of a seek that lands on one does not hold
    "x264-refresh.mp4": ("mp4", "libx264", {"preset": "superfast", "bf": "3", "g": "30",
                                            "x264-params": "intra-refresh=1"}, False),
    "mpeg2.mp4": ("mp4", "mpeg2video", {"bf": "2", "g": "30"}, False),  # open GOPs
    "x264-noedit.mp4": ("mp4", "libx264", {"preset": "superfast", "bf": "3", "g": "40"}, False),
    "x264-frag.mp4": ("mp4", "libx264", {"preset": "superfast", "bf": "3", "g": "40"}, False),
}
#: muxer options of some :data:`SKIP_CLIPS`: no edit list (the first frame is shown at 0.2 s, after
#: the B-frame delay), and a fragmented MP4 (a moof box per keyframe, no index in the moov box)
SKIP_MUXER_OPTIONS = {"x264-noedit.mp4": {"use_editlist": "0"}, "x264-frag.mp4": {"movflags": "frag_keyframe+empty_moov"}}


def _every_frame(path) -> tuple[list[float], list[bytes], float]:
    """The truth: ``(times, images, eps)`` of every frame a full decode gives, times from the first
    frame, images as RGB bytes, and the tick within which a frame is at a time."""
    import av

    with av.open(str(path)) as c:
        stream = c.streams.video[0]
        tb = float(stream.time_base)
        frames = [(f.pts * tb, f.to_image().tobytes()) for f in c.decode(stream)]
    return [t - frames[0][0] for t, _ in frames], [img for _, img in frames], max(1e-6, min(tb, 1e-3))


def _on_screen(times: list[float], at: float, eps: float) -> int:
    """Index of the frame on screen ``at`` seconds after the first: the last shown at or before it
    (within ``eps``), the first for a time before it."""
    return max([i for i, t in enumerate(times) if t <= at + eps] or [0])


@pytest.fixture(scope="module")
def skip_clips(tmp_path_factory):
    """Each :data:`SKIP_CLIPS` clip this PyAV build encodes, with its truth (:func:`_every_frame`)."""
    import av

    d = tmp_path_factory.mktemp("skip")
    vfr = np.cumsum(np.random.default_rng(3).integers(20, 250, 100)).tolist()
    out = {}
    for name, (fmt, codec, options, variable) in SKIP_CLIPS.items():
        if codec not in av.codecs_available:
            continue
        write_noise_video(d / name, 100, 10, fmt=fmt, codec=codec, options=options, pts=vfr if variable else None,
                          container_options=SKIP_MUXER_OPTIONS.get(name))
        out[name] = _every_frame(d / name)
    _cut_without_reencoding(d / "x264.mp4", d / "x264-cut.mp4", 5000)  # an edit list hides the first 5 frames
    _cut_without_reencoding(d / "x264.mp4", d / "x264-late.mp4", -25000)  # and one that starts it 2.44 s late
    for name in ("x264-cut.mp4", "x264-late.mp4"):
        out[name] = _every_frame(d / name)
    return d, out


def _time_lists(rng, times: list[float]) -> list[list[float]]:
    """Dense and sparse (2 s or more apart on average: a seek per time) lists of times to take
    frames at: random times, frame times and times a hair either side of them, repeats, times past
    the end, in any order."""
    end = times[-1]
    lists = []
    for _ in range(6):
        n = int(rng.integers(5, 30))
        picks = rng.uniform(0, end + 1.5, n).tolist()
        frame_times = [times[int(i)] for i in rng.integers(0, len(times), 4)]
        picks += frame_times + [t + float(rng.choice([-2e-3, -1e-7, 1e-7, 2e-3])) for t in frame_times]
        picks += [picks[int(i)] for i in rng.integers(0, len(picks), 3)]  # repeats
        lists.append([max(0.0, t) for t in rng.permutation(picks).tolist()])
    for _ in range(6):
        start = float(rng.uniform(0, 2))
        picks = (start + np.cumsum(rng.uniform(2.0, 4.5, int(rng.integers(2, 6))))).tolist()
        picks += [picks[-1]] if rng.random() < 0.3 else []  # a repeat (still 2 s apart on average)
        lists.append(rng.permutation([start] + picks).tolist())
    return lists


def _assert_frames_of_a_full_decode(d: Path, truth: dict, name: str) -> None:
    """``counted_frames`` of clip ``name`` (in ``d``) at seeded random dense and sparse lists of
    times are, pixel for pixel, the frames of its full decode (``truth[name]``: frame times, images,
    eps) on screen at those times; the seed is printed on a failure."""
    from packtool.media import counted_frames

    if name not in truth:
        pytest.skip("codec not in this PyAV build")
    times, images, eps = truth[name]
    seed = sum(map(ord, name))
    for picks in _time_lists(np.random.default_rng(seed), times):
        got = [img.tobytes() for img in counted_frames(d / name, {"timestamps": picks})]
        want = [images[_on_screen(times, t, eps)] for t in picks]
        assert got == want, f"seed {seed}, times {picks}: frames " \
                            f"{[images.index(g) if g in images else None for g in got]} for " \
                            f"{[_on_screen(times, t, eps) for t in picks]}"


@pytest.mark.parametrize("name", [*SKIP_CLIPS, "x264-cut.mp4", "x264-late.mp4"])
def test_frames_are_those_of_a_full_decode_whether_or_not_frames_are_skipped(skip_clips, name):
    """For every codec and container (B-frames in MP4 and Matroska, variable rate, an edit list
    hiding frames, codecs the decoder skips no frame of), the frames taken at random dense and
    sparse lists of times are, pixel for pixel, the frames of a full decode on screen at those
    times: skipping frames the requests do not take changes none of the frames taken."""
    _assert_frames_of_a_full_decode(*skip_clips, name)


def _counting_skips(monkeypatch) -> dict:
    """Counts, through ``packtool.media._frames_skipping``, the decodes that skip frames, the frames
    they put out, and those that gave up their plan."""
    import packtool.media as media

    seen = {"runs": 0, "frames": 0, "broken": 0}
    skipping = media._frames_skipping

    def counted(*args, **kwargs):
        seen["runs"] += 1
        try:
            for frame in skipping(*args, **kwargs):
                seen["frames"] += 1
                yield frame
        except media._PlanBroken:
            seen["broken"] += 1
            raise

    monkeypatch.setattr(media, "_frames_skipping", counted)
    return seen


@pytest.mark.parametrize("name", ["x264.mp4", "x264.mkv", "x265.mp4", "mpeg4.mp4"])
def test_the_decoder_skips_the_frames_no_time_takes(skip_clips, monkeypatch, name):
    """A dense request (one linear decode) and, in an MP4, a sparse one (a seek per time) of a clip
    with B-frames put out fewer frames than a plain linear decode does up to the last frame taken:
    the non-reference frames between the frames taken are not decoded, and a time whose seek lands
    where the previous time's did is read on from that decode (1.5 s and 3.8 s share the keyframe at
    0 of ``x264.mp4``), where each seek decoded from its keyframe again. The plans hold throughout."""
    from packtool.media import counted_frames

    d, truth = skip_clips
    if name not in truth:
        pytest.skip("codec not in this PyAV build")
    times, images, eps = truth[name]
    seen = _counting_skips(monkeypatch)
    for picks in ([0.0, 1.5, 3.0, 4.5, 6.0, 7.5], [1.5, 3.8, 5.0, 8.5]):  # 1.5 s apart; 2.3 s apart: a seek per time
        sparse = picks[1] - picks[0] > 2
        if sparse and not name.endswith(".mp4"):
            continue
        seen.update(runs=0, frames=0, broken=0)
        assert [img.tobytes() for img in counted_frames(d / name, {"timestamps": picks})] == \
               [images[_on_screen(times, t, eps)] for t in picks]
        linear = _on_screen(times, picks[-1], eps) + 2  # frames put out up to the one after the last taken
        assert seen["broken"] == 0 and seen["frames"] < 0.65 * linear, (picks, seen, linear)
        if not sparse:
            assert seen["runs"] == 1
        elif name == "x264.mp4":  # keyframes at 0, 4 and 8 s: four times, three seeks decoded from
            assert seen["runs"] == 3, seen


@pytest.mark.parametrize(("name", "holds"), [("x264-open.mp4", True), ("x264-refresh.mp4", False)])
def test_frames_a_seek_to_a_keyframe_cannot_rebuild_are_those_of_a_full_decode(skip_clips, monkeypatch, name, holds):
    """Times on frames that a decode from the keyframe a seek lands on does not put out: the frames
    shown at 3.8 and 3.9 s of an open GOP whose keyframe is at 4 s (they refer to the GOP before),
    and the frames after an intra-refresh keyframe (at 3 and 6.2 s) until its refresh is through.
    Each is the frame a full decode shows: the seek is retried from further back, and where the
    skipping decode meets frames it was not told of (the refresh), every frame is decoded."""
    from packtool.media import counted_frames

    d, truth = skip_clips
    times, images, eps = truth[name]
    seen = _counting_skips(monkeypatch)
    for picks in ([0.0, 3.8, 7.9], [3.9, 6.0], [1.5, 3.9 + 1e-7, 8.0], [3.1, 6.3, 9.0], [3.0 - 1e-7, 6.2, 9.5]):
        got = [img.tobytes() for img in counted_frames(d / name, {"timestamps": picks})]
        assert got == [images[_on_screen(times, t, eps)] for t in picks], \
            (picks, [images.index(g) if g in images else None for g in got])
    assert seen["runs"] > 0 and (seen["broken"] == 0) == holds, seen


@pytest.mark.parametrize("fmt", ["mp4", "matroska"])
def test_frames_of_clips_of_one_to_three_frames_are_those_of_a_full_decode(tmp_path, fmt):
    """Clips of 1, 2 and 3 frames coded with B-frames allowed: times on, between and past their
    frames, repeated and out of order, dense and sparse, take the frames a full decode shows."""
    from packtool.media import counted_frames

    for n in (1, 2, 3):
        path = write_noise_video(tmp_path / f"c{n}.{fmt}", n, 10, fmt=fmt, options={"preset": "superfast", "bf": "3"})
        times, images, eps = _every_frame(path)
        assert len(images) == n
        for picks in ([0.0], [0.0, 0.05, 0.1, 0.15, 0.2, 0.25], [5.0, 0.0, 5.0], [0.2, 0.1 - 1e-7, 0.1 + 1e-7],
                      [0.0, 2.5, 5.0], [0.1, 0.1, 0.1]):
            got = [img.tobytes() for img in counted_frames(path, {"timestamps": picks})]
            assert got == [images[_on_screen(times, t, eps)] for t in picks], (n, picks)


def test_frames_of_a_matroska_clip_whose_frame_times_collide_are_those_of_a_full_decode(tmp_path, monkeypatch):
    """Frames 1/90,000 s apart keep their order in an MP4 but share a time on Matroska's millisecond
    clock; the skipping decode, which tells frames apart by their times, gives way to a decode of
    every frame, and each time takes the later of two frames at one time, as a full decode does."""
    from packtool.media import counted_frames

    rng = np.random.default_rng(7)
    gaps = rng.integers(1, 27000, 60)
    gaps[::7] = 1  # every 7th frame one tick after the one before
    pts = np.cumsum(gaps).tolist()
    seen = _counting_skips(monkeypatch)
    for fmt in ("mp4", "matroska"):
        path = write_noise_video(tmp_path / f"close.{fmt}", 60, 10, fmt=fmt, pts=pts, time_base=Fraction(1, 90000),
                                 options={"preset": "superfast", "bf": "3", "g": "20"})
        times, images, eps = _every_frame(path)
        assert len(images) == 60
        seen.update(broken=0)
        for picks in _time_lists(np.random.default_rng(11), times):
            got = [img.tobytes() for img in counted_frames(path, {"timestamps": picks})]
            assert got == [images[_on_screen(times, t, eps)] for t in picks], (fmt, picks)
        assert (seen["broken"] > 0) == (fmt == "matroska"), (fmt, seen)


def test_a_plan_that_does_not_hold_decodes_every_frame(skip_clips, monkeypatch):
    """When the skipping decode meets a stream its plan does not cover (here: told the decoder holds
    no reordered frame, so the first B-frame breaks it), the frames come from a fresh plain decode,
    the same frames, on the dense and the sparse path."""
    import packtool.media as media

    d, truth = skip_clips
    times, images, eps = truth["x264.mp4"]
    seen = _counting_skips(monkeypatch)
    monkeypatch.setattr(media, "_skip_depth", lambda *a, **k: 0)
    for picks in ([0.0, 0.45, 3.3, 3.3, 5.0, 12.0], [0.5, 4.5, 8.25]):  # dense, then sparse
        seen.update(broken=0)
        assert [img.tobytes() for img in media.counted_frames(d / "x264.mp4", {"timestamps": picks})] == \
               [images[_on_screen(times, t, eps)] for t in picks]
        assert seen["broken"] == 1


# --------------------------------------------------------------------------- ASF with B-frames

#: name -> (codec, encoder options): 60 frames at 10 fps in ASF, with B-frames, a keyframe every 2 s
ASF_CLIPS = {
    "x264.asf": ("libx264", {"preset": "superfast", "bf": "3", "g": "20", "sc_threshold": "0"}),
    "x264-flat.wmv": ("libx264", {"preset": "superfast", "bf": "2", "g": "20", "x264-params": "b-pyramid=none"}),
    "mpeg2.wmv": ("mpeg2video", {"bf": "2", "g": "20"}),
    "mpeg4.asf": ("mpeg4", {"bf": "2", "g": "20"}),
}


def _every_frame_by_position(path) -> tuple[list[float], list[bytes], float]:
    """The truth for a file whose frame times FFmpeg makes up in decode order: ``(times, images,
    eps)`` of :func:`_every_frame`, the n-th frame a full decode gives (in display order) shown at
    the n-th packet time (sorted), not at its own time."""
    import av

    with av.open(str(path)) as c:
        stream = c.streams.video[0]
        tb = float(stream.time_base)
        shown = sorted(p.pts * tb for p in c.demux(stream) if p.size)
    with av.open(str(path)) as c:
        images = [f.to_image().tobytes() for f in c.decode(video=0)]
    assert len(images) == len(shown)
    return [t - shown[0] for t in shown], images, max(1e-6, min(tb, 1e-3))


@pytest.fixture(scope="module")
def asf_clips(tmp_path_factory):
    """Each :data:`ASF_CLIPS` clip this PyAV build encodes, with its truth (:func:`_every_frame_by_position`)."""
    import av

    d = tmp_path_factory.mktemp("asf")
    out = {}
    for name, (codec, options) in ASF_CLIPS.items():
        if codec not in av.codecs_available:
            continue
        write_noise_video(d / name, 60, 10, fmt="asf", codec=codec, options=options)
        with av.open(str(d / name)) as c:
            assert c.streams.video[0].codec_context.has_b_frames
        out[name] = _every_frame_by_position(d / name)
    return d, out


@pytest.mark.parametrize("name", ASF_CLIPS)
def test_frames_of_an_asf_with_b_frames_are_those_of_a_full_decode_by_position(asf_clips, name):
    """FFmpeg gives the frames of an ASF (WMV) file with B-frames times made up in decode order, as
    in an AVI (H.264 and MPEG-2 frames leave the decoder in display order with times out of order,
    some H.264 frames with none): taken by their own times, each random list of times of the H.264
    and MPEG-2 clips took some wrong frames. The n-th frame decoded is the one shown at the n-th
    packet time, so the frames taken at random dense and sparse lists of times are, pixel for
    pixel, those of a full decode picked by that rule."""
    _assert_frames_of_a_full_decode(*asf_clips, name)


@pytest.mark.parametrize("name", ["x264.asf", "mpeg2.wmv"])
def test_frames_at_the_times_probed_from_an_asf_with_b_frames_are_the_counted_frames(asf_clips, name):
    """What probe_video counts of an ASF file with B-frames (frames, their times) is what a full
    decode gives, and the frames extracted at each family's timestamps are the frames on screen at
    those times by that count."""
    from packtool.media import counted_frames

    d, truth = asf_clips
    if name not in truth:
        pytest.skip("codec not in this PyAV build")
    times, images, eps = truth[name]
    meta = probe_video(d / name)
    probed = list(meta.frame_times) or [i / meta.fps for i in range(meta.n_frames)]
    assert meta.n_frames == len(images) and probed == pytest.approx(times, abs=eps)
    for family in ("qwen2.5-vl", "molmo2", "internvl"):
        picks = list(get_family(family).video(meta).timestamps)
        got = [img.tobytes() for img in counted_frames(d / name, {"timestamps": picks})]
        assert got == [images[_on_screen(probed, t, eps)] for t in picks], (family, picks)


# --------------------------------------------------------------------------- MPEG program and transport streams

#: name -> (PyAV format, codec, encoder options): 60 frames at 10 fps, a keyframe every 2 s (4 s for H.264)
MPEG_CLIPS = {
    "x264.mpg": ("mpeg", "libx264", {"preset": "superfast", "bf": "3", "g": "40", "sc_threshold": "0"}),
    "x264-nob.mpg": ("mpeg", "libx264", {"preset": "superfast", "bf": "0", "g": "40"}),
    "mpeg4.mpg": ("mpeg", "mpeg4", {"bf": "2", "g": "20"}),
    "mpeg4.ts": ("mpegts", "mpeg4", {"bf": "2", "g": "20"}),
}


@pytest.fixture(scope="module")
def mpeg_clips(tmp_path_factory):
    """Each :data:`MPEG_CLIPS` clip this PyAV build encodes, with ``(times, images, eps)``: every frame
    of a full decode (display order) at the time probe_video counts it at (its frame times, else
    ``i / fps``)."""
    import av

    d = tmp_path_factory.mktemp("mpeg")
    out = {}
    for name, (fmt, codec, options) in MPEG_CLIPS.items():
        if codec not in av.codecs_available:
            continue
        write_noise_video(d / name, 60, 10, fmt=fmt, codec=codec, options=options)
        with av.open(str(d / name)) as c:
            stream = c.streams.video[0]
            frames = [(f.pts, f.to_image().tobytes()) for f in c.decode(stream)]
            tb = float(stream.time_base)
        meta = probe_video(d / name)
        probed = list(meta.frame_times) or [i / meta.fps for i in range(meta.n_frames)]
        assert meta.n_frames == len(frames) == 60
        own = [p for p, _ in frames if p is not None]
        assert own == sorted(own)  # the decoder puts frames out in display order
        out[name] = probed, [img for _, img in frames], max(1e-6, min(tb, 1e-3))
    return d, out


@pytest.mark.parametrize("name", MPEG_CLIPS)
def test_frames_of_mpeg_program_and_transport_streams_are_those_of_a_full_decode(mpeg_clips, name):
    """In MPEG-PS most H.264 frames carry no time (they were left out: frames 0, 9, 20 ... for 0, 10,
    20 ...), and an MPEG-PS or MPEG-TS seek lands on any packet, from which the MPEG-4 Part 2 decoder
    rebuilds frames that appear nowhere in a full decode. These files are read in one pass (a
    transport stream still seeks where its decoder waits for a keyframe), frame n at the time
    probe_video counted it at: the frames taken at random dense and sparse lists of times are, pixel
    for pixel, those of a full decode."""
    _assert_frames_of_a_full_decode(*mpeg_clips, name)


def _with_zeroed_frames(src: Path, dst: Path) -> Path:
    """``src`` (an MP4) with its ``mdat`` payload zeroed: every header as it was, so tokenize
    counts it, but no frame decodes."""
    data = bytearray(src.read_bytes())
    at = 0
    while at + 8 <= len(data):
        n = int.from_bytes(data[at:at + 4], "big")
        if data[at + 4:at + 8] == b"mdat":
            data[at + 8:at + n] = bytes(n - 8)
        at += n
    dst.write_bytes(bytes(data))
    return dst


def _video_records(path: Path, videos: dict[str, str]) -> Path:
    """A JSONL file of one-question records, ``{id: video file stem}``, each asking about its video."""
    path.write_text("".join(json.dumps({"id": i, "video": f"{n}.mp4", "conversations": [
        {"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": "It fades."}]}) + "\n"
        for i, n in videos.items()))
    return path


def _calls(monkeypatch, module, name: str) -> list:
    """A list that gets one entry per call of ``module.name`` from now on (the function still runs)."""
    calls: list = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: (calls.append(1), real(*a))[1])
    return calls


def test_a_video_whose_frames_do_not_decode_is_a_rejected_row_not_a_stopped_pack(tmp_path, monkeypatch):
    """Tokenize reads a video's headers only, so a video whose frame data is damaged is found when
    pack decodes it. That stopped the whole pack (every run of the dataset, until the rows were
    found and dropped by hand). Its sample is now a ``corrupt_video`` row in errors.jsonl and the
    shard is packed again without it, and without every other such video of the shard, found
    in one look (two attempts, however many there are): the shards are byte for byte those of a
    run that rejected the samples before planning, on one worker or two."""
    import packtool.pipeline as pipeline
    from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset
    from packtool.validate import validate_dir

    media = tmp_path / "media"
    media.mkdir()
    for i in range(5):
        write_video(media / f"v{i}.mp4", n_frames=12 + 6 * i, fps=6, step=20)
    base = write_video(tmp_path / "base.mp4", n_frames=24, fps=6)
    for bad in ("zeroed", "zeroed2"):
        _with_zeroed_frames(base, media / f"{bad}.mp4")
    names = ["v0", "v1", "zeroed", "v2", "zeroed2", "v3", "v4"]
    bad_names = {"zeroed", "zeroed2"}
    data = _video_records(tmp_path / "data.jsonl", {n: n for n in names})
    tok = tmp_path / "tok"
    tokenize_dataset([data], tok, TokenizeConfig(media_root=str(media)), workers=1, progress=None)
    cfg = PackConfig(max_tokens=2048)
    attempts = _calls(monkeypatch, pipeline, "_pack_shard_once")
    runs = {}
    for workers in (1, 2):
        out = tmp_path / f"packed-{workers}"
        seen: list[int] = []
        m = pack_dataset(tok, out, cfg, workers=workers, progress=seen.append)
        assert (m["counts"]["samples_packed"], m["counts"]["rejected_by_reason"]) == (5, {"corrupt_video": 2})
        assert sum(seen) == len(names)  # the attempt packed again reports no row twice
        errors = [json.loads(x) for x in (out / ".packtool" / "errors.jsonl").read_text().splitlines()]
        assert {(e["sample_id"], e["reason"]) for e in errors} == {(n, "corrupt_video") for n in bad_names}
        assert all(e["message"].startswith(f"video '{e['sample_id']}.mp4' has frames that do not decode (")
                   for e in errors)
        assert validate_dir(out)["ok"]
        runs[workers] = {f.name: f.read_bytes() for f in sorted(out.glob("part-*.parquet"))}
    # one task (one tokenized shard) runs in process whatever the workers: per run, the failed
    # attempt and the one that packed (one more per bad video before the shard was looked at once)
    assert len(attempts) == 4
    # packs assembled one at a time: the packs before the video's were reported by the first attempt
    monkeypatch.setattr(pipeline, "PACK_CHUNK", 1)
    seen = []
    pack_dataset(tok, tmp_path / "one-by-one", cfg, workers=1, progress=seen.append)
    assert sum(seen) == len(names), seen  # an attempt that reported its packs, then re-packed: more before
    packed_ids = [i for f in sorted((tmp_path / "packed-1").glob("part-*.parquet"))
                  for r in pq.read_table(f, columns=["sample_ids"]).column("sample_ids").to_pylist() for i in r]
    assert sorted(packed_ids) == sorted(n for n in names if n not in bad_names)
    # the same shards as a run that knew before planning: the rows rejected by the check that runs then
    real = pipeline._media_problems

    def known(media_col, root, check_mtime):
        return {**real(media_col, root, check_mtime),
                **{names.index(n): ("media_changed", "known before planning") for n in bad_names}}

    monkeypatch.setattr(pipeline, "_media_problems", known)
    pack_dataset(tok, tmp_path / "known", cfg, workers=1, progress=None)
    assert {f.name: f.read_bytes() for f in sorted((tmp_path / "known").glob("part-*.parquet"))} == runs[1] == runs[2]


def test_a_mixture_rejects_every_copy_of_a_sample_whose_video_does_not_decode(tmp_path, monkeypatch):
    """The same in a mixture: a sample with a video whose frames do not decode used to stop the
    whole mixture pack. Each copy of it (``--rates 2`` takes every sample twice) is now a
    ``corrupt_video`` row named with its copy's id, the task is packed again without them
    (two attempts however many there are), and the packs are those of a run that rejected the
    samples before planning, on one worker or two."""
    import packtool.pipeline as pipeline
    from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset
    from packtool.mixture import Mixture
    from packtool.validate import validate_dir

    media = tmp_path / "media"
    media.mkdir()
    for i in range(4):
        write_video(media / f"v{i}.mp4", n_frames=12 + 6 * i, fps=6, step=20)
    _with_zeroed_frames(write_video(tmp_path / "base.mp4", n_frames=24, fps=6), media / "zeroed.mp4")
    toks = []
    for name, ids in (("a", ["v0", "zeroed", "v1"]), ("b", ["v2", "v3"])):
        data = _video_records(tmp_path / f"{name}.jsonl", {f"{name}-{n}": n for n in ids})
        toks.append(tmp_path / f"tok-{name}")
        tokenize_dataset([data], toks[-1], TokenizeConfig(media_root=str(media)), workers=1, progress=None)
    cfg = PackConfig(max_tokens=2048)
    attempts = _calls(monkeypatch, pipeline, "_mix_shards")
    runs = {}
    for workers in (1, 2):
        out = tmp_path / f"mixed-{workers}"
        seen: list[int] = []
        m = pack_dataset(Mixture.from_rates(toks, "2,1"), out, cfg, workers=workers, progress=seen.append)
        assert (m["counts"]["samples_packed"], m["counts"]["rejected_by_reason"]) == (6, {"corrupt_video": 2})
        assert sum(seen) == 8  # the attempt packed again reports no row twice
        errors = [json.loads(x) for x in (out / ".packtool" / "errors.jsonl").read_text().splitlines()]
        assert sorted(e["sample_id"] for e in errors) == ["a-zeroed", "a-zeroed#c1"]
        assert all(e["reason"] == "corrupt_video" and "video 'zeroed.mp4' has frames that do not decode (" in e["message"]
                   for e in errors)
        assert validate_dir(out)["ok"]
        runs[workers] = {f.name: f.read_bytes() for f in sorted(out.glob("part-*.parquet"))}
        packed = sorted(i for f in sorted(out.glob("part-*.parquet"))
                        for r in pq.read_table(f, columns=["sample_ids"]).column("sample_ids").to_pylist() for i in r)
        assert packed == sorted(["a-v0", "a-v0#c1", "a-v1", "a-v1#c1", "b-v2", "b-v3"])
    assert len(attempts) == 4  # per run: the attempt that met the video, then the one that packed
    real = pipeline._media_problems

    def known(media_col, root, check_mtime):  # the bad video's row, known before planning
        rows = [r for r, items in enumerate(media_col.to_pylist()) if items and items[0]["path"] == "zeroed.mp4"]
        return {**real(media_col, root, check_mtime), **{r: ("media_changed", "known before planning") for r in rows}}

    monkeypatch.setattr(pipeline, "_media_problems", known)
    pack_dataset(Mixture.from_rates(toks, "2,1"), tmp_path / "known", cfg, workers=1, progress=None)
    assert {f.name: f.read_bytes() for f in sorted((tmp_path / "known").glob("part-*.parquet"))} == runs[1] == runs[2]


def _size_change(path: Path) -> Path:
    """An MPEG-TS file whose frame size changes mid-stream (64x48 for 1 s, then 96x64 for 1 s), as
    two captures joined, or a recording whose encoder adapted its resolution, give."""
    first = write_video(path.with_suffix(".a.ts"), 10, fps=10, size=(64, 48), fmt="mpegts",
                        pts=[100 * i for i in range(10)])
    second = write_video(path.with_suffix(".b.ts"), 10, fps=10, size=(96, 64), fmt="mpegts",
                         pts=[1000 + 100 * i for i in range(10)])
    path.write_bytes(first.read_bytes() + second.read_bytes())
    return path


@pytest.mark.parametrize("family", ["qwen2.5-vl", "molmo2", "llava-ov"])
def test_a_video_whose_frame_size_changes_is_a_rejected_row_not_a_crash_in_training(tmp_path, family):
    """Tokenize counts a video at the size its headers give. A stream whose size changes mid-way
    was counted and packed, and every family's reader then failed in the training loop with a bare
    ``stack expects each tensor to be equal size``: the frames taken must all have one size, else
    the row is ``corrupt_video`` at pack (and, packed by reference, a named error in the reader)."""
    from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset
    from packtool.errors import InputError
    from packtool.media import counted_frames
    from packtool.reader import decode_video

    media = tmp_path / "media"
    media.mkdir()
    _size_change(media / "joined.ts")
    write_video(media / "fine.mp4", 20, fps=10)
    meta = probe_video(media / "joined.ts")
    lay = get_family(family).video(meta)
    item = {"kind": "video", "path": "joined.ts", "width": meta.width, "height": meta.height,
            "timestamps": list(lay.timestamps)}
    with pytest.raises(SampleError, match=r"frame size changes mid-stream \(64x48 at 0 s, 96x64 at 1(\.\d+)? s\)"):
        counted_frames(media / "joined.ts", item)
    with pytest.raises(InputError, match="frame size changes mid-stream"):
        decode_video(item, media)  # packed by reference
    records = tmp_path / "data.jsonl"
    records.write_text("".join(json.dumps({"id": i, "video": v, "conversations": [
        {"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": "It fades."}]}) + "\n"
        for i, v in (("joined", "joined.ts"), ("fine", "fine.mp4"))))
    tokenize_dataset([records], tmp_path / "tok", TokenizeConfig(media_root=str(media)), workers=1, progress=None)
    m = pack_dataset(tmp_path / "tok", tmp_path / "packed", PackConfig(max_tokens=4096), workers=1, progress=None)
    assert (m["counts"]["samples_packed"], m["counts"]["rejected_by_reason"]) == (1, {"corrupt_video": 1})
    error = json.loads((tmp_path / "packed" / ".packtool" / "errors.jsonl").read_text())
    assert error["sample_id"] == "joined" and "frame size changes mid-stream" in error["message"]


def test_embedded_frames_of_two_sizes_are_a_named_error():
    """A pack made before the check above holds such a video's frames at two sizes: the reader names
    the video and the fix instead of the processor's shape error."""
    import io

    from PIL import Image

    from packtool.errors import InputError
    from packtool.reader import decode_video

    def jpeg(w, h):
        buf = io.BytesIO()
        Image.new("RGB", (w, h)).save(buf, format="JPEG")
        return buf.getvalue()

    item = {"kind": "video", "path": "joined.ts", "frames": [jpeg(64, 48), jpeg(96, 64)], "timestamps": [0.0, 1.0]}
    with pytest.raises(InputError, match=r"'joined.ts' has embedded frames of 2 sizes \(64x48, 96x64\)"):
        decode_video(item)
    assert [f.size for f in decode_video({**item, "frames": [jpeg(64, 48)] * 2}).frames] == [(64, 48)] * 2


def _marked_video(path: Path, size: tuple[int, int], rotation: int) -> Path:
    """Six black frames with a white block in the top-left corner of the coded picture, and a
    display rotation of ``rotation`` degrees (as a phone held upside down or upright records)."""
    import av

    w, h = size
    with av.open(str(path), "w", format="mp4") as out:
        st = out.add_stream("libx264", rate=10)
        st.width, st.height, st.pix_fmt = w, h, "yuv420p"
        st.options = {"preset": "ultrafast"}
        st.set_display_rotation(rotation)
        for _ in range(6):
            img = np.zeros((h, w, 3), np.uint8)
            img[: h // 4, : w // 4] = 255
            for p in st.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(p)
        for p in st.encode():
            out.mux(p)
    return path


def _white_corner(img) -> str:
    a = np.asarray(img.convert("L"), dtype=float)
    h, w = a.shape
    corners = {"top-left": a[: h // 4, : w // 4], "top-right": a[: h // 4, -(w // 4):],
               "bottom-left": a[-(h // 4):, : w // 4], "bottom-right": a[-(h // 4):, -(w // 4):]}
    return max(corners, key=lambda k: corners[k].mean())


# (coded size, display rotation) -> where the coded top-left corner is shown
_SHOWN = {((64, 48), 90): "bottom-left", ((64, 48), 180): "bottom-right", ((48, 48), 90): "bottom-left",
          ((48, 48), 270): "top-right"}


@pytest.mark.parametrize("size,rotation", list(_SHOWN))
def test_frames_of_a_video_counted_with_its_rotation_are_turned_by_it(tmp_path, size, rotation):
    """With ``--exif apply`` (Molmo2's default) a video's frames are fed as displayed. The turn was
    guessed from the recorded size (width and height the coded ones swapped), so a half turn and
    any turn of a square video were fed as coded, unlike a quarter turn of any other video: the
    turn is now the one tokenize applied, told by the family's setting, in pack and the reader."""
    from packtool.media import counted_frames

    path = _marked_video(tmp_path / "v.mp4", size, rotation)
    items = {}
    for exif, want in (("apply", _SHOWN[(size, rotation)]), ("ignore", "top-left")):
        meta = probe_video(path, apply_rotation=exif == "apply")
        assert meta.rotation == rotation
        lay = get_family("molmo2", exif=exif).video(meta)
        items[exif] = {"kind": "video", "path": "v.mp4", "width": meta.width, "height": meta.height,
                       "timestamps": list(lay.timestamps)}
        frames = counted_frames(path, items[exif], rotate=exif == "apply")
        assert {_white_corner(f) for f in frames} == {want}, exif
        assert {f.size for f in frames} == {(meta.width, meta.height)}
    # a caller that does not know the setting: the guess from the size, right for a quarter turn of
    # a video that is not square only
    guessed = _white_corner(counted_frames(path, items["apply"])[0])
    assert guessed == (_SHOWN[(size, rotation)] if size[0] != size[1] and rotation != 180 else "top-left")


@pytest.mark.parametrize("media_mode", ["embed", "reference"])
def test_pack_and_the_reader_turn_a_half_turned_video_as_tokenize_counted_it(tmp_path, media_mode):
    """The setting reaches the frames through the manifests: pack embeds, and the reader decodes by
    reference, a 180-degree video turned under ``--exif apply`` and as coded under ``ignore``."""
    from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset
    from packtool.reader import PackedDataset, decode_media

    media = tmp_path / "media"
    media.mkdir()
    _marked_video(media / "upside.mp4", (64, 48), 180)
    records = tmp_path / "data.jsonl"
    records.write_text(json.dumps({"id": "u", "video": "upside.mp4", "conversations": [
        {"from": "human", "value": "<video>\nWhat is shown?"}, {"from": "gpt", "value": "A block."}]}) + "\n")
    for exif, want in (("apply", "bottom-right"), ("ignore", "top-left")):
        tok, out = tmp_path / f"tok-{exif}", tmp_path / f"packed-{exif}"
        tokenize_dataset([records], tok, TokenizeConfig(media_root=str(media), exif=exif), workers=1, progress=None)
        pack_dataset(tok, out, PackConfig(max_tokens=4096, media=media_mode), workers=1, progress=None)
        rows = list(PackedDataset(out, shuffle=False))
        (video,) = decode_media(rows[0], media)
        assert {_white_corner(f) for f in video.frames} == {want}, exif
