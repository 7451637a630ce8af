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
(LLaVA's pretraining template: the prompt's media, no system or user text, then the answer
and ``"\\n"``) has no end-of-turn token, so its newline is the stop signal and carries loss.

ChatML (Qwen2-VL / Qwen2.5-VL), one image, one turn::

    <|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n
    <|im_start|>user\\n<|vision_start|><|image_pad|>×N<|vision_end|>What is it?<|im_end|>\\n
    <|im_start|>assistant\\nA cat.<|im_end|>\\n
                          ^^^^^^^^^^^^^^^^^^ loss

``llama3`` opens every sequence with ``<|begin_of_text|>`` and strips whitespace from both ends of
every turn's content, as Llama 3's template does (``message['content'] | trim``); ``molmo2`` with the Molmo2
tokenizer's BOS (its generation config sets ``bos_token_id`` to ``<|im_end|>``'s id) and
moves every media item to the start of the first user turn, where the Molmo2 processor
puts the image tokens.

**Tool use** (``chatml`` and ``qwen3-vl``: the Qwen function-calling format; every other
template rejects a sample with tools as ``tools_unsupported`` rather than invent a format:
Llama 3's template has none, and none is published for Molmo2 or LLaVA pretraining). The
function schemas go in the system turn, after the system text, as Qwen's chat templates
write them (Qwen2.5's for ``chatml``, whose default system text with tools is "You are Qwen,
created by Alibaba Cloud. You are a helpful assistant."; Qwen3-VL's for ``qwen3-vl``, which
has none)::

    <|im_start|>system\\nYou are Qwen, ...\\n\\n# Tools\\n\\nYou may call one or more functions ...
    <tools>\\n{"name": "get_weather", ...}\\n</tools>\\n\\nFor each function call, return a json object
    with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n
    {"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n
    <|im_start|>user\\nWeather in Paris?<|im_end|>\\n
    <|im_start|>assistant\\n<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call><|im_end|>\\n
                          ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^ loss
    <|im_start|>user\\n<tool_response>\\n{"temp_c": 18}\\n</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n18 °C.<|im_end|>\\n
                          ^^^^^^^^^^^^^^^^ loss

Consecutive tool results share one user turn, one ``<tool_response>`` block each. JSON is
written as the templates' ``tojson`` writes it (``json.dumps``: ``", "`` and ``": "``
separators, non-ASCII kept). ``<tool_call>`` / ``</tool_call>`` (and for ``qwen3-vl``
``<tool_response>`` / ``</tool_response>``) are single tokens of the model's vocabulary
(:attr:`Template.markers`), looked up like every special token.

**Reasoning** (``qwen3-vl`` only). When any assistant turn of a conversation has reasoning
(a ``reasoning_content`` field, or ``<think>…</think>`` in its text) the conversation is
rendered as Qwen3's thinking template does: after the last real user query, an assistant
turn keeps its reasoning as ``<think>\\n{reasoning}\\n</think>\\n\\n{answer}`` when it is the
last turn or has reasoning; every earlier turn's reasoning is dropped. Whether the
``<think>…</think>\\n\\n`` span carries loss is ``reasoning_loss`` (``--reasoning-loss``, the
default, or ``--no-reasoning-loss``). A conversation with no reasoning renders as before.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache, lru_cache

from .errors import ConfigError, SampleError, quoted
from .records import Message, Part, ToolCall

__all__ = ["Template", "get_template", "TEMPLATES", "Segment", "tojson"]

Segment = tuple[str, str, int, bool]

#: The Qwen2.5 / Qwen3 chat templates' function-calling instructions, word for word;
#: ``{tools}`` is one JSON schema per line.
QWEN_TOOLS_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)
#: Qwen2.5's system text when tools are offered and the conversation has no system turn.
QWEN25_TOOLS_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def tojson(value) -> str:
    """JSON as the chat templates' ``tojson`` filter writes it (transformers: ``json.dumps``,
    non-ASCII kept, default separators, keys in their order).

    Example:
        >>> tojson({"city": "Zürich", "days": [1, 2]})
        '{"city": "Zürich", "days": [1, 2]}'
    """
    return json.dumps(value, ensure_ascii=False)


