"""``packtool validate DIR``: prove that a tokenized or packed directory is whole.

Three layers, cheapest first; the first problems found are reported, never raised:

1. **files against the manifest**: the recorded ``config_digest`` is the digest of the
   recorded config, and a packed manifest's capacities are the config's (a manifest edited by
   hand no longer describes the shards); every listed shard exists with the listed size,
   sha256 and row count, opens as Parquet, and has the schema of this version; no other
   visible ``.parquet`` file lies beside them (a Parquet dataset reader would read it);
   ``.packtool/errors.jsonl`` holds known reason codes and as many lines as the counts say; a
   tokenized manifest's ``branches`` is the sum of the shards' ``n_branches`` (one column read;
   checked where the counts have ``folded_branches``: an older manifest's branches counted the
   folded ones too);
2. **every row's invariants** (DESIGN.md §3.2): equal column lengths; ``cu_seqlens``
   starts at 0, rises, ends at the row length and agrees with ``position_ids``
   (which restart at 0 exactly at each sample start, and at each branch of a tree
   whose branches share no prefix); subsegment ids name the row's
   sample and its prefix or branch, prefix first; positions continue across a branch
   start from the prefix length; a target is ``-100`` or the next token of the same
   branch, so nothing is predicted across a sample or branch boundary; capacities hold;
   media spans lie inside their sample, in row order without overlap, are never a target,
   add up to the row's vision units
   and hold what the family lays out for the item (:func:`span_problem`);
3. **embedded media decodes** (packed, ``--media embed``): each image and video frame
   opens and decodes with Pillow.

Example (a packed directory with one damaged shard)::

    report = validate_dir("packed")
    report["ok"], report["problems"][:1]
    # (False, [{'where': 'part-00000-00000.parquet', 'what': 'sha256 ... differs from the manifest ...'}])
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np

from .config import config_digest
from .errors import REASON_CODES, InputError, NoOutputError, SampleError
from .runs import (
    COMPACT_COLUMNS,
    MIN_RUN,
    RUN_COLUMNS,
    TOKEN_COLUMNS,
    V3_COMPACT_COLUMNS,
    V3_RUN_COLUMNS,
    V4_COMPACT_COLUMNS,
    blob_byte_offsets,
    blob_table,
    column_parts,
    compact_table,
    expand_table,
    is_runs_table,
    runs_version,
)
from .schema import (
    PREFIX_SUBSEGMENT,
    READABLE_VERSIONS,
    SCHEMA_VERSION,
    SUBSEGMENT_STRIDE,
    schema_of_version,
)
from .shards import ERRORS, MANIFEST, either, errors_path, read_manifest, sha256_file
from .vision import span_segments

__all__ = ["validate_dir", "render_report", "check_row", "span_problem", "run_problems", "errors_file_whole"]

log = logging.getLogger(__name__)

IGNORE = -100


class _Problems:
    def __init__(self, limit: int) -> None:
        self.items: list[dict] = []
        self.limit = limit

    def add(self, where: str, what: str) -> None:
        if len(self.items) < self.limit:
            self.items.append({"where": where, "what": what})

    @property
    def full(self) -> bool:
        return len(self.items) >= self.limit


def _list_rows(col) -> tuple[np.ndarray, np.ndarray]:
    """Flat values and row offsets of a list<int> column (one batch)."""
    import pyarrow as pa

    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False)
    return values, offsets


def span_problem(span: np.ndarray, segments, known: dict, tokenizer=None) -> str | None:
    """Why the token ids of one media span differ from the family's ``segments`` for it
    (:func:`packtool.vision.span_segments`), or ``None`` when they agree.

    With ``tokenizer`` (the one the directory was tokenized with) every placeholder,
    marker and text must be exactly its ids. Without it (a manifest names its tokenizer
    but not its file) the ids are learnt: the first span that uses a name fixes its id in
    ``known`` (kept across the directory), every later use must agree, and no two names
    share an id; so a marker damaged in the only span that uses it goes unseen. A text
    segment (Qwen3-VL and Molmo2 frame times, InternVL frame labels) runs up to the
    markers before the next pad run; it must hold no placeholder or marker id, and the
    same text must encode to the same ids everywhere.

    Example:
        >>> segs = (("pad", "<p>", 2), ("special", "<col>", 1), ("pad", "<p>", 2))
        >>> known = {}
        >>> span_problem(np.array([7, 7, 9, 7, 7]), segs, known), known["ids"]
        (None, {7: '<p>', 9: '<col>'})
        >>> span_problem(np.array([7, 7, 7, 7, 7]), segs, known)
        'token 2 is 7, the layout puts <col> (9) there'
    """
    n, i = len(span), 0
    ids = known.setdefault("ids", {})  # id -> name of every placeholder and marker fixed so far
    if tokenizer is not None:
        for kind, value, _ in segments:
            key = ("text" if kind == "text" else "token", value)
            if key not in known:
                known[key] = tuple(tokenizer.encode(value)) if kind == "text" else tokenizer.special_id(value)
                if kind != "text":
                    ids[known[key]] = value
    if not any(k == "text" for k, _, _ in segments):
        want = sum(c for _, _, c in segments)
        if want != n:
            return f"{n} tokens, the layout has {want}"
    for j, (kind, value, count) in enumerate(segments):
        if kind == "text":
            nxt = next(k for k in range(j + 1, len(segments)) if segments[k][0] == "pad")
            n_markers = sum(c for _, _, c in segments[j + 1:nxt])
            pad_id = known.get(("token", segments[nxt][1]))
            hits = np.flatnonzero(span[i:] == pad_id) if pad_id is not None else []
            end = i + int(hits[0]) - n_markers if len(hits) else -1
            if end <= i:
                return f"no text {value!r} at token {i} before the next {segments[nxt][1]} run"
            got = tuple(int(t) for t in span[i:end])
            marker = set(got) & ids.keys()
            if marker:
                return f"text {value!r} at tokens {i}..{end} holds placeholder or marker id {min(marker)}"
            seen = known.setdefault(("text", value), got)
            if seen != got:
                return f"text {value!r} at tokens {i}..{end} is {list(got)}, it encodes as {list(seen)}"
            i = end
            continue
        if i + count > n:
            return f"{n} tokens, too few for the layout's {value} at token {i}"
        tid = known.get(("token", value))
        if tid is None:
            tid = int(span[i])
            if tid in ids:
                return f"token {i} is {tid}, the id of {ids[tid]}, where the layout puts {value}"
            known[("token", value)] = tid
            ids[tid] = value
        bad = np.flatnonzero(span[i:i + count] != tid)
        if len(bad):
            t = i + int(bad[0])
            return f"token {t} is {int(span[t])}, the layout puts {value} ({tid}) there"
        i += count
    if i != n:
        return f"{n} tokens, the layout ends after {i}"
    return None


def _family_of(manifest: dict):
    """The vision family a manifest's ``vision`` settings describe, or ``None`` when this
    packtool cannot rebuild it (spans are then checked by the one-pad rule)."""
    from .errors import ConfigError
    from .vision import get_family

    vision = dict(manifest.get("vision") or {})
    name = vision.pop("name", None)
    for key in ("unit", "default_max_vision_units"):
        vision.pop(key, None)
    if not name:
        return None
    try:
        return get_family(name, **vision)
    except (ConfigError, TypeError, ValueError) as exc:
        log.info("media spans checked by the one-pad rule: vision settings %s not rebuilt (%s)", name, exc)
        return None


def _builtin_tokenizer(manifest: dict):
    """``(tokenizer, problem)``: the embedded vocabulary a manifest names, to check spans with
    (``None``: another tokenizer, whose ids are learnt), or why this packtool's copy of it is not
    the one recorded."""
    from .tokenization import load_tokenizer, vocabulary_difference

    recorded = manifest.get("tokenizer") or {}
    name = recorded.get("name")
    if name not in ("qwen2", "qwen3"):
        return None, None
    tok = load_tokenizer(name)
    difference = vocabulary_difference(tok, recorded)
    if difference:
        return None, f"the recorded tokenizer is not this packtool's built-in {name!r}: {difference}"
    return tok, None


def check_row(row: dict, kind: str, caps: dict | None = None, pad_ids: dict | None = None,
              family=None, tokenizer=None) -> list[str]:
    """Invariant violations of one row (dict of numpy arrays and scalars; see the module doc).

    ``row`` holds ``input_ids``, ``target_ids``, ``position_ids``, ``subsegment_ids``,
    ``n_tokens``, ``n_vision_units``, ``media`` (list of dicts) and, for packed rows,
    ``cu_seqlens`` and ``n_samples``. With ``family`` (a :class:`packtool.vision.VisionFamily`)
    each media span must hold what the family lays out for the item (:func:`span_problem`);
    without it, a span must start and end on one placeholder id. ``pad_ids`` collects
    the token ids learnt across rows (or taken from ``tokenizer``), so a span on another
    id is caught. Returns human-readable problems.

    Example:
        >>> ids = np.array([5, 6, 7]); row = dict(input_ids=ids, target_ids=np.array([-100, 7, -100]),
        ...     position_ids=np.arange(3), subsegment_ids=np.full(3, 10000), n_tokens=3, n_vision_units=0, media=[])
        >>> check_row(row, "tokenized")
        []
    """
    out: list[str] = []
    ids, tgt, pos, sub = row["input_ids"], row["target_ids"], row["position_ids"], row["subsegment_ids"]
    n = len(ids)
    if not (len(tgt) == len(pos) == len(sub) == n == row["n_tokens"]):
        return [f"column lengths differ: input {n}, target {len(tgt)}, position {len(pos)}, subsegment {len(sub)}, "
                f"n_tokens {row['n_tokens']}"]
    if n == 0:
        return ["row has no tokens"]
    if kind == "packed":
        cu = row["cu_seqlens"]
        if len(cu) != row["n_samples"] + 1:
            out.append(f"cu_seqlens has {len(cu)} entries for {row['n_samples']} samples (expected samples + 1)")
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != n or np.any(np.diff(cu) <= 0):
            out.append(f"cu_seqlens {cu[:8].tolist()}... must rise from 0 to the row length {n}")
            return out
    else:
        cu = np.array([0, n])
    local = sub % SUBSEGMENT_STRIDE
    starts = np.zeros(n, dtype=bool)
    starts[cu[:-1]] = True
    # a tree whose branches share no token (text only, differing from the first one, as in the
    # `plain` template) has no prefix, so each of its branches starts at position 0
    no_prefix = np.repeat(local[cu[:-1]] != PREFIX_SUBSEGMENT, np.diff(cu))
    starts[1:] |= no_prefix[1:] & (sub[1:] != sub[:-1])
    resets = pos == 0
    if np.any(resets != starts):
        t = int(np.flatnonzero(resets != starts)[0])
        out.append(f"position_ids restart at 0 where cu_seqlens does not start a sample (or the reverse), first at token {t}")
    sample_of = np.repeat(np.arange(len(cu) - 1), np.diff(cu))
    if kind == "packed" and np.any(sub // SUBSEGMENT_STRIDE != sample_of):
        t = int(np.flatnonzero(sub // SUBSEGMENT_STRIDE != sample_of)[0])
        out.append(f"subsegment id {int(sub[t])} at token {t} does not name its sample {int(sample_of[t])}")
    for k in range(len(cu) - 1):
        a, b = int(cu[k]), int(cu[k + 1])
        loc = local[a:b]
        is_prefix = loc == PREFIX_SUBSEGMENT
        p = int(is_prefix.sum())
        if p and not np.all(is_prefix[:p]):
            out.append(f"sample {k}: its shared prefix (subsegment {PREFIX_SUBSEGMENT}) is not at its start")
            continue
        branch = loc[p:]
        if np.any(np.diff(branch) < 0) or np.any(branch >= PREFIX_SUBSEGMENT):
            out.append(f"sample {k}: branch subsegment ids are not ascending branch numbers")
            continue
        sp = pos[a:b]
        new_seg = np.concatenate([[True], loc[1:] != loc[:-1]])
        expect = np.empty(b - a, dtype=np.int64)
        seg_start = np.flatnonzero(new_seg)
        seg_len = np.diff(np.concatenate([seg_start, [b - a]]))
        base = np.where(loc[seg_start] == PREFIX_SUBSEGMENT, 0, p)
        expect[:] = np.repeat(base - seg_start, seg_len) + np.arange(b - a)
        if np.any(sp != expect):
            t = int(np.flatnonzero(sp != expect)[0])
            out.append(f"sample {k}: position_ids {int(sp[t])} at token {a + t} should be {int(expect[t])} "
                       "(0.. over the prefix, each branch continuing from the prefix length)")
    lossy = np.flatnonzero(tgt != IGNORE)
    if len(lossy):
        nxt = lossy + 1
        bad = nxt >= n
        ok = ~bad
        ok_idx = lossy[ok]
        bad_next = np.zeros(len(lossy), dtype=bool)
        bad_next[ok] = (sub[ok_idx + 1] != sub[ok_idx]) | (tgt[ok_idx] != ids[ok_idx + 1])
        if np.any(bad | bad_next):
            t = int(lossy[np.flatnonzero(bad | bad_next)[0]])
            out.append(f"target_ids[{t}] = {int(tgt[t])} is neither -100 nor the next token of the same branch "
                       "(a loss across a sample or branch boundary, or a wrong shift)")
    units = 0
    known = pad_ids if pad_ids is not None else {}
    n_images: dict[int, int] = {}
    for m in row["media"]:
        if m["kind"] == "image":
            k = int(m.get("sample_index", 0) or 0)
            n_images[k] = n_images.get(k, 0) + 1
    end = 0  # where the span before ends
    for j, m in enumerate(row["media"]):
        off, cnt = int(m["token_offset"]), int(m["n_tokens"])
        units += int(m["vision_units"])
        if off < 0 or cnt <= 0 or off + cnt > n:
            out.append(f"media {j}: span {off}..{off + cnt} outside the row of {n} tokens")
            continue
        # pixels are handed over in media order and the model fills the placeholders in row order
        if off < end:
            out.append(f"media {j}: span {off}..{off + cnt} starts before the span before it ends, at {end} "
                       "(spans overlap or are not in row order)")
        end = off + cnt
        span = ids[off:off + cnt]
        what = None
        if family is not None:
            n_img = n_images.get(int(m.get("sample_index", 0) or 0), 1)
            # rows repeat media sizes, so layouts are rebuilt once per distinct item
            key = ("segments", m["kind"], m["width"], m["height"], m["grid_t"], m["grid_h"], m["grid_w"],
                   tuple(m.get("timestamps") or ()), m.get("source_fps"), m.get("source_frames"), n_img)
            try:
                segs = known[key] if key in known else known.setdefault(key, span_segments(family, m, n_img))
            except ValueError as exc:
                what = str(exc)
            except (SampleError, ArithmeticError) as exc:  # a recorded size no processor would take
                what = f"its layout cannot be rebuilt from the recorded {m['width']}x{m['height']}: {exc}"
            else:
                what = span_problem(span, segs, known, tokenizer)
        else:
            pad = known.setdefault(("pad", m["kind"]), int(span[0]))
            if span[0] != pad or span[-1] != pad:
                what = f"starts on token {int(span[0])} and ends on {int(span[-1])}, other {m['kind']} spans use {pad}"
        if what:
            model = f"{family.name} " if family is not None else ""
            out.append(f"media {j}: {m['kind']} span {off}..{off + cnt} is not the {model}placeholder layout: {what}")
        source = _source_problem(m)
        if source:
            out.append(f"media {j}: {m['kind']} {source}")
        if "data" in m and not (m.get("path") or m.get("data") or m.get("frames")):
            out.append(f"media {j}: {m['kind']} has neither a path nor its bytes, so no reader can load it; pack the "
                       "tokenized directory again (items that came as bytes keep them, by reference too)")
        # targets are pre-shifted: positions off-1 .. off+cnt-2 predict the span's tokens; the last
        # one predicts the token after the span, which may be an answer (LLaVA's `plain` pretraining)
        if np.any(tgt[max(off - 1, 0):off + cnt - 1] != IGNORE):
            out.append(f"media {j}: placeholder tokens are targets")
        k = int(m.get("sample_index", 0) or 0)
        if k + 1 >= len(cu) or not (cu[k] <= off and off + cnt <= cu[k + 1]):
            out.append(f"media {j}: span {off}..{off + cnt} is not inside its sample {k}")
        elif np.any(local[off:off + cnt] != PREFIX_SUBSEGMENT):
            out.append(f"media {j}: span lies outside its sample's shared prefix")
    if units != row["n_vision_units"]:
        out.append(f"n_vision_units {row['n_vision_units']} but its media add up to {units}")
    if caps:
        alone_ok = caps.get("allow_oversize_single") and len(cu) == 2
        if row["n_tokens"] > caps["max_tokens"] and not alone_ok:
            out.append(f"{row['n_tokens']:,} tokens, more than the pack capacity {caps['max_tokens']:,}")
        if caps.get("max_vision_units") and row["n_vision_units"] > caps["max_vision_units"] and not alone_ok:
            out.append(f"{row['n_vision_units']:,} vision units, more than the pack capacity {caps['max_vision_units']:,}")
    return out


def _source_problem(m: dict) -> str | None:
    """What is wrong with an item's ``source_fps`` / ``source_frames`` (schema version 6 on): set
    for an image, one without the other, or a rate, count or frame number no video has. Both
    null on a video is right (packed from a tokenized directory of version 5 or older). Frame
    counts are not compared: a time-based sampler (Molmo2) may take more frames than a short
    video has."""
    fps, frames = m.get("source_fps"), m.get("source_frames")
    if fps is None and frames is None:
        return None
    if m["kind"] != "video":
        return f"has source_fps {fps} and source_frames {frames}; only videos record them"
    if fps is None or frames is None:
        return f"has source_fps {fps} but source_frames {frames}: one without the other"
    if not (math.isfinite(fps) and fps > 0) or frames < 1:
        return f"has source_fps {fps} and source_frames {frames}: no video has them"
    return None


#: What decoding embedded bytes gave, by a digest of the bytes: ``(size, None, None)``, or
#: ``(None, "refused" | "undecodable", message)``. A corpus embeds each of its images once per
#: sample that uses it (a few hundred distinct images in 20,000 rows, say), and decoding every
#: copy made validate a hundred times slower than the pack that wrote them.
_DECODED: dict[bytes, tuple] = {}
_DECODED_MAX = 1 << 14


def _decoded(blob: bytes) -> tuple:
    """:data:`_DECODED`'s entry for ``blob``, decoding it the first time it is met."""
    import hashlib

    from .media import open_image

    key = hashlib.blake2b(blob, digest_size=16).digest()
    hit = _DECODED.get(key)
    if hit is None:
        try:
            with open_image(blob) as im:  # the allow-list: an embedded EPS is reported, never rendered
                im.load()
                hit = (im.size, None, None)
        except SampleError as err:
            hit = (None, "refused", err.message)
        except Exception as exc:  # noqa: BLE001 - any decoder failure is the finding
            hit = (None, "undecodable", str(exc))
        if len(_DECODED) >= _DECODED_MAX:
            _DECODED.clear()
        _DECODED[key] = hit
    return hit


