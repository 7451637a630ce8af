"""Chat templates: exact token ids of a two-turn conversation with one image, per template.

Each golden was checked by decoding it to the rendered chat string (shown next to it)
and comparing that string with the model's published chat format; the ids are then
pinned. Special-token ids always come from the tokenizer: the embedded Qwen2 vocabulary
for the ChatML family, a small real ``tokenizer.json`` built here for ``llama3``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from packtool.errors import ConfigError
from packtool.records import MediaRef, Message, Part, Sample
from packtool.rows import EncodeContext, encode_samples
from packtool.templates import TEMPLATES, get_template
from packtool.tokenization import load_tokenizer
from packtool.vision import get_family

IM_START, IM_END, NL, V_START, V_END, PAD = 151644, 151645, 198, 151652, 151653, 151655
USER, ASSISTANT = [872, 198], [77091, 198]
WHAT_IS_IT, A_CAT, COLOUR, RED = [3838, 374, 432, 30], [32, 8251, 13], [33281, 30], [6033, 13]
SYSTEM = [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198]  # "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
IMAGE = [V_START, PAD, PAD, PAD, PAD, V_END]  # a 56x56 image is 4 tokens in Qwen2.5-VL

CHATML_BODY = (
    [IM_START, *USER, *IMAGE, *WHAT_IS_IT, IM_END, NL, IM_START, *ASSISTANT, *A_CAT, IM_END, NL,
     IM_START, *USER, *COLOUR, IM_END, NL, IM_START, *ASSISTANT, *RED, IM_END, NL]
)

GOLDEN = {
    # <|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>
    # <|image_pad|>x4<|vision_end|>What is it?<|im_end|>\n<|im_start|>assistant\nA cat.<|im_end|>\n
    # <|im_start|>user\nColour?<|im_end|>\n<|im_start|>assistant\nRed.<|im_end|>\n
    "chatml": [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198, 151644, 872, 198, 151652,
               151655, 151655, 151655, 151655, 151653, 3838, 374, 432, 30, 151645, 198, 151644, 77091, 198, 32,
               8251, 13, 151645, 198, 151644, 872, 198, 33281, 30, 151645, 198, 151644, 77091, 198, 6033, 13,
               151645, 198],
    # as chatml without the default system turn
    "qwen3-vl": [151644, 872, 198, 151652, 151655, 151655, 151655, 151655, 151653, 3838, 374, 432, 30, 151645,
                 198, 151644, 77091, 198, 32, 8251, 13, 151645, 198, 151644, 872, 198, 33281, 30, 151645, 198,
                 151644, 77091, 198, 6033, 13, 151645, 198],
    # <|im_end|> (Molmo2's BOS) then as qwen3-vl
    "molmo2": [151645, 151644, 872, 198, 151652, 151655, 151655, 151655, 151655, 151653, 3838, 374, 432, 30,
               151645, 198, 151644, 77091, 198, 32, 8251, 13, 151645, 198, 151644, 872, 198, 33281, 30, 151645,
               198, 151644, 77091, 198, 6033, 13, 151645, 198],
    # <|vision_start|><|image_pad|>x4<|vision_end|>A cat.\nRed.\n: LLaVA's preprocess_plain keeps a user
    # turn's image and drops its text (the prompt is replaced by the image token)
    "plain": [151652, 151655, 151655, 151655, 151655, 151653, 32, 8251, 624, 6033, 624],
    # <|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n<|image_pad|>x3What is it?<|eot_id|>
    # <|start_header_id|>assistant<|end_header_id|>\n\nA cat.<|eot_id|><|start_header_id|>user
    # <|end_header_id|>\n\nColour?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nRed.<|eot_id|>
    # (byte-level tiny vocabulary: one id per byte, specials from 256)
    "llama3": [256, 257, 84, 82, 68, 81, 258, 198, 198, 260, 260, 260, 54, 71, 64, 83, 220, 72, 82, 220, 72, 83,
               30, 259, 257, 64, 82, 82, 72, 82, 83, 64, 77, 83, 258, 198, 198, 32, 220, 66, 64, 83, 13, 259, 257,
               84, 82, 68, 81, 258, 198, 198, 34, 78, 75, 78, 84, 81, 30, 259, 257, 64, 82, 82, 72, 82, 83, 64,
               77, 83, 258, 198, 198, 49, 68, 67, 13, 259],
}

# what carries loss, decoded: assistant content + end of turn; the newline only in plain
LOSS_TEXT = {
    "chatml": "A cat.<|im_end|>Red.<|im_end|>",
    "qwen3-vl": "A cat.<|im_end|>Red.<|im_end|>",
    "molmo2": "A cat.<|im_end|>Red.<|im_end|>",
    "plain": "A cat.\nRed.\n",
    "llama3": "A cat.<|eot_id|>Red.<|eot_id|>",
}


def byte_level_tokenizer(directory: Path, specials: list[str]) -> Path:
    """A real tokenizer.json: one id per byte (no merges), then the given special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory


LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|image_pad|>"]


@pytest.fixture(scope="module")
def media_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("media")
    Image.new("RGB", (56, 56), (10, 20, 30)).save(root / "img.png")
    byte_level_tokenizer(root / "tiny-llama3", LLAMA3_SPECIALS)
    return root


def two_turns(*turns: Message) -> Sample:
    u = Message("user", (Part.media("image", 0), Part.of_text("What is it?")))
    base = (u, Message("assistant", (Part.of_text("A cat."),)), Message("user", (Part.of_text("Colour?"),)),
            Message("assistant", (Part.of_text("Red."),)))
    return Sample("s", "src", 0, (MediaRef("image", "img.png"),), (turns or base,))


def encode(template: str, media_root: Path, sample: Sample, system_prompt=None):
    tok = load_tokenizer(str(media_root / "tiny-llama3")) if template == "llama3" else load_tokenizer(None)
    family = get_family("fixed:3" if template == "llama3" else "qwen2.5-vl")
    ctx = EncodeContext(tok, get_template(template), family, media_root, system_prompt)
    rows, rejected = encode_samples([sample], ctx)
    return tok, rows, rejected


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_ids_and_loss(name, media_root):
    tok, [row], _ = encode(name, media_root, two_turns())
    ids, tgt = row["input_ids"].tolist(), row["target_ids"].tolist()
    assert ids == GOLDEN[name]
    lossy = [ids[t + 1] for t in range(len(ids) - 1) if tgt[t] != -100]
    assert tok.decode(lossy) == LOSS_TEXT[name]
    assert tgt[-1] == -100
    assert row["position_ids"].tolist() == list(range(len(ids)))
    assert set(row["subsegment_ids"].tolist()) == {10000}
    pad = tok.special_id("<|image_pad|>")
    [m] = row["media"]
    assert ids[m["token_offset"]: m["token_offset"] + m["n_tokens"]] == [pad] * m["n_tokens"]


def test_chatml_matches_parts():
    assert GOLDEN["chatml"] == SYSTEM + CHATML_BODY and GOLDEN["qwen3-vl"] == CHATML_BODY
    assert GOLDEN["molmo2"] == [IM_END] + CHATML_BODY


def test_trailing_newline_rule_per_template():
    """The newline after an assistant's end of turn carries loss only where it is the end of turn."""
    assert {n: t.loss_on_turn_newline for n, t in TEMPLATES.items()} == {
        "chatml": False, "qwen3-vl": False, "llama3": False, "molmo2": False, "plain": True}
    assert TEMPLATES["llama3"].turn_newline == ""


def test_default_system_prompts(media_root):
    assert {n: t.default_system for n, t in TEMPLATES.items()} == {
        "chatml": "You are a helpful assistant.", "qwen3-vl": "", "llama3": "", "molmo2": "", "plain": ""}
    tok, [row], _ = encode("chatml", media_root, two_turns(), system_prompt="")
    assert row["input_ids"].tolist() == CHATML_BODY
    tok, [row], _ = encode("qwen3-vl", media_root, two_turns(), system_prompt="Be terse.")
    assert tok.decode(row["input_ids"][:8].tolist()) == "<|im_start|>system\nBe terse.<|im_end|>\n"


