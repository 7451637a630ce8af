"""Tool use and reasoning: golden ids per template, from every input shape, with exact loss.

Worked examples, derived by hand from the published chat templates (Qwen2.5's tool
template for ``chatml``, Qwen3's for ``qwen3-vl``; both are embedded and run through
transformers in ``test_tool_templates_crosscheck.py``). Each golden below is the rendered
string spelled out, then its ids in the real Qwen2 vocabulary (``qwen3`` adds
``<tool_response>`` 151665, ``</tool_response>`` 151666, ``<think>`` 151667, ``</think>``
151668). The image is 56x56 px: 4 ``<|image_pad|>`` under the ``qwen2.5-vl`` family, used
for both templates (the template is what is under test).

Tool conversation (``get_weather`` schema ``{"name": "get_weather", "parameters": {"type":
"object"}}``)::

    chatml:   <|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\\n\\n
    qwen3-vl: <|im_start|>system\\n
              # Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are
              provided with function signatures within <tools></tools> XML tags:\\n<tools>\\n{"name":
              "get_weather", "parameters": {"type": "object"}}\\n</tools>\\n\\nFor each function call, return
              a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n
              <tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n
              <|im_start|>user\\n<|vision_start|><|image_pad|>x4<|vision_end|>Weather here?<|im_end|>\\n
              <|im_start|>assistant\\n<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\\n
              </tool_call><|im_end|>\\n
              <|im_start|>user\\n<tool_response>\\n-3\\n</tool_response><|im_end|>\\n
              <|im_start|>assistant\\nCold.<|im_end|>\\n

Loss: the call (``<tool_call>`` .. ``</tool_call>``), the answer, and each assistant
``<|im_end|>``; never the system turn, the tool result or any newline after ``<|im_end|>``.

Reasoning conversation (``qwen3-vl``)::

    <|im_start|>user\\n2+2?<|im_end|>\\n<|im_start|>assistant\\n4<|im_end|>\\n
    <|im_start|>user\\nTimes 3?<|im_end|>\\n<|im_start|>assistant\\n<think>\\nMultiply.\\n</think>\\n\\n12<|im_end|>\\n

The first turn's reasoning ("Add.") is dropped, as Qwen3's template drops reasoning before
the last user query. Loss: ``4<|im_end|>`` and ``<think>\\nMultiply.\\n</think>\\n\\n12<|im_end|>``;
with ``reasoning_loss=False`` the ``<think>…</think>\\n\\n`` span carries none.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from packtool.formats import Rejected, iter_samples, parse_record
from packtool.rows import EncodeContext, encode_samples
from packtool.runs import read_expanded
from packtool.templates import get_template
from packtool.tokenization import load_tokenizer
from packtool.vision import get_family

IM_START, IM_END, NL, V_START, V_END, PAD = 151644, 151645, 198, 151652, 151653, 151655
TOOL_CALL, END_TOOL_CALL = 151657, 151658  # <tool_call>, </tool_call>: in Qwen2.5's vocabulary too
TOOL_RESPONSE, END_TOOL_RESPONSE, THINK, END_THINK = 151665, 151666, 151667, 151668  # Qwen3's additions
SYSTEM, USER, ASSISTANT = [8948, 198], [872, 198], [77091, 198]  # "system\n", "user\n", "assistant\n"
IMAGE = [V_START, PAD, PAD, PAD, PAD, V_END]

# "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n"
QWEN25_TOOLS_SYSTEM = [2610, 525, 1207, 16948, 11, 3465, 553, 54364, 14817, 13, 1446, 525, 264, 10950, 17847, 382]
# "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function
# signatures within <tools></tools> XML tags:\n<tools>\n{"name": "get_weather", "parameters": {"type": "object"}}
# \n</tools>\n\nFor each function call, return a json object with function name and arguments within "
TOOLS_1 = [2, 13852, 271, 2610, 1231, 1618, 825, 476, 803, 5746, 311, 7789, 448, 279, 1196, 3239, 382, 2610, 525,
           3897, 448, 729, 32628, 2878, 366, 15918, 1472, 15918, 29, 11874, 9492, 510, 27, 15918, 397, 4913, 606, 788,
           330, 455, 69364, 497, 330, 13786, 788, 5212, 1313, 788, 330, 1700, 95642, 522, 15918, 1339, 2461, 1817, 729,
           1618, 11, 470, 264, 2951, 1633, 448, 729, 829, 323, 5977, 2878, 220]
TOOLS_2 = [11874, 9492, 510]  # " XML tags:\n"
# '\n{"name": <function-name>, "arguments": <args-json-object>}\n'
TOOLS_3 = [198, 4913, 606, 788, 366, 1688, 11494, 8066, 330, 16370, 788, 366, 2116, 56080, 40432, 31296]
TOOLS_BLOCK = [*TOOLS_1, TOOL_CALL, END_TOOL_CALL, *TOOLS_2, TOOL_CALL, *TOOLS_3, END_TOOL_CALL]
WEATHER_HERE = [28981, 1588, 30]  # "Weather here?"
CALL_OSLO = [198, 4913, 606, 788, 330, 455, 69364, 497, 330, 16370, 788, 5212, 8926, 788, 330, 28867, 385, 95642]
# '\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
COLD = [76418, 13]  # "Cold."

TOOL_TAIL_CHATML = [
    IM_START, *USER, *IMAGE, *WEATHER_HERE, IM_END, NL,
    IM_START, *ASSISTANT, TOOL_CALL, *CALL_OSLO, END_TOOL_CALL, IM_END, NL,
    # "user\n<tool_response>\n-3\n</tool_response>": plain text in Qwen2.5's vocabulary
    IM_START, 872, 198, 27, 14172, 9655, 397, 12, 18, 198, 522, 14172, 9655, 29, IM_END, NL,
    IM_START, *ASSISTANT, *COLD, IM_END, NL,
]
TOOL_TAIL_QWEN3 = [
    IM_START, *USER, *IMAGE, *WEATHER_HERE, IM_END, NL,
    IM_START, *ASSISTANT, TOOL_CALL, *CALL_OSLO, END_TOOL_CALL, IM_END, NL,
    IM_START, *USER, TOOL_RESPONSE, NL, 12, 18, NL, END_TOOL_RESPONSE, IM_END, NL,  # "-3" is [12, 18]
    IM_START, *ASSISTANT, *COLD, IM_END, NL,
]
GOLDEN_TOOLS = {
    "chatml": [IM_START, *SYSTEM, *QWEN25_TOOLS_SYSTEM, *TOOLS_BLOCK, IM_END, NL, *TOOL_TAIL_CHATML],
    "qwen3-vl": [IM_START, *SYSTEM, *TOOLS_BLOCK, IM_END, NL, *TOOL_TAIL_QWEN3],
}
RENDERED_TOOL_TAIL = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|image_pad|><|image_pad|><|image_pad|><|vision_end|>"
    "Weather here?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
    "{\"city\": \"Oslo\"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n-3\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\nCold.<|im_end|>\n"
)
TOOLS_TEXT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>\n{\"name\": \"get_weather\", \"parameters\": {\"type\": "
    "\"object\"}}\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
    "</tool_call><|im_end|>\n"
)
RENDERED_TOOLS = {
    "chatml": "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n"
              + TOOLS_TEXT + RENDERED_TOOL_TAIL,
    "qwen3-vl": "<|im_start|>system\n" + TOOLS_TEXT + RENDERED_TOOL_TAIL,
}
TOOL_LOSS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>Cold.<|im_end|>'

GOLDEN_REASONING = [
    IM_START, *USER, 17, 10, 17, 30, IM_END, NL,  # "2+2?"
    IM_START, *ASSISTANT, 19, IM_END, NL,  # "4"
    IM_START, *USER, 18889, 220, 18, 30, IM_END, NL,  # "Times 3?"
    IM_START, *ASSISTANT, THINK, 198, 95155, 624, END_THINK, 271, 16, 17, IM_END, NL,  # <think>"\nMultiply.\n"</think>"\n\n""12"
]
RENDERED_REASONING = ("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\n"
                      "Times 3?<|im_end|>\n<|im_start|>assistant\n<think>\nMultiply.\n</think>\n\n12<|im_end|>\n")
REASONING_LOSS = {True: "4<|im_end|><think>\nMultiply.\n</think>\n\n12<|im_end|>", False: "4<|im_end|>12<|im_end|>"}

SCHEMA = {"name": "get_weather", "parameters": {"type": "object"}}


def tool_records() -> dict[str, dict]:
    """The tool conversation in every input shape packtool reads."""
    openai_calls = [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]
    return {
        # OpenAI chat format: arguments a JSON string, results by tool_call_id, tools a list
        "openai": {"messages": [{"role": "user", "content": "<image>Weather here?"},
                                {"role": "assistant", "content": None, "tool_calls": openai_calls},
                                {"role": "tool", "tool_call_id": "call_1", "content": "-3"},
                                {"role": "assistant", "content": "Cold."}],
                   "images": ["img.png"], "tools": [SCHEMA]},
        # the same with typed content parts, arguments as an object and tools as a JSON string
        "openai-parts": {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Weather here?"}]},
                                      {"role": "assistant", "content": "", "tool_calls": [
                                          {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                                      {"role": "tool", "name": "get_weather", "content": "-3"},
                                      {"role": "assistant", "content": [{"type": "text", "text": "Cold."}]}],
                         "images": ["img.png"], "tools": json.dumps([SCHEMA])},
        # LLaMA-Factory ShareGPT: function_call / observation, tools a JSON string column
        "sharegpt": {"conversations": [{"from": "human", "value": "<image>Weather here?"},
                                       {"from": "function_call", "value": "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}"},
                                       {"from": "observation", "value": "-3"},
                                       {"from": "gpt", "value": "Cold."}],
                     "images": ["img.png"], "tools": json.dumps([SCHEMA])},
        # ms-swift: tool_call / tool_response roles
        "swift": {"messages": [{"role": "user", "content": "<image>Weather here?"},
                               {"role": "tool_call", "content": "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}"},
                               {"role": "tool_response", "content": "-3"},
                               {"role": "assistant", "content": "Cold."}],
                  "images": ["img.png"], "tools": json.dumps([SCHEMA])},
    }


def reasoning_records() -> dict[str, dict]:
    return {
        "openai-reasoning_content": {"messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Add."},
            {"role": "user", "content": "Times 3?"},
            {"role": "assistant", "content": "12", "reasoning_content": "Multiply."}]},
        "swift-inline-think": {"messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nAdd.\n</think>\n\n4"},
            {"role": "user", "content": "Times 3?"},
            {"role": "assistant", "content": "<think>\nMultiply.\n</think>\n\n12"}]},
        "sharegpt-inline-think": {"conversations": [
            {"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "<think>Add.</think>4"},
            {"from": "human", "value": "Times 3?"}, {"from": "gpt", "value": "<think>\nMultiply.\n</think>\n\n12"}],
            "system": None, "tools": None},
        "sharegpt-reasoning_content": {"conversations": [
            {"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4", "reasoning_content": "Add."},
            {"from": "human", "value": "Times 3?"}, {"from": "gpt", "value": "12", "reasoning_content": "Multiply."}],
            "tools": "[]"},
    }


@pytest.fixture(scope="module")
def media_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("media")
    Image.new("RGB", (56, 56), (10, 20, 30)).save(root / "img.png")
    return root


def encode(template: str, media_root: Path, record: dict, tokenizer: str | None = None, reasoning_loss: bool = True,
           fmt: str = "auto"):
    tok = load_tokenizer(tokenizer or ("qwen3" if template == "qwen3-vl" else None))
    ctx = EncodeContext(tok, get_template(template), get_family("qwen2.5-vl"), media_root, reasoning_loss=reasoning_loss)
    sample = parse_record(record, "data.jsonl", 0, fmt)
    if isinstance(sample, Rejected):
        return tok, [], [sample]
    rows, rejected = encode_samples([sample], ctx)
    return tok, rows, rejected


def lossy_text(tok, row) -> str:
    ids, tgt = row["input_ids"].tolist(), row["target_ids"].tolist()
    return tok.decode([ids[t + 1] for t in range(len(ids) - 1) if tgt[t] != -100])


def test_goldens_decode_to_the_rendered_strings():
    """The hand-derived ids spell exactly the rendered chat (the derivation above)."""
    assert load_tokenizer("qwen2").decode(GOLDEN_TOOLS["chatml"]) == RENDERED_TOOLS["chatml"]
    assert load_tokenizer("qwen3").decode(GOLDEN_TOOLS["qwen3-vl"]) == RENDERED_TOOLS["qwen3-vl"]
    assert load_tokenizer("qwen3").decode(GOLDEN_REASONING) == RENDERED_REASONING


@pytest.mark.parametrize("shape", sorted(tool_records()))
@pytest.mark.parametrize("template", sorted(GOLDEN_TOOLS))
def test_every_tool_shape_gives_the_golden_ids_and_loss(template, shape, media_root):
    tok, [row], rejected = encode(template, media_root, tool_records()[shape])
    assert rejected == []
    assert row["input_ids"].tolist() == GOLDEN_TOOLS[template]
    assert lossy_text(tok, row) == TOOL_LOSS
    [m] = row["media"]
    assert row["input_ids"][m["token_offset"]: m["token_offset"] + m["n_tokens"]].tolist() == [PAD] * 4


def test_parquet_sharegpt_tools_give_the_golden_ids(media_root, tmp_path):
    """A Hugging Face Parquet file (tools a string column, images as structs) reads like its JSON twin."""
    rec = tool_records()["sharegpt"]
    buf = io.BytesIO()
    Image.new("RGB", (56, 56), (10, 20, 30)).save(buf, format="PNG")
    table = pa.Table.from_pylist([{**rec, "images": [{"bytes": buf.getvalue(), "path": "img.png"}]}])
    pq.write_table(table, tmp_path / "train-00000-of-00001.parquet")
    [sample] = list(iter_samples([tmp_path / "train-00000-of-00001.parquet"]))
    ctx = EncodeContext(load_tokenizer(None), get_template("chatml"), get_family("qwen2.5-vl"), media_root)
    [row], [] = encode_samples([sample], ctx)
    assert row["input_ids"].tolist() == GOLDEN_TOOLS["chatml"]


@pytest.mark.parametrize("shape", sorted(reasoning_records()))
@pytest.mark.parametrize("reasoning_loss", [True, False])
def test_every_reasoning_shape_gives_the_golden_ids_and_loss(shape, reasoning_loss, media_root):
    tok, [row], rejected = encode("qwen3-vl", media_root, reasoning_records()[shape], reasoning_loss=reasoning_loss)
    assert rejected == []
    assert row["input_ids"].tolist() == GOLDEN_REASONING
    assert lossy_text(tok, row) == REASONING_LOSS[reasoning_loss]


def test_conversations_without_reasoning_keep_the_instruct_rendering(media_root):
    """No reasoning anywhere: no think block (Qwen3-VL-Instruct), exactly as before this feature."""
    rec = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    tok, [row], _ = encode("qwen3-vl", media_root, rec)
    assert row["input_ids"].tolist() == [IM_START, *USER, 17, 10, 17, 30, IM_END, NL, IM_START, *ASSISTANT, 19, IM_END, NL]


def test_qwen3_vl_needs_the_qwen3_vocabulary_for_its_tags(media_root):
    from packtool.errors import ConfigError

    with pytest.raises(ConfigError, match="--tokenizer qwen3"):
        encode("qwen3-vl", media_root, tool_records()["openai"], tokenizer="qwen2")


def test_chatml_keeps_inline_think_as_text_and_refuses_a_reasoning_field(media_root):
    """Qwen2.5's template has no reasoning rule: <think> text is ordinary answer text there."""
    inline = reasoning_records()["swift-inline-think"]
    tok, [row], _ = encode("chatml", media_root, inline)
    assert lossy_text(tok, row) == "<think>\nAdd.\n</think>\n\n4<|im_end|><think>\nMultiply.\n</think>\n\n12<|im_end|>"
    _, [], [rej] = encode("chatml", media_root, reasoning_records()["openai-reasoning_content"])
    assert rej.reason == "reasoning_unsupported"