def _check_media_bytes(m: dict) -> str | None:
    data = m.get("frames") if m["kind"] == "video" else ([m["data"]] if m.get("data") else None)
    if not data:
        return None
    for i, blob in enumerate(data):
        size, failure, message = _decoded(blob)
        if failure == "refused":
            return f"embedded {m['kind']} is refused: {message}"
        if failure is not None:
            return f"embedded {m['kind']} {'frame ' + str(i) if m['kind'] == 'video' else 'bytes'} do not decode: {message}"
        if m["kind"] == "image" and sorted(size) != sorted((m["width"], m["height"])):
            return f"embedded image is {size[0]}x{size[1]}, the row says {m['width']}x{m['height']}"
    if m["kind"] == "video" and m.get("timestamps") is not None and len(data) != len(m["timestamps"]):
        return f"{len(data)} embedded frames for {len(m['timestamps'])} timestamps"
    return None


def _schema_problem(schema, expected) -> str | None:
    got = {f.name: f.type for f in schema}
    want = {f.name: f.type for f in expected}
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    differ = sorted(k for k in set(want) & set(got) if want[k] != got[k])
    if not (missing or extra or differ):
        # same names and types: a stored blob must say it holds what this version's fields hold
        encodings = {f.name: f.metadata for f in expected if f.metadata}
        odd = sorted(n for n, meta in encodings.items() if schema.field(n).metadata != meta)
        if not odd:
            return None
        said = ", ".join(f"{k.decode()}: {v.decode()}" for k, v in encodings[odd[0]].items())
        return f"columns {odd} do not say {said!r} in their field metadata; not a shard of this version"
    return f"schema differs from version's (missing {missing}, unexpected {extra}, different types {differ})"


