"""Chat templates: a conversation becomes a list of segments with a loss flag.

A segment is ``(kind, value, count, loss)``:

* ``("special", "<|im_start|>", 1, False)`` — a special token, looked up by name in the
  tokenizer (ids are never hard-coded here);
* ``("text", "user\\n", 1, False)`` — ordinary text, encoded by the tokenizer;
* ``("media", "image", i, False)`` — media item ``i``; the vision family expands it.

Loss is carried by assistant content and the assistant's end-of-turn token only.
Whether the text after the end-of-turn token (a newline in ChatML) also carries loss
is a per-template rule, :attr:`Template.loss_on_turn_newline`:

=========  ==========================  ==============  ===============  =====================
template   turn                        end of turn     newline loss     default system prompt
=========  ==========================  ==============  ===============  =====================
chatml     ``<|im_start|>role\\n``       ``<|im_end|>``  no               "You are a helpful assistant."
qwen3-vl   ``<|im_start|>role\\n``       ``<|im_end|>``  no               none
llama3     ``<|start_header_id|>role``  ``<|eot_id|>``  (no newline)     none
           ``<|end_header_id|>\\n\\n``
molmo2     ``<|im_start|>role\\n``       ``<|im_end|>``  no               none
plain      (nothing)                   ``\\n`` after    yes: the newline none
                                       assistant turns *is* the end
=========  ==========================  ==============  ===============  =====================

Why no loss on ChatML's newline: generation stops at ``<|im_end|>``, so the newline
after it is never produced by the model; training on it teaches nothing and, in a
message tree, it is the token a branch would predict *after* its own end. ``plain``
(LLaVA's pretraining template: media, the user's text if any, then the answer and
``"\\n"``) has no end-of-turn token, so its newline is the stop signal and carries loss.

ChatML (Qwen2-VL / Qwen2.5-VL), one image, one turn::

    <|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n
    <|im_start|>user\\n<|vision_start|><|image_pad|>×N<|vision_end|>What is it?<|im_end|>\\n
    <|im_start|>assistant\\nA cat.<|im_end|>\\n
                          ^^^^^^^^^^^^^^^^^^ loss

``llama3`` opens every sequence with ``<|begin_of_text|>``; ``molmo2`` with the Molmo2
tokenizer's BOS (its generation config sets ``bos_token_id`` to ``<|im_end|>``'s id) and
moves every media item to the start of the first user turn, where the Molmo2 processor
puts the image tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

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
        header: segments opening a turn, ``(kind, value)`` with kind ``special`` or
            ``text``; ``{role}`` in a value is replaced by the role name.
        turn_end: special token closing a turn ("" for none); it carries loss on assistant turns.
        turn_newline: text after ``turn_end``.
        loss_on_turn_newline: whether ``turn_newline`` after an assistant turn carries loss.
        bos: special token at the start of every sequence ("" for none).
        require_user_first: reject conversations whose first non-system turn is the
            assistant's (``bad_turn_order``).
        hoist_media: move all media to the start of the first user turn.
        newline_roles: roles whose turns end with ``turn_newline``.
    """

    name: str
    default_system: str
    header: tuple[tuple[str, str], ...]
    turn_end: str
    turn_newline: str
    loss_on_turn_newline: bool = False
    bos: str = ""
    require_user_first: bool = True
    hoist_media: bool = False
    newline_roles: tuple[str, ...] = ("system", "user", "assistant")

    def render(self, messages: tuple[Message, ...], system_prompt: str | None = None) -> list[Segment]:
        """Segments of one conversation branch.

        Args:
            messages: the branch's turns.
            system_prompt: overrides :attr:`default_system` (``""`` for none); a
                conversation's own system turn always wins.

        Raises:
            SampleError: ``empty_conversation``, ``unknown_role``, ``bad_turn_order``, ``no_loss``.
        """
        if not messages:
            raise SampleError("empty_conversation", "the conversation has no turns")
        segs: list[Segment] = []
        if self.bos:
            segs.append(("special", self.bos, 1, False))
        msgs = list(messages)
        if self.hoist_media:
            msgs = _hoist_media(msgs)
        system = self.default_system if system_prompt is None else system_prompt
        if msgs[0].role != "system" and system:
            self._turn(segs, "system", [("text", system, 1, False)])
        seen_user = False
        has_loss = False
        for i, msg in enumerate(msgs):
            role = msg.role
            if role == "system":
                if i != 0:
                    raise SampleError("bad_turn_order", f"system turn at position {i}; only the first turn may be system")
            elif role == "user":
                seen_user = True
            elif role == "assistant":
                if self.require_user_first and not seen_user:
                    raise SampleError("bad_turn_order", f"an assistant turn comes before any user turn, which template {self.name!r} forbids")
                has_loss = True
            else:
                raise SampleError("unknown_role", f"turn {i} has role {role!r}")
            loss = role == "assistant"
            body = []
            for part in msg.parts:
                if part.kind == "text":
                    if part.text:
                        body.append(("text", part.text, 1, loss))
                else:
                    body.append(("media", part.kind, part.index, False))
            self._turn(segs, role, body)
        if not has_loss:
            raise SampleError("no_loss", "the conversation has no assistant turn, so nothing to learn from")
        return segs

    def _turn(self, segs: list[Segment], role: str, body: list[Segment]) -> None:
        head, tail = _turn_ends(self, role)
        segs.extend(head)
        segs.extend(body)
        segs.extend(tail)

    def settings(self) -> dict:
        return {"name": self.name, "default_system": self.default_system,
                "loss_on_turn_newline": self.loss_on_turn_newline}


