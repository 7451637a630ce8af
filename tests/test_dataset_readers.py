"""Output directories are Parquet datasets: the data tools people already use open a tokenized
and a packed directory by its path and get exactly the shards' rows, nothing else.

The manifest, the rejected rows and the run state live in the hidden ``.packtool/`` folder,
which pyarrow (and so pandas), duckdb and Hugging Face ``datasets`` skip. polars reads every
non-empty file under a directory, hidden or not, so it is given the shards' glob.
These readers are test-only dependencies (the ``test`` extra, installed by ``make test``).
"""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packtool.schema import PACKED, TOKENIZED

KEY = {"tokenized": "sample_id", "packed": "pack_index"}


def _expected(d) -> tuple[int, list]:
    """Rows and key column of the shards the manifest lists, read one by one."""
    manifest = json.loads((d / ".packtool" / "manifest.json").read_text())
    kind = manifest["kind"]
    keys: list = []
    for s in manifest["shards"]:
        keys += pq.read_table(d / s["file"], columns=[KEY[kind]])[KEY[kind]].to_pylist()
    return kind, keys


@pytest.fixture(params=["tokenized", "packed"])
def out_dir(request, demo_dirs):
    d = demo_dirs[request.param]
    # what a finished run leaves beside the shards must not disturb any reader
    assert sorted(p.name for p in d.iterdir() if not p.name.endswith(".parquet")) == [".packtool"]
    return d


def test_pandas_reads_the_directory(out_dir):
    pd = pytest.importorskip("pandas")
    kind, keys = _expected(out_dir)
    df = pd.read_parquet(out_dir)
    assert df[KEY[kind]].tolist() == keys


def test_pyarrow_dataset_reads_the_directory(out_dir):
    import pyarrow.dataset as ds

    kind, keys = _expected(out_dir)
    table = ds.dataset(out_dir, format="parquet").to_table()
    assert table[KEY[kind]].to_pylist() == keys
    assert table.schema.remove_metadata().equals((TOKENIZED if kind == "tokenized" else PACKED).remove_metadata())


def test_duckdb_reads_the_directory(out_dir):
    duckdb = pytest.importorskip("duckdb")
    kind, keys = _expected(out_dir)
    got = duckdb.sql(f"SELECT {KEY[kind]} FROM read_parquet('{out_dir}') ORDER BY {KEY[kind]}").fetchall()
    assert [r[0] for r in got] == sorted(keys)


def test_polars_reads_the_shards(out_dir):
    pl = pytest.importorskip("polars")
    kind, keys = _expected(out_dir)
    df = pl.scan_parquet(f"{out_dir}/*.parquet").collect()
    assert df[KEY[kind]].to_list() == keys


def test_hf_datasets_loads_and_streams_the_directory(out_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    kind, keys = _expected(out_dir)
    loaded = datasets.load_dataset("parquet", data_dir=str(out_dir), split="train", cache_dir=str(tmp_path / "cache"))
    assert loaded[KEY[kind]] == keys
    streamed = datasets.load_dataset("parquet", data_dir=str(out_dir), split="train", streaming=True)
    assert [r[KEY[kind]] for r in streamed] == keys
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"


def _leaves(t: pa.DataType, prefix: str) -> dict[str, pa.DataType]:
    """Every field of a (nested) type by dotted name, with its type."""
    out = {prefix: t}
    if pa.types.is_list(t) and pa.types.is_struct(t.value_type):
        t = t.value_type
    if pa.types.is_struct(t):
        for i in range(t.num_fields):
            out.update(_leaves(t.field(i).type, f"{prefix}.{t.field(i).name}"))
    return out


def test_one_arrow_type_per_field_name_across_tokenized_and_packed():
    tok = {k: v for f in TOKENIZED for k, v in _leaves(f.type, f.name).items()}
    packed = {k: v for f in PACKED for k, v in _leaves(f.type, f.name).items()}
    differ = {k: (str(tok[k]), str(packed[k])) for k in tok.keys() & packed.keys()
              if k != "media" and tok[k] != packed[k]}  # media: each kind adds its own fields
    assert differ == {}


def test_directories_of_the_earlier_layout_are_still_read(demo_dirs, tmp_path):
    """``manifest.json`` and ``errors.jsonl`` beside the shards (packtool before the hidden layout)."""
    import shutil

    from packtool import compute_stats
    from packtool.reader import PackedDataset
    from packtool.shards import read_manifest

    old = {}
    for kind in ("tokenized", "packed"):
        old[kind] = tmp_path / kind
        shutil.copytree(demo_dirs[kind], old[kind])
        for name in ("manifest.json", "errors.jsonl"):
            (old[kind] / ".packtool" / name).rename(old[kind] / name)
    packed_manifest = json.loads((old["packed"] / "manifest.json").read_text())
    packed_manifest["source"]["path"] = str(old["tokenized"])
    (old["packed"] / "manifest.json").write_text(json.dumps(packed_manifest))
    assert read_manifest(old["tokenized"], "tokenized")["counts"]["samples"] == 30
    assert compute_stats(old["packed"])["reconcile"]["balanced"]
    assert len(list(PackedDataset(old["packed"], shuffle=False))) == 4


def test_tokenized_directories_of_schema_version_1_still_pack(demo_dirs, tmp_path):
    """Version 2 changed packed shards only, so a version-1 tokenized directory packs as it is."""
    import shutil

    from packtool import PackConfig, pack_dataset
    from packtool.shards import sha256_file

    old = tmp_path / "tok-v1"
    shutil.copytree(demo_dirs["tokenized"], old)
    manifest = json.loads((old / ".packtool" / "manifest.json").read_text())
    for s in manifest["shards"]:
        t = pq.read_table(old / s["file"])
        t = t.replace_schema_metadata({**t.schema.metadata, b"packtool.schema_version": b"1"})
        pq.write_table(t, old / s["file"])
        s.update(bytes=(old / s["file"]).stat().st_size, sha256=sha256_file(old / s["file"]))
    manifest["schema_version"] = 1
    (old / "manifest.json").write_text(json.dumps(manifest))  # and the earlier layout
    shutil.rmtree(old / ".packtool")
    result = pack_dataset(old, tmp_path / "packed", PackConfig(max_tokens=8192))
    assert result["counts"]["samples_packed"] == 30
