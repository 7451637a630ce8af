"""Tool use and reasoning, checked against the models' own published chat templates.

The Jinja templates below are the ``chat_template`` strings Qwen publishes, word for word:

* ``QWEN25_TEMPLATE``: Qwen2.5-Instruct's (``tokenizer_config.json``), which is also the
  template in Qwen2.5-VL-7B-Instruct's ``tokenizer_config.json``, the one with tool calls
  (the processor's ``chat_template.json`` has no tool part);
* ``QWEN3_TEMPLATE``: Qwen3's (``tokenizer_config.json`` of Qwen3-8B), whose reasoning
  rules the ``qwen3-vl`` template follows for conversations with reasoning;
* ``QWEN3_VL_TEMPLATE``: Qwen3-VL-8B-Instruct's (5,292 bytes, sha256 ``3636d0f0…``, pinned
  below), for conversations without reasoning: images, tools and images inside tool results.

Each conversation is rendered by transformers' own template compiler (its sandbox and
``tojson``), the string is tokenized whole with the embedded vocabulary (special and
added tokens included, as a Hugging Face tokenizer would), and packtool's ids, made from
the same conversation read as an input record, must be identical. Where the template writes
one ``<|image_pad|>`` per image, the processor's expansion to the image's token count is
applied to the string first (the count itself is pinned by the vision tests).
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pytest

from packtool.formats import Rejected, parse_record
from packtool.rows import EncodeContext, encode_samples
from packtool.templates import get_template
from packtool.tokenization import load_tokenizer
from packtool.vision import get_family

QWEN25_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)

QWEN3_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0].role == 'system' %}\n"
    "        {{- messages[0].content + '\\n\\n' }}\n    {%- endif %}\n"
    "    {{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    "    {%- if ns.multi_step_tool and message.role == \"user\" and not(message.content.startswith('<tool_response>') "
    "and message.content.endswith('</tool_response>')) %}\n        {%- set ns.multi_step_tool = false %}\n"
    "        {%- set ns.last_query_index = index %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {%- set content = message.content %}\n"
    "        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n        {%- else %}\n"
    "            {%- if '</think>' in message.content %}\n"
    "                {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}\n"
    "                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\\n')"
    ".split('<think>')[-1].lstrip('\\n') %}\n            {%- endif %}\n        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + "
    "'\\n</think>\\n\\n' + content.lstrip('\\n') }}\n            {%- else %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n' + content }}\n            {%- endif %}\n"
    "        {%- else %}\n            {{- '<|im_start|>' + message.role + '\\n' + content }}\n        {%- endif %}\n"
    "        {%- if message.tool_calls %}\n            {%- for tool_call in message.tool_calls %}\n"
    "                {%- if (loop.first and content) or (not loop.first) %}\n                    {{- '\\n' }}\n"
    "                {%- endif %}\n                {%- if tool_call.function %}\n"
    "                    {%- set tool_call = tool_call.function %}\n                {%- endif %}\n"
    "                {{- '<tool_call>\\n{\"name\": \"' }}\n                {{- tool_call.name }}\n"
    "                {{- '\", \"arguments\": ' }}\n                {%- if tool_call.arguments is string %}\n"
    "                    {{- tool_call.arguments }}\n                {%- else %}\n"
    "                    {{- tool_call.arguments | tojson }}\n                {%- endif %}\n"
    "                {{- '}\\n</tool_call>' }}\n            {%- endfor %}\n        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}\n"
    "        {%- if loop.first or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}\n{%- endif %}"
)

QWEN3_VL_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {%- if messages[0].content is string %}
            {{- messages[0].content }}
        {%- else %}
            {%- for content in messages[0].content %}
                {%- if 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' }}
        {%- if messages[0].content is string %}
            {{- messages[0].content }}
        {%- else %}
            {%- for content in messages[0].content %}
                {%- if 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif content.type == 'video' or 'video' in content %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                    <|vision_start|><|video_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content_item in message.content %}
                {%- if 'text' in content_item %}
                    {{- content_item.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and message.content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif content.type == 'video' or 'video' in content %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                    <|vision_start|><|video_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"name": "get_time", "description": "Local time.", "parameters": {"type": "object", "properties": {}}}


def call(name: str, args: dict, cid: str | None = None) -> dict:
    out = {"type": "function", "function": {"name": name, "arguments": args}}
    if cid:
        out["id"] = cid
    return out


# (label, tools, messages): OpenAI-style conversations, arguments as objects (what the
# templates are documented to take); the record given to packtool stores them as JSON strings
CONVERSATIONS = [
    ("one call", [WEATHER], [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Zürich"}, "c1")]},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"temp_c\": 18, \"sky\": \"clear\"}"},
        {"role": "assistant", "content": "It is 18 °C and clear."}]),
    ("system, parallel calls with text, two results", [WEATHER, TIME], [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather and time in Oslo?"},
        {"role": "assistant", "content": "Checking both.",
         "tool_calls": [call("get_weather", {"city": "Oslo"}), call("get_time", {})]},
        {"role": "tool", "content": "{\"temp_c\": -3}"},
        {"role": "tool", "content": "14:05"},
        {"role": "assistant", "content": "-3 °C at 14:05."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome."}]),
]

REASONING = [
    ("reasoning field; the earlier turn's reasoning is dropped", [], [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two plus two."},
        {"role": "user", "content": "Times 3?"},
        {"role": "assistant", "content": "12", "reasoning_content": "\nFour times three is twelve.\n"}]),
    ("inline think, a last turn without reasoning gets an empty block", [], [
        {"role": "system", "content": "Think first."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "<think>\nRecall.\n</think>\n\nParis."},
        {"role": "user", "content": "And Italy?"},
        {"role": "assistant", "content": "Rome."}]),
    ("tool loop after the last query keeps every turn's reasoning", [WEATHER], [
        {"role": "user", "content": "Old question"},
        {"role": "assistant", "content": "Old answer", "reasoning_content": "dropped"},
        {"role": "user", "content": "Weather in Lima?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
         "tool_calls": [call("get_weather", {"city": "Lima"})]},
        {"role": "tool", "content": "{\"temp_c\": 21}"},
        {"role": "assistant", "content": "21 °C.", "reasoning_content": "Report it."}]),
]


def render(template: str, messages: list[dict], tools: list[dict]) -> str:
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template(template).render(messages=messages, tools=tools or None,
                                                    add_generation_prompt=False)


def as_record(messages: list[dict], tools: list[dict]) -> dict:
    """The conversation as an OpenAI-shaped input record: arguments stored as JSON strings."""
    msgs = copy.deepcopy(messages)
    for m in msgs:
        for c in m.get("tool_calls", []):
            c["function"]["arguments"] = json.dumps(c["function"]["arguments"])
    return {"messages": msgs, "tools": tools}


def packtool_ids(template: str, tokenizer: str, record: dict) -> list[int]:
    ctx = EncodeContext(load_tokenizer(tokenizer), get_template(template), get_family("qwen2.5-vl"), Path("."))
    sample = parse_record(record, "conv.jsonl", 0)
    assert not isinstance(sample, Rejected), sample
    rows, rejected = encode_samples([sample], ctx)
    assert rejected == []
    return rows[0]["input_ids"].tolist()


def whole_string_ids(tokenizer: str, text: str) -> list[int]:
    return load_tokenizer(tokenizer)._enc.encode(text, allowed_special="all")


@pytest.mark.parametrize("label,tools,messages", CONVERSATIONS, ids=[c[0] for c in CONVERSATIONS])
def test_chatml_tools_equal_qwen25_published_template(label, tools, messages):
    text = render(QWEN25_TEMPLATE, messages, tools)
    assert "<tool_response>" in text and "# Tools" in text
    ids = packtool_ids("chatml", "qwen2", as_record(messages, tools))
    assert load_tokenizer("qwen2").decode(ids) == text
    assert ids == whole_string_ids("qwen2", text)


@pytest.mark.parametrize("label,tools,messages", CONVERSATIONS + REASONING, ids=[c[0] for c in CONVERSATIONS + REASONING])
def test_qwen3_vl_tools_and_reasoning_equal_qwen3_published_template(label, tools, messages):
    if not any(m.get("reasoning_content") or "</think>" in m.get("content", "") for m in messages):
        # Qwen3's hybrid template gives the last turn an empty think block; qwen3-vl renders a
        # conversation without reasoning as Qwen3-VL-Instruct does (none), so add one here
        messages = [*messages[:-1], {**messages[-1], "reasoning_content": "Done."}]
    text = render(QWEN3_TEMPLATE, messages, tools)
    ids = packtool_ids("qwen3-vl", "qwen3", as_record(messages, tools))
    assert load_tokenizer("qwen3").decode(ids) == text
    assert ids == whole_string_ids("qwen3", text)


def test_the_crosscheck_can_fail():
    """A template that writes the tool calls differently (compact JSON) gives different ids."""
    label, tools, messages = CONVERSATIONS[0]
    wrong = QWEN25_TEMPLATE.replace("tool_call.arguments | tojson", "tool_call.arguments | tojson(separators=(',', ':'))")
    text = render(wrong, messages, tools)
    assert packtool_ids("chatml", "qwen2", as_record(messages, tools)) != whole_string_ids("qwen2", text)


SCREENSHOT = {"type": "function", "function": {"name": "screenshot", "description": "Capture the screen.",
                                               "parameters": {"type": "object", "properties": {}}}}
IMAGE_PART = {"type": "image"}

VISION = [
    ("image question, tool call, answer", [WEATHER], [
        {"role": "user", "content": [IMAGE_PART, {"type": "text", "text": "Weather where this photo was taken?"}]},
        {"role": "assistant", "content": "It looks like Oslo.",
         "tool_calls": [call("get_weather", {"city": "Oslo"})]},
        {"role": "tool", "content": "{\"temp_c\": -3}"},
        {"role": "assistant", "content": "-3 °C in Oslo."}]),
    ("a tool result holding an image", [SCREENSHOT], [
        {"role": "system", "content": "You operate a phone."},
        {"role": "user", "content": "Open settings."},
        {"role": "assistant", "content": "", "tool_calls": [call("screenshot", {})]},
        {"role": "tool", "content": [IMAGE_PART, {"type": "text", "text": "home screen"}]},
        {"role": "assistant", "content": "Tap the gear icon."}]),
    ("no tools, system turn", [], [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": [{"type": "text", "text": "What is it?"}, IMAGE_PART]},
        {"role": "assistant", "content": "A square."}]),
]


@pytest.fixture(scope="module")
def image_root(tmp_path_factory) -> Path:
    from PIL import Image

    root = tmp_path_factory.mktemp("images")
    Image.new("RGB", (96, 64), (200, 40, 40)).save(root / "img.png")
    return root


def test_the_embedded_qwen3_vl_template_is_the_published_one():
    data = QWEN3_VL_TEMPLATE.encode()
    assert len(data) == 5292
    assert hashlib.sha256(data).hexdigest() == "3636d0f0bd6bef02654cdffdc447b79cb2cef8ab02cc75267345946291a489e4"


@pytest.mark.parametrize("label,tools,messages", CONVERSATIONS + VISION, ids=[c[0] for c in CONVERSATIONS + VISION])
def test_qwen3_vl_equals_qwen3_vl_instruct_published_template(label, tools, messages, image_root):
    n_images = sum(1 for m in messages if isinstance(m["content"], list) for p in m["content"] if p is IMAGE_PART)
    record = {**as_record(messages, tools), "images": ["img.png"] * n_images}
    ctx = EncodeContext(load_tokenizer("qwen3"), get_template("qwen3-vl"), get_family("qwen3-vl"), image_root)
    [row], [] = encode_samples([parse_record(record, "conv.jsonl", 0)], ctx)
    n_pad = {m["n_tokens"] for m in row["media"]}
    assert len(row["media"]) == n_images and len(n_pad) <= 1
    text = render(QWEN3_VL_TEMPLATE, messages, tools)
    text = text.replace("<|image_pad|>", "<|image_pad|>" * (n_pad.pop() if n_pad else 1))
    assert row["input_ids"].tolist() == whole_string_ids("qwen3", text)
