"""Same inputs and config give byte-identical shards, whatever the number of workers or ranks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.corpus import make_corpus  # noqa: E402
from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset  # noqa: E402
from packtool.pipeline import merge_output  # noqa: E402

# packs a corpus of several tasks: minutes with the pure-Python kernel (NUMBA_DISABLE_JIT=1)
pytestmark = pytest.mark.jit


def shard_hashes(d: Path) -> dict[str, str]:
    manifest = json.loads((d / ".packtool" / "manifest.json").read_text())
    return {s["file"]: s["sha256"] for s in manifest["shards"]}


def manifest_without_paths(d: Path) -> dict:
    m = json.loads((d / ".packtool" / "manifest.json").read_text())
    m.get("source", {}).pop("path", None)  # the tokenized directory's own location
    return m


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    make_corpus(root, 900, seed=3)
    return root


def run_both(corpus: Path, out: Path, **kw) -> tuple[dict, dict]:
    tok = tokenize_dataset([corpus / "data.jsonl"], out / "tok", TokenizeConfig(media_root=str(corpus), rows_per_shard=300),
                           **kw)
    packed = pack_dataset(out / "tok", out / "packed", PackConfig(max_tokens=4096, media="reference", packs_per_shard=40),
                          **kw)
    return tok, packed


@pytest.fixture(scope="module")
def serial(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("serial")
    run_both(corpus, out, workers=1)
    return out


def test_pool_output_is_byte_identical_to_in_process(corpus, serial, tmp_path):
    run_both(corpus, tmp_path, workers=2)
    for stage in ("tok", "packed"):
        a, b = shard_hashes(serial / stage), shard_hashes(tmp_path / stage)
        assert len(a) >= 3, "the corpus must be cut into several tasks for this test to mean anything"
        assert a == b
        assert manifest_without_paths(serial / stage) == manifest_without_paths(tmp_path / stage)
        assert (serial / stage / ".packtool" / "errors.jsonl").read_bytes() == (tmp_path / stage / ".packtool" / "errors.jsonl").read_bytes()


def test_ranks_then_merge_give_the_same_bytes(corpus, serial, tmp_path):
    cfg = TokenizeConfig(media_root=str(corpus), rows_per_shard=300)
    parts = [tokenize_dataset([corpus / "data.jsonl"], tmp_path / "tok", cfg, rank=r, world_size=2, workers=1)
             for r in (1, 0)]
    assert parts[0]["partial"] and parts[0]["tasks_missing"] == 2
    assert "partial" not in parts[1]  # the last rank to finish writes the manifest
    assert (tmp_path / "tok" / ".packtool" / "manifest.json").read_bytes() == (serial / "tok" / ".packtool" / "manifest.json").read_bytes()
    pcfg = PackConfig(max_tokens=4096, media="reference", packs_per_shard=40)
    for r in range(3):
        pack_dataset(tmp_path / "tok", tmp_path / "packed", pcfg, rank=r, world_size=3, workers=1)
    (tmp_path / "packed" / ".packtool" / "manifest.json").unlink()
    merged = merge_output(tmp_path / "packed")
    assert shard_hashes(tmp_path / "packed") == shard_hashes(serial / "packed")
    assert merged["counts"] == json.loads((serial / "packed" / ".packtool" / "manifest.json").read_text())["counts"]


def test_shards_carry_no_run_specific_metadata(serial):
    import pyarrow.parquet as pq

    for stage in ("tok", "packed"):
        for f in shard_hashes(serial / stage):
            meta = pq.ParquetFile(serial / stage / f).metadata
            kv = {k.decode(): v.decode() for k, v in (meta.metadata or {}).items()}
            # only the schema and its fixed kind/version: no timestamps, hosts or paths
            assert set(kv) == {"ARROW:schema", "packtool.kind", "packtool.schema_version"}, kv.keys()
            assert kv["packtool.kind"] == {"tok": "tokenized", "packed": "packed"}[stage]
            assert meta.created_by.startswith("parquet-cpp-arrow")


def test_pack_index_is_unique_and_rises_in_manifest_order(serial):
    import pyarrow.parquet as pq

    from packtool.pipeline import PACK_INDEX_STRIDE

    d = serial / "packed"
    index = [i for f in shard_hashes(d) for i in pq.read_table(d / f, columns=["pack_index"])["pack_index"].to_pylist()]
    assert index == sorted(set(index))
    tasks = sorted({i // PACK_INDEX_STRIDE for i in index})
    assert tasks == [0, 1, 2]
    for t in tasks:  # within a task: 0, 1, 2, ...
        local = [i % PACK_INDEX_STRIDE for i in index if i // PACK_INDEX_STRIDE == t]
        assert local == list(range(len(local)))
