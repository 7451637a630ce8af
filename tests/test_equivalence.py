"""Proof that packing is invisible to a model: a packed row gives the same logits and loss
as running each sample (and each branch of a message tree, with its prefix) on its own.

The model is a small transformer block in numpy (token and learned position embeddings,
one attention layer with RoPE, a linear head) in float64; the packed side uses only the
reader's mask and position ids, the "alone" side a plain lower-triangular mask and
``arange`` positions. Packs come from the demo corpus (plus message trees encoded with
``rows.encode_samples``) and from hypothesis-generated samples.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import packtool
from packtool import PackConfig, TokenizeConfig
from packtool.packer import PackPlan, assemble_packs
from packtool.reader import PackedDataset, attention_mask, position_ids
from packtool.records import MediaRef, Message, Part, Sample
from packtool.rows import EncodeContext, encode_samples, shifted_targets
from packtool.runs import expand_table, read_expanded
from packtool.schema import PREFIX_SUBSEGMENT, TOKENIZED, TOKENIZED_ROWS
from packtool.shards import ShardWriter, read_manifest, write_manifest
from packtool.templates import get_template
from packtool.tokenization import load_tokenizer
from packtool.vision import get_family

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "examples" / "sample"
ATOL = 1e-5


# --------------------------------------------------------------------------- the model


class TinyLM:
    """Embeddings + learned positions, one multi-head attention layer with RoPE, a linear head."""

    def __init__(self, seed: int = 0, vocab: int = 257, dim: int = 16, heads: int = 1, max_pos: int = 16384) -> None:
        rng = np.random.default_rng(seed)
        self.vocab, self.dim, self.heads = vocab, dim, heads
        self.emb = rng.normal(0, 1.0, (vocab, dim))
        self.pos = rng.normal(0, 0.5, (max_pos, dim))
        self.wq, self.wk, self.wv, self.wo = (rng.normal(0, dim**-0.5, (dim, dim)) for _ in range(4))
        self.head = rng.normal(0, dim**-0.5, (dim, vocab))

    def rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Rotary embedding over the last axis of ``x`` (``L, heads, dh``)."""
        dh = x.shape[-1]
        inv = 10000.0 ** (-np.arange(0, dh, 2) / dh)
        ang = pos[:, None].astype(np.float64) * inv[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x1 * sin + x2 * cos
        return out

    def embed(self, ids: np.ndarray, pos: np.ndarray) -> np.ndarray:
        return self.emb[np.asarray(ids) % self.vocab] + self.pos[np.asarray(pos)]

    def qkv(self, x: np.ndarray, pos: np.ndarray):
        n, h = len(x), self.heads
        dh = self.dim // h
        q = self.rope((x @ self.wq).reshape(n, h, dh), pos)
        k = self.rope((x @ self.wk).reshape(n, h, dh), pos)
        v = (x @ self.wv).reshape(n, h, dh)
        return q, k, v

    def forward(self, ids, pos, mask: np.ndarray, chunk: int = 256) -> np.ndarray:
        pos = np.asarray(pos, dtype=np.int64)
        x = self.embed(ids, pos)
        q, k, v = self.qkv(x, pos)
        n, dh = len(x), self.dim // self.heads
        out = np.empty_like(q)
        kt = k.transpose(1, 2, 0)  # h, dh, L
        vt = v.transpose(1, 0, 2)  # h, L, dh
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            lo, hi = key_range(mask[s:e])  # keys outside get weight exactly 0: skip them
            scores = q[s:e].transpose(1, 0, 2) @ kt[:, :, lo:hi] / np.sqrt(dh)  # h, c, keys
            scores = np.where(mask[s:e, lo:hi][None], scores, -np.inf)
            scores -= scores.max(-1, keepdims=True)
            w = np.exp(scores)
            w /= w.sum(-1, keepdims=True)
            out[s:e] = (w @ vt[:, lo:hi]).transpose(1, 0, 2)
        x = x + out.reshape(n, self.dim) @ self.wo
        return x @ self.head

    def token_losses(self, logits: np.ndarray, targets) -> np.ndarray:
        """Cross-entropy per position (0 where the target is -100)."""
        t = np.asarray(targets, dtype=np.int64)
        valid = t != -100
        m = logits.max(-1, keepdims=True)
        lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[:, 0]
        picked = logits[np.arange(len(t)), np.where(valid, t % self.vocab, 0)]
        return np.where(valid, lse - picked, 0.0)


MODEL = TinyLM()


def key_range(mask_rows: np.ndarray) -> tuple[int, int]:
    """The smallest key interval holding every key these query rows may attend."""
    cols = np.flatnonzero(mask_rows.any(0))
    return int(cols[0]), int(cols[-1]) + 1


def causal(n: int) -> np.ndarray:
    return np.tri(n, dtype=bool)


def alone_mask(n: int, spans: list[tuple[int, int]], vision: str) -> np.ndarray:
    """The mask of one sequence run by itself: lower-triangular, plus vision blocks if asked."""
    mask = causal(n)
    if vision == "media":
        for s, k in spans:
            mask[s:s + k, s:s + k] = True
    elif vision == "sample" and spans:
        idx = np.concatenate([np.arange(s, s + k) for s, k in spans])
        mask[np.ix_(idx, idx)] = True
    return mask


# --------------------------------------------------------------------------- references


class Alone:
    """One sequence run by itself, and where its tokens sit inside its sample in a pack."""

    def __init__(self, ids, targets, local, spans) -> None:
        self.ids = np.asarray(ids, dtype=np.int64)
        self.targets = np.asarray(targets, dtype=np.int64)
        self.local = np.asarray(local, dtype=np.int64)  # index in the packed sample of each token
        self.spans = spans  # media (start, n) in this sequence
        self._cache: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def run(self, vision: str = "causal") -> tuple[np.ndarray, np.ndarray]:
        if vision not in self._cache:
            n = len(self.ids)
            logits = MODEL.forward(self.ids, np.arange(n), alone_mask(n, self.spans, vision))
            self._cache[vision] = (logits, MODEL.token_losses(logits, self.targets))
        return self._cache[vision]


def check_row(row: dict, alones: dict[str, list[Alone]], vision: str = "causal") -> int:
    """Run one packed row with the reader's mask and positions; compare every token with the alone runs."""
    sub = np.asarray(row["subsegment_ids"])
    pos = np.asarray(row["position_ids"])
    np.testing.assert_array_equal(position_ids(sub), pos)
    logits = MODEL.forward(row["input_ids"], pos, attention_mask(sub, row["media"], vision=vision))
    losses = MODEL.token_losses(logits, row["target_ids"])
    covered = np.zeros(len(sub), dtype=bool)
    cu = np.asarray(row["cu_seqlens"])
    for k, sid in enumerate(row["sample_ids"]):
        for ref in alones[sid]:
            at = cu[k] + ref.local
            ref_logits, ref_losses = ref.run(vision)
            np.testing.assert_array_equal(np.asarray(row["input_ids"])[at], ref.ids)
            np.testing.assert_array_equal(np.asarray(row["target_ids"])[at], ref.targets)
            np.testing.assert_allclose(logits[at], ref_logits, rtol=0, atol=ATOL)
            np.testing.assert_allclose(losses[at], ref_losses, rtol=0, atol=ATOL)
            covered[at] = True
    assert covered.all(), "every token of the pack belongs to some sample or branch"
    return len(sub)


# --------------------------------------------------------------------------- demo corpus + trees


def _tree_samples() -> list[Sample]:
    """Three message trees sharing one image each (2 and 3 branches, different lengths)."""
    questions = [("What colour is the shape?", "It is purple."), ("How many shapes are there?", "There is exactly one shape."),
                 ("Describe the background.", "The background is plain white with no texture at all.")]
    out = []
    for t, (img, n_branches) in enumerate((("images/img04.png", 2), ("images/img00.png", 3), ("images/img02.png", 2))):
        branches = tuple(
            (Message("user", (Part.media("image", 0), Part.of_text(q))), Message("assistant", (Part.of_text(a),)))
            for q, a in questions[:n_branches]
        )
        out.append(Sample(f"tree-{t}", "trees", t, (MediaRef("image", img),), branches))
    return out


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict:
    """The demo corpus plus three message trees, tokenized and packed (media by reference)."""
    base = tmp_path_factory.mktemp("equiv")
    tok = base / "tok"
    packtool.tokenize_dataset([SAMPLE / "data.jsonl"], tok, TokenizeConfig(media_root=str(SAMPLE)))
    man = read_manifest(tok, "tokenized")

    demo_rows = pa.concat_tables([read_expanded(tok / s["file"]) for s in man["shards"]]).to_pylist()
    ctx = EncodeContext(load_tokenizer(None), get_template("chatml"), get_family("qwen2.5-vl"), SAMPLE)
    trees = _tree_samples()
    tree_rows, rejected = encode_samples(trees, ctx)
    assert not rejected and [r["n_branches"] for r in tree_rows] == [2, 3, 2]
    rows = demo_rows[:5] + tree_rows[:1] + demo_rows[5:15] + tree_rows[1:] + demo_rows[15:]
    tok2 = base / "tok_trees"
    tok2.mkdir()
    with ShardWriter(tok2, TOKENIZED, rows_per_shard=1000) as w:
        w.write_rows(rows)
    write_manifest(tok2, "tokenized", man["config"], man["config_digest"] + "-trees", w.shards,
                   tokenizer=man["tokenizer"], vision=man["vision"], template=man["template"])
    packed = base / "packed"
    pman = packtool.pack_dataset(tok2, packed, PackConfig(max_tokens=8192, media="reference"))
    assert pman["counts"]["samples_packed"] == len(rows)

    alones: dict[str, list[Alone]] = {}
    for r in rows:
        if r["n_branches"] == 1:
            spans = [(m["token_offset"], m["n_tokens"]) for m in r["media"]]
            alones[r["sample_id"]] = [Alone(r["input_ids"], r["target_ids"], np.arange(r["n_tokens"]), spans)]
    for sample, tree in zip(trees, tree_rows, strict=True):
        sub = np.asarray(tree["subsegment_ids"])
        prefix = np.flatnonzero(sub == PREFIX_SUBSEGMENT)
        refs = []
        for b, branch in enumerate(sample.branches):
            one, rej = encode_samples([Sample(f"{sample.sample_id}/{b}", "trees", 0, sample.media, (branch,))], ctx)
            assert not rej
            alone = one[0]
            local = np.concatenate([prefix, np.flatnonzero(sub == b)])
            assert len(local) == alone["n_tokens"]
            spans = [(m["token_offset"], m["n_tokens"]) for m in alone["media"]]
            refs.append(Alone(alone["input_ids"], alone["target_ids"], local, spans))
        alones[sample.sample_id] = refs
    return {"packed": packed, "alones": alones, "n_samples": len(rows), "trees": {s.sample_id for s in trees}}


def test_packed_demo_rows_equal_samples_alone(demo):
    rows = list(PackedDataset(demo["packed"], shuffle=False))
    seen = [sid for r in rows for sid in r["sample_ids"]]
    assert sorted(seen) == sorted(demo["alones"]) and len(seen) == demo["n_samples"]
    assert any(len(r["sample_ids"]) > 1 and demo["trees"] & set(r["sample_ids"]) for r in rows), "a tree shares a pack"
    assert sum(check_row(r, demo["alones"]) for r in rows) == sum(r["n_tokens"] for r in rows)


@pytest.mark.parametrize("vision", ["media", "sample"])
def test_bidirectional_vision_equals_alone(demo, vision):
    rows = [r for r in PackedDataset(demo["packed"], shuffle=False) if demo["trees"] & set(r["sample_ids"])]
    assert rows
    for r in rows:
        check_row(r, demo["alones"], vision=vision)


def test_leaky_mask_is_caught(demo):
    """The check has teeth: a plain causal mask over the whole pack leaks across samples."""
    row = next(r for r in PackedDataset(demo["packed"], shuffle=False) if len(r["sample_ids"]) > 1)
    logits = MODEL.forward(row["input_ids"], row["position_ids"], causal(row["n_tokens"]))
    k = 1
    ref = demo["alones"][row["sample_ids"][k]][0]
    at = row["cu_seqlens"][k] + ref.local
    assert np.abs(logits[at] - ref.run()[0]).max() > 1e-3


# --------------------------------------------------------------------------- torch adapter


def test_torch_adapter_sdpa_equals_alone(demo):
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from packtool.reader.torch import PackedIterableDataset

    t = {name: torch.from_numpy(getattr(MODEL, name)) for name in ("emb", "pos", "wq", "wk", "wv", "wo", "head")}
    h, dh = MODEL.heads, MODEL.dim // MODEL.heads

    def rope(x, pos):  # x: B, L, h, dh
        inv = 10000.0 ** (-torch.arange(0, dh, 2, dtype=torch.float64) / dh)
        ang = pos[..., None].double() * inv
        cos, sin = ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)

    def forward(ids, pos, mask, chunk=256):
        b, n = ids.shape
        x = t["emb"][ids % MODEL.vocab] + t["pos"][pos]
        q = rope((x @ t["wq"]).view(b, n, h, dh), pos).transpose(1, 2)
        k = rope((x @ t["wk"]).view(b, n, h, dh), pos).transpose(1, 2)
        v = (x @ t["wv"]).view(b, n, h, dh).transpose(1, 2)
        parts = []
        for s in range(0, n, chunk):
            lo, hi = key_range(mask[:, 0, s:s + chunk].numpy().any(0))
            parts.append(F.scaled_dot_product_attention(q[:, :, s:s + chunk], k[:, :, lo:hi], v[:, :, lo:hi],
                                                        attn_mask=mask[:, :, s:s + chunk, lo:hi]))
        out = torch.cat(parts, dim=2)
        return (x + out.transpose(1, 2).reshape(b, n, MODEL.dim) @ t["wo"]) @ t["head"]

    ds = PackedIterableDataset(demo["packed"], batch_size=2, shuffle=False, masks=True)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)
    n_batches = 0
    for batch in loader:
        n_batches += 1
        labels = batch["shift_labels"]
        assert labels.dtype == torch.int64 and "target_ids" not in batch
        with torch.no_grad():
            logits = forward(batch["input_ids"], batch["position_ids"], batch["attention_mask"])
        safe = torch.where(labels == -100, labels, labels % MODEL.vocab)
        losses = F.cross_entropy(logits.flatten(0, 1), safe.flatten(), ignore_index=-100, reduction="none").view(labels.shape)
        for i, sids in enumerate(batch["sample_ids"]):
            cu = batch["cu_seqlens"][i].numpy()
            for k, sid in enumerate(sids):
                for ref in demo["alones"][sid]:
                    at = torch.from_numpy(cu[k] + ref.local)
                    ref_logits, ref_losses = ref.run()
                    np.testing.assert_array_equal(labels[i, at].numpy(), ref.targets)
                    np.testing.assert_allclose(logits[i, at].numpy(), ref_logits, rtol=0, atol=ATOL)
                    np.testing.assert_allclose(losses[i, at].numpy(), ref_losses, rtol=0, atol=ATOL)
            # padding carries no loss
            assert (labels[i, int(batch["lengths"][i]):] == -100).all()
    assert n_batches == len(ds)


