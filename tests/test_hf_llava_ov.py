"""LLaVA-OneVision: packed rows == each sample alone on the real ``LlavaOnevisionForConditionalGeneration``.

A tiny random-init model (SigLIP tower at the real 384-px / 14-px geometry, so every crop
gives the real 27x27 features; two-layer Qwen2) is built from config. The corpus holds a
text-only sample, a single image that tiles to 1x2 crops, a two-image sample (one crop
each), a video of which 4 of 6 frames are counted, and a message tree (three answers to
one image). See ``tests/hf_harness.py`` for what "packed" and "alone" mean.

flex attention has no backward on the CPU in torch, so its check here is forward-only
(loss and logits), and it is slow (inductor compiles the kernel); a fast test shows its
block mask is the sdpa mask.
"""

from __future__ import annotations

import doctest
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("torchvision")

from hf_harness import (  # noqa: E402
    alone_rows,
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
from packtool.reader import PackedDataset, decode_image, decode_video  # noqa: E402
from packtool.reader.hf import get_family_inputs, llava_ov, model_inputs  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"]
MAX_TOKENS = 3072
MAX_FRAMES = 4
MINI_MAX_TOKENS = 1600


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("llava-ov-corpus")
    small = noise_image(root / "small.png", (60, 40), 1)  # one 384 tile: 1261 tokens
    wide = noise_image(root / "wide.png", (500, 100), 2)  # tiles to 1x2 crops (3 with the base view): 1334 tokens
    square = noise_image(root / "square.jpg", (50, 50), 3)
    write_video(root / "clip.mp4", n_frames=6, fps=10, size=(64, 48), step=40)  # 4 of 6 frames counted
    records = [
        {"id": "text", "conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "Hi there."}]},
        {"id": "wide", "image": wide, "conversations": [
            {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "Noise."},
            {"from": "human", "value": "Sure?"}, {"from": "gpt", "value": "Quite."}]},
        {"id": "two", "image": [small, square], "conversations": [
            {"from": "human", "value": "<image> and <image>: same?"}, {"from": "gpt", "value": "No."}]},
        {"id": "clip", "video": "clip.mp4", "conversations": [
            {"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": "It brightens."}]},
    ]
    tree = [{"id": "tree", "image": small, "message_list": [
        {"question": "Colour?", "answer": "Many.", "style": "user_qa"},
        {"question": "Shape?", "answer": "A wide box.", "style": "user_qa"},
        {"messages": ["Size?", "Small.", "Exactly?", "60 by 40."]}]}]
    by_id = {r["id"]: r for r in records}
    return {"root": root, "inputs": [write_jsonl(root / "data.jsonl", records), write_jsonl(root / "tree.jsonl", tree)],
            # eager attention materialises (rows, heads, L, L) scores: its checks run on shorter rows
            "mini": [write_jsonl(root / "mini.jsonl", [by_id["text"], by_id["two"]]), root / "tree.jsonl"],
            "no_trees": [write_jsonl(root / "flat.jsonl", [by_id["text"], by_id["wide"], by_id["clip"]])]}


@pytest.fixture(scope="module")
def packs(corpus, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("llava-ov")
    tok = byte_tokenizer(tmp / "tok", SPECIALS)
    tokenize = {"model": "llava-ov", "template": "chatml", "tokenizer": str(tok), "max_frames": MAX_FRAMES}
    packed = build(tmp, corpus["inputs"], corpus["root"], max_tokens=MAX_TOKENS, tokenize=tokenize)
    mini = build(tmp, corpus["mini"], corpus["root"], max_tokens=MINI_MAX_TOKENS, tokenize=tokenize, name="mini")
    return {"tokenizer": tok, "packed": packed, "mini": mini, "rows": list(PackedDataset(packed, shuffle=False)),
            "tokenize": tokenize}


def tiny_model(tok: Path, attn: str = "sdpa", seed: int = 0, **overrides):
    """A random-init ``LlavaOnevisionForConditionalGeneration``: one-layer SigLIP, two-layer Qwen2, float32."""
    vision = {"model_type": "siglip_vision_model", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 384, "patch_size": 14, "vision_use_head": False}
    text = {"model_type": "qwen2", "vocab_size": vocab_size(tok), "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 4096}
    config = transformers.LlavaOnevisionConfig(vision_config=vision, text_config=text,
                                               image_token_id=token_id(tok, "<image>"),
                                               video_token_id=token_id(tok, "<video>"), **overrides)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = transformers.LlavaOnevisionForConditionalGeneration(config).float().eval()
    # SigLIP's key bias adds the same q.b to every score of a query, which softmax ignores: its
    # gradient is exactly zero, computed as float noise (~1e-11) whose relative difference means
    # nothing. Frozen, it has no gradient on either side and the harness skips it.
    for name, p in model.model.vision_tower.named_parameters():
        if name.endswith("self_attn.k_proj.bias"):
            p.requires_grad_(False)
    return model


# ---------------------------------------------------------------------------- packed == alone


def test_corpus_exercises_every_case(packs):
    rows = packs["rows"]
    assert len(rows) >= 2 and any(len(r["sample_ids"]) >= 3 for r in rows)
    units = {m["path"]: m["vision_units"] for r in rows for m in r["media"] if m["kind"] == "image"}
    assert units["wide.png"] == 3  # base view + 1x2 tiles
    video = next(m for r in rows for m in r["media"] if m["kind"] == "video")
    assert len(video["timestamps"]) == MAX_FRAMES and video["n_tokens"] == MAX_FRAMES * 196 + 1


def test_packed_equals_alone_sdpa(packs):
    rep = compare(tiny_model(packs["tokenizer"], "sdpa"), packs["packed"], "sdpa")
    assert rep.n_rows >= 2 and rep.n_alone >= 7, rep
    assert rep.ok(), f"sdpa: {rep}"


def test_packed_equals_alone_eager(packs):
    """Eager, on the shorter rows (a text-only and a two-image sample in one row, the tree in another)."""
    rep = compare(tiny_model(packs["tokenizer"], "eager"), packs["mini"], "eager")
    assert rep.n_rows >= 2 and rep.n_alone >= 5, rep
    assert rep.ok(), f"eager: {rep}"


@pytest.mark.slow
def test_packed_equals_alone_flex_forward(packs):
    """flex attention (text model; the SigLIP tower keeps sdpa, it sees no packing): same loss and logits."""
    model = tiny_model(packs["tokenizer"], "sdpa")
    model.set_attn_implementation({"text_config": "flex_attention", "vision_config": "sdpa"})
    rep = compare(model, packs["packed"], "flex_attention", grads=False)
    assert rep.ok(), f"flex_attention: {rep}"


def test_flex_block_mask_is_the_sdpa_mask(packs):
    """The BlockMask packtool builds for flex attention allows exactly the sdpa mask's (q, k) pairs."""
    rows = packs["rows"]
    dense = model_inputs(rows, attn_implementation="sdpa")["attention_mask"][:, 0]
    bm = model_inputs(rows, attn_implementation="flex_attention")["attention_mask"]
    b, length = dense.shape[:2]
    q, k = torch.arange(length)[:, None], torch.arange(length)[None, :]
    flex = torch.stack([bm.mask_mod(torch.tensor(i), torch.tensor(0), q, k) for i in range(b)])
    assert torch.equal(flex, dense)


def test_varlen_inputs_equal_alone_without_trees(packs, corpus, tmp_path):
    """The flash form (rows end to end, no mask, positions restarting per sample), run by sdpa, which splits
    sequences from those position ids as varlen kernels do."""
    flat = build(tmp_path, corpus["no_trees"], corpus["root"], max_tokens=MAX_TOKENS, tokenize=packs["tokenize"])
    rep = compare(tiny_model(packs["tokenizer"], "sdpa"), flat, "flash_attention_2")
    assert rep.ok(), f"flash form: {rep}"
    with pytest.raises(InputError, match="message trees"):
        model_inputs(packs["rows"], attn_implementation="flash_attention_2")


# ---------------------------------------------------------------------------- wrong inputs fail


def test_boolean_mask_with_eager_fails_the_comparison(packs):
    """Eager attention adds its mask to the scores: a boolean mask there is silently wrong."""
    rep = compare(tiny_model(packs["tokenizer"], "eager"), packs["mini"], "eager", mutate=boolean_mask)
    assert not rep.ok() and rep.logits > 1e-3, rep


def test_one_causal_mask_per_row_fails_the_comparison(packs):
    """Samples that see each other (a plain causal mask over the whole row) change every later sample."""
    def causal(inputs):
        mask = inputs["attention_mask"]
        real = mask.any(-1, keepdim=True)  # padding queries keep their own rule
        return {**inputs, "attention_mask": torch.where(real, torch.ones_like(mask).tril(), mask)}

    rep = compare(tiny_model(packs["tokenizer"], "sdpa"), packs["mini"], "sdpa", mutate=causal)
    assert not rep.ok() and rep.logits > 1e-3, rep


@pytest.mark.parametrize("wrong", ["no batch_num_images", "images counted per row"])
def test_images_not_grouped_per_sample_break_the_model(packs, wrong):
    """Images passed flat (every one tiled) or grouped per row (a row's single images taken for a multi-image
    sample) give features that do not fit the counted placeholders: the model refuses them."""
    rows = packs["rows"]
    model = tiny_model(packs["tokenizer"], "sdpa")
    inputs = model_inputs(rows, config=model.config)
    if wrong == "no batch_num_images":
        inputs.pop("batch_num_images")
    else:
        per_row = [sum(m["kind"] == "image" for m in r["media"]) for r in rows]
        inputs["batch_num_images"] = torch.tensor([n for n in per_row if n])
    assert not torch.equal(inputs.get("batch_num_images", torch.empty(0)), model_inputs(rows)["batch_num_images"])
    with pytest.raises((RuntimeError, ValueError)), torch.no_grad():
        model(**inputs)


# ---------------------------------------------------------------------------- pixels


def test_images_grouped_per_sample(packs):
    rows = packs["rows"]
    out = model_inputs(rows)
    samples = [(i, m["sample_index"]) for i, r in enumerate(rows)
               for m in sorted(r["media"], key=lambda m: m["token_offset"]) if m["kind"] == "image"]
    want = [samples.count(s) for s in dict.fromkeys(samples)]
    assert out["batch_num_images"].tolist() == want and sorted(want) == [1, 1, 2]
    # wide: base + 2 tiles; tree's image alone in its sample: base + 1 tile; the two-image sample: 1 crop each
    assert out["pixel_values"].shape == (3 + 2 + 1 + 1, 3, 384, 384)
    sizes = {tuple(s) for s in out["image_sizes"].tolist()}
    assert sizes == {(100, 500), (40, 60), (50, 50)}


def test_pixels_and_counts_are_the_processors(packs):
    """The real ``LlavaOnevisionProcessor`` on each sample alone expands ``<image>`` / ``<video>`` to the counted
    tokens and makes the same pixels (its 5-D padded form, padding dropped)."""
    from tokenizers import Tokenizer

    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(packs["tokenizer"])))
    family = get_family_inputs(packs["rows"][0]["vision"])
    processor = transformers.LlavaOnevisionProcessor(
        image_processor=family.image_processor(), video_processor=family.video_processor(), tokenizer=tok,
        num_image_tokens=729, vision_feature_select_strategy="full")
    image_id, video_id = token_id(packs["tokenizer"], "<image>"), token_id(packs["tokenizer"], "<video>")
    checked = 0
    for row in packs["rows"]:
        for _, alone in alone_rows(row):
            media = alone["media"]
            if not media:
                continue
            ours = family.pixels([alone], None)
            images = [decode_image(m) for m in media if m["kind"] == "image"]
            videos = [torch.stack([torch.from_numpy(np.array(f)).permute(2, 0, 1) for f in decode_video(m).frames])
                      for m in media if m["kind"] == "video"]
            text = " x ".join("<video>" if m["kind"] == "video" else "<image>" for m in media)
            ref = processor(text=[text], images=[images] if images else None, videos=videos or None,
                            return_tensors="pt")
            ids = ref["input_ids"][0].numpy()
            runs = np.split(ids, np.flatnonzero(np.diff(np.isin(ids, [image_id, video_id]).astype(int))) + 1)
            counted = [len(r) for r in runs if r[0] in (image_id, video_id)]
            assert counted == [m["n_tokens"] for m in media], alone["sample_ids"]
            if images:
                crops = torch.cat([pv[:n] for pv, n in zip(ref["pixel_values"], _crops(family, ref), strict=True)])
                assert torch.equal(crops, ours["pixel_values"])
                assert torch.equal(ref["batch_num_images"], ours["batch_num_images"])
            if videos:
                assert torch.equal(ref["pixel_values_videos"], ours["pixel_values_videos"])
            checked += 1
    assert checked >= 5


def _crops(family, ref) -> list[int]:
    tiled = [n == 1 for n in ref["batch_num_images"].tolist() for _ in range(n)]
    return [family.image_crops(*s) if t else 1 for s, t in zip(ref["image_sizes"].tolist(), tiled, strict=True)]


def test_videos_are_the_counted_frames(packs):
    """The embedded frames are used as they are: frame i of the test video is grey level 40*i, and the counted
    timestamps (0, 0.1, 0.3, 0.5 s at 10 fps) pick frames 0, 1, 3, 5."""
    row = next(r for r in packs["rows"] if any(m["kind"] == "video" for m in r["media"]))
    video = model_inputs([row])["pixel_values_videos"]
    assert video.shape == (1, MAX_FRAMES, 3, 384, 384)
    grey = ((video[0].mean(dim=(1, 2, 3)) * 0.5 + 0.5) * 255).tolist()
    assert np.allclose(grey, [0, 40, 120, 200], atol=4), grey


def test_videos_of_different_lengths_are_refused(packs):
    row = next(r for r in packs["rows"] if any(m["kind"] == "video" for m in r["media"]))
    shorter = {**row, "pack_index": 99, "media": [
        {**m, "frames": m["frames"][:2], "timestamps": m["timestamps"][:2], "n_tokens": 2 * 196 + 1}
        if m["kind"] == "video" else m for m in row["media"]]}
    family = get_family_inputs(row["vision"])
    assert family.pixels([shorter], None)["pixel_values_videos"].shape[1] == 2
    with pytest.raises(InputError, match=r"videos of \[2, 4\] frames"):
        family.pixels([row, shorter], None)


# ---------------------------------------------------------------------------- counts checked


def test_model_with_other_tiling_names_the_sample(packs):
    """A model tiling with other pinpoints would give the wide image other features: refused, naming the sample."""
    model = tiny_model(packs["tokenizer"], image_grid_pinpoints=[[384, 384], [768, 768]])
    row = next(r for r in packs["rows"] if "wide" in r["sample_ids"])
    with pytest.raises(InputError, match=r"sample 'wide' \(pack \d+\).*gives \d+ vision tokens where tokenize counted 1334"):
        model_inputs([row], config=model.config)


def test_changed_video_frames_name_the_sample(packs):
    row = next(r for r in packs["rows"] if any(m["kind"] == "video" for m in r["media"]))
    bad = {**row, "media": [{**m, "frames": m["frames"][:3], "timestamps": m["timestamps"][:3]} if m["kind"] == "video"
                            else m for m in row["media"]]}
    with pytest.raises(InputError, match="sample 'clip'.*3 frames"):
        model_inputs([bad])


def test_unsupported_configs_are_clear():
    cfg = transformers.LlavaOnevisionConfig(vision_feature_select_strategy="default")
    with pytest.raises(ConfigError, match="no CLS token"):
        get_family_inputs({"name": "llava-ov"}, cfg)


def test_no_positions_or_extras(packs):
    """1-D positions restarting per sample (rotary attention needs no more); no extra keyword arguments."""
    rows = packs["rows"]
    out = model_inputs(rows)
    assert out["position_ids"].shape == out["input_ids"].shape
    assert set(out) == {"input_ids", "labels", "shift_labels", "position_ids", "attention_mask", "num_items_in_batch",
                        "use_cache", "pixel_values", "image_sizes", "batch_num_images", "pixel_values_videos"}


def test_docstring_examples():
    assert doctest.testmod(llava_ov).failed == 0


def test_an_image_turned_by_exif_is_fed_turned(tmp_path):
    """With --exif apply, a photo whose EXIF says 'rotate 90' was counted turned (300x700: 2,025 tokens) but
    decoded unturned for the processor (700x300: 1,994 tokens): model_inputs refused the pack, and an image
    whose turn kept the count (a square) would have reached the model on its side."""
    from PIL import Image, ImageOps

    rng = np.random.default_rng(0)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees
    Image.fromarray(rng.integers(0, 256, (300, 700, 3), dtype=np.uint8)).save(tmp_path / "turned.jpg", exif=exif.tobytes())
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "turned", "image": "turned.jpg", "conversations": [
        {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "Noise."}]}])
    tok = byte_tokenizer(tmp_path / "tok", SPECIALS)
    packed = build(tmp_path, [data], tmp_path, max_tokens=4096,
                   tokenize={"model": "llava-ov", "template": "chatml", "tokenizer": str(tok), "exif": "apply"})
    [row] = list(PackedDataset(packed))
    assert (row["media"][0]["width"], row["media"][0]["height"], row["media"][0]["n_tokens"]) == (300, 700, 2025)
    got = model_inputs([row])
    with Image.open(tmp_path / "turned.jpg") as im:
        want = get_family_inputs(row["vision"]).image_processor()(images=[[ImageOps.exif_transpose(im).convert("RGB")]],
                                                                 return_tensors="pt")
    assert got["image_sizes"].tolist() == [[700, 300]]
    assert torch.equal(got["pixel_values"], want["pixel_values"][0])