def _mixture_problem(pf, n_sources: int) -> str | None:
    """Whether every packed row of a mixture names one source in range per sample."""
    t = pf.read(columns=["sample_ids", "sample_sources"])
    ids, srcs = t["sample_ids"].combine_chunks(), t["sample_sources"].combine_chunks()
    if not np.array_equal(ids.offsets.to_numpy(), srcs.offsets.to_numpy()):
        return "sample_sources does not hold one source per sample id"
    values = srcs.values.to_numpy(zero_copy_only=False)
    if len(values) and (values.min() < 0 or values.max() >= n_sources):
        return f"sample_sources holds {int(values.min())}..{int(values.max())}; the mixture has {n_sources} sources"
    return None


def run_problems(table) -> list[tuple[int, str]]:
    """Problems of the run tables of a batch in runs form, as ``(row in the batch, what)``.

    In schema versions 4 and 5 every stored blob must hold whole int32 values (a byte length
    that is a multiple of 4) and the four compact columns of a row one length. Then, in either
    runs form, a run table must give each row as many lengths as starts; starts lie inside
    the compact row, strictly ascending; every run stands for at least ``MIN_RUN`` tokens;
    and the row is in its one canonical form (compacting the expanded row gives the stored
    row back: runs maximal, nothing a run could hold stored token by token), so the bytes
    are a function of the row alone.

    Example:
        >>> import pyarrow as pa
        >>> blob = lambda v: np.array(v, "<i4").tobytes()
        >>> t = pa.table({"compact_input_ids_i32le": [blob([7, 9, 3])], "run_starts_i32le": [blob([1])],
        ...               "run_lengths_i32le": [blob([2])]})
        >>> run_problems(t)
        [(0, 'run 0 stands for 2 tokens, fewer than 8')]
        >>> run_problems(t.set_column(2, "run_lengths_i32le", pa.array([b"\\x02\\x00\\x00"])))
        [(0, 'run_lengths_i32le holds 3 bytes, not whole int32 values (a multiple of 4)')]
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    version = runs_version(table)
    compact_names, run_names = {5: (COMPACT_COLUMNS, RUN_COLUMNS), 4: (V4_COMPACT_COLUMNS, RUN_COLUMNS)}.get(
        version, (V3_COMPACT_COLUMNS, V3_RUN_COLUMNS))
    out: list[tuple[int, str]] = []
    if version in (4, 5):
        present = [c for c in (*compact_names, *run_names) if c in table.column_names]
        byte_off = {c: blob_byte_offsets(table.column(c)) for c in present}
        for c in present:
            sizes = np.diff(byte_off[c])
            out += [(r, f"{c} holds {int(sizes[r])} bytes, not whole int32 values (a multiple of 4)")
                    for r in np.flatnonzero(sizes & 3).tolist()]
        if not out:
            lens = [(c, np.diff(byte_off[c]) >> 2) for c in present if c in compact_names]
            for c, n in lens[1:]:
                out += [(r, f"{c} holds {int(n[r])} values, {lens[0][0]} {int(lens[0][1][r])}")
                        for r in np.flatnonzero(n != lens[0][1]).tolist()]
        if out:
            return _first_per_row(out)
    _, c_off = column_parts(table.column(compact_names[0]))
    starts, s_off = column_parts(table.column(run_names[0]))
    lengths, l_off = column_parts(table.column(run_names[1]))
    starts, lengths = starts[s_off[0]:s_off[-1]], lengths[l_off[0]:l_off[-1]]
    s_off, l_off, c_off = s_off - s_off[0], l_off - l_off[0], c_off - c_off[0]
    for r in np.flatnonzero(np.diff(s_off) != np.diff(l_off)).tolist():
        out.append((r, f"{run_names[0]} has {int(s_off[r + 1] - s_off[r])} entries, "
                       f"{run_names[1]} {int(l_off[r + 1] - l_off[r])}"))
    if out:
        return out
    row = np.repeat(np.arange(len(s_off) - 1), np.diff(s_off))
    k = np.arange(len(starts)) - s_off[row]
    outside = (starts < 0) | (starts >= np.diff(c_off)[row])
    unsorted = np.zeros(len(starts), dtype=bool)
    unsorted[1:] = (np.diff(starts) <= 0) & (row[1:] == row[:-1])
    short = lengths < MIN_RUN
    seen: set[int] = set()
    for j in np.flatnonzero(outside | unsorted | short).tolist():
        r = int(row[j])
        if r in seen:
            continue
        seen.add(r)
        if outside[j]:
            what = f"run {int(k[j])} starts at {int(starts[j])}, outside the compact row of {int(c_off[r + 1] - c_off[r])}"
        elif unsorted[j]:
            what = f"run {int(k[j])} starts at {int(starts[j])}, not after the run before it"
        else:
            what = f"run {int(k[j])} stands for {int(lengths[j])} tokens, fewer than {MIN_RUN}"
        out.append((r, what))
    if out or not all(c in table.column_names for c in compact_names):
        return out
    stored = table.select([*compact_names, *run_names])
    again = compact_table(expand_table(stored))
    current = blob_table(stored)  # the same rows in the version 5 form, compared column by column
    for name, name5 in zip((*compact_names, *run_names), (*COMPACT_COLUMNS, *RUN_COLUMNS), strict=True):
        a, b = (col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
                for col in (current.column(name5), again.column(name5)))
        differ = pc.not_equal(a, b)
        out += [(r, f"{name} is not in canonical runs form (a run is split or not stored as one)")
                for r in np.flatnonzero(differ.to_numpy(zero_copy_only=False)).tolist() if r not in seen]
        seen.update(r for r, _ in out)
    return sorted(out)


def _first_per_row(found: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The first problem of each row, rows ascending."""
    first: dict[int, str] = {}
    for r, what in found:
        first.setdefault(r, what)
    return sorted(first.items())


