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

Tool use: ms-swift's ``tool_call`` / ``tool_response`` roles and OpenAI's assistant
``tool_calls`` with ``role: "tool"`` results, the function schemas in ``tools`` (a list
or a JSON string of one); an assistant's ``reasoning_content`` is its reasoning (see
:mod:`.tools`). ``objects``, ``rejected_response`` and ``label`` are ignored.
"""

from __future__ import annotations

from ..errors import SampleError
from ..records import Sample
from .common import build_sample, check_text, media_ref, media_refs, read_turns, sample_id_of
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


def _content_text(content, i: int, images: list, videos: list) -> str:
    """Content as text with tags; typed-part lists become ``<image>``/``<video>`` tags."""
    if isinstance(content, str):
        return check_text(content, f"message {i} 'content'")
    if not isinstance(content, list):
        raise SampleError("bad_record", f"message {i} 'content' must be a string or a list of parts")
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            out.append(check_text(part.get("text"), f"message {i} text part"))
        elif kind in ("image", "video", "image_url", "video_url"):
            kind = kind.removesuffix("_url")
            inline = _part_media(part, kind)
            if inline is not None:  # the part names its own media
                (images if kind == "image" else videos).append(media_ref(kind, inline))
            out.append(f"<{kind}>")
        else:
            raise SampleError("bad_record", f"message {i} has a content part of type {kind!r}")
    return "".join(out)


def parse(record: dict, source: str, row: int) -> Sample:
    msgs = record.get("messages")
    if not isinstance(msgs, list):
        raise SampleError("bad_record", "record has no 'messages' list")
    if not msgs:
        raise SampleError("empty_conversation", "'messages' is empty")
    images, videos = media_refs(record, ("images", "image"), ("videos", "video"))

    def text_of(msg: dict, i: int) -> str:
        return _content_text(msg.get("content"), i, images, videos)

    turns = read_turns(msgs, "role", "content", "messages", ROLE_MAP, text_of)
    return build_sample(turns, images, videos, sample_id_of(record, source, row), source, row,
                        tools=parse_tools(record.get("tools")))
