"""The Arrow schemas of tokenized and packed shards, written out once (DESIGN.md §3).

``python -m packtool.schema DIR`` writes ``DIR/tokenized.vN.json``, ``DIR/packed.vN.json`` and
``DIR/packed-mixture.vN.json`` for N = 6 (``SCHEMA_VERSION``), 5, 4 and 3, and the packed files
for 7 (``FULL_VERSION``) and the three kinds for 2 (``FULL_V2_VERSION``); a test fails when the
committed files drift from this module.
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

__all__ = ["SCHEMA_VERSION", "FULL_VERSION", "READABLE_VERSIONS", "LAYOUTS", "MEDIA_FIELDS", "MEDIA_FIELDS_V5",
           "SOURCE_FIELDS", "media_type", "TOKENIZED",
           "TOKENIZED_ROWS", "PACKED", "PACKED_FULL", "PACKED_MIXTURE", "PACKED_MIXTURE_FULL", "TOKENIZED_V3", "PACKED_V3", "PACKED_MIXTURE_V3", "LIST_RUNS_VERSION",
           "PLAIN_BLOBS_VERSION", "TOKENIZED_V4", "PACKED_V4", "PACKED_MIXTURE_V4", "NEXT_SWAP_VERSION",
           "TOKENIZED_V5", "PACKED_V5", "PACKED_MIXTURE_V5", "FULL_V2_VERSION", "TOKENIZED_ROWS_V2", "PACKED_FULL_V2",
           "PACKED_MIXTURE_FULL_V2", "has_source_fields", "with_media_type",
           "schema_of_version", "packed_schema", "expanded_form",
           "schema_json", "SUBSEGMENT_STRIDE", "PREFIX_SUBSEGMENT"]

#: What tokenize writes, and pack by default: token columns in runs form (``packtool.runs``),
#: each stored column an int32 blob (``binary``, little-endian), targets stored against the
#: next input (``runs.swap_next``); each video's ``source_fps`` and ``source_frames`` (what
#: its frame sampler read) in the media struct.
SCHEMA_VERSION = 6
#: Version 6's token columns without the media ``source_*`` fields (still read and packed;
#: a Qwen2.5-VL reader falls back, with a warning, to the configured fps for its videos).
NEXT_SWAP_VERSION = 5
#: The runs form with int32 blobs and targets stored as they are (still read; ``runs.blob_table`` converts it).
PLAIN_BLOBS_VERSION = 4
#: The runs form with ``list<int32>`` columns (still read; ``runs.blob_table`` converts it).
LIST_RUNS_VERSION = 3
#: The expanded layout (every token stored) with version 6's media struct: what ``pack
#: --layout full`` writes, version 2's columns plus the two media ``source_*`` fields. A
#: version number names one schema of a kind, so the expanded twin of version 6 takes the
#: next number (packed shards only: tokenize always writes the runs form).
FULL_VERSION = 7
#: The expanded layout as packtool wrote it before version 7 (still read).
FULL_V2_VERSION = 2
#: Versions of each kind this packtool reads: version 2 changed only packed shards (media
#: ``data`` became the image file's ``binary`` everywhere; video frames moved to ``frames``),
#: so tokenized directories of version 1 are read (and packed) as they are; version 3 stores
#: token columns in runs form in both kinds, version 4 stores those six columns as int32
#: blobs instead of ``list<int32>``, under new names, version 5 stores the target blob
#: against the next input, under a new name, version 6 adds the media ``source_fps`` and
#: ``source_frames`` fields, and version 7 is version 6 expanded (``pack --layout full``).
READABLE_VERSIONS = {"tokenized": (1, 2, 3, 4, 5, 6), "packed": (2, 3, 4, 5, 6, 7)}
#: Packed layouts: ``runs`` (schema version 6, the default) and ``full`` (version 7).
LAYOUTS = {"runs": SCHEMA_VERSION, "full": FULL_VERSION}

#: Sample ``k`` of a pack uses subsegment ids ``k * SUBSEGMENT_STRIDE + b``.
SUBSEGMENT_STRIDE = 100_000
#: The subsegment of a sample's shared prefix (and the whole of a single-branch sample).
PREFIX_SUBSEGMENT = 10_000

_i32_list = pa.list_(pa.int32())

#: The media struct of schema versions 1 to 5.
MEDIA_FIELDS_V5 = [
    pa.field("kind", pa.string(), nullable=False),  # "image" | "video"
    pa.field("path", pa.string()),  # relative to the media root (an absolute path under it is cut); null for inline bytes
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
#: What a video's frame sampler read from the file (``media.probe_video``), null for images:
#: its average frame rate and frame count. With ``timestamps`` they give the rate of the
#: sampled frames, ``len(timestamps) / source_frames * source_fps``, which Qwen2.5-VL's
#: processor turns into the video's time step (``second_per_grid_ts``).
SOURCE_FIELDS = [
    pa.field("source_fps", pa.float64()),
    pa.field("source_frames", pa.int32()),
]
#: The media struct of schema versions 6 and 7.
MEDIA_FIELDS = MEDIA_FIELDS_V5 + SOURCE_FIELDS


def media_type(extra: list[pa.Field] | None = None, fields: list[pa.Field] | None = None) -> pa.DataType:
    """The ``media`` column type: ``fields`` (default :data:`MEDIA_FIELDS`) then ``extra``."""
    return pa.list_(pa.struct((MEDIA_FIELDS if fields is None else fields) + (extra or [])))


def has_source_fields(schema: pa.Schema) -> bool:
    """Whether a shard schema's media struct holds the ``source_*`` fields (version 6 on)."""
    if "media" not in schema.names:
        return False
    struct = schema.field("media").type.value_type
    return all(struct.get_field_index(f.name) >= 0 for f in SOURCE_FIELDS)


