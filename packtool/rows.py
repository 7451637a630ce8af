"""Samples become tokenized rows: template → segments → token ids → tree layout (DESIGN.md §3.2).

Layout of one tokenized row (a message tree with branches ``b = 0..B-1``)::

    input_ids      [ shared prefix (p tokens) | rest of branch 0 | rest of branch 1 | ... ]
    position_ids   [ 0 .. p-1                 | p .. p+r0-1      | p .. p+r1-1      | ... ]
    subsegment_ids [ 10000 ...                | 0 ...            | 1 ...            | ... ]

The prefix is the longest token prefix all branches share, cut back so that (a) the
token right after it carries no loss in any branch (the last prefix position can only
predict one next token) and so (b) every media span lies inside it (the vision encoder
runs once). A single-branch sample is all prefix. ``target_ids`` are pre-shifted inside
each branch: ``target[t]`` is the branch's token ``t+1`` when that token carries loss,
else ``-100``; the last token of every branch predicts nothing.

A sample's branches may become **several trees on the same media** (never dropped):

* branches whose media sit at different token positions (records merged by
  ``--group-by-media`` that place the image differently) cannot share one prefix, so
  each placement gets its own tree;
* ``--max-branches`` caps branches per tree (10,000 at most whatever it says: a branch's
  subsegment id must stay below the prefix's ``PREFIX_SUBSEGMENT``), and ``--max-tokens`` caps a tree's tokens
  (prefix once plus every branch's rest): branches are taken in order and a new tree is
  started when the next branch would break either cap. A single branch longer than
  ``--max-tokens`` still becomes a tree of its own; the packer's ``--oversize`` policy
  decides its fate.

The extra trees are counted (``counts["split_extra_trees"]``) and named
``<sample_id>#1``, ``#2``, ...

A tokenize task stores each name once (:class:`SampleNames`): a row whose name an earlier row of
the task holds (a record repeating an id, a record whose own id is ``a#1`` after the split tree
``a#1``, or a split tree named like an earlier record) is stored as ``<name>#d1`` (``#d2``, ... for
further repeats; the first free one), and its split trees follow its new name (``x#d1#1``).

A branch that lies wholly inside its tree's shared prefix (a repeat of another branch when the
tree holds nothing else, or a conversation that is a prefix of every other branch of the tree)
has no tokens of its own: its tokens are the prefix's, stored and trained once, as any turn the
branches share is, and it gets no subsegment. It is counted, not silently lost:
``counts["folded_branches"]``, while ``counts["branches"]`` counts the branches rows store
(their ``n_branches``), so the two add up to the conversations encoded.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pyarrow as pa

from . import runs
from .config import INT32_MAX
from .errors import SampleError
from .formats import Rejected
from .media import MediaPathResolver, probe_image, recorded_media_path, resolve_media_path
from .records import MediaRef, Sample
from .schema import PREFIX_SUBSEGMENT, TOKENIZED
from .templates import Template
from .tokenization import Tokenizer
from .vision import VisionFamily, VisionLayout

__all__ = ["EncodeContext", "SampleNames", "encode_samples", "encode_stored", "group_by_media", "shifted_targets",
           "IGNORE"]

IGNORE = -100
#: Probe results kept per process; cleared when full (bounds memory on huge corpora).
_PROBE_CACHE_MAX = 100_000


@dataclass(frozen=True, slots=True)
class EncodeContext:
    """Everything :func:`encode_samples` needs besides the samples.

    Attributes:
        max_branches: most branches in one tree (``None``, or above 10,000: 10,000).
        max_tokens: most tokens in one tree (``None``: no cap); branches beyond it go
            to another tree on the same media.
        probe_cache: media probes by path (or inline bytes), shared across batches and the
            tasks of one run in a process; media files are assumed not to change during a run
            (:meth:`start_run` empties it for the next one).
        reasoning_loss: whether reasoning the template keeps (``<think>…</think>``) carries loss.
    """

    tokenizer: Tokenizer
    template: Template
    family: VisionFamily
    media_root: Path
    system_prompt: str | None = None
    max_branches: int | None = None
    max_tokens: int | None = None
    reasoning_loss: bool = True
    probe_cache: dict = field(default_factory=dict, compare=False, repr=False)
    #: the local media root's resolver (:class:`media.MediaPathResolver`: each directory's real
    #: path found once, not each component of each file's path); ``None`` for a bucket
    paths: MediaPathResolver | None = field(default=None, init=False, compare=False, repr=False)
    #: the run whose probes the caches hold (:meth:`start_run`)
    run: str = field(default="", init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.media_root, Path):
            object.__setattr__(self, "paths", MediaPathResolver(self.media_root))

    def start_run(self, run: str) -> None:
        """Begin a task of run ``run``: the probes and resolved folders of another run are
        dropped. A process keeps this context from run to run (a notebook, a library caller,
        a pool's worker), and the files may have changed between them: an image put in place
        after a run rejected it as missing, a folder link replaced by a copy, a file of
        another size (whose stale probe would count its tokens wrong)."""
        if run != self.run:
            self.probe_cache.clear()
            if self.paths is not None:
                object.__setattr__(self, "paths", MediaPathResolver(self.media_root))
            object.__setattr__(self, "run", run)


class SampleNames:
    """The names a tokenize task has stored, so that no two of its rows share one.

    Users trace a training sequence back to its record by the names in ``sample_ids``, so a
    name means one row. :meth:`take` gives a name back as asked when no earlier row holds it,
    else the first free ``<name>#dK`` (``K`` from 1). The later row yields: a row already
    written keeps its name. ``renamed`` counts the rows that got a derived name.

    Example:
        >>> names = SampleNames()
        >>> [names.take(n) for n in ["a", "a#1", "a", "a#d2", "a"]], names.renamed
        (['a', 'a#1', 'a#d1', 'a#d2', 'a#d3'], 2)
    """

    __slots__ = ("taken", "renamed", "_next")

    def __init__(self) -> None:
        self.taken: set[str] = set()
        self.renamed = 0
        self._next: dict[str, int] = {}  # the first suffix number not yet tried, by name

    def take(self, name: str) -> str:
        """``name`` when it is free, else the first free ``name#dK``; either way it is taken."""
        if name not in self.taken:
            self.taken.add(name)
            return name
        k = self._next.get(name, 1)
        while f"{name}#d{k}" in self.taken:
            k += 1
        self._next[name] = k + 1
        derived = f"{name}#d{k}"
        self.taken.add(derived)
        self.renamed += 1
        return derived


@dataclass(frozen=True, slots=True)
class _Probed:
    ref: MediaRef
    width: int
    height: int
    layout: VisionLayout
    stat: tuple[int, int] | None = None  # (size_bytes, mtime_ns) of the file counted; None: inline bytes
    #: a video's (fps, n_frames) as its frame sampler read them (``VideoMeta``); None for images
    source: tuple[float, int] | None = None
    #: the layout as segments for :func:`_stage_into` (``("pad", name, n, False)`` for placeholder runs)
    segments: tuple = field(init=False, repr=False, compare=False)
    #: the fields of its ``media`` entry but ``token_offset`` and ``n_tokens``, in schema order (:data:`_MEDIA_STATIC`)
    static: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "segments", tuple((kind, value, n, False) for kind, value, n in self.layout.segments))
        lay = self.layout
        object.__setattr__(self, "static", (
            lay.kind, self.ref.path, self.width, self.height, lay.resized[1], lay.resized[0], *lay.grid, lay.units,
            list(lay.timestamps) if lay.kind == "video" else None,
            self.source[0] if self.source else None, self.source[1] if self.source else None, self.ref.data,
            self.stat[0] if self.stat else None, self.stat[1] if self.stat else None))


