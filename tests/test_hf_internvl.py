"""InternVL: packed rows == each sample alone on the real ``InternVLForConditionalGeneration``.

A tiny random-init model is built from config (the real 448-px / patch-14 / pixel-shuffle
vision layout, so 256 tokens per tile; a two-layer Qwen2 text model sized for a byte
tokenizer). The corpus holds a text-only sample, one-tile images, a 3:1 image cut into
2 tiles + thumbnail by ``--max-num 2`` (4 tiles with the default 12, so the processor
must use the manifest's setting), a two-image sample, a 2-frame video and a message
tree on an image. See ``tests/hf_harness.py`` for what "packed" and "alone" mean.

Flex attention has no backward on the CPU in torch, so there the comparison is of
loss and logits only (and slow: the kernel is compiled), marked ``slow``.
"""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("torchvision")

from hf_harness import (  # noqa: E402
    boolean_mask,
    build,
    byte_tokenizer,
    compare,
    noise_image,
    token_id,
    vocab_size,
    write_jsonl,
)
from video_fixtures import write_video  # noqa: E402

from packtool.errors import ConfigError, InputError  # noqa: E402
from packtool.reader import PackedDataset, collate  # noqa: E402
from packtool.reader.hf import block_mask, get_family_inputs, model_inputs  # noqa: E402
from packtool.vision.internvl import InternVL, target_ratios  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>"]
MAX_NUM = 2
MAX_FRAMES = 2
MAX_TOKENS = 1024


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("internvl-corpus")
    small = noise_image(root / "small.png", (120, 90), 1)
    wide = noise_image(root / "wide.png", (240, 80), 2)  # 3:1 -> 2x1 grid + thumbnail with max_num 2
    square = noise_image(root / "square.jpg", (64, 64), 3)
    write_video(root / "clip.mp4", n_frames=20, fps=10, size=(64, 48), step=12)
    records = [
        {"id": "text", "conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "Hi there."}]},
        {"id": "one", "image": small, "conversations": [
            {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "Noise."},
            {"from": "human", "value": "Sure?"}, {"from": "gpt", "value": "Quite."}]},
        {"id": "wide", "image": wide, "conversations": [
            {"from": "human", "value": "Describe <image> briefly."}, {"from": "gpt", "value": "A strip."}]},
        {"id": "two", "image": [small, square], "conversations": [
            {"from": "human", "value": "<image> and <image>: same?"}, {"from": "gpt", "value": "No."}]},
        {"id": "clip", "video": "clip.mp4", "conversations": [
            {"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": "It brightens."}]},
    ]
    tree = [{"id": "tree", "image": square, "message_list": [
        {"question": "Colour?", "answer": "Many.", "style": "user_qa"},
        {"question": "Shape?", "answer": "A square.", "style": "user_qa"},
        {"messages": ["Size?", "Small.", "Exactly?", "64 by 64."]}]}]
    return {"root": root, "inputs": [write_jsonl(root / "data.jsonl", records), write_jsonl(root / "tree.jsonl", tree)],
            "small": [write_jsonl(root / "small.jsonl", records[:3])]}


@pytest.fixture(scope="module")
def packs(corpus, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("internvl")
    tok = byte_tokenizer(tmp / "tok", SPECIALS)
    packed = build(tmp, corpus["inputs"], corpus["root"], max_tokens=MAX_TOKENS,
                   tokenize={"model": "internvl", "tokenizer": str(tok), "max_num": MAX_NUM, "max_frames": MAX_FRAMES})
    # text, a one-tile and a multi-tile image, no tree: cheaper runs for the varlen form and the wrong inputs
    small = build(tmp, corpus["small"], corpus["root"], max_tokens=MAX_TOKENS, name="small",
                  tokenize={"model": "internvl", "tokenizer": str(tok), "max_num": MAX_NUM, "max_frames": MAX_FRAMES})
    return {"packed": packed, "small": small, "tokenizer": tok, "rows": list(PackedDataset(packed, shuffle=False))}


def tiny_config(tok: Path, attn: str):
    """An ``InternVLConfig``: the real tile geometry (448 px, patch 14, pixel shuffle 0.5), tiny widths."""
    text = {"model_type": "qwen2", "vocab_size": vocab_size(tok), "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 4096}
    vision = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32,
              "image_size": 448, "patch_size": 14, "layer_scale_init_value": 1.0}
    config = transformers.InternVLConfig(text_config=text, vision_config=vision, downsample_ratio=0.5,
                                         image_token_id=token_id(tok, "<IMG_CONTEXT>"))
    config.bos_token_id = config.eos_token_id = config.text_config.bos_token_id = config.text_config.eos_token_id = None
    config._attn_implementation = attn
    return config


def tiny_model(tok: Path, attn: str = "sdpa", seed: int = 0):
    """A random-init ``InternVLForConditionalGeneration`` with the real tile geometry and a tiny width.

    The vision tower is re-initialised with fan-in scaled weights and layer scale 1:
    with transformers' default init (std 0.02, layer scale 0.1) the first layer norm's
    gradient is ~1e-5, so small that summing it over ~10 tiles x 1025 patches in
    another order moves it by 4e-5 relative, which would hide a real mismatch in
    rounding noise (float64 agrees to 5e-8 either way).
    """
    torch.manual_seed(seed)
    model = transformers.InternVLForConditionalGeneration(tiny_config(tok, attn)).float()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.model.vision_tower.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p[0].numel()))
    return model


