"""LLaVA JSON/JSONL: ``{"id", "image": str | [str], "video", "conversations": [{"from", "value"}]}``.

``<image>`` / ``<video>`` tags mark where media go, in order. A record with media but
no tags gets its media at the start of the first user turn, as LLaVA does.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import SampleError
from ..records import MediaRef, Message, Part, Sample

__all__ = ["parse", "ROLE_MAP", "split_placeholders"]

ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
_TAG = re.compile(r"<(image|video)>")


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def split_placeholders(text: str, counters: dict[str, int], offsets: dict[str, int]) -> list[Part]:
    """Split ``text`` at ``<image>``/``<video>`` tags into parts; tags become media parts.

    ``counters`` counts tags per kind seen so far; ``offsets`` maps kind to its first
    media index (images first, then videos). Whitespace hugging a tag (LLaVA writes
    ``"<image>\\nWhat..."``) is dropped.
    """
    parts: list[Part] = []
    pos = 0
    for m in _TAG.finditer(text):
        before = text[pos : m.start()]
        if before.strip():
            parts.append(Part.of_text(before.rstrip("\n") if m.start() else before))
        kind = m.group(1)
        parts.append(Part.media(kind, offsets[kind] + counters[kind]))
        counters[kind] += 1
        pos = m.end()
    rest = text[pos:]
    if pos:
        rest = rest.lstrip("\n")
    if rest:
        parts.append(Part.of_text(rest))
    return parts


def parse(record: dict, source: str, row: int) -> Sample:
    convs = record.get("conversations")
    if not isinstance(convs, list):
        raise SampleError("bad_record", "record has no 'conversations' list")
    if not convs:
        raise SampleError("empty_conversation", "'conversations' is empty")
    images = _as_list(record.get("image", record.get("images")))
    videos = _as_list(record.get("video", record.get("videos")))
    for m in images + videos:
        if not isinstance(m, str) or not m:
            raise SampleError("bad_record", f"media entries must be non-empty strings, got {m!r}")
    media = tuple([MediaRef("image", p) for p in images] + [MediaRef("video", p) for p in videos])
    offsets = {"image": 0, "video": len(images)}
    counters = {"image": 0, "video": 0}
    messages: list[Message] = []
    for i, turn in enumerate(convs):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise SampleError("bad_record", f"turn {i} needs a string 'value'")
        role = ROLE_MAP.get(str(turn.get("from", "")).lower())
        if role is None:
            raise SampleError("unknown_role", f"turn {i} has role {turn.get('from')!r}")
        messages.append(Message(role, tuple(split_placeholders(turn["value"], counters, offsets))))
    n_tags = counters["image"] + counters["video"]
    if n_tags == 0 and media:
        first_user = next((i for i, m in enumerate(messages) if m.role == "user"), None)
        if first_user is None:
            raise SampleError("placeholder_mismatch", "record has media but no user turn to put them in")
        lead = tuple(Part.media(m.kind, i) for i, m in enumerate(media))
        msg = messages[first_user]
        messages[first_user] = Message(msg.role, lead + msg.parts)
    elif counters["image"] != len(images) or counters["video"] != len(videos):
        raise SampleError(
            "placeholder_mismatch",
            f"{counters['image']} <image> and {counters['video']} <video> tags for "
            f"{len(images)} images and {len(videos)} videos",
        )
    sid = record.get("id")
    sample_id = str(sid) if sid is not None else f"{Path(source).name}:{row}"
    return Sample(sample_id, source, row, media, (tuple(messages),))