def _probe_uncached(ref: MediaRef, ctx: EncodeContext, n_images: int) -> tuple:
    """``(ref, width, height, layout, stat, source)`` of one media item (see :class:`_Probed`);
    ``ref`` names the file relative to the media root (:func:`recorded_media_path`)."""
    if ref.kind not in ("image", "video"):
        raise SampleError("bad_record", f"unknown media kind {ref.kind!r}")
    if ref.data is None and not ref.path:
        raise SampleError("missing_media", "neither a path nor inline bytes given")
    # what was counted: pack checks the file is still this one before it embeds or references it
    stat = None
    if ref.data is not None:
        src = ref.data
    else:
        if ctx.paths is not None:  # a local root: one lstat for a regular file, no realpath of each component
            src, st = ctx.paths.with_stat(ref.path)
        else:
            src = resolve_media_path(ref.path, ctx.media_root)
            st = src.stat()
        stat = (st.st_size, st.st_mtime_ns)
        # an absolute path would tie the rows to where the media are today: pack and the reader
        # could not be given another root once they move
        recorded = recorded_media_path(ref.path, src, ctx.media_root)
        if recorded != ref.path:
            ref = MediaRef(ref.kind, recorded, None)
    try:
        if ref.kind == "image":
            info = probe_image(src, exif=ctx.family.exif)
            return ref, info.width, info.height, ctx.family.image_in_sample(info.height, info.width, n_images), stat, None
        from .media import probe_video

        meta = probe_video(src, apply_rotation=ctx.family.exif == "apply")
        # the rate and count the sampler read: with the sampled frames they give the sampled rate a
        # processor derives the video's time step from (Qwen2.5-VL's second_per_grid_ts)
        return ref, meta.width, meta.height, ctx.family.video(meta), stat, (float(meta.fps), int(meta.n_frames))
    except SampleError as err:
        if ref.data is not None:  # named by its place in the sample, which the cache key leaves out (_probe_all)
            raise
        # the error row names its record; this names which of the record's files failed, by the
        # path it records (relative to the root, as written when it was relative)
        shown = ref.path if len(ref.path) <= 200 else f"{ref.path[:200]}..."
        raise SampleError(err.reason, f"{ref.kind} {shown!r}: {err.message}") from None


def _probe(ref: MediaRef, ctx: EncodeContext, n_images: int = 1) -> _Probed:
    """Probe one media item, memoized per path (or per inline bytes) for the whole run.

    Corpora reference the same image from many records; a header read costs far more
    than the rest of a sample's encoding, so each distinct file is probed once.
    Failures are memoized too, so a missing file costs one ``stat``. ``n_images`` is
    the number of images in the sample, which some families' image layouts depend on
    (:meth:`VisionFamily.image_in_sample`); it joins the key only for those families.
    """
    cache = ctx.probe_cache
    key = (ref.kind, ref.path, None) if ref.data is None else (ref.kind, None, ref.data)
    if ref.kind == "image":
        count_key = ctx.family.image_count_key(n_images)
        if count_key is not None:
            key = (*key, count_key)
    hit = cache.get(key)
    if hit is None:
        try:
            hit = _Probed(*_probe_uncached(ref, ctx, n_images))
        except SampleError as err:
            hit = err
        if len(cache) >= _PROBE_CACHE_MAX:
            cache.clear()
        cache[key] = hit
    if isinstance(hit, SampleError):
        raise SampleError(hit.reason, hit.message)
    if ref.data is not None and hit.ref is not ref:
        # inline bytes are keyed by the bytes alone; the entry names this sample's path
        return _Probed(ref, hit.width, hit.height, hit.layout, hit.stat, hit.source)
    return hit  # a path's entry is the same for every sample (nothing changes a _Probed)


def _probe_all(media: tuple[MediaRef, ...], ctx: EncodeContext) -> list[_Probed]:
    """:func:`_probe` of each of a sample's media items. An item without a path (inline bytes)
    that fails is named in the error by its place among the sample's items of its kind
    (``image 2 of 3 (inline bytes): ...``); a file is named by its path where it failed."""
    n_images = sum(ref.kind == "image" for ref in media)
    probed = []
    for i, ref in enumerate(media):
        try:
            probed.append(_probe(ref, ctx, n_images))
        except SampleError as err:
            if ref.data is None and ref.path:
                raise
            k = sum(r.kind == ref.kind for r in media[:i + 1])
            n = sum(r.kind == ref.kind for r in media)
            label = f"{ref.kind} {k} of {n}" + (" (inline bytes)" if ref.data is not None else "")
            raise SampleError(err.reason, f"{label}: {err.message}") from None
    return probed


class _Specials(dict):
    """Special-token ids by name, looked up in the tokenizer once (a plain dict lookup after)."""

    def __init__(self, tok: Tokenizer) -> None:
        super().__init__()
        self._tok = tok

    def __missing__(self, name: str) -> int:
        tid = self[name] = self._tok.special_id(name)
        return tid


# piece kinds in a staged batch
_TEXT, _TOKEN, _PAD = 0, 1, 2


class _Pieces:
    """The token-level pieces of a whole batch, as flat lists (one entry a piece).

    ``kind``: ``_TEXT`` (``value``: the index of its string in ``texts``; its length is
    known once the batch is encoded), ``_TOKEN`` or ``_PAD`` (``value`` a token id);
    ``loss``. A token piece stands for one token; ``repeats`` holds ``(piece, count,
    media)`` of every pad run (``media`` the item's index) and of any token piece of
    another count: few entries, so the common piece costs three appends, not five.
    """

    __slots__ = ("kind", "value", "loss", "repeats", "texts")

    def __init__(self) -> None:
        self.kind: list[int] = []
        self.value: list[int] = []
        self.loss: list[bool] = []
        self.repeats: list[tuple[int, int, int]] = []
        self.texts: list[str] = []

    def __len__(self) -> int:
        return len(self.kind)

    def rollback(self, n: int) -> None:
        """Drop the pieces from ``n`` on (a rejected sample's)."""
        del self.kind[n:], self.value[n:], self.loss[n:]
        repeats = self.repeats
        while repeats and repeats[-1][0] >= n:
            repeats.pop()


