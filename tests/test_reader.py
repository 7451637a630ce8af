"""packtool.reader: the stream split, exact resume, shard checks, masks, collate and media."""

from __future__ import annotations

import copy
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from naive import list_form
from PIL import Image, ImageOps

from packtool.errors import ConfigError, InputError, ResumeMismatchError
from packtool.reader import (
    PAD_SUBSEGMENT,
    PackedDataset,
    VideoFrames,
    attention_mask,
    collate,
    decode_image,
    decode_media,
    decode_video,
    flash_attn_varlen_kwargs,
    position_ids,
)
from packtool.runs import blob_table, compact_table, expand_row
from packtool.schema import (
    PACKED,
    PACKED_FULL,
    PACKED_V3,
    PREFIX_SUBSEGMENT,
    SCHEMA_VERSION,
    SUBSEGMENT_STRIDE,
)
from packtool.shards import sha256_file

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "examples" / "sample"


# --------------------------------------------------------------------------- fixtures


def write_packed(out: Path, shard_rows: list[int], group_rows: int, seed: int = 0) -> Path:
    """A packed directory with shards of the given row counts, cut into row groups of ``group_rows``.

    Pack ``i`` holds one or two samples whose input ids are all ``i`` (easy to trace).
    """
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    shards, index = [], 0
    for s, n_rows in enumerate(shard_rows):
        rows = []
        for _ in range(n_rows):
            lens = rng.integers(1, 6, size=rng.integers(1, 3))
            sub = np.concatenate([np.full(n, k * SUBSEGMENT_STRIDE + PREFIX_SUBSEGMENT) for k, n in enumerate(lens)])
            rows.append({
                "pack_index": index, "n_tokens": int(lens.sum()), "n_vision_units": 0, "sample_ids": [f"p{index}s{k}" for k in range(len(lens))],
                "input_ids": [index] * int(lens.sum()), "target_ids": [-100] * int(lens.sum()),
                "position_ids": np.concatenate([np.arange(n) for n in lens]).tolist(), "subsegment_ids": sub.tolist(),
                "cu_seqlens": [0, *np.cumsum(lens).tolist()], "media": [],
            })
            index += 1
        name = f"part-{s:05d}.parquet"
        pq.write_table(compact_table(pa.Table.from_pylist(rows, schema=PACKED_FULL)).cast(PACKED), out / name,
                       row_group_size=group_rows)
        shards.append({"file": name, "rows": n_rows, "bytes": (out / name).stat().st_size, "sha256": sha256_file(out / name)})
    manifest = {"kind": "packed", "schema_version": SCHEMA_VERSION, "config": {}, "config_digest": f"synthetic-{seed}", "shards": shards}
    (out / ".packtool").mkdir()
    (out / ".packtool" / "manifest.json").write_text(json.dumps(manifest))
    return out


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    """23 packs in 4 shards (7, 7, 7, 2 rows), row groups of 3 rows."""
    return write_packed(tmp_path_factory.mktemp("packed") / "p", [7, 7, 7, 2], group_rows=3)


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict[str, Path]:
    """The demo corpus packed twice: media embedded and media by reference."""
    import packtool
    from packtool import PackConfig, TokenizeConfig

    base = tmp_path_factory.mktemp("reader-demo")
    packtool.tokenize_dataset([SAMPLE / "data.jsonl"], base / "tok", TokenizeConfig(media_root=str(SAMPLE)))
    packtool.pack_dataset(base / "tok", base / "embed", PackConfig(max_tokens=8192))
    packtool.pack_dataset(base / "tok", base / "ref", PackConfig(max_tokens=8192, media="reference"))
    # a few short packs keep the README's CPU training loop quick
    head = base / "head.jsonl"
    head.write_text("".join((SAMPLE / "data.jsonl").read_text().splitlines(keepends=True)[:8]))
    packtool.tokenize_dataset([head], base / "tok_head", TokenizeConfig(media_root=str(SAMPLE)))
    packtool.pack_dataset(base / "tok_head", base / "small", PackConfig(max_tokens=2048))
    return {"embed": base / "embed", "ref": base / "ref", "small": base / "small", "tok": base / "tok"}


def ids(rows) -> list[int]:
    return [r["pack_index"] for r in rows]


def loader_order(ds: PackedDataset, num_workers: int, block: int) -> list[tuple[list[int], int]]:
    """What a DataLoader with ``num_workers`` workers hands the trainer: workers (each a copy
    of the dataset, as after fork) produce blocks, visited round-robin until all are done."""
    iters = [copy.deepcopy(ds).iter_blocks(w, num_workers, block) for w in range(num_workers)]
    out, live = [], list(range(num_workers))
    while live:
        for w in list(live):
            try:
                rows, consumed = next(iters[w])
                out.append((ids(rows), consumed))
            except StopIteration:
                live.remove(w)
    return out


# --------------------------------------------------------------------------- import weight