@lru_cache(maxsize=64)
def _turn_ends(template: Template, role: str) -> tuple[tuple[Segment, ...], tuple[Segment, ...]]:
    """The segments before and after a turn's body, per template and role (built once: every
    turn of every sample needs them)."""
    loss = role == "assistant"
    head = tuple((kind, value.replace("{role}", role) if "{" in value else value, 1, False)
                 for kind, value in template.header)
    tail: list[Segment] = []
    if template.turn_end:
        tail.append(("special", template.turn_end, 1, loss))
    if template.turn_newline and role in template.newline_roles:
        tail.append(("text", template.turn_newline, 1, loss and template.loss_on_turn_newline))
    return head, tuple(tail)


def _hoist_media(msgs: list[Message]) -> list[Message]:
    media = [p for m in msgs for p in m.parts if p.kind != "text"]
    if not media:
        return msgs
    media.sort(key=lambda p: p.index)
    first_user = next((i for i, m in enumerate(msgs) if m.role == "user"), None)
    if first_user is None:
        raise SampleError("placeholder_mismatch", "the conversation has media but no user turn to hold them")
    out = [Message(m.role, tuple(p for p in m.parts if p.kind == "text")) for m in msgs]
    out[first_user] = Message("user", tuple(media) + out[first_user].parts)
    return out


_CHATML_HEADER = (("special", "<|im_start|>"), ("text", "{role}\n"))

TEMPLATES: dict[str, Template] = {
    "chatml": Template(
        name="chatml",
        default_system="You are a helpful assistant.",
        header=_CHATML_HEADER,
        turn_end="<|im_end|>",
        turn_newline="\n",
    ),
    "qwen3-vl": Template(
        name="qwen3-vl",
        default_system="",
        header=_CHATML_HEADER,
        turn_end="<|im_end|>",
        turn_newline="\n",
    ),
    "llama3": Template(
        name="llama3",
        default_system="",
        header=(("special", "<|start_header_id|>"), ("text", "{role}"), ("special", "<|end_header_id|>"), ("text", "\n\n")),
        turn_end="<|eot_id|>",
        turn_newline="",
        bos="<|begin_of_text|>",
    ),
    "molmo2": Template(
        name="molmo2",
        default_system="",
        header=_CHATML_HEADER,
        turn_end="<|im_end|>",
        turn_newline="\n",
        bos="<|im_end|>",
        hoist_media=True,
    ),
    "plain": Template(
        name="plain",
        default_system="",
        header=(),
        turn_end="",
        turn_newline="\n",
        loss_on_turn_newline=True,
        require_user_first=False,
        newline_roles=("assistant",),
    ),
}


def get_template(name: str) -> Template:
    try:
        return TEMPLATES[name]
    except KeyError:
        raise ConfigError(f"unknown --template {name!r}; choose one of: {', '.join(sorted(TEMPLATES))}") from None
