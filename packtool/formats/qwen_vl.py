"""Qwen-VL finetune format (Qwen2-VL / Qwen2.5-VL / Qwen3-VL finetuning scripts).

Same keys as LLaVA — ``image`` (a path or a list), ``video``, ``conversations`` with
``from``/``value`` — but every image and video needs its own ``<image>`` / ``<video>``
tag: the tag count must equal the media count, or the row is rejected with
``placeholder_mismatch`` (no implicit placement).

    {"image": ["a.jpg", "b.jpg"],
     "conversations": [{"from": "human", "value": "<image>\\n<image>\\nSame place?"},
                       {"from": "gpt", "value": "Yes."}]}

``--format auto`` reads such records as LLaVA (which also accepts tag-less records);
pass ``--format qwen-vl`` to enforce the strict count.
"""

from __future__ import annotations

from ..records import Sample
from . import llava

__all__ = ["parse"]


def parse(record: dict, source: str, row: int) -> Sample:
    return llava.parse(record, source, row, strict=True)