def _stage(segments, probed: list[_Probed], specials: _Specials, out: _Pieces, used: set[int]) -> tuple[int, int]:
    """Append one branch's rendered segments to ``out`` as token-level pieces; returns the
    branch's piece range.

    Media segments are replaced by their family layout. Adjacent text with equal loss is
    merged so it is encoded as one string, as a tokenizer applied to the rendered chat
    would see it.
    """
    first = len(out.kind)
    _stage_into(segments, probed, specials, out, used, None)
    return first, len(out.kind)


def _stage_into(segments, probed: list[_Probed], specials: _Specials, out: _Pieces, used: set[int],
                open_loss: bool | None, media: int = -1) -> bool | None:
    """:func:`_stage`'s loop. ``open_loss`` is the loss of the text piece that ends ``out`` and
    that the next text may extend (None: there is none); returns it as the segments leave it.
    A media item's layout comes back in here as segments (:attr:`_Probed.segments`, its
    placeholder runs ``pad``; ``media`` is the item's index), so text in a layout merges like
    any other text. The merge is written inline, one loop: a sample stages some thirty
    segments, and a call per segment was the largest Python cost of encoding.
    """
    kinds, values, losses, repeats, texts = out.kind, out.value, out.loss, out.repeats, out.texts
    for kind, value, count, loss in segments:
        if kind == "text":
            if open_loss == loss:
                texts[-1] += value
                continue
            open_loss = loss
            kinds.append(_TEXT)
            values.append(len(texts))
            texts.append(value)
            losses.append(loss)
        elif kind == "special" or kind == "pad":  # a token, or a run of a media item's placeholder
            open_loss = None
            if kind == "pad":
                repeats.append((len(kinds), count, media))
                kinds.append(_PAD)
            else:
                if count != 1:
                    repeats.append((len(kinds), count, -1))
                kinds.append(_TOKEN)
            values.append(specials[value])
            losses.append(loss)
        elif kind == "media":
            if count >= len(probed) or probed[count].ref.kind != value:
                raise SampleError("placeholder_mismatch", f"placeholder for {value} {count} has no matching media")
            used.add(count)
            open_loss = _stage_into(probed[count].segments, probed, specials, out, used, open_loss, count)
        else:
            raise RuntimeError(f"internal error: unknown segment kind {kind!r}")
    return open_loss


def _stage_samples(samples: list[Sample], ctx: EncodeContext, counts: Counter | None = None
                   ) -> tuple[_Pieces, list, list[Rejected]]:
    """Probe, render and stage a batch: its pieces, ``(sample, probed, branch piece ranges)``
    of each staged sample, and the samples rejected (their pieces rolled back).

    A sample that :func:`group_by_media` merged from several records is staged record by
    record: a record whose own conversation is rejected (say it has no assistant turn) is one
    rejected row and the others stay in the tree, as they would alone; the tree takes the id,
    source and row of its first record kept. When the media themselves fail (a missing image)
    every record is one rejected row with the reason (every input row ends in ``errors.jsonl``
    or a shard). ``counts["merged_records"]``, when given, drops the records no longer folded
    into a kept record."""
    specials = _Specials(ctx.tokenizer)
    staged = []
    rejected: list[Rejected] = []
    pieces = _Pieces()
    for s in samples:
        mark, n_texts = len(pieces), len(pieces.texts)
        folded = s.meta.get("merged_rows", ()) if s.meta else ()
        try:
            probed = _probe_all(s.media, ctx)
            if folded and "merged_branches" in s.meta:
                s, branches = _stage_members(s, probed, ctx, specials, pieces, rejected, counts)
                if branches:
                    _check_int32(pieces, mark, n_texts, probed)
                    staged.append((s, probed, branches))
                continue
            branches = _stage_branches(s, s.branches, probed, ctx, specials, pieces)
            _check_int32(pieces, mark, n_texts, probed)
            staged.append((s, probed, branches))
        except SampleError as err:
            pieces.rollback(mark)
            del pieces.texts[n_texts:]
            rejected.append(Rejected(s.source, s.source_row, s.sample_id, err.reason, err.message))
            for source, row, sid in folded:
                rejected.append(Rejected(source, row, sid, err.reason,
                                         f"{err.message} (in the tree of {s.sample_id!r}: --group-by-media)"))
            if folded and counts is not None:
                counts["merged_records"] -= len(folded)
    return pieces, staged, rejected


def _check_int32(pieces: _Pieces, mark: int, n_texts: int, probed: list[_Probed]) -> None:
    """``oversize`` for a sample whose tokens or vision units a shard's int32 counts cannot hold
    (one ``fixed:N`` item of a huge N, or a few such items together): its pieces from ``mark``
    on and texts from ``n_texts`` on. A text's tokens are bounded by its UTF-8 bytes (a token is
    at least one byte), so nothing needs encoding; the bound errs only for a sample within its
    text's bytes of the limit, which no pack could hold anyway.

    Raises:
        SampleError: ``oversize``, naming the count and the limit.
    """
    units = 0
    for p in probed:
        units += p.layout.units
    tokens = len(pieces.kind) - mark  # one a piece (a text piece's tokens are bounded below) ...
    for at, count, _ in reversed(pieces.repeats):  # ... and a placeholder run (or repeated token) its count
        if at < mark:
            break
        tokens += count - 1
    texts = pieces.texts[n_texts:]
    if units <= INT32_MAX and tokens + 4 * sum(map(len, texts)) <= INT32_MAX:  # 4 bytes a character at most
        return
    tokens += sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    if units <= INT32_MAX and tokens <= INT32_MAX:
        return
    what, n = ("vision units", units) if units > INT32_MAX else ("tokens", tokens)
    counted = " (its text counted at a token a byte)" if what == "tokens" else ""
    raise SampleError("oversize", f"the sample needs {n:,} {what}{counted}, more than a shard's int32 counts hold "
                                  f"({INT32_MAX:,}); no pack could hold it")


def _stage_branches(s: Sample, branches, probed: list[_Probed], ctx: EncodeContext, specials: _Specials,
                    pieces: _Pieces) -> list[tuple[int, int]]:
    """Render and stage ``branches`` (conversations of ``s``: all of them, or one merged
    record's) with :func:`_stage`; each branch's piece range.

    Raises:
        SampleError: ``placeholder_mismatch`` when a media item is placed in none of them.
    """
    used: set[int] = set()
    staged = [_stage(ctx.template.render(messages, ctx.system_prompt, s.tools, ctx.reasoning_loss), probed, specials,
                     pieces, used) for messages in branches]
    if len(used) != len(probed):
        raise SampleError("placeholder_mismatch", f"{len(probed)} media but only {len(used)} placed in the conversation")
    return staged