def _tile_ranges(rows) -> list[tuple[dict, int, int]]:
    """``(media, first tile, end tile)`` of every item in ``pixel_values`` order."""
    out, k = [], 0
    for r in rows:
        for m in sorted(r["media"], key=lambda m: int(m["token_offset"])):
            out.append((m, k, k + int(m["vision_units"])))
            k += int(m["vision_units"])
    return out


# ---------------------------------------------------------------------------------- packed == alone


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_equals_alone(packs, attn):
    rep = compare(tiny_model(packs["tokenizer"], attn), packs["packed"], attn)
    assert rep.n_rows >= 3 and rep.n_alone >= 8, rep
    assert rep.ok(), f"internvl {attn}: {rep}"


@pytest.mark.slow
def test_packed_equals_alone_flex_attention(packs):
    """The BlockMask form: loss and logits (flex attention has no CPU backward in torch). The vision
    tower keeps sdpa: it sees one tile at a time, never a pack, and flex would only recompile there."""
    model = tiny_model(packs["tokenizer"], "sdpa")
    model.set_attn_implementation({"text_config": "flex_attention", "vision_config": "sdpa"})
    rep = compare(model, packs["packed"], "flex_attention", grads=False)
    assert rep.ok(), f"internvl flex_attention: {rep}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention backward needs a GPU")
def test_flex_attention_gradients_on_gpu(packs):
    """Gradients too, where flex attention has a backward.

    The block mask is rebuilt on the GPU: ``model_inputs`` makes it on the CPU, and
    ``BlockMask.to`` moves its block tables but not the tensors its ``mask_mod`` reads.
    """
    sub = collate(packs["rows"], pixels=False)["subsegment_ids"]

    def on_gpu(inputs):
        return {**inputs, "attention_mask": block_mask(sub, device="cuda")}

    model = OnDevice(tiny_model(packs["tokenizer"], "flex_attention"), "cuda")
    rep = compare(model, packs["packed"], "flex_attention", mutate=on_gpu)
    assert rep.ok(), rep


class OnDevice(torch.nn.Module):
    """Runs ``model`` on ``device``: inputs (tensors, a ``BlockMask``) move there, logits come back to the CPU."""

    def __init__(self, model, device: str):
        super().__init__()
        self.inner = model.to(device)
        self.config = model.config
        self.device_ = device

    def forward(self, **kw):
        out = self.inner(**{k: v.to(self.device_) if hasattr(v, "to") else v for k, v in kw.items()})
        out.logits = out.logits.cpu()
        return out


