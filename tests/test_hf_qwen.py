"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL: packed rows == each sample alone on the real model classes.

Tiny random-init models are built from config (no weights); the corpus holds text-only,
single-image, multi-image, video and message-tree samples, tokenized with a capped
``--max-pixels`` so the processor must use the manifest's settings. See
``tests/hf_harness.py`` for what "packed" and "alone" mean.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("torchvision")

from hf_harness import (  # noqa: E402
    RTOL,
    boolean_mask,
    build,
    byte_tokenizer,
    compare,
    standard_corpus,
    token_id,
    vocab_size,
    write_jsonl,
)

from packtool.errors import ConfigError, InputError  # noqa: E402
from packtool.reader import PackedDataset  # noqa: E402
from packtool.reader.hf import model_inputs  # noqa: E402
from packtool.reader.hf.qwen import mrope_positions  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]
FAMILIES = ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"]
MAX_PIXELS = 28 * 28 * 24
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    # video at 0.0 and 2.0 s under --max-frames 2 (molmo2); the 640x480 image is capped by --max-pixels
    # (qwen) or cut into 1x2 tiles under --max-crops 2 (molmo2)
    return standard_corpus(tmp_path_factory.mktemp("qwen-corpus"))


@pytest.fixture(scope="module")
def packs(corpus, tmp_path_factory) -> dict:
    """One packed directory per family (several rows, several samples per row)."""
    out = {}
    tok = byte_tokenizer(tmp_path_factory.mktemp("qwen-tok"), SPECIALS)
    for fam in FAMILIES:
        tmp = tmp_path_factory.mktemp(fam)
        template = "qwen3-vl" if fam == "qwen3-vl" else "chatml"
        out[fam] = build(tmp, corpus["inputs"], corpus["root"], max_tokens=MAX_TOKENS,
                         tokenize={"model": fam, "template": template, "tokenizer": str(tok), "max_pixels": MAX_PIXELS})
    out["tokenizer"] = tok
    return out


