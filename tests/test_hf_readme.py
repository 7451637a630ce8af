"""The README's ``packtool.reader.hf`` snippets run as written, on a tiny Qwen2.5-VL and small demo packs.

The ``packtool.reader.hf`` blocks of "Training on packed shards" (marked ``<!-- docs: skip -->``
for ``make docs``, since they need a model in scope) are executed here with ``model`` (a random-init Qwen2.5-VL from ``examples/train_hf.py``),
``optimizer`` and ``torch`` in scope, and their results checked.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("torchvision")

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- docs: skip -->"


def hf_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Training on packed shards", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(re.escape(MARK) + r"\n```python\n(.*?)```", section, flags=re.S)
    return [b for b in blocks if "packtool.reader.hf" in b or "attn_implementation" in b]


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("train_hf", ROOT / "examples" / "train_hf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    packed = mod.build_packs(tmp_path_factory.mktemp("hf-readme"))
    return mod, packed


def _run(code: str, packed: Path, model) -> dict:
    assert '"build/demo/packed"' in code
    scope = {"__name__": "__readme__", "torch": torch, "model": model,
             "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3)}
    exec(compile(code.replace('"build/demo/packed"', repr(str(packed))), "README.md", "exec"), scope)
    return scope


def test_readme_has_the_hf_blocks():
    blocks = hf_blocks()
    assert len(blocks) == 2 and "model_inputs(" in blocks[0] and "PackedIterableDataset(" in blocks[1]


def test_one_call_block_runs(example):
    mod, packed = example
    model = mod.tiny_model(packed)
    scope = _run(hf_blocks()[0], packed, model)
    assert scope["batch"]["position_ids"].shape[0] == 4  # text row + 3-D mRoPE
    assert torch.isfinite(scope["loss"]) and model.lm_head.weight.grad is not None


def test_accumulation_block_runs_and_gives_a_resumable_state(example):
    mod, packed = example
    model = mod.tiny_model(packed)
    scope = _run(hf_blocks()[1], packed, model)
    state = scope["state"]
    assert (state["epoch"], state["consumed"]) == (0, 2)
    assert int(scope["micro"][0]["num_items_in_batch"]) == scope["total"]