def _check_rows(pf, file: str, kind: str, caps: dict | None, problems: _Problems, check_media: bool,
                pad_ids: dict, family=None, tokenizer=None) -> tuple[int, int]:
    """Check every row of one shard (expanding a runs-form shard after checking its run
    tables); return (rows, samples) seen."""
    import pyarrow as pa

    n_rows = n_samples = 0
    cols = list(TOKEN_COLUMNS)
    for batch in pf.iter_batches(batch_size=256):
        batch = pa.Table.from_batches([batch])
        if is_runs_table(batch):
            bad = run_problems(batch)
            for r, what in bad:
                problems.add(f"{file}: row {n_rows + r}", what)
            if bad:  # the rows cannot be expanded faithfully; their other checks would only repeat it
                n_rows += batch.num_rows
                if problems.full:
                    return n_rows, n_samples
                continue
            batch = expand_table(batch)
        flat = {c: _list_rows(batch.column(c)) for c in cols + (["cu_seqlens"] if kind == "packed" else [])}
        media = batch.column("media").to_pylist()
        n_tok = batch.column("n_tokens").to_numpy()
        n_units = batch.column("n_vision_units").to_numpy()
        n_in_row = (np.diff(batch.column("sample_ids").combine_chunks().offsets.to_numpy()) if kind == "packed"
                    else np.ones(batch.num_rows, dtype=np.int64))
        for r in range(batch.num_rows):
            row = {c: v[o[r]:o[r + 1]] for c, (v, o) in flat.items()}
            row.update(n_tokens=int(n_tok[r]), n_vision_units=int(n_units[r]), media=media[r], n_samples=int(n_in_row[r]))
            where = f"{file}: row {n_rows}"
            for what in check_row(row, kind, caps, pad_ids, family, tokenizer):
                problems.add(where, what)
            if check_media and kind == "packed":
                for j, m in enumerate(row["media"]):
                    msg = _check_media_bytes(m)
                    if msg:
                        problems.add(where, f"media {j}: {msg}")
            n_rows += 1
            n_samples += int(n_in_row[r])
            if problems.full:
                return n_rows, n_samples
    return n_rows, n_samples


