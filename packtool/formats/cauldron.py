"""The Cauldron (``HuggingFaceM4/the_cauldron``) and the datasets written like it:
``{"images": [...], "texts": [{"user", "assistant", "source"}, ...]}``.

Each ``texts`` entry is one exchange: its ``user`` text becomes a user turn and its
``assistant`` text the assistant turn that answers it, in order. ``source`` names the
sub-dataset the exchange came from; it is no part of the conversation and is not stored.

The Cauldron writes no ``<image>`` tags: a row's images go, in order, at the start of its
first user turn, where the readers written for it put them (torchtune's
``TheCauldronToMessages``, nanoVLM's ``VQADataset``), as packtool does with untagged ``llava``
and ``swift`` records. A text that does carry ``<image>`` tags places the images there
instead, one tag per image, as in ``llava``. ``images`` may be empty or null: the row is text only. A row
written with ``image`` (one or a list) or with ``video`` / ``videos`` beside its ``texts``
has those read as every other format reads them, not dropped.

In Parquet, ``images`` is the list of ``{bytes, path}`` structs that ``datasets`` writes for
a ``Sequence(Image)`` feature; a JSON or JSONL copy may hold paths under ``--media-root``,
data URIs, or such structs with base64 bytes.

    {"images": ["charts/17.png"],
     "texts": [{"user": "Which year is highest?", "assistant": "2019.", "source": "chartqa"},
               {"user": "By how much?", "assistant": "12 points.", "source": "chartqa"}]}
"""

from __future__ import annotations

from ..errors import SampleError, quoted
from ..records import Sample
from .common import build_sample, check_text, media_refs, sample_id_of, system_of

__all__ = ["parse", "parse_turns", "is_exchange"]

#: The two texts of one ``texts`` entry, in the order their turns take.
ROLES = ("user", "assistant")


def is_exchange(entry) -> bool:
    """Whether ``entry`` is written as a Cauldron ``texts`` entry: an object holding a ``user``
    or an ``assistant`` text (a null one counts as absent, as in a Parquet struct).

    Example:
        >>> is_exchange({"user": "Colour?", "assistant": "Red.", "source": "vqav2"}), is_exchange({"text": "A cat."})
        (True, False)
    """
    return isinstance(entry, dict) and any(entry.get(key) is not None for key in ROLES)


def parse_turns(texts) -> list[tuple[str, str]]:
    """``[{"user": q, "assistant": a}, ...]`` → ``[("user", q), ("assistant", a), ...]``.

    Example:
        >>> parse_turns([{"user": "Colour?", "assistant": "Red.", "source": "vqav2"},
        ...              {"user": "Shape?", "assistant": "Round.", "source": "vqav2"}])
        [('user', 'Colour?'), ('assistant', 'Red.'), ('user', 'Shape?'), ('assistant', 'Round.')]

    Raises:
        SampleError: ``bad_record`` (``texts`` is not a list, an entry is not an object or lacks
            a text, a text is not a string), ``empty_conversation`` (no entries), ``bad_encoding``.
    """
    if texts is None:
        raise SampleError("bad_record", "record has no 'texts' list of {user, assistant} turns")
    if not isinstance(texts, list):
        raise SampleError("bad_record", f"'texts' must be a list of {{user, assistant}} turns, got "
                                        f"{type(texts).__name__} {quoted(texts, 40)}")
    if not texts:
        raise SampleError("empty_conversation", "'texts' is empty")
    turns = []
    for i, entry in enumerate(texts):
        if not isinstance(entry, dict):
            raise SampleError("bad_record", f"texts[{i}] is a {type(entry).__name__}, not an object with 'user' "
                                            "and 'assistant' texts")
        for role in ROLES:
            text = entry.get(role)
            if text is None and role in entry:  # a Parquet struct's null field
                raise SampleError("bad_record", f"texts[{i}] {role!r} is null; every entry needs a 'user' and an "
                                                "'assistant' text")
            if text is None:
                keys = ", ".join(repr(str(k)[:40]) for k in sorted(map(str, entry))[:6]) or "none"
                raise SampleError("bad_record", f"texts[{i}] has no {role!r} text (its keys: {keys}); write every "
                                                "entry as {\"user\": ..., \"assistant\": ...}")
            turns.append((role, check_text(text, f"texts[{i}] {role!r}")))
    return turns


def parse(record: dict, source: str, row: int) -> Sample:
    """A Cauldron record as a single-branch sample: its images at the start of the first user
    turn, unless ``<image>`` / ``<video>`` tags place them (then one tag per item)."""
    turns = parse_turns(record.get("texts"))
    images, videos = media_refs(record, ("images", "image"), ("videos", "video"))
    return build_sample(turns, images, videos, sample_id_of(record, source, row), source, row,
                        system=system_of(record))