def _stage_members(s: Sample, probed: list[_Probed], ctx: EncodeContext, specials: _Specials, pieces: _Pieces,
                   rejected: list[Rejected], counts: Counter | None) -> tuple[Sample, list]:
    """Stage a tree :func:`group_by_media` merged, one record at a time (:func:`_stage_samples`):
    the tree of the records kept, and its branch piece ranges (none when every record failed)."""
    members = [(s.source, s.source_row, s.sample_id), *s.meta["merged_rows"]]
    n_branches = s.meta["merged_branches"]
    first = np.concatenate([[0], np.cumsum(n_branches)]).tolist()  # record k's branches: first[k]..first[k + 1]
    kept: list[int] = []
    branches: list[tuple[int, int]] = []
    for k, (source, row, sid) in enumerate(members):
        mark, n_texts = len(pieces), len(pieces.texts)
        try:
            branches.extend(_stage_branches(s, s.branches[first[k]:first[k + 1]], probed, ctx, specials, pieces))
            kept.append(k)
        except SampleError as err:
            pieces.rollback(mark)
            del pieces.texts[n_texts:]
            rejected.append(Rejected(source, row, sid, err.reason, err.message))
    if counts is not None:
        counts["merged_records"] -= len(members) - 1 - max(len(kept) - 1, 0)
    if len(kept) == len(members) or not kept:
        return s, branches
    head = members[kept[0]]
    rest = kept[1:]
    return replace(s, sample_id=head[2], source=head[0], source_row=head[1],
                   branches=tuple(b for k in kept for b in s.branches[first[k]:first[k + 1]]),
                   meta={**s.meta, "merged": tuple(members[k][2] for k in rest),
                         "merged_rows": tuple(members[k] for k in rest),
                         "merged_branches": tuple(n_branches[k] for k in kept)}), branches


def encode_samples(
    samples: list[Sample], ctx: EncodeContext, counts: Counter | None = None, names: SampleNames | None = None
) -> tuple[list[dict], list[Rejected]]:
    """Encode a batch of samples into tokenized rows (dicts matching ``schema.TOKENIZED_ROWS``,
    the expanded form; :func:`encode_stored` gives the same rows as shards store them).

    Texts of the whole batch go to the tokenizer in one batch call, and the batch's token
    ids, loss mask, targets and positions are built as whole arrays (one numpy pass each,
    not a few small ones per sample); a row's arrays are views into them. A sample may give
    several rows (see the module docstring); ``counts``, when given, gains ``trees``
    (rows), ``branches`` (branches over all rows: their ``n_branches``), ``folded_branches``
    (conversations wholly inside their tree's shared prefix, which store no branch of their own)
    and ``split_extra_trees`` (rows beyond one per sample). ``names``, when given, names the
    rows (:class:`SampleNames`: the names of earlier batches of the task are not used again).
    """
    pieces, staged, rejected = _stage_samples(samples, ctx, counts)
    arrays = _PieceArrays(pieces, _encode_texts(pieces, ctx))
    ids, loss, starts = _assemble_batch(arrays)
    rows = []
    single = []  # (row, token range) of one-branch rows: their targets and positions come in bulk
    for s, probed, branches in staged:
        trees = _sample_trees(arrays, ids, loss, branches, ctx, counts)
        for k, tree in enumerate(trees):
            if len(tree) == 1 and len(branches) == 1:
                row = _single_row(s, probed, tree[0])
                single.append((row, starts[branches[0][0]], starts[branches[0][1]]))
            else:
                row = _tree_row(s, probed, tree)
            _count_branches(counts, len(tree), row["n_branches"])
            if names is not None:
                if not k:
                    head = names.take(s.sample_id)
                row["sample_id"] = names.take(f"{head}#{k}") if k else head
            elif k:
                row["sample_id"] = f"{s.sample_id}#{k}"
            rows.append(row)
    if single:
        _fill_single(single, ids, loss)
    return rows, rejected


def _encode_texts(pieces: _Pieces, ctx: EncodeContext) -> list[bytes]:
    return ctx.tokenizer.encode_blobs(pieces.texts) if pieces.texts else []


def _sample_trees(arrays: _PieceArrays, ids: np.ndarray, loss: np.ndarray, branches, ctx: EncodeContext,
                  counts: Counter | None) -> list[list]:
    """A staged sample's branches as ``(ids, loss, spans)`` grouped into trees (:func:`_split_trees`)."""
    starts = arrays.starts
    seqs = [(ids[starts[p0]:starts[p1]], loss[starts[p0]:starts[p1]], _spans(arrays, p0, p1))
            for p0, p1 in branches]
    trees = _split_trees(seqs, ctx.max_branches, ctx.max_tokens)
    if counts is not None:
        counts["trees"] += len(trees)
        counts["split_extra_trees"] += len(trees) - 1
    return trees


def _count_branches(counts: Counter | None, n_seqs: int, n_branches: int) -> None:
    """Count a row of ``n_seqs`` conversations that stores ``n_branches`` branches: the others lie
    wholly inside its shared prefix (folded; see the module docstring)."""
    if counts is not None:
        counts["branches"] += n_branches
        counts["folded_branches"] += n_seqs - n_branches


class _PieceArrays:
    """A staged batch's pieces as numpy arrays, with their texts encoded.

    ``count[k]`` is the tokens piece ``k`` stands for (a text's encoded length), ``starts[k]``
    where they start in the batch's tokens end to end (one entry more than pieces),
    ``pool_text`` every text's tokens end to end, text ``i`` at ``text_off[i]``.
    """

    __slots__ = ("kind", "value", "count", "loss", "media", "is_text", "starts", "pool_text", "text_off")

    def __init__(self, pieces: _Pieces, encoded: list) -> None:
        self.kind = np.array(pieces.kind, dtype=np.int8)
        self.value = np.array(pieces.value, dtype=np.int64)
        self.loss = np.array(pieces.loss, dtype=bool)
        self.is_text = self.kind == _TEXT
        self.count = (~self.is_text).astype(np.int64)  # a token piece: one token; texts below
        self.media = np.full(len(self.kind), -1, dtype=np.int64)
        if pieces.repeats:
            at, n, media = np.array(pieces.repeats, dtype=np.int64).T
            self.count[at] = n
            self.media[at] = media
        # each text's ids as int32 bytes (Tokenizer.encode_blobs): joined in one copy
        text_len = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)) >> 2
        self.text_off = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum(text_len, out=self.text_off[1:])
        self.pool_text = np.frombuffer(b"".join(encoded), dtype="<i4").astype(np.int32, copy=False)
        self.count[self.is_text] = text_len[self.value[self.is_text]]
        self.starts = np.zeros(len(self.kind) + 1, dtype=np.int64)
        np.cumsum(self.count, out=self.starts[1:])


