"""What the packer did, in numbers a person can check: fill, waste, padding, drops.

Three views share one JSON shape (``schemas/stats.v1.json``, ``stats_version`` 1):

* a **tokenized** directory: samples, lengths, branches per tree, rejections, sources;
* a **packed** directory: packs, token and vision fill, packs against the lower bound,
  samples per pack, padding against naive padded batching, drops. The tokenized
  directory it was packed from (recorded in its manifest, or given explicitly) adds
  input order, per-source counts, branches, and a reconciliation of every input row;
* a **plan** (``pack --dry-run``, ``sweep``): the packed view computed from
  :class:`~packtool.packer.PackPlan` objects and the tokenized length columns alone.

Only length columns are read (``n_tokens``, ``n_vision_units``, ``cu_seqlens``, the
``n_tokens`` leaf of ``media``), never token ids or media bytes, so stats stay cheap
on large corpora.

    >>> s = compute_stats("packed/")                      # doctest: +SKIP
    >>> s["token_fill"]["mean"], s["packs"], s["lower_bound"]   # doctest: +SKIP
    (0.9731, 1204, 1190)
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .errors import ConfigError, InputError
from .pipeline import lower_bound
from .shards import RUN_STATE, STATE_DIR, errors_path, read_manifest, read_shard
from .storage import fetch_output, source_dir, source_name

__all__ = [
    "STATS_VERSION",
    "NAIVE_BATCH_SIZES",
    "StatsData",
    "Thresholds",
    "load_stats_data",
    "plan_stats_data",
    "summarize",
    "compute_stats",
    "plan_stats",
    "check_thresholds",
    "render_stats",
    "naive_padding",
    "pack_padding",
    "sweep",
    "render_sweep",
    "mixture_summary",
    "mixture_rejected",
    "render_mixture",
]

log = logging.getLogger(__name__)

#: Version of the ``stats --json`` shape; bump it (and add ``schemas/stats.vN.json``) on any
#: change that removes or renames a key or changes a type. Adding a key keeps the version.
STATS_VERSION = 1

#: Batch sizes at which naive padded batching is measured.
NAIVE_BATCH_SIZES = (8, 32)


# ---------------------------------------------------------------------------------------------
# numeric helpers


def naive_padding(lengths: np.ndarray, batch_size: int) -> tuple[int, int]:
    """Padding spent by naive batching: consecutive samples, each padded to the batch's longest.

    Returns ``(pad_tokens, slots)``: ``slots`` is the token positions the batches occupy
    (``Σ batch_len × longest``), ``pad_tokens = slots - Σ lengths``. The last batch holds
    what is left and is padded only to its own longest sample.

    Example:
        >>> naive_padding(np.array([3, 1, 4, 1, 5]), 2)   # [3,1] [4,1] [5]
        (5, 19)
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    if n == 0:
        return 0, 0
    starts = np.arange(0, n, batch_size)
    longest = np.maximum.reduceat(lengths, starts)
    sizes = np.diff(np.append(starts, n))
    slots = int((longest * sizes).sum())
    return slots - int(lengths.sum()), slots


def pack_padding(pack_tokens: np.ndarray, max_tokens: int) -> tuple[int, int]:
    """Padding of fixed-length packs: every pack is padded to ``max_tokens``.

    A pack longer than ``max_tokens`` (an oversize sample packed alone) occupies its own
    length and adds no padding. Returns ``(pad_tokens, slots)``.

    Example:
        >>> pack_padding(np.array([8000, 8192, 9000]), 8192)
        (192, 25384)
    """
    t = np.asarray(pack_tokens, dtype=np.int64)
    slots = int(np.maximum(t, max_tokens).sum())
    return slots - int(t.sum()), slots


def _dist(x: np.ndarray) -> dict | None:
    """``{"mean", "p5", "p50", "p95", "min", "max"}`` of ``x`` (linear-interpolated percentiles)."""
    x = np.asarray(x, dtype=np.float64)
    if len(x) == 0:
        return None
    p5, p50, p95 = np.percentile(x, [5, 50, 95])
    return {"mean": round(float(x.mean()), 4), "p5": round(float(p5), 4), "p50": round(float(p50), 4),
            "p95": round(float(p95), 4), "min": round(float(x.min()), 4), "max": round(float(x.max()), 4)}


def _hist(x: np.ndarray) -> dict | None:
    """A distribution plus ``histogram``: count per integer value (keys are strings, ascending)."""
    d = _dist(x)
    if d is None:
        return None
    values, counts = np.unique(np.asarray(x, dtype=np.int64), return_counts=True)
    d["histogram"] = {str(int(v)): int(c) for v, c in zip(values, counts, strict=True)}
    return d