def test_reader_import_is_light(packed):
    code = ("import sys, packtool.reader as r; rows = list(r.PackedDataset(sys.argv[1])); "
            "r.collate(rows, masks=True); assert len(rows) == 23; "
            "bad = [m for m in ('numba', 'typer', 'torch', 'packtool.knapsack', 'packtool.cli', 'packtool.pipeline', 'packtool.packer') "
            "if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code, str(packed)], check=True, cwd=ROOT)


def test_docstring_examples_hold():
    import doctest

    import packtool.reader

    result = doctest.testmod(packtool.reader)
    assert result.attempted >= 4 and result.failed == 0


# --------------------------------------------------------------------------- the split


@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 8, 30])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_cover_every_pack(packed, world_size, drop_last):
    n = 23
    if drop_last and world_size > n:  # every rank would get nothing: refused (see test_an_epoch_of_nothing_is_refused)
        with pytest.raises(ConfigError, match="every rank would get none"):
            PackedDataset(packed, world_size=world_size, drop_last=True)
        return
    streams = []
    for rank in range(world_size):
        ds = PackedDataset(packed, rank=rank, world_size=world_size, seed=7, drop_last=drop_last)
        rows = ids(ds)
        assert len(rows) == len(ds) == (n // world_size if drop_last else -(-n // world_size))
        streams.append(rows)
    flat = [i for s in streams for i in s]
    if drop_last:
        assert len(set(flat)) == len(flat) == world_size * (n // world_size)
    else:
        # the epoch's order G, then its first packs repeated to fill the last ranks
        assert sorted(flat[:n]) == list(range(n))
        assert flat[n:] == (flat[:n] * world_size)[: len(flat) - n]


def test_shuffle_is_deterministic_and_changes_per_epoch(packed):
    def order(epoch, seed=3, shuffle=True):
        ds = PackedDataset(packed, seed=seed, shuffle=shuffle)
        ds.set_epoch(epoch)
        return ids(ds)

    assert order(0) == order(0)
    assert order(0) != order(1)
    assert order(0, seed=4) != order(0)
    assert sorted(order(2)) == list(range(23))
    assert order(0, shuffle=False) == order(5, shuffle=False) == list(range(23))


def test_in_process_iteration_advances_epochs(packed):
    ds = PackedDataset(packed, seed=1)
    first, second = ids(ds), ids(ds)
    assert ds.epoch == 2 and sorted(first) == sorted(second) and first != second
    ds2 = PackedDataset(packed, seed=1)
    ds2.set_epoch(1)
    assert ids(ds2) == second


def test_row_groups_are_read_one_at_a_time(packed, monkeypatch):
    reads = []
    original = pq.ParquetFile.read_row_group

    def spy(self, i, *args, **kwargs):
        reads.append(i)
        return original(self, i, *args, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("the reader must not read whole files")

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)
    monkeypatch.setattr(pq.ParquetFile, "read", refuse)
    monkeypatch.setattr(pq, "read_table", refuse)
    ds = PackedDataset(packed, rank=1, world_size=2, seed=0)
    rows = list(ds)
    # 12 rows from groups of at most 3: each group touched is decoded once, not once per row
    assert len(rows) == 12 and 4 <= len(reads) <= 7


# --------------------------------------------------------------------------- exact resume


COMBOS = [(1, 0, 1, 1), (2, 1, 2, 1), (3, 2, 3, 2), (4, 0, 2, 3), (8, 5, 1, 1), (5, 4, 3, 1)]


@pytest.mark.parametrize(("world_size", "rank", "num_workers", "block"), COMBOS)
@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("legacy", [False, True], ids=["order2", "order1"])
def test_exact_resume(packed, world_size, rank, num_workers, block, k, legacy):
    """``legacy``: the run started from a checkpoint of a packtool that saved no order version,
    so it reads the first order; the states it saves carry that order to any fresh reader."""
    def fresh():
        return PackedDataset(packed, rank=rank, world_size=world_size, seed=11)

    def start():
        ds = fresh()
        if legacy:
            ds.load_state_dict(_order_1(fresh().state_dict()))
        return ds

    full = [i for b, _ in loader_order(start(), num_workers, block) for i in b]
    assert len(full) == len(fresh())
    ds = start()
    got = loader_order(ds, num_workers, block)
    k = min(k, len(got))
    taken = [i for b, _ in got[:k] for i in b]
    state = ds.state_dict(consumed=got[k - 1][1] if k else 0)
    assert state["order"] == (1 if legacy else 2)
    assert json.loads(json.dumps(state)) == state  # a checkpoint can store it as JSON
    for workers_after in (num_workers, 1, num_workers + 1):
        resumed = fresh()
        resumed.load_state_dict(state)
        rest = [i for b, _ in loader_order(resumed, workers_after, block) for i in b]
        if state["epoch"] == 0:
            assert taken + rest == full
        else:  # the whole epoch was taken: resume starts the next epoch
            assert taken == full and rest == [i for b, _ in loader_order(_at_epoch(start(), 1), 1, 1) for i in b]


def _order_1(state: dict) -> dict:
    """``state`` as a packtool that had one shuffle order saved it: without ``order``."""
    return {k: v for k, v in state.items() if k != "order"}


def test_shuffle_levels_are_independent(tmp_path):
    """The shard order, a shard's row-group order and a group's row order used to be one
    stream: seeds ``[s, e]``, ``[s, e, 0]`` and ``[s, e, 0, 0]`` are the same to numpy (keys are
    padded with zeros), so shard 0's groups came in the epoch's shard order, and its group 0's
    rows in that order again, for every seed."""
    # 4 shards of 4 row groups of 4 rows: pack 16*shard + 4*group + row
    data = write_packed(tmp_path / "p", [16] * 4, group_rows=4)
    same_groups = same_rows = 0
    for seed in range(10):
        for epoch in (0, 1):
            stream = ids(_at_epoch(PackedDataset(data, seed=seed), epoch))
            shards = [i // 16 for i in stream[::16]]
            groups = [i // 4 % 4 for i in stream if i // 16 == 0][::4]
            rows = [i for i in stream if i < 4]
            assert sorted(stream) == list(range(64))
            same_groups += groups == shards
            same_rows += rows == groups
    # independent permutations of 4 agree once in 24: about 1 of these 20 draws (it was 20 of 20)
    assert same_groups <= 4 and same_rows <= 4, (same_groups, same_rows)


#: The first order (saved states without ``order``) of ``packed`` with seed 11: (world_size, rank, epoch) -> packs.
ORDER_1 = {
    (1, 0, 0): [22, 21, 7, 8, 9, 11, 10, 12, 13, 4, 3, 5, 1, 0, 2, 6, 17, 19, 18, 15, 14, 16, 20],
    (1, 0, 1): [0, 1, 2, 3, 5, 4, 6, 22, 21, 13, 11, 10, 12, 9, 8, 7, 17, 19, 18, 15, 14, 16, 20],
    (3, 1, 0): [13, 4, 3, 5, 1, 0, 2, 6],
    (3, 1, 1): [21, 13, 11, 10, 12, 9, 8, 7],
}


@pytest.mark.parametrize(("world_size", "rank"), [(1, 0), (3, 1)])
def test_a_state_saved_without_an_order_resumes_in_the_first_order(packed, world_size, rank):
    """A checkpoint taken before the shuffle levels were made independent continues with
    exactly the packs its run had not read yet, this epoch and the next."""
    def fresh():
        return PackedDataset(packed, rank=rank, world_size=world_size, seed=11)

    assert fresh().state_dict()["order"] == 2 and ids(fresh()) != ORDER_1[(world_size, rank, 0)]
    old = ORDER_1[(world_size, rank, 0)]
    for consumed in (0, 3, len(old)):
        state = _order_1(fresh().state_dict(consumed=consumed))
        ds = fresh()
        ds.load_state_dict(state)
        if consumed < len(old):
            assert ids(ds) == old[consumed:]
        assert ids(ds) == ORDER_1[(world_size, rank, 1)]  # later epochs keep the first order
        assert ds.state_dict()["order"] == 1
        for workers in (2, 3):  # DataLoader workers read copies of the reader
            again = fresh()
            again.load_state_dict(state)
            again.set_epoch(state["epoch"])
            blocks = loader_order(again, workers, 2)
            assert [i for b, _ in blocks for i in b] == (old[consumed:] if consumed < len(old) else ORDER_1[(world_size, rank, 1)])
    # an unknown order (saved by a later packtool) is refused, not read in another order
    for value in (3, 0, "2", True):
        with pytest.raises(ResumeMismatchError, match=f"order={value!r}"):
            fresh().load_state_dict(dict(fresh().state_dict(), order=value))
    ds = fresh()
    ds.load_state_dict(_order_1(fresh().state_dict()))
    ds.load_state_dict(dict(fresh().state_dict(), order=np.int64(2)))  # a later state in the new order
    assert ids(ds) == ids(fresh())


def test_resume_across_epochs_and_from_another_rank(packed):
    ds = PackedDataset(packed, rank=0, world_size=3, seed=2)
    epoch0 = ids(ds)
    ds.set_epoch(1)
    it = iter(ds)
    head = [next(it)["pack_index"] for _ in range(4)]
    state = ds.state_dict()
    assert state["epoch"] == 1 and state["consumed"] == 4
    # ranks step together, so rank 0's state resumes rank 2 too
    other = PackedDataset(packed, rank=2, world_size=3, seed=2)
    other.set_epoch(1)
    other_full = ids(other)
    other2 = PackedDataset(packed, rank=2, world_size=3, seed=2)
    other2.load_state_dict(state)
    other2.set_epoch(1)  # the usual loop calls set_epoch again: it must keep the position
    assert ids(other2) == other_full[4:]
    # the rest of rank 0's epoch 1
    again = PackedDataset(packed, rank=0, world_size=3, seed=2)
    again.load_state_dict(state)
    assert head + ids(again) == ids(_at_epoch(PackedDataset(packed, rank=0, world_size=3, seed=2), 1))
    assert epoch0 != head + ids(again) and len(epoch0) == 8
    # a finished epoch resumes at the start of the next one
    done = PackedDataset(packed, rank=0, world_size=3, seed=2)
    list(done)
    assert done.state_dict() == {**state, "epoch": 1, "consumed": 0}


def _at_epoch(ds, epoch):
    ds.set_epoch(epoch)
    return ds


def test_resume_refuses_another_split(packed, tmp_path):
    state = PackedDataset(packed, world_size=2, seed=1).state_dict()
    with pytest.raises(ResumeMismatchError, match="world_size"):
        PackedDataset(packed, world_size=4, seed=1).load_state_dict(state)
    with pytest.raises(ResumeMismatchError, match="seed"):
        PackedDataset(packed, world_size=2, seed=2).load_state_dict(state)
    other = write_packed(tmp_path / "other", [5], group_rows=2, seed=9)
    with pytest.raises(ResumeMismatchError, match="another packed dataset"):
        PackedDataset(other, world_size=2, seed=1).load_state_dict(state)
    with pytest.raises(ConfigError, match="rank 2"):
        PackedDataset(packed, rank=2, world_size=2)


@pytest.mark.parametrize("key,value", [("consumed", 2.5), ("consumed", -1), ("consumed", "3"), ("consumed", None),
                                       ("epoch", -1), ("epoch", 1.5), ("epoch", True)])
def test_resume_refuses_a_position_that_is_not_a_count(packed, key, value):
    """A position is never rounded or guessed: 2.5 packs, epoch -1 or a missing key name the key."""
    ds = PackedDataset(packed, seed=1)
    state = dict(ds.state_dict(), epoch=1, consumed=4)
    state[key] = value
    with pytest.raises(ResumeMismatchError, match=f"{key}="):
        ds.load_state_dict(state)
    good = dict(state, **{key: np.int64(3)})  # numpy integers, as a checkpoint may hold them
    ds.load_state_dict(good)
    assert (ds.epoch, ds.consumed) == (good["epoch"], good["consumed"])



def test_a_state_for_a_negative_epoch_is_refused_when_saved_not_when_loaded(packed):
    """state_dict(epoch=-1) returned a state that load_state_dict refuses: the checkpoint
    holding it could never be resumed, and the refusal said to load it unchanged."""
    ds = PackedDataset(packed, seed=1)
    with pytest.raises(ConfigError, match="^epoch must be non-negative, got -1"):
        ds.state_dict(consumed=3, epoch=-1)
    PackedDataset(packed, seed=1).load_state_dict(ds.state_dict(consumed=3, epoch=0))

def test_the_hidden_state_folder_given_as_the_dataset_names_its_parent(packed):
    with pytest.raises(InputError, match=r"\.packtool folder .* pass the directory that holds it") as err:
        PackedDataset(packed / ".packtool")
    assert repr(str(packed)) in str(err.value)


def test_resume_refuses_an_edited_corpus_repacked_with_the_same_settings(tmp_path):
    """The same input path and settings give the same config digest, and here the same pack
    count: only the shards tell the two datasets apart."""
    import packtool
    from packtool import PackConfig, TokenizeConfig

    for i, colour in enumerate(["red", "blue"]):
        Image.new("RGB", (64 + 16 * i, 48), colour).save(tmp_path / f"img{i}.png")
    data = tmp_path / "data.jsonl"

    def corpus(answer: str, name: str) -> Path:
        data.write_text("".join(json.dumps({"id": f"s{i}", "image": f"img{i}.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat colour?"}, {"from": "gpt", "value": f"{answer} {i}."}]}) + "\n"
            for i in range(2)))
        packtool.tokenize_dataset([data], tmp_path / f"tok-{name}", TokenizeConfig(media_root=str(tmp_path)))
        packtool.pack_dataset(tmp_path / f"tok-{name}", tmp_path / name, PackConfig(max_tokens=64))
        return tmp_path / name

    before, after = corpus("A plain colour", "before"), corpus("One plain colour", "after")
    old, new = PackedDataset(before, seed=1), PackedDataset(after, seed=1)
    assert old.n_packs == new.n_packs == 2
    assert old.manifest["config_digest"] == new.manifest["config_digest"]
    next(iter(old))
    state = old.state_dict()
    with pytest.raises(ResumeMismatchError, match="another packed dataset \\(shards_digest"):
        new.load_state_dict(state)
    copy_ = shutil.copytree(before, tmp_path / "copy")  # the same shards elsewhere are the same data
    PackedDataset(copy_, seed=1).load_state_dict(state)
    # a state saved before the shards were part of it still loads
    legacy = {k: v for k, v in state.items() if k != "shards_digest"}
    new.load_state_dict(legacy)
    assert new.state_dict()["consumed"] == 1


def test_an_epoch_of_nothing_is_refused(packed, tmp_path):
    """A packed directory of no packs, or drop_last leaving every rank none, used to yield
    empty epochs: a training loop ran to its end without one step."""
    (tmp_path / "d.jsonl").write_text(json.dumps({"id": "x", "image": "missing.png", "conversations": [
        {"from": "human", "value": "<image> Hi"}, {"from": "gpt", "value": "Hello."}]}) + "\n")
    for cmd in (["tokenize", str(tmp_path / "d.jsonl"), "--media-root", str(tmp_path), "-o", str(tmp_path / "tok")],
                ["pack", str(tmp_path / "tok"), "-o", str(tmp_path / "packed")]):
        subprocess.run([sys.executable, "-m", "packtool", *cmd, "--quiet"], check=True, cwd=ROOT)  # both exit 0
    with pytest.raises(InputError, match="holds no packs .*packtool stats"):
        PackedDataset(tmp_path / "packed")
    with pytest.raises(ConfigError, match="drop_last=True splits 23 packs over 24 ranks: every rank would get none; "
                                          "use drop_last=False"):
        PackedDataset(packed, rank=3, world_size=24, drop_last=True)
    assert len(PackedDataset(packed, rank=3, world_size=24)) == 1  # topped up instead
    assert len(PackedDataset(packed, rank=3, world_size=23, drop_last=True)) == 1


@pytest.mark.parametrize("kwargs, name", [
    ({"rank": "1", "world_size": 2}, "rank"),  # RANK read from the environment is a string
    ({"rank": 0.5, "world_size": 2}, "rank"),
    ({"rank": True, "world_size": 2}, "rank"),
    ({"world_size": 2.0}, "world_size"),
    ({"seed": None}, "seed"),
    ({"seed": 1.5}, "seed"),
])
def test_non_integer_split_arguments_are_refused(packed, kwargs, name):
    with pytest.raises(ConfigError, match=rf"^{name} must be an integer, got .*; pass {name}=int"):
        PackedDataset(packed, **kwargs)


def test_numpy_and_torch_integers_are_accepted_and_fractions_refused_everywhere(packed):
    torch = pytest.importorskip("torch")
    from packtool.reader.torch import PackedIterableDataset

    ds = PackedDataset(packed, rank=np.int64(1), world_size=torch.tensor(2), seed=np.uint8(7))
    assert (ds.rank, ds.world_size, ds.seed) == (1, 2, 7)
    assert ids(ds) == ids(PackedDataset(packed, rank=1, world_size=2, seed=7))
    with pytest.raises(ConfigError, match="epoch must be an integer"):
        ds.set_epoch(1.5)
    with pytest.raises(ConfigError, match="consumed must be an integer"):
        ds.state_dict(consumed=2.7)  # was cut to 2: the resumed stream repeated a pack
    assert ds.state_dict(consumed=torch.tensor(3))["consumed"] == 3
    with pytest.raises(ConfigError, match="batch_size must be an integer"):
        PackedIterableDataset(packed, batch_size=2.5)  # batches of 3 with consumed 2.5 before


def test_split_arguments_beside_a_packed_dataset_are_refused_not_ignored(packed):
    pytest.importorskip("torch")
    from packtool.reader.torch import PackedIterableDataset

    ds = PackedDataset(packed, seed=5)
    # rank 1 of 2 would have read rank 0's slice of world size 1: every rank the same packs
    with pytest.raises(ConfigError, match="rank=, world_size= would be ignored"):
        PackedIterableDataset(ds, batch_size=2, rank=1, world_size=2)
    assert PackedIterableDataset(ds, batch_size=2).dataset is ds


def test_state_of_a_batch_whose_position_was_popped_names_the_fix(packed):
    pytest.importorskip("torch")
    from packtool.reader.torch import PackedIterableDataset

    data = PackedIterableDataset(packed, batch_size=2, masks=False, seed=5)
    batch = next(iter(data))
    position = {"epoch": batch.pop("epoch"), "consumed": batch.pop("consumed")}  # as before model(**batch)
    with pytest.raises(ConfigError, match=r"no 'epoch' and 'consumed' \(popped before the model call\?\).*state_dict\(position\)"):
        data.state_dict(batch)  # was KeyError: 'consumed'
    assert data.state_dict(position)["consumed"] == 2


def test_torch_dataloader_workers_resume_exactly(packed):
    torch = pytest.importorskip("torch")
    from packtool.reader.torch import PackedIterableDataset

    def make():
        return PackedIterableDataset(packed, batch_size=2, masks=False, rank=1, world_size=2, seed=5)

    def run(ds, workers):
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers, multiprocessing_context="fork" if workers else None)
        return [(b["pack_index"], b["consumed"], b["epoch"]) for b in loader]

    ref = run(make(), 0)
    assert [i for b, _, _ in ref for i in b] == ids(PackedDataset(packed, rank=1, world_size=2, seed=5))
    assert len(ref) == len(make()) == 6
    with_workers = run(make(), 2)
    assert with_workers == ref
    ds = make()
    ds.load_state_dict(make().state_dict({"consumed": with_workers[2][1], "epoch": with_workers[2][2]}))
    assert run(ds, 1) == ref[3:]
    # the position after a batch does not depend on when it is asked for
    in_proc = make()
    batches = list(torch.utils.data.DataLoader(in_proc, batch_size=None, num_workers=0))
    assert in_proc.dataset.epoch == 1  # the finished epoch moved on
    assert in_proc.state_dict(batches[1])["epoch"] == 0 and in_proc.state_dict(batches[1])["consumed"] == 4
    assert in_proc.state_dict(batches[-1]) == {**in_proc.state_dict(), "epoch": 1, "consumed": 0}
    # persistent workers never see set_epoch: their copies move to the next epoch themselves
    persistent = torch.utils.data.DataLoader(make(), batch_size=None, num_workers=2, persistent_workers=True,
                                             multiprocessing_context="fork")
    epochs = [[i for b in persistent for i in b["pack_index"]] for _ in range(2)]
    in_process = make().dataset
    assert epochs == [ids(in_process), ids(in_process)] and epochs[0] != epochs[1]



def test_torch_dataloader_workers_keep_the_order_of_the_state_loaded(packed):
    """A checkpoint saved without ``order`` resumes in the first order in DataLoader workers too,
    and the states the adapter then saves carry that order to the next restart."""
    torch = pytest.importorskip("torch")
    from packtool.reader.torch import PackedIterableDataset

    def make():
        return PackedIterableDataset(packed, batch_size=2, masks=False, rank=1, world_size=3, seed=11)

    def run(ds, workers):
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers, multiprocessing_context="fork")
        return [(b["pack_index"], ds.state_dict(b)) for b in loader]

    old = ORDER_1[(3, 1, 0)]
    ds = make()
    ds.load_state_dict(_order_1(make().state_dict({"epoch": 0, "consumed": 2})))
    got = run(ds, 2)
    assert [i for b, _ in got for i in b] == old[2:]
    assert [s["order"] for _, s in got] == [1, 1, 1]
    again = make()
    again.load_state_dict(got[0][1])  # a restart of the restarted run: still the first order
    assert [i for b, _ in run(again, 1) for i in b] == old[4:]
    fresh = run(make(), 2)
    assert {s["order"] for _, s in fresh} == {2} and [i for b, _ in fresh for i in b] != old