def _assemble_batch(pa_: _PieceArrays) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token ids and loss mask of every piece of the batch, end to end, and where each piece
    starts (``starts[k]``; one entry more than pieces).

    Pad runs are often thousands of identical tokens; texts are short and repeated. Both
    are written by one gather from a pool (the batch's text tokens, then each repeated
    token once): output position ``t`` of piece ``k`` reads ``pool[base[k] + step[k] *
    (t - starts[k])]``, ``step`` 1 for text and 0 for a repeated token.
    """
    n = len(pa_.kind)
    is_text, value, count, starts, pool_text = pa_.is_text, pa_.value, pa_.count, pa_.starts, pa_.pool_text
    rep = np.flatnonzero(~is_text)
    pool = np.concatenate([pool_text, value[rep].astype(np.int32)])
    base = np.empty(n, dtype=np.int64)
    base[is_text] = pa_.text_off[value[is_text]]
    base[rep] = len(pool_text) + np.arange(len(rep))
    step = is_text.astype(np.int64)
    total = int(starts[-1])
    # base[k] + step[k] * (t - starts[k]) = (base[k] - step[k] * starts[k]) + step[k] * t
    idx = np.repeat(base - step * starts[:-1], count)
    idx += np.repeat(step, count) * np.arange(total, dtype=np.int64)
    ids = pool[idx] if total else np.zeros(0, dtype=np.int32)
    loss = np.repeat(pa_.loss, count)
    return ids, loss, starts


def encode_stored(samples: list[Sample], ctx: EncodeContext, counts: Counter | None = None,
                  names: SampleNames | None = None) -> tuple[pa.Table, list[Rejected]]:
    """The rows of :func:`encode_samples` as tokenized shards store them: a table of
    ``schema.TOKENIZED``, token columns in runs form (``packtool.runs``), equal to
    ``compact_table(rows_table(rows, TOKENIZED_ROWS))`` value for value (``names`` as there).

    A one-branch row (most rows) goes from its staged pieces to the runs form without
    being expanded: a placeholder run is one piece already (:func:`_compact_pieces`). A
    message tree is assembled expanded, as in :func:`encode_samples`, and compacted with
    :func:`runs.compact`.
    """
    pieces, staged, rejected = _stage_samples(samples, ctx, counts)
    arrays = _PieceArrays(pieces, _encode_texts(pieces, ctx))
    starts = arrays.starts
    meta: list[list] = []  # [sample_id, sample, probed, media spans, n_tokens, n_branches] of each row
    single_ranges: list[tuple[int, int]] = []
    single_meta: list[list] = []
    tree_rows: list[dict] = []
    from_tree: list[bool] = []
    expanded = None
    for s, probed, branches in staged:
        if len(branches) == 1:
            p0, p1 = branches[0]
            single_ranges.append((p0, p1))
            from_tree.append(False)
            sid = s.sample_id if names is None else names.take(s.sample_id)
            single_meta.append([sid, s, probed, None, int(starts[p1] - starts[p0]), 1])
            meta.append(single_meta[-1])
            if counts is not None:
                counts["trees"] += 1
            _count_branches(counts, 1, 1)
            continue
        if expanded is None:
            expanded = _assemble_batch(arrays)
        ids, loss, _ = expanded
        head = s.sample_id if names is None else names.take(s.sample_id)
        for k, tree in enumerate(_sample_trees(arrays, ids, loss, branches, ctx, counts)):
            row = _tree_row(s, probed, tree)
            _count_branches(counts, len(tree), row["n_branches"])
            tree_rows.append(row)
            from_tree.append(True)
            name = head if not k else f"{head}#{k}" if names is None else names.take(f"{head}#{k}")
            meta.append([name, s, probed, sorted(tree[0][2], key=lambda x: x[1]), row["n_tokens"], row["n_branches"]])
    for m, spans in zip(single_meta, _single_spans(arrays, single_ranges), strict=True):
        m[3] = spans
    c = _compact_pieces(arrays, single_ranges)
    if tree_rows:
        lengths = [r["n_tokens"] for r in tree_rows]
        offsets = np.zeros(len(tree_rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        trees_c = runs.compact({name: np.concatenate([r[name] for r in tree_rows]) for name in runs.TOKEN_COLUMNS},
                               offsets)
        # rows in batch order: the one-branch rows come first in the joined form, then the trees
        is_tree = np.array(from_tree, dtype=bool)
        order = np.empty(len(from_tree), dtype=np.int64)
        order[~is_tree] = np.arange(len(single_ranges))
        order[is_tree] = len(single_ranges) + np.arange(len(tree_rows))
        c = _take_rows(_join(c, trees_c), order)
    return _stored_table(meta, c), rejected


def _excl_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(len(x), dtype=np.int64)
    np.cumsum(x[:-1], out=out[1:])
    return out


def _ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``concatenate([arange(a, b) for a, b in zip(lo, hi)])`` in one pass.

    Example:
        >>> _ranges(np.array([2, 7]), np.array([4, 10])).tolist()
        [2, 3, 7, 8, 9]
    """
    n = hi - lo
    return np.repeat(lo - _excl_cumsum(n), n) + np.arange(int(n.sum()), dtype=np.int64)


