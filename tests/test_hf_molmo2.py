"""Molmo2: packed rows == each sample alone on the real ``Molmo2ForConditionalGeneration``.

A tiny random-init model is built from config (no weights). The corpus holds a text-only
sample, one-image samples (one of them 640x480, tiled into 1x2 crops + the global crop),
a two-image sample, a PyAV video (2 frames at the counted timestamps) and a message
tree (three answers to one image), tokenized with ``--max-crops 2 --max-frames 2`` and
packed two samples per row. See ``tests/hf_harness.py`` for what "packed" and "alone" mean.

The reference side of every comparison is ``transformers``' own code: the alone runs
get their pixels from ``Molmo2ImageProcessor`` / ``Molmo2VideoProcessor`` called on
that sample's media, and their ``mm_token_type_ids`` (which make the model attend
bidirectionally over image tokens) from ``Molmo2Processor.create_mm_token_type_ids``.

Why float64 for the full comparison: Molmo2 *adds* pooled features to the
``<im_patch>`` embeddings, and the gradient of a vision weight is a sum over thousands
of patches that nearly cancels. Float32 rounding of ~1e-7 in the text model (which a
different batch shape alone causes) then shows up as up to ~1e-2 relative in those
sums, even for a row holding one video sample whose vision inputs are bit-identical to
the alone run's. In float64 packed and alone agree to ~1e-7 everywhere (the loss itself
is computed in float32 by ``transformers``), which proves the inputs exact; the float32
run checks loss and logits.

Flex attention: the class takes it, but PyTorch has no flex-attention backward on the
CPU, so here the flex form is compared forward only (loss and logits), and marked
``slow``: the flex kernel is compiled for every sequence length.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("torchvision")

from hf_harness import (  # noqa: E402
    RTOL,
    alone_rows,
    build,
    byte_tokenizer,
    compare,
    standard_corpus,
    token_id,
    vocab_size,
)

from packtool.errors import ConfigError, InputError  # noqa: E402
from packtool.reader import PackedDataset, attention_mask, decode_image, decode_video  # noqa: E402
from packtool.reader.hf import get_family_inputs, model_inputs  # noqa: E402
from packtool.reader.hf.molmo2 import image_token_spans  # noqa: E402

MAX_CROPS = 2
MAX_FRAMES = 2
MAX_TOKENS = 1050
IMAGE_SPECIALS = ["<im_patch>", "<im_col>", "<im_start>", "<low_res_im_start>", "<im_end>", "<frame_start>",
                  "<frame_end>"]
# the template's specials, the image specials, and what Molmo2Processor looks up besides them
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *IMAGE_SPECIALS, "<im_low>", "<|image|>", "<|video|>"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    # video at 0.0 and 2.0 s under --max-frames 2 (molmo2); the 640x480 image is capped by --max-pixels
    # (qwen) or cut into 1x2 tiles under --max-crops 2 (molmo2)
    return standard_corpus(tmp_path_factory.mktemp("molmo2-corpus"))


@pytest.fixture(scope="module")
def packs(corpus, tmp_path_factory) -> dict:
    tok = byte_tokenizer(tmp_path_factory.mktemp("molmo2-tok"), SPECIALS)
    packed = build(tmp_path_factory.mktemp("molmo2"), corpus["inputs"], corpus["root"], max_tokens=MAX_TOKENS,
                   tokenize={"model": "molmo2", "template": "molmo2", "tokenizer": str(tok), "max_crops": MAX_CROPS,
                             "max_frames": MAX_FRAMES})
    return {"packed": packed, "tokenizer": tok, "rows": list(PackedDataset(packed, shuffle=False))}


@pytest.fixture(scope="module")
def processor(packs):
    """The real ``Molmo2Processor`` over the test tokenizer, with the settings tokenize counted with."""
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(packs["tokenizer"]), eos_token="<|im_end|>")
    return transformers.Molmo2Processor(
        image_processor=transformers.Molmo2ImageProcessor(max_crops=MAX_CROPS),
        video_processor=transformers.Molmo2VideoProcessor(do_sample_frames=False),  # frames come as packed
        tokenizer=tok, use_single_crop_col_tokens=False)


def _frames(m: dict):
    return torch.stack([torch.from_numpy(np.array(f)).permute(2, 0, 1) for f in decode_video(m).frames])


@pytest.fixture(scope="module")
def alone_extra(processor):
    """What ``Molmo2Processor`` returns for one sample besides its text: the reference inputs of an alone run."""

    def extra(family, alone: dict) -> dict:
        kw: dict = {}
        images = [decode_image(m) for m in alone["media"] if m["kind"] == "image"]
        videos = [_frames(m) for m in alone["media"] if m["kind"] == "video"]
        if images:
            kw.update(processor.image_processor(images=images, return_tensors="pt"))
        if videos:
            kw.update(processor.video_processor(videos=videos, return_tensors="pt"))
        kw["mm_token_type_ids"] = torch.tensor(processor.create_mm_token_type_ids([alone["input_ids"].tolist()]))
        return kw

    return extra


def tiny_config(tok: Path, attn: str = "sdpa", vision_attn: str | None = None):
    """A two-layer ``Molmo2Config`` sized for the byte tokenizer, its image token ids the tokenizer's.

    The vision tower and adapter are initialised with std 0.2 (instead of 0.02) so the
    added image features move the logits and the vision gradients are not all rounding
    noise: a wrong pooling index must show. ``vision_attn`` sets the vision tower's and
    the adapter's attention apart from the text model's.
    """
    ids = {"image_patch_id": token_id(tok, "<im_patch>"), "image_start_token_id": token_id(tok, "<im_start>"),
           "low_res_image_start_token_id": token_id(tok, "<low_res_im_start>"),
           "image_end_token_id": token_id(tok, "<im_end>"), "frame_start_token_id": token_id(tok, "<frame_start>"),
           "frame_end_token_id": token_id(tok, "<frame_end>")}
    heads = {"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8}
    config = transformers.Molmo2Config(
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "initializer_range": 0.2,
                       **heads},  # 378-px crops of 14-px patches: 729 position embeddings, as released
        adapter_config={"vision_feature_layer": [-1, 0], "hidden_size": 16, "intermediate_size": 32,
                        "text_hidden_size": 32, "initializer_range": 0.2, **heads},
        text_config={"vocab_size": vocab_size(tok), "additional_vocab_size": 0, "hidden_size": 32,
                     "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 4096,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
        **ids)
    config._attn_implementation = attn if vision_attn is None else {
        "": attn, "text_config": attn, "vision_config": vision_attn, "adapter_config": vision_attn}
    return config


def tiny_model(tok: Path, attn: str = "sdpa", dtype=torch.float64, seed: int = 0, vision_attn: str | None = None):
    """A seeded random-init ``Molmo2ForConditionalGeneration`` of :func:`tiny_config`.

    The key biases of the vision tower's and adapter's attentions are frozen: their
    gradient is zero in exact arithmetic (one vector added to every key shifts all
    scores of a query alike, which softmax ignores), so what backward computes there is
    rounding noise, seeded by the float32 loss ``transformers`` computes even for a
    float64 model, and no floor relative to other gradients makes it comparable.
    """
    config = tiny_config(tok, attn, vision_attn)
    torch.manual_seed(seed)
    model = transformers.Molmo2ForConditionalGeneration(config).to(dtype)
    for name, p in model.named_parameters():
        if name.endswith("k_proj.bias"):
            p.requires_grad_(False)
    return model


# ---------------------------------------------------------------- packed == alone


def test_corpus_packs_several_samples_per_row(packs):
    rows = packs["rows"]
    assert len(rows) >= 3 and all(len(r["sample_ids"]) >= 2 for r in rows)
    kinds = {m["kind"] for r in rows for m in r["media"]}
    assert kinds == {"image", "video"}
    assert max(m["vision_units"] for r in rows for m in r["media"]) == 1 + MAX_CROPS  # the tiled image


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_equals_alone(packs, alone_extra, attn):
    """All rows in one batch (images and a video together, padding, a tree) against every sample and branch alone:
    loss, logits and every parameter's gradient."""
    model = tiny_model(packs["tokenizer"], attn)
    rep = compare(model, packs["packed"], attn, alone_extra=alone_extra)
    assert rep.n_rows >= 3 and rep.n_alone >= 8, rep
    assert rep.ok(), f"{attn}: {rep}"