@pytest.mark.parametrize("workers", [1, 2])
def test_a_persistent_worker_stopped_mid_epoch_does_not_skip_what_it_fetched_ahead(packed, workers):
    """With one persistent worker, leaving the loop mid-epoch and iterating again began after the
    batches the worker had fetched ahead but the trainer never saw: those packs were skipped
    that epoch. Every worker count now starts again where the reader stands, as fresh
    workers do."""
    torch = pytest.importorskip("torch")
    from packtool.reader.torch import PackedIterableDataset

    data = PackedIterableDataset(packed, batch_size=2, masks=False, seed=3)
    loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=workers, persistent_workers=True,
                                         multiprocessing_context="fork")
    for i, _ in enumerate(loader):
        if i == 2:
            break
    again = [i for b in loader for i in b["pack_index"]]
    assert again == ids(PackedDataset(packed, seed=3))


# --------------------------------------------------------------------------- each worker's own state


def round_robin(iters: list, first: int = 0):
    """``(worker, item)`` in the order a DataLoader hands workers' items to the trainer: worker
    ``first`` first, then cyclically, a worker dropped once it has no more."""
    live = list(range(first, len(iters))) + list(range(first))
    while live:
        for w in list(live):
            try:
                yield w, next(iters[w])
            except StopIteration:
                live.remove(w)


