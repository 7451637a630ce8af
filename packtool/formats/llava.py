"""LLaVA JSON/JSONL: ``{"id", "image": str | [str], "video", "conversations": [{"from", "value"}]}``.

``<image>`` / ``<video>`` tags mark where media go, in order. A record with media but
no tags gets its media at the start of the first user turn, as LLaVA does. A record with
videos and no image may tag its videos ``<image>``, as LLaVA-NeXT / LLaVA-OneVision training
code does (LLaVA-Video-178K is written so), one tag per video.

    {"id": "0", "image": "coco/1.jpg",
     "conversations": [{"from": "human", "value": "<image>\\nWhat is this?"},
                       {"from": "gpt", "value": "A cat."}]}
"""

from __future__ import annotations

from ..records import Sample
from .common import (
    Turn,
    build_sample,
    check_text,
    media_refs,
    read_turns,
    sample_id_of,
    split_placeholders,
    system_of,
)

__all__ = ["parse", "parse_turns", "ROLE_MAP", "split_placeholders"]

ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def parse_turns(convs, role_key: str = "from", text_key: str = "value", field: str = "conversations") -> list[Turn | tuple[str, str]]:
    """``[{"from": "human", "value": ...}, ...]`` → turns (``("user", text)`` ...), tool turns included.

    A ShareGPT record with ``function_call`` / ``observation`` turns and no other ShareGPT
    key reads as LLaVA under ``--format auto``; its tool turns read the same either way.

    Raises:
        SampleError: ``bad_record`` (not a list / no text), ``empty_conversation``,
            ``unknown_role``, ``bad_encoding``, ``bad_tool_call``, ``bad_tool_arguments``.
    """

    def text_of(turn: dict, i: int) -> str:
        text = turn.get(text_key)
        if type(text) is str and text.isascii():  # nothing to check (and no message to format)
            return text
        return check_text(text, f"turn {i} {text_key!r}")

    return read_turns(convs, role_key, text_key, field, ROLE_MAP, text_of)


def parse(record: dict, source: str, row: int, strict: bool = False) -> Sample:
    """A LLaVA record as a single-branch sample; ``strict`` demands one tag per media item."""
    turns = parse_turns(record.get("conversations"))
    images, videos = media_refs(record, ("image", "images"), ("video", "videos"))
    # a top-level system prompt (ShareGPT's, read as LLaVA under --format llava) is kept, not dropped
    system = system_of(record)
    return build_sample(turns, images, videos, sample_id_of(record, source, row), source, row, strict=strict,
                        system=system, image_tags_for_video=not strict)
