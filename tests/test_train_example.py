"""``examples/train_hf.py`` runs: trains a tiny Qwen2.5-VL on the demo packs, saves, resumes, and the
resumed run sees the identical next batch and computes the identical loss on it."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("torchvision")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_hf.py"


def test_train_save_resume_continues_identically(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("train_hf", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--out", str(tmp_path), "--steps", "3"]) == 0
    out = capsys.readouterr().out
    losses = [float(x) for x in re.findall(r"^step \d+  loss (\S+)", out, re.M)]
    assert len(losses) == 3 and losses[-1] < losses[0], out  # it trains
    m = re.search(r"next batch (\w+), loss (\S+) \(uninterrupted run (\S+)\)", out)
    assert m and m.group(1) == "identical" and m.group(2) == m.group(3), out
    # the step after the checkpoint crosses into the next epoch (7 packs, 2 per step)
    assert "resumed at epoch 0 consumed 6" in out, out
