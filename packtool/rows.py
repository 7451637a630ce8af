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
* ``--max-branches`` caps branches per tree, and ``--max-tokens`` caps a tree's tokens
  (prefix once plus every branch's rest): branches are taken in order and a new tree is
  started when the next branch would break either cap. A single branch longer than
  ``--max-tokens`` still becomes a tree of its own; the packer's ``--oversize`` policy
  decides its fate.

The extra trees are counted (``counts["split_extra_trees"]``) and named
``<sample_id>#1``, ``#2``, ...
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from .errors import SampleError
from .formats import Rejected
from .media import probe_image, resolve_media_path
from .records import MediaRef, Sample
from .schema import PREFIX_SUBSEGMENT
from .templates import Template
from .tokenization import Tokenizer
from .vision import VisionFamily, VisionLayout

__all__ = ["EncodeContext", "encode_samples", "group_by_media", "shifted_targets", "IGNORE"]

IGNORE = -100
#: Probe results kept per process; cleared when full (bounds memory on huge corpora).
_PROBE_CACHE_MAX = 100_000


@dataclass(frozen=True, slots=True)
class EncodeContext:
    """Everything :func:`encode_samples` needs besides the samples.

    Attributes:
        max_branches: most branches in one tree (``None``: no cap).
        max_tokens: most tokens in one tree (``None``: no cap); branches beyond it go
            to another tree on the same media.
        probe_cache: media probes by path (or inline bytes), shared across batches;
            media files are assumed not to change during a run.
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


@dataclass(slots=True)
class _Probed:
    ref: MediaRef
    width: int
    height: int
    layout: VisionLayout
    stat: tuple[int, int] | None = None  # (size_bytes, mtime_ns) of the file counted; None: inline bytes


def _probe_uncached(ref: MediaRef, ctx: EncodeContext, n_images: int) -> tuple[int, int, VisionLayout]:
    if ref.kind not in ("image", "video"):
        raise SampleError("bad_record", f"unknown media kind {ref.kind!r}")
    if ref.data is None and not ref.path:
        raise SampleError("missing_media", f"{ref.kind} has neither a path nor inline bytes")
    src = ref.data if ref.data is not None else resolve_media_path(ref.path, ctx.media_root)
    # what was counted: pack checks the file is still this one before it embeds or references it
    stat = None
    if ref.data is None:
        st = src.stat()
        stat = (st.st_size, st.st_mtime_ns)
    if ref.kind == "image":
        info = probe_image(src, exif=ctx.family.exif)
        return info.width, info.height, ctx.family.image_in_sample(info.height, info.width, n_images), stat
    from .media import probe_video

    meta = probe_video(src, apply_rotation=ctx.family.exif == "apply")
    return meta.width, meta.height, ctx.family.video(meta), stat


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
            hit = _probe_uncached(ref, ctx, n_images)
        except SampleError as err:
            hit = err
        if len(cache) >= _PROBE_CACHE_MAX:
            cache.clear()
        cache[key] = hit
    if isinstance(hit, SampleError):
        raise SampleError(hit.reason, hit.message)
    return _Probed(ref, hit[0], hit[1], hit[2], hit[3])


class _Specials:
    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self._ids: dict[str, int] = {}

    def __getitem__(self, name: str) -> int:
        tid = self._ids.get(name)
        if tid is None:
            tid = self._ids[name] = self._tok.special_id(name)
        return tid


# piece kinds in a staged branch
_TEXT, _TOKEN, _PAD = 0, 1, 2


def _stage(segments, probed: list[_Probed], specials: _Specials, texts: list[str], used: set[int]):
    """Turn rendered segments into token-level pieces, queueing texts for one batch encode.

    Each piece is ``(kind, value, count, loss, media_index)``: ``_TEXT`` pieces hold the
    index of their string in ``texts``; ``_TOKEN`` and ``_PAD`` pieces hold a token id
    repeated ``count`` times. Media segments are replaced by their family layout.
    Adjacent text with equal loss is merged so it is encoded as one string, as a
    tokenizer applied to the rendered chat would see it.
    """
    pieces: list[tuple] = []
    last_text = -1  # index in pieces of a text piece that the next text may extend
    for kind, value, count, loss in segments:
        if kind == "text":
            if last_text >= 0 and pieces[last_text][3] == loss:
                texts[pieces[last_text][1]] += value
            else:
                last_text = len(pieces)
                pieces.append((_TEXT, len(texts), 1, loss, -1))
                texts.append(value)
        elif kind == "special":
            pieces.append((_TOKEN, specials[value], count, loss, -1))
            last_text = -1
        elif kind == "media":
            if count >= len(probed) or probed[count].ref.kind != value:
                raise SampleError("placeholder_mismatch", f"placeholder for {value} {count} has no matching media")
            used.add(count)
            for skind, svalue, scount in probed[count].layout.segments:
                if skind == "text":
                    if last_text >= 0 and not pieces[last_text][3]:
                        texts[pieces[last_text][1]] += svalue
                    else:
                        last_text = len(pieces)
                        pieces.append((_TEXT, len(texts), 1, False, -1))
                        texts.append(svalue)
                else:
                    pieces.append((_PAD if skind == "pad" else _TOKEN, specials[svalue], scount, False, count))
                    last_text = -1
        else:
            raise RuntimeError(f"internal error: unknown segment kind {kind!r}")
    return pieces


def encode_samples(
    samples: list[Sample], ctx: EncodeContext, counts: Counter | None = None
) -> tuple[list[dict], list[Rejected]]:
    """Encode a batch of samples into tokenized rows (dicts matching ``schema.TOKENIZED``).

    Texts of the whole batch go to the tokenizer in one batch call. A sample may give
    several rows (see the module docstring); ``counts``, when given, gains ``trees``
    (rows), ``branches`` (branches over all rows) and ``split_extra_trees`` (rows beyond
    one per sample).
    """
    specials = _Specials(ctx.tokenizer)
    render = ctx.template.render
    system = ctx.system_prompt
    staged = []
    rejected: list[Rejected] = []
    texts: list[str] = []
    for s in samples:
        try:
            n_images = sum(ref.kind == "image" for ref in s.media)
            probed = [_probe(ref, ctx, n_images) for ref in s.media]
            used: set[int] = set()
            branches = [_stage(render(messages, system, s.tools, ctx.reasoning_loss), probed, specials, texts, used)
                        for messages in s.branches]
            if len(used) != len(probed):
                raise SampleError("placeholder_mismatch", f"{len(probed)} media but only {len(used)} placed in the conversation")
            staged.append((s, probed, branches))
        except SampleError as err:
            rejected.append(Rejected(s.source, s.source_row, s.sample_id, err.reason, err.message))
    encoded = ctx.tokenizer.encode_batch(texts) if texts else []
    rows = []
    for s, probed, branches in staged:
        seqs = [_assemble(b, encoded) for b in branches]
        trees = _split_trees(seqs, ctx.max_branches, ctx.max_tokens)
        for k, tree in enumerate(trees):
            row = _tree_row(s, probed, tree)
            if k:
                row["sample_id"] = f"{s.sample_id}#{k}"
            rows.append(row)
        if counts is not None:
            counts["trees"] += len(trees)
            counts["branches"] += len(seqs)
            counts["split_extra_trees"] += len(trees) - 1
    return rows, rejected


def _assemble(pieces, encoded):
    """Token ids, loss mask and media spans ``(media_index, start, n)`` of one branch.

    Arrays are preallocated and filled slice by slice: a media item is often thousands
    of identical pad tokens, which must not pass through Python lists.
    """
    total = 0
    for kind, value, count, _, _ in pieces:
        total += len(encoded[value]) if kind == _TEXT else count
    ids = np.empty(total, dtype=np.int32)
    loss = np.zeros(total, dtype=bool)
    spans: list[tuple[int, int, int]] = []
    pos = 0
    for kind, value, count, lossy, media_index in pieces:
        if kind == _TEXT:
            toks = encoded[value]
            count = len(toks)
            if count:
                ids[pos : pos + count] = toks
        else:
            ids[pos : pos + count] = value
            if kind == _PAD:
                # one span per item, from its first pad to its last (layouts may put row
                # or frame markers between pad runs)
                if spans and spans[-1][0] == media_index:
                    spans[-1] = (media_index, spans[-1][1], pos + count - spans[-1][1])
                else:
                    spans.append((media_index, pos, count))
        if lossy:
            loss[pos : pos + count] = True
        pos += count
    return ids, loss, spans


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
    for members in clusters.values():
        p = _common_prefix(members) if len(members) > 1 else len(members[0][0])
        if p < _media_end(members[0][2]):
            # loss right after the media (media inside an assistant turn): no shared
            # prefix can hold the media, so every branch is its own tree
            trees.extend([m] for m in members)
            continue
        if max_branches is None and max_tokens is None:
            trees.append(members)
            continue
        current: list = []
        size = p
        for seq in members:
            rest = len(seq[0]) - p
            full = max_branches is not None and len(current) >= max_branches
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
    media = [_media_entry(probed[mi], start, n) for mi, start, n in sorted(spans, key=lambda x: x[1])]
    return {
        "sample_id": s.sample_id,
        "source": s.source,
        "source_row": s.source_row,
        "n_tokens": int(len(input_ids)),
        "n_vision_units": int(sum(pr.layout.units for pr in probed)),
        "n_branches": max(1, n_branches),
        "input_ids": input_ids,
        "target_ids": target_ids,
        "position_ids": position_ids,
        "subsegment_ids": subsegment_ids,
        "media": media,
    }


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
    input order (``meta["merged"]`` lists the ids folded in). Samples without media and
    rejected rows pass through. The whole input
    is held in memory (merging needs to see every record); ``counts["merged_records"]``
    counts records folded into an earlier one.

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
            order[at] = replace(first, branches=first.branches + item.branches, meta={**first.meta, "merged": merged})
            if counts is not None:
                counts["merged_records"] += 1
    yield from order