@pytest.mark.parametrize("template", ["chatml", "qwen3-vl", "molmo2", "plain"])
def test_an_empty_reasoning_field_is_no_reasoning(template, media_root):
    """``"reasoning_content": ""`` (an OpenAI-style export of answers that had none) is no
    reasoning: the ids of the same record without the field. It was reasoning under every
    template: ``reasoning_unsupported`` but under ``qwen3-vl``, which opened the thinking template
    for it (an empty think block in the last turn)."""
    turns = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    plain = {"messages": turns}
    empty = {"messages": [turns[0], {**turns[1], "reasoning_content": ""}]}
    _, want, none = encode(template, media_root, plain)
    _, got, rejected = encode(template, media_root, empty)
    assert (rejected, none) == ([], [])
    assert [r["input_ids"].tolist() for r in got] == [r["input_ids"].tolist() for r in want]
    assert [r["target_ids"].tolist() for r in got] == [r["target_ids"].tolist() for r in want]


@pytest.mark.parametrize("template", ["llama3", "molmo2", "plain"])
def test_templates_without_a_tool_format_reject_tool_samples(template, media_root):
    for shape, rec in tool_records().items():
        _, rows, [rej] = encode(template, media_root, rec)
        assert rows == [] and rej.reason == "tools_unsupported", shape
        assert template in rej.message
    _, [], [rej] = encode(template, media_root, reasoning_records()["openai-reasoning_content"])
    assert rej.reason == "reasoning_unsupported"