def test_float32_loss_and_logits(packs, alone_extra):
    model = tiny_model(packs["tokenizer"], "sdpa", dtype=torch.float32)
    rep = compare(model, packs["packed"], "sdpa", alone_extra=alone_extra, grads=False)
    assert rep.loss <= RTOL and rep.logits <= RTOL, rep


@pytest.mark.slow
def test_flex_attention_loss_and_logits(packs, alone_extra):
    """The BlockMask form against the model's own flex path alone: loss and logits (float32: the compiled flex
    kernel takes no float64 on the CPU; no gradients: torch has no flex backward on the CPU). The crops' own
    attention (vision tower, adapter: no mask from packtool) runs sdpa, sparing a flex compile per crop batch.
    Every length is compiled statically (``hf_harness`` turns dynamic shapes off for the session: inductor's
    dynamic-shape flex kernel for the CPU fails to build here, ``cur_kvSplitSize0`` undeclared, torch 2.14).
    No monkeypatch of that setting here: undoing it on torch's config module removed the setting, and a
    flex test in a later file then failed on the missing name."""
    model = tiny_model(packs["tokenizer"], "flex_attention", dtype=torch.float32, vision_attn="sdpa")
    rep = compare(model, packs["packed"], "flex_attention", alone_extra=alone_extra, grads=False)
    assert rep.loss <= RTOL and rep.logits <= RTOL, rep