def test_varlen_inputs_equal_alone_without_trees(packs):
    """The flash form (rows end to end, no mask, positions restarting per sample) is exact; run here
    by sdpa, which splits sequences at position resets exactly as varlen kernels do."""
    rep = compare(tiny_model(packs["tokenizer"], "sdpa"), packs["small"], "flash_attention_2")
    assert rep.n_alone >= 3 and rep.ok(), f"internvl flash form: {rep}"
    with pytest.raises(InputError, match="message trees"):
        model_inputs(packs["rows"], attn_implementation="flash_attention_2")


# ---------------------------------------------------------------------------------- wrong inputs fail


def test_boolean_mask_with_eager_fails_the_comparison(packs):
    """Eager attention adds its mask to the scores: a boolean mask there is silently wrong."""
    rep = compare(tiny_model(packs["tokenizer"], "eager"), packs["small"], "eager", mutate=boolean_mask)
    assert not rep.ok() and rep.logits > 1e-3, rep


def test_thumbnail_first_fails_the_comparison(packs):
    """Tiles in another order (the thumbnail before the grid tiles, one multi-tile image): caught."""
    rows = list(PackedDataset(packs["small"], shuffle=False))
    [(_, a, b)] = [t for t in _tile_ranges(rows) if t[0]["vision_units"] > 1 and t[0]["kind"] == "image"]

    def thumbnail_first(inputs):
        pv = inputs["pixel_values"].clone()
        pv[a:b] = torch.cat([pv[b - 1:b], pv[a:b - 1]])
        return {**inputs, "pixel_values": pv}

    rep = compare(tiny_model(packs["tokenizer"], "sdpa"), packs["small"], "sdpa", mutate=thumbnail_first)
    assert not rep.ok() and rep.logits > 1e-3, rep


# ---------------------------------------------------------------------------------- pixels


def test_pixels_are_the_processors_tiles_in_token_order(packs):
    """One tile per 256 placeholders, with the manifest's max_num; video frames are the counted ones, in order."""
    rows = packs["rows"]
    assert rows[0]["vision"]["max_num"] == MAX_NUM
    pv = model_inputs(rows)["pixel_values"]
    ranges = _tile_ranges(rows)
    assert pv.shape == (ranges[-1][2], 3, 448, 448)
    ctx = token_id(packs["tokenizer"], "<IMG_CONTEXT>")
    assert sum(int((np.asarray(r["input_ids"]) == ctx).sum()) for r in rows) == 256 * pv.shape[0]
    wide = next(m for m, _, _ in ranges if m["kind"] == "image" and m["vision_units"] > 1)
    assert (wide["vision_units"], wide["resized_width"], wide["resized_height"]) == (3, 896, 448)
    assert InternVL().image(80, 240).units == 4  # the default max_num would have cut 3x1 + thumbnail
    [(clip, a, b)] = [t for t in ranges if t[0]["kind"] == "video"]
    assert b - a == MAX_FRAMES == len(clip["timestamps"])
    brightness = pv[a:b].mean(dim=(1, 2, 3)).tolist()
    assert brightness == sorted(brightness) and brightness[0] < brightness[-1]  # grey frames brighten with time


def test_processor_mismatch_names_the_sample(packs):
    """Counted with --max-num 2, fed with 12: an error naming the sample, never misaligned tiles."""
    rows = packs["rows"]
    row = next(r for r in rows if "wide" in r["sample_ids"])
    with pytest.raises(InputError, match=r"sample 'wide' \(pack \d+\).*3x1 grid.*2x1 grid"):
        model_inputs([row], vision={**row["vision"], "max_num": 12})
    bad = {**row, "media": [{**m, "vision_units": 2} for m in row["media"]]}
    with pytest.raises(InputError, match="sample 'wide'.*counted 2 tiles"):
        model_inputs([bad])