def validate_dir(path: str | Path, max_problems: int = 20, check_media: bool = True, check_rows: bool = True,
                 tokenizer: str | None = None) -> dict:
    """Validate a tokenized or packed directory; returns a report dict, ``ok`` when whole.

    ``max_problems`` stops the search early; ``check_media=False`` skips decoding embedded
    media; ``check_rows=False`` checks only the files against the manifest. ``tokenizer``
    (a ``--tokenizer`` spec) names the tokenizer the directory was made with, so media
    spans are checked id for id (:func:`span_problem`); the embedded vocabularies
    (``qwen2``, ``qwen3``) are found from the manifest without it.

    Raises:
        ConfigError: ``tokenizer`` cannot be loaded, or it is not the vocabulary the manifest
            records (:func:`packtool.tokenization.load_recorded_tokenizer`): a mistake in the
            call, so it is raised rather than reported as a problem of the directory.
    """
    tokenizer_spec = tokenizer
    import pyarrow.parquet as pq

    from .storage import fetch_output
    from .tokenization import load_recorded_tokenizer

    problems = _Problems(max_problems)
    report = {"ok": False, "path": str(path), "kind": None, "shards": 0, "rows": 0, "problems": problems.items}
    try:
        # a bucket's output: every shard fetched and checked against the manifest's sha256 first
        path = fetch_output(path)
        manifest = read_manifest(path)
    except NoOutputError:
        raise  # no output at all: nothing to check, so no report saying it is "not whole"
    except InputError as exc:
        problems.add(MANIFEST, str(exc))
        return report
    # a --tokenizer of another vocabulary is a mistake in the command, not in the data: refused
    # (ConfigError) before anything is checked
    tokenizer = None if tokenizer_spec is None else load_recorded_tokenizer(tokenizer_spec, manifest.get("tokenizer") or {})
    kind = manifest.get("kind")
    report["kind"] = kind
    if kind not in ("tokenized", "packed"):
        problems.add(MANIFEST, f"unknown kind {kind!r}")
        return report
    # a config edited by hand no longer describes the shards: its digest gives it away
    recorded = manifest.get("config_digest")
    if config_digest(manifest["config"]) != recorded:
        problems.add(MANIFEST, f"config_digest {recorded} is not the digest of the config it records "
                               f"({config_digest(manifest['config'])}): the config was changed after the run wrote it; "
                               "put the manifest back as written, or re-run the command that made the directory")
    mixture = manifest.get("mixture") if kind == "packed" else None
    version = manifest.get("schema_version")
    expected = schema_of_version(kind, version, mixture is not None)
    caps = None
    if kind == "packed":
        caps = dict(manifest.get("capacities") or {})
        # stats and inspect measure fill against the capacities: they must be the ones packed with
        for key in ("max_tokens", "max_vision_units"):
            if caps.get(key) != manifest["config"].get(key):
                problems.add(MANIFEST, f"capacities.{key} {caps.get(key)!r} differs from the config's {key} "
                                       f"{manifest['config'].get(key)!r} (the manifest was changed after the run wrote "
                                       "it); put the manifest back as written, or re-run the command that made the "
                                       "directory")
        counts = manifest.get("counts", {})
        caps["allow_oversize_single"] = bool(counts.get("alone") or counts.get("truncated"))
    listed = set()
    total_rows = total_samples = 0
    # counts.branches is the sum of the rows' n_branches in a manifest that also counts the
    # conversations folded into a tree's shared prefix (folded_branches); before, branches counted
    # those too, so an older manifest's branches exceed the column's sum when any folded
    count_branches = kind == "tokenized" and {"branches", "folded_branches"} <= set(manifest.get("counts") or {})
    total_branches = 0
    pad_ids: dict = {}
    family = _family_of(manifest) if check_rows else None
    if family is not None and tokenizer is None:
        tokenizer, msg = _builtin_tokenizer(manifest)
        if msg:
            problems.add(MANIFEST, msg)
            return report
    for entry in manifest.get("shards", []):
        file = entry["file"]
        listed.add(file)
        f = path / file
        if not f.is_file():
            problems.add(file, "listed in the manifest but missing")
            continue
        size = f.stat().st_size
        if size != entry.get("bytes"):
            problems.add(file, f"{size:,} bytes, the manifest says {entry.get('bytes'):,}")
        digest = sha256_file(f)
        if digest != entry.get("sha256"):
            problems.add(file, f"sha256 {digest[:12]}… differs from the manifest's {str(entry.get('sha256'))[:12]}… "
                               "(the file changed after it was written)")
            continue
        try:
            pf = pq.ParquetFile(f)
        except Exception as exc:  # noqa: BLE001 - an unreadable shard is the finding
            problems.add(file, f"not readable as Parquet: {exc}")
            continue
        meta = {k.decode(): v.decode() for k, v in (pf.schema_arrow.metadata or {}).items()}
        readable = [str(v) for v in READABLE_VERSIONS.get(kind, (SCHEMA_VERSION,))]
        written = meta.get("packtool.schema_version")
        if written in readable and written != str(version) and {written, str(version)} - {"1", "2"}:
            # a shard of version 3 on is read by its own version's rules only (tokenized version 1
            # shards carry version 2's schema)
            schema_msg = f"written with schema version {written}, the manifest says {version}"
        else:
            schema_msg = _schema_problem(pf.schema_arrow, expected)
            if not schema_msg and written not in readable:
                schema_msg = f"written with schema version {written!r}, this packtool reads {either(readable)}"
        if schema_msg:
            problems.add(file, schema_msg)
            continue
        if pf.metadata.num_rows != entry.get("rows"):
            problems.add(file, f"{pf.metadata.num_rows:,} rows, the manifest says {entry.get('rows'):,}")
        report["shards"] += 1
        if count_branches:  # one int32 column: cheap beside the hash just taken
            total_branches += int(pf.read(columns=["n_branches"]).column(0).to_numpy().sum())
        if mixture is not None and check_rows:
            msg = _mixture_problem(pf, len(mixture.get("sources", [])))
            if msg:
                problems.add(file, msg)
        if check_rows and not problems.full:
            rows, samples = _check_rows(pf, file, kind, caps, problems, check_media, pad_ids, family, tokenizer)
            total_rows += rows
            total_samples += samples
        if problems.full:
            break
    report["rows"] = total_rows
    counts = manifest.get("counts", {})
    if check_rows and not problems.full and not problems.items:
        want_rows = counts.get("packs") if kind == "packed" else counts.get("samples")
        if want_rows is not None and want_rows != total_rows:
            problems.add(MANIFEST, f"counts say {want_rows:,} rows, the shards hold {total_rows:,}")
        if kind == "packed" and counts.get("samples_packed") is not None and counts["samples_packed"] != total_samples:
            problems.add(MANIFEST, f"counts say {counts['samples_packed']:,} samples packed, the shards hold {total_samples:,}")
    if count_branches and not problems.items and counts.get("branches") != total_branches:
        problems.add(MANIFEST, f"counts say {counts['branches']:,} branches, the shards' n_branches add up to "
                               f"{total_branches:,}")
    # packtool's readers go by the manifest, but a Parquet dataset reader (pandas, duckdb,
    # datasets, pyarrow) reads every visible .parquet file of the directory
    for f in sorted(path.glob("*.parquet")):
        if f.name not in listed and not f.name.startswith(("_", ".")):
            problems.add(f.name, "not listed in the manifest, yet tools that read the directory as a Parquet dataset "
                                 "(pandas, duckdb, datasets) read its rows with the listed shards'; remove it")
    _check_errors_file(path, counts, manifest.get("errors_file"), problems)
    report["ok"] = not problems.items
    return report