def test_plain_keeps_no_system_text(media_root):
    """LLaVA's ``preprocess_plain`` renders the image and the answer, nothing else: a system turn
    (a record's own, or its top-level ``system``) was glued before the image as untagged text
    (``Be brief.<image>A cat.``), as was ``--system-prompt``, which plain now refuses."""
    from packtool import TokenizeConfig

    u1, a1, u2, a2 = two_turns().branches[0]
    system = Message("system", (Part.of_text("Be brief."),))
    _, [row], _ = encode("plain", media_root, two_turns(system, u1, a1, u2, a2))
    assert row["input_ids"].tolist() == GOLDEN["plain"]
    _, [row], _ = encode("plain", media_root, two_turns(), system_prompt="Be brief.")
    assert row["input_ids"].tolist() == GOLDEN["plain"]
    with pytest.raises(ConfigError, match="--system-prompt has no place in --template plain"):
        TokenizeConfig(template="plain", system_prompt="Be brief.")
    assert TokenizeConfig(template="plain", system_prompt="").system_prompt == ""


def test_molmo2_moves_media_to_the_first_user_turn(media_root):
    late = two_turns(Message("user", (Part.of_text("Look:"),)), Message("assistant", (Part.of_text("Ok."),)),
                     Message("user", (Part.media("image", 0), Part.of_text("What is it?"))),
                     Message("assistant", (Part.of_text("A cat."),)))
    tok, [row], _ = encode("molmo2", media_root, late)
    assert tok.decode(row["input_ids"][:10].tolist()).startswith("<|im_end|><|im_start|>user\n<|vision_start|>")


def test_assistant_first_is_rejected_where_the_template_forbids_it(media_root):
    first = two_turns(Message("assistant", (Part.of_text("Hello."),)),
                      Message("user", (Part.media("image", 0), Part.of_text("Hi"))),
                      Message("assistant", (Part.of_text("A cat."),)))
    for name in ("chatml", "qwen3-vl", "llama3", "molmo2"):
        _, rows, [rej] = encode(name, media_root, first)
        assert rows == [] and rej.reason == "bad_turn_order"
    _, [row], [] = encode("plain", media_root, first)  # plain allows captions before prompts
    assert np.count_nonzero(row["target_ids"] != -100) > 0


def test_no_assistant_turn_is_no_loss(media_root):
    _, [], [rej] = encode("chatml", media_root, two_turns(Message("user", (Part.media("image", 0),))))
    assert rej.reason == "no_loss"


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_an_assistant_turn_marked_loss_false_is_context_only(name, media_root):
    """ms-swift's per-message ``"loss": false``: the turn is rendered as it is, with no loss on
    any of its tokens (its end of turn included); the tokens are those of the default render. A
    conversation whose every assistant turn is so marked has nothing to learn: ``no_loss``.
    The context turn ends in whitespace, which ``llama3`` trims (the trimmed turn once lost its
    mark there, and was trained on)."""
    u1, a1, u2, a2 = two_turns().branches[0]
    a1 = Message("assistant", (Part.of_text("A cat.\n"),))
    base = two_turns(u1, a1, u2, a2)
    tok, [plain_row], _ = encode(name, media_root, base)
    _, [row], _ = encode(name, media_root, two_turns(u1, Message("assistant", a1.parts, loss=False), u2, a2))
    ids, tgt = row["input_ids"].tolist(), row["target_ids"].tolist()
    assert ids == plain_row["input_ids"].tolist()
    lossy = tok.decode([ids[t + 1] for t in range(len(ids) - 1) if tgt[t] != -100])
    assert "A cat." not in lossy and lossy.startswith("Red.") and lossy
    _, [], [rej] = encode(name, media_root, two_turns(u1, Message("assistant", a1.parts, loss=False)))
    assert rej.reason == "no_loss" and '"loss": false' in rej.message


def test_special_tokens_absent_from_the_vocabulary_name_the_template(media_root):
    tok = load_tokenizer(None)
    ctx = EncodeContext(tok, get_template("llama3"), get_family("qwen2.5-vl"), media_root)
    with pytest.raises(ConfigError, match="<\\|begin_of_text\\|>"):
        encode_samples([two_turns()], ctx)