def _list_sum(col: pa.ChunkedArray | pa.Array, leaf: str | None = None) -> np.ndarray:
    """Per-row sum of a list column (of a struct's ``leaf`` field when given)."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    flat = pc.list_flatten(arr)
    if leaf is not None:
        flat = pc.struct_field(flat, leaf)
    parents = pc.list_parent_indices(arr).to_numpy(zero_copy_only=False)
    values = flat.to_numpy(zero_copy_only=False).astype(np.int64)
    return np.bincount(parents, weights=values, minlength=len(arr)).astype(np.int64)


def _concat(parts: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)


# ---------------------------------------------------------------------------------------------
# loading


@dataclass(slots=True)
class StatsData:
    """The arrays statistics are computed from (also what ``--plot`` draws).

    Attributes:
        kind: ``"tokenized"``, ``"packed"`` or ``"plan"``.
        sample_*: one entry per tokenized sample in input order (``None`` without a tokenized dir);
            ``sample_id`` an Arrow string array, ``sample_source`` int32 codes into ``source_names``.
        packed_mask: which tokenized samples are in a pack.
        pack_*: one entry per pack in pack order (``None`` for a tokenized dir).
        pack_sample_tokens: lengths of the samples as packed, pack after pack (``pack_sample_ids``
            their ids, an Arrow string array).
    """

    kind: str
    tokenized_path: Path | None = None
    packed_path: Path | None = None
    tok_manifest: dict | None = None
    packed_manifest: dict | None = None
    capacities: dict | None = None
    oversize: str | None = None
    sample_id: pa.ChunkedArray | None = None
    sample_source: np.ndarray | None = None
    source_names: list[str] = field(default_factory=list)
    sample_tokens: np.ndarray | None = None
    sample_units: np.ndarray | None = None
    sample_vision_tokens: np.ndarray | None = None
    sample_branches: np.ndarray | None = None
    packed_mask: np.ndarray | None = None
    pack_tokens: np.ndarray | None = None
    pack_units: np.ndarray | None = None
    pack_vision_tokens: np.ndarray | None = None
    pack_samples: np.ndarray | None = None
    pack_sample_ids: pa.ChunkedArray | None = None
    pack_sample_tokens: np.ndarray | None = None
    dropped: int = 0
    alone: int = 0
    truncated: int = 0
    pack_rejected: dict = field(default_factory=dict)
    pack_errors: list[dict] | None = None
    shared_ids: int = 0
    notes: list[str] = field(default_factory=list)


def _read(path: Path, entry: dict, columns: list[str]) -> pa.Table:
    # full leaf paths select one field of the media struct, so media bytes are never read
    return read_shard(path, entry, columns)


def _read_errors(path: Path) -> list[dict]:
    file = errors_path(path)
    if not file.is_file():
        return []
    out = []
    with open(file, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                out.append(json.loads(line))
    return out


def _load_tokenized(data: StatsData, path: Path, manifest: dict) -> None:
    cols = ["sample_id", "source", "n_tokens", "n_vision_units", "n_branches", "media.list.element.n_tokens"]
    srcs, tok, units, vt, br = [], [], [], [], []
    ids_arrow = []
    names: dict[str, int] = {}
    for entry in manifest["shards"]:
        t = _read(path, entry, cols)
        ids_arrow.append(t["sample_id"])
        srcs.append(_codes(t["source"], names))
        tok.append(t["n_tokens"].to_numpy())
        units.append(t["n_vision_units"].to_numpy())
        br.append(t["n_branches"].to_numpy())
        vt.append(_list_sum(t["media"], "n_tokens"))
    data.tokenized_path = path
    data.tok_manifest = manifest
    # ids stay Arrow strings and sources codes into their names: a numpy object array is a Python
    # string a row (about 0.6 KB a sample with the counters that matched them: 61 GB at 100M)
    data.sample_id = _strings(ids_arrow)
    data.sample_source = _concat(srcs, np.int32)
    data.source_names = list(names)
    data.sample_tokens = _concat(tok, np.int64)
    data.sample_units = _concat(units, np.int64)
    data.sample_vision_tokens = _concat(vt, np.int64)
    data.sample_branches = _concat(br, np.int64)
    # a task names its samples apart, tasks do not (a run-wide check would read every id again):
    # one hash pass here, and a count of the samples that share an id only when some do
    ids = data.sample_id
    if len(ids) and pc.count_distinct(ids).as_py() < len(ids):
        n = pc.value_counts(ids).field("counts").to_numpy(zero_copy_only=False)
        data.shared_ids = int(n[n > 1].sum())
        data.notes.append(f"{data.shared_ids:,} samples of the tokenized directory share their id with another "
                          "(tokenize names samples apart only within one task, an input slice): `packtool inspect "
                          "--sample ID` lists each; give the records ids of their own")


def _unmark_dropped(data: StatsData, path: Path, manifest: dict) -> None:
    """Take the samples pack dropped out of ``data.packed_mask`` when ids are shared: a dropped
    sample's id may be in a pack all the same, another sample's. ``errors.jsonl`` names each drop
    by its id and input row (``source``, ``row``), as the tokenized rows do."""
    drops = Counter((e.get("sample_id"), e.get("source"), e.get("row")) for e in data.pack_errors or [])
    ids = np.array(sorted({k[0] for k in drops if isinstance(k[0], str)}), dtype=object)
    maybe = np.flatnonzero(data.packed_mask & is_in(data.sample_id, ids))
    if not len(maybe):
        return
    rows = _concat([_read(path, e, ["source_row"])["source_row"].to_numpy() for e in manifest["shards"]], np.int64)
    sids = data.sample_id.take(maybe).to_pylist()
    for i, sid in zip(maybe.tolist(), sids, strict=True):
        key = (sid, data.source_names[data.sample_source[i]], int(rows[i]))
        if drops[key]:
            drops[key] -= 1
            data.packed_mask[i] = False


def _load_packed(data: StatsData, path: Path, manifest: dict) -> None:
    cols = ["n_tokens", "n_vision_units", "sample_ids", "cu_seqlens", "media.list.element.n_tokens"]
    tok, units, vt, nsamp, ids, slen = [], [], [], [], [], []
    for entry in manifest["shards"]:
        t = _read(path, entry, cols)
        tok.append(t["n_tokens"].to_numpy())
        units.append(t["n_vision_units"].to_numpy())
        vt.append(_list_sum(t["media"], "n_tokens"))
        sid = t["sample_ids"].combine_chunks()
        nsamp.append(pc.list_value_length(sid).to_numpy(zero_copy_only=False))
        ids.append(pc.list_flatten(sid))
        cu = t["cu_seqlens"].combine_chunks()
        v = pc.list_flatten(cu).to_numpy(zero_copy_only=False).astype(np.int64)
        parent = pc.list_parent_indices(cu).to_numpy(zero_copy_only=False)
        slen.append((v[1:] - v[:-1])[parent[1:] == parent[:-1]])
    caps = manifest.get("capacities") or {}
    counts = manifest.get("counts") or {}
    data.packed_path = path
    data.packed_manifest = manifest
    data.capacities = {"max_tokens": int(caps.get("max_tokens", 0)), "max_vision_units": int(caps.get("max_vision_units", 0))}
    data.oversize = (manifest.get("config") or {}).get("oversize")
    data.pack_tokens = _concat(tok, np.int64)
    data.pack_units = _concat(units, np.int64)
    data.pack_vision_tokens = _concat(vt, np.int64)
    data.pack_samples = _concat(nsamp, np.int64)
    data.pack_sample_ids = _strings(ids)
    data.pack_sample_tokens = _concat(slen, np.int64)
    data.dropped = int(counts.get("dropped", 0))
    data.alone = int(counts.get("alone", 0))
    data.truncated = int(counts.get("truncated", 0))
    data.pack_rejected = dict(counts.get("rejected_by_reason") or {})
    data.pack_errors = _read_errors(path)


def _packed_other_shards(packed_path: Path, tok_manifest: dict) -> bool:
    """Whether the tokenized directory of ``tok_manifest`` holds other shards than the packed run at
    ``packed_path`` packed: tokenized again since with the same settings (an input file changed),
    which the config digest cannot tell. The run state records the sha256 of every tokenized shard
    it packed (``inputs``); where it is not there to read (a copy without it), nothing is said."""
    try:
        packed_inputs = json.loads((Path(packed_path) / STATE_DIR / RUN_STATE).read_text()).get("inputs")
    except (OSError, ValueError, AttributeError):
        return False
    if not isinstance(packed_inputs, dict):
        return False
    shards = tok_manifest.get("shards") or []
    return packed_inputs != {e.get("file"): e.get("sha256") for e in shards if isinstance(e, dict)}


def load_stats_data(path: str | Path, packed: str | Path | None = None) -> StatsData:
    """Read the arrays for statistics.

    Args:
        path: a tokenized or packed directory.
        packed: with ``path`` tokenized, the packed directory made from it (the pair is
            reconciled). With ``path`` packed and ``packed`` None, the tokenized directory
            recorded in the packed manifest is used when it still exists and matches.

    Raises:
        InputError: a directory is not a finished packtool output, or the pair does not match.
    """
    # messages name the paths as given: a bucket's output is read from a checked local copy
    shown, shown_packed = str(path), None if packed is None else str(packed)
    path = fetch_output(path)
    first = read_manifest(path)
    changed = None  # what the tokenized directory a packed one names holds now, when it is not what was packed
    if packed is not None:
        if first.get("kind") != "tokenized":
            raise InputError(f"{shown!r} holds {first.get('kind')} shards; `stats TOKENIZED PACKED` takes the tokenized directory first")
        tok_path, tok_manifest = path, first
        packed_path = fetch_output(packed)
        packed_manifest = read_manifest(packed_path, "packed")
        if "mixture" in packed_manifest:
            raise InputError(f"{shown_packed!r} is a mixture of {_n_dirs(len(packed_manifest['mixture']['sources']))}; "
                             f"run `packtool stats {shown_packed}` for its per-source shares")
        want = (packed_manifest.get("source") or {}).get("config_digest") or packed_manifest["config"].get("source_digest")
        if want and want != tok_manifest.get("config_digest"):
            raise InputError(
                f"{shown_packed!r} was packed from a tokenized run with config digest {want}, but {shown!r} "
                f"has {tok_manifest.get('config_digest')}; pass the tokenized directory it was made from"
            )
        if _packed_other_shards(packed_path, tok_manifest):
            raise InputError(
                f"{shown_packed!r} was packed from other tokenized shards than {shown!r} holds now (it was tokenized "
                "again since, with the same settings: its inputs changed); pass the tokenized directory it was made "
                f"from, or pack {shown!r} again"
            )
    elif first.get("kind") == "packed":
        packed_path, packed_manifest = path, first
        tok_path = source_dir(path, first)
        tok_manifest = None
        if tok_path is not None:
            tok_manifest = read_manifest(tok_path)
            want = (first.get("source") or {}).get("config_digest")
            if tok_manifest.get("kind") != "tokenized":
                changed = f"now holds {tok_manifest.get('kind')} shards"
            elif want and want != tok_manifest.get("config_digest"):
                changed = (f"was tokenized again since (config digest {tok_manifest.get('config_digest')}; "
                           f"these packs were made from {want})")
            elif _packed_other_shards(path, tok_manifest):
                changed = ("was tokenized again since, with the same settings (its shards are not the ones these "
                           "packs were made from)")
            if changed:
                tok_path, tok_manifest = None, None
    else:
        data = StatsData("tokenized")
        _load_tokenized(data, path, first)
        return data
    data = StatsData("packed")
    _load_packed(data, packed_path, packed_manifest)
    if "mixture" in packed_manifest:
        data.notes.append(f"a mixture of {_n_dirs(len(packed_manifest['mixture']['sources']))}: "
                          "requested and realised shares per source are in the mixture table; input order, branches and reconciliation "
                          "are per directory: packtool stats TOKENIZED")
        return data
    if tok_path is None:
        src = (packed_manifest.get("source") or {}).get("path")
        if changed:  # re-tokenized in place since: naming it as the fix would only fail on the digest
            data.notes.append(f"the tokenized directory {src!r} {changed}: no input order, sources, branches or "
                              "reconciliation; to have them, pass the tokenized directory it was packed from "
                              "first: packtool stats TOKENIZED PACKED")
        else:
            data.notes.append("tokenized directory not found: no input order, sources, branches or reconciliation; "
                              "pass it first: packtool stats TOKENIZED PACKED")
        return data
    _load_tokenized(data, tok_path, tok_manifest)
    data.packed_mask = is_in(data.sample_id, data.pack_sample_ids)
    if data.shared_ids and data.pack_errors:
        _unmark_dropped(data, tok_path, tok_manifest)
    return data


def _codes(column: pa.ChunkedArray, names: dict[str, int]) -> np.ndarray:
    """Each string of ``column`` as its index in ``names``, which takes the strings not seen yet
    (in order of first sight): int32 codes, one Python string per distinct value."""
    out = []
    for chunk in column.chunks:
        enc = chunk.dictionary_encode()
        local = np.array([names.setdefault(v, len(names)) for v in enc.dictionary.to_pylist()], dtype=np.int32)
        out.append(local[enc.indices.to_numpy(zero_copy_only=False)] if len(local) else np.zeros(0, np.int32))
    return _concat(out, np.int32)


def _strings(parts: list) -> pa.ChunkedArray:
    """Arrow string arrays (or chunked arrays) as one chunked array, no copy of the strings."""
    chunks = [c for p in parts for c in (p.chunks if isinstance(p, pa.ChunkedArray) else [p])]
    return pa.chunked_array(chunks, type=pa.string())


def _unmatched(expected: pa.ChunkedArray, landed: pa.ChunkedArray) -> tuple[int, int]:
    """``(missing, extra)``: the ids of ``expected`` that ``landed`` lacks, and those ``landed``
    has over ``expected``, both counted with repeats (a multiset difference, as two hash
    counts joined on the id, not a Python counter of every id).

    Example:
        >>> _unmatched(_strings([pa.array(["a", "a", "b"])]), _strings([pa.array(["a", "c", "c"])]))
        (2, 2)
    """
    def counts(ids: pa.ChunkedArray, name: str) -> pa.Table:
        vc = pc.value_counts(ids) if len(ids) else pa.StructArray.from_arrays(
            [pa.array([], pa.string()), pa.array([], pa.int64())], ["values", "counts"])
        return pa.table({"id": vc.field("values"), name: vc.field("counts")})

    both = counts(expected, "want").join(counts(landed, "got"), "id", join_type="full outer")
    diff = pc.subtract(pc.fill_null(both["want"], 0), pc.fill_null(both["got"], 0)).to_numpy()
    return int(diff[diff > 0].sum()), int(-diff[diff < 0].sum())


def is_in(ids, value_set) -> np.ndarray:
    """Which of ``ids`` (strings) occur in ``value_set``: one hash join, linear in both sizes.

    ``np.isin`` on object arrays compares element by element (quadratic: 23 s for 50,000
    samples); Arrow hashes the value set once.

    Example:
        >>> is_in(np.array(["a", "b", "c"], dtype=object), np.array(["c", "a"], dtype=object)).tolist()
        [True, False, True]
    """
    if len(ids) == 0:
        return np.zeros(0, dtype=bool)
    values = value_set if isinstance(value_set, pa.ChunkedArray) else pa.array(value_set, pa.string())
    if values.nbytes >= 1 << 31:  # one array of more string bytes than int32 offsets address
        values, ids = values.cast(pa.large_string()), (ids if isinstance(ids, pa.ChunkedArray) else
                                                       pa.array(ids, pa.string())).cast(pa.large_string())
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    found = pc.is_in(ids if isinstance(ids, pa.ChunkedArray | pa.Array) else pa.array(ids, type=pa.string()),
                     value_set=values)
    return np.asarray(found.to_numpy(zero_copy_only=False) if isinstance(found, pa.Array) else found.to_numpy(),
                      dtype=bool)


def plan_stats_data(tokenized: str | Path, result: dict) -> StatsData:
    """Arrays for the statistics of a dry-run plan (``pack_dataset(..., dry_run=True)``).

    Pack loads come from each shard's plan over the tokenized length columns; truncated
    samples count ``max_tokens`` tokens, as the packer would cut them.
    """
    tokenized = fetch_output(tokenized)
    data = StatsData("plan")
    tok_manifest = read_manifest(tokenized, "tokenized")
    _load_tokenized(data, tokenized, tok_manifest)
    caps = result["capacities"]
    max_tokens = int(caps["max_tokens"])
    data.capacities = {"max_tokens": max_tokens, "max_vision_units": int(caps["max_vision_units"])}
    data.oversize = result["config"].get("oversize")
    plans = result.get("plans")
    if plans is None or len(plans) != len(tok_manifest["shards"]):
        raise RuntimeError("internal error: dry-run result lacks one plan per tokenized shard")
    starts = np.concatenate([[0], np.cumsum([e["rows"] for e in tok_manifest["shards"]])]).astype(np.int64)
    eff = data.sample_tokens.copy()
    mask = np.zeros(len(eff), dtype=bool)
    tok, units, vt, nsamp, order_all = [], [], [], [], []
    for base, plan in zip(starts[:-1], plans, strict=True):
        if plan.truncated:
            eff[base + np.asarray(plan.truncated, dtype=np.int64)] = max_tokens
        if plan.n_packs == 0:
            continue
        order = base + plan.order
        first = plan.offsets[:-1]
        tok.append(np.add.reduceat(eff[order], first))
        units.append(np.add.reduceat(data.sample_units[order], first))
        vt.append(np.add.reduceat(data.sample_vision_tokens[order], first))
        nsamp.append(np.diff(plan.offsets))
        order_all.append(order)
        mask[order] = True
    order = _concat(order_all, np.int64)
    data.pack_tokens = _concat(tok, np.int64)
    data.pack_units = _concat(units, np.int64)
    data.pack_vision_tokens = _concat(vt, np.int64)
    data.pack_samples = _concat(nsamp, np.int64)
    data.pack_sample_ids = data.sample_id.take(order)
    data.pack_sample_tokens = eff[order]
    data.packed_mask = mask
    c = result["counts"]
    data.dropped, data.alone, data.truncated = int(c.get("dropped", 0)), int(c.get("alone", 0)), int(c.get("truncated", 0))
    data.pack_rejected = dict(c.get("rejected_by_reason") or ({"oversize": data.dropped} if data.dropped else {}))
    return data


# ---------------------------------------------------------------------------------------------
# summary (the JSON shape)


def _padding(data: StatsData) -> dict | None:
    if data.pack_tokens is None:
        lengths, order = data.sample_tokens, "input"
        packtool = None
    else:
        if data.sample_tokens is not None:
            lengths = data.sample_tokens[data.packed_mask]
            if data.oversize == "truncate":
                lengths = np.minimum(lengths, data.capacities["max_tokens"])
            order = "input"
        else:
            lengths, order = data.pack_sample_tokens, "pack"
        pad, slots = pack_padding(data.pack_tokens, data.capacities["max_tokens"])
        packtool = {"pad_tokens": pad, "slots": slots, "waste": round(pad / slots, 4) if slots else 0.0}
    naive = []
    for b in NAIVE_BATCH_SIZES:
        pad, slots = naive_padding(lengths, b)
        naive.append({"batch_size": b, "pad_tokens": pad, "slots": slots, "waste": round(pad / slots, 4) if slots else 0.0})
    return {"order": order, "packtool": packtool, "naive": naive}


def _sources(data: StatsData, tok_rejects: list[dict]) -> list[dict] | None:
    if data.sample_source is None:
        return None
    rows: dict[str, dict] = {}

    def row(src: str) -> dict:
        if src not in rows:
            rows[src] = {"source": src, "samples": 0, "packed": 0, "dropped": 0, "rejected": 0,
                         "tokens": 0, "vision_units": 0}
        return rows[src]

    packed = data.packed_mask if data.packed_mask is not None else np.ones(len(data.sample_source), bool)
    # one pass per column over source codes (a Python loop per sample took seconds at 1M)
    names, code = data.source_names, data.sample_source
    k = len(names)
    per = {"samples": np.bincount(code, minlength=k), "tokens": np.bincount(code, weights=data.sample_tokens, minlength=k),
           "vision_units": np.bincount(code, weights=data.sample_units, minlength=k),
           "packed": np.bincount(code, weights=packed.astype(np.int64), minlength=k)}
    for i, src in enumerate(names):
        r = row(src)
        for key, arr in per.items():
            r[key] += int(arr[i])
    for e in tok_rejects:
        row(str(e.get("source")))["rejected"] += 1
    for r in rows.values():
        # pack drops are the source's samples that are in no pack
        r["dropped"] = r["samples"] - r["packed"] if data.packed_mask is not None else None
        if data.packed_mask is None:
            r["packed"] = None
    return sorted(rows.values(), key=lambda r: r["source"])


def _reconcile(data: StatsData) -> dict | None:
    if data.kind != "packed" or data.sample_id is None:
        return None
    tc = (data.tok_manifest or {}).get("counts") or {}
    tok_rej = dict(tc.get("rejected_by_reason") or {})
    rows_in = int(tc.get("rows_in", len(data.sample_id) + sum(tok_rej.values())))
    n_tok_rej = sum(tok_rej.values())
    # --group-by-media folds records into one tree; --max-branches/--max-tokens split trees
    merged = int(tc.get("merged_records", 0))
    split = int(tc.get("split_extra_trees", 0))
    n_pack_rej = sum(data.pack_rejected.values())
    # a drop without a string id matches no sample: null, counted as landed over what was expected
    dropped_ids = pa.chunked_array([pa.array([e.get("sample_id") if isinstance(e.get("sample_id"), str) else None
                                              for e in (data.pack_errors or [])], pa.string())])
    missing, extra = _unmatched(data.sample_id, _strings([data.pack_sample_ids, dropped_ids]))
    n_packed = int(data.pack_samples.sum())
    balanced = (rows_in == n_packed + n_tok_rej + n_pack_rej + merged - split
                and len(data.sample_id) == n_packed + n_pack_rej
                and missing == 0 and extra == 0)
    return {
        "rows_in": rows_in,
        "tokenize_rejected": n_tok_rej,
        "merged_records": merged,
        "split_extra_trees": split,
        "samples_tokenized": int(len(data.sample_id)),
        "pack_rejected": n_pack_rej,
        "samples_packed": n_packed,
        "missing": int(missing),
        "extra": int(extra),
        "balanced": bool(balanced),
    }


def summarize(data: StatsData) -> dict:
    """The ``stats --json`` dict (shape: ``schemas/stats.v1.json``) of loaded arrays."""
    caps = data.capacities
    tok_manifest = data.tok_manifest or {}
    vision = (data.packed_manifest or {}).get("vision") or tok_manifest.get("vision") or {}
    tc = tok_manifest.get("counts") or {}
    tok_rej = dict(tc.get("rejected_by_reason") or {})
    rows_in = int(tc["rows_in"]) if "rows_in" in tc else None
    mixture = (data.packed_manifest or {}).get("mixture")
    if mixture is not None and data.tok_manifest is None:
        rows_in, tok_rej = _mixture_rows(mixture)
    tok_rejects = _read_errors(data.tokenized_path) if data.tokenized_path is not None else []
    if data.pack_tokens is not None:
        n_samples = int(data.pack_samples.sum())
        tokens = int(data.pack_tokens.sum())
        vision_tokens = int(data.pack_vision_tokens.sum())
        units = int(data.pack_units.sum())
        max_t, max_u = caps["max_tokens"], caps["max_vision_units"]
        n_packs = int(len(data.pack_tokens))
        # a pack over capacity holds one --oversize alone sample: one pack of the bound each
        over = (data.pack_tokens > max_t) | (data.pack_units > max_u)
        lb = lower_bound(tokens - int(data.pack_tokens[over].sum()), units - int(data.pack_units[over].sum()), max_t,
                         max_u, int(over.sum()))
        packs = {
            "packs": n_packs,
            "lower_bound": lb,
            "packs_over_lower_bound": round(n_packs / lb, 4) if lb else None,
            "token_fill": _dist(data.pack_tokens / max_t) if max_t else None,
            "vision_fill": _dist(data.pack_units / max_u) if max_u else None,
            "samples_per_pack": _hist(data.pack_samples),
        }
        sample_lengths = data.pack_sample_tokens
        branches = data.sample_branches[data.packed_mask] if data.sample_branches is not None else None
    else:
        n_samples = int(len(data.sample_tokens))
        tokens = int(data.sample_tokens.sum())
        vision_tokens = int(data.sample_vision_tokens.sum())
        units = int(data.sample_units.sum())
        packs = {"packs": None, "lower_bound": None, "packs_over_lower_bound": None, "token_fill": None,
                 "vision_fill": None, "samples_per_pack": None}
        sample_lengths = data.sample_tokens
        branches = data.sample_branches
    return {
        "stats_version": STATS_VERSION,
        "kind": data.kind,
        "tokenized": source_name(data.tokenized_path) if data.tokenized_path is not None else None,
        "packed": source_name(data.packed_path) if data.packed_path is not None else None,
        "capacities": caps,
        "vision_unit": vision.get("unit"),
        "rows_in": rows_in,
        "samples": n_samples,
        **{k: packs[k] for k in ("packs", "lower_bound", "packs_over_lower_bound")},
        "tokens": tokens,
        "vision_tokens": vision_tokens,
        "vision_units": units,
        "vision_token_share": round(vision_tokens / tokens, 4) if tokens else 0.0,
        **{k: packs[k] for k in ("token_fill", "vision_fill", "samples_per_pack")},
        "sample_tokens": _dist(sample_lengths),
        "branches_per_sample": _hist(branches) if branches is not None else None,
        "padding": _padding(data),
        "sources": _sources(data, tok_rejects),
        "dropped": data.dropped,
        "alone": data.alone,
        "truncated": data.truncated,
        "rejected": {"total": sum(tok_rej.values()) + sum(data.pack_rejected.values()),
                     "tokenize": dict(sorted(tok_rej.items())), "pack": dict(sorted(data.pack_rejected.items()))},
        "reconcile": _reconcile(data),
        "mixture": mixture_summary(data.packed_manifest["mixture"])
        if data.packed_manifest is not None and "mixture" in data.packed_manifest else None,
        "thresholds": [],
        "notes": list(data.notes),
    }


def _mixture_rows(mixture: dict) -> tuple[int | None, dict]:
    """The rows a mixture's sources' tokenize runs read, and those they rejected by reason, each
    source once (as its manifest counted them when the mixture was packed; the rejected-rows gate
    weights them by rate, :func:`mixture_rejected`). A source recorded without its reasons (an
    earlier packtool's mixture) counts its rejections under ``unknown``; ``None`` rows when a
    source recorded no counts."""
    rows: int | None = 0
    rejected: dict[str, int] = {}
    for src in mixture.get("sources") or []:
        t = src.get("tokenized")
        if not isinstance(t, dict):
            rows = None
            continue
        if rows is not None:
            rows += int(t.get("rows_in", 0))
        by = t.get("rejected_by_reason")
        if not isinstance(by, dict):
            by = {"unknown": int(t.get("rejected", 0))} if t.get("rejected") else {}
        for reason, n in by.items():
            rejected[reason] = rejected.get(reason, 0) + int(n)
    return rows, rejected


def compute_stats(path: str | Path, packed: str | Path | None = None) -> dict:
    """Statistics of a tokenized or packed directory, or of a (tokenized, packed) pair.

    Args:
        path: a tokenized or packed directory.
        packed: with ``path`` tokenized, the packed directory made from it (see
            :func:`load_stats_data`).

    Returns the report; ``schemas/stats.v1.json`` gives its shape.
    """
    return summarize(load_stats_data(path, packed))


def plan_stats(tokenized: str | Path, result: dict) -> dict:
    """Statistics of a dry-run plan, in the same shape as :func:`compute_stats` (``kind`` ``"plan"``)."""
    return summarize(plan_stats_data(tokenized, result))


# ---------------------------------------------------------------------------------------------
# mixtures


def _share(part: int, total: int) -> float:
    return round(part / total, 4) if total else 0.0


def _n_dirs(n: int) -> str:
    return f"{n} tokenized director{'y' if n == 1 else 'ies'}"


def mixture_summary(mix: dict) -> dict:
    """Requested against realised share of each source of a mixture (the manifest's ``mixture``).

    *Requested* is what the rates asked for: the samples the rounding rule selected and their
    tokens and vision units. *Realised* is what the packs hold. Loss tokens are known only for
    packed samples (tokenized rows do not count them), so they have a realised share only.
    A warning names every source whose request could not be met as asked: samples rejected at
    pack time (oversize, changed media), a target count above the source's size (met only by
    up-sampling), a source without samples.

    Example:
        >>> src = lambda n, got: {"path": "a", "rate": "1", "available": n, "requested": n,
        ...     "selected": {"samples": n, "tokens": 10 * n, "vision_units": n},
        ...     "realised": {"samples": got, "tokens": 10 * got, "vision_units": got, "loss_tokens": got, "rejected": n - got}}
        >>> m = mixture_summary({"seed": 0, "group_by": "none", "sources": [src(3, 3), src(1, 0)]})
        >>> m["sources"][0]["requested_share"]["samples"], m["sources"][0]["realised_share"]["samples"]
        (0.75, 1.0)
        >>> m["warnings"]
        ["source 'a' (2): 0 of 1 requested samples packed (1 rejected at pack time; see .packtool/errors.jsonl); its share of samples is 0.0%, requested 25.0%"]
    """
    sources = mix["sources"]
    keys = ("samples", "tokens", "vision_units")
    sel_total = {k: sum(int(s["selected"][k]) for s in sources) for k in keys}
    # a dry run assembles nothing, so it has no loss tokens to count
    real_keys = (*keys, "loss_tokens") if all("loss_tokens" in s["realised"] for s in sources) else keys
    real_total = {k: sum(int(s["realised"][k]) for s in sources) for k in real_keys}
    rows, warnings = [], []
    for i, s in enumerate(sources):
        name = s.get("name") or s["path"]
        label = f"source {name!r}" + (f" ({i + 1})" if sum((x.get("name") or x["path"]) == name for x in sources) > 1
                                       else "")
        req_share = {k: _share(int(s["selected"][k]), sel_total[k]) for k in keys}
        real_share = {k: _share(int(s["realised"][k]), real_total[k]) for k in real_keys}
        rows.append({"source": name, "path": s["path"], "rate": s.get("rate"), "target_samples": s.get("samples"),
                     "available": int(s["available"]), "tokenized": s.get("tokenized"),
                     "requested": {k: int(s["selected"][k]) for k in keys},
                     "realised": {k: int(s["realised"][k]) for k in real_keys},
                     "requested_share": req_share, "realised_share": real_share})
        n, want, sel, got = int(s["available"]), int(s["requested"]), int(s["selected"]["samples"]), \
            int(s["realised"]["samples"])
        if n == 0:
            warnings.append(f"{label} holds no samples; it contributes nothing" +
                            (f" (target {want:,})" if s.get("samples") is not None else ""))
        elif want == 0:  # a rate that rounds to no sample (a target is at least 1)
            from .mixture import least_rate_text

            warnings.append(f"{label}: rate {s.get('rate')} of its {n:,} sample{'s' if n != 1 else ''} rounds to 0 "
                            f"samples, so it contributes nothing; give it a rate of at least {least_rate_text(n)}, or "
                            "leave it out")
        elif s.get("samples") is not None and want > n:
            warnings.append(f"{label}: target of {want:,} samples is more than its {n:,}; met by up-sampling "
                            f"(every sample {want // n} time{'s' if want // n > 1 else ''}"
                            + (f", {want % n:,} of them once more" if want % n else "") + ")")
        if got < sel:
            why = ("rejected at pack time; see .packtool/errors.jsonl" if "loss_tokens" in real_keys
                   else "would be rejected at pack time")
            warnings.append(f"{label}: {got:,} of {sel:,} requested samples packed ({sel - got:,} {why}); its share "
                            f"of samples is {real_share['samples']:.1%}, requested {req_share['samples']:.1%}")
    return {"seed": mix.get("seed"), "group_by": mix.get("group_by"), "sources": rows, "warnings": warnings}


def mixture_rejected(m: dict) -> float | None:
    """The share of input rows a mixture rejected (``--fail-above-rejected``), from
    :func:`mixture_summary`: each source's rows as tokenize read and rejected them, weighted by
    the share of its samples the mixture selected (``requested / available``: 1 at rate 1, 2 at
    rate 2, a half at rate 1/2, so a repeated source counts as often as it is read), then the
    selected samples pack rejected, as for one source. ``None`` when a source has no
    ``tokenized`` counts (a mixture packed by an earlier packtool).

    Example:
        >>> src = lambda n, want, got, rows, rej: {"available": n, "requested": {"samples": want},
        ...     "realised": {"samples": got}, "tokenized": {"rows_in": rows, "rejected": rej}}
        >>> mixture_rejected({"sources": [src(21, 21, 21, 30, 9)]})  # 9 of 30 rows rejected at tokenize
        0.3
        >>> mixture_rejected({"sources": [src(21, 21, 21, 30, 9), src(10, 20, 18, 10, 0)]})  # 2 drops at pack
        0.22
    """
    rows = rejected = selected = dropped = 0.0
    for s in m["sources"]:
        t = s.get("tokenized")
        if t is None:
            return None
        n, want = int(s["available"]), int(s["requested"]["samples"])
        w = want / n if n else 0.0
        rows += w * int(t["rows_in"])
        rejected += w * int(t["rejected"])
        selected += want
        dropped += want - int(s["realised"]["samples"])
    tok = rejected / rows if rows else 0.0
    return tok + (dropped / selected * (1 - tok) if selected else 0.0)


def render_mixture(m: dict) -> str:
    """The per-source table of :func:`mixture_summary` (shares as requested -> realised)."""
    head = ("source", "rate", "samples", "samples share", "tokens share", "vision share", "loss share")

    def pair(r: dict, k: str) -> str:
        return f"{r['requested_share'][k]:.1%} -> {r['realised_share'][k]:.1%}"

    table = [head]
    for r in m["sources"]:
        rate = r["rate"] if r["rate"] is not None else f"{r['target_samples']:,} samples"
        table.append((_short(r["source"], 24), rate, f"{r['requested']['samples']:,} -> {r['realised']['samples']:,}",
                      pair(r, "samples"), pair(r, "tokens"), pair(r, "vision_units"),
                      f"{r['realised_share']['loss_tokens']:.1%}" if "loss_tokens" in r["realised_share"] else "-"))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = [f"mixture: {len(m['sources'])} source{'' if len(m['sources']) == 1 else 's'}, seed {m['seed']}, group by {m['group_by']} "
             "(requested -> realised)"]
    for row in table:
        lines.append("  ".join([row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)])
                     .rstrip())
    lines += [f"warning: {w}" for w in m["warnings"]]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# thresholds


@dataclass(frozen=True, slots=True)
class Thresholds:
    """CI gates on a stats dict; ``None`` disables a gate.

    Attributes:
        fail_below_fill: minimum mean token fill (0..1).
        fail_below_vision_fill: minimum mean vision fill (0..1).
        fail_above_ratio: maximum packs / lower bound.
        fail_above_rejected: maximum fraction of input rows rejected or dropped (pack drops as their
            share of the tokenized samples, so a row split into trees is not counted once a tree).
    """

    fail_below_fill: float | None = None
    fail_below_vision_fill: float | None = None
    fail_above_ratio: float | None = None
    fail_above_rejected: float | None = None

    def __post_init__(self) -> None:
        for flag, value, fraction in (("--fail-below-fill", self.fail_below_fill, True),
                                      ("--fail-below-vision-fill", self.fail_below_vision_fill, True),
                                      ("--fail-above-ratio", self.fail_above_ratio, False),
                                      ("--fail-above-rejected", self.fail_above_rejected, True)):
            if value is None:
                continue
            if fraction and not 0 <= value <= 1:  # also NaN
                raise ConfigError(f"{flag} {value}: give a fraction from 0 to 1 (0.95 for 95%)")
            if not fraction and not 0 <= value < math.inf:  # also NaN and inf (JSON has no Infinity)
                raise ConfigError(f"{flag} {value}: give a non-negative ratio (1.05 for 5% above the lower bound)")

    def any(self) -> bool:
        return any(getattr(self, f) is not None for f in self.__slots__)


def _gate_number(x: float) -> str:
    """A gate's value or limit as a failure message shows it: short (``1``, ``0.95``), but never
    rounded into its counterpart (``.4g`` printed "packs_over_lower_bound 1 is above
    --fail-above-ratio 1" for a limit of 0.99999)."""
    short = f"{x:g}"
    return short if float(short) == x else repr(float(x))


def check_thresholds(stats: dict, th: Thresholds) -> list[str]:
    """Record each gate in ``stats["thresholds"]``; return the failure messages.

    Raises:
        ConfigError: a gate needs packs and ``stats`` describes a tokenized directory.
    """
    checks = []
    fill = (stats.get("token_fill") or {}).get("mean")
    vfill = (stats.get("vision_fill") or {}).get("mean")
    rows = stats.get("rows_in") or (stats["samples"] + stats["rejected"]["total"])
    tok_rej, pack_rej = (sum(stats["rejected"][k].values()) for k in ("tokenize", "pack"))
    # pack drops samples, not rows: once a row is split into trees (or records merged into one),
    # a drop is the share of the tokenized samples it took, of the rows tokenize kept
    tokenized = stats["reconcile"]["samples_tokenized"] if stats.get("reconcile") else stats["samples"] + pack_rej
    rejected_frac = (tok_rej / rows if rows else 0.0) + (pack_rej / tokenized * (1 - tok_rej / rows) if tokenized else 0.0)
    if stats.get("mixture") and stats["kind"] == "packed":
        rejected_frac = mixture_rejected(stats["mixture"])
    for flag, name, limit, value, below in (
        ("--fail-below-fill", "token_fill_mean", th.fail_below_fill, fill, True),
        ("--fail-below-vision-fill", "vision_fill_mean", th.fail_below_vision_fill, vfill, True),
        ("--fail-above-ratio", "packs_over_lower_bound", th.fail_above_ratio, stats.get("packs_over_lower_bound"), False),
        ("--fail-above-rejected", "rejected_fraction", th.fail_above_rejected,
         None if rejected_frac is None else round(rejected_frac, 4), False),
    ):
        if limit is None:
            continue
        if name == "rejected_fraction" and value is None:  # a mixture packed before its sources' rows were recorded
            raise InputError(f"{flag} counts the rows tokenize rejected of each source, which the manifest of "
                             f"{stats['packed']!r} does not record (a mixture packed by an earlier packtool); pack it "
                             "again, or gate each source: packtool stats TOKENIZED --fail-above-rejected ...")
        if value is None and name == "vision_fill_mean" and stats.get("packs") and \
                not (stats.get("capacities") or {}).get("max_vision_units"):
            # packs there are, but with no vision capacity there is no vision fill to measure
            raise InputError(f"{flag} needs a vision capacity, and {stats['packed']!r} was packed with "
                             "--max-vision-units 0, so its packs have no vision fill; leave the gate out, or pack "
                             "again with a vision capacity")
        if value is None and stats["kind"] == "packed":  # a packed directory, but its run packed nothing
            from .shards import why_no_packs

            by_pack = stats["rejected"]["pack"]
            raise InputError(f"{flag} needs packs, and {stats['packed']!r} holds none: "
                             + why_no_packs(sum(by_pack.values()), stats["dropped"], sum(by_pack.values())))
        if value is None:
            raise ConfigError(f"{flag} needs packs with that capacity; {stats['kind']} statistics have no {name}; "
                              "pass a packed directory")
        if name == "rejected_fraction" and stats["kind"] == "packed" and stats["tokenized"] is None \
                and not stats.get("mixture"):
            # without the tokenized directory the rows tokenize rejected are unknown: the share would
            # count pack drops only and pass a run that should fail
            raise InputError(f"{flag} counts the rows tokenize rejected, which only the tokenized directory knows, "
                             f"and the one {stats['packed']!r} was packed from is not where its manifest says (or was "
                             f"tokenized again since); pass it first: packtool stats TOKENIZED {stats['packed']}")
        passed = value >= limit if below else value <= limit
        checks.append({"name": name, "flag": flag, "limit": limit, "value": value, "passed": bool(passed)})
    stats["thresholds"] = checks
    failures = []
    for c in checks:
        if not c["passed"]:
            word = "below" if c["flag"].startswith("--fail-below") else "above"
            failures.append(f"{c['name']} {_gate_number(c['value'])} is {word} {c['flag']} {_gate_number(c['limit'])}")
    if stats.get("reconcile") and not stats["reconcile"]["balanced"]:
        r = stats["reconcile"]
        failures.append(f"rows do not reconcile: {r['rows_in']} in, {r['samples_packed']} packed, "
                        f"{r['tokenize_rejected']} rejected by tokenize, {r['pack_rejected']} by pack, "
                        f"{r['missing']} missing, {r['extra']} extra")
    return failures


# ---------------------------------------------------------------------------------------------
# rendering


def _pct(d: dict | None) -> str:
    if d is None:
        return "-"
    return f"mean {d['mean']:.1%}  p5 {d['p5']:.1%}  p50 {d['p50']:.1%}  min {d['min']:.1%}"


def _num(d: dict | None) -> str:
    if d is None:
        return "-"
    return f"mean {d['mean']:,.1f}  p5 {d['p5']:,.0f}  p50 {d['p50']:,.0f}  max {d['max']:,.0f}"


def _histline(d: dict | None, limit: int = 8) -> str:
    if d is None:
        return "-"
    items = list(d["histogram"].items())
    shown = "  ".join(f"{k}:{v}" for k, v in items[:limit])
    return shown + ("  ..." if len(items) > limit else "")


def _opt(v: int | None) -> str:
    return "-" if v is None else f"{v:,}"


def _short(name: str, width: int = 36) -> str:
    return name if len(name) <= width else "..." + name[-(width - 3):]


def render_stats(s: dict) -> str:
    """The human-readable table of a stats dict."""
    rows: list[tuple[str, str]] = []
    unit = s.get("vision_unit") or "vision units"
    caps = s.get("capacities")
    if caps:
        rows.append(("capacities", f"{caps['max_tokens']:,} tokens, {caps['max_vision_units']:,} {unit} per pack"))
    rows.append(("samples", f"{s['samples']:,}"))
    if s["packs"] is not None:
        ratio = f"  ({s['packs_over_lower_bound']:.3f}x)" if s["packs_over_lower_bound"] else ""
        rows += [
            ("packs", f"{s['packs']:,}  lower bound {s['lower_bound']:,}{ratio}"),
            ("token fill", _pct(s["token_fill"])),
            ("vision fill", _pct(s["vision_fill"])),
            ("samples per pack", _num(s["samples_per_pack"])),
            ("", _histline(s["samples_per_pack"])),
        ]
    rows.append(("tokens", f"{s['tokens']:,}  (vision {s['vision_tokens']:,} = {s['vision_token_share']:.1%})"))
    rows.append((f"{unit}", f"{s['vision_units']:,}"))
    rows.append(("sample length", _num(s["sample_tokens"])))
    if s["branches_per_sample"] is not None:
        rows.append(("branches per sample", _histline(s["branches_per_sample"])))
    pad = s.get("padding")
    if pad:
        order = "" if pad["order"] == "input" else ", in pack order"
        for n in pad["naive"]:
            rows.append((f"padding, batch {n['batch_size']}", f"{n['pad_tokens']:,} tokens = {n['waste']:.1%} of {n['slots']:,}  (naive{order})"))
        if pad["packtool"]:
            p = pad["packtool"]
            rows.append(("padding, packed", f"{p['pad_tokens']:,} tokens = {p['waste']:.1%} of {p['slots']:,}"))
    if s["packs"] is not None:
        rows.append(("dropped / alone / truncated", f"{s['dropped']:,} / {s['alone']:,} / {s['truncated']:,}"))
    rej = s["rejected"]
    of = f" of {s['rows_in']:,} rows in" if s.get("rows_in") is not None else ""
    if s.get("mixture") and s.get("rows_in") is not None and rej["total"]:  # each source once; a rate repeats its rows
        # tokenize rejects rows (each source once), pack the mixture's selected samples (copies
        # included): one total "of" the rows read "28 of 22 rows in" for a source at rate 2
        selected = sum(x["requested"]["samples"] for x in s["mixture"]["sources"])
        of = (f": {sum(rej['tokenize'].values()):,} of {s['rows_in']:,} rows in by tokenize (the sources' rows, each "
              f"once), {sum(rej['pack'].values()):,} of {selected:,} selected samples by pack; --fail-above-rejected "
              "weighs each source by its rate")
    elif s.get("rows_in") is not None and rej["pack"] and s.get("reconcile") and \
            s["reconcile"]["samples_tokenized"] != s["rows_in"] - s["reconcile"]["tokenize_rejected"]:
        # rows merged into trees (--group-by-media) or split into several (--max-branches): pack
        # drops samples, which are not rows; "8 of 30 rows in" for 8 trees of 18 records
        r = s["reconcile"]
        of = (f": {r['tokenize_rejected']:,} of {s['rows_in']:,} rows in by tokenize, {r['pack_rejected']:,} of "
              f"{r['samples_tokenized']:,} tokenized samples (message trees) by pack")
    rows.append(("rejected", f"{rej['total']:,}{of}"))
    for stage in ("tokenize", "pack"):
        for reason, n in rej[stage].items():
            rows.append((f"  {stage}: {reason}", f"{n:,}"))
    r = s.get("reconcile")
    if r:
        mark = "ok" if r["balanced"] else f"MISMATCH ({r['missing']} missing, {r['extra']} extra)"
        extra = ""
        if r["merged_records"] or r["split_extra_trees"]:
            extra = f" + {r['merged_records']:,} merged - {r['split_extra_trees']:,} split"
        rejected = r["tokenize_rejected"] + r["pack_rejected"]
        rows.append(("rows in = packed + rejected",
                     f"{r['rows_in']:,} = {r['samples_packed']:,} + {rejected:,}{extra}  {mark}  (rejected: "
                     f"{r['tokenize_rejected']:,} by tokenize, {r['pack_rejected']:,} by pack)"))
    for c in s.get("thresholds", []):
        rows.append((f"gate {c['flag']}", f"{_gate_number(c['value'])} vs {_gate_number(c['limit'])}  {'pass' if c['passed'] else 'FAIL'}"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    if s.get("sources"):
        lines.append("")
        head = ("source", "samples", "packed", "dropped", "rejected", "tokens", unit)
        table = [head] + [(_short(x["source"]), f"{x['samples']:,}", _opt(x["packed"]), _opt(x["dropped"]), f"{x['rejected']:,}",
                           f"{x['tokens']:,}", f"{x['vision_units']:,}") for x in s["sources"]]
        widths = [max(len(r[i]) for r in table) for i in range(len(head))]
        for r in table:
            lines.append("  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]).rstrip())
    if s.get("mixture"):
        lines += ["", render_mixture(s["mixture"])]
    for note in s.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# sweep


def sweep(tokenized: str | Path, base, grid: dict[str, list[int]]) -> list[dict]:
    """Plan every combination of ``grid`` (PackConfig field -> values) and summarize each.

    Args:
        tokenized: the tokenized directory.
        base: a :class:`~packtool.config.PackConfig` the grid values replace fields of.
        grid: e.g. ``{"buffer_size": [48, 256], "vision_weight": [0, 30], "max_tokens": [8192, 16384]}``.

    Returns:
        one dict per setting: the varied fields plus packs, lower bound, fill and drops:
        ``dropped`` (oversize samples dropped) and ``rejected`` (every sample the pack would
        reject: those drops, ``--oversize truncate`` cuts that keep no target, media changed since
        tokenize), as ``pack --dry-run`` counts them.
    """
    import dataclasses
    import time

    from .pipeline import pack_dataset

    keys = list(grid)
    # every setting is checked (a ConfigError) before any is planned, and a value given twice is planned once
    cells = [(values, dataclasses.replace(base, **dict(zip(keys, values, strict=True))))
             for values in itertools.product(*(dict.fromkeys(grid[k]) for k in keys))]
    out = []
    for values, cfg in cells:
        t0 = time.perf_counter()
        result = pack_dataset(tokenized, Path("."), cfg, dry_run=True)
        seconds = time.perf_counter() - t0
        s = plan_stats(tokenized, result)
        tf, vf = s["token_fill"] or {}, s["vision_fill"] or {}
        out.append({
            **dict(zip(keys, values, strict=True)),
            "max_vision_units": s["capacities"]["max_vision_units"],
            "packs": s["packs"],
            "lower_bound": s["lower_bound"],
            "packs_over_lower_bound": s["packs_over_lower_bound"],
            "token_fill_mean": tf.get("mean"),
            "token_fill_p5": tf.get("p5"),
            "vision_fill_mean": vf.get("mean"),
            "samples_per_pack_mean": (s["samples_per_pack"] or {}).get("mean"),
            "dropped": s["dropped"],
            # what a pack of these settings would lose: oversize drops, but also truncate's no_loss cuts
            "rejected": sum(s["rejected"]["pack"].values()),
            "plan_seconds": round(seconds, 3),
        })
    return out


def render_sweep(rows: list[dict]) -> str:
    """A fixed-width table of :func:`sweep` output."""
    if not rows:
        return ""
    cols = [c for c in rows[0] if c != "plan_seconds"]
    fmt = {
        "packs_over_lower_bound": lambda v: "-" if v is None else f"{v:.3f}x",
        "token_fill_mean": lambda v: "-" if v is None else f"{v:.1%}",
        "token_fill_p5": lambda v: "-" if v is None else f"{v:.1%}",
        "vision_fill_mean": lambda v: "-" if v is None else f"{v:.1%}",
        "samples_per_pack_mean": lambda v: "-" if v is None else f"{v:.1f}",
    }
    names = {"packs_over_lower_bound": "vs bound", "token_fill_mean": "fill", "token_fill_p5": "fill p5",
             "vision_fill_mean": "vision fill", "samples_per_pack_mean": "per pack", "lower_bound": "bound"}
    head = [names.get(c, c.replace("_", "-")) for c in cols]
    body = [[fmt.get(c, lambda v: f"{v:,}" if isinstance(v, int) else str(v))(r[c]) for c in cols] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(lines)