# ---------------------------------------------------------------- the comparison can fail


def _without_offsets(inputs: dict) -> dict:
    """Every item's pooling indices as if it were alone: all items pool the first crops of the batch."""
    pool = inputs["image_token_pooling"].clone()
    grids, crops = inputs["image_grids"], inputs["image_num_crops"]
    rows = (grids[:, 0] * grids[:, 1] + grids[:, 2] * grids[:, 3]).tolist()
    per_crop = inputs["pixel_values"].shape[1]
    start, first = 0, 0
    for n_rows, n_crops in zip(rows, crops.tolist(), strict=True):
        part = pool[start:start + n_rows]
        pool[start:start + n_rows] = torch.where(part >= 0, part - first, part)
        start, first = start + n_rows, first + n_crops * per_crop
    return {**inputs, "image_token_pooling": pool}


def test_pooling_indices_without_offsets_fail_the_comparison(packs, alone_extra):
    """Every image pooling the batch's first crops: the feature count still matches, so the model raises
    nothing, and the comparison catches it."""
    model = tiny_model(packs["tokenizer"], "sdpa", dtype=torch.float32)
    rep = compare(model, packs["packed"], "sdpa", alone_extra=alone_extra, mutate=_without_offsets, grads=False)
    assert not rep.ok() and rep.logits > 1e-3, rep


def _dense_mask(packs, vision: str):
    width = max(len(r["input_ids"]) for r in packs["rows"])
    masks = []
    for r in packs["rows"]:
        sub = np.full(width, -1, dtype=np.int64)
        sub[:len(r["subsegment_ids"])] = r["subsegment_ids"]
        masks.append(attention_mask(sub, r["media"], vision=vision))
    return torch.from_numpy(np.stack(masks))[:, None]


@pytest.mark.parametrize("wrong", ["boolean mask with eager", pytest.param("causal image tokens", marks=pytest.mark.slow),
                                   pytest.param("media spans", marks=pytest.mark.slow)])
def test_wrong_masks_fail_the_comparison(packs, alone_extra, wrong):
    """Eager attention adds its mask to the scores, so a boolean mask there is silently wrong. Image tokens attend
    both ways over exactly the processor's image tokens: a causal mask misses that, and media spans
    (``vision="sample"``) miss the markers around the first and last patch and open up the video's timestamps."""
    attn = "eager" if wrong.endswith("eager") else "sdpa"

    def mutate(inputs):
        if attn == "eager":
            return {**inputs, "attention_mask": inputs["attention_mask"] == 0}
        return {**inputs, "attention_mask": _dense_mask(packs, "causal" if wrong.startswith("causal") else "sample")}

    model = tiny_model(packs["tokenizer"], attn, dtype=torch.float32)
    rep = compare(model, packs["packed"], attn, alone_extra=alone_extra, mutate=mutate, grads=False)
    assert not rep.ok() and rep.logits > 1e-4, rep


# ---------------------------------------------------------------- against the processor, no model


def test_token_types_are_the_processors(packs, processor):
    out = model_inputs(packs["rows"])
    for i, r in enumerate(packs["rows"]):
        want = processor.create_mm_token_type_ids([r["input_ids"].tolist()])[0]
        assert out["mm_token_type_ids"][i, :len(want)].tolist() == want
        assert out["mm_token_type_ids"][i, len(want):].sum() == 0


def test_layout_is_the_processors(packs, processor):
    """Each item's tokens, from the structure token before its first patch to its last marker, are what
    ``Molmo2Processor`` writes for that image or video (its ``image_grids`` / ``video_grids``; for the video, at
    the counted timestamps, since the processor's own frame sampler is not the one tokenize reproduces)."""
    hf_tok = processor.tokenizer
    n_checked = 0
    for r in packs["rows"]:
        ids = r["input_ids"].tolist()
        for m in r["media"]:
            off, n = int(m["token_offset"]), int(m["n_tokens"])
            if m["kind"] == "image":
                grids = processor.image_processor(images=[decode_image(m)], return_tensors="pt")["image_grids"]
                text, end = processor.replace_image_token({"image_grids": grids}, 0), off + n + 2
            else:
                grid = processor.video_processor(videos=[_frames(m)], return_tensors="pt")["video_grids"][0]
                text, end = processor.get_video_string(grid, m["timestamps"]), off + n + 1
            want = hf_tok(text, add_special_tokens=False)["input_ids"]
            assert ids[end - len(want):end] == want, (r["sample_ids"], m["kind"], off)
            n_checked += 1
    assert n_checked == sum(len(r["media"]) for r in packs["rows"])


