"""One pack, or one sample, as a person wants to read it.

``inspect_dir`` returns a plain dict (the ``--json`` output); ``render_inspection``
formats it. For each sample of a pack (or the one sample of a tokenized row):

* the turns, by role, with the text decoded and each media placeholder span collapsed to
  ``<image 1: 1932×1092, 2691 tokens>`` (resized width × height, placeholder tokens);
* the tokens that carry loss marked ``⟦…⟧`` (token ``t`` carries loss when the pre-shifted
  ``target_ids[t-1]`` is not -100);
* for a message tree, the shared prefix and then each branch, as stored;
* a compact ruler: runs of equal subsegment id with their token and position ranges;
* the media list: kind, path, original and resized size, grid, tokens, units, timestamps
  (and, for videos, the source's frame count and rate).

The tokenizer is the one the manifests name (the embedded Qwen2 vocabulary by default),
checked against the vocabulary fingerprint recorded there.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import numpy as np
import pyarrow as pa

from .errors import ConfigError, InputError
from .runs import TOKEN_COLUMNS, expand_row, is_runs_table, stored_names
from .schema import MEDIA_FIELDS, PREFIX_SUBSEGMENT, SUBSEGMENT_STRIDE
from .shards import (
    ERRORS,
    errors_path,
    open_shard,
    read_manifest,
    read_shard,
    shard_error,
    why_no_packs,
)
from .storage import join, source_dir
from .templates import TEMPLATES, Template
from .tokenization import Tokenizer, load_recorded_tokenizer, load_tokenizer, vocabulary_difference

__all__ = ["inspect_dir", "render_inspection", "LOSS_OPEN", "LOSS_CLOSE"]

log = logging.getLogger(__name__)

LOSS_OPEN, LOSS_CLOSE = "⟦", "⟧"

_TOKEN_COLUMNS = list(TOKEN_COLUMNS)
# every media leaf except the bytes, so inspecting a pack never reads embedded images or frames
_MEDIA_LEAVES = [f"media.list.element.{f.name}" + (".list.element" if f.name == "timestamps" else "")
                 for f in MEDIA_FIELDS]
# vision delimiters around a placeholder span are folded into the collapsed media label
_VISION_DELIMITERS = ("<|vision_start|>", "<|vision_end|>")


# ---------------------------------------------------------------------------------------------
# locating the row


def _find_row(path: Path, manifest: dict, column: str, want, is_list: bool) -> tuple[str, int] | None:
    for entry in manifest["shards"]:
        values = read_shard(path, entry, [column])[column].to_pylist()
        for row, v in enumerate(values):
            if (want in v) if is_list else (v == want):
                return entry["file"], row
    return None


#: Matches of one sample id that a note lists by name; the rest are counted.
_MATCHES_LISTED = 10


def _sample_matches(path: Path, manifest: dict, sample: str, packed: bool) -> tuple[list[dict], list[str]]:
    """Every sample named ``sample`` in the directory, in manifest order, and the names tokenize
    gave later samples of that id in the same task (``sample#d1``, ...: :class:`packtool.rows.SampleNames`).

    A tokenized match is ``{file, row, source, source_row}``; a packed one ``{file, row,
    pack_index, index}`` (``index``: the sample's place in its pack), with ``source_index`` (its
    source in ``mixture.sources``) in a mixture. Columns are compared with Arrow kernels, so a
    directory of millions of samples is searched in a blink.
    """
    import pyarrow.compute as pc

    column = "sample_ids" if packed else "sample_id"
    derived_name = "^" + re.escape(sample) + "#d[0-9]+$"
    found: list[dict] = []
    derived: list[str] = []
    for entry in manifest["shards"]:
        ids = read_shard(path, entry, [column])[column].combine_chunks()
        flat = pc.list_flatten(ids) if packed else ids
        derived += flat.filter(pc.match_substring_regex(flat, derived_name)).to_pylist()
        at = np.flatnonzero(pc.equal(flat, pa.scalar(sample, pa.string())).to_numpy(zero_copy_only=False))
        if not len(at):
            continue
        if not packed:
            t = read_shard(path, entry, ["source", "source_row"])
            src, src_row = t["source"].to_pylist(), t["source_row"].to_pylist()
            found += [{"file": entry["file"], "row": int(r), "source": src[r], "source_row": src_row[r]} for r in at]
            continue
        parent = pc.list_parent_indices(ids).to_numpy(zero_copy_only=False)
        first = ids.offsets.to_numpy(zero_copy_only=False)
        mixture = manifest.get("mixture") is not None
        t = read_shard(path, entry, ["pack_index"] + (["sample_sources"] if mixture else []))
        numbers = t["pack_index"].to_numpy()
        sources = pc.list_flatten(t["sample_sources"].combine_chunks()).to_numpy(zero_copy_only=False) if mixture else None
        for i in at.tolist():
            r = int(parent[i])
            m = {"file": entry["file"], "row": r, "pack_index": int(numbers[r]), "index": i - int(first[r])}
            if mixture:
                m["source_index"] = int(sources[i])
            found.append(m)
    # a name listed once (samples of different tasks may bear the same derived name: its own note says so)
    return found, sorted(dict.fromkeys(derived), key=lambda n: int(n.rsplit("#d", 1)[1]))


def _mixture_source_name(manifest: dict, i: int) -> str:
    src = manifest["mixture"]["sources"][i]
    return src.get("name") or src["path"]


def _match_source(shown: str, manifest: dict, matches: list[dict], sample: str, source: str) -> list[dict]:
    """The ``matches`` from ``source``: in a mixture, a source's name or path as the manifest
    records it; in a tokenized directory, a row's input file (its ``source``)."""
    kind = manifest.get("kind")
    if kind == "packed":
        mixture = manifest.get("mixture")
        if mixture is None:
            raise ConfigError(f"--source picks one source of a mixture, and {shown!r} packs one tokenized directory; "
                              "leave --source out (the samples of a name are listed with their packs)")
        names = [(s.get("name"), s["path"]) for s in mixture["sources"]]
        picked = {i for i, (name, p) in enumerate(names) if name == source or _same_path(p, source)}
        if not picked:
            listed = ", ".join(repr(name or p) for name, p in names)
            raise ConfigError(f"--source {source!r} is none of the {len(names)} sources of the mixture {shown!r}: "
                              f"{listed}; give one of those (a name, or the path the manifest records)")
        kept = [m for m in matches if m["source_index"] in picked]
        have = dict.fromkeys(_mixture_source_name(manifest, m["source_index"]) for m in matches)
    else:
        kept = [m for m in matches if _same_path(m["source"], source)]
        have = dict.fromkeys(m["source"] for m in matches)
    if matches and not kept:
        raise InputError(f"sample {sample!r} of {shown!r} is not from {source!r}: the "
                         f"{'sample of that name is' if len(matches) == 1 else 'samples of that name are'} from "
                         f"{', '.join(repr(h) for h in have)}; give one of those to --source, or leave it out")
    return kept


def _same_path(a: str, b: str) -> bool:
    return a == b or os.path.normpath(a) == os.path.normpath(b)


def _read_row(path: Path, manifest: dict, file: str, row: int, columns: list[str]) -> dict:
    """One row, reading only the row group that holds it; token columns come back expanded
    (from a runs-form shard too)."""
    entry = next(e for e in manifest["shards"] if e["file"] == file)
    pf = open_shard(path, entry)
    if is_runs_table(pf.schema_arrow):
        run_table = stored_names(pf.schema_arrow, TOKEN_COLUMNS[:1])[1:]  # read even when no token column is asked for
        columns = list(dict.fromkeys([*stored_names(pf.schema_arrow, columns), *run_table]))
    # media leaves a shard of an older schema version lacks (the source_* fields before version 6)
    leaves = set(pf.schema.names) | {c.path for c in (pf.schema.column(i) for i in range(len(pf.schema)))}
    columns = [c for c in columns if not c.startswith("media.") or c in leaves]
    start = 0
    for rg in range(pf.metadata.num_row_groups):
        n = pf.metadata.row_group(rg).num_rows
        if row < start + n:
            try:
                table = pf.read_row_group(rg, columns=columns)
            except (pa.ArrowException, OSError) as exc:
                raise shard_error(path / file, exc) from None
            try:
                return expand_row(table.slice(row - start, 1).to_pylist()[0])
            except ValueError as exc:
                raise InputError(f"{path / file}: row {row}: {exc}; run packtool validate on {str(path)!r}") from None
        start += n
    raise RuntimeError(f"internal error: row {row} not in {file}")


def _pack_numbers(path: Path, manifest: dict) -> list[int]:
    """Every ``pack_index`` of a packed directory, ascending."""
    found: list[int] = []
    for entry in manifest["shards"]:
        found += read_shard(path, entry, ["pack_index"])["pack_index"].to_pylist()
    return sorted(found)


def _number_ranges(numbers: list[int], most: int = 6) -> str:
    """Ascending ``numbers`` as runs of consecutive ones, all of them when there are at most
    ``most`` runs, else the first few, an ellipsis and the last. A pack task's packs are one run
    (``pack_index = task * 1000000000 + k``), so this reads as the packs of each task.

    Example:
        >>> _number_ranges([0, 1, 1000000000, 1000000001, 1000000002, 2000000000])
        '0..1, 1000000000..1000000002 and 2000000000'
        >>> _number_ranges([t * 1000000000 + k for t in range(9) for k in range(3)])
        '0..2, 1000000000..1000000002, 2000000000..2000000002, 3000000000..3000000002, …, 8000000000..8000000002 (9 runs)'
    """
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    text = [f"{a}" if a == b else f"{a}..{b}" for a, b in runs]
    if len(text) > most:
        return ", ".join(text[:most - 2] + ["…", text[-1]]) + f" ({len(text)} runs)"
    return text[0] if len(text) == 1 else ", ".join(text[:-1]) + " and " + text[-1]


def _rejection(path: Path, shown: str, sample: str, what: str) -> str | None:
    """Why ``sample`` is not in the directory, when its rejected-rows file lists it: ``what`` (who
    left it out), the reason code and message, and where the input row was."""
    file = errors_path(path)
    if not file.is_file():
        return None
    with open(file, encoding="utf-8") as fh:
        for line in fh:
            e = json.loads(line) if line.strip() else {}
            if e.get("sample_id") == sample:
                return (f"{what} ({e.get('reason')}: {e.get('message')}; {e.get('source')} row {e.get('row')}), "
                        f"as {join(shown, ERRORS)} lists")
    return None


def _merge_note(manifest: dict | None) -> str:
    """Where a record ``--group-by-media`` merged went, when the tokenized ``manifest`` merged any:
    its id is stored nowhere (a tree carries its first record's id), so a search for it fails."""
    n = ((manifest or {}).get("counts") or {}).get("merged_records") or 0
    if not n:
        return ""
    records = "one record" if n == 1 else f"{n:,} records"
    return (f"; --group-by-media merged {records} into the trees of others, each named after the first "
            "record of its media (trees split off: ID#1, ID#2, ...): a merged record is in the tree of the first "
            "record with the same images or videos")


def _examples(path: Path, manifest: dict, column: str, is_list: bool, n: int = 3) -> list:
    if not manifest["shards"]:
        return []
    col = read_shard(path, manifest["shards"][0], [column])[column].to_pylist()
    flat = [x for v in col for x in v] if is_list else col
    return flat[:n]


# ---------------------------------------------------------------------------------------------
# tokenizer and template


def _resolve_tokenizer(manifest: dict, tok_manifest: dict | None, override: str | None) -> Tokenizer:
    recorded = manifest.get("tokenizer") or {}
    embedded = recorded.get("name") in (None, "qwen2", "qwen3")  # no --tokenizer: the vocabulary recorded
    if override is not None:
        return load_recorded_tokenizer(override, recorded)
    if tok_manifest is not None:
        spec = (tok_manifest.get("config") or {}).get("tokenizer")
        if spec is None and embedded:
            spec = recorded.get("name")
    elif embedded:
        spec = recorded.get("name")
    else:
        raise ConfigError(f"this directory was tokenized with {recorded.get('name')!r} and the tokenized directory "
                          "is not where the manifest says; pass --tokenizer PATH")
    tok = load_tokenizer(spec)
    difference = vocabulary_difference(tok, recorded)
    if difference:  # the tokenizer file the tokenized directory names changed since, or the manifests disagree
        raise ConfigError(f"tokenizer {spec!r} is not the one this directory was made with: {difference}; "
                          "pass --tokenizer with the original")
    return tok


def _template(manifest: dict) -> Template | None:
    name = (manifest.get("template") or {}).get("name")
    return TEMPLATES.get(name) if name else None


def _header_of(tpl: Template) -> tuple[tuple[str, str], ...]:
    """The template's turn header as ``(kind, value)`` pairs (older templates: turn_start + role_header)."""
    header = getattr(tpl, "header", None)
    if header is not None:
        return tuple(header)
    start, role = getattr(tpl, "turn_start", ""), getattr(tpl, "role_header", "")
    return tuple(x for x in (("special", start), ("text", role)) if x[1])


class _Decoder:
    """Turns token runs into readable pieces with the tokenizer's special ids at hand.

    A turn starts at the first token of the template's header when that is a special token;
    the rest of the header (role text, more specials) is matched as a regular expression
    over the decoded text that follows, which yields the role.
    """

    def __init__(self, tok: Tokenizer, template: Template | None) -> None:
        self.tok = tok
        self.template = template
        header = _header_of(template) if template is not None else ()
        self.turn_start = self._special(header[0][1]) if header and header[0][0] == "special" else None
        pattern = ""
        for kind, value in header[1:]:
            if kind == "text" and "{role}" in value:
                pre, _, suf = value.partition("{role}")
                pattern += re.escape(pre) + r"(?P<role>[A-Za-z_][\w-]*)" + re.escape(suf)
            else:
                pattern += re.escape(value)
        self.header_re = re.compile(pattern) if "(?P<role>" in pattern else None
        self.delims = {i for i in (self._special(n) for n in _VISION_DELIMITERS) if i is not None}
        names = [v for k, v in header if k == "special"]
        names += [getattr(template, n, "") for n in ("turn_end", "bos", "eos")] if template is not None else []
        self.specials = {i for i in (self._special(n) for n in names if n) if i is not None} | self.delims

    def _special(self, name: str) -> int | None:
        try:
            return self.tok.special_id(name)
        except ConfigError:
            return None

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


# ---------------------------------------------------------------------------------------------
# one sample


def _size(w: int, h: int) -> str:
    return f"{w}×{h}"


def _media_view(m: dict, label: str, offset_in_sample: int) -> dict:
    return {
        "label": label,
        "kind": m["kind"],
        "path": m.get("path"),
        "width": m["width"],
        "height": m["height"],
        "resized_width": m["resized_width"],
        "resized_height": m["resized_height"],
        "grid": [m["grid_t"], m["grid_h"], m["grid_w"]],
        "n_tokens": m["n_tokens"],
        "token_offset": offset_in_sample,
        "vision_units": m["vision_units"],
        "timestamps": m.get("timestamps"),
        "source_fps": m.get("source_fps"),
        "source_frames": m.get("source_frames"),
    }


def _pieces(ids: np.ndarray, carries: np.ndarray, start: int, end: int, spans: dict[int, dict], dec: _Decoder) -> list[dict]:
    """Pieces of tokens ``[start, end)``: text runs of equal loss, special tokens, collapsed media."""
    out: list[dict] = []
    i = start
    run: list[int] = []
    run_loss = False

    def flush() -> None:
        nonlocal run
        if run:
            out.append({"kind": "text", "text": dec.decode(run), "loss": run_loss})
            run = []

    while i < end:
        m = spans.get(i)
        if m is not None:
            flush()
            if out and out[-1]["kind"] == "special" and out[-1]["id"] in dec.delims:
                out.pop()
            out.append({"kind": "media", "text": f"<{m['label']}: {_size(m['resized_width'], m['resized_height'])}, "
                                                 f"{m['n_tokens']:,} tokens>", "loss": False})
            i += m["n_tokens"]
            if i < end and int(ids[i]) in dec.delims:
                i += 1
            continue
        t = int(ids[i])
        loss = bool(carries[i])
        if t in dec.specials:
            flush()
            out.append({"kind": "special", "id": t, "text": dec.decode([t]), "loss": loss})
        else:
            if run and loss != run_loss:
                flush()
            run_loss = loss
            run.append(t)
        i += 1
    flush()
    return out


def _text_of(pieces: list[dict]) -> str:
    """Join pieces, wrapping each maximal run of loss-carrying pieces in ⟦…⟧."""
    out, inside = [], False
    for p in pieces:
        if p["loss"] != inside:
            out.append(LOSS_OPEN if p["loss"] else LOSS_CLOSE)
            inside = p["loss"]
        out.append(p["text"])
    if inside:
        out.append(LOSS_CLOSE)
    return "".join(out)


def _take_header(pieces: list[dict], dec: _Decoder) -> tuple[str | None, list[dict]]:
    """Match the role header at the start of ``pieces``; return the role and the pieces after it."""
    if dec.header_re is None:
        return None, pieces
    m = dec.header_re.match("".join(p["text"] for p in pieces))
    if m is None:
        return None, pieces
    left = m.end()
    rest = []
    for p in pieces:
        if left >= len(p["text"]):
            left -= len(p["text"])
            continue
        rest.append({**p, "text": p["text"][left:]} if left else p)
        left = 0
    return m.group("role"), rest


def _turns(pieces: list[dict], dec: _Decoder, prev_role: str | None = None, open_header: list[dict] | None = None,
           is_prefix: bool = False) -> tuple[list[dict], str | None, list[dict] | None]:
    """Split pieces at turn-start tokens; read each turn's role from the template's header.

    A tree's shared prefix ends before the first token any branch needs loss on, which for
    branches that answer the same question is inside the answer's header (``<|im_start|>assistant``
    | ``\n``). The prefix (``is_prefix``) leaves such a header open: it shows no turn for it and
    hands its pieces on, and each branch reads them together with its own first pieces
    (``open_header``), so the branch's first turn gets its role.

    Returns the turns, the role the pieces after these continue, and the pieces of a header left
    open at the end (``None`` when none is).
    """
    tpl = dec.template
    if tpl is None or dec.turn_start is None:
        return [{"role": None, "continued": False, "text": _text_of(pieces), "segments": _segments(pieces)}], None, None
    groups: list[tuple[bool, list[dict]]] = [(open_header is None, list(open_header or []))]
    for p in pieces:
        if p["kind"] == "special" and p["id"] == dec.turn_start:
            groups.append((False, []))
        else:
            groups[-1][1].append(p)
    turns = []
    role = prev_role
    for i, (continued, body) in enumerate(groups):
        if not continued:
            role, rest = _take_header(body, dec)
            if is_prefix and i == len(groups) - 1 and (role is None or not rest):
                # the header (or all of it that is here) ends the prefix: the branches finish it
                return turns, role, (None if role else body)
            body = rest if role is not None else body
        # the newline after the end-of-turn token is layout, not content
        if body and body[-1]["kind"] == "text" and body[-1]["text"] == tpl.turn_newline and not body[-1]["loss"]:
            body = body[:-1]
        if body:
            turns.append({"role": role, "continued": continued, "text": _text_of(body), "segments": _segments(body)})
    return turns, role, None


def _segments(pieces: list[dict]) -> list[dict]:
    return [{"kind": p["kind"], "text": p["text"], "loss": p["loss"]} for p in pieces]


def _part_name(sub: int) -> str:
    local = sub % SUBSEGMENT_STRIDE
    return "prefix" if local == PREFIX_SUBSEGMENT else f"branch {local}"


def _sample_view(row: dict, a: int, b: int, k: int | None, media: list[dict], dec: _Decoder) -> dict:
    ids = np.asarray(row["input_ids"][a:b], dtype=np.int64)
    tgt = np.asarray(row["target_ids"][a:b], dtype=np.int64)
    pos = np.asarray(row["position_ids"][a:b], dtype=np.int64)
    sub = np.asarray(row["subsegment_ids"][a:b], dtype=np.int64)
    n = len(ids)
    # runs of equal subsegment id: the prefix, then each branch (a single-branch sample is one run)
    cuts = np.flatnonzero(np.diff(sub)) + 1
    starts = np.concatenate([[0], cuts]).astype(int)
    ends = np.concatenate([cuts, [n]]).astype(int)
    carries = np.zeros(n, dtype=bool)
    for s, e in zip(starts, ends, strict=True):
        # token t carries loss when the position before it (in the same run) predicts it
        carries[s + 1:e] = tgt[s:e - 1] != -100
    counters: dict[str, int] = {}
    views, spans = [], {}
    for m in sorted(media, key=lambda m: m["token_offset"]):
        counters[m["kind"]] = counters.get(m["kind"], 0) + 1
        off = m["token_offset"] - a
        v = _media_view(m, f"{m['kind']} {counters[m['kind']]}", off)
        views.append(v)
        spans[off] = v
    single = len(starts) == 1
    ruler, parts = [], []
    prev_role, open_header = None, None
    for s, e in zip(starts, ends, strict=True):
        name = "sample" if single else _part_name(int(sub[s]))
        ruler.append({"part": name, "tokens": [int(s), int(e - 1)], "positions": [int(pos[s]), int(pos[e - 1])],
                      "subsegment": int(sub[s])})
        pieces = _pieces(ids, carries, int(s), int(e), spans, dec)
        if name == "prefix":
            turns, prev_role, open_header = _turns(pieces, dec, is_prefix=True)
        else:
            turns = _turns(pieces, dec, prev_role, open_header)[0]
        parts.append({"part": name, "turns": turns})
    return {
        "index": k,
        "start": a,
        "end": b,
        "n_tokens": n,
        "n_loss_tokens": int((tgt != -100).sum()),
        "n_branches": max(1, sum(p["part"] != "prefix" for p in parts)),  # a tree may have no shared prefix
        "ruler": ruler,
        "parts": parts,
        "media": views,
    }


# ---------------------------------------------------------------------------------------------
# entry point


def inspect_dir(path: str | Path, pack: int | None = None, sample: str | None = None,
                tokenizer: str | None = None, source: str | None = None) -> dict:
    """Describe one pack (packed dir) or one sample (either dir) for reading.

    Args:
        path: a packed or tokenized directory.
        pack: the ``pack_index`` of the pack to show (packed directories; default: the first pack).
            A pack task numbers its packs from ``task * 1_000_000_000``, so a directory packed in
            several tasks holds packs 0, 1, ..., 1000000000, 1000000001, ...
        sample: a sample id; in a packed dir the pack holding it is shown with only that sample.
            When several samples bear the name (sources of a mixture sharing ids; samples of
            different tokenize tasks, which name apart only within a task) the first is shown
            and ``matches`` lists them all (``shown`` marks those in view); ``repeats`` lists the
            names tokenize gave later samples of the id in the same task (``ID#d1``, ...).
        tokenizer: a tokenizer.json or model directory to decode with instead of the recorded one.
        source: with ``sample``, only the samples from this source: in a mixture a source's
            name or recorded path, in a tokenized directory a row's input file.

    Raises:
        InputError: no such pack or sample (or none from ``source``).
        ConfigError: ``--pack`` on a tokenized directory, ``source`` without ``sample``, or on
            a packed directory that is no mixture, or naming no source of the mixture; or a
            tokenizer that does not match.
    """
    from .storage import fetch_output

    shown = str(path)  # what messages and the view name: the URL, not the local copy of a bucket's output
    path = fetch_output(path)  # a bucket's output is read from a checked local copy
    manifest = read_manifest(path)
    kind = manifest.get("kind")
    if pack is not None and sample is not None:
        raise ConfigError("give --pack or --sample, not both")
    if source is not None and sample is None:
        raise ConfigError("--source picks among the samples of one name: give --sample ID with it")
    matches: list[dict] = []
    repeats: list[str] = []
    tok_manifest = manifest if kind == "tokenized" else None
    src_dir = source_dir(path, manifest) if kind == "packed" else None
    if src_dir is not None and tokenizer is None:
        tok_manifest = read_manifest(src_dir)
    dec = _Decoder(_resolve_tokenizer(manifest, tok_manifest, tokenizer), _template(manifest))
    media_cols = _MEDIA_LEAVES + (["media.list.element.sample_index"] if kind == "packed" else [])
    if kind == "tokenized":
        if pack is not None:
            raise ConfigError(f"{shown!r} is a tokenized directory; it has samples, not packs: use --sample ID")
        if sample is None:
            if not manifest["shards"]:
                raise InputError(f"{shown!r} holds no samples")
            where = (manifest["shards"][0]["file"], 0)
        else:
            matches, repeats = _sample_matches(path, manifest, sample, packed=False)
            if source is not None:
                matches = _match_source(shown, manifest, matches, sample, source)
            where = (matches[0]["file"], matches[0]["row"]) if matches else None
            if where is None:
                why = _rejection(path, shown, sample, "tokenize rejected it")
                ex = ", ".join(repr(x) for x in _examples(path, manifest, "sample_id", False))
                raise InputError(f"sample {sample!r} is not in {shown!r}" + (
                    f": {why}" if why else (f" (e.g. {ex})" if ex else " (it holds no samples)") + _merge_note(manifest)))
        cols = ["sample_id", "source", "source_row", "n_tokens", "n_vision_units", "n_branches"] + _TOKEN_COLUMNS + media_cols
        row = _read_row(path, manifest, where[0], where[1], cols)
        view = _sample_view(row, 0, len(row["input_ids"]), None, row["media"], dec)
        view.update(sample_id=row["sample_id"], source=row["source"], source_row=row["source_row"],
                    n_vision_units=row["n_vision_units"])
        return {"kind": "sample", "dir": shown, "file": where[0], "row": where[1],
                "tokenizer": dec.tok.name, "template": dec.template.name if dec.template else None,
                "vision_unit": (manifest.get("vision") or {}).get("unit"), "samples": [view],
                **_more_of_the_name(matches, repeats, where, manifest)}
    in_view: set[int] = set()  # with --sample: the places in the pack shown of the samples of that name
    if sample is not None:
        matches, repeats = _sample_matches(path, manifest, sample, packed=True)
        if source is not None:
            matches = _match_source(shown, manifest, matches, sample, source)
        where = (matches[0]["file"], matches[0]["row"]) if matches else None
        in_view = {m["index"] for m in matches if (m["file"], m["row"]) == where}
        if where is None:
            ex = ", ".join(repr(x) for x in _examples(path, manifest, "sample_ids", True))
            if not ex:
                raise InputError(f"sample {sample!r} is in no pack of {shown!r}, which holds no packs: "
                                 f"{_why_no_packs(manifest)}")
            src = (manifest.get("source") or {}).get("path")
            why = _rejection(path, shown, sample, "pack dropped it") or (
                _rejection(src_dir, src, sample, "tokenize rejected it") if src_dir is not None else None)
            note = _merge_note(read_manifest(src_dir)) if why is None and src_dir is not None else ""
            raise InputError(f"sample {sample!r} is in no pack of {shown!r}" + (
                f": {why}" if why else f" (e.g. {ex}); a dropped sample is listed in {ERRORS}{note}"))
    elif pack is None:  # the first pack: pack 0 when pack task 0 made any
        first = next((e["file"] for e in manifest["shards"] if e["rows"]), None)
        if first is None:
            raise InputError(f"{shown!r} holds no packs: {_why_no_packs(manifest)}")
        where = (first, 0)
    else:
        where = _find_row(path, manifest, "pack_index", pack, is_list=False)
        if where is None:
            numbers = _pack_numbers(path, manifest)
            if not numbers:
                raise InputError(f"--pack {pack}: {shown!r} holds no packs: {_why_no_packs(manifest)}")
            count = f"its {len(numbers):,} packs are" if len(numbers) > 1 else "its one pack is"
            raise InputError(f"--pack {pack}: {shown!r} has no such pack; {count} numbered "
                             f"{_number_ranges(numbers)} (pack_index = task × 1000000000 + k); pass one of those")
    mixture = manifest.get("mixture")
    cols = (["pack_index", "n_tokens", "n_vision_units", "sample_ids", "cu_seqlens"] + _TOKEN_COLUMNS + media_cols
            + (["sample_sources"] if mixture else []))
    row = _read_row(path, manifest, where[0], where[1], cols)
    cu = row["cu_seqlens"]
    views = []
    for k, sid in enumerate(row["sample_ids"]):
        if sample is not None and k not in in_view:
            continue
        media = [m for m in row["media"] if m["sample_index"] == k]
        v = _sample_view(row, cu[k], cu[k + 1], k, media, dec)
        v["sample_id"] = sid
        if mixture:  # which source of the mixture the sample came from
            src = mixture["sources"][row["sample_sources"][k]]
            v["mixture_source"] = src.get("name") or src["path"]
        views.append(v)
    caps = manifest.get("capacities") or {}
    return {"kind": "pack", "dir": shown, "file": where[0], "row": where[1], "pack_index": row["pack_index"],
            "n_tokens": row["n_tokens"], "max_tokens": caps.get("max_tokens"), "n_vision_units": row["n_vision_units"],
            "max_vision_units": caps.get("max_vision_units"), "n_samples": len(row["sample_ids"]),
            "tokenizer": dec.tok.name, "template": dec.template.name if dec.template else None,
            "vision_unit": (manifest.get("vision") or {}).get("unit"), "samples": views,
            **_more_of_the_name(matches, repeats, where, manifest)}


def _more_of_the_name(matches: list[dict], repeats: list[str], where: tuple[str, int], manifest: dict) -> dict:
    """The ``matches`` and ``repeats`` keys of a view, each only when it says something: every
    sample of the name when there are several, the names tokenize derived from it when any."""
    out: dict = {}
    if len(matches) > 1:
        out["matches"] = []
        for m in matches:
            m = {**m, "shown": (m["file"], m["row"]) == where}
            if "source_index" in m:
                m["mixture_source"] = _mixture_source_name(manifest, m.pop("source_index"))
            out["matches"].append(m)
    if repeats:
        out["repeats"] = repeats
    return out


# ---------------------------------------------------------------------------------------------
# rendering


def _rng(pair: list[int]) -> str:
    a, b = pair
    return f"{a:,}" if a == b else f"{a:,}..{b:,}"


def _media_line(m: dict, unit: str) -> str:
    size = _size(m["width"], m["height"])
    resized = _size(m["resized_width"], m["resized_height"])
    t, h, w = m["grid"]
    line = (f"{m['label']}  {m['path'] or '(inline)'}  {size} -> {resized}  grid {t}×{h}×{w}  "
            f"{m['n_tokens']:,} tokens @ {m['token_offset']:,}  {m['vision_units']:,} {unit}")
    ts = m.get("timestamps")
    if ts:
        shown = ts if len(ts) <= 8 else ts[:4] + ["..."] + ts[-3:]
        line += f"  {len(ts)} frames at " + ", ".join(x if isinstance(x, str) else f"{x:g}" for x in shown) + " s"
        if m.get("source_frames") is not None and m.get("source_fps") is not None:
            line += f" (of {m['source_frames']:,} at {m['source_fps']:g} fps)"
    return line


def _indent(text: str, first: str, rest: str) -> list[str]:
    lines = text.split("\n")
    return [first + lines[0]] + [rest + x for x in lines[1:]]


def render_inspection(view: dict) -> str:
    """The human-readable text of :func:`inspect_dir` output."""
    unit = view.get("vision_unit") or "vision units"
    out = []
    if view["kind"] == "pack":
        fill = f" ({view['n_tokens'] / view['max_tokens']:.1%})" if view.get("max_tokens") else ""
        units = f" / {view['max_vision_units']:,}" if view.get("max_vision_units") else ""
        out.append(f"pack {view['pack_index']}  ({view['file']} row {view['row']})  {view['n_samples']} sample{'' if view['n_samples'] == 1 else 's'}  "
                   f"{view['n_tokens']:,} / {view['max_tokens']:,} tokens{fill}  {view['n_vision_units']:,}{units} {unit}")
    else:
        s = view["samples"][0]
        out.append(f"sample {s['sample_id']}  ({view['file']} row {view['row']}; from {s['source']} row {s['source_row']})  "
                   f"{s['n_tokens']:,} tokens  {s['n_vision_units']:,} {unit}")
    out.extend(_name_notes(view))
    out.append(f"{LOSS_OPEN}…{LOSS_CLOSE} marks tokens that carry loss; ranges are inclusive")
    for s in view["samples"]:
        out.append("")
        branches = f"  {s['n_branches']} branches" if s["n_branches"] > 1 else ""
        idx = f"[{s['index']}] " if s.get("index") is not None else ""
        where = f"tokens {s['start']:,}..{s['end'] - 1:,}" if view["kind"] == "pack" else f"{s['n_tokens']:,} tokens"
        origin = f"  from {s['mixture_source']}" if s.get("mixture_source") else ""
        out.append(f"{idx}{s['sample_id']}  {where}  {s['n_loss_tokens']:,} carry loss{branches}{origin}")
        for part in s["parts"]:
            pad = "  "
            if part["part"] != "sample":
                out.append(f"  {part['part']}:")
                pad = "    "
            for t in part["turns"]:
                role = (t["role"] or "") + (" (cont.)" if t["continued"] and t["role"] else "")
                out.extend(_indent(t["text"], f"{pad}{role:<12} ", f"{pad}{'':<12} "))
        for m in s["media"]:
            out.append(f"  media  {_media_line(m, unit)}")
        width = max(len(_rng(r["tokens"])) for r in s["ruler"])
        pwidth = max(len(_rng(r["positions"])) for r in s["ruler"])
        for i, r in enumerate(s["ruler"]):
            sub = r["subsegment"]
            k, local = divmod(sub, SUBSEGMENT_STRIDE)
            sub_txt = f"{k}*{SUBSEGMENT_STRIDE}+{local}" if k else f"{local}"
            head = "  ruler  " if i == 0 else "         "
            out.append(f"{head}tokens {_rng(r['tokens']).ljust(width)}  pos {_rng(r['positions']).ljust(pwidth)}  "
                       f"sub {sub_txt}  {r['part']}")
    return "\n".join(out)


def _listed(items: list[str]) -> str:
    more = len(items) - _MATCHES_LISTED
    return ", ".join(items[:_MATCHES_LISTED]) + (f" and {more:,} more" if more > 0 else "")


def _name_notes(view: dict) -> list[str]:
    """The ``note:`` lines of a view whose name stands for several samples, or that tokenize
    derived other names from (``matches`` and ``repeats`` of :func:`inspect_dir`)."""
    lines = []
    matches = view.get("matches")
    sid = view["samples"][0]["sample_id"] if view["samples"] else None
    if matches:
        packed = view["kind"] == "pack"
        places = []
        for m in matches:
            if packed:
                place = f"pack {m['pack_index']} [{m['index']}]" + (f" from {m['mixture_source']}"
                                                                    if "mixture_source" in m else "")
            else:
                place = f"{m['file']} row {m['row']} (from {m['source']} row {m['source_row']})"
            places.append(place + (" (shown)" if m["shown"] else ""))
        sources = {m.get("mixture_source", m.get("source")) for m in matches}
        if len(sources) > 1:
            how = "pick a source with --source " + ("NAME" if packed else "FILE")
            how += ", or a pack with --pack N" if packed else ""
        elif packed:
            how = "see another with --pack N"
        else:
            how = ("tokenize names samples apart only within one task (input slice), and these come from different "
                   "tasks of one input: give the records ids of their own")
        lines.append(f"note: {len(matches):,} samples are named {sid!r}: {_listed(places)}; {how}")
    if view.get("repeats"):
        lines.append(f"note: tokenize stored later samples with this id under names of their own (a task holds each "
                     f"name once): {_listed(view['repeats'])}; inspect them by those names")
    return lines


def _why_no_packs(manifest: dict) -> str:
    c = manifest.get("counts") or {}
    return why_no_packs(c.get("samples_in", 0), c.get("dropped", 0), c.get("rejected", 0))