@pytest.mark.parametrize(("world_size", "rank", "num_workers", "block"), COMBOS)
def test_a_workers_own_state_resumes_that_worker_exactly(packed, world_size, rank, num_workers, block):
    """What StatefulDataLoader does with the copies in its workers: it keeps each worker's
    ``state_dict()`` from right after the last batch the trainer took from it, restores each into
    a fresh copy of the same worker and resumes the round robin after the last worker used. The
    trainer then gets every remaining pack once, in the uninterrupted order, wherever it stopped."""
    def fresh():
        return PackedDataset(packed, rank=rank, world_size=world_size, seed=11)

    full = [i for b, _ in loader_order(fresh(), num_workers, block) for i in b]
    n_blocks = -(-len(full) // block)
    for taken_blocks in range(n_blocks + 1):
        copies = [copy.deepcopy(fresh()) for _ in range(num_workers)]
        iters = [c.iter_blocks(w, num_workers, block) for w, c in enumerate(copies)]
        saved = [c.state_dict() for c in copies]  # a worker's state before its first batch
        taken, last = [], num_workers - 1
        for m, (w, (rows, _)) in enumerate(round_robin(iters)):
            if m == taken_blocks:
                break
            taken += ids(rows)
            saved[w], last = copies[w].state_dict(), w
        # the copies fetched ahead of the trainer; only what it took is in the saved states
        saved = json.loads(json.dumps(saved))  # a checkpoint can store them as JSON
        if num_workers > 1:  # one copy outside a DataLoader worker is read in-process: its position says it all
            assert {s["worker"]["num_workers"] for s in saved} == {num_workers}
        restored = [fresh() for _ in range(num_workers)]
        for c, s in zip(restored, saved, strict=True):
            c.load_state_dict(s)
            assert num_workers == 1 or c.state_dict() == s  # loaded, not yet iterated: the same state back
        rest = [i for _, (rows, _) in round_robin([c.iter_blocks(w, num_workers, block) for w, c in enumerate(restored)],
                                                  (last + 1) % num_workers) for i in ids(rows)]
        assert taken + rest == full, f"stopped after {taken_blocks} blocks"
        assert all(c.epoch == 1 and c.consumed == 0 for c in restored)  # every copy moved on at the end


def test_a_workers_state_refuses_another_worker_or_split(packed):
    full = ids(PackedDataset(packed, seed=2))
    ds = copy.deepcopy(PackedDataset(packed, seed=2))
    it = ds.iter_blocks(1, 2, block=3)
    next(it)
    state = ds.state_dict()
    assert state["worker"] == {"id": 1, "num_workers": 2, "block": 3, "next": 9} and state["consumed"] == 0
    fix = r"same num_workers and batch size, or checkpoint ds.state_dict\(batch\) instead"
    for split in [(0, 2, 3), (1, 3, 3), (1, 2, 2), (0, 1, 3)]:
        other = PackedDataset(packed, seed=2)
        other.load_state_dict(state)
        with pytest.raises(ResumeMismatchError, match=rf"worker 1 of 2 \(blocks of 3 packs\).*{fix}"):
            other.iter_blocks(*split)
        assert other.state_dict() == state  # still its state: the right split continues it
        assert [i for b, _ in other.iter_blocks(1, 2, 3) for i in ids(b)] == [full[i] for i in (*range(9, 12), *range(15, 18), 21, 22)]
    for bad in [{"id": 0}, {"next": 10}, {"next": 24}, {"num_workers": 0}, {"block": 0}, {"next": -3}]:
        with pytest.raises(ResumeMismatchError, match="unchanged"):
            PackedDataset(packed, seed=2).load_state_dict({**state, "worker": {**state["worker"], **bad}})
    with pytest.raises(ResumeMismatchError, match="where a dict is needed"):
        PackedDataset(packed, seed=2).load_state_dict({**state, "worker": 1})


def test_an_in_process_state_after_the_last_block_ends_that_pass(packed):
    """In-process, the state taken after the last pack but before the loop has ended says so,
    so a restored loop ends that pass too (then the next epoch begins) instead of reading the
    next epoch inside it; the position after a whole epoch is still the next epoch's start."""
    ds = PackedDataset(packed, world_size=3, seed=4)
    it = iter(ds)
    rows = [next(it) for _ in range(len(ds))]
    state = ds.state_dict()
    assert (state["epoch"], state["consumed"]) == (0, len(ds)) and "worker" not in state
    assert ds.state_dict(consumed=len(ds)) == {**state, "epoch": 1, "consumed": 0}
    again = PackedDataset(packed, world_size=3, seed=4)
    again.load_state_dict(state)
    assert ids(again) == [] and ids(again) == ids(_at_epoch(PackedDataset(packed, world_size=3, seed=4), 1))
    assert list(it) == [] and ds.state_dict() == {**state, "epoch": 1, "consumed": 0}
    assert len(rows) == 8


@pytest.mark.parametrize("workers", [1, 2])
def test_the_trainers_load_and_set_epoch_reach_persistent_workers(packed, workers):
    """Persistent workers hold copies made when they started: a load_state_dict or set_epoch on
    the trainer's reader after that was silently ignored (they went on from their own position).
    Each worker now takes the trainer's position when it next starts a pass."""
    torch = pytest.importorskip("torch")
    from packtool.reader.torch import PackedIterableDataset

    data = PackedIterableDataset(packed, batch_size=2, masks=False, seed=3)
    epoch0, epoch1 = ids(PackedDataset(packed, seed=3)), ids(_at_epoch(PackedDataset(packed, seed=3), 1))
    loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=workers, persistent_workers=True,
                                         multiprocessing_context="fork")
    used = []
    for batch in loader:
        used.append(batch)
        if len(used) == 3:
            break
    data.load_state_dict(data.state_dict(used[1]))  # go back to right after the second batch
    assert [i for b in loader for i in b["pack_index"]] == epoch0[4:]
    assert [i for b in loader for i in b["pack_index"]] == epoch1  # then the copies move on by themselves
    for i, _ in enumerate(loader):
        if i == 1:
            break
    data.set_epoch(1)  # a loop that leaves each epoch early: the next pass is epoch 1 from its start
    assert [i for b in loader for i in b["pack_index"]] == epoch1


def test_without_shared_memory_the_reader_still_reads_and_says_what_it_cannot_do(packed, monkeypatch, caplog):
    torch = pytest.importorskip("torch")
    from packtool.reader.torch import PackedIterableDataset

    def no_shm(self):
        raise RuntimeError("unable to open shared memory object")

    monkeypatch.setattr(torch.Tensor, "share_memory_", no_shm)
    with caplog.at_level("WARNING", logger="packtool.reader.torch"):
        data = PackedIterableDataset(packed, batch_size=2, masks=False, seed=3)
    assert "persistent DataLoader workers will not see a later set_epoch or load_state_dict" in caplog.text
    data.load_state_dict(data.state_dict({"epoch": 0, "consumed": 4}))
    assert [i for b in data for i in b["pack_index"]] == ids(PackedDataset(packed, seed=3))[4:]


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")  # more workers than cores: on purpose
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata 0.11 calls it on every loader it builds
@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (1, False), (1, True), (2, False), (2, True),
                                                         (3, False), (3, True)])
def test_stateful_dataloader_resumes_exactly(packed, num_workers, persistent):
    """torchdata's StatefulDataLoader saves and restores each worker's own state: checkpoints
    taken during a run (early, right after epoch 0's last batch, inside epoch 1), each restored
    in a fresh reader and loader, read exactly the packs the run read after them, in the same
    order, over two epochs (with ``set_epoch``, or with persistent workers moving on by themselves)."""
    pytest.importorskip("torch")
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    from packtool.reader.torch import PackedIterableDataset

    def run(state=None, first_epoch=0, save_after=()):
        data = PackedIterableDataset(packed, batch_size=2, masks=False, rank=1, world_size=2, seed=5)
        loader = stateful.StatefulDataLoader(data, batch_size=None, num_workers=num_workers,
                                             persistent_workers=persistent,
                                             multiprocessing_context="fork" if num_workers else None)
        if state is not None:
            loader.load_state_dict(state)
        read, saved = [], {}
        for epoch in range(first_epoch, 2):
            if not persistent:
                data.set_epoch(epoch)
            for batch in loader:
                read.append(batch["pack_index"])
                if len(read) in save_after:
                    saved[len(read)] = (torch_roundtrip(loader.state_dict()), epoch)
            if epoch == 0 and "end" in save_after:  # after the loop: the loader's iterator has finished
                saved["end"] = (torch_roundtrip(loader.state_dict()), epoch + 1)
        return read, saved

    # with 3 workers, one is still unused after 2 batches; after batch 6, epoch 0's last, inside the
    # loop (resumed in epoch 0, whose loop then ends at once) and after it (torchdata starts a
    # finished loader afresh: resumed at the next epoch, as the README says)
    full, saved = run(save_after=(2, 6, 9, "end"))
    epochs = [ids(_at_epoch(PackedDataset(packed, rank=1, world_size=2, seed=5), e)) for e in (0, 1)]
    assert [i for b in full[:6] for i in b] == epochs[0] and [i for b in full[6:] for i in b] == epochs[1]
    for stop, (state, epoch) in saved.items():
        rest, _ = run(state, first_epoch=epoch)
        done = 6 if stop == "end" else stop
        assert full[:done] + rest == full, f"restored after batch {stop}"


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")  # more workers than cores: on purpose
@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (1, False), (2, False), (2, True), (3, False)])
def test_a_loop_without_set_epoch_reads_the_same_epochs_whatever_the_workers(packed, num_workers, persistent):
    """A finished epoch moves on by itself in-process and in persistent workers' copies; fresh
    (non-persistent) workers are copied from the trainer's reader, which never moves, and read
    epoch 0 again every epoch. They now move on once every worker has read its share to the end,
    so three loops read epochs 0, 1, 2 in every setting; a set_epoch still says which epoch."""
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from packtool.reader.torch import PackedIterableDataset

    data = PackedIterableDataset(packed, batch_size=2, masks=False, seed=4)
    loader = DataLoader(data, batch_size=None, num_workers=num_workers, persistent_workers=persistent,
                        multiprocessing_context="fork" if num_workers else None)
    epochs = [ids(_at_epoch(PackedDataset(packed, seed=4), e)) for e in range(4)]
    got = [[(b["epoch"], i) for b in loader for i in b["pack_index"]] for _ in range(3)]
    assert got == [[(e, i) for i in epochs[e]] for e in range(3)]
    data.set_epoch(1)  # the trainer says which epoch: it is read, and the loop after it moves on from there
    assert [[i for b in loader for i in b["pack_index"]] for _ in range(2)] == [epochs[1], epochs[2]]