def test_pixels_of_one_kind_are_the_processors_call(packs, processor):
    """Without mixing, the batch's vision inputs are exactly one processor call on its media (offsets and all)."""
    images_row = next(r for r in packs["rows"] if "two" in r["sample_ids"])
    family = get_family_inputs(images_row["vision"])
    got = family.pixels([images_row, images_row], None)
    media = [m for r in (images_row, images_row) for m in r["media"]]
    want = processor.image_processor(images=[decode_image(m) for m in media], return_tensors="pt")
    assert set(got) == {"pixel_values", "image_token_pooling", "image_grids", "image_num_crops"}
    for key in got:
        assert torch.equal(got[key], want[key]), key
    clip_row = next(r for r in packs["rows"] if "clip" in r["sample_ids"])
    clip = next(alone for _, alone in alone_rows(clip_row) if alone["sample_ids"] == ["clip"])
    got = family.pixels([clip], None)
    want = processor.video_processor(videos=[_frames(clip["media"][0])], return_tensors="pt")
    assert set(got) == {"pixel_values_videos", "video_token_pooling", "video_grids"}
    for key in got:
        assert torch.equal(got[key], want[key]), key


def test_mixed_batch_folds_videos_into_the_image_path(packs):
    out = model_inputs(packs["rows"])
    assert "pixel_values_videos" not in out
    media = [m for r in packs["rows"] for m in sorted(r["media"], key=lambda m: m["token_offset"])]
    grids = out["image_grids"].tolist()
    assert len(grids) == len(media)
    for g, m in zip(grids, media, strict=True):
        want = [m["grid_t"] * m["grid_h"], m["grid_w"], 0, 0] if m["kind"] == "video" else [14, 14, m["grid_h"], m["grid_w"]]
        assert g == want
    n_features = int((out["image_token_pooling"] >= 0).any(-1).sum())
    assert n_features == int((out["input_ids"] == token_id(packs["tokenizer"], "<im_patch>")).sum())
    assert out["pixel_values"].shape[0] == int(out["image_num_crops"].sum()) == sum(m["vision_units"] for m in media)


def test_image_token_spans_cover_markers_not_timestamps(packs):
    tok = packs["tokenizer"]
    image_ids = {token_id(tok, t) for t in IMAGE_SPECIALS}
    for r in packs["rows"]:
        ids = np.asarray(r["input_ids"])
        marked = np.zeros(len(ids), bool)
        for s, e in image_token_spans(r):
            marked[s:e] = True
        assert np.array_equal(marked, np.isin(ids, list(image_ids)))


# ---------------------------------------------------------------- errors


def test_processor_mismatch_names_the_sample(packs):
    """Counted with --max-crops 2, fed with 1: an error naming the sample, never a silent truncation."""
    big = next(r for r in packs["rows"] if "big" in r["sample_ids"])
    with pytest.raises(InputError, match="sample 'big'"):
        model_inputs([big], vision={**big["vision"], "max_crops": 1})


def test_image_tokens_in_a_branch_are_refused(packs):
    """Media live in a tree's shared prefix; a row saying otherwise cannot get the model's image block."""
    family = get_family_inputs(packs["rows"][0]["vision"])
    row = {"input_ids": np.array([1, 2, 5, 5, 6, 5, 7, 8, 9, 3]), "pack_index": 7,
           "subsegment_ids": np.array([10000] * 3 + [0] * 7), "media": [{"kind": "image", "token_offset": 2, "n_tokens": 4}]}
    with pytest.raises(InputError, match="pack 7: image tokens inside a branch"):
        family.vision_blocks([row], 10)


def test_varlen_forms_are_refused(packs):
    """Flash kernels cannot express the bidirectional image block; the model class refuses them too."""
    plain = [r for r in packs["rows"] if "tree" not in r["sample_ids"]]
    with pytest.raises(ConfigError, match="does not take attn_implementation='flash_attention_2'"):
        model_inputs(plain, attn_implementation="flash_attention_2")


def test_other_tokenizer_is_refused(packs):
    """A model whose <im_patch> id is not the packs': named up front, not a feature-count error deep inside."""
    config = tiny_config(packs["tokenizer"])
    config.image_patch_id = token_id(packs["tokenizer"], "<im_col>")
    with pytest.raises(InputError, match="another tokenizer"):
        model_inputs(packs["rows"], config=config)