def tiny_model(family: str, tok: Path, attn: str = "sdpa", seed: int = 0):
    """A two-layer random-init model of the family's real class, sized for the byte tokenizer."""
    ids = {"image_token_id": token_id(tok, "<|image_pad|>"), "video_token_id": token_id(tok, "<|video_pad|>"),
           "vision_start_token_id": token_id(tok, "<|vision_start|>"),
           "vision_end_token_id": token_id(tok, "<|vision_end|>")}
    text = {"vocab_size": vocab_size(tok), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096}
    vision = {"depth": 2, "hidden_size": 32, "num_heads": 4, "spatial_merge_size": 2, "temporal_patch_size": 2}
    if family == "qwen2-vl":
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0}
        config = transformers.Qwen2VLConfig(text_config=text, vision_config={**vision, "embed_dim": 32, "mlp_ratio": 2,
                                                                             "patch_size": 14}, **ids)
        cls = transformers.Qwen2VLForConditionalGeneration
    elif family == "qwen2.5-vl":
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0}
        config = transformers.Qwen2_5_VLConfig(
            text_config=text, vision_config={**vision, "intermediate_size": 64, "out_hidden_size": 32, "patch_size": 14,
                                             "window_size": 56, "fullatt_block_indexes": [1], "tokens_per_second": 2},
            **ids)
        cls = transformers.Qwen2_5_VLForConditionalGeneration
    else:
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True,
                                   "rope_theta": 10000.0}
        text["head_dim"] = 8
        config = transformers.Qwen3VLConfig(
            text_config=text, vision_config={**vision, "intermediate_size": 64, "out_hidden_size": 32, "patch_size": 16,
                                             "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
            **ids)
        cls = transformers.Qwen3VLForConditionalGeneration
    config.bos_token_id = config.eos_token_id = config.text_config.bos_token_id = config.text_config.eos_token_id = None
    config._attn_implementation = attn
    torch.manual_seed(seed)
    return cls(config).float()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_equals_alone(packs, family, attn):
    model = tiny_model(family, packs["tokenizer"], attn)
    rep = compare(model, packs[family], attn)
    assert rep.n_rows >= 2 and rep.n_alone >= 8, rep
    assert rep.ok(), f"{family} {attn}: {rep}"


@pytest.mark.parametrize("family", FAMILIES)
def test_varlen_inputs_equal_alone_without_trees(packs, family, tmp_path, corpus):
    """The flash form (rows end to end, no mask, text positions restarting per sample) is exact: run here by
    sdpa, which builds its mask from those position ids exactly as varlen kernels split sequences."""
    flat = build(tmp_path, corpus["inputs"][:1], corpus["root"], max_tokens=1024,
                 tokenize={"model": family, "template": "qwen3-vl" if family == "qwen3-vl" else "chatml",
                           "tokenizer": str(packs["tokenizer"]), "max_pixels": MAX_PIXELS})
    model = tiny_model(family, packs["tokenizer"], "sdpa")
    rep = compare(model, flat, "flash_attention_2")
    assert rep.ok(), f"{family} flash form: {rep}"
    with pytest.raises(InputError, match="message trees"):
        model_inputs(list(PackedDataset(packs[family], shuffle=False)), attn_implementation="flash_attention_2")


def test_one_dimensional_positions_fail_the_comparison(packs):
    """What the README's old recipe did: 1-D positions for an mRoPE model. The image tokens lose their
    height/width positions, and the comparison catches it."""
    model = tiny_model("qwen2.5-vl", packs["tokenizer"], "sdpa")

    def one_d(inputs):
        return {**inputs, "position_ids": inputs["position_ids"][0]}

    rep = compare(model, packs["qwen2.5-vl"], "sdpa", mutate=one_d)
    assert not rep.ok() and rep.logits > 1e-3, rep


def test_boolean_mask_with_eager_fails_the_comparison(packs):
    """Eager attention adds its mask to the scores: a boolean mask there is silently wrong."""
    model = tiny_model("qwen2.5-vl", packs["tokenizer"], "eager")

    rep = compare(model, packs["qwen2.5-vl"], "eager", mutate=boolean_mask)
    assert not rep.ok() and rep.logits > 1e-3, rep


def test_tree_branches_continue_their_prefix_positions(packs):
    rows = list(PackedDataset(packs["qwen2.5-vl"], shuffle=False))
    row = next(r for r in rows if "tree" in r["sample_ids"])
    pos = mrope_positions(row)
    sub = np.asarray(row["subsegment_ids"])
    k = row["sample_ids"].index("tree")
    s, e = int(row["cu_seqlens"][k]), int(row["cu_seqlens"][k + 1])
    local = sub[s:e] % 100000
    prefix_end = s + int(np.argmax(local != 10000))
    starts = [s + i for i in range(1, e - s) if local[i] != local[i - 1] and local[i] != 10000]
    assert len(starts) >= 3
    # every branch starts one past the prefix's last text position, on all three axes
    for b in starts:
        assert pos[:, b].tolist() == [int(pos[0, prefix_end - 1]) + 1] * 3
    # image tokens are laid out on the grid, not along a line
    img = next(m for m in row["media"] if m["sample_index"] == k)
    o, n = int(img["token_offset"]), int(img["n_tokens"])
    assert len(set(pos[1, o:o + n].tolist())) == img["grid_h"] // 2
    assert len(set(pos[2, o:o + n].tolist())) == img["grid_w"] // 2


def test_settings_come_from_the_manifest(packs):
    """The processor resizes with the manifest's --max-pixels: the capped image's grid is the counted one."""
    rows = list(PackedDataset(packs["qwen2.5-vl"], shuffle=False))
    assert rows[0]["vision"]["max_pixels"] == MAX_PIXELS
    out = model_inputs(rows)
    grids = out["image_grid_thw"]
    counted = [(m["grid_t"], m["grid_h"], m["grid_w"]) for r in rows for m in sorted(r["media"], key=lambda m: m["token_offset"])
               if m["kind"] == "image"]
    assert [tuple(g) for g in grids.tolist()] == counted
    assert max(h * w for _, h, w in counted) * 14 * 14 <= MAX_PIXELS


def test_processor_mismatch_names_the_sample(packs):
    """Counted with one --max-pixels, fed with another: an error naming the sample, never a silent truncation."""
    rows = list(PackedDataset(packs["qwen2.5-vl"], shuffle=False))
    wrong = {**rows[0]["vision"], "max_pixels": MAX_PIXELS * 4}
    big = next(r for r in rows if "big" in r["sample_ids"])
    with pytest.raises(InputError, match="sample 'big'"):
        model_inputs([big], vision=wrong)


def test_bad_arguments_are_clear(packs):
    rows = list(PackedDataset(packs["qwen2.5-vl"], shuffle=False))
    # transformers' Qwen-VL classes take no flex attention: refused by name, not failed deep inside
    with pytest.raises(ConfigError, match="Qwen2_5_VLForConditionalGeneration does not take"):
        model_inputs(rows, attn_implementation="flex_attention")
    with pytest.raises(ConfigError, match="attn_implementation='flash'"):
        model_inputs(rows, attn_implementation="flash")
    bare = [{k: v for k, v in r.items() if k != "vision"} for r in rows]
    with pytest.raises(ConfigError, match="vision=manifest"):
        model_inputs(bare)


def test_tokenizer_mismatch_with_the_model_is_named(packs):
    """Packs from one tokenizer, a model whose image token is another id: a clear error up front."""
    rows = list(PackedDataset(packs["qwen2.5-vl"], shuffle=False))
    model = tiny_model("qwen2.5-vl", packs["tokenizer"])
    model.config.image_token_id += 1
    with pytest.raises(InputError, match="another tokenizer than this checkpoint's"):
        model_inputs(rows, config=model.config)


def test_loss_normalises_by_loss_tokens(packs):
    """``num_items_in_batch`` makes the loss a per-token mean over the batch, whatever the packing."""
    rows = list(PackedDataset(packs["qwen2.5-vl"], shuffle=False))
    out = model_inputs(rows)
    assert int(out["num_items_in_batch"]) == int((out["shift_labels"] != -100).sum())
    assert torch.equal(out["labels"], out["shift_labels"]) and out["use_cache"] is False
    assert int(model_inputs(rows, num_items_in_batch=1000)["num_items_in_batch"]) == 1000


def test_rtol_is_tight():
    assert RTOL <= 1e-5


# --------------------------------------------------------------------------- video time steps (Qwen2.5-VL)

#: (frames, fps) of each fixture video, tokenized with --max-frames 6: 15 frames at 10 fps sample 3
#: frames at 2 fps, raised to the minimum 4; 50 frames give 10, capped at 6; 25 give 5, rounded to 4
VIDEOS = {"short.mp4": (15, 10), "capped.mp4": (50, 10), "odd.mp4": (25, 10)}


@pytest.fixture(scope="module")
def video_packs(tmp_path_factory) -> dict:
    from hf_harness import write_jsonl
    from video_fixtures import write_video

    root = tmp_path_factory.mktemp("fps-corpus")
    for name, (n, fps) in VIDEOS.items():
        write_video(root / name, n_frames=n, fps=fps, size=(56, 28))
    records = [
        {"id": "short", "video": "short.mp4", "conversations": [
            {"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": "It brightens."}]},
        {"id": "two", "video": ["capped.mp4", "odd.mp4"], "conversations": [
            {"from": "human", "value": "<video> then <video>: which is longer?"}, {"from": "gpt", "value": "The first."}]},
    ]
    tmp = tmp_path_factory.mktemp("fps")
    tok = byte_tokenizer(tmp / "tok", SPECIALS)
    packed = build(tmp, [write_jsonl(root / "videos.jsonl", records)], root, max_tokens=4096,
                   tokenize={"model": "qwen2.5-vl", "template": "chatml", "tokenizer": str(tok), "max_frames": 6})
    return {"packed": packed, "tokenized": tmp / "packed-tok", "tokenizer": tok, "root": root}


def _processor(tok: Path):
    """The real ``Qwen2_5_VLProcessor``; frames arrive sampled and at the counted size, as the reader feeds them."""
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    video = Qwen2VLVideoProcessor(do_resize=False, do_sample_frames=False, cap_pixels_per_frame=True, patch_size=14,
                                  merge_size=2, temporal_patch_size=2)
    return Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(), video_processor=video,
                               tokenizer=PreTrainedTokenizerFast(tokenizer_file=str(tok)))