def _compact_pieces(arrays: _PieceArrays, ranges: list[tuple[int, int]], min_run: int = runs.MIN_RUN) -> runs.Compact:
    """The runs form of one-branch rows (row ``r`` is pieces ``ranges[r]`` end to end), what
    :func:`runs.compact` gives for the same rows expanded, without expanding them.

    In a one-branch row positions rise by one and the subsegment is constant, so a run is a
    maximal stretch of at least ``min_run`` tokens with equal ``(input_id, target_id)``.
    The row is read as *elements*: one per text token, and for a placeholder or special
    token piece of ``n`` tokens a *body* of ``n - 1`` tokens and a *tail* of one (just the
    tail when ``n`` is 1). Every token of an element has the same target: the id of the
    token after the element when that token carries loss, else -100 (inside a body the next
    token is the piece's own), and -100 for a row's last token. Neighbouring elements with
    equal id and target join into stretches; a stretch of at least ``min_run`` tokens is
    stored as one value and a run. The work is per element, not per token: a 2,691-token
    image costs what two text tokens do.

    Example: the pieces ``"A"`` (loss; one token, id 5), ``<pad>`` x 9 (id 9) and ``<end>``
    (id 3), no loss on either, are the expanded row ``5 9 9 9 9 9 9 9 9 9 3`` with targets
    all -100; elements ``5 | 9 x 8 | 9 | 3`` join to ``5 | 9 x 9 | 3``: stored ``5 9 3``,
    one run at index 1 standing for 9 tokens.
    """
    n_rows = len(ranges)
    lo = np.fromiter((a for a, _ in ranges), dtype=np.int64, count=n_rows)
    hi = np.fromiter((b for _, b in ranges), dtype=np.int64, count=n_rows)
    n_pieces = hi - lo
    if n_rows and lo[0] == 0 and hi[-1] == len(arrays.kind) and np.array_equal(lo[1:], hi[:-1]):
        is_text, count, value, loss = arrays.is_text, arrays.count, arrays.value, arrays.loss
        text_ids = arrays.pool_text  # every text of the batch, in piece order
    else:
        sel = _ranges(lo, hi)
        is_text, count, value, loss = arrays.is_text[sel], arrays.count[sel], arrays.value[sel], arrays.loss[sel]
        tv = value[is_text]  # text indices rise with the pieces: their tokens in piece order
        text_ids = arrays.pool_text[_ranges(arrays.text_off[tv], arrays.text_off[tv + 1])]
    # elements of each piece: a text's tokens; body and tail of a repeated token (none if no tokens)
    n_el = np.where(is_text, count, np.minimum(count, 2))
    el_end = np.cumsum(n_el)
    n = int(el_end[-1]) if len(el_end) else 0
    rep = np.flatnonzero(~is_text & (count > 0))
    at = el_end[rep] - n_el[rep]
    body = count[rep] >= 2
    el_id = np.empty(n, dtype=np.int32)
    el_len = np.ones(n, dtype=np.int64)
    is_rep = np.zeros(n, dtype=bool)
    is_rep[at] = True
    is_rep[at[body] + 1] = True
    el_id[~is_rep] = text_ids
    el_id[at] = value[rep]
    el_id[at[body] + 1] = value[rep[body]]
    el_len[at[body]] = count[rep[body]] - 1
    el_loss = np.repeat(loss, n_el)
    # rows in elements: [row_lo[r], row_lo[r + 1])
    row_lo = np.zeros(n_rows + 1, dtype=np.int64)
    if n:
        piece_end = np.cumsum(n_pieces)
        row_lo[1:] = np.where(piece_end > 0, el_end[np.maximum(piece_end - 1, 0)], 0)
    el_tgt = np.full(n, IGNORE, dtype=np.int32)
    if n > 1:
        el_tgt[:-1] = np.where(el_loss[1:], el_id[1:], IGNORE)
    row_last = row_lo[1:][row_lo[1:] > row_lo[:-1]] - 1
    el_tgt[row_last] = IGNORE
    new = np.ones(n, dtype=bool)
    if n > 1:
        np.not_equal(el_id[1:], el_id[:-1], out=new[1:])
        new[1:] |= el_tgt[1:] != el_tgt[:-1]
        new[row_lo[:-1][row_lo[:-1] < n]] = True  # a row's first element starts a stretch
    first = np.flatnonzero(new)
    if len(first) == n:
        g_len, g_id, g_tgt = el_len, el_id, el_tgt
    else:
        g_len = np.add.reduceat(el_len, first) if n else el_len
        g_id, g_tgt = el_id[first], el_tgt[first]
    n_new = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(new, out=n_new[1:])
    row_g = n_new[row_lo]  # stretches before each row
    is_run = g_len >= min_run
    stored = np.where(is_run, 1, g_len)
    g_at = np.zeros(len(g_len) + 1, dtype=np.int64)  # first stored value of each stretch
    np.cumsum(stored, out=g_at[1:])
    offsets = g_at[row_g]
    g_exp = np.zeros(len(g_len) + 1, dtype=np.int64)  # first token of each stretch, rows end to end
    np.cumsum(g_len, out=g_exp[1:])
    total = int(g_at[-1])
    # the expanded position of stored value i of stretch g is g_exp[g] - g_exp[row start] + (i - g_at[g])
    pos = np.arange(total, dtype=np.int64)
    pos += np.repeat(g_exp[:-1] - g_at[:-1], stored)
    pos -= np.repeat(g_exp[row_g[:-1]], np.diff(offsets))
    runs_at = np.flatnonzero(is_run)
    run_row = np.searchsorted(row_g, runs_at, side="right") - 1
    n_runs = np.zeros(len(g_len) + 1, dtype=np.int64)
    np.cumsum(is_run, out=n_runs[1:])
    return runs.Compact(
        columns={"input_ids": np.repeat(g_id, stored), "target_ids": np.repeat(g_tgt, stored),
                 "position_ids": pos.astype(np.int32), "subsegment_ids": np.full(total, PREFIX_SUBSEGMENT, dtype=np.int32)},
        offsets=offsets,
        run_starts=(g_at[runs_at] - offsets[run_row]).astype(np.int32),
        run_lengths=g_len[runs_at].astype(np.int32),
        run_offsets=n_runs[row_g],
    )


def _join(a: runs.Compact, b: runs.Compact) -> runs.Compact:
    """The rows of ``a`` then those of ``b``, as one batch."""
    return runs.Compact(
        columns={name: np.concatenate([a.columns[name], b.columns[name]]) for name in runs.TOKEN_COLUMNS},
        offsets=np.concatenate([a.offsets, b.offsets[1:] - b.offsets[0] + a.offsets[-1]]),
        run_starts=np.concatenate([a.run_starts, b.run_starts]),
        run_lengths=np.concatenate([a.run_lengths, b.run_lengths]),
        run_offsets=np.concatenate([a.run_offsets, b.run_offsets[1:] - b.run_offsets[0] + a.run_offsets[-1]]),
    )


def _take_rows(c: runs.Compact, order: np.ndarray) -> runs.Compact:
    """The batch with row ``r`` being ``c``'s row ``order[r]`` (run starts are row-relative, unchanged)."""

    def take(offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = offsets[:-1][order], offsets[1:][order]
        out = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(hi - lo, out=out[1:])
        return _ranges(lo, hi), out

    idx, offsets = take(c.offsets)
    run_idx, run_offsets = take(c.run_offsets)
    return runs.Compact(columns={name: col[idx] for name, col in c.columns.items()}, offsets=offsets,
                        run_starts=c.run_starts[run_idx], run_lengths=c.run_lengths[run_idx], run_offsets=run_offsets)


def _single_spans(arrays: _PieceArrays, ranges: list[tuple[int, int]]) -> list[list[tuple[int, int, int]]]:
    """:func:`_spans` of each one-branch row (pieces ``ranges[r]``), for the batch at once."""
    n_rows = len(ranges)
    lo = np.fromiter((a for a, _ in ranges), dtype=np.int64, count=n_rows)
    hi = np.fromiter((b for _, b in ranges), dtype=np.int64, count=n_rows)
    sel = _ranges(lo, hi)
    pad = arrays.kind[sel] == _PAD
    k = sel[pad]
    row = np.repeat(np.arange(n_rows, dtype=np.int64), hi - lo)[pad]
    mi = arrays.media[k]
    # a span is an item's pad pieces from its first to its last (layout markers may lie between)
    new = np.ones(len(k), dtype=bool)
    new[1:] = (row[1:] != row[:-1]) | (mi[1:] != mi[:-1])
    first = np.flatnonzero(new)
    last = np.empty_like(first)
    last[:-1] = first[1:] - 1
    last[-1:] = len(k) - 1
    base = arrays.starts[lo[row[first]]]
    start = arrays.starts[k[first]] - base
    end = arrays.starts[k[last] + 1] - base
    out: list[list] = [[] for _ in range(n_rows)]
    for r, m, a, b in zip(row[first].tolist(), mi[first].tolist(), start.tolist(), end.tolist(), strict=True):
        out[r].append((m, a, b - a))
    return out


#: the ``media`` struct fields a probed item alone decides (:attr:`_Probed.static`), in schema order
_MEDIA_TYPE = TOKENIZED.field("media").type
_MEDIA_FIELDS = [_MEDIA_TYPE.value_type.field(i) for i in range(_MEDIA_TYPE.value_type.num_fields)]
_MEDIA_STATIC = [f.name for f in _MEDIA_FIELDS if f.name not in ("token_offset", "n_tokens")]


def _media_column(meta: list[list]) -> pa.Array:
    """The ``media`` column of rows whose entries are ``(media_index, token_offset, n_tokens)``
    spans (``meta[r][3]``, in token order) of the probed items ``meta[r][2]``; built field by
    field, not from a dict per item."""
    items, offsets, tokens = [], [0], []
    for m in meta:
        probed = m[2]
        for mi, start, n in m[3]:
            items.append(probed[mi].static)
            tokens.append((start, n))
        offsets.append(len(items))
    static = dict(zip(_MEDIA_STATIC, zip(*items, strict=True), strict=True)) if items else dict.fromkeys(_MEDIA_STATIC, ())
    static["token_offset"] = [t[0] for t in tokens]
    static["n_tokens"] = [t[1] for t in tokens]
    struct = pa.StructArray.from_arrays([pa.array(static[f.name], type=f.type) for f in _MEDIA_FIELDS],
                                        fields=_MEDIA_FIELDS)
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), struct, type=_MEDIA_TYPE)


