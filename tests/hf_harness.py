"""Packed == alone, on the real ``transformers`` model classes (shared by tests/test_hf_*.py).

:func:`compare` runs a packed directory two ways through one tiny random-init model:

* **packed**: every row of the directory in one batch (so padding is exercised too),
  ``model(**model_inputs(rows, attn_implementation=...))``;
* **alone**: every sample of every row on its own, and every branch of a message tree
  with its prefix, through the model's *own* default path: no ``position_ids`` and no
  ``attention_mask`` are passed, so the model computes its own positions (mRoPE via its
  ``get_rope_index``) and its own causal mask. Only the pixels come from packtool (the
  same processor call for one sample), plus what a processor returns beside them
  (``alone_extra``).

It then compares the summed loss, the logits of every token and the gradient of every
parameter. A tree's shared prefix carries its loss once: in the alone runs, branches
after the first have their prefix targets masked, so both sides sum the same terms.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from packtool.reader import PackedDataset
from packtool.reader.hf import get_family_inputs, loss_tokens, model_inputs, sample_spans

RTOL = 1e-5

#: Every special token a family's template or layout uses, for :func:`byte_tokenizer`.
FAMILY_SPECIALS = sorted({"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                          "<|image_pad|>", "<|video_pad|>", "<img>", "</img>", "<IMG_CONTEXT>", "<image>", "<video>",
                          "<im_patch>", "<im_col>", "<im_start>", "<low_res_im_start>", "<im_end>", "<frame_start>",
                          "<frame_end>", "<im_low>", "<|image|>", "<|video|>"})
#: Tokenize settings per family that keep :func:`standard_corpus` small.
FAMILY_SETTINGS = {
    "qwen2.5-vl": {"template": "chatml", "max_pixels": 128 * 28 * 28},
    "qwen3-vl": {"template": "qwen3-vl", "max_pixels": 128 * 28 * 28},
    "molmo2": {"template": "molmo2", "max_crops": 2, "max_frames": 2},
    "internvl": {"max_num": 2, "max_frames": 2},
    "llava-ov": {"template": "chatml", "max_frames": 2},
}


def _static_flex_shapes() -> None:
    """torch 2.14's inductor cannot build flex attention's CPU kernel for dynamic shapes (C++ compile
    error: ``cur_kvSplitSize`` undeclared). A recompile for a new sequence length turns dynamic shapes
    on, and a whole test session compiles flex for many lengths, so keep shapes static here."""
    try:
        import torch._dynamo
    except ImportError:
        return
    torch._dynamo.config.automatic_dynamic_shapes = False


_static_flex_shapes()


def byte_tokenizer(directory: Path, specials: list[str]) -> Path:
    """A real ``tokenizer.json``: one id per byte (no merges), then ``specials`` (a small vocabulary,
    so tiny models stay tiny)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials))
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    tok.save(str(path))
    return path


def token_id(tokenizer_json: Path, token: str) -> int:
    from tokenizers import Tokenizer

    i = Tokenizer.from_file(str(tokenizer_json)).token_to_id(token)
    if i is None:
        raise KeyError(token)
    return int(i)