def _processed(processor, m: dict, root: Path) -> dict:
    """The processor's outputs for one video: its decoded frames and the file's own frame count and
    rate (the fixture's, not what packtool recorded) with the indices of the frames it took."""
    from transformers.video_utils import VideoMetadata

    from packtool.reader import decode_video

    n_frames, fps = VIDEOS[m["path"]]
    frames = [f.resize((m["resized_width"], m["resized_height"])) for f in decode_video(m, root).frames]
    video = torch.stack([torch.from_numpy(np.array(f.convert("RGB"))).permute(2, 0, 1) for f in frames])
    meta = VideoMetadata(total_num_frames=n_frames, fps=float(fps), frames_indices=[round(t * fps) for t in m["timestamps"]])
    out = processor(text=["<|vision_start|><|video_pad|><|vision_end|>"], videos=[video], video_metadata=[meta],
                    return_tensors="pt")
    assert tuple(out["video_grid_thw"][0].tolist()) == (m["grid_t"], m["grid_h"], m["grid_w"])
    return out


def test_qwen25_video_time_steps_are_the_processors(video_packs):
    """For a clip raised to the 4-frame minimum, one capped by --max-frames and one whose count was
    rounded to even, ``second_per_grid_ts`` is what ``Qwen2_5_VLProcessor`` computes from the sampled
    frames' rate (0.75, 1.6667, 1.25 s; the configured 2 fps would say 1.0 for all three), and the
    3-D positions are what the model's ``get_rope_index`` puts there with it, sample by sample."""
    from hf_harness import alone_rows

    tok = video_packs["tokenizer"]
    rows = list(PackedDataset(video_packs["packed"], shuffle=False))
    model = tiny_model("qwen2.5-vl", tok)
    inputs = model_inputs(rows, config=model.config)
    processor = _processor(tok)
    media = [m for r in rows for m in sorted(r["media"], key=lambda m: m["token_offset"])]
    assert sorted(m["path"] for m in media) == sorted(VIDEOS)
    assert {m["path"]: len(m["timestamps"]) for m in media} == {"short.mp4": 4, "capped.mp4": 6, "odd.mp4": 4}
    for m in media:  # what tokenize recorded: the file's frame count and rate
        assert (m["source_frames"], m["source_fps"]) == VIDEOS[m["path"]]
    want = torch.cat([_processed(processor, m, video_packs["root"])["second_per_grid_ts"] for m in media])
    assert want.tolist() == pytest.approx([0.75, 2 / 1.2, 1.25])
    assert torch.equal(inputs["second_per_grid_ts"], want)

    video_id = token_id(tok, "<|video_pad|>")
    for i, row in enumerate(rows):
        for idx, alone in alone_rows(row):
            videos = sorted(alone["media"], key=lambda m: m["token_offset"])
            outs = [_processed(processor, m, video_packs["root"]) for m in videos]
            ids = torch.from_numpy(alone["input_ids"])[None]
            kw = {"input_ids": ids, "mm_token_type_ids": (ids == video_id).long() * 2,
                  "video_grid_thw": torch.cat([o["video_grid_thw"] for o in outs])}
            pos, _ = model.model.get_rope_index(**kw, second_per_grid_ts=torch.cat([o["second_per_grid_ts"] for o in outs]))
            assert torch.equal(inputs["position_ids"][1:, i, torch.from_numpy(idx)], pos[:, 0]), alone["sample_ids"]
            # the time step of the configured fps (what packtool used before) puts other positions there
            old, _ = model.model.get_rope_index(**kw, second_per_grid_ts=torch.ones(len(videos)))
            assert not torch.equal(old, pos)


