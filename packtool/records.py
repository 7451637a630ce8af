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

__all__ = ["MediaRef", "Part", "Message", "Sample", "ToolCall", "ROLES"]

ROLES = ("system", "user", "assistant", "tool")


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

    @staticmethod
    def of_path(kind: str, path: str) -> MediaRef:
        """``MediaRef(kind, path)``: a file named by path (the common entry), built fast."""
        m = _new(MediaRef)
        _ref_kind(m, kind)
        _ref_path(m, path)
        _ref_data(m, None)
        return m


@dataclass(frozen=True, slots=True)
class Part:
    """A piece of a message: text, or a placeholder for media item ``index`` of the sample."""

    kind: str  # "text" | "image" | "video"
    text: str = ""
    index: int = -1

    @staticmethod
    def of_text(text: str) -> Part:
        return _part("text", text, -1)

    @staticmethod
    def media(kind: str, index: int) -> Part:
        return _part(kind, "", index)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call made by the assistant.

    Attributes:
        name: the function's name.
        arguments: the decoded JSON object of arguments (inputs that store them as a JSON
            string are decoded by the reader, so every input shape renders alike).
        call_id: the call's id where the input gives one (OpenAI ``tool_calls[].id``); used
            only to check that a tool result answers a call, never rendered.
    """

    name: str
    arguments: dict
    call_id: str | None = None


@dataclass(frozen=True, slots=True)
class Message:
    """One turn.

    Attributes:
        role: ``system``, ``user``, ``assistant`` or ``tool`` (a tool result).
        parts: text and media placeholders.
        tool_calls: the assistant's function calls, after its text.
        reasoning: the assistant's reasoning given apart from its text (a
            ``reasoning_content`` field), or None; reasoning written inline as
            ``<think>…</think>`` stays in the text and the template splits it off.
        tool_call_id: for a tool result, the id of the call it answers, where given.
        loss: ``False`` for an assistant turn the record keeps as context only (ms-swift's
            per-message ``"loss": false``): rendered, with no loss on any of its tokens;
            ``None``, the default, is the role's rule (loss on assistant turns).
    """

    role: str
    parts: tuple[Part, ...]
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str | None = None
    tool_call_id: str | None = None
    loss: bool | None = None

    @staticmethod
    def plain(role: str, parts: tuple[Part, ...]) -> Message:
        """``Message(role, parts)``: a turn of text and media only (the common one), built fast."""
        m = _new(Message)
        _message_role(m, role)
        _message_parts(m, parts)
        _message_tool_calls(m, ())
        _message_reasoning(m, None)
        _message_tool_call_id(m, None)
        _message_loss(m, None)
        return m


@dataclass(frozen=True, slots=True)
class Sample:
    """One training sample: shared media and one or more conversation branches.

    Attributes:
        sample_id: stable id (from the input's ``id`` field, else ``file:row``).
        source: the input file it came from.
        source_row: line (JSONL), index (JSON array) or row (Parquet), 0-based.
        media: the media set, in the order placeholders refer to them.
        branches: each branch is a tuple of messages.
        tools: the function schemas offered to the model (JSON objects, in input order),
            shared by every branch; empty for none.
    """

    sample_id: str
    source: str
    source_row: int
    media: tuple[MediaRef, ...]
    branches: tuple[tuple[Message, ...], ...]
    meta: dict = field(default_factory=dict, compare=False)
    tools: tuple[dict, ...] = ()


# A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``, which made
# building parts and turns a fifth of parsing a chat record. The readers' hot path builds the
# commonest records (and media paths) by setting their slots directly (the same object: equal, same hash and
# repr; a test compares both ways).
_new = object.__new__
_part_kind, _part_text, _part_index = (Part.__dict__[name].__set__ for name in ("kind", "text", "index"))
_ref_kind, _ref_path, _ref_data = (MediaRef.__dict__[name].__set__ for name in ("kind", "path", "data"))
_message_role, _message_parts, _message_tool_calls, _message_reasoning, _message_tool_call_id, _message_loss = (
    Message.__dict__[name].__set__ for name in ("role", "parts", "tool_calls", "reasoning", "tool_call_id", "loss"))


def _part(kind: str, text: str, index: int) -> Part:
    p = _new(Part)
    _part_kind(p, kind)
    _part_text(p, text)
    _part_index(p, index)
    return p