@cache
def _markers_pattern(markers: tuple[str, ...]) -> re.Pattern:
    """One pattern for the tags: the alternatives in string order, so where two start at one
    place the least wins, as :meth:`Template._marked` has always chosen."""
    return re.compile("|".join(re.escape(tag) for tag in sorted(markers)))


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
        tool_format: ``"qwen2.5"`` or ``"qwen3"`` (the Qwen function-calling format, with
            that version's system rule), or ``""``: the model has none (``tools_unsupported``).
        markers: the tool and reasoning tags that are single tokens of the model's
            vocabulary (rendered as special tokens; any other tag is ordinary text).
        reasoning: render reasoning as Qwen3's thinking template does (else a
            ``reasoning_content`` field is ``reasoning_unsupported``).
        model: the model family the template is for, named in messages.
        default_tokenizer: the embedded vocabulary used when ``--tokenizer`` is not given
            (``qwen3-vl``: ``qwen3``, whose tool and think tags are single tokens).
        trim_content: strip whitespace from both ends of every turn's content, as Llama 3's
            template does (``message['content'] | trim``).
        prompt_text: whether the text of user and system turns is rendered; LLaVA's pretraining
            (``plain``) keeps only their media, as its ``preprocess_plain`` replaces the prompt with
            the image and has no system text (a default or ``--system-prompt`` included).
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
    tool_format: str = ""
    markers: tuple[str, ...] = ()
    reasoning: bool = False
    model: str = ""
    default_tokenizer: str | None = None
    trim_content: bool = False
    prompt_text: bool = True

    def render(self, messages: tuple[Message, ...], system_prompt: str | None = None, tools: tuple[dict, ...] = (),
               reasoning_loss: bool = True) -> list[Segment]:
        """Segments of one conversation branch.

        Args:
            messages: the branch's turns.
            system_prompt: overrides :attr:`default_system` (``""`` for none); a
                conversation's own system turn always wins.
            tools: the function schemas offered to the model (the sample's).
            reasoning_loss: whether kept reasoning (``<think>…</think>``) carries loss.

        Raises:
            SampleError: ``empty_conversation``, ``unknown_role``, ``bad_turn_order``, ``no_loss``,
                ``tools_unsupported``, ``reasoning_unsupported``, ``orphan_tool_result``.
        """
        if not messages:
            raise SampleError("empty_conversation", "the conversation has no turns")
        if not tools:
            segs = self._render_plain(messages, system_prompt)
            if segs is not None:
                return segs
        return self._render_general(messages, system_prompt, tools, reasoning_loss)

    def _render_general(self, messages: tuple[Message, ...], system_prompt: str | None, tools: tuple[dict, ...],
                        reasoning_loss: bool) -> list[Segment]:
        """:meth:`render` of any conversation (tools, reasoning, hoisted media, every error)."""
        if not messages:
            raise SampleError("empty_conversation", "the conversation has no turns")
        if self.trim_content:
            messages, system_prompt = _trimmed_all(messages, system_prompt)
        msgs = list(messages)
        self._check_tools(msgs, tools)
        segs: list[Segment] = []
        if self.bos:
            segs.append(("special", self.bos, 1, False))
        if self.hoist_media:
            msgs = _hoist_media(msgs)
        has_system = msgs[0].role == "system"
        if tools:
            self._tools_system(segs, msgs[0] if has_system else None, system_prompt, tools)
        elif not has_system and self.prompt_text:
            system = self.default_system if system_prompt is None else system_prompt
            if system:
                self._turn(segs, "system", [("text", system, 1, False)])
        think = self.reasoning and any(m.role == "assistant" and (m.reasoning is not None or "</think>" in _text(m))
                                       for m in msgs)
        last_query = _last_query(msgs) if think else len(msgs)
        seen_user = False
        has_loss = False
        i = 0
        while i < len(msgs):
            msg = msgs[i]
            role = msg.role
            if role == "system":
                if i != 0:
                    raise SampleError("bad_turn_order", f"system turn at position {i}; only the first turn may be system")
                if not tools:
                    self._turn(segs, "system", _body(msg, False, media_only=not self.prompt_text))
            elif role == "user":
                seen_user = True
                self._turn(segs, "user", _body(msg, False, media_only=not self.prompt_text))
            elif role == "assistant":
                if self.require_user_first and not seen_user:
                    raise SampleError("bad_turn_order", f"an assistant turn comes before any user turn, which template {self.name!r} forbids")
                keep = think and i > last_query and (i == len(msgs) - 1 or bool(_split_reasoning(msg)[0]))
                start = len(segs)
                self._turn(segs, "assistant", self._assistant_body(msg, think, keep, reasoning_loss))
                if msg.loss is False:  # context only: the turn as rendered, none of it learned
                    segs[start:] = _without_loss(segs[start:])
                else:
                    has_loss = True
            elif role == "tool":
                i = self._tool_results(segs, msgs, i)
                continue
            else:
                raise SampleError("unknown_role", f"turn {i} has role {quoted(role)}")
            i += 1
        if not has_loss:
            if any(m.role == "assistant" for m in msgs):
                raise SampleError("no_loss", 'every assistant turn is marked "loss": false (context only), so nothing '
                                             "to learn from")
            raise SampleError("no_loss", "the conversation has no assistant turn, so nothing to learn from")
        return segs

    def _render_plain(self, messages: tuple[Message, ...], system_prompt: str | None) -> list[Segment] | None:
        """:meth:`render` of the common conversation in one pass, or None where it needs the general path.

        Common: system, user and assistant turns of text and media only (no tool calls or
        results, no reasoning), in an order the template accepts, with an assistant turn,
        under a template that leaves media where they are.
        Anything else returns None and :meth:`render` takes its general path, which gives
        the same segments for what this accepts and raises the right error for the rest; a
        test renders every case both ways. Most samples are common, and this path makes no
        per-turn calls (every chat sample renders five turns or so).
        """
        if self.hoist_media:
            return None
        if self.trim_content:
            messages, system_prompt = _trimmed_all(messages, system_prompt)
        ends = _role_ends(self)
        segs: list[Segment] = [("special", self.bos, 1, False)] if self.bos else []
        if messages[0].role != "system" and self.prompt_text:
            system = self.default_system if system_prompt is None else system_prompt
            if system:
                head, tail = ends["system"]
                segs += head
                segs.append(("text", system, 1, False))
                segs += tail
        seen_user = has_loss = False
        think = self.reasoning
        for i, msg in enumerate(messages):
            role = msg.role
            if msg.tool_calls or msg.reasoning is not None or msg.tool_call_id is not None:
                return None
            if role == "user":
                seen_user = True
                loss = False
            elif role == "assistant":
                if (self.require_user_first and not seen_user) or (think and "</think>" in _text(msg)) \
                        or msg.loss is False:  # a turn kept as context only: the general path
                    return None
                has_loss = loss = True
            elif role != "system" or i:
                return None
            else:
                loss = False
            head, tail = ends[role]
            segs += head
            _body(msg, loss, segs, media_only=role != "assistant" and not self.prompt_text)
            segs += tail
        return segs if has_loss else None

    def _check_tools(self, msgs: list[Message], tools: tuple[dict, ...]) -> None:
        """Refuse what this template cannot render; every tool result must answer a call."""
        has_result = has_call = has_reasoning = False
        for m in msgs:  # one pass: most conversations have none of these
            has_result = has_result or m.role == "tool"
            has_call = has_call or bool(m.tool_calls)
            has_reasoning = has_reasoning or m.reasoning is not None
        if (tools or has_result or has_call) and not self.tool_format:
            raise SampleError("tools_unsupported", f"the sample uses tools, but template {self.name!r} ({self.model}) has no "
                                                   "tool-call format; use --template chatml or qwen3-vl, or drop the tool turns")
        if has_reasoning and not self.reasoning:
            raise SampleError("reasoning_unsupported", f"an assistant turn has reasoning_content, which template "
                                                       f"{self.name!r} ({self.model}) has no format for; use --template "
                                                       "qwen3-vl, or put the reasoning in the text")
        if not has_result:
            return
        calls: tuple[ToolCall, ...] = ()
        answered = 0
        for i, m in enumerate(msgs):
            if m.role == "tool":
                if not calls:
                    raise SampleError("orphan_tool_result", f"turn {i} is a tool result with no tool call before it")
                answered += 1
                if answered > len(calls):
                    raise SampleError("orphan_tool_result", f"turn {i} is tool result {answered} after an assistant "
                                                            f"turn that made {len(calls)} call(s)")
                ids = {c.call_id for c in calls if c.call_id is not None}
                if m.tool_call_id is not None and ids and m.tool_call_id not in ids:
                    raise SampleError("orphan_tool_result", f"turn {i} answers tool call {quoted(m.tool_call_id)}, which "
                                                            f"the assistant turn before it did not make "
                                                            f"({', '.join(quoted(c, 40) for c in sorted(ids)[:8])})")
            else:
                calls, answered = (m.tool_calls if m.role == "assistant" else ()), 0

    def _tool_results(self, segs: list[Segment], msgs: list[Message], i: int) -> int:
        """The tool results from ``msgs[i]`` on as one user turn of ``<tool_response>`` blocks; the next index."""
        body: list[Segment] = []
        j = i
        while j < len(msgs) and msgs[j].role == "tool":
            if j > i:
                body.append(("text", "\n", 1, False))
            body.append(self._marker("<tool_response>", False))
            body.append(("text", "\n", 1, False))
            body.extend(_body(msgs[j], False))
            body.append(("text", "\n", 1, False))
            body.append(self._marker("</tool_response>", False))
            j += 1
        self._turn(segs, "user", body)
        return j

    def _marker(self, tag: str, loss: bool) -> Segment:
        return ("special" if tag in self.markers else "text", tag, 1, loss)

    def _marked(self, text: str, loss: bool) -> list[Segment]:
        """Template-written ``text`` with its vocabulary tags (:attr:`markers`) as tokens: each
        leftmost tag in turn (at one place, the least tag as a string), found in one pass over
        the text. (Looking for every tag again after each one took time quadratic in the tags
        a tool schema's text holds: 12 s for 40,000.)"""
        out: list[Segment] = []
        pos = 0
        if self.markers:
            for m in _markers_pattern(self.markers).finditer(text):
                at = m.start()
                if at > pos:
                    out.append(("text", text[pos:at], 1, loss))
                out.append(("special", m.group(), 1, loss))
                pos = m.end()
        if pos < len(text):
            out.append(("text", text[pos:], 1, loss))
        return out

    def _tools_system(self, segs: list[Segment], system: Message | None, system_prompt: str | None,
                      tools: tuple[dict, ...]) -> None:
        """The system turn with the tools block, as the template's model writes it."""
        block = QWEN_TOOLS_BLOCK.format(tools="".join("\n" + tojson(t) for t in tools))
        if system is not None:
            body = _body(system, False)
            body.append(("text", "\n\n", 1, False))
        else:
            text = system_prompt if system_prompt is not None else (
                QWEN25_TOOLS_SYSTEM if self.tool_format == "qwen2.5" else self.default_system)
            # Qwen2.5 always writes a system text before the block; Qwen3 only a given one
            body = [("text", text + "\n\n", 1, False)] if text or self.tool_format == "qwen2.5" else []
        body.extend(self._marked(block, False))
        self._turn(segs, "system", body)

    def _assistant_body(self, msg: Message, think: bool, keep: bool, reasoning_loss: bool) -> list[Segment]:
        """Reasoning (kept or dropped), the answer, then the calls, all with loss but dropped reasoning."""
        body: list[Segment] = []
        if think and all(p.kind == "text" for p in msg.parts):
            reasoning, content = _split_reasoning(msg)
            if keep:
                body.append(self._marker("<think>", reasoning_loss))
                body.append(("text", "\n" + reasoning.strip("\n") + "\n", 1, reasoning_loss))
                body.append(self._marker("</think>", reasoning_loss))
                body.append(("text", "\n\n", 1, reasoning_loss))
                if content.lstrip("\n"):
                    body.append(("text", content.lstrip("\n"), 1, True))
            elif content:
                body.append(("text", content, 1, True))
        else:
            body = _body(msg, True)
            if not msg.tool_calls:
                return body
            content = _text(msg)
        for k, call in enumerate(msg.tool_calls):
            if k or content:
                body.append(("text", "\n", 1, True))
            body.append(self._marker("<tool_call>", True))
            body.append(("text", f'\n{{"name": "{call.name}", "arguments": {tojson(call.arguments)}}}\n', 1, True))
            body.append(self._marker("</tool_call>", True))
        return body

    def _turn(self, segs: list[Segment], role: str, body: list[Segment]) -> None:
        head, tail = _turn_ends(self, role)
        segs.extend(head)
        segs.extend(body)
        segs.extend(tail)

    def settings(self) -> dict:
        return {"name": self.name, "default_system": self.default_system,
                "loss_on_turn_newline": self.loss_on_turn_newline}


