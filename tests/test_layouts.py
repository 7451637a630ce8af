"""The runs layout (packed schema v4, the default) and ``--layout full`` (v2) hold the same rows:
what ``packtool.reader`` yields from one equals what it yields from the other, for every model
family the tests use, and both directories validate."""

from __future__ import annotations

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from hf_harness import FAMILY_SETTINGS as FAMILIES
from hf_harness import FAMILY_SPECIALS as SPECIALS
from hf_harness import byte_tokenizer, standard_corpus

from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset
from packtool.reader import PackedDataset
from packtool.shards import read_manifest
from packtool.validate import validate_dir


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("layouts")
    (base / "corpus").mkdir()
    (base / "tok").mkdir()
    return {"base": base, "corpus": standard_corpus(base / "corpus"), "tok": byte_tokenizer(base / "tok", SPECIALS)}


def _rows(d) -> list[dict]:
    return list(PackedDataset(d, shuffle=False))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_runs_and_full_layouts_give_the_reader_the_same_rows(setup, family):
    base, corpus = setup["base"] / family, setup["corpus"]
    tok = base / "tok"
    tokenize_dataset(corpus["inputs"], tok, TokenizeConfig(media_root=str(corpus["root"]), model=family,
                                                           tokenizer=str(setup["tok"]), **FAMILIES[family]))
    assert read_manifest(tok)["schema_version"] == 6
    outs = {}
    for layout in ("runs", "full"):
        outs[layout] = base / layout
        pack_dataset(tok, outs[layout], PackConfig(max_tokens=1024, layout=layout))
        manifest = read_manifest(outs[layout])
        assert (manifest["schema_version"], manifest["layout"]) == ({"runs": 6, "full": 7}[layout], layout)
    # validate reads both layouts alike, and every family's spans (markers inside included) are whole
    reports = {layout: validate_dir(out, tokenizer=str(setup["tok"])) for layout, out in outs.items()}
    assert reports["runs"]["ok"] and reports["full"]["ok"], (reports["runs"]["problems"], reports["full"]["problems"])
    runs, full = _rows(outs["runs"]), _rows(outs["full"])
    assert len(runs) == len(full) >= 1
    for a, b in zip(runs, full, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], np.ndarray):
                assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), (family, a["pack_index"], key)
            else:
                assert a[key] == b[key], (family, a["pack_index"], key)
    # the runs form holds fewer token values: every vision span is stored once
    stored = sum(pc.sum(pc.binary_length(pq.read_table(f, columns=["compact_input_ids_i32le"])["compact_input_ids_i32le"])).as_py()
                 for f in sorted(outs["runs"].glob("part-*.parquet"))) // 4
    assert stored < sum(r["n_tokens"] for r in runs)


@pytest.mark.parametrize("mix", ["qwen-images", "molmo2"])
def test_expanded_tokenized_shards_pack_to_the_same_bytes(tmp_path, mix):
    """Tokenized directories written before the runs form (schema v2, every token stored), in
    the list form of the runs layout (schema v3) and with plain target blobs (schema v4) pack
    to the same shards as the same rows in today's form (v5), in both packed layouts."""
    from bench.corpus import write_tokenized

    hashes = {}
    for expanded in (False, True, "v3", "v4"):
        tok = tmp_path / f"tok-{expanded}"
        manifest = write_tokenized(tok, mix, 600, seed=1, rows_per_shard=250, expanded=expanded is True)
        assert manifest["schema_version"] == (2 if expanded is True else 6)
        if expanded in ("v3", "v4"):
            _as_older_version(tok, int(expanded[1]))
        for layout in ("runs", "full"):
            out = tmp_path / f"packed-{expanded}-{layout}"
            # in process: the bytes are the same on any number of workers (tests/test_determinism.py),
            # and eight pools' start-up would be most of this test's time
            pack_dataset(tok, out, PackConfig(media="reference", layout=layout, max_tokens=8192), workers=1)
            hashes[expanded, layout] = [s["sha256"] for s in read_manifest(out)["shards"]]
    assert hashes[True, "runs"] == hashes[False, "runs"] and hashes[True, "full"] == hashes[False, "full"]
    assert hashes["v3", "runs"] == hashes[False, "runs"] and hashes["v3", "full"] == hashes[False, "full"]
    assert hashes["v4", "runs"] == hashes[False, "runs"] and hashes["v4", "full"] == hashes[False, "full"]
    assert hashes[False, "runs"] != hashes[False, "full"]


def _as_older_version(tok, version: int) -> None:
    """Rewrite a tokenized directory as packtool wrote schema version 3 (``list<int32>`` run
    columns) or 4 (int32 blobs, targets as they are), manifest included."""
    import json

    from naive import list_form, plain_target_form

    from packtool.schema import TOKENIZED_V3, TOKENIZED_V4
    from packtool.shards import MANIFEST, sha256_file

    manifest = read_manifest(tok)
    form, schema = {3: (list_form, TOKENIZED_V3), 4: (plain_target_form, TOKENIZED_V4)}[version]
    for entry in manifest["shards"]:
        f = tok / entry["file"]
        table = form(pq.read_table(f))
        assert table.column_names == schema.names
        table = table.cast(schema)
        pq.write_table(table, f, row_group_size=100)
        entry.update(bytes=f.stat().st_size, sha256=sha256_file(f))
    manifest["schema_version"] = version
    (tok / MANIFEST).write_text(json.dumps(manifest))