def with_messages(**changes) -> dict:
    rec = tool_records()["openai"]
    return {**rec, **changes}


MALFORMED = {
    "arguments not JSON": ("bad_tool_arguments", with_messages(messages=[
        {"role": "user", "content": "<image>Weather here?"},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": "{city: Oslo}"}}]},
        {"role": "tool", "content": "-3"}, {"role": "assistant", "content": "Cold."}])),
    "arguments a JSON list": ("bad_tool_arguments", with_messages(messages=[
        {"role": "user", "content": "<image>Weather here?"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "get_weather", "arguments": "[1, 2]"}}]},
        {"role": "tool", "content": "-3"}, {"role": "assistant", "content": "Cold."}])),
    "call without a name": ("bad_tool_call", with_messages(messages=[
        {"role": "user", "content": "<image>Weather here?"},
        {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
        {"role": "tool", "content": "-3"}, {"role": "assistant", "content": "Cold."}])),
    "sharegpt function_call not JSON": ("bad_tool_call", {
        "conversations": [{"from": "human", "value": "Weather?"}, {"from": "function_call", "value": "get_weather(Oslo)"},
                          {"from": "observation", "value": "-3"}, {"from": "gpt", "value": "Cold."}],
        "tools": json.dumps([SCHEMA])}),
    "result with no call": ("orphan_tool_result", {"messages": [
        {"role": "user", "content": "Weather?"}, {"role": "tool", "content": "-3"}, {"role": "assistant", "content": "Cold."}]}),
    "more results than calls": ("orphan_tool_result", {"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "tool_call", "content": "{\"name\": \"get_weather\", \"arguments\": {}}"},
        {"role": "tool_response", "content": "-3"}, {"role": "tool_response", "content": "-4"},
        {"role": "assistant", "content": "Cold."}]}),
    "result answers another call id": ("orphan_tool_result", {"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "get_weather", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "b", "content": "-3"}, {"role": "assistant", "content": "Cold."}]}),
    "tools not JSON": ("bad_tools", with_messages(tools="get_weather(city)")),
    "tools an object": ("bad_tools", with_messages(tools=SCHEMA)),
    "tool schema without a name": ("bad_tools", with_messages(tools=[{"description": "weather"}])),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_tool_use_is_a_row_error_with_its_reason(case, media_root):
    reason, rec = MALFORMED[case]
    for template in ("chatml", "qwen3-vl"):
        _, rows, [rej] = encode(template, media_root, rec)
        assert rows == [] and rej.reason == reason, (template, rej.message)


def test_tokenize_cli_records_the_flag_and_writes_golden_rows_and_reasons(media_root, tmp_path):
    """End to end: a mixed JSONL through ``packtool tokenize``; good rows match the goldens with the
    loss the flag asks for, bad rows land in errors.jsonl with their reasons, the manifest records
    ``reasoning_loss`` and the qwen3 vocabulary (qwen3-vl's default), and ``inspect`` reads the rows back."""
    import numpy as np
    from clirun import packtool

    rows = [{"id": "tools", **tool_records()["openai"]},
            {"id": "think", **reasoning_records()["openai-reasoning_content"]},
            {"id": "bad-args", **MALFORMED["arguments not JSON"][1]},
            {"id": "orphan", **MALFORMED["result with no call"][1]}]
    src = tmp_path / "tool_use.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = tmp_path / "tok"
    r = packtool("tokenize", src, "--media-root", media_root, "-o", out,
                 "--template", "qwen3-vl", "--no-reasoning-loss", "--quiet", "--json")  # qwen3: the template's default
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert (summary["samples"], summary["rejected"]) == (2, 2)
    assert summary["rejected_by_reason"] == {"bad_tool_arguments": 1, "orphan_tool_result": 1}
    manifest = json.loads((out / ".packtool" / "manifest.json").read_text())
    assert manifest["config"]["reasoning_loss"] is False and manifest["tokenizer"]["name"] == "qwen3"
    errors = [json.loads(line) for line in (out / ".packtool" / "errors.jsonl").read_text().splitlines()]
    assert {(e["sample_id"], e["reason"]) for e in errors} == {("bad-args", "bad_tool_arguments"),
                                                                ("orphan", "orphan_tool_result")}
    table = pa.concat_tables([read_expanded(f) for f in sorted(out.glob("part-*.parquet"))]).to_pylist()
    got = {row["sample_id"]: row for row in table}
    assert got["tools"]["input_ids"] == GOLDEN_TOOLS["qwen3-vl"]
    assert got["think"]["input_ids"] == GOLDEN_REASONING
    tok = load_tokenizer("qwen3")
    for sid, want in (("tools", TOOL_LOSS), ("think", REASONING_LOSS[False])):
        row = {k: np.asarray(got[sid][k]) for k in ("input_ids", "target_ids")}
        assert lossy_text(tok, row) == want
    r = packtool("inspect", out, "--sample", "think", "--json")
    assert r.returncode == 0, r.stderr
    assert "Multiply." in r.stdout


def test_llamafactory_thought_before_a_function_call_is_that_turns_reasoning(media_root):
    """LLaMA-Factory writes a thinking model's thought before the call JSON ("thought words"), ms-swift
    as an assistant turn before its tool_call turns; under qwen3-vl both render exactly as the
    OpenAI shape with reasoning_content."""
    thought = {"conversations": [
        {"from": "human", "value": "Weather in Oslo?"},
        {"from": "function_call", "value": "<think>\nNeed the tool.\n</think>\n\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}"},
        {"from": "observation", "value": "-3"},
        {"from": "gpt", "value": "<think>\nReport.\n</think>\n\nCold."}], "tools": json.dumps([SCHEMA])}
    openai = {"messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "-3"},
        {"role": "assistant", "content": "Cold.", "reasoning_content": "Report."}], "tools": [SCHEMA]}
    # ms-swift's multimodal tool-use example: an assistant turn holding only the thought, then tool_call
    swift = {"messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "<think>\nNeed the tool.\n</think>\n"},
        {"role": "tool_call", "content": "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}"},
        {"role": "tool_response", "content": "-3"},
        {"role": "assistant", "content": "<think>\nReport.\n</think>\n\nCold."}], "tools": json.dumps([SCHEMA])}
    tok, [a], _ = encode("qwen3-vl", media_root, thought)
    _, [b], _ = encode("qwen3-vl", media_root, openai)
    _, [c], _ = encode("qwen3-vl", media_root, swift)
    for row in (a, c):
        assert row["input_ids"].tolist() == b["input_ids"].tolist()
        assert row["target_ids"].tolist() == b["target_ids"].tolist()
    assert tok.decode(a["input_ids"].tolist()).endswith(
        "<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", "
        "\"arguments\": {\"city\": \"Oslo\"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n-3\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\nReport.\n</think>\n\nCold.<|im_end|>\n")