def _without_loss(segs: list[Segment]) -> list[Segment]:
    """``segs`` with no loss on any of them (an assistant turn a record keeps as context only)."""
    return [(kind, value, count, False) for kind, value, count, _ in segs]


def _text(msg: Message) -> str:
    return "".join(p.text for p in msg.parts if p.kind == "text")


def _body(msg: Message, loss: bool, body: list[Segment] | None = None, media_only: bool = False) -> list[Segment]:
    """The segments of a turn's parts, appended to ``body`` (a new list when None); with
    ``media_only``, only its media (:attr:`Template.prompt_text`)."""
    if body is None:
        body = []
    for part in msg.parts:
        if part.kind == "text":
            if part.text and not media_only:
                body.append(("text", part.text, 1, loss))
        else:
            body.append(("media", part.kind, part.index, False))
    return body


def _trimmed_all(messages: tuple[Message, ...], system_prompt: str | None) -> tuple[tuple[Message, ...], str | None]:
    """Every turn :func:`_trimmed`, and the system prompt stripped (it is a turn's content too)."""
    return tuple(map(_trimmed, messages)), (system_prompt.strip() if system_prompt is not None else None)


def _trimmed(msg: Message) -> Message:
    """``msg`` with the whitespace at both ends of its content removed (Jinja's ``trim``, which is
    ``str.strip``); media parts are not whitespace, so only text before the first and after the
    last media part is touched.

    Example: parts ``(" ", "\\nHi ", <image>, " ok\\n")`` → ``("Hi ", <image>, " ok")``.
    """
    parts = list(msg.parts)
    for step in (1, -1):
        k = 0 if step == 1 else len(parts) - 1
        while 0 <= k < len(parts) and parts[k].kind == "text":
            text = parts[k].text.lstrip() if step == 1 else parts[k].text.rstrip()
            if text:
                parts[k] = Part.of_text(text)
                break
            del parts[k]
            k = 0 if step == 1 else len(parts) - 1
    if len(parts) == len(msg.parts) and all(a is b for a, b in zip(parts, msg.parts, strict=True)):
        return msg
    return Message(msg.role, tuple(parts), msg.tool_calls, msg.reasoning, msg.tool_call_id, msg.loss)


