"""The trainer side's cost per pack (``packtool.reader.hf.model_inputs``) beside a model forward on
the same pack, and the memory of a dense mask against a flex ``BlockMask``.

Per family: a corpus of photo-sized images (320x240 to 1024x768), some text-only samples and one
message tree, packed at 4,096 tokens. For each pack: positions (3-D mRoPE for Qwen-VL), the
dense boolean mask, the block mask, the pixels (the family's processor), the whole
``model_inputs`` call, and the forward (and forward + backward) of a tiny random-init model of
the family's class on those inputs. The tiny model is far cheaper than a real checkpoint, so
the ratio reader / forward here is an upper bound on the reader's share of a step.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from bench import best_s

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(_ROOT / "tests"))

SIZES = [(320, 240), (640, 480), (800, 600), (1024, 768), (480, 640)]


def _corpus(root: Path, n: int) -> list[Path]:
    from hf_harness import write_jsonl

    rng = np.random.default_rng(0)
    recs = []
    for i in range(n):
        if i % 5 == 4:
            recs.append({"id": f"t{i}", "conversations": [{"from": "human", "value": "Count to five. " * 8},
                                                          {"from": "gpt", "value": "One, two, three, four, five. " * 6}]})
            continue
        w, h = SIZES[i % len(SIZES)]
        Image.fromarray(rng.integers(0, 255, (h // 8, w // 8, 3), dtype=np.uint8)).resize((w, h)).save(root / f"i{i}.jpg")
        recs.append({"id": f"s{i}", "image": f"i{i}.jpg", "conversations": [
            {"from": "human", "value": "<image>\nDescribe the picture in detail."},
            {"from": "gpt", "value": "A noisy picture with many colours and no clear objects. " * 3}]})
    tree = [{"id": "tree", "image": "i1.jpg", "message_list": [
        {"question": f"Question {k}?", "answer": f"Answer number {k}, at some length." * 2, "style": "user_qa"}
        for k in range(4)]}]
    return [write_jsonl(root / "data.jsonl", recs), write_jsonl(root / "tree.jsonl", tree)]


def _ms(fn, repeat: int = 3) -> float:
    return best_s(fn, repeat) * 1e3


# family -> (test module with SPECIALS and tiny_model, extra tokenize settings, tiny_model takes the family name)
FAMILY_TESTS = {
    "qwen2.5-vl": ("test_hf_qwen", {"template": "chatml"}, True),
    "qwen3-vl": ("test_hf_qwen", {"template": "qwen3-vl"}, True),
    "qwen2-vl": ("test_hf_qwen", {"template": "chatml"}, True),
    "llava-ov": ("test_hf_llava_ov", {}, False),
    "internvl": ("test_hf_internvl", {"max_num": 6}, False),
    "molmo2": ("test_hf_molmo2", {"template": "molmo2", "max_crops": 4}, False),
}


def _family_rows(family: str, quick: bool):
    """(rows, sdpa model, (packed dir, model factory)) for one family, or None when its test module is absent."""
    import importlib

    from hf_harness import build, byte_tokenizer

    from packtool.reader import PackedDataset

    module, settings, by_name = FAMILY_TESTS[family]
    try:
        t = importlib.import_module(module)
    except ImportError:
        return None

    def make(form, tok):
        return t.tiny_model(family, tok, form) if by_name else t.tiny_model(tok, form)

    tmp = Path(tempfile.mkdtemp(prefix=f"bench-hf-{family}-"))
    inputs = _corpus(tmp, 16 if quick else 40)
    tok = byte_tokenizer(tmp / "tok", t.SPECIALS)
    packed = build(tmp, inputs, tmp, max_tokens=4096, tokenize={"model": family, "tokenizer": str(tok), **settings})
    rows = list(PackedDataset(packed, shuffle=False))
    return rows, make("sdpa", tok), (packed, lambda form: make(form, tok))


def _per_pack(family: str, rows: list, model) -> dict:
    import torch

    from packtool.reader import attention_mask
    from packtool.reader.hf import block_mask, get_family_inputs, model_inputs

    fam = get_family_inputs(rows[0]["vision"], model.config)
    out: dict[str, list[float]] = {k: [] for k in ("positions", "dense", "block", "pixels", "inputs", "fwd", "fwd_bwd")}
    for r in rows:
        n = len(r["input_ids"])
        sub = np.asarray(r["subsegment_ids"])[None]
        out["positions"].append(_ms(lambda r=r, n=n: fam.positions([r], n)))
        out["dense"].append(_ms(lambda r=r: attention_mask(r["subsegment_ids"])))
        out["block"].append(_ms(lambda sub=sub: block_mask(sub)))
        out["pixels"].append(_ms(lambda r=r: fam.pixels([r], None), repeat=1))
        out["inputs"].append(_ms(lambda r=r: model_inputs([r], config=model.config), repeat=1))
        kw = model_inputs([r], config=model.config)
        with torch.no_grad():
            out["fwd"].append(_ms(lambda kw=kw: model(**kw), repeat=1))

        def step(kw=kw):
            model(**kw).loss.backward()
            model.zero_grad(set_to_none=True)

        out["fwd_bwd"].append(_ms(step, repeat=1))
    return {k: statistics.median(v) for k, v in out.items()}


def _block_bytes(bm) -> int:
    total = 0
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
                 "full_q_num_blocks", "full_q_indices"):
        t = getattr(bm, name, None)
        if t is not None:
            total += t.numel() * t.element_size()
    return total


def _memory_rows() -> list[str]:
    """Dense masks against a BlockMask for one row of L tokens: 8 samples, one of them a 4-branch tree."""
    from packtool.reader.hf import block_mask

    lines = []
    for length in (4096, 16384):
        sub = np.empty(length, dtype=np.int64)
        bounds = np.linspace(0, length, 9).astype(int)
        for k in range(8):
            s, e = bounds[k], bounds[k + 1]
            sub[s:e] = k * 100000 + 10000
            if k == 3:  # a tree: prefix, then 4 branches
                cut = np.linspace(s + (e - s) // 2, e, 5).astype(int)
                for b in range(4):
                    sub[cut[b]:cut[b + 1]] = k * 100000 + b
        t0 = time.perf_counter()
        bm = block_mask(sub[None])
        ms = (time.perf_counter() - t0) * 1e3
        dense, eager = length * length, 4 * length * length
        blk = _block_bytes(bm)
        lines.append(f"| {length:,} | {dense / 2**20:,.0f} MiB | {eager / 2**20:,.0f} MiB | {blk / 2**10:,.1f} KiB "
                     f"| {dense / blk:,.0f}x | {ms:,.1f} ms |")
    return lines


def _equivalence(family: str, rows_dir_model) -> list[str]:
    """Packed against alone on the bench corpus: largest relative differences per attention form."""
    from hf_harness import compare

    from packtool.reader.hf import get_family_inputs

    packed, make_model = rows_dir_model
    forms = get_family_inputs({"name": family}).attn_implementations
    out = []
    for form in ("sdpa", "eager", "flex_attention"):
        if form not in forms:
            continue
        # flex attention has no backward pass on the CPU: loss and logits only there
        rep = compare(make_model(form), packed, form, grads=form != "flex_attention")
        grads = f"{rep.grads:.1e}" if form != "flex_attention" else "(no CPU backward)"
        out.append(f"| {family} | {form} | {rep.n_rows} | {rep.n_alone} | {rep.loss:.1e} | {rep.logits:.1e} | {grads} |")
    return out


def run(quick: bool = False) -> str:
    lines = ["| family | packs | tokens/pack | positions | dense mask | block mask | pixels | model_inputs (all) "
             "| tiny fwd | tiny fwd+bwd |", "|" + "---|" * 10]
    proof = ["", "Packed against each sample alone on the same corpus (largest relative difference):", "",
             "| family | form | packs | alone runs | summed loss | logits | gradients |", "|---|---|---|---|---|---|---|"]
    for family in FAMILY_TESTS:
        found = _family_rows(family, quick)
        if found is None:
            continue
        rows, model, packed_model = found
        proof += _equivalence(family, packed_model)
        t = _per_pack(family, rows, model)
        tokens = statistics.median(len(r["input_ids"]) for r in rows)
        lines.append(f"| {family} | {len(rows)} | {tokens:,.0f} | {t['positions']:.2f} ms | {t['dense']:.2f} ms "
                     f"| {t['block']:.2f} ms | {t['pixels']:.1f} ms | {t['inputs']:.1f} ms | {t['fwd']:.1f} ms "
                     f"| {t['fwd_bwd']:.1f} ms |")
    lines += ["", "Mask memory per row (bool dense for sdpa, float32 dense for eager, BlockMask for flex, 128-token blocks):",
              "", "| tokens | dense bool | dense float32 | BlockMask | bool / block | build |", "|---|---|---|---|---|---|"]
    lines += _memory_rows()
    return "\n".join(lines + proof)