def _as_v5(directory: Path) -> None:
    """Rewrite a directory's shards and manifest as packtool wrote schema version 5 (no media source_* fields)."""
    import json

    import pyarrow.parquet as pq
    from naive import v5_form

    from packtool.shards import MANIFEST, read_manifest, sha256_file

    manifest = read_manifest(directory)
    for entry in manifest["shards"]:
        f = directory / entry["file"]
        pq.write_table(v5_form(pq.read_table(f)), f)
        entry.update(bytes=f.stat().st_size, sha256=sha256_file(f))
    manifest["schema_version"] = 5
    (directory / MANIFEST).write_text(json.dumps(manifest))


def test_v5_directories_still_read_and_pack_with_one_warning(video_packs, tmp_path, monkeypatch, caplog):
    """A packed directory of schema version 5 reads (videos get the configured fps's time step and a
    warning naming the fix, once); a tokenized one packs into version 6 with null source fields."""
    import shutil

    import pyarrow.parquet as pq

    import packtool.reader.hf.qwen as qwen
    from packtool import PackConfig, pack_dataset
    from packtool.schema import PACKED, PACKED_V5
    from packtool.shards import read_manifest
    from packtool.validate import validate_dir

    packed, tok = tmp_path / "packed", tmp_path / "tok"
    shutil.copytree(video_packs["packed"], packed)
    shutil.copytree(video_packs["tokenized"], tok)
    _as_v5(packed)
    _as_v5(tok)
    assert validate_dir(packed)["ok"] and validate_dir(tok)["ok"]
    assert pq.read_schema(next(packed.glob("part-*.parquet"))).remove_metadata().equals(PACKED_V5.remove_metadata())
    monkeypatch.setattr(qwen, "_warned_no_source", False)
    with caplog.at_level("WARNING", logger=qwen.__name__):
        rows = list(PackedDataset(packed, shuffle=False))
        for _ in range(2):
            out = model_inputs(rows)
    assert out["second_per_grid_ts"].tolist() == [1.0, 1.0, 1.0]
    warned = [r.getMessage() for r in caplog.records if r.name == qwen.__name__]
    assert len(warned) == 1 and "re-run tokenize and pack with this packtool version" in warned[0]

    again = tmp_path / "packed-again"
    pack_dataset(tok, again, PackConfig(max_tokens=4096))
    assert read_manifest(again)["schema_version"] == 6 and validate_dir(again)["ok"]
    assert pq.read_schema(next(again.glob("part-*.parquet"))).remove_metadata().equals(PACKED.remove_metadata())
    media = [m for r in PackedDataset(again, shuffle=False) for m in r["media"]]
    assert len(media) == 3 and all(m["source_fps"] is None and m["source_frames"] is None for m in media)


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_a_strip_thinner_than_half_a_block_gets_the_counted_grid(tmp_path, family):
    """tokenize counts with qwen-vl-utils' resize rule (no side rounds below one 28-px block); the
    copy in ``transformers`` makes another grid when a side is under half a block (a 1000x5 strip:
    2x58 patches where 2x72 were counted), which stopped training with 'the media or the processor
    settings changed'. The reader resizes such an image to the counted size first, as qwen-vl-utils does."""
    from PIL import Image

    root = tmp_path / "media"
    root.mkdir()
    Image.new("RGB", (1000, 5), "red").save(root / "strip.png")
    Image.new("RGB", (3, 400), "blue").save(root / "tall.png")
    Image.new("RGB", (64, 48), "green").save(root / "ok.png")
    conv = [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A strip."}]
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": name, "image": f"{name}.png", "conversations": conv}
                                              for name in ("strip", "tall", "ok")])
    packed = build(tmp_path, [src], root, max_tokens=4096, tokenize={"model": family})
    rows = list(PackedDataset(packed, shuffle=False))
    counted = [(m["grid_t"], m["grid_h"], m["grid_w"]) for r in rows
               for m in sorted(r["media"], key=lambda m: m["token_offset"])]
    out = model_inputs(rows)
    assert [tuple(g) for g in out["image_grid_thw"].tolist()] == counted
    assert out["pixel_values"].shape[0] == sum(t * h * w for t, h, w in counted)
    if family == "qwen2.5-vl":
        assert (1, 2, 72) in counted  # the strip, as qwen-vl-utils sizes it (28x1008 px)