def _split_reasoning(msg: Message) -> tuple[str, str]:
    """``(reasoning, answer)`` of an assistant turn, split as Qwen3's template splits it.

    Example: ``"<think>\\nAdd.\\n</think>\\n\\n4"`` → ``("Add.", "4")``.
    """
    text = _text(msg)
    if msg.reasoning is not None:
        return msg.reasoning, text
    if "</think>" in text:
        head, _, _ = text.partition("</think>")
        return head.rstrip("\n").split("<think>")[-1].lstrip("\n"), text.split("</think>")[-1].lstrip("\n")
    return "", text


def _last_query(msgs: list[Message]) -> int:
    """Index of the last user turn that is a real query (not a ``<tool_response>`` wrapper), as
    Qwen3's template finds it; reasoning is kept only after it."""
    for i in range(len(msgs) - 1, -1, -1):
        if msgs[i].role == "user":
            text = _text(msgs[i])
            if not (text.startswith("<tool_response>") and text.endswith("</tool_response>")):
                return i
    return len(msgs) - 1


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


@lru_cache(maxsize=16)
def _role_ends(template: Template) -> dict[str, tuple[tuple[Segment, ...], tuple[Segment, ...]]]:
    """:func:`_turn_ends` of the three plain roles, by role (one cache look-up per render)."""
    return {role: _turn_ends(template, role) for role in ("system", "user", "assistant")}