def test_model_with_other_tiles_is_refused(packs):
    cfg = tiny_config(packs["tokenizer"], "sdpa")
    cfg.vision_config.patch_size = (28, 28)
    with pytest.raises(ConfigError, match="448x448 tiles of 64 tokens"):
        model_inputs(packs["rows"], config=cfg)


def test_other_tokenizer_is_refused(packs):
    """Placeholders that are not the checkpoint's ``<IMG_CONTEXT>`` (images and videos alike): refused by pack."""
    cfg = tiny_config(packs["tokenizer"], "sdpa")
    model_inputs(packs["rows"], config=cfg)
    cfg.image_token_id += 1
    with pytest.raises(InputError, match=r"pack \d+: its (image|video) placeholders are token \d+ but"):
        model_inputs(packs["rows"], config=cfg)


def test_rows_without_media_have_no_pixels(packs):
    family = get_family_inputs(packs["rows"][0]["vision"])
    assert family.pixels([{**packs["rows"][0], "media": []}], None) == {}


# ---------------------------------------------------------------------------------- grid choice


def _tie_sizes(max_num: int) -> list[tuple[int, int]]:
    """``(width, height)`` whose aspect is exactly halfway between two grids of equal area (where the
    candidate orders of packtool and transformers differ)."""
    out = []
    grids = target_ratios(1, max_num)
    for c1, r1 in grids:
        for c2, r2 in grids:
            if c1 * r1 == c2 * r2 and c1 < c2:
                mid = (Fraction(c1, r1) + Fraction(c2, r2)) / 2
                for scale in (1, 7, 100):
                    out.append((mid.numerator * scale, mid.denominator * scale))
    return out


def test_grid_choice_matches_transformers():
    """packtool's ``dynamic_preprocess`` grid is the one ``GotOcr2ImageProcessor`` cuts, for every ``max_num``,
    including the aspect ratios where equal-area grids tie (the only place their candidate orders differ)."""
    from transformers.models.got_ocr2.image_processing_got_ocr2 import (
        get_all_supported_aspect_ratios,
        get_optimal_tiled_canvas,
    )

    assert target_ratios(1, 12) != get_all_supported_aspect_ratios(1, 12)  # same grids, other order
    assert sorted(target_ratios(1, 12)) == sorted(get_all_supported_aspect_ratios(1, 12))
    rng = np.random.default_rng(0)
    for max_num in range(1, 13):
        fam = InternVL(max_num=max_num)
        sizes = _tie_sizes(max_num) + [tuple(int(x) for x in s) for s in rng.integers(1, 3000, (300, 2))]
        for w, h in sizes:
            cols, rows, _ = fam.tiles(h, w)
            assert (cols, rows) == tuple(get_optimal_tiled_canvas((h, w), (448, 448), 1, max_num)), (max_num, w, h)


def test_a_transparent_image_turned_by_exif_gives_its_counted_tiles(tmp_path):
    """With --exif apply, a transparent PNG whose EXIF says 'rotate 90' was counted turned (300x500, a 2x3
    grid) but fed to the processor unturned (500x300: the EXIF was lost when transparency was laid over
    white, before the turn): model_inputs refused every such pack."""
    from PIL import Image

    rng = np.random.default_rng(0)
    rgba = rng.integers(0, 256, (300, 500, 4), dtype=np.uint8)
    rgba[:50, :, 3] = 0
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees
    Image.fromarray(rgba, "RGBA").save(tmp_path / "turned.png", exif=exif.tobytes())
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "turned", "image": "turned.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "Noise."}]}])
    tok = byte_tokenizer(tmp_path / "tok", SPECIALS)
    packed = build(tmp_path, [data], tmp_path, max_tokens=4096,
                   tokenize={"model": "internvl", "tokenizer": str(tok), "max_num": MAX_NUM, "exif": "apply"})
    [row] = list(PackedDataset(packed))
    m = row["media"][0]
    assert (m["width"], m["height"], m["vision_units"]) == (300, 500, 3)  # 1x2 grid + thumbnail
    assert model_inputs([row])["pixel_values"].shape == (3, 3, 448, 448)
