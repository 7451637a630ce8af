"""Molmo / PixMo ``message_list``: several conversations about one media set → one message tree.

The Molmo training data loaders return, per image, ``{"image", "message_list": [...]}``
where each entry is one independent annotation of that image:

* ``{"question": q, "answer": a, "style": s}`` (PixMo-AskModelAnything, PixMo-Docs);
* ``{"messages": [q1, a1, q2, a2, ...], "style": s}`` (PixMo-CapQA: alternating user /
  assistant strings; ``{"role", "content"}`` objects are accepted too);
* ``{"text": t, "style": s}`` (PixMo-Cap captions; an optional ``"prompt"`` becomes the
  user text, else the user turn holds only the media).

Every entry becomes one *branch* of a single :class:`~packtool.records.Sample`; the
media go at the start of each branch's first user turn (where Molmo puts them), so
they land in the shared prefix and the vision encoder runs once for all branches.
``image`` / ``images`` and ``video`` / ``videos`` take paths, data URIs or
``{"bytes", "path"}`` structs.

    {"id": "pixmo-17", "image": "images/17.jpg",
     "message_list": [{"question": "What colour is the car?", "answer": "Red.", "style": "user_qa"},
                      {"question": "How many wheels?", "answer": "Four.", "style": "user_qa"}]}
"""

from __future__ import annotations

from ..errors import SampleError, quoted
from ..records import Message, Part, Sample
from .common import check_text, media_refs, sample_id_of, split_placeholders
from .llava import ROLE_MAP

__all__ = ["parse"]


def _entry_turns(entry, i: int) -> list[tuple[str, str]]:
    if not isinstance(entry, dict):
        raise SampleError("bad_record", f"message_list[{i}] is a {type(entry).__name__}, not an object")
    # a key holding null is absent: a Parquet list<struct> has every entry style's fields in each entry
    if entry.get("messages") is not None:
        msgs = entry["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise SampleError("empty_conversation", f"message_list[{i}] has no messages")
        turns = []
        for j, m in enumerate(msgs):
            if isinstance(m, dict):
                raw = m.get("role")
                if raw is not None and not isinstance(raw, str):
                    raise SampleError("bad_record", f"message_list[{i}] message {j} 'role' must be a string, got "
                                                    f"{type(raw).__name__} {quoted(raw, 40)}")
                role = ROLE_MAP.get((raw or "").lower())
                if role is None:
                    raise SampleError("unknown_role", f"message_list[{i}] message {j} has role {quoted(m.get('role'))}")
                turns.append((role, check_text(m.get("content"), f"message_list[{i}] message {j}")))
            else:
                turns.append(("user" if j % 2 == 0 else "assistant", check_text(m, f"message_list[{i}] message {j}")))
        return turns
    if entry.get("question") is not None or entry.get("answer") is not None:
        return [("user", check_text(entry.get("question"), f"message_list[{i}] 'question'")),
                ("assistant", check_text(entry.get("answer"), f"message_list[{i}] 'answer'"))]
    if entry.get("text") is not None:
        prompt = entry.get("prompt")
        return [("user", "" if prompt is None else check_text(prompt, f"message_list[{i}] 'prompt'")),
                ("assistant", check_text(entry["text"], f"message_list[{i}] 'text'"))]
    raise SampleError("bad_record", f"message_list[{i}] needs 'question'/'answer', 'messages' or 'text'")


def parse(record: dict, source: str, row: int) -> Sample:
    entries = record.get("message_list")
    if not isinstance(entries, list):
        raise SampleError("bad_record", "record has no 'message_list' list")
    if not entries:
        raise SampleError("empty_conversation", "'message_list' is empty")
    images, videos = media_refs(record, ("image", "images"), ("video", "videos"))
    media = tuple(images + videos)
    offsets = {"image": 0, "video": len(images)}
    lead = tuple(Part.media(m.kind, k) for k, m in enumerate(media))
    branches = []
    for i, entry in enumerate(entries):
        counters = {"image": 0, "video": 0}
        messages = [Message(role, tuple(split_placeholders(text, counters, offsets))) for role, text in _entry_turns(entry, i)]
        if counters["image"] + counters["video"] == 0:
            first_user = next((k for k, m in enumerate(messages) if m.role == "user"), None)
            if first_user is None and media:
                raise SampleError("placeholder_mismatch", f"message_list[{i}] has no user turn to hold the media")
            if first_user is not None:
                messages[first_user] = Message("user", lead + messages[first_user].parts)
        elif counters["image"] != len(images) or counters["video"] != len(videos):
            raise SampleError("placeholder_mismatch", f"message_list[{i}]: {counters['image']} <image> and "
                              f"{counters['video']} <video> tags for {len(images)} images and {len(videos)} videos")
        branches.append(tuple(messages))
    return Sample(sample_id_of(record, source, row), source, row, media, tuple(branches))
