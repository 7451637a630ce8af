"""ms-swift standard format: ``{"messages": [{"role", "content"}], "images": [...], "videos": [...]}``.

``messages`` holds ``system`` / ``user`` / ``assistant`` turns; ``<image>`` and
``<video>`` tags in the content mark where media go. Media entries are paths
(relative to ``--media-root``), data URIs (``data:image/png;base64,...``), or
``{"bytes", "path"}`` structs. A record with media and no tag at all gets its media at
the start of the first user turn; a record with some tags must tag every item.

    {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "<image>What is in the picture?"},
                  {"role": "assistant", "content": "A red circle."}],
     "images": ["images/circle.png"]}

Content may also be a list of typed parts (``{"type": "text", "text"}``,
``{"type": "image"}``, ``{"type": "video"}``), the OpenAI / transformers chat style;
each image or video part stands for the next item of ``images`` / ``videos``, unless it
names its own media as Qwen-VL, transformers and OpenAI write it (``{"type": "image",
"image" | "url" | "path" | "base64": ...}``, ``{"type": "image_url", "image_url": {"url"}}``).
Media stand in the order of their tags: a part that names its own image sits where its tag is,
the listed items fill the other tags in turn.

A top-level ``system`` string is the system prompt when the conversation opens with no system turn
of its own (ms-swift's ``system`` key; LLaMA-Factory's system column, whose role/content records
read as these).

Tool use: ms-swift's ``tool_call`` / ``tool_response`` roles and OpenAI's assistant
``tool_calls`` with ``role: "tool"`` results, the function schemas in ``tools`` (a list
or a JSON string of one); an assistant's ``reasoning_content`` is its reasoning (see
:mod:`.tools`). ``objects``, ``rejected_response`` and ``label`` are ignored.
"""

from __future__ import annotations

from ..errors import SampleError, quoted
from ..records import Sample
from .common import (
    build_sample,
    check_text,
    media_ref,
    media_refs,
    read_turns,
    sample_id_of,
    system_of,
)
from .llava import ROLE_MAP
from .tools import parse_tools

__all__ = ["parse"]


def _part_media(part: dict, kind: str):
    """The media entry a typed part names itself, or ``None`` when it stands for the next listed item.

    Qwen-VL and transformers' chat templates name it under the kind (``"image"``), ``"url"``,
    ``"path"`` or ``"base64"``; OpenAI and qwen-vl-utils under ``"image_url"``, a string or
    ``{"url", "detail"}``. A key holding null (a Parquet struct's other fields) names nothing.

    Example:
        >>> _part_media({"type": "image_url", "image_url": {"url": "a.jpg", "detail": "low"}}, "image")
        'a.jpg'
    """
    for key in (kind, f"{kind}_url", "url", "path"):
        value = part.get(key)
        if isinstance(value, dict) and key == f"{kind}_url":
            value = value.get("url")
        if value is not None:
            return value
    data = part.get("base64")
    return None if data is None else {"bytes": data}


def _content_text(content, i: int, take) -> str:
    """Content as text with tags; typed-part lists become ``<image>``/``<video>`` tags.

    ``take(kind, inline, n)`` is told of every tag in order: ``n`` tags of ``kind`` that stand for
    the next listed items, or one whose part names its own media ``inline``.
    """
    if isinstance(content, str):
        text = check_text(content, f"message {i} 'content'")
        _take_tags(text, take)
        return text
    if not isinstance(content, list):
        raise SampleError("bad_record", f"message {i} 'content' must be a string or a list of parts")
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text = check_text(part.get("text"), f"message {i} text part")
            _take_tags(text, take)
            out.append(text)
        elif kind in ("image", "video", "image_url", "video_url"):
            kind = kind.removesuffix("_url")
            take(kind, _part_media(part, kind), 1)
            out.append(f"<{kind}>")
        else:
            raise SampleError("bad_record", f"message {i} has a content part of type {quoted(kind)}")
    return "".join(out)


def _take_tags(text: str, take) -> None:
    if "<" in text:
        for kind in ("image", "video"):
            if n := text.count(f"<{kind}>"):
                take(kind, None, n)


def parse(record: dict, source: str, row: int) -> Sample:
    msgs = record.get("messages")
    if not isinstance(msgs, list):
        raise SampleError("bad_record", "record has no 'messages' list")
    if not msgs:
        raise SampleError("empty_conversation", "'messages' is empty")
    listed = dict(zip(("image", "video"), media_refs(record, ("images", "image"), ("videos", "video")), strict=True))
    # media in the order of their tags: a part that names its own media takes its place among the
    # listed items, which fill the other tags in turn (their leftovers follow, for the count check)
    ordered: dict[str, list] = {"image": [], "video": []}
    used = {"image": 0, "video": 0}

    def take(kind: str, inline, n: int) -> None:
        if inline is not None:
            ordered[kind].append(media_ref(kind, inline))
        else:
            ordered[kind] += listed[kind][used[kind]:used[kind] + n]
            used[kind] += n

    def text_of(msg: dict, i: int) -> str:
        return _content_text(msg.get("content"), i, take)

    turns = read_turns(msgs, "role", "content", "messages", ROLE_MAP, text_of)
    images, videos = (ordered[k] + listed[k][used[k]:] for k in ("image", "video"))
    return build_sample(turns, images, videos, sample_id_of(record, source, row), source, row,
                        system=system_of(record), tools=parse_tools(record.get("tools")))