def test_group_by_media_keeps_samples_with_different_tools_apart(media_root):
    """Two records on one image but offering different tools render different system turns: two trees."""
    from packtool.rows import group_by_media

    other = {**tool_records()["openai"], "tools": [{"name": "get_time", "parameters": {}}]}
    samples = [parse_record(tool_records()["openai"], "a.jsonl", 0), parse_record(other, "a.jsonl", 1),
               parse_record(tool_records()["swift"], "a.jsonl", 2)]
    merged = list(group_by_media(samples, media_root))
    assert [len(s.branches) for s in merged] == [2, 1]  # the swift twin offers the same tools as row 0


def test_a_sharegpt_tool_record_with_no_other_sharegpt_key_reads_the_same(media_root):
    """``--format auto`` reads bare ``conversations`` as LLaVA; its tool turns still parse (no tools block)."""
    rec = {k: v for k, v in tool_records()["sharegpt"].items() if k not in ("tools", "images")}
    rec["conversations"] = [{**t, "value": t["value"].replace("<image>", "")} for t in rec["conversations"]]
    tok, [row], [] = encode("chatml", media_root, rec)
    text = tok.decode(row["input_ids"].tolist())
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")  # no tools: the VL default
    assert lossy_text(tok, row) == TOOL_LOSS