def with_media_type(table: pa.Table, media: pa.DataType) -> pa.Table:
    """``table`` with its ``media`` column as ``media`` (a list of structs): fields it lacks
    (the ``source_*`` fields of a version 5 or older shard) come as nulls, fields ``media``
    lacks are dropped. Built child by child, so it holds on every supported pyarrow.

    Example:
        >>> old = pa.table({"media": pa.array([[{"kind": "image"}]], media_type(fields=MEDIA_FIELDS_V5[:1]))})
        >>> with_media_type(old, media_type(fields=[MEDIA_FIELDS[0], *SOURCE_FIELDS]))["media"].to_pylist()
        [[{'kind': 'image', 'source_fps': None, 'source_frames': None}]]
    """
    col = table.column("media")
    if col.type == media:
        return table
    struct = media.value_type
    chunks = []
    for chunk in col.chunks:
        flat = chunk.values  # every struct of the chunk's lists, offsets kept as they are
        have = {flat.type.field(i).name: flat.field(i) for i in range(flat.type.num_fields)}
        children = [have[f.name].cast(f.type) if f.name in have else pa.nulls(len(flat), f.type) for f in struct]
        values = pa.StructArray.from_arrays(children, fields=list(struct), mask=flat.is_null() if flat.null_count else None)
        chunks.append(pa.ListArray.from_arrays(chunk.offsets, values, type=media,
                                               mask=chunk.is_null() if chunk.null_count else None))
    i = table.schema.get_field_index("media")
    return table.set_column(i, table.schema.field(i).with_type(media), pa.chunked_array(chunks, type=media))


def _tokenized_rows(media_fields: list[pa.Field], version: int) -> pa.Schema:
    return pa.schema(
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
                                          pa.field("mtime_ns", pa.int64())], media_fields), nullable=False),
        ],
        metadata={"packtool.kind": "tokenized", "packtool.schema_version": str(version)},
    )


def _packed_full(media_fields: list[pa.Field], version: int) -> pa.Schema:
    return pa.schema(
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
                            pa.field("frames", pa.list_(pa.binary()))], media_fields),
                nullable=False,
            ),
        ],
        metadata={"packtool.kind": "packed", "packtool.schema_version": str(version)},
    )


def _mixture(schema: pa.Schema) -> pa.Schema:
    """Packed shards of a mixture (``pack A B ... --rates``): ``schema`` plus ``sample_sources``, the
    position in the manifest's ``mixture.sources`` of each sample (parallel to ``sample_ids``).
    One source, no rates: the plain schema, so those shards are what they always were."""
    return pa.schema([*schema, pa.field("sample_sources", _i32_list, nullable=False)],
                     metadata={**schema.metadata, b"packtool.mixture": b"1"})


#: Expanded tokenized rows with the current media struct: the rows ``rows.encode_samples``
#: builds (tokenize stores them in runs form, :data:`TOKENIZED`).
TOKENIZED_ROWS = _tokenized_rows(MEDIA_FIELDS, FULL_VERSION)
#: The expanded layout of packed shards (schema version 7, ``pack --layout full``).
PACKED_FULL = _packed_full(MEDIA_FIELDS, FULL_VERSION)
PACKED_MIXTURE_FULL = _mixture(PACKED_FULL)
#: Schema version 2 (tokenized versions 1 and 2 too): expanded, the media struct before ``source_*``.
TOKENIZED_ROWS_V2 = _tokenized_rows(MEDIA_FIELDS_V5, FULL_V2_VERSION)
PACKED_FULL_V2 = _packed_full(MEDIA_FIELDS_V5, FULL_V2_VERSION)
PACKED_MIXTURE_FULL_V2 = _mixture(PACKED_FULL_V2)