def _stored_table(meta: list[list], c: runs.Compact) -> pa.Table:
    """The ``schema.TOKENIZED`` table of a batch: per-row fields from ``meta``, token columns from ``c``."""
    tokens = runs.compact_arrays(c)
    tokens["media"] = _media_column(meta)
    plain = {
        "sample_id": [m[0] for m in meta],
        "source": [m[1].source for m in meta],
        "source_row": [m[1].source_row for m in meta],
        "n_tokens": [m[4] for m in meta],
        "n_vision_units": [sum(pr.layout.units for pr in m[2]) for m in meta],
        "n_branches": [m[5] for m in meta],
    }
    cols = [tokens[f.name] if f.name in tokens else pa.array(plain[f.name], type=f.type) for f in TOKENIZED]
    return pa.Table.from_arrays(cols, schema=TOKENIZED)


def _spans(arrays: _PieceArrays, p0: int, p1: int) -> list[tuple[int, int, int]]:
    """Media spans ``(media_index, start, n)`` of the branch of pieces ``p0..p1``, from its
    start: one span per item, from its first pad to its last (layouts may put row or frame
    markers between pad runs)."""
    spans: list[tuple[int, int, int]] = []
    starts = arrays.starts
    base = int(starts[p0])
    for k in (np.flatnonzero(arrays.kind[p0:p1] == _PAD) + p0).tolist():
        mi = int(arrays.media[k])
        pos = int(starts[k]) - base
        end = int(starts[k + 1]) - base
        if spans and spans[-1][0] == mi:
            spans[-1] = (mi, spans[-1][1], end - spans[-1][1])
        else:
            spans.append((mi, pos, end - pos))
    return spans


def _single_row(s: Sample, probed: list[_Probed], seq) -> dict:
    """A one-branch sample's row, its targets and positions still to come (:func:`_fill_single`)."""
    ids, _, spans = seq
    return _row(s, probed, spans, ids, None, None, None, 1)


def _row(s: Sample, probed: list[_Probed], spans, input_ids, target_ids, position_ids, subsegment_ids,
         n_branches: int) -> dict:
    """The row dict of ``schema.TOKENIZED``."""
    return {
        "sample_id": s.sample_id,
        "source": s.source,
        "source_row": s.source_row,
        "n_tokens": int(len(input_ids)),
        "n_vision_units": int(sum(pr.layout.units for pr in probed)),
        "n_branches": n_branches,
        "input_ids": input_ids,
        "target_ids": target_ids,
        "position_ids": position_ids,
        "subsegment_ids": subsegment_ids,
        "media": _media_entries(probed, spans),
    }


def _media_entries(probed: list[_Probed], spans) -> list[dict]:
    return [_media_entry(probed[mi], start, n) for mi, start, n in sorted(spans, key=lambda x: x[1])]


def _fill_single(single: list, ids: np.ndarray, loss: np.ndarray) -> None:
    """Targets, positions and subsegments of one-branch rows (all prefix), for the batch at
    once: :func:`shifted_targets` within each row, positions from 0 in each row."""
    lo = np.fromiter((a for _, a, _ in single), dtype=np.int64, count=len(single))
    hi = np.fromiter((b for _, _, b in single), dtype=np.int64, count=len(single))
    tgt = np.full(len(ids), IGNORE, dtype=np.int32)
    if len(ids) > 1:
        tgt[:-1] = np.where(loss[1:], ids[1:], IGNORE)
    last = hi[hi > lo] - 1
    tgt[last] = IGNORE  # the last token of a row predicts nothing
    pos = np.arange(len(ids), dtype=np.int32)
    pos -= np.repeat(np.concatenate([[0], lo]).astype(np.int32), np.diff(np.concatenate([[0], lo, [len(ids)]])))
    sub = np.full(len(ids), PREFIX_SUBSEGMENT, dtype=np.int32)
    for (row, a, b) in single:
        row["target_ids"] = tgt[a:b]
        row["position_ids"] = pos[a:b]
        row["subsegment_ids"] = sub[a:b]


def shifted_targets(ids: np.ndarray, loss: np.ndarray) -> np.ndarray:
    """``target[t] = ids[t+1]`` where token ``t+1`` carries loss, else -100; last is -100.

    Example:
        >>> shifted_targets(np.array([5, 6, 7]), np.array([False, True, True])).tolist()
        [6, 7, -100]
    """
    tgt = np.full(len(ids), IGNORE, dtype=np.int32)
    if len(ids) > 1:
        tgt[:-1] = np.where(loss[1:], ids[1:], IGNORE)
    return tgt


def _common_prefix(seqs) -> int:
    p = min(len(ids) for ids, _, _ in seqs)
    first_ids, first_loss, _ = seqs[0]
    for ids, loss, _ in seqs[1:]:
        neq = np.flatnonzero((ids[:p] != first_ids[:p]) | (loss[:p] != first_loss[:p]))
        if len(neq):
            p = int(neq[0])
    # the last prefix position predicts one token only: no branch may need loss right after it
    while p > 0 and any(p < len(ids) and loss[p] for ids, loss, _ in seqs):
        p -= 1
    return p


def _media_end(spans) -> int:
    return max((start + n for _, start, n in spans), default=0)