# --------------------------------------------------------------------------- variable-rate Matroska (Qwen3-VL)

#: presentation times (ms) of a variable-rate clip: 20 frames over 2 s, nominally 30 fps
VFR_MS = [0, 10, 20, 100, 110, 400, 410, 420, 900, 1000, 1010, 1500, 1600, 1700, 1710, 1720, 1800, 1900, 1950, 2000]


def test_qwen3_frames_of_a_variable_rate_mkv_are_the_processors(tmp_path):
    """A variable-rate MKV (no frame count in the file) of 20 frames: tokenize samples the number of
    frames ``Qwen3VLVideoProcessor.sample_frames`` samples from the decoded count and the stream's
    average rate, the reader hands over the decoded frames at the indices it picks, pixel for pixel,
    and the timestamp text is the processor's ``_calculate_timestamps`` (the probe counted 61 frames
    at the nominal 30 fps, and the frames taken were not those indices)."""
    import json
    from fractions import Fraction

    import av
    import pyarrow.parquet as pq
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata
    from video_fixtures import write_video

    from packtool import TokenizeConfig, tokenize_dataset
    from packtool.reader import decode_video
    from packtool.vision import get_family

    write_video(tmp_path / "vfr.mkv", 20, 30, fmt="matroska", pts=VFR_MS, time_base=Fraction(1, 1000), step=12)
    with av.open(str(tmp_path / "vfr.mkv")) as c:  # the truth: a full decode, as torchcodec or decord index it
        s = c.streams.video[0]
        packets = [p for p in c.demux(s) if p.size]
        end = max((p.pts + p.duration) * s.time_base for p in packets) - min(p.pts * s.time_base for p in packets)
    with av.open(str(tmp_path / "vfr.mkv")) as c:
        decoded = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    fps = len(decoded) / float(end)  # torchcodec's average_fps: frames over the scanned span
    want = Qwen3VLVideoProcessor().sample_frames(VideoMetadata(total_num_frames=len(decoded), fps=fps), fps=2)

    rec = {"id": "v", "video": "vfr.mkv", "conversations": [{"from": "human", "value": "<video>\nWhat happens?"},
                                                           {"from": "gpt", "value": "It flickers."}]}
    (tmp_path / "d.jsonl").write_text(json.dumps(rec) + "\n")
    tokenize_dataset([tmp_path / "d.jsonl"], tmp_path / "tok", TokenizeConfig(model="qwen3-vl", media_root=str(tmp_path)))
    m = pq.read_table(next((tmp_path / "tok").glob("**/*.parquet"))).to_pylist()[0]["media"][0]
    assert (m["source_frames"], len(m["timestamps"])) == (len(decoded), len(want))
    assert m["source_fps"] == pytest.approx(fps)
    got = decode_video(m, tmp_path).frames  # packed by reference: the reader decodes the file
    for img, i in zip(got, want.tolist(), strict=True):
        assert np.array_equal(np.asarray(img), decoded[i]), i
    fam = get_family("qwen3-vl")
    text = [s[1] for s in fam.video_segments((m["grid_t"], 1, 1), fam.segment_times(m)) if s[0] == "text"]
    stamps = Qwen3VLProcessor._calculate_timestamps(None, want.tolist(), fps)
    assert text == [f"<{t:.1f} seconds>" for t in stamps]


