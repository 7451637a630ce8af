"""``--video-sampler qwen-vl-utils``: Qwen3-VL videos counted as qwen-vl-utils prepares them.

The expected counts come from :func:`qwen_vl_utils_video`, a re-statement of
``qwen_vl_utils.fetch_video(ele, image_patch_size=16)`` (qwen-vl-utils 0.0.14,
``vision_process.py``) written out here from its source, not packtool's functions: the frame
count of ``smart_nframes``, the indices of ``torch.linspace(0, N - 1, n).round()`` (taken
exactly, with fractions), the per-frame budget and the 2-D ``smart_resize``. The videos are
real files encoded with PyAV and probed as tokenize probes them.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from video_fixtures import write_video

from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset
from packtool.errors import ConfigError
from packtool.media import probe_video
from packtool.shards import read_manifest
from packtool.validate import validate_dir
from packtool.vision import VideoMeta, check_settings, get_family

#: qwen-vl-utils' module constants (vision_process.py), Qwen3-VL's patch size and merge
VIDEO_MIN_TOKEN_NUM, VIDEO_MAX_TOKEN_NUM, MODEL_SEQ_LEN = 128, 768, 128000
FPS, FRAME_FACTOR, FPS_MIN_FRAMES, FPS_MAX_FRAMES = 2.0, 2, 4, 768
PATCH, MERGE = 16, 2


def qwen_vl_utils_video(total: int, video_fps: float, height: int, width: int) -> dict:
    """What ``fetch_video`` (then the processor with ``do_resize=False``) makes of a video of ``total``
    frames at ``video_fps``, each ``height`` x ``width``: frame indices, resized size, grid, tokens."""
    factor = PATCH * MERGE
    # smart_nframes
    min_frames = math.ceil(FPS_MIN_FRAMES / FRAME_FACTOR) * FRAME_FACTOR
    max_frames = math.floor(min(FPS_MAX_FRAMES, total) / FRAME_FACTOR) * FRAME_FACTOR
    n = total / video_fps * FPS
    n = min(min(max(n, min_frames), max_frames), total)
    n = math.floor(n / FRAME_FACTOR) * FRAME_FACTOR
    indices = [round(Fraction((total - 1) * i, n - 1)) for i in range(n)]  # round half to even, as torch
    # fetch_video's per-frame budget
    min_pixels = VIDEO_MIN_TOKEN_NUM * factor * factor
    total_pixels = MODEL_SEQ_LEN * factor * factor * 0.9
    max_pixels = max(min(VIDEO_MAX_TOKEN_NUM * factor * factor, total_pixels / n * FRAME_FACTOR),
                     int(min_pixels * 1.05))
    # smart_resize
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    grid = (n // 2, h // PATCH, w // PATCH)
    return {"indices": indices, "resized": (h, w), "grid": grid, "tokens": grid[0] * grid[1] * grid[2] // MERGE ** 2}


#: (width, height, frames, fps) of the encoded clips: tiny frames scaled up to the 128-token floor, a
#: 720p clip cut to the 768-token cap, a 5.4-frame clip (qwen-vl-utils takes 4, the processor 5), a
#: portrait one and a 10-frame one.
CLIPS = {
    "tiny.mp4": (64, 48, 20, 10),
    "hd.mp4": (1280, 720, 60, 30),
    "odd.mp4": (352, 288, 27, 10),
    "portrait.mp4": (480, 848, 25, 5),
    "hd3.mp4": (1280, 720, 90, 30),
}


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sampler-clips")
    for name, (w, h, n, fps) in CLIPS.items():
        write_video(root / name, n, fps, size=(w, h))
    return root


@pytest.fixture(scope="module")
def tokenized(clips, tmp_path_factory) -> dict[str, Path]:
    """The clips tokenized with each sampler (and without the flag)."""
    records = [{"id": name, "video": name, "conversations": [{"from": "human", "value": "<video>\nWhat happens?"},
                                                            {"from": "gpt", "value": "It brightens."}]}
               for name in CLIPS]
    tmp = tmp_path_factory.mktemp("sampler-tok")
    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = {}
    for sampler in (None, "processor", "qwen-vl-utils"):
        out[sampler] = tmp / f"tok-{sampler}"
        tokenize_dataset([data], out[sampler], TokenizeConfig(model="qwen3-vl", media_root=str(clips),
                                                              video_sampler=sampler))
    return out


def _media(tok: Path) -> dict[str, dict]:
    rows = [r for f in sorted(tok.glob("**/*.parquet")) for r in pq.read_table(f).to_pylist()]
    return {r["sample_id"]: r["media"][0] for r in rows}


def test_the_tokenized_counts_are_qwen_vl_utils(tokenized, clips):
    """Every clip's stored frames, size, grid and token count are qwen-vl-utils', and its timestamp
    text is what the processor writes from qwen-vl-utils' metadata (``frames_indices`` / ``fps``)."""
    media = _media(tokenized["qwen-vl-utils"])
    assert sorted(media) == sorted(CLIPS)
    for name, m in media.items():
        meta = probe_video(clips / name)
        assert (meta.width, meta.height, meta.n_frames) == CLIPS[name][:3], name
        want = qwen_vl_utils_video(meta.n_frames, meta.fps, meta.height, meta.width)
        assert (m["resized_height"], m["resized_width"]) == want["resized"], name
        assert (m["grid_t"], m["grid_h"], m["grid_w"]) == want["grid"], name
        assert m["vision_units"] == math.prod(want["grid"]), name
        assert m["timestamps"] == pytest.approx([i / meta.fps for i in want["indices"]]), name
        lay = get_family("qwen3-vl", video_sampler="qwen-vl-utils").video(meta)
        assert lay.n_tokens == want["tokens"]
        idx = want["indices"]
        text = [s[1] for s in lay.segments if s[0] == "text"]
        assert text == [f"<{(idx[i] / meta.fps + idx[i + 1] / meta.fps) / 2:.1f} seconds>"
                        for i in range(0, len(idx), 2)], name