def _split_trees(seqs, max_branches: int | None, max_tokens: int | None) -> list[list]:
    """Group a sample's branch sequences into trees (see the module docstring)."""
    if len(seqs) == 1:
        return [seqs]
    # 1. one cluster per media placement: equal spans and equal tokens up to the last span
    clusters: dict[tuple, list] = {}
    for seq in seqs:
        ids, loss, spans = seq
        end = _media_end(spans)
        key = (tuple(spans), ids[:end].tobytes(), loss[:end].tobytes())
        clusters.setdefault(key, []).append(seq)
    trees: list[list] = []
    # branch b of a tree has subsegment id b, which must stay below the shared prefix's
    # PREFIX_SUBSEGMENT (branch 10000 would read as prefix, and the branches after it lose the media)
    max_branches = min(max_branches or PREFIX_SUBSEGMENT, PREFIX_SUBSEGMENT)
    for members in clusters.values():
        p = _common_prefix(members) if len(members) > 1 else len(members[0][0])
        if p < _media_end(members[0][2]):
            # loss right after the media (media inside an assistant turn): no shared
            # prefix can hold the media, so every branch is its own tree
            trees.extend([m] for m in members)
            continue
        if len(members) <= max_branches and max_tokens is None:
            trees.append(members)
            continue
        current: list = []
        size = p
        for seq in members:
            rest = len(seq[0]) - p
            full = len(current) >= max_branches
            too_long = max_tokens is not None and current and size + rest > max_tokens
            if current and (full or too_long):
                trees.append(current)
                current, size = [], p
            current.append(seq)
            size += rest
        trees.append(current)
    return trees


def _tree_row(s: Sample, probed: list[_Probed], seqs) -> dict:
    if len(seqs) == 1:
        ids, loss, spans = seqs[0]
        p = len(ids)
    else:
        p = _common_prefix(seqs)
        spans = seqs[0][2]
        if _media_end(spans) > p or any(sp != spans for _, _, sp in seqs[1:]):
            raise RuntimeError(
                f"internal error: sample {s.sample_id!r}: media must lie in the shared prefix of a tree"
            )
    parts_ids, parts_tgt, parts_pos, parts_sub = [], [], [], []
    ids0, loss0, _ = seqs[0]
    tgt0 = shifted_targets(ids0, loss0)
    parts_ids.append(ids0[:p])
    parts_tgt.append(tgt0[:p])
    parts_pos.append(np.arange(p, dtype=np.int32))
    parts_sub.append(np.full(p, PREFIX_SUBSEGMENT, dtype=np.int32))
    n_branches = 0
    for b, (ids, loss, _) in enumerate(seqs if len(seqs) > 1 else []):
        if len(ids) == p:
            continue  # a branch wholly inside the prefix adds nothing
        tgt = shifted_targets(ids, loss)
        parts_ids.append(ids[p:])
        parts_tgt.append(tgt[p:])
        parts_pos.append(np.arange(p, len(ids), dtype=np.int32))
        parts_sub.append(np.full(len(ids) - p, b, dtype=np.int32))
        n_branches += 1
    if len(parts_ids) == 1:
        input_ids, target_ids, position_ids, subsegment_ids = parts_ids[0], parts_tgt[0], parts_pos[0], parts_sub[0]
    else:
        input_ids = np.concatenate(parts_ids)
        target_ids = np.concatenate(parts_tgt)
        position_ids = np.concatenate(parts_pos)
        subsegment_ids = np.concatenate(parts_sub)
    return _row(s, probed, spans, input_ids, target_ids, position_ids, subsegment_ids, max(1, n_branches))


def _media_entry(pr: _Probed, start: int, n: int) -> dict:
    lay = pr.layout
    return {
        "kind": lay.kind,
        "path": pr.ref.path,
        "token_offset": start,
        "n_tokens": n,
        "width": pr.width,
        "height": pr.height,
        "resized_width": lay.resized[1],
        "resized_height": lay.resized[0],
        "grid_t": lay.grid[0],
        "grid_h": lay.grid[1],
        "grid_w": lay.grid[2],
        "vision_units": lay.units,
        "timestamps": list(lay.timestamps) if lay.kind == "video" else None,
        "source_fps": pr.source[0] if pr.source else None,
        "source_frames": pr.source[1] if pr.source else None,
        "data": pr.ref.data,
        "size_bytes": pr.stat[0] if pr.stat else None,
        "mtime_ns": pr.stat[1] if pr.stat else None,
    }


def _media_key(ref: MediaRef, media_root: Path) -> tuple[str, str, str]:
    if ref.data is not None:
        return (ref.kind, "sha256", hashlib.sha256(ref.data).hexdigest())
    try:
        return (ref.kind, "path", str(resolve_media_path(ref.path or "", media_root)))
    except SampleError:
        return (ref.kind, "raw", ref.path or "")  # encode will reject it with the reason


def group_by_media(items: Iterable[Sample | Rejected], media_root: Path,
                   counts: Counter | None = None) -> Iterator[Sample | Rejected]:
    """Merge separate records that reference the same media into one message tree.

    Two samples merge when their media lists match item by item: the same resolved
    path under ``media_root``, or the same sha256 for inline bytes. The merged sample
    keeps the first record's id, source and row, and takes every record's branches in
    input order (``meta["merged"]`` lists the ids folded in, ``meta["merged_rows"]`` their
    ``(source, row, id)``, ``meta["merged_branches"]`` the branches of every record, the
    first included). Samples without media and rejected rows pass through. The whole
    input is held in memory (merging needs to see every record); ``counts["merged_records"]``
    counts records folded into an earlier one. Encoding rejects a merged sample record by
    record (:func:`_stage_samples`): a record with a bad conversation leaves the tree alone,
    bad media reject every record in it; a rejected record is no longer counted as merged.

    Example: records ``a`` (``img.jpg``, "What colour?") and ``b`` (``./img.jpg``,
    "How many?") become one sample with two branches, id ``a``.
    """
    order: list = []
    groups: dict[tuple, int] = {}
    for item in items:
        if isinstance(item, Rejected) or not item.media:
            order.append(item)
            continue
        # samples offering different tools render different system turns: never one tree
        key = (tuple(_media_key(ref, media_root) for ref in item.media),
               json.dumps(item.tools, sort_keys=True, ensure_ascii=False) if item.tools else "")
        at = groups.get(key)
        if at is None:
            groups[key] = len(order)
            order.append(item)
        else:
            first = order[at]
            merged = (*first.meta.get("merged", ()), item.sample_id)
            rows = (*first.meta.get("merged_rows", ()), (item.source, item.source_row, item.sample_id))
            n_branches = (*first.meta.get("merged_branches", (len(first.branches),)), len(item.branches))
            order[at] = replace(first, branches=first.branches + item.branches,
                                meta={**first.meta, "merged": merged, "merged_rows": rows, "merged_branches": n_branches})
            if counts is not None:
                counts["merged_records"] += 1
    yield from order