def _hoist_media(msgs: list[Message]) -> list[Message]:
    media = [p for m in msgs for p in m.parts if p.kind != "text"]
    if not media:
        return msgs
    media.sort(key=lambda p: p.index)
    first_user = next((i for i, m in enumerate(msgs) if m.role == "user"), None)
    if first_user is None:
        raise SampleError("placeholder_mismatch", "the conversation has media but no user turn to hold them")
    out = [Message(m.role, tuple(p for p in m.parts if p.kind == "text"), m.tool_calls, m.reasoning, m.tool_call_id,
                   m.loss) for m in msgs]
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
        tool_format="qwen2.5",
        markers=("<tool_call>", "</tool_call>"),
        model="Qwen2-VL / Qwen2.5-VL",
    ),
    "qwen3-vl": Template(
        name="qwen3-vl",
        default_system="",
        header=_CHATML_HEADER,
        turn_end="<|im_end|>",
        turn_newline="\n",
        tool_format="qwen3",
        markers=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"),
        reasoning=True,
        model="Qwen3-VL",
        default_tokenizer="qwen3",
    ),
    "llama3": Template(
        name="llama3",
        default_system="",
        header=(("special", "<|start_header_id|>"), ("text", "{role}"), ("special", "<|end_header_id|>"), ("text", "\n\n")),
        turn_end="<|eot_id|>",
        turn_newline="",
        bos="<|begin_of_text|>",
        model="Llama 3",
        trim_content=True,
    ),
    "molmo2": Template(
        name="molmo2",
        default_system="",
        header=_CHATML_HEADER,
        turn_end="<|im_end|>",
        turn_newline="\n",
        bos="<|im_end|>",
        hoist_media=True,
        model="Molmo2",
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
        model="LLaVA pretraining",
        prompt_text=False,
    ),
}


def get_template(name: str) -> Template:
    try:
        return TEMPLATES[name]
    except KeyError:
        raise ConfigError(f"unknown --template {name!r}; choose one of: {', '.join(sorted(TEMPLATES))}") from None