def test_the_cap_changes_counts_that_the_processor_makes():
    """The 2 s 720p clip: the processor spends its whole clip budget on 4 frames (1280x704, 880 tokens
    a temporal patch), qwen-vl-utils caps each frame at 768 tokens (1152x640, 720). A 27-frame 10 fps
    clip: the processor samples 5 frames, qwen-vl-utils 4."""
    hd = VideoMeta(1280, 720, 2.0, 30.0, 60)
    default = get_family("qwen3-vl").video(hd)
    capped = get_family("qwen3-vl", video_sampler="qwen-vl-utils").video(hd)
    assert (default.resized, default.n_tokens) == ((704, 1280), 1760)
    assert (capped.resized, capped.n_tokens) == ((640, 1152), 1440)
    assert capped.n_tokens == qwen_vl_utils_video(60, 30.0, 720, 1280)["tokens"]
    odd = VideoMeta(352, 288, 2.7, 10.0, 27)
    assert len(get_family("qwen3-vl").video(odd).timestamps) == 5
    assert len(get_family("qwen3-vl", video_sampler="qwen-vl-utils").video(odd).timestamps) == 4


@pytest.mark.parametrize("total, video_fps, height, width", [
    (20, 10.0, 48, 64), (60, 30.0, 720, 1280), (27, 10.0, 288, 352), (3, 30.0, 480, 640), (900, 30.0, 1080, 1920),
    (9000, 30.0, 720, 1280),  # 300 frames: the last clip length the 768-token cap holds for
    (9060, 30.0, 720, 1280),  # 302 frames: the budget's share, below the cap
    (46080, 30.0, 2160, 3840),  # 768 frames of 4K: 300 tokens a frame
    (61, 29.97, 1080, 1920), (400, 25.0, 90, 4000), (100, 10.0, 7, 1000), (33, 1.0, 1000, 1000),
])
def test_counts_match_the_restatement_on_many_videos(total, video_fps, height, width):
    meta = VideoMeta(width, height, total / video_fps, video_fps, total)
    lay = get_family("qwen3-vl", video_sampler="qwen-vl-utils").video(meta)
    want = qwen_vl_utils_video(total, video_fps, height, width)
    assert (lay.resized, lay.grid, lay.n_tokens) == (want["resized"], want["grid"], want["tokens"])
    assert lay.timestamps == pytest.approx([i / video_fps for i in want["indices"]])


