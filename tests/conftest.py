"""Shared fixtures: the demo corpus tokenized and packed once per test session."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "examples" / "sample"


def pytest_configure(config):
    """A test run started as a background job of a non-interactive shell (``cmd &`` in a
    script) inherits SIGINT ignored, and so would every command its tests start: the tests of
    Ctrl-C (SIGINT sent to a command) would see it ignored. The run takes the default back."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _storage_options_stay_per_test():
    """``--storage-option`` (``storage.set_options``) writes its options into the environment
    for workers; a test that sets them in this process must not hand its endpoint to the next
    one (a later bucket test would dial it and fail far from the cause)."""
    from packtool import storage

    before = os.environ.get(storage.OPTIONS_ENV)
    yield
    if os.environ.get(storage.OPTIONS_ENV) != before:
        if before is None:
            os.environ.pop(storage.OPTIONS_ENV, None)
        else:
            os.environ[storage.OPTIONS_ENV] = before
        storage._FILESYSTEMS.clear()


@pytest.fixture(scope="session")
def demo_dirs(tmp_path_factory) -> dict[str, Path]:
    """``{"tokenized": Path, "packed": Path, "packed-full": Path, "sample": Path}`` built from
    examples/sample with the library (embedded media, 8192 tokens per pack; ``packed-full``
    with ``layout="full"``)."""
    from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset

    base = tmp_path_factory.mktemp("demo")
    tok = base / "tokenized"
    packed = base / "packed"
    tokenize_dataset([SAMPLE / "data.jsonl"], tok, TokenizeConfig(media_root=str(SAMPLE)))
    pack_dataset(tok, packed, PackConfig(max_tokens=8192))
    full = base / "packed-full"
    pack_dataset(tok, full, PackConfig(max_tokens=8192, layout="full"))
    return {"tokenized": tok, "packed": packed, "packed-full": full, "sample": SAMPLE}


def pytest_collection_modifyitems(config, items):
    """With ``NUMBA_DISABLE_JIT=1`` (``make test-nojit``) the knapsack runs as plain Python, one
    32-cell step at a time; tests marked ``jit`` pack corpora of several tasks and would take
    minutes there, so they run only with the compiled kernel (``make test``). The kernel and
    packer tests themselves run in both modes."""
    if os.environ.get("NUMBA_DISABLE_JIT", "0") not in ("", "0"):
        skip = pytest.mark.skip(reason="needs the compiled kernel (NUMBA_DISABLE_JIT=1)")
        for item in items:
            if "jit" in item.keywords:
                item.add_marker(skip)
