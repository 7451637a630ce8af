"""The mask forms of ``packtool.reader.hf`` against the reader's dense rule (``attention_mask``).

The flex ``BlockMask`` is built from per-block summaries without a dense mask; here it is
expanded back (full tiles True, partial tiles through its ``mask_mod``, empty tiles False)
and compared cell by cell with ``attention_mask`` on random packed rows: samples, message
trees, padding, bidirectional image spans, several block sizes.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from packtool.reader import attention_mask  # noqa: E402
from packtool.reader.hf import block_mask, eager_mask, sample_spans  # noqa: E402

SEED = 20261130


def _random_row(rng: np.random.Generator) -> tuple[np.ndarray, list[dict]]:
    length = int(rng.integers(40, 700))
    sub: list[int] = []
    k = 0
    while len(sub) < length:
        n = int(rng.integers(1, 150))
        if rng.random() < 0.4:  # a tree: prefix, then 1-3 branches
            sub += [k * 100000 + 10000] * int(rng.integers(1, n + 1))
            for b in range(int(rng.integers(1, 4))):
                sub += [k * 100000 + b] * int(rng.integers(1, 40))
        else:
            sub += [k * 100000 + 10000] * n
        k += 1
    row = np.array(sub[:length] + [-1] * int(rng.integers(0, 40)))
    media = []
    first = int(np.argmax(row // 100000 != 0)) or length
    if first > 8 and rng.random() < 0.6:
        media = [{"token_offset": 2, "n_tokens": int(rng.integers(2, first - 3)), "sample_index": 0}]
    return row, media


def _expand(bm, n: int, bs: int) -> np.ndarray:
    from torch.nn.attention.flex_attention import create_mask

    cells = create_mask(bm.mask_mod, 1, 1, n, n, device="cpu")[0, 0].numpy()
    partial = np.zeros_like(bm.to_dense()[0, 0].numpy(), dtype=bool)
    kn, ki = bm.kv_num_blocks[0, 0].numpy(), bm.kv_indices[0, 0].numpy()
    fn, fi = bm.full_kv_num_blocks[0, 0].numpy(), bm.full_kv_indices[0, 0].numpy()
    out = np.zeros((n, n), dtype=bool)
    for q in range(len(kn)):
        for kb in ki[q, : kn[q]]:
            partial[q, kb] = True
            sl = (slice(q * bs, (q + 1) * bs), slice(kb * bs, (kb + 1) * bs))
            out[sl] = cells[sl]
        for kb in fi[q, : fn[q]]:
            out[q * bs:(q + 1) * bs, kb * bs:(kb + 1) * bs] = True
    return out


@pytest.mark.parametrize("trial", range(40))
def test_block_mask_equals_the_dense_rule(trial):
    rng = np.random.default_rng([SEED, trial])
    sub, media = _random_row(rng)
    vision = str(rng.choice(["causal", "media", "sample"])) if media else "causal"
    bs = int(rng.choice([16, 32, 128]))
    want = attention_mask(sub, media, vision=vision)
    got = _expand(block_mask(sub[None], media=[media], vision=vision, block_size=bs), len(sub), bs)
    bad = np.argwhere(got != want)
    assert len(bad) == 0, f"seed [{SEED}, {trial}], vision {vision}, block {bs}: first wrong cells {bad[:5].tolist()}"


def test_block_mask_skips_what_no_query_sees():
    """Eight samples of 512 tokens at 128-token blocks: only tiles inside a sample are kept, and the
    ones strictly below the diagonal are full (no mask_mod call)."""
    sub = np.repeat(np.arange(8) * 100000 + 10000, 512)
    bm = block_mask(sub[None])
    full = int(bm.full_kv_num_blocks.sum())
    partial = int(bm.kv_num_blocks.sum())
    assert (partial, full) == (32, 8 * 6)  # 4 diagonal tiles per sample; 4*3/2 below them


def test_eager_mask_is_additive():
    allowed = attention_mask([10000, 10000, 0, 1])
    add = eager_mask(allowed)
    assert add.dtype == torch.float32
    assert torch.equal(add == 0, torch.from_numpy(allowed))
    assert float(add.min()) == torch.finfo(torch.float32).min
    assert eager_mask(allowed, torch.bfloat16).dtype == torch.bfloat16


def test_sample_spans_of_a_tree_row():
    row = {"cu_seqlens": [0, 3, 9], "subsegment_ids": [10000] * 3 + [110000] * 2 + [100000] * 2 + [100001] * 2}
    assert sample_spans(row) == [(0, 3, []), (3, 5, [(5, 7), (7, 9)])]


def test_docstring_examples():
    import doctest

    import packtool.reader.hf as hf
    import packtool.reader.hf.qwen as qwen

    for mod in (hf, qwen):
        failed, _ = doctest.testmod(mod)
        assert failed == 0, mod.__name__


def test_block_mask_pickles_for_dataloader_workers():
    """A BlockMask made in a DataLoader worker travels to the trainer by pickle."""
    import pickle

    sub = np.repeat(np.arange(3) * 100000 + 10000, 100)[None]
    bm = block_mask(sub, block_size=32)
    back = pickle.loads(pickle.dumps(bm))
    q, k = torch.arange(300)[:, None], torch.arange(300)[None, :]
    zero = torch.tensor(0)
    assert torch.equal(back.mask_mod(zero, zero, q, k), bm.mask_mod(zero, zero, q, k))
    assert torch.equal(back.kv_num_blocks, bm.kv_num_blocks)


def test_a_block_mask_moved_to_another_device_takes_its_mask_mod_along():
    """A BlockMask is made on the CPU in DataLoader workers and moved by the trainer: ``.to(device)``
    must move the id tensors its mask_mod reads too (torch's BlockMask.to moves only the block
    indices; the kernel on the GPU would then index CPU tensors)."""
    import pickle

    from torch.nn.attention.flex_attention import BlockMask

    sub = np.repeat(np.arange(3) * 100000 + 10000, 100)[None]
    media = [[{"token_offset": 10, "n_tokens": 20, "sample_index": 0}]]
    bm = block_mask(sub, media=media, vision="media", block_size=32)
    moved = bm.to("meta")
    assert isinstance(moved, BlockMask) and moved.kv_indices.device.type == "meta"
    mod = moved.mask_mod
    assert {t.device.type for t in (mod.sub, mod.sample, mod.groups)} == {"meta"}
    back = pickle.loads(pickle.dumps(bm)).to("cpu")  # from a worker, then to the trainer's device
    q, k = torch.arange(300)[:, None], torch.arange(300)[None, :]
    zero = torch.tensor(0)
    assert torch.equal(back.mask_mod(zero, zero, q, k), bm.mask_mod(zero, zero, q, k))
    assert torch.equal(back.to_dense(), bm.to_dense())