def test_without_the_flag_nothing_changes(tokenized):
    """The default is the processor's rule, and a run without the flag records the config and vision
    settings of a packtool before the flag: no ``video_sampler`` key, so its digest is unchanged and
    an earlier run of the same settings is resumed, not refused. ``--video-sampler processor`` writes
    the same rows and vision settings (its packs mix with the default's)."""
    default, explicit = tokenized[None], tokenized["processor"]
    assert _media(default) == _media(explicit)
    m = read_manifest(default)
    assert "video_sampler" not in m["config"] and "video_sampler" not in m["vision"]
    assert read_manifest(explicit)["vision"] == m["vision"]
    assert read_manifest(explicit)["config"]["video_sampler"] == "processor"
    hd = _media(default)["hd.mp4"]
    assert (hd["resized_height"], hd["resized_width"], hd["grid_t"]) == (704, 1280, 2)
    assert get_family("qwen3-vl").video(VideoMeta(1280, 720, 10.0, 30.0, 300)).grid == (10, 44, 80)


def test_the_setting_round_trips_through_pack_and_validate(tokenized, tmp_path):
    """The manifest records the sampler; pack carries it to the packed manifest, validate rebuilds the
    family from it (and finds every span right), and a mixture of both samplers is refused."""
    tok = tokenized["qwen-vl-utils"]
    vision = read_manifest(tok)["vision"]
    assert vision["video_sampler"] == "qwen-vl-utils"
    packed = tmp_path / "packed"
    pack_dataset(tok, packed, PackConfig(max_tokens=8192))
    assert read_manifest(packed)["vision"] == vision
    for out in (tok, packed):
        report = validate_dir(out)
        assert report["ok"], report
    settings = {k: v for k, v in vision.items() if k not in ("name", "unit", "default_max_vision_units")}
    assert get_family(vision["name"], **settings).settings() == {k: vision[k] for k in ("name", *settings)}
    with pytest.raises(ConfigError, match=r"video_sampler: None vs 'qwen-vl-utils'"):
        pack_dataset([tokenized[None], tok], tmp_path / "mixed", PackConfig(max_tokens=8192))


@pytest.mark.parametrize("model, message", [
    ("qwen2.5-vl", "--video-sampler does not apply to --model qwen2.5-vl: it counts videos as qwen-vl-utils samples "
                   "and resizes them already; leave the flag out"),
    ("qwen2-vl", "--video-sampler does not apply to --model qwen2-vl"),
    ("molmo2", "--video-sampler does not apply to --model molmo2; it accepts: --max-crops, --max-frames"),
    ("internvl", "--video-sampler does not apply to --model internvl; it accepts: --max-frames, --max-num"),
    ("llava-ov", "--video-sampler does not apply to --model llava-ov; it accepts: --max-frames"),
    ("fixed:576", "--video-sampler does not apply to --model fixed:N"),
])
def test_other_models_refuse_the_flag(model, message):
    for sampler in ("qwen-vl-utils", "processor"):
        with pytest.raises(ConfigError) as err:
            TokenizeConfig(model=model, video_sampler=sampler)
        assert message in str(err.value)


def test_a_sampler_that_is_not_one_is_refused():
    with pytest.raises(ConfigError, match=r"--video-sampler 'qwen_vl_utils': choose processor or qwen-vl-utils"):
        check_settings("qwen3-vl", video_sampler="qwen_vl_utils")
    with pytest.raises(ConfigError, match="must be a string"):
        TokenizeConfig(model="qwen3-vl", video_sampler=1)  # type: ignore[arg-type]


def test_the_command_line_flag_reaches_the_manifest(clips, tmp_path, capsys):
    from packtool.cli import main

    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"id": "hd", "video": "hd.mp4", "conversations": [
        {"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": "It brightens."}]}) + "\n")
    out = tmp_path / "tok"
    assert main(["tokenize", str(data), "--media-root", str(clips), "-o", str(out), "--model", "qwen3-vl",
                 "--video-sampler", "qwen-vl-utils", "--workers", "1", "-q"]) == 0
    manifest = read_manifest(out)
    assert manifest["config"]["video_sampler"] == manifest["vision"]["video_sampler"] == "qwen-vl-utils"
    m = _media(out)["hd"]
    assert (m["resized_height"], m["resized_width"]) == qwen_vl_utils_video(60, 30.0, 720, 1280)["resized"]
