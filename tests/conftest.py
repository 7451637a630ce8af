"""Shared fixtures: the demo corpus tokenized and packed once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "examples" / "sample"


@pytest.fixture(scope="session")
def demo_dirs(tmp_path_factory) -> dict[str, Path]:
    """``{"tokenized": Path, "packed": Path, "sample": Path}`` built from examples/sample
    with the library (embedded media, 8192 tokens per pack)."""
    from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset

    base = tmp_path_factory.mktemp("demo")
    tok = base / "tokenized"
    packed = base / "packed"
    tokenize_dataset([SAMPLE / "data.jsonl"], tok, TokenizeConfig(media_root=str(SAMPLE)))
    pack_dataset(tok, packed, PackConfig(max_tokens=8192))
    return {"tokenized": tok, "packed": packed, "sample": SAMPLE}