def torch_roundtrip(state):
    """``state`` through ``torch.save`` / ``torch.load`` (how a checkpoint holds it)."""
    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# --------------------------------------------------------------------------- shard checks


def test_shard_checks(packed, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(packed, bad)
    f = bad / "part-00001.parquet"
    data = bytearray(f.read_bytes())
    # a byte inside the page data of the first row group's input ids, which the page checksum
    # covers (a fixed fraction of the file may land in the footer, which no decoder checks)
    chunk = next(c for c in (pq.ParquetFile(f).metadata.row_group(0).column(i) for i in range(
        pq.ParquetFile(f).metadata.num_columns)) if c.path_in_schema.startswith("compact_input_ids"))
    data[chunk.data_page_offset + chunk.total_compressed_size - 3] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(InputError, match=r"part-00001\.parquet.*sha256.*re-run packtool pack"):
        list(PackedDataset(bad, shuffle=False, verify=True))
    with pytest.raises(InputError, match=r"part-00001\.parquet.*(cannot be read|sha256)"):
        list(PackedDataset(bad, shuffle=False))  # without verify the decoder notices, with the same advice
    f.write_bytes(bytes(data) + b"x")
    with pytest.raises(InputError, match=r"part-00001\.parquet.*bytes but \.packtool/manifest\.json says"):
        list(PackedDataset(bad, shuffle=False))
    f.unlink()
    with pytest.raises(InputError, match="missing"):
        list(PackedDataset(bad, shuffle=False))
    with pytest.raises(InputError, match=r"no \.packtool/manifest\.json"):
        PackedDataset(tmp_path)


def test_a_tokenized_directory_is_refused_naming_the_step_missing(demo):
    """The reader given the tokenized directory said only 'holds tokenized shards, expected packed shards'."""
    with pytest.raises(InputError) as err:
        PackedDataset(demo["tok"])
    tok = str(demo["tok"])
    assert str(err.value) == (f"{tok!r} holds tokenized shards, expected packed shards; pack it first "
                              f"(`packtool pack {tok} -o PACKED`) and pass the packed directory")


def test_plain_pyarrow_reads_shards(demo):
    import pyarrow.dataset as pads

    manifest = json.loads((demo["embed"] / ".packtool" / "manifest.json").read_text())
    total = 0
    for entry in manifest["shards"]:
        table = pq.read_table(demo["embed"] / entry["file"])
        assert table.num_rows == entry["rows"]
        assert table.schema.remove_metadata().equals(PACKED.remove_metadata())
        assert table.schema.metadata[b"packtool.kind"] == b"packed"
        total += table.num_rows
    data = pads.dataset([str(demo["embed"] / e["file"]) for e in manifest["shards"]], format="parquet").to_table()
    assert data.num_rows == total == len(PackedDataset(demo["embed"]))
    first = data.slice(0, 1).to_pylist()[0]
    # runs form: a direct reader finds no `input_ids` (never compact data under that name), nor
    # version 3's list columns (never bytes read as values) ...
    assert "input_ids" not in first and "compact_input_ids" not in first and "run_starts" not in first
    # ... but each row's little-endian int32 values, one bytes object per column
    compact_ids = np.frombuffer(first["compact_input_ids_i32le"], dtype="<i4")
    assert len(compact_ids) < first["n_tokens"] and len(first["run_starts_i32le"]) == len(first["run_lengths_i32le"]) > 0
    # ... and packtool.runs.expand_row gives the documented row, the one PackedDataset yields
    row = expand_row(first)
    assert len(row["input_ids"]) == row["n_tokens"] == row["cu_seqlens"][-1]
    mine = next(r for r in PackedDataset(demo["embed"], shuffle=False) if r["pack_index"] == first["pack_index"])
    for name in ("input_ids", "target_ids", "position_ids", "subsegment_ids"):
        assert row[name] == mine[name].tolist(), name


# --------------------------------------------------------------------------- masks and positions


def twin_mask(sub) -> np.ndarray:
    """Brute-force twin of the DESIGN.md rule, one pair at a time."""
    n = len(sub)
    out = np.zeros((n, n), dtype=bool)
    for q in range(n):
        for j in range(n):
            out[q, j] = j <= q and sub[q] <= sub[j] and sub[q] // SUBSEGMENT_STRIDE == sub[j] // SUBSEGMENT_STRIDE
    return out


def twin_positions(sub) -> list[int]:
    out, seen = [], {}
    for s in sub:
        k, b = divmod(s, SUBSEGMENT_STRIDE)
        prefix = seen.get((k, PREFIX_SUBSEGMENT), 0)
        n = seen.get((k, b), 0)
        out.append(n if b == PREFIX_SUBSEGMENT else prefix + n)
        seen[(k, b)] = n + 1
    return out


@st.composite
def packed_subsegments(draw):
    sub = []
    for k in range(draw(st.integers(1, 4))):
        sub += [k * SUBSEGMENT_STRIDE + PREFIX_SUBSEGMENT] * draw(st.integers(0, 5))
        n_branches = draw(st.integers(0, 3))
        for b in range(n_branches):
            sub += [k * SUBSEGMENT_STRIDE + b] * draw(st.integers(1, 4))
    sub += [PAD_SUBSEGMENT] * draw(st.integers(0, 3))
    return sub


@settings(max_examples=150, deadline=None)
@given(sub=packed_subsegments())
def test_mask_and_positions_match_twins(sub):
    mask = attention_mask(sub)
    np.testing.assert_array_equal(mask, twin_mask(sub))
    if sub:
        assert mask.diagonal().all()  # every query sees at least itself: no NaN rows in softmax
    real = [s for s in sub if s != PAD_SUBSEGMENT]
    assert position_ids(real).tolist() == twin_positions(real)


def test_mask_tree_semantics():
    # sample 0: prefix(2) branch0(2) branch1(1); sample 1: two tokens
    sub = [10000, 10000, 0, 0, 1, 110000, 110000]
    m = attention_mask(sub)
    assert m[4, :2].all() and not m[4, 2:4].any()  # branch 1 sees the prefix, not branch 0
    assert not m[5, :5].any() and m[6, 5]  # sample 1 sees nothing of sample 0
    media = [{"token_offset": 0, "n_tokens": 2, "sample_index": 0}, {"token_offset": 5, "n_tokens": 2, "sample_index": 1}]
    mb = attention_mask(sub, media, vision="media")
    assert mb[0, 1] and mb[5, 6] and not mb[0, 2] and not mb[1, 5]
    with pytest.raises(ConfigError, match="media list"):
        attention_mask(sub, vision="sample")
    with pytest.raises(ConfigError, match="choose one of"):
        attention_mask(sub, media, vision="full")


def test_positions_and_varlen_on_demo(demo):
    rows = list(PackedDataset(demo["ref"], shuffle=False))
    for r in rows:
        np.testing.assert_array_equal(position_ids(r["subsegment_ids"]), r["position_ids"])
        kw = flash_attn_varlen_kwargs(r)
        np.testing.assert_array_equal(kw["cu_seqlens_q"], r["cu_seqlens"])
        assert kw["max_seqlen_q"] == max(np.diff(r["cu_seqlens"])) and kw["causal"]
    both = flash_attn_varlen_kwargs(rows[:2])
    n0 = rows[0]["n_tokens"]
    assert both["cu_seqlens_k"].tolist() == list(rows[0]["cu_seqlens"]) + [n0 + c for c in rows[1]["cu_seqlens"][1:]]
    tree = {"pack_index": 3, "cu_seqlens": [0, 5], "subsegment_ids": [10000, 10000, 0, 0, 1]}
    with pytest.raises(InputError, match="message trees"):
        flash_attn_varlen_kwargs(tree)


# --------------------------------------------------------------------------- collate and media


def test_collate_pads_and_masks(demo):
    rows = list(PackedDataset(demo["ref"], shuffle=False))[:3]
    b = collate(rows, masks=True, pixels=False)
    longest = max(r["n_tokens"] for r in rows)
    assert b["input_ids"].shape == (3, longest) and b["attention_mask"].shape == (3, 1, longest, longest)
    for i, r in enumerate(rows):
        n = r["n_tokens"]
        assert b["lengths"][i] == n
        np.testing.assert_array_equal(b["target_ids"][i, :n], r["target_ids"])
        assert (b["target_ids"][i, n:] == -100).all() and (b["subsegment_ids"][i, n:] == PAD_SUBSEGMENT).all()
        assert b["attention_mask"][i, 0].diagonal().all()
        assert not b["attention_mask"][i, 0, n:, :n].any() and not b["attention_mask"][i, 0, :n, n:].any()
        assert b["cu_seqlens"][i][-1] == longest and b["cu_seqlens"][i][:len(r["cu_seqlens"])].tolist() == list(r["cu_seqlens"])
        assert b["pixel"][i] == [] and all("data" not in m and "frames" not in m for m in b["media"][i])
    fixed = collate(rows, pad_to=8192, pixels=False)
    assert fixed["input_ids"].shape == (3, 8192) and "attention_mask" not in fixed
    with pytest.raises(ConfigError, match="pad_to"):
        collate(rows, pad_to=100, pixels=False)


def test_pad_to_the_capacity_names_an_oversize_alone_pack(demo, tmp_path):
    """``--oversize alone`` packs are longer than ``--max-tokens``: the error must not say that
    ``pad_to=max_tokens`` is enough (it is what the trainer passed)."""
    torch = pytest.importorskip("torch")
    import packtool
    from packtool import PackConfig
    from packtool.reader.torch import PackedIterableDataset

    packtool.pack_dataset(demo["tok"], tmp_path / "alone", PackConfig(max_tokens=4096, oversize="alone"))
    rows = list(PackedDataset(tmp_path / "alone", shuffle=False))
    big = max(rows, key=lambda r: r["n_tokens"])
    assert big["n_tokens"] > 4096
    data = PackedIterableDataset(tmp_path / "alone", batch_size=2, pad_to=4096, masks=False, shuffle=False)
    with pytest.raises(ConfigError, match=rf"^pack {big['pack_index']} has {big['n_tokens']:,} tokens but pad_to is "
                                          r"4,096; raise pad_to to the longest pack \(.*--oversize alone"):
        list(torch.utils.data.DataLoader(data, batch_size=None))
    assert collate([big], pad_to=big["n_tokens"], pixels=False)["input_ids"].shape == (1, big["n_tokens"])


def test_images_decode_from_embedded_bytes_and_references(demo):
    emb = next(iter(PackedDataset(demo["embed"], shuffle=False)))
    ref = next(iter(PackedDataset(demo["ref"], shuffle=False)))
    assert ids([emb]) == ids([ref]) and emb["media"]
    batch = collate([emb], pixels=True)
    pixels = batch["pixel"][0]
    assert len(pixels) == len(emb["media"])
    for item, im in zip(emb["media"], pixels, strict=True):
        with Image.open(SAMPLE / item["path"]) as original:
            assert im.size == (item["width"], item["height"]) == original.size
            assert np.array_equal(np.asarray(im), np.asarray(original.convert("RGB")))
    with pytest.raises(InputError, match="media_root"):
        decode_media(ref)
    by_ref = decode_media(ref, media_root=SAMPLE)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(by_ref, pixels, strict=True))
    with pytest.raises(InputError, match="outside"):
        decode_image({**ref["media"][0], "path": "../../etc/passwd"}, media_root=SAMPLE)


