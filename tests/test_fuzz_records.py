"""Tokenize's contract under fuzzed records (see ``fuzz_records.py``): a bad row never stops the
run, every row ends in one place with a known reason, and the output validates.

Seeded and small, to run with the suite; ``PACKTOOL_FUZZ_SEED`` / ``PACKTOOL_FUZZ_RECORDS``
replay another seed or a longer run, and ``python tests/fuzz_records.py N SEED...`` runs a
campaign over every family and container.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fuzz_records import FAMILIES, TOOL_SPECIALS, check_run, media_root, mutants, write_jsonl

SEED = int(os.environ.get("PACKTOOL_FUZZ_SEED", "20261202"))
N_RECORDS = int(os.environ.get("PACKTOOL_FUZZ_RECORDS", "240"))


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    from hf_harness import FAMILY_SPECIALS, byte_tokenizer

    base = tmp_path_factory.mktemp("fuzz")
    records = mutants(SEED, N_RECORDS)
    return {"base": base, "media": media_root(base / "media"), "records": records,
            "jsonl": write_jsonl(base / "fuzz.jsonl", records),
            "vocab": byte_tokenizer(base / "tok", sorted({*FAMILY_SPECIALS, *TOOL_SPECIALS}))}


def _replay(family: str) -> str:
    return (f"fuzz seed {SEED} ({N_RECORDS} records, --model {family}); replay with PACKTOOL_FUZZ_SEED={SEED} "
            f"PACKTOOL_FUZZ_RECORDS={N_RECORDS}")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fuzzed_jsonl_records_keep_the_contract(setup, tmp_path, family):
    try:
        m = check_run([setup["jsonl"]], tmp_path / "tok", setup["media"], family, setup["vocab"])
    except Exception as exc:
        raise AssertionError(_replay(family)) from exc
    c = m["counts"]
    # the mutants reach every stage: some records tokenize, and rows are rejected for many reasons
    assert c["samples"] >= N_RECORDS // 10, _replay(family)
    assert len(c["rejected_by_reason"]) >= 8, (_replay(family), c["rejected_by_reason"])


def test_fuzzed_records_as_a_json_array_merged_by_media(setup, tmp_path):
    src = tmp_path / "fuzz.json"
    src.write_text(json.dumps(setup["records"]), encoding="utf-8")
    try:
        m = check_run([src], tmp_path / "tok", setup["media"], "qwen3-vl", None, group_by_media=True,
                      max_branches=2, max_tokens=96)
    except Exception as exc:
        raise AssertionError(_replay("qwen3-vl")) from exc
    assert m["counts"]["merged_records"] > 0 and m["counts"]["samples"] > 0


def test_fuzzed_records_as_parquet_files(setup, tmp_path):
    """The mutants Arrow can type, one Parquet file each (so each keeps its own column types:
    strings where structs were, ints, nested nulls), read as one input directory."""
    data = tmp_path / "data"
    data.mkdir()
    n = 0
    for i, rec in enumerate(setup["records"]):
        if not isinstance(rec, dict) or not rec:
            continue
        try:
            pq.write_table(pa.Table.from_pylist([rec]), data / f"part-{i:05d}.parquet")
        except (pa.ArrowException, TypeError, ValueError, OverflowError, NotImplementedError):
            continue  # mixed types in one list, an empty object: no Parquet column holds it
        n += 1
    assert n >= N_RECORDS // 3
    try:
        m = check_run([data], tmp_path / "tok", setup["media"], "qwen2.5-vl", None)
    except Exception as exc:
        raise AssertionError(_replay("qwen2.5-vl") + " (Parquet)") from exc
    assert m["counts"]["rows_in"] == n and m["counts"]["samples"] > 0


def test_fuzz_driver_mutates_every_seed_format():
    """The driver is deterministic, and its mutants cover each input shape and the odd values."""
    a, b = mutants(5, 400), mutants(5, 400)
    assert json.dumps(a) == json.dumps(b)
    text = json.dumps(a)
    for needle in ("conversations", "messages", "message_list", "texts", "tool_calls", "reasoning_content", "NaN", "\\ud800",
                   "Infinity", "http://", "../", "file://", "<video>"):
        assert needle in text, needle
    assert any(not isinstance(r, dict) for r in a)


def test_media_root_has_real_media(setup):
    from PIL import Image

    root: Path = setup["media"]
    with Image.open(root / "a.png") as im:
        assert im.size == (64, 48)
    assert (root / "clip.mp4").stat().st_size > 0 and (root / "sub").is_dir()