# --------------------------------------------------------------------------- --video-sampler qwen-vl-utils (Qwen3-VL)

#: (width, height, frames, fps): tiny frames qwen-vl-utils scales up to its 128-token floor (64x48 ->
#: 448x320), a 720p clip it caps at 768 tokens a frame, a 5.4-frame clip it takes 4 frames of (the
#: processor 5), a portrait one
SAMPLER_CLIPS = {"tiny.mp4": (64, 48, 20, 10), "hd.mp4": (1280, 720, 8, 4), "odd.mp4": (352, 288, 27, 10),
                 "portrait.mp4": (480, 848, 25, 5)}


@pytest.fixture(scope="module")
def sampler_clips(tmp_path_factory) -> dict:
    from video_fixtures import write_noise_video

    root = tmp_path_factory.mktemp("sampler-clips")
    for i, (name, (w, h, n, fps)) in enumerate(SAMPLER_CLIPS.items()):
        write_noise_video(root / name, n, fps, size=(w, h), seed=i)
    conv = [{"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": "It pans."}]
    data = write_jsonl(root / "data.jsonl", [{"id": name, "video": name, "conversations": conv}
                                             for name in SAMPLER_CLIPS])
    return {"root": root, "data": data, "tokenizer": byte_tokenizer(tmp_path_factory.mktemp("sampler-tok"), SPECIALS)}


