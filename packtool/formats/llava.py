"""LLaVA JSON/JSONL: ``{"id", "image": str | [str], "video", "conversations": [{"from", "value"}]}``.

``<image>`` / ``<video>`` tags mark where media go, in order. A record with media but
no tags gets its media at the start of the first user turn, as LLaVA does.

    {"id": "0", "image": "coco/1.jpg",
     "conversations": [{"from": "human", "value": "<image>\\nWhat is this?"},
                       {"from": "gpt", "value": "A cat."}]}
"""

from __future__ import annotations

from ..errors import SampleError
from ..records import Sample
from .common import build_sample, check_text, media_refs, sample_id_of, split_placeholders

__all__ = ["parse", "parse_turns", "ROLE_MAP", "split_placeholders"]

ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def parse_turns(convs, role_key: str = "from", text_key: str = "value", field: str = "conversations") -> list[tuple[str, str]]:
    """``[{"from": "human", "value": ...}, ...]`` → ``[("user", text), ...]``.

    Raises:
        SampleError: ``bad_record`` (not a list / no text), ``empty_conversation``,
            ``unknown_role``, ``bad_encoding``.
    """
    if not isinstance(convs, list):
        raise SampleError("bad_record", f"record has no {field!r} list")
    if not convs:
        raise SampleError("empty_conversation", f"{field!r} is empty")
    turns = []
    for i, turn in enumerate(convs):
        if not isinstance(turn, dict):
            raise SampleError("bad_record", f"turn {i} is a {type(turn).__name__}, not an object")
        raw_role = turn.get(role_key)
        role = ROLE_MAP.get(str(raw_role).lower()) if raw_role is not None else None
        if role is None:
            raise SampleError("unknown_role", f"turn {i} has role {raw_role!r}")
        turns.append((role, check_text(turn.get(text_key), f"turn {i} {text_key!r}")))
    return turns


def parse(record: dict, source: str, row: int, strict: bool = False) -> Sample:
    """A LLaVA record as a single-branch sample; ``strict`` demands one tag per media item."""
    turns = parse_turns(record.get("conversations"))
    images, videos = media_refs(record, ("image", "images"), ("video", "videos"))
    return build_sample(turns, images, videos, sample_id_of(record, source, row), source, row, strict=strict)