# --------------------------------------------------------------------------- hypothesis samples


@st.composite
def synthetic_samples(draw):
    """Token-level samples: a shared prefix (with media spans inside) and 1-3 branches."""
    n_samples = draw(st.integers(1, 4))
    samples = []
    for _ in range(n_samples):
        p = draw(st.integers(1, 12))
        prefix = draw(st.lists(st.integers(0, 5000), min_size=p, max_size=p))
        prefix_loss = draw(st.lists(st.booleans(), min_size=p, max_size=p))
        n_media = draw(st.integers(0, 2))
        spans, at = [], 0
        for _ in range(n_media):
            if at >= p:
                break
            start = draw(st.integers(at, p - 1))
            n = draw(st.integers(1, p - start))
            spans.append((start, n))
            at = start + n
        branches = []
        for _ in range(draw(st.integers(1, 3))):
            r = draw(st.integers(1, 8))
            rest = draw(st.lists(st.integers(0, 5000), min_size=r, max_size=r))
            loss = draw(st.lists(st.booleans(), min_size=r, max_size=r))
            loss[0] = False  # the token after the prefix carries no loss (the tree contract)
            branches.append((rest, loss))
        samples.append((prefix, prefix_loss, spans, branches))
    return samples


def _tokenized_row(i: int, prefix, prefix_loss, spans, branches) -> tuple[dict, list[Alone]]:
    """A tokenized row laid out per DESIGN.md §3.2, and the alone sequence of every branch."""
    p = len(prefix)
    full = [(np.array(prefix + rest), np.array(prefix_loss + loss)) for rest, loss in branches]
    single = len(branches) == 1
    ids = [np.array(prefix)]
    tgt = [shifted_targets(full[0][0], full[0][1])[:p]]
    pos = [np.arange(p)]
    sub = [np.full(p, PREFIX_SUBSEGMENT)]
    alones, offset = [], p
    for b, ((rest, _), (fids, floss)) in enumerate(zip(branches, full, strict=True)):
        t = shifted_targets(fids, floss)
        r = len(rest)
        if single:
            tgt = [t[:p]]
            ids.append(np.array(rest))
            tgt.append(t[p:])
            pos.append(np.arange(p, p + r))
            sub.append(np.full(r, PREFIX_SUBSEGMENT))
        else:
            ids.append(np.array(rest))
            tgt.append(t[p:])
            pos.append(np.arange(p, p + r))
            sub.append(np.full(r, b))
        alones.append(Alone(fids, t, np.concatenate([np.arange(p), np.arange(offset, offset + r)]), spans))
        offset += r
    media = [{"kind": "image", "path": f"m{i}-{j}.png", "token_offset": s, "n_tokens": n, "width": 28, "height": 28,
              "resized_width": 28, "resized_height": 28, "grid_t": 1, "grid_h": 2, "grid_w": 2, "vision_units": 4,
              "timestamps": None, "data": None} for j, (s, n) in enumerate(spans)]
    row = {"sample_id": f"s{i}", "source": "synthetic", "source_row": i, "n_tokens": offset, "n_vision_units": 4 * len(spans),
           "n_branches": len(branches), "input_ids": np.concatenate(ids), "target_ids": np.concatenate(tgt),
           "position_ids": np.concatenate(pos), "subsegment_ids": np.concatenate(sub), "media": media}
    return row, alones


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(samples=synthetic_samples(), order_seed=st.integers(0, 1000), vision=st.sampled_from(["causal", "media", "sample"]))
def test_hypothesis_packed_equals_alone(samples, order_seed, vision):
    built = [_tokenized_row(i, *s) for i, s in enumerate(samples)]
    table = pa.Table.from_pylist([r for r, _ in built], schema=TOKENIZED_ROWS)
    order = np.random.default_rng(order_seed).permutation(len(built))
    packed = expand_table(assemble_packs(table, PackPlan(order, np.array([0, len(order)])), first_pack_index=0))
    row = packed.to_pylist()[0]
    alones = {r["sample_id"]: a for r, a in built}
    check_row(row, alones, vision=vision)
