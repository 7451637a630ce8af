"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL: packed rows == each sample alone on the real model classes.

Tiny random-init models are built from config (no weights); the corpus holds text-only,
single-image, multi-image, video and message-tree samples, tokenized with a capped
``--max-pixels`` so the processor must use the manifest's settings. See
``tests/hf_harness.py`` for what "packed" and "alone" mean.
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
    boolean_mask,
    build,
    byte_tokenizer,
    compare,
    standard_corpus,
    token_id,
    vocab_size,
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
