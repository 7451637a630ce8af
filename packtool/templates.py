"""Chat templates: a conversation becomes a list of segments with a loss flag.

A segment is ``(kind, value, count, loss)``:

* ``("special", "<|im_start|>", 1, False)`` — a special token, looked up by name;
* ``("text", "user\\n", 1, False)`` — ordinary text, encoded by the tokenizer;
* ``("media", "", i, False)`` — media item ``i``; the vision family expands it.

Loss is carried by assistant content and the assistant's end-of-turn token only.
Whether the newline after the end-of-turn token carries loss is a per-template
rule (:attr:`Template.loss_on_turn_newline`); for ``chatml`` it does not.

ChatML (Qwen2-VL / Qwen2.5-VL), one image, one turn::

    <|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n
    <|im_start|>user\\n<|vision_start|><|image_pad|>×N<|vision_end|>What is it?<|im_end|>\\n
    <|im_start|>assistant\\nA cat.<|im_end|>\\n
                          ^^^^^^^^^^^^^^^^^^ loss
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError, SampleError
from .records import Message

__all__ = ["Template", "get_template", "TEMPLATES", "Segment"]

Segment = tuple[str, str, int, bool]


@dataclass(frozen=True, slots=True)
class Template:
    """A turn-based chat template.

    Attributes:
        name: the ``--template`` value.
        default_system: system prompt used when a conversation has none ("" for none).
        turn_start: special token opening a turn (before the role header).
        role_header: text after ``turn_start``; ``{role}`` is replaced by the role name.
        turn_end: special token closing a turn; it carries loss on assistant turns.
        turn_newline: text after ``turn_end``.
        loss_on_turn_newline: whether ``turn_newline`` after an assistant turn carries loss.
        bos: special token at the start of every sequence ("" for none).
        eos: special token after the last assistant turn ("" for none).
    """

    name: str
    default_system: str
    turn_start: str
    role_header: str
    turn_end: str
    turn_newline: str
    loss_on_turn_newline: bool = False
    bos: str = ""
    eos: str = ""
    require_user_first: bool = True

    def render(self, messages: tuple[Message, ...], system_prompt: str | None = None) -> list[Segment]:
        """Segments of one conversation branch.

        Raises:
            SampleError: ``empty_conversation``, ``unknown_role``, ``bad_turn_order``, ``no_loss``.
        """
        if not messages:
            raise SampleError("empty_conversation", "the conversation has no turns")
        segs: list[Segment] = []
        if self.bos:
            segs.append(("special", self.bos, 1, False))
        msgs = list(messages)
        system = self.default_system if system_prompt is None else system_prompt
        if msgs[0].role != "system" and system:
            segs.extend(self._turn("system", ((("text", system, 1, False)),)))
        seen_user = False
        has_loss = False
        for i, msg in enumerate(msgs):
            if msg.role == "system":
                if i != 0:
                    raise SampleError("bad_turn_order", f"system turn at position {i}; only the first turn may be system")
            elif msg.role == "user":
                seen_user = True
            elif msg.role == "assistant":
                if self.require_user_first and not seen_user:
                    raise SampleError("bad_turn_order", "an assistant turn comes before any user turn")
                has_loss = True
            else:
                raise SampleError("unknown_role", f"turn {i} has role {msg.role!r}")
            loss = msg.role == "assistant"
            body = []
            for part in msg.parts:
                if part.kind == "text":
                    if part.text:
                        body.append(("text", part.text, 1, loss))
                else:
                    body.append(("media", part.kind, part.index, False))
            segs.extend(self._turn(msg.role, body))
        if not has_loss:
            raise SampleError("no_loss", "the conversation has no assistant turn, so nothing to learn from")
        if self.eos:
            segs.append(("special", self.eos, 1, True))
        return segs

    def _turn(self, role: str, body) -> list[Segment]:
        loss = role == "assistant"
        segs: list[Segment] = []
        if self.turn_start:
            segs.append(("special", self.turn_start, 1, False))
        if self.role_header:
            segs.append(("text", self.role_header.format(role=role), 1, False))
        segs.extend(body)
        if self.turn_end:
            segs.append(("special", self.turn_end, 1, loss))
        if self.turn_newline:
            segs.append(("text", self.turn_newline, 1, loss and self.loss_on_turn_newline))
        return segs

    def settings(self) -> dict:
        return {"name": self.name}


TEMPLATES: dict[str, Template] = {
    "chatml": Template(
        name="chatml",
        default_system="You are a helpful assistant.",
        turn_start="<|im_start|>",
        role_header="{role}\n",
        turn_end="<|im_end|>",
        turn_newline="\n",
    ),
}


def get_template(name: str) -> Template:
    try:
        return TEMPLATES[name]
    except KeyError:
        raise ConfigError(f"unknown --template {name!r}; choose one of: {', '.join(sorted(TEMPLATES))}") from None