def _errors_fix(path: Path) -> str:
    """What a damaged ``errors.jsonl`` needs. It is the run's task logs end to end: ``packtool
    merge`` writes it again from them while every task's completion marker reads as merge reads
    it (:func:`~packtool.shards.read_marker`: its shards and error log whole); without them the
    command that wrote the directory redoes the tasks whose files are gone and writes it (merge
    would refuse, naming that command)."""
    from .shards import read_marker, read_run

    merge = "`packtool merge` on the directory writes it again from the tasks' error logs"
    rerun = ("the tasks' error logs it is written from are gone too: run the command that wrote the directory "
             "again (it redoes those tasks and writes it)")
    try:
        run = read_run(path)
    except InputError:
        # no run state here to look at (a bucket output is checked from a copy of its manifest,
        # errors.jsonl and shards): merge finds the logs, or names the command that writes them
        return merge
    if any(read_marker(path, t, run["config_digest"]) is None for t in range(run["n_tasks"])):
        return rerun
    return merge


def errors_file_whole(path: str | Path, manifest: dict) -> bool:
    """Whether ``validate`` finds ``errors.jsonl`` of the output ``path`` (a local folder, or a
    bucket output's mirror) as its ``manifest`` describes it: its sha256 where the manifest
    records one, else its lines against the counts. ``packtool merge`` asks this of a finished
    run whose task logs it cannot read any more: when whole, there is nothing to write again."""
    problems = _Problems(1)
    _check_errors_file(Path(path), manifest.get("counts") or {}, manifest.get("errors_file"), problems)
    return not problems.items


