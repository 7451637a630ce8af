"""The Arrow schemas of tokenized and packed shards, written out once (DESIGN.md §3).

``python -m packtool.schema DIR`` writes ``DIR/tokenized.vN.json``, ``DIR/packed.vN.json`` and
``DIR/packed-mixture.vN.json`` for N = 5 (``SCHEMA_VERSION``), 4 and 3, and 2 (``FULL_VERSION``);
a test fails when the committed files drift from this module.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa

from .runs import (
    BLOB_METADATA,
    COMPACT_COLUMNS,
    RUN_COLUMNS,
    TOKEN_COLUMNS,
    V3_COMPACT_COLUMNS,
    V3_RUN_COLUMNS,
    V4_COMPACT_COLUMNS,
    field_metadata,
)

__all__ = ["SCHEMA_VERSION", "FULL_VERSION", "READABLE_VERSIONS", "LAYOUTS", "MEDIA_FIELDS", "media_type", "TOKENIZED",
           "TOKENIZED_ROWS", "PACKED", "PACKED_FULL", "PACKED_MIXTURE", "PACKED_MIXTURE_FULL", "TOKENIZED_V3", "PACKED_V3", "PACKED_MIXTURE_V3", "LIST_RUNS_VERSION",
           "PLAIN_BLOBS_VERSION", "TOKENIZED_V4", "PACKED_V4", "PACKED_MIXTURE_V4",
           "schema_of_version", "packed_schema", "expanded_form",
           "schema_json", "SUBSEGMENT_STRIDE", "PREFIX_SUBSEGMENT"]

#: What tokenize writes, and pack by default: token columns in runs form (``packtool.runs``),
#: each stored column an int32 blob (``binary``, little-endian), targets stored against the
#: next input (``runs.swap_next``).
SCHEMA_VERSION = 5
#: The runs form with int32 blobs and targets stored as they are (still read; ``runs.blob_table`` converts it).
PLAIN_BLOBS_VERSION = 4
#: The runs form with ``list<int32>`` columns (still read; ``runs.blob_table`` converts it).
LIST_RUNS_VERSION = 3
#: The expanded layout (every token stored): what ``pack --layout full`` writes, byte for byte
#: what packtool wrote before the runs form.
FULL_VERSION = 2
#: Versions of each kind this packtool reads: version 2 changed only packed shards (media
#: ``data`` became the image file's ``binary`` everywhere; video frames moved to ``frames``),
#: so tokenized directories of version 1 are read (and packed) as they are; version 3 stores
#: token columns in runs form in both kinds, version 4 stores those six columns as int32
#: blobs instead of ``list<int32>``, under new names, and version 5 stores the target blob
#: against the next input, under a new name.
READABLE_VERSIONS = {"tokenized": (1, 2, 3, 4, 5), "packed": (2, 3, 4, 5)}
#: Packed layouts: ``runs`` (schema version 5, the default) and ``full`` (version 2).
LAYOUTS = {"runs": SCHEMA_VERSION, "full": FULL_VERSION}

#: Sample ``k`` of a pack uses subsegment ids ``k * SUBSEGMENT_STRIDE + b``.
SUBSEGMENT_STRIDE = 100_000
#: The subsegment of a sample's shared prefix (and the whole of a single-branch sample).
PREFIX_SUBSEGMENT = 10_000

_i32_list = pa.list_(pa.int32())

MEDIA_FIELDS = [
    pa.field("kind", pa.string(), nullable=False),  # "image" | "video"
    pa.field("path", pa.string()),  # as written in the input; null for inline bytes
    pa.field("token_offset", pa.int32(), nullable=False),  # first placeholder token, from row start
    pa.field("n_tokens", pa.int32(), nullable=False),  # placeholder tokens (the span length)
    pa.field("width", pa.int32(), nullable=False),  # original size
    pa.field("height", pa.int32(), nullable=False),
    pa.field("resized_width", pa.int32(), nullable=False),
    pa.field("resized_height", pa.int32(), nullable=False),
    pa.field("grid_t", pa.int32(), nullable=False),
    pa.field("grid_h", pa.int32(), nullable=False),
    pa.field("grid_w", pa.int32(), nullable=False),
    pa.field("vision_units", pa.int32(), nullable=False),
    pa.field("timestamps", pa.list_(pa.float64())),  # videos: the exact frame times counted
]


def media_type(extra: list[pa.Field] | None = None) -> pa.DataType:
    return pa.list_(pa.struct(MEDIA_FIELDS + (extra or [])))


TOKENIZED_ROWS = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("source_row", pa.int64(), nullable=False),
        pa.field("n_tokens", pa.int32(), nullable=False),
        pa.field("n_vision_units", pa.int32(), nullable=False),
        pa.field("n_branches", pa.int32(), nullable=False),
        pa.field("input_ids", _i32_list, nullable=False),
        pa.field("target_ids", _i32_list, nullable=False),
        pa.field("position_ids", _i32_list, nullable=False),
        pa.field("subsegment_ids", _i32_list, nullable=False),
        # data: the media file's bytes when given inline (data URIs, Parquet image structs); else null.
        # size_bytes, mtime_ns: the file that was counted (null for inline bytes); pack checks them
        pa.field("media", media_type([pa.field("data", pa.binary()), pa.field("size_bytes", pa.int64()),
                                      pa.field("mtime_ns", pa.int64())]), nullable=False),
    ],
    metadata={"packtool.kind": "tokenized", "packtool.schema_version": str(FULL_VERSION)},
)

PACKED_FULL = pa.schema(
    [
        pa.field("pack_index", pa.int64(), nullable=False),
        pa.field("n_tokens", pa.int32(), nullable=False),
        pa.field("n_vision_units", pa.int32(), nullable=False),
        pa.field("sample_ids", pa.list_(pa.string()), nullable=False),
        pa.field("input_ids", _i32_list, nullable=False),
        pa.field("target_ids", _i32_list, nullable=False),
        pa.field("position_ids", _i32_list, nullable=False),
        pa.field("subsegment_ids", _i32_list, nullable=False),
        pa.field("cu_seqlens", _i32_list, nullable=False),
        pa.field(
            "media",
            # embedded media (--media embed): data is an image file's bytes, frames a video's JPEG
            # per timestamp; both null with --media reference. One type per name in both kinds.
            media_type([pa.field("sample_index", pa.int32(), nullable=False), pa.field("data", pa.binary()),
                        pa.field("frames", pa.list_(pa.binary()))]),
            nullable=False,
        ),
    ],
    metadata={"packtool.kind": "packed", "packtool.schema_version": str(FULL_VERSION)},
)

#: Packed shards of a mixture (``pack A B ... --rates``): ``PACKED`` plus ``sample_sources``, the
#: position in the manifest's ``mixture.sources`` of each sample (parallel to ``sample_ids``).
#: One source, no rates: ``PACKED`` itself, so those shards are what they always were.
PACKED_MIXTURE_FULL = pa.schema(
    [*PACKED_FULL, pa.field("sample_sources", _i32_list, nullable=False)],
    metadata={"packtool.kind": "packed", "packtool.schema_version": str(FULL_VERSION), "packtool.mixture": "1"},
)

def _runs_form(schema: pa.Schema, version: int = SCHEMA_VERSION) -> pa.Schema:
    """``schema`` with its four token columns in runs form (see ``packtool.runs``): each
    ``X`` becomes its compact twin (a row's tokens with every run cut to its first token),
    and the run table (each run's index in the compact row, and the tokens it stands for)
    follows them. Version 5 stores the six as int32 blobs (``binary``, little-endian; field
    metadata ``packtool.encoding: int32-le``, and ``int32-le-next-swap`` for the targets,
    stored against the next input); version 4 the same with targets as they are (all six
    ``int32-le``); version 3 as ``list<int32>``."""
    compact_names, run_names = {SCHEMA_VERSION: (COMPACT_COLUMNS, RUN_COLUMNS),
                                PLAIN_BLOBS_VERSION: (V4_COMPACT_COLUMNS, RUN_COLUMNS)}.get(
        version, (V3_COMPACT_COLUMNS, V3_RUN_COLUMNS))

    def stored(name: str, like: pa.Field) -> pa.Field:
        if version == SCHEMA_VERSION:
            return pa.field(name, pa.binary(), nullable=False, metadata=field_metadata(name))
        if version == PLAIN_BLOBS_VERSION:
            return pa.field(name, pa.binary(), nullable=False, metadata=BLOB_METADATA)
        return like.with_name(name)

    fields = []
    for f in schema:
        if f.name in TOKEN_COLUMNS:
            fields.append(stored(compact_names[TOKEN_COLUMNS.index(f.name)], f))
            if f.name == TOKEN_COLUMNS[-1]:
                fields += [stored(name, pa.field(name, _i32_list, nullable=False)) for name in run_names]
        else:
            fields.append(f)
    meta = dict(schema.metadata)
    meta[b"packtool.schema_version"] = str(version).encode()
    return pa.schema(fields, metadata=meta)


def expanded_form(schema: pa.Schema) -> pa.Schema:
    """The expanded twin of a runs-form schema (the inverse of the runs form), or ``schema`` itself."""
    run_names = set(RUN_COLUMNS) | set(V3_RUN_COLUMNS)
    if not run_names & set(schema.names):
        return schema
    plain = dict(zip((*COMPACT_COLUMNS, *V4_COMPACT_COLUMNS, *V3_COMPACT_COLUMNS), TOKEN_COLUMNS * 3, strict=True))
    fields = [pa.field(plain[f.name], _i32_list, nullable=False) if f.name in plain else f
              for f in schema if f.name not in run_names]
    meta = dict(schema.metadata)
    meta[b"packtool.schema_version"] = str(FULL_VERSION).encode()
    return pa.schema(fields, metadata=meta)


#: Tokenized shards as written (schema version 5): token columns in runs form, int32 blobs.
TOKENIZED = _runs_form(TOKENIZED_ROWS)
#: Packed shards as written by default (schema version 5, ``--layout runs``); ``n_tokens``,
#: ``cu_seqlens`` and media ``token_offset`` / ``n_tokens`` count expanded tokens.
PACKED = _runs_form(PACKED_FULL)
PACKED_MIXTURE = _runs_form(PACKED_MIXTURE_FULL)
#: The same in schema version 4 (targets stored as they are), as the packtool before wrote them.
TOKENIZED_V4 = _runs_form(TOKENIZED_ROWS, PLAIN_BLOBS_VERSION)
PACKED_V4 = _runs_form(PACKED_FULL, PLAIN_BLOBS_VERSION)
PACKED_MIXTURE_V4 = _runs_form(PACKED_MIXTURE_FULL, PLAIN_BLOBS_VERSION)
#: The same in schema version 3 (``list<int32>`` columns), as older packtool wrote them.
TOKENIZED_V3 = _runs_form(TOKENIZED_ROWS, LIST_RUNS_VERSION)
PACKED_V3 = _runs_form(PACKED_FULL, LIST_RUNS_VERSION)
PACKED_MIXTURE_V3 = _runs_form(PACKED_MIXTURE_FULL, LIST_RUNS_VERSION)


def schema_of_version(kind: str, version: int, mixture: bool = False) -> pa.Schema:
    """The schema shards of ``kind`` (``tokenized`` or ``packed``) have at a schema version."""
    if kind == "tokenized":
        return {SCHEMA_VERSION: TOKENIZED, PLAIN_BLOBS_VERSION: TOKENIZED_V4,
                LIST_RUNS_VERSION: TOKENIZED_V3}.get(version, TOKENIZED_ROWS)
    if mixture:
        return {SCHEMA_VERSION: PACKED_MIXTURE, PLAIN_BLOBS_VERSION: PACKED_MIXTURE_V4,
                LIST_RUNS_VERSION: PACKED_MIXTURE_V3}.get(version, PACKED_MIXTURE_FULL)
    return {SCHEMA_VERSION: PACKED, PLAIN_BLOBS_VERSION: PACKED_V4, LIST_RUNS_VERSION: PACKED_V3}.get(version, PACKED_FULL)


def packed_schema(layout: str = "runs", mixture: bool = False) -> pa.Schema:
    """The schema of packed shards of a layout (``runs`` or ``full``), plain or of a mixture."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; use one of {', '.join(LAYOUTS)}")
    if layout == "full":
        return PACKED_MIXTURE_FULL if mixture else PACKED_FULL
    return PACKED_MIXTURE if mixture else PACKED


def _type_json(t: pa.DataType):
    if pa.types.is_list(t):
        return {"list": _type_json(t.value_type)}
    if pa.types.is_struct(t):
        return {"struct": [_field_json(t.field(i)) for i in range(t.num_fields)]}
    return str(t)


def _field_json(f: pa.Field) -> dict:
    out = {"name": f.name, "type": _type_json(f.type), "nullable": f.nullable}
    if f.metadata:
        out["metadata"] = {k.decode(): v.decode() for k, v in f.metadata.items()}
    return out


def schema_json(schema: pa.Schema) -> dict:
    """A readable, stable JSON description of a schema (what ``schemas/*.json`` hold)."""
    meta = {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()}
    return {"kind": meta.get("packtool.kind"), "schema_version": int(meta["packtool.schema_version"]),
            "fields": [_field_json(f) for f in schema]}


#: The schemas ``make schemas`` writes, by file name stem.
SCHEMA_FILES = (("tokenized", TOKENIZED), ("packed", PACKED), ("packed-mixture", PACKED_MIXTURE),
                ("tokenized", TOKENIZED_V4), ("packed", PACKED_V4), ("packed-mixture", PACKED_MIXTURE_V4),
                ("tokenized", TOKENIZED_V3), ("packed", PACKED_V3), ("packed-mixture", PACKED_MIXTURE_V3),
                ("tokenized", TOKENIZED_ROWS), ("packed", PACKED_FULL), ("packed-mixture", PACKED_MIXTURE_FULL))


def write_schemas(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, schema in SCHEMA_FILES:
        version = schema.metadata[b"packtool.schema_version"].decode()
        path = out / f"{name}.v{version}.json"
        path.write_text(json.dumps(schema_json(schema), indent=2) + "\n")
        written.append(path)
    return written


if __name__ == "__main__":  # pragma: no cover - exercised by `make schemas`
    for p in write_schemas(Path(sys.argv[1] if len(sys.argv) > 1 else "schemas")):
        print(p)
