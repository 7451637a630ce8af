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
"""

from __future__ import annotations

from dataclasses import dataclass
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

__all__ = ["EncodeContext", "encode_samples", "IGNORE"]

IGNORE = -100


@dataclass(frozen=True, slots=True)
class EncodeContext:
    tokenizer: Tokenizer
    template: Template
    family: VisionFamily
    media_root: Path
    system_prompt: str | None = None


@dataclass(slots=True)
class _Probed:
    ref: MediaRef
    width: int
    height: int
    layout: VisionLayout


def _probe(ref: MediaRef, ctx: EncodeContext) -> _Probed:
    if ref.kind == "image":
        src = ref.data if ref.data is not None else resolve_media_path(ref.path or "", ctx.media_root)
        info = probe_image(src)
        return _Probed(ref, info.width, info.height, ctx.family.image(info.height, info.width))
    if ref.kind == "video":
        from .media import probe_video

        src = ref.data if ref.data is not None else resolve_media_path(ref.path or "", ctx.media_root)
        meta = probe_video(src)
        return _Probed(ref, meta.width, meta.height, ctx.family.video(meta))
    raise SampleError("bad_record", f"unknown media kind {ref.kind!r}")


class _Specials:
    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self._ids: dict[str, int] = {}

    def __getitem__(self, name: str) -> int:
        tid = self._ids.get(name)
        if tid is None:
            tid = self._ids[name] = self._tok.special_id(name)
        return tid


def _expand(segments, probed: list[_Probed], specials: _Specials):
    """Replace media segments by their family layout; returns token-level pieces.

    Each piece is ``(kind, value, count, loss, media_index)`` with kind ``text``,
    ``special`` or ``pad``; adjacent text pieces with equal loss are merged so they
    are encoded as one string, as a tokenizer applied to the rendered chat would.
    """
    out: list[list] = []
    for kind, value, count, loss in segments:
        if kind == "media":
            if count >= len(probed) or probed[count].ref.kind != value:
                raise SampleError("placeholder_mismatch", f"placeholder for {value} {count} has no matching media")
            for skind, svalue, scount in probed[count].layout.segments:
                out.append([skind, svalue, scount, False, count])
        elif kind == "text" and out and out[-1][0] == "text" and out[-1][3] == loss:
            out[-1][1] += value
        else:
            out.append([kind, value, count, loss, -1])
    return out


def encode_samples(samples: list[Sample], ctx: EncodeContext) -> tuple[list[dict], list[Rejected]]:
    """Encode a batch of samples into tokenized rows (dicts matching ``schema.TOKENIZED``).

    Texts of the whole batch go to the tokenizer in one batch call.
    """
    specials = _Specials(ctx.tokenizer)
    staged = []
    rejected: list[Rejected] = []
    texts: list[str] = []
    for s in samples:
        try:
            probed = [_probe(ref, ctx) for ref in s.media]
            branches = []
            for messages in s.branches:
                pieces = _expand(ctx.template.render(messages, ctx.system_prompt), probed, specials)
                for p in pieces:
                    if p[0] == "text":
                        p[2] = len(texts)
                        texts.append(p[1])
                    elif p[0] in ("special", "pad"):
                        p[1] = specials[p[1]]
                branches.append(pieces)
            used = {p[4] for b in branches for p in b if p[4] >= 0}
            if len(used) != len(probed):
                raise SampleError("placeholder_mismatch", f"{len(probed)} media but only {len(used)} placed in the conversation")
            staged.append((s, probed, branches))
        except SampleError as err:
            rejected.append(Rejected(s.source, s.source_row, s.sample_id, err.reason, err.message))
    encoded = ctx.tokenizer.encode_batch(texts) if texts else []
    rows = []
    for s, probed, branches in staged:
        seqs = [_assemble(b, encoded) for b in branches]
        rows.append(_tree_row(s, probed, seqs))
    return rows, rejected


def _assemble(pieces, encoded):
    """Token ids, loss mask and media spans ``(media_index, start, n)`` of one branch."""
    ids: list[int] = []
    loss: list[bool] = []
    spans: list[tuple[int, int, int]] = []
    for kind, value, count, lossy, media_index in pieces:
        if kind == "text":
            toks = encoded[count]
            ids.extend(toks)
            loss.extend([lossy] * len(toks))
        elif kind == "special":
            ids.extend([value] * count)
            loss.extend([lossy] * count)
        else:  # pad: the feature slots of one media item
            if spans and spans[-1][0] == media_index and spans[-1][1] + spans[-1][2] == len(ids):
                spans[-1] = (media_index, spans[-1][1], spans[-1][2] + count)
            else:
                spans.append((media_index, len(ids), count))
            ids.extend([value] * count)
            loss.extend([False] * count)
    return np.asarray(ids, dtype=np.int32), np.asarray(loss, dtype=bool), spans


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


def _tree_row(s: Sample, probed: list[_Probed], seqs) -> dict:
    if len(seqs) == 1:
        ids, loss, spans = seqs[0]
        p = len(ids)
    else:
        p = _common_prefix(seqs)
        spans = seqs[0][2]
        if any(start + n > p for _, start, n in spans) or any(sp != spans for _, _, sp in seqs[1:]):
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
    input_ids = np.concatenate(parts_ids)
    media = [_media_entry(probed[mi], start, n) for mi, start, n in sorted(spans, key=lambda x: x[1])]
    return {
        "sample_id": s.sample_id,
        "source": s.source,
        "source_row": s.source_row,
        "n_tokens": int(len(input_ids)),
        "n_vision_units": int(sum(pr.layout.units for pr in probed)),
        "n_branches": max(1, n_branches),
        "input_ids": input_ids,
        "target_ids": np.concatenate(parts_tgt),
        "position_ids": np.concatenate(parts_pos),
        "subsegment_ids": np.concatenate(parts_sub),
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
    }