def _check_errors_file(path: Path, counts: dict, record: object, problems: _Problems) -> None:
    """``errors.jsonl`` against the manifest: its lines (known reason codes, as many as the counts
    say) and, where the manifest records them (``errors_file``), its size and sha256."""
    import hashlib

    f = errors_path(path)
    if not f.is_file():
        if counts.get("rejected"):
            problems.add(ERRORS, f"missing, but the manifest counts {counts['rejected']:,} rejected rows; {_errors_fix(path)}")
        return
    n = 0
    by_reason: dict[str, int] = {}
    digest = hashlib.sha256()
    # read as bytes: a line that is not UTF-8 is a finding of its own, not a decoding error
    with open(f, "rb") as fh:
        for i, line in enumerate(fh):
            digest.update(line)
            try:
                rec = json.loads(line)
            except ValueError:  # UnicodeDecodeError included
                problems.add(f"{ERRORS}: line {i}", "not valid JSON")
                return
            if not isinstance(rec, dict):
                problems.add(f"{ERRORS}: line {i}", f"a JSON {type(rec).__name__}, not a rejected row (an object)")
                return
            if rec.get("reason") not in REASON_CODES:
                problems.add(f"{ERRORS}: line {i}", f"unknown reason code {rec.get('reason')!r}")
            by_reason[rec.get("reason")] = by_reason.get(rec.get("reason"), 0) + 1
            n += 1
    if "rejected" in counts and counts["rejected"] != n:
        problems.add(ERRORS, f"{n:,} lines, the manifest counts {counts['rejected']:,} rejected rows; {_errors_fix(path)}")
    elif "rejected_by_reason" in counts and counts["rejected_by_reason"] != dict(sorted(by_reason.items())):
        problems.add(ERRORS, "reasons differ from the manifest's rejected_by_reason")
    elif isinstance(record, dict) and record.get("sha256") not in (None, digest.hexdigest()):
        problems.add(ERRORS, f"sha256 {digest.hexdigest()[:12]}… differs from the manifest's "
                             f"{str(record['sha256'])[:12]}… (the file changed after it was written); {_errors_fix(path)}")


def render_report(report: dict) -> str:
    """The human summary ``packtool validate`` prints."""
    shards, rows = report["shards"], report["rows"]
    head = (f"{report['path']}: {report['kind'] or 'unknown'} directory, {shards:,} shard{'' if shards == 1 else 's'}, "
            f"{rows:,} row{'' if rows == 1 else 's'} checked")
    if report["ok"]:
        return f"{head}: OK"
    lines = [f"{head}: {len(report['problems'])} problem(s) found (first ones):"]
    lines += [f"  {p['where']}: {p['what']}" for p in report["problems"]]
    return "\n".join(lines)