def _random_conversation(rng) -> tuple[Message, ...]:
    """A short conversation, often well-formed, sometimes not (wrong order, odd roles, reasoning,
    tool turns), with text and media parts."""
    texts = ["", "Hi.", "What is it?", "A cat.\n", "<think>\nhm\n</think>\n\nYes.", "</", "think>", "\n"]
    roles = ["user", "assistant", "user", "assistant", "system", "tool", "narrator"]
    msgs = []
    for _ in range(rng.randint(1, 6)):
        role = rng.choice(roles[:4] if rng.random() < 0.7 else roles)
        parts = []
        for _ in range(rng.randint(0, 3)):
            if rng.random() < 0.2:
                parts.append(Part.media(rng.choice(["image", "video"]), rng.randint(0, 2)))
            else:
                parts.append(Part.of_text(rng.choice(texts)))
        extra = rng.random()
        msgs.append(Message(role, tuple(parts), reasoning="why" if role == "assistant" and extra < 0.05 else None,
                            tool_call_id="c1" if role == "tool" and extra < 0.5 else None,
                            loss=False if role == "assistant" and 0.05 <= extra < 0.12 else None))
    return tuple(msgs)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_one_pass_render_matches_the_general_path(name):
    """Every conversation the one-pass render accepts gives the general path's segments; what it
    declines, the general path renders or rejects as before (seeded; the seed is printed)."""
    import random

    from packtool.errors import SampleError

    template = TEMPLATES[name]
    seed = 1600 + sorted(TEMPLATES).index(name)
    rng = random.Random(seed)
    taken = 0
    for case in range(600):
        msgs = _random_conversation(rng)
        system = rng.choice([None, "", "Be brief."])
        try:
            want = template._render_general(msgs, system, (), True)
        except SampleError as err:
            want = err.reason
        fast = template._render_plain(msgs, system)
        if fast is not None:
            taken += 1
            assert fast == want, f"seed {seed}, case {case}: {msgs!r}"
        try:
            got = template.render(msgs, system)
        except SampleError as err:
            got = err.reason
        assert got == want, f"seed {seed}, case {case}: {msgs!r}"
    # molmo2 moves media: always the general path
    assert (taken == 0) if template.hoist_media else (taken > 50), f"seed {seed}: the one-pass render took {taken} of 600"


#: Meta-Llama-3-8B-Instruct's ``chat_template`` (tokenizer_config.json), word for word.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def test_llama3_trims_each_turn_as_the_published_template(media_root):
    """Llama 3's template writes ``message['content'] | trim``: whitespace at a turn's edges is dropped
    (it was kept, and trained on, before). Checked against the published template, seeded."""
    import random

    from tokenizers import Tokenizer
    from transformers.utils.chat_template_utils import _compile_jinja_template

    rng = random.Random(1700)
    pieces = ["", " ", "\n", "\n\n", "\t", " Hi", "Hi ", "A cat.", "a\n b", "  \n"]
    tok = load_tokenizer(str(media_root / "tiny-llama3"))
    ctx = EncodeContext(tok, get_template("llama3"), get_family("fixed:3"), media_root)
    compiled = _compile_jinja_template(LLAMA3_TEMPLATE)
    whole = Tokenizer.from_file(str(media_root / "tiny-llama3" / "tokenizer.json"))  # parses the template's specials
    for case in range(40):
        roles = (["system"] if rng.random() < 0.5 else []) + ["user", "assistant"] * rng.randint(1, 2)
        turns = [(role, "".join(rng.choice(pieces) for _ in range(3)) or "x") for role in roles]
        sample = Sample("s", "src", 0, (), (tuple(Message(r, (Part.of_text(t),)) for r, t in turns),))
        [row], [] = encode_samples([sample], ctx)
        text = compiled.render(messages=[{"role": r, "content": t} for r, t in turns], bos_token="<|begin_of_text|>",
                               add_generation_prompt=False)
        assert row["input_ids"].tolist() == whole.encode(text, add_special_tokens=False).ids, f"case {case}: {turns!r}"
    # media are not whitespace: only the text outside them is trimmed
    img = Message("user", (Part.of_text(" \n"), Part.media("image", 0), Part.of_text(" What is it? \n")))
    _, [row], _ = encode("llama3", media_root, two_turns(img, Message("assistant", (Part.of_text("\nA cat.\n"),))))
    assert tok.decode(row["input_ids"].tolist()) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n<|image_pad|><|image_pad|><|image_pad|> What is "
        "it?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nA cat.<|eot_id|>")