def vocab_size(tokenizer_json: Path) -> int:
    from tokenizers import Tokenizer

    return int(Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True))


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def noise_image(path: Path, size: tuple[int, int], seed: int) -> str:
    """A seeded random-noise image of ``size`` (width, height) at ``path``; returns its file name."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    return path.name


def standard_corpus(root: Path) -> dict:
    """The corpus the family tests share: text-only, one image over two turns, a large image (640x480,
    capped by the family's resize settings), two images in one sample, a 2 s video and a 3-branch tree.

    Returns ``{"root": root, "inputs": [data.jsonl, tree.jsonl]}``.
    """
    from video_fixtures import write_video

    small = noise_image(root / "small.png", (84, 56), 1)
    wide = noise_image(root / "wide.png", (150, 90), 2)
    big = noise_image(root / "big.jpg", (640, 480), 3)
    write_video(root / "clip.mp4", n_frames=20, fps=10, size=(64, 48))
    records = [
        {"id": "text", "conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "Hi there."}]},
        {"id": "one", "image": small, "conversations": [
            {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "Noise."},
            {"from": "human", "value": "Sure?"}, {"from": "gpt", "value": "Quite."}]},
        {"id": "big", "image": big, "conversations": [
            {"from": "human", "value": "Describe <image> briefly."}, {"from": "gpt", "value": "Static."}]},
        {"id": "two", "image": [small, wide], "conversations": [
            {"from": "human", "value": "<image> and <image>: same?"}, {"from": "gpt", "value": "No."}]},
        {"id": "clip", "video": "clip.mp4", "conversations": [
            {"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": "It brightens."}]},
    ]
    tree = [{"id": "tree", "image": wide, "message_list": [
        {"question": "Colour?", "answer": "Many.", "style": "user_qa"},
        {"question": "Shape?", "answer": "A wide box.", "style": "user_qa"},
        {"messages": ["Size?", "Small.", "Exactly?", "150 by 90."]}]}]
    return {"root": root, "inputs": [write_jsonl(root / "data.jsonl", records), write_jsonl(root / "tree.jsonl", tree)]}


def build(tmp: Path, inputs: list[Path], media_root: Path, *, max_tokens: int, tokenize: dict, pack: dict | None = None,
          name: str = "packed") -> Path:
    """Tokenize ``inputs`` and pack them with the library; returns the packed directory."""
    from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset

    tok_dir, packed = tmp / f"{name}-tok", tmp / name
    tokenize_dataset(inputs, tok_dir, TokenizeConfig(media_root=str(media_root), **tokenize))
    pack_dataset(tok_dir, packed, PackConfig(max_tokens=max_tokens, **(pack or {})))
    return packed


@dataclass
class Report:
    """Largest relative differences, packed against alone."""

    loss: float = 0.0
    logits: float = 0.0
    grads: float = 0.0
    worst_grad: str = ""
    n_alone: int = 0
    n_rows: int = 0
    n_items: int = 0
    details: dict = field(default_factory=dict)

    def ok(self, rtol: float = RTOL) -> bool:
        return max(self.loss, self.logits, self.grads) <= rtol

    def __str__(self) -> str:
        return (f"loss {self.loss:.2e}, logits {self.logits:.2e}, grads {self.grads:.2e} ({self.worst_grad}); "
                f"{self.n_rows} rows, {self.n_alone} alone runs, {self.n_items} loss tokens")


def _rel(a, b) -> float:
    import torch

    scale = float(torch.max(torch.abs(b))) if b.numel() else 0.0
    return float(torch.max(torch.abs(a - b))) / max(scale, 1e-12) if a.numel() else 0.0


def boolean_mask(inputs: dict) -> dict:
    """A deliberately wrong input: eager attention's additive mask swapped for the boolean form sdpa reads
    (eager adds the mask to the scores, so this is silently wrong)."""
    return {**inputs, "attention_mask": inputs["attention_mask"] == 0}


def alone_rows(row: dict) -> list[tuple[np.ndarray, dict]]:
    """Each sample of a packed row, and each branch with its prefix, as ``(row positions, alone row)``.

    Branches after the first have their prefix targets masked (the prefix's loss counts once).
    """
    out = []
    ids = np.asarray(row["input_ids"], dtype=np.int64)
    tgt = np.asarray(row["target_ids"], dtype=np.int64)
    for k, (s, p, branches) in enumerate(sample_spans(row)):
        end = branches[-1][1] if branches else p
        media = [m for m in row["media"] if s <= int(m["token_offset"]) < end]
        for b, (bs, be) in enumerate(branches or [(p, p)]):
            idx = np.concatenate([np.arange(s, p), np.arange(bs, be)])
            t = tgt[idx].copy()
            if b > 0:
                t[: p - s] = -100
            rebased = []
            for m in media:
                off = int(m["token_offset"])
                if off < p:
                    new = off - s
                elif bs <= off < be:
                    new = off - bs + (p - s)
                else:
                    continue  # media of another branch
                rebased.append({**m, "token_offset": new, "sample_index": 0})
            sid = (row.get("sample_ids") or ["?"] * (k + 1))[k]
            alone = {"input_ids": ids[idx], "target_ids": t, "position_ids": np.arange(len(idx)),
                     "subsegment_ids": np.full(len(idx), 10000), "cu_seqlens": np.array([0, len(idx)]),
                     "media": rebased, "sample_ids": [sid], "pack_index": row.get("pack_index"),
                     "vision": row.get("vision")}
            out.append((idx, alone))
    return out


def compare(model, packed_dir: Path, attn_implementation: str, *, alone_extra: Callable | None = None,
            mutate: Callable | None = None, media_root: Path | None = None, grads: bool = True) -> Report:
    """Run ``packed_dir`` packed and alone through ``model``; return the largest relative differences.

    Args:
        model: a ``transformers`` model built with ``attn_implementation``.
        attn_implementation: passed to ``model_inputs``.
        alone_extra: ``f(family, alone_row) -> dict`` of extra keyword arguments for an
            alone run (what a processor returns beside the pixels); default: the family's
            ``extra`` hook (token type ids), never positions or masks.
        mutate: ``f(inputs) -> inputs`` applied to the packed inputs (deliberately wrong inputs).
        grads: also compare gradients (flex attention has no backward on the CPU).
    """
    import torch

    torch.manual_seed(0)
    model.eval()  # no dropout; gradients still flow
    rows = list(PackedDataset(packed_dir, shuffle=False))
    n_items = loss_tokens(rows)
    family = get_family_inputs(rows[0]["vision"], model.config)
    report = Report(n_rows=len(rows), n_items=n_items)

    # packed
    inputs = model_inputs(rows, attn_implementation=attn_implementation, media_root=media_root, config=model.config)
    if mutate is not None:
        inputs = mutate(inputs)
    varlen = attn_implementation.startswith("flash")
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grads):
        out = model(**inputs)
    if grads:
        out.loss.backward()
    packed_loss = float(out.loss.detach()) * n_items
    packed_logits = out.logits.detach()
    packed_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    # alone
    model.zero_grad(set_to_none=True)
    alone_loss = 0.0
    worst_logits = 0.0
    offset = 0
    for i, row in enumerate(rows):
        for idx, alone in alone_rows(row):
            kw = family.pixels([alone], media_root)
            kw.update(alone_extra(family, alone) if alone_extra else family.extra([alone], {"input_ids": alone["input_ids"][None]}))
            ids = torch.from_numpy(alone["input_ids"])[None]
            tgt = torch.from_numpy(alone["target_ids"])[None]
            with torch.set_grad_enabled(grads):
                o = model(input_ids=ids, labels=tgt, shift_labels=tgt, num_items_in_batch=torch.tensor(n_items),
                          use_cache=False, **kw)
            if grads:
                o.loss.backward()
            alone_loss += float(o.loss.detach()) * n_items
            where = (0, torch.from_numpy(idx + offset)) if varlen else (i, torch.from_numpy(idx))
            worst_logits = max(worst_logits, _rel(packed_logits[where[0], where[1]], o.logits[0].detach()))
            report.n_alone += 1
        if varlen:
            offset += len(row["input_ids"])
    report.loss = abs(packed_loss - alone_loss) / max(abs(alone_loss), 1e-12)
    report.logits = worst_logits
    report.details = {"packed_loss_sum": packed_loss, "alone_loss_sum": alone_loss}
    # a gradient that is zero in theory (e.g. a key bias under softmax) computes as rounding noise:
    # measure every parameter against at least 1e-6 of the model's largest gradient, not against its own noise
    alone_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    floor = 1e-6 * max((float(g.abs().max()) for g in alone_grads.values()), default=0.0)
    for n, p in model.named_parameters():
        if n not in alone_grads and n not in packed_grads:
            continue
        a = packed_grads.get(n, torch.zeros_like(p))
        b = alone_grads.get(n, torch.zeros_like(p))
        r = float(torch.max(torch.abs(a - b))) / max(float(torch.max(torch.abs(b))), floor, 1e-12)
        if r > report.grads:
            report.grads, report.worst_grad = r, n
    model.zero_grad(set_to_none=True)
    return report
