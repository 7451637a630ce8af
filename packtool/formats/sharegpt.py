"""ShareGPT as LLaMA-Factory reads it (``"formatting": "sharegpt"``).

The conversation is under ``conversations`` (the default column) or ``messages``;
each turn is ``{"from": "human" | "gpt" | "system", "value": ...}`` (the default
tags) or ``{"role": "user" | "assistant" | "system", "content": ...}`` (the tags
LLaMA-Factory's multimodal demo uses). A top-level ``system`` string is the system
prompt. ``images`` and ``videos`` list media; every one needs an ``<image>`` /
``<video>`` tag, as LLaMA-Factory checks, else ``placeholder_mismatch``.

    {"messages": [{"role": "user", "content": "<image>Who are they?"},
                  {"role": "assistant", "content": "Two football players."}],
     "images": ["mllm_demo_data/1.jpg"]}

Tool use as LLaMA-Factory stores it: ``function_call`` turns (a JSON call, or a list of
them) and ``observation`` turns (the results), with the function schemas in a ``tools``
column (a JSON string of the list); see :mod:`.tools` for every accepted shape.
``reasoning_content`` on an assistant turn is its reasoning.

    {"conversations": [{"from": "human", "value": "Weather in Paris?"},
                       {"from": "function_call", "value": "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}"},
                       {"from": "observation", "value": "{\"temp_c\": 18}"},
                       {"from": "gpt", "value": "18 °C."}],
     "tools": "[{\"name\": \"get_weather\", \"parameters\": {\"type\": \"object\"}}]"}
"""

from __future__ import annotations

from ..errors import SampleError
from ..records import Sample
from .common import Turn, build_sample, media_refs, sample_id_of, system_of
from .llava import parse_turns
from .tools import parse_tools

__all__ = ["parse", "conversation_turns"]


def conversation_turns(record: dict) -> tuple[list[Turn | tuple[str, str]], str]:
    """``(turns, field)`` from ``conversations`` or ``messages``, either tag style."""
    field = "conversations" if record.get("conversations") is not None else "messages"
    convs = record.get(field)
    first = convs[0] if isinstance(convs, list) and convs and isinstance(convs[0], dict) else {}
    if first.get("from") is not None or first.get("value") is not None:
        return parse_turns(convs, "from", "value", field), field
    return parse_turns(convs, "role", "content", field), field


def parse(record: dict, source: str, row: int) -> Sample:
    if record.get("conversations") is None and record.get("messages") is None:
        raise SampleError("bad_record", "record has neither 'conversations' nor 'messages'")
    turns, _ = conversation_turns(record)
    system = system_of(record)
    images, videos = media_refs(record, ("images", "image"), ("videos", "video"))
    return build_sample(turns, images, videos, sample_id_of(record, source, row), source, row,
                        strict=True, system=system, tools=parse_tools(record.get("tools")))
