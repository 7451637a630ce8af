"""The internal sample model every input format maps to (DESIGN.md §3.1).

A :class:`Sample` is one media set plus one or more branches. Each branch is an
ordinary conversation; several branches form a *message tree*: they share the
media and their common prefix, and never see each other.

    Sample(media=(img,), branches=(
        (Message("user", (Part.media("image", 0), Part.of_text("What colour?"))),
         Message("assistant", (Part.of_text("Red."),))),
        (Message("user", (Part.media("image", 0), Part.of_text("How many?"))),
         Message("assistant", (Part.of_text("Two."),))),
    ))
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["MediaRef", "Part", "Message", "Sample", "ROLES"]

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True, slots=True)
class MediaRef:
    """One image or video as the input named it.

    Attributes:
        kind: ``"image"`` or ``"video"``.
        path: the path as written in the input (relative to ``--media-root``), or None.
        data: inline bytes (data URIs, Parquet image structs), or None.
    """

    kind: str
    path: str | None = None
    data: bytes | None = None


@dataclass(frozen=True, slots=True)
class Part:
    """A piece of a message: text, or a placeholder for media item ``index`` of the sample."""

    kind: str  # "text" | "image" | "video"
    text: str = ""
    index: int = -1

    @staticmethod
    def of_text(text: str) -> Part:
        return Part("text", text)

    @staticmethod
    def media(kind: str, index: int) -> Part:
        return Part(kind, "", index)


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    parts: tuple[Part, ...]


@dataclass(frozen=True, slots=True)
class Sample:
    """One training sample: shared media and one or more conversation branches.

    Attributes:
        sample_id: stable id (from the input's ``id`` field, else ``file:row``).
        source: the input file it came from.
        source_row: line (JSONL), index (JSON array) or row (Parquet), 0-based.
        media: the media set, in the order placeholders refer to them.
        branches: each branch is a tuple of messages.
    """

    sample_id: str
    source: str
    source_row: int
    media: tuple[MediaRef, ...]
    branches: tuple[tuple[Message, ...], ...]
    meta: dict = field(default_factory=dict, compare=False)