def _runs_form(schema: pa.Schema, version: int = SCHEMA_VERSION) -> pa.Schema:
    """``schema`` with its four token columns in runs form (see ``packtool.runs``): each
    ``X`` becomes its compact twin (a row's tokens with every run cut to its first token),
    and the run table (each run's index in the compact row, and the tokens it stands for)
    follows them. Versions 5 and 6 store the six as int32 blobs (``binary``, little-endian; field
    metadata ``packtool.encoding: int32-le``, and ``int32-le-next-swap`` for the targets,
    stored against the next input); version 4 the same with targets as they are (all six
    ``int32-le``); version 3 as ``list<int32>``."""
    swapped = version in (SCHEMA_VERSION, NEXT_SWAP_VERSION)
    compact_names, run_names = (COMPACT_COLUMNS, RUN_COLUMNS) if swapped else {
        PLAIN_BLOBS_VERSION: (V4_COMPACT_COLUMNS, RUN_COLUMNS)}.get(version, (V3_COMPACT_COLUMNS, V3_RUN_COLUMNS))

    def stored(name: str, like: pa.Field) -> pa.Field:
        if swapped:
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
    meta[b"packtool.schema_version"] = str(FULL_VERSION if has_source_fields(schema) else FULL_V2_VERSION).encode()
    return pa.schema(fields, metadata=meta)


#: Tokenized shards as written (schema version 6): token columns in runs form, int32 blobs.
TOKENIZED = _runs_form(TOKENIZED_ROWS)
#: Packed shards as written by default (schema version 6, ``--layout runs``); ``n_tokens``,
#: ``cu_seqlens`` and media ``token_offset`` / ``n_tokens`` count expanded tokens.
PACKED = _runs_form(PACKED_FULL)
PACKED_MIXTURE = _runs_form(PACKED_MIXTURE_FULL)
#: The same in schema version 5 (no media ``source_*`` fields), as the packtool before wrote them.
TOKENIZED_V5 = _runs_form(TOKENIZED_ROWS_V2, NEXT_SWAP_VERSION)
PACKED_V5 = _runs_form(PACKED_FULL_V2, NEXT_SWAP_VERSION)
PACKED_MIXTURE_V5 = _runs_form(PACKED_MIXTURE_FULL_V2, NEXT_SWAP_VERSION)
#: ... in schema version 4 (targets stored as they are),
TOKENIZED_V4 = _runs_form(TOKENIZED_ROWS_V2, PLAIN_BLOBS_VERSION)
PACKED_V4 = _runs_form(PACKED_FULL_V2, PLAIN_BLOBS_VERSION)
PACKED_MIXTURE_V4 = _runs_form(PACKED_MIXTURE_FULL_V2, PLAIN_BLOBS_VERSION)
#: ... and in schema version 3 (``list<int32>`` columns), as older packtool wrote them.
TOKENIZED_V3 = _runs_form(TOKENIZED_ROWS_V2, LIST_RUNS_VERSION)
PACKED_V3 = _runs_form(PACKED_FULL_V2, LIST_RUNS_VERSION)
PACKED_MIXTURE_V3 = _runs_form(PACKED_MIXTURE_FULL_V2, LIST_RUNS_VERSION)


def schema_of_version(kind: str, version: int, mixture: bool = False) -> pa.Schema:
    """The schema shards of ``kind`` (``tokenized`` or ``packed``) have at a schema version
    (versions 1 and 2, and any this packtool does not know, give version 2's expanded schema)."""
    if kind == "tokenized":
        return {SCHEMA_VERSION: TOKENIZED, NEXT_SWAP_VERSION: TOKENIZED_V5, PLAIN_BLOBS_VERSION: TOKENIZED_V4,
                LIST_RUNS_VERSION: TOKENIZED_V3}.get(version, TOKENIZED_ROWS_V2)
    if mixture:
        return {SCHEMA_VERSION: PACKED_MIXTURE, FULL_VERSION: PACKED_MIXTURE_FULL, NEXT_SWAP_VERSION: PACKED_MIXTURE_V5,
                PLAIN_BLOBS_VERSION: PACKED_MIXTURE_V4, LIST_RUNS_VERSION: PACKED_MIXTURE_V3}.get(version,
                                                                                                 PACKED_MIXTURE_FULL_V2)
    return {SCHEMA_VERSION: PACKED, FULL_VERSION: PACKED_FULL, NEXT_SWAP_VERSION: PACKED_V5, PLAIN_BLOBS_VERSION: PACKED_V4,
            LIST_RUNS_VERSION: PACKED_V3}.get(version, PACKED_FULL_V2)


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


#: The schemas ``make schemas`` writes, by file name stem (no tokenized shard has version 7).
SCHEMA_FILES = (("tokenized", TOKENIZED), ("packed", PACKED), ("packed-mixture", PACKED_MIXTURE),
                ("packed", PACKED_FULL), ("packed-mixture", PACKED_MIXTURE_FULL),
                ("tokenized", TOKENIZED_V5), ("packed", PACKED_V5), ("packed-mixture", PACKED_MIXTURE_V5),
                ("tokenized", TOKENIZED_V4), ("packed", PACKED_V4), ("packed-mixture", PACKED_MIXTURE_V4),
                ("tokenized", TOKENIZED_V3), ("packed", PACKED_V3), ("packed-mixture", PACKED_MIXTURE_V3),
                ("tokenized", TOKENIZED_ROWS_V2), ("packed", PACKED_FULL_V2), ("packed-mixture", PACKED_MIXTURE_FULL_V2))


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
