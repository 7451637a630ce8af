"""Tool use and reasoning as inputs store them, read into :class:`~packtool.formats.common.Turn`.

Three conversation shapes carry function calls; all become assistant turns with
:class:`~packtool.records.ToolCall` s and ``tool`` turns with the results:

* **OpenAI** ``messages``: an assistant message with ``tool_calls: [{"id", "type":
  "function", "function": {"name", "arguments"}}]`` (``arguments`` a JSON string, or an
  object), then one ``{"role": "tool", "tool_call_id", "content"}`` message per result
  (the legacy ``function_call`` object and ``role: "function"`` read the same);
* **ShareGPT** (LLaMA-Factory): ``{"from": "function_call", "value": "{\\"name\\": ..,
  \\"arguments\\": {..}}"}`` (one call, or a JSON list of calls) then ``{"from":
  "observation", "value": result}``;
* **ms-swift**: ``{"role": "tool_call", "content": "{\\"name\\": .., \\"arguments\\": ..}"}``
  (one message per call; consecutive ones are one assistant turn) then
  ``{"role": "tool_response", "content": result}``.

The functions offered to the model are a sample-level ``tools`` list of JSON schemas,
either a list or a JSON string holding one (how LLaMA-Factory and ms-swift store it);
each is ``{"name", "description", "parameters"}`` or OpenAI's ``{"type": "function",
"function": {...}}`` and is rendered as written.

Reasoning: an assistant message's ``reasoning_content`` field becomes
:attr:`~packtool.records.Message.reasoning`; ``<think>…</think>`` inside the text stays
there (the template splits it off, as the model's own template does). A ShareGPT
``function_call`` value may start with such a block before its JSON (LLaMA-Factory's
thought words): the block is kept as the turn's text.
"""

from __future__ import annotations

import json

from ..errors import SampleError, quoted
from ..records import ToolCall

__all__ = ["parse_tools", "parse_tool_call", "parse_call_text", "CALL_ROLES", "RESULT_ROLES"]

#: Role / ``from`` values of a message that holds one function call as JSON text.
CALL_ROLES = ("function_call", "tool_call")
#: Role / ``from`` values of a tool result.
RESULT_ROLES = ("tool", "observation", "tool_response", "function")


def _schema_name(tool) -> str | None:
    if not isinstance(tool, dict):
        return None
    fn = tool.get("function") if tool.get("type") == "function" else tool
    name = fn.get("name") if isinstance(fn, dict) else None
    return name if isinstance(name, str) and name else None


def parse_tools(value) -> tuple[dict, ...]:
    """The sample's ``tools``: a list of function schemas, or a JSON string of one.

    Example:
        >>> parse_tools('[{"name": "add", "parameters": {}}]')
        ({'name': 'add', 'parameters': {}},)

    Raises:
        SampleError: ``bad_tools`` (not JSON, not a list, or an entry without a name).
    """
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise SampleError("bad_tools", f"'tools' is a string but not JSON ({str(exc)[:120]}); write the list "
                                           "of function schemas as JSON") from None
    if not isinstance(value, list):
        raise SampleError("bad_tools", f"'tools' must be a list of function schemas, got {type(value).__name__}")
    for i, tool in enumerate(value):
        if _schema_name(tool) is None:
            raise SampleError("bad_tools", f"tools[{i}] is not a function schema: it needs a 'name' (or "
                                           "'type': 'function' with 'function': {'name', ...})")
    return tuple(value)


def parse_tool_call(call, where: str) -> ToolCall:
    """One call, OpenAI ``{"type": "function", "function": {"name", "arguments"}}`` or bare ``{"name", "arguments"}``.

    ``arguments`` may be a JSON string (OpenAI) or an object; it must decode to a JSON object.

    Example:
        >>> parse_tool_call({"function": {"name": "add", "arguments": '{"a": 1}'}}, "call 0")
        ToolCall(name='add', arguments={'a': 1}, call_id=None)

    Raises:
        SampleError: ``bad_tool_call`` (no name), ``bad_tool_arguments`` (arguments not a JSON object).
    """
    if not isinstance(call, dict):
        raise SampleError("bad_tool_call", f"{where} is a {type(call).__name__}, not an object with a name and arguments")
    fn = call["function"] if isinstance(call.get("function"), dict) else call
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise SampleError("bad_tool_call", f"{where} has no function name")
    if "arguments" not in fn:
        raise SampleError("bad_tool_arguments", f"{where} ({quoted(name)}) has no 'arguments'; write {{}} for none")
    args = fn["arguments"]
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError as exc:
            raise SampleError("bad_tool_arguments", f"{where} ({quoted(name)}): arguments are not JSON ({str(exc)[:120]})") from None
    if not isinstance(args, dict):
        raise SampleError("bad_tool_arguments", f"{where} ({quoted(name)}): arguments must be a JSON object, got "
                                                f"{type(args).__name__}")
    call_id = call.get("id")
    return ToolCall(name, args, str(call_id) if call_id is not None else None)


def parse_call_text(text: str, where: str) -> tuple[str, tuple[ToolCall, ...]]:
    """``(leading text, calls)`` of a ShareGPT ``function_call`` / ms-swift ``tool_call`` value.

    The value is one call object or a JSON list of them, optionally after a
    ``<think>…</think>`` block, which is returned as the leading text.

    Raises:
        SampleError: ``bad_tool_call`` (the value is not JSON), ``bad_tool_arguments``.
    """
    lead, body = "", text
    cut = text.rfind("</think>")
    if cut >= 0:
        lead, body = text[: cut + len("</think>")], text[cut + len("</think>"):]
    try:
        value = json.loads(body)
    except ValueError as exc:
        raise SampleError("bad_tool_call", f"{where} is not a JSON function call ({str(exc)[:120]}); write "
                                           "{\"name\": ..., \"arguments\": {...}}") from None
    calls = value if isinstance(value, list) else [value]
    if not calls:
        raise SampleError("bad_tool_call", f"{where} is an empty list of calls")
    return lead, tuple(parse_tool_call(c, f"{where} call {k}") for k, c in enumerate(calls))