def _sampler_pack(clips: dict, tmp: Path, names: list[str], sampler: str | None = "qwen-vl-utils",
                  model: str = "qwen3-vl") -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    records = [json.loads(line) for line in clips["data"].read_text().splitlines()]
    src = write_jsonl(tmp / "in.jsonl", [r for r in records if r["id"] in names])
    settings = {"model": model, "template": "qwen3-vl" if model == "qwen3-vl" else "chatml",
                "tokenizer": str(clips["tokenizer"])}
    if model == "qwen3-vl":
        settings["video_sampler"] = sampler
    return build(tmp, [src], clips["root"], max_tokens=16384, pack={"media": "reference"}, tokenize=settings)


def _counted(rows: list[dict]) -> list[tuple[str, tuple[int, int, int]]]:
    return [(m["path"], (m["grid_t"], m["grid_h"], m["grid_w"])) for r in rows
            for m in sorted(r["media"], key=lambda m: m["token_offset"])]


def test_qwen3_videos_counted_as_qwen_vl_utils_get_the_counted_grid(sampler_clips, tmp_path):
    """Under ``--video-sampler qwen-vl-utils`` the reader hands the processor each video at the size
    tokenize counted, so its grid is the counted one (the 720p clip capped at 40x72 patches where the
    processor's own rule gives 44x80) and the features fill the placeholders exactly; validate agrees."""
    from packtool.validate import validate_dir

    packed = _sampler_pack(sampler_clips, tmp_path, list(SAMPLER_CLIPS))
    assert validate_dir(packed)["ok"]
    rows = list(PackedDataset(packed, shuffle=False))
    counted = _counted(rows)
    assert dict(counted)["hd.mp4"] == (2, 40, 72) and dict(counted)["tiny.mp4"] == (2, 20, 28)
    out = model_inputs(rows, media_root=sampler_clips["root"])
    assert [tuple(g) for g in out["video_grid_thw"].tolist()] == [g for _, g in counted]
    assert out["pixel_values_videos"].shape[0] == sum(t * h * w for _, (t, h, w) in counted)
    n_pads = int((out["input_ids"] == token_id(sampler_clips["tokenizer"], "<|video_pad|>")).sum())
    assert n_pads == sum(t * h * w // 4 for _, (t, h, w) in counted)
    default = _counted(list(PackedDataset(_sampler_pack(sampler_clips, tmp_path / "default", ["hd.mp4"], None),
                                          shuffle=False)))
    assert default == [("hd.mp4", (2, 44, 80))]


def test_qwen3_qwen_vl_utils_packed_equals_alone(sampler_clips, tmp_path):
    """The real model class, packed rows against each sample alone, on a video counted as qwen-vl-utils
    counts it (scaled up to 448x320 a frame; the processor's own rule keeps 64x64)."""
    packed = _sampler_pack(sampler_clips, tmp_path, ["tiny.mp4", "odd.mp4"])
    model = tiny_model("qwen3-vl", sampler_clips["tokenizer"], "sdpa")
    rep = compare(model, packed, "sdpa", media_root=sampler_clips["root"])
    assert rep.ok(), rep


@pytest.mark.parametrize("model", ["qwen3-vl", "qwen2.5-vl"])
def test_videos_counted_as_qwen_vl_utils_are_fetch_videos(model, sampler_clips, tmp_path, monkeypatch):
    """The reference itself: ``fetch_video(image_patch_size=..., return_video_metadata=True)`` takes
    the frames tokenize counted and resizes them to the counted size, the processor
    (``do_resize=False``, sampling off, as the Qwen recipes call it) makes the counted grid, and for
    Qwen3-VL its timestamp text from qwen-vl-utils' metadata is the one laid out. The pixels the
    reader hands over are qwen-vl-utils' (the reader decodes the same frames and resizes them with
    the same call): for Qwen3-VL under ``--video-sampler qwen-vl-utils``, for Qwen2.5-VL always (it
    counts every video so); before, Qwen2.5-VL's reader resized with another kernel and its pixels
    differed by up to 25 levels on these noise clips. Neither decord nor torchcodec is installed here, so fetch_video's decord path reads
    through a stand-in that decodes every frame with PyAV, as decord indexes them."""
    import sys
    from types import SimpleNamespace

    import av

    vp = pytest.importorskip("qwen_vl_utils.vision_process")
    from transformers import Qwen2VLVideoProcessor
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    from packtool.media import probe_video
    from packtool.vision import get_family

    class VideoReader:
        def __init__(self, path: str) -> None:
            with av.open(path) as c:
                self.fps = float(c.streams.video[0].average_rate)
                self.frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]

        def __len__(self) -> int:
            return len(self.frames)

        def get_avg_fps(self) -> float:
            return self.fps

        def get_batch(self, idx):
            return SimpleNamespace(asnumpy=lambda: np.stack([self.frames[i] for i in idx]))

    monkeypatch.setitem(sys.modules, "decord", SimpleNamespace(VideoReader=VideoReader))
    monkeypatch.setattr(vp, "get_video_reader_backend", lambda: "decord")
    qwen3 = model == "qwen3-vl"
    family = get_family(model, **({"video_sampler": "qwen-vl-utils"} if qwen3 else {}))
    processor = (Qwen3VLVideoProcessor if qwen3 else Qwen2VLVideoProcessor)(do_resize=False, do_sample_frames=False,
                                                                            cap_pixels_per_frame=True)
    names = list(SAMPLER_CLIPS)
    want_pixels = []
    for name in names:
        path = sampler_clips["root"] / name
        video, meta = vp.fetch_video({"video": str(path)}, image_patch_size=16 if qwen3 else 14,
                                     return_video_metadata=True)
        lay = family.video(probe_video(path))
        assert [round(t * meta["fps"]) for t in lay.timestamps] == list(meta["frames_indices"]), name
        assert tuple(video.shape[-2:]) == lay.resized, name
        out = processor(videos=[video], return_tensors="pt")
        assert tuple(out["video_grid_thw"][0].tolist()) == lay.grid, name
        if qwen3:
            stamps = Qwen3VLProcessor._calculate_timestamps(None, meta["frames_indices"], meta["fps"])
            assert [s[1] for s in lay.segments if s[0] == "text"] == [f"<{t:.1f} seconds>" for t in stamps], name
        want_pixels.append((name, out["pixel_values_videos"]))
    rows = list(PackedDataset(_sampler_pack(sampler_clips, tmp_path, names, model=model), shuffle=False))
    order = [p for p, _ in _counted(rows)]
    got = model_inputs(rows, media_root=sampler_clips["root"])["pixel_values_videos"]
    want = torch.cat([dict(want_pixels)[p] for p in order])
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=0)