def test_a_reference_tokenize_accepted_is_found_by_the_reader(tmp_path):
    """tokenize finds ``imgs\\sub\\e.jpg`` (Windows separators) under the media root and records the path as
    written; packed by reference, the reader said 'not found under media_root' for the very root it was
    tokenized with, where the embedded pack decoded."""
    import packtool
    from packtool import PackConfig, TokenizeConfig

    (tmp_path / "imgs" / "sub").mkdir(parents=True)
    Image.new("RGB", (64, 48), (200, 30, 30)).save(tmp_path / "imgs" / "sub" / "e.png")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"id": "a", "image": "imgs\\sub\\e.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat colour?"}, {"from": "gpt", "value": "Red."}]}) + "\n")
    packtool.tokenize_dataset([data], tmp_path / "tok", TokenizeConfig(media_root=str(tmp_path)))
    packtool.pack_dataset(tmp_path / "tok", tmp_path / "ref", PackConfig(max_tokens=256, media="reference"))
    row = next(iter(PackedDataset(tmp_path / "ref")))
    assert row["media"][0]["path"] == "imgs\\sub\\e.png"
    (im,) = decode_media(row, media_root=tmp_path)
    assert im.size == (64, 48) and im.getpixel((5, 5)) == (200, 30, 30)
    with pytest.raises(InputError, match=r"^media file .* not found under media_root .*; pass the right media_root$"):
        decode_media(row, media_root=tmp_path / "imgs")


def test_media_named_by_absolute_path_are_found_under_a_new_media_root_after_a_move(tmp_path):
    """Packed by reference from records that name their images by absolute path under the media root, the
    rows held that path: once the media moved, ``decode_media(row, media_root=NEW)`` said it "resolves
    outside media_root; pass the right media_root", and no root was right."""
    import packtool
    from packtool import PackConfig, TokenizeConfig

    media = tmp_path / "data"
    (media / "imgs").mkdir(parents=True)
    rng = np.random.default_rng(11)
    pixels = {}
    for name in ("a.png", "b.png"):
        pixels[name] = rng.integers(0, 256, (40, 56, 3), dtype=np.uint8)
        Image.fromarray(pixels[name]).save(media / "imgs" / name)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": i, "image": image, "conversations": [
        {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "Noise."}]}) + "\n"
        for i, image in (("a", f"{media}/imgs/a.png"), ("b", f"file://{media}/imgs/b.png"))))
    packtool.tokenize_dataset([data], tmp_path / "tok", TokenizeConfig(media_root=str(media)))
    packtool.pack_dataset(tmp_path / "tok", tmp_path / "ref", PackConfig(max_tokens=512, media="reference"))
    moved = media.rename(tmp_path / "moved")
    rows = list(PackedDataset(tmp_path / "ref"))
    items = [m for row in rows for m in row["media"]]
    assert sorted(m["path"] for m in items) == ["imgs/a.png", "imgs/b.png"]
    for m in items:
        assert np.array_equal(np.asarray(decode_image(m, media_root=moved)), pixels[m["path"].split("/")[1]])
    got = [np.asarray(im) for ims in collate(rows, media_root=moved)["pixel"] for im in ims]
    assert len(got) == 2 and all(any(np.array_equal(g, p) for p in pixels.values()) for g in got)
    with pytest.raises(InputError, match=r"^media file 'imgs/.\.png' not found under media_root .*; pass the right"):
        decode_media(rows[0], media_root=media)


def test_collate_turns_images_as_tokenize_counted_them(tmp_path):
    """Packs tokenized with --exif apply (Molmo2's default) count a photo whose EXIF says 'rotate 90' turned:
    its media item says 40x60. collate's ``pixel`` and decode_media gave it unturned (60x40), another size
    than its vision tokens were counted for."""
    import packtool
    from packtool import PackConfig, TokenizeConfig

    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees
    rng = np.random.default_rng(3)
    Image.fromarray(rng.integers(0, 256, (40, 60, 3), dtype=np.uint8)).save(tmp_path / "turned.jpg", exif=exif.tobytes())
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"id": "a", "image": "turned.jpg", "conversations": [
        {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "Noise."}]}) + "\n")
    packtool.tokenize_dataset([data], tmp_path / "tok", TokenizeConfig(media_root=str(tmp_path), exif="apply"))
    with Image.open(tmp_path / "turned.jpg") as im:
        want = np.asarray(ImageOps.exif_transpose(im).convert("RGB"))
    for media in ("embed", "reference"):
        packtool.pack_dataset(tmp_path / "tok", tmp_path / media, PackConfig(max_tokens=512, media=media))
        row = next(iter(PackedDataset(tmp_path / media)))
        assert row["vision"]["exif"] == "apply" and (row["media"][0]["width"], row["media"][0]["height"]) == (40, 60)
        (got,) = collate([row], media_root=tmp_path)["pixel"][0]
        assert got.size == (40, 60) and np.array_equal(np.asarray(got), want), media
        assert decode_media(row, tmp_path)[0].size == (40, 60)