def _marked_by_search(markers: tuple[str, ...], text: str) -> list[tuple[str, str]]:
    """The tag split as it was first written: every tag looked for again after each one found."""
    out, pos = [], 0
    while True:
        hits = [(text.find(tag, pos), tag) for tag in markers if text.find(tag, pos) >= 0]
        if not hits:
            break
        at, tag = min(hits)
        if at > pos:
            out.append(("text", text[pos:at]))
        out.append(("special", tag))
        pos = at + len(tag)
    if pos < len(text):
        out.append(("text", text[pos:]))
    return out


@pytest.mark.parametrize("name", ["chatml", "qwen3-vl"])
def test_tags_in_template_text_split_in_one_pass_as_before(name):
    """The tool block's text is split at the template's tags with one pattern, not a search per
    tag after each tag found (quadratic: 12 s for a schema description holding 40,000 ``<think>``):
    the same segments on seeded random texts made of tags, their fragments and other characters;
    a text of 200,000 tags is split whole."""
    import random

    template = get_template(name)
    markers = template.markers
    pieces = [*markers, "<", ">", "/", "tool", "_call", "think", "x", " ", "\n", "<tool_call><tool_call>"]
    for seed in range(400):
        rng = random.Random(seed)
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 40)))
        got = [(kind, value) for kind, value, _, _ in template._marked(text, False)]
        assert got == _marked_by_search(markers, text), f"seed {seed}: {text!r}"
    many = "<tool_call>" * 200_000
    assert len(template._marked(many, False)) == 200_000