def _transparent(mode: str) -> bytes:
    """A seeded 64x48 image in ``mode`` whose left half is transparent over hidden noise."""
    rng = np.random.default_rng(5)
    rgba = rng.integers(0, 256, (48, 64, 4), dtype=np.uint8)
    rgba[:, :32, 3] = 0
    im = Image.fromarray(rgba)
    buf = io.BytesIO()
    if mode == "P":  # a palette PNG whose colour 0 is transparent (icons, GIF-era art)
        im.convert("RGB").quantize(16, dither=Image.Dither.NONE).save(buf, format="PNG", transparency=0)
    else:
        im.convert(mode).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparent_images_decode_as_the_models_processor_sees_them(mode):
    """Transparency is laid over white, as transformers' image processors do with the original file;
    a plain ``convert("RGB")`` gave the hidden colours (black in most files) in the model's pixels."""
    pytest.importorskip("transformers")
    from transformers import Qwen2VLImageProcessor
    from transformers.image_transforms import convert_to_rgb

    data = _transparent(mode)
    processor = Qwen2VLImageProcessor()
    with Image.open(io.BytesIO(data)) as original:
        assert "A" in original.getbands() or "transparency" in original.info
        want = np.asarray(convert_to_rgb(original))  # what every image processor applies first
        want_pixels = processor(images=[original], return_tensors="np")["pixel_values"]
    got = decode_image({"kind": "image", "data": data})
    assert got.mode == "RGB" and got.size == (64, 48)
    assert np.array_equal(np.asarray(got), want)
    assert np.array_equal(processor(images=[got], return_tensors="np")["pixel_values"], want_pixels)


COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0)]


def test_video_frames_embedded_and_by_reference(tmp_path):
    import av

    # a 4 s video at 2 fps whose frames are solid colours, one colour per second
    path = tmp_path / "clip.mp4"
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=2)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(8):
            frame = av.VideoFrame.from_image(Image.new("RGB", (64, 48), COLOURS[i // 2]))
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    stamps = [0.0, 1.0, 2.5, 3.5]
    want = [COLOURS[int(t)] for t in stamps]
    item = {"kind": "video", "path": "clip.mp4", "timestamps": stamps, "data": None, "frames": None, "token_offset": 0, "n_tokens": 4}
    got = decode_video(item, media_root=tmp_path)
    assert isinstance(got, VideoFrames) and got.timestamps == tuple(stamps)
    for im, colour in zip(got.frames, want, strict=True):
        assert np.abs(np.asarray(im).reshape(-1, 3).mean(0) - colour).max() < 20

    def jpeg(colour):
        buf = io.BytesIO()
        Image.new("RGB", (32, 24), colour).save(buf, format="JPEG")
        return buf.getvalue()

    embedded = decode_video({**item, "path": None, "frames": [jpeg(c) for c in want]})
    assert embedded.timestamps == tuple(stamps)
    for im, colour in zip(embedded.frames, want, strict=True):
        assert im.size == (32, 24) and np.abs(np.asarray(im).reshape(-1, 3).mean(0) - colour).max() < 8
    with pytest.raises(InputError, match="2 embedded frames but 4 timestamps"):
        decode_video({**item, "frames": [jpeg(c) for c in want[:2]]})


@pytest.mark.parametrize("damage, says", [
    (lambda b: b[: len(b) // 2], "embedded frame 1 of 2 does not decode"),
    (lambda b: b"\x00" * 100, "not an image Pillow can identify"),
])
def test_a_damaged_embedded_video_frame_is_an_input_error_naming_the_video(damage, says):
    """As a damaged embedded image is: one line naming the video, the frame and the fix, not Pillow's error."""
    buf = io.BytesIO()
    Image.effect_noise((64, 48), 80).convert("RGB").save(buf, format="JPEG")
    item = {"kind": "video", "path": "clip.mp4", "timestamps": [0.0, 0.5], "frames": [buf.getvalue(), damage(buf.getvalue())]}
    with pytest.raises(InputError, match=f"video 'clip.mp4'.*{says}.*re-run packtool pack"):
        decode_video(item)


def test_video_by_reference_gives_the_frames_pack_embeds(tmp_path):
    """Timestamps count from the stream's first frame and a rotated video's frames are turned, as tokenize
    counted and pack embeds them. A clip whose stream starts at 1 s used to give frames 0, 0, 3, 9 by
    reference (its timestamps read as absolute times) where the embedded pack holds frames 0, 6, 13, 19;
    a video with display rotation came back unturned, in another shape than counted."""
    from video_fixtures import write_video

    from packtool.media import extract_frames

    write_video(tmp_path / "late.mp4", n_frames=20, fps=10, step=12, pts=[1000 + 100 * i for i in range(20)])
    write_video(tmp_path / "turned.mp4", n_frames=20, fps=10, step=12, rotation=90)
    stamps = [0.0, 0.6, 1.3, 1.9]
    for name, size in (("late.mp4", (64, 48)), ("turned.mp4", (48, 64))):
        item = {"kind": "video", "path": name, "timestamps": stamps, "data": None, "frames": None, "width": size[0],
                "height": size[1], "token_offset": 0, "n_tokens": 4}
        by_reference = decode_video(item, media_root=tmp_path)
        embedded = decode_video({**item, "frames": extract_frames(tmp_path, item)})
        for got in (by_reference, embedded):
            levels = [float(np.asarray(f.convert("L")).mean()) for f in got.frames]
            assert np.allclose(levels, [0, 72, 156, 228], atol=3), (name, levels)
            assert [f.size for f in got.frames] == [size] * 4, name


def test_media_that_came_as_bytes_keep_them_when_packed_by_reference(tmp_path):
    """An image or video given inline (a data URI here; a Parquet image struct is the same item)
    has no file to refer to: by reference it used to be packed with neither a path nor its
    bytes, which no media root could bring back (validate said OK). It keeps its file's bytes:
    the image decodes as embedded, the video's frames are decoded from them at read time and
    are those pack embeds; validate reports a packed item with neither."""
    import base64

    from test_validate import relist
    from video_fixtures import write_video

    from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset
    from packtool.validate import validate_dir

    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 10, 10)).save(buf, "PNG")
    clip = write_video(tmp_path / "clip.mp4", n_frames=20, fps=10, step=12).read_bytes()

    def uri(kind: str, data: bytes) -> str:
        return f"data:{kind};base64," + base64.b64encode(data).decode()

    records = [{"id": "img", "image": uri("image/png", buf.getvalue()),
                "conversations": [{"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": "Red."}]},
               {"id": "vid", "video": uri("video/mp4", clip),
                "conversations": [{"from": "human", "value": "<video>\nWhat?"}, {"from": "gpt", "value": "Grey."}]}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "media").mkdir()
    tokenize_dataset([tmp_path / "in.jsonl"], tmp_path / "tok", TokenizeConfig(media_root=str(tmp_path / "media")),
                     workers=1, progress=None)
    rows = {}
    for media in ("reference", "embed"):
        pack_dataset(tmp_path / "tok", tmp_path / media, PackConfig(media=media), workers=1, progress=None)
        (row,) = list(PackedDataset(tmp_path / media))
        rows[media] = row
    by_ref = {m["kind"]: m for m in rows["reference"]["media"]}
    assert by_ref["image"]["path"] is None and by_ref["image"]["data"] == buf.getvalue()
    assert by_ref["video"]["path"] is None and by_ref["video"]["data"] == clip and by_ref["video"]["frames"] is None
    got, want = decode_media(rows["reference"]), decode_media(rows["embed"])  # no media_root: nothing to find
    assert np.asarray(got[0]).tolist() == np.asarray(want[0]).tolist()
    assert got[1].timestamps == want[1].timestamps and len(got[1].frames) == len(want[1].frames) > 1
    for a, b in zip(got[1].frames, want[1].frames, strict=True):  # embedded frames are JPEG: grey levels agree
        assert abs(float(np.asarray(a.convert("L")).mean()) - float(np.asarray(b.convert("L")).mean())) < 3
    assert validate_dir(tmp_path / "reference")["ok"]
    # a packed item with neither a path nor its bytes is a finding, not a row that fails at training time
    shard = next((tmp_path / "reference").glob("*.parquet"))
    table = pq.read_table(shard)
    media_col = table.column("media").to_pylist()
    media_col[0][0]["data"] = None
    broken = table.set_column(table.schema.get_field_index("media"), "media",
                              pa.array(media_col, type=table.schema.field("media").type))
    pq.write_table(broken, shard)
    relist(tmp_path / "reference", shard)
    report = validate_dir(tmp_path / "reference")
    assert not report["ok"]
    assert [p["what"] for p in report["problems"]] == [
        "media 0: image has neither a path nor its bytes, so no reader can load it; pack the tokenized directory again "
        "(items that came as bytes keep them, by reference too)"], report["problems"]


# --------------------------------------------------------------------------- README


def readme_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Training on packed shards", 1)[1].split("\n## ", 1)[0]
    # blocks marked skip (the transformers recipes, which need a model in scope) run in tests/test_hf_readme.py
    return re.findall(r"(?<!<!-- docs: skip -->\n)```python\n(.*?)```", section, flags=re.S)


def test_readme_training_loop_runs_on_cpu(demo, tmp_path):
    torch = pytest.importorskip("torch")
    loops = [b for b in readme_blocks() if "optimizer.step()" in b]
    assert len(loops) == 1, "the section has exactly one complete training loop"
    code = loops[0]
    assert len([line for line in code.splitlines() if line.strip()]) <= 36
    assert '"build/demo/packed"' in code and '"checkpoint.pt"' in code
    ckpt = tmp_path / "ckpt.pt"
    code = code.replace('"build/demo/packed"', repr(str(demo["small"]))).replace('"checkpoint.pt"', repr(str(ckpt)))
    scope: dict = {"__name__": "__readme__"}
    exec(compile(code, "README.md", "exec"), scope)  # the documented example itself
    saved = torch.load(ckpt, weights_only=False)
    assert len(scope["data"]) >= 2 and saved["data"] == {**scope["data"].state_dict(), "epoch": 2, "consumed": 0}
    assert np.isfinite(scope["loss"].item())


def test_readme_numpy_batches_run(demo):
    blocks = [b for b in readme_blocks() if "from packtool.reader import" in b]
    assert len(blocks) == 1
    code = blocks[0].replace('"build/demo/packed"', repr(str(demo["small"]))).replace('"examples/sample"', repr(str(SAMPLE)))
    scope: dict = {"__name__": "__readme__"}
    exec(compile(code, "README.md", "exec"), scope)
    batch = scope["batch"]
    assert batch["input_ids"].shape[0] == 2 and batch["attention_mask"].shape[:2] == (2, 1)
    assert all(len(p) == len(m) for p, m in zip(batch["pixel"], batch["media"], strict=True))


@pytest.mark.parametrize("edit, says", [
    (lambda row: row["run_lengths"].__setitem__(0, row["run_lengths"][0] + 1), "has n_tokens"),
    (lambda row: row["run_starts"].__setitem__(0, len(row["compact_input_ids"])), "cannot be read"),
    # a stored blob cut short (edited as bytes): not whole int32 values
    (lambda row: row.__setitem__("run_lengths_i32le", row["run_lengths_i32le"][:-1]), "multiple of 4"),
])
def test_a_damaged_run_table_is_an_input_error(demo, tmp_path, edit, says):
    """A run table that does not expand to the row's n_tokens, or points outside the row, is
    refused with the shard named, never expanded into a wrong row."""
    d = tmp_path / "ref"
    shutil.copytree(demo["ref"], d)
    manifest = json.loads((d / ".packtool" / "manifest.json").read_text())
    f = d / manifest["shards"][0]["file"]
    as_bytes = "multiple" in says
    table = pq.read_table(f)
    rows = (table if as_bytes else list_form(table)).to_pylist()
    assert rows[0]["run_lengths_i32le" if as_bytes else "run_lengths"], "the demo's first pack holds image spans"
    edit(rows[0])
    pq.write_table(pa.Table.from_pylist(rows, schema=PACKED) if as_bytes
                   else blob_table(pa.Table.from_pylist(rows, schema=PACKED_V3)).cast(PACKED), f)
    manifest["shards"][0].update(bytes=f.stat().st_size, sha256=sha256_file(f))
    (d / ".packtool" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InputError, match=says) as err:
        list(PackedDataset(d, shuffle=False))
    assert f.name in str(err.value)


def test_a_packed_directory_of_schema_version_3_reads_the_same(demo, tmp_path):
    """Packed shards in the list form of schema v3 (as older packtool wrote them): the reader,
    ``inspect`` and ``runs.read_expanded`` give the same rows as from today's blobs."""
    from packtool.inspection import inspect_dir
    from packtool.runs import read_expanded

    d = tmp_path / "v3"
    shutil.copytree(demo["ref"], d)
    manifest = json.loads((d / ".packtool" / "manifest.json").read_text())
    for entry in manifest["shards"]:
        f = d / entry["file"]
        pq.write_table(list_form(pq.read_table(f)).cast(PACKED_V3), f)
        entry.update(bytes=f.stat().st_size, sha256=sha256_file(f))
    manifest["schema_version"] = 3
    (d / ".packtool" / "manifest.json").write_text(json.dumps(manifest))
    assert "compact_input_ids" in pq.read_schema(d / manifest["shards"][0]["file"]).names
    old, new = list(PackedDataset(d, shuffle=False)), list(PackedDataset(demo["ref"], shuffle=False))
    assert len(old) == len(new) > 0
    for a, b in zip(old, new, strict=True):
        assert a.keys() == b.keys()
        for key in ("input_ids", "target_ids", "position_ids", "subsegment_ids", "cu_seqlens"):
            assert np.array_equal(a[key], b[key]), (a["pack_index"], key)
    first = manifest["shards"][0]["file"]
    cols = ["pack_index", "input_ids", "position_ids"]
    assert read_expanded(d / first, cols).equals(read_expanded(demo["ref"] / first, cols))
    assert inspect_dir(d, pack=1) == {**inspect_dir(demo["ref"], pack=1), "dir": str(d)}



@pytest.fixture
def bucket(tmp_path, monkeypatch) -> Path:
    """``s3://b/KEY`` served from ``tmp_path/bucket/b/KEY`` by a local file system (no server), and a
    fresh reader cache."""
    import os

    from fsspec.implementations.local import LocalFileSystem

    import packtool.storage as storage

    root = tmp_path / "bucket"

    class Bucket(LocalFileSystem):
        def _strip_protocol(self, path):
            path = str(path)
            return path if path.startswith(str(root)) else f"{root}/{path.lstrip('/')}"

    monkeypatch.setenv("PACKTOOL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(storage._FILESYSTEMS, ("s3", os.getpid()), Bucket())
    return root


def test_a_small_bucket_cache_keeps_the_footer_of_a_shard_it_fetched_whole(bucket):
    """A small shard comes whole with its footer; recording its groups may pass the cap, and evicting
    one of them, before the footer's spans were known, removed the whole file (a FileNotFoundError)."""
    write_packed(bucket / "b" / "p", [60, 50, 70, 30, 5], group_rows=3)
    rows = [r["pack_index"] for r in PackedDataset("s3://b/p", seed=0, cache_bytes=50_000, prefetch=0)]
    assert rows == [r["pack_index"] for r in PackedDataset(bucket / "b" / "p", seed=0)]


def test_readers_sharing_the_bucket_cache_do_not_evict_what_another_reads(bucket):
    """Ranks and DataLoader workers on one machine share the cache directory, each within its own
    cap: one's eviction (a punched group, a removed file) must cost the other a fetch, not a read
    of a group that is gone (it was an InputError calling the shard corrupt)."""
    write_packed(bucket / "b" / "p", [60, 50, 70, 30, 5], group_rows=3)
    local = bucket / "b" / "p"
    for world, cap in ((4, 26_000), (3, 100_000), (6, 50_000)):
        streams = [iter(PackedDataset("s3://b/p", rank=r, world_size=world, seed=cap, cache_bytes=cap)) for r in range(world)]
        got = [[next(s)["pack_index"] for s in streams] for _ in range(len(PackedDataset(local, world_size=world)))]
        want = [[r["pack_index"] for r in PackedDataset(local, rank=k, world_size=world, seed=cap)] for k in range(world)]
        assert got == [list(step) for step in zip(*want, strict=True)]


def test_a_group_held_for_reading_is_not_evicted_by_the_same_process(bucket):
    """The reader holds a row group while it reads it (``GroupCache.held``): fetching other groups
    meanwhile (the prefetcher's thread; here in line) evicts others, not it. The newest ``keep``
    groups were the only guard, and a small shard fetched whole records all its groups at once,
    which could push the group being read out of them and punch it out under the read."""
    from packtool.reader.cache import GroupCache

    write_packed(bucket / "b" / "p", [12, 12], group_rows=3)
    shards = json.loads((bucket / "b" / "p" / ".packtool" / "manifest.json").read_text())["shards"]
    (a, b) = ((f"s3://b/p/{e['file']}", e["bytes"], e["sha256"]) for e in shards)
    want = pq.ParquetFile(bucket / "b" / "p" / shards[0]["file"]).read_row_group(0)
    cache = GroupCache(max_bytes=1, keep=1, coalesce_bytes=0)  # every group but the newest is evicted
    held, newest = (cache._name(a[2]), 0), (cache._name(b[2]), 3)
    with cache.held(*a, 0) as path:
        for g in range(4):
            cache.path(*b, g)
        assert [k for k in cache._lru if k[1] >= 0] == [held, newest]  # the others went
        got = pq.ParquetFile(path, page_checksum_verification=True).read_row_group(0)
    assert got.equals(want)
    cache.path(*b, 0)  # held no longer: evicted like any other
    assert [k for k in cache._lru if k[1] >= 0] == [(newest[0], 0)]


def test_an_eager_mask_of_the_torch_adapter_takes_the_models_dtype(demo):
    """``dtype=`` reaches the eager mask the DataLoader workers build: a bf16 model gets a bf16
    mask (half the bytes of float32), 0 where attention is allowed and the dtype's minimum
    elsewhere, as :func:`model_inputs` makes it. Without ``attn_implementation`` the batch's mask
    is bool and a dtype would be ignored, so it is refused."""
    torch = pytest.importorskip("torch")
    from packtool.reader.hf import model_inputs
    from packtool.reader.torch import PackedIterableDataset

    data = PackedIterableDataset(demo["embed"], batch_size=2, attn_implementation="eager", dtype=torch.bfloat16)
    mask = next(iter(data))["attention_mask"]
    stream = iter(PackedDataset(demo["embed"]))
    rows = [next(stream), next(stream)]
    expected = model_inputs(rows, attn_implementation="eager", dtype=torch.bfloat16)["attention_mask"]
    assert mask.dtype == torch.bfloat16 and torch.equal(mask, expected)
    assert set(mask.unique().tolist()) == {0.0, torch.finfo(torch.bfloat16).min}
    with pytest.raises(ConfigError, match=r"dtype=torch.bfloat16 is the float dtype of an eager mask: pass it with "
                                          r"attn_implementation='eager'"):
        PackedIterableDataset(demo["embed"], batch_size=2, dtype=torch.bfloat16)
