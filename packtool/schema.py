"""The Arrow schemas of tokenized and packed shards, written out once (DESIGN.md §3).

``python -m packtool.schema DIR`` writes ``DIR/tokenized.vN.json`` and
``DIR/packed.vN.json`` (N = ``SCHEMA_VERSION``); a test fails when the committed files drift from this module.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa

__all__ = ["SCHEMA_VERSION", "READABLE_VERSIONS", "MEDIA_FIELDS", "media_type", "TOKENIZED", "PACKED", "PACKED_MIXTURE", "schema_json", "SUBSEGMENT_STRIDE", "PREFIX_SUBSEGMENT"]

SCHEMA_VERSION = 2
#: Versions of each kind this packtool reads: version 2 changed only packed shards (media
#: ``data`` became the image file's ``binary`` everywhere; video frames moved to ``frames``),
#: so tokenized directories of version 1 are read (and packed) as they are.
READABLE_VERSIONS = {"tokenized": (1, 2), "packed": (2,)}

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


TOKENIZED = pa.schema(
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
    metadata={"packtool.kind": "tokenized", "packtool.schema_version": str(SCHEMA_VERSION)},
)

PACKED = pa.schema(
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
    metadata={"packtool.kind": "packed", "packtool.schema_version": str(SCHEMA_VERSION)},
)


#: Packed shards of a mixture (``pack A B ... --rates``): ``PACKED`` plus ``sample_sources``, the
#: position in the manifest's ``mixture.sources`` of each sample (parallel to ``sample_ids``).
#: One source, no rates: ``PACKED`` itself, so those shards are what they always were.
PACKED_MIXTURE = pa.schema(
    [*PACKED, pa.field("sample_sources", _i32_list, nullable=False)],
    metadata={"packtool.kind": "packed", "packtool.schema_version": str(SCHEMA_VERSION), "packtool.mixture": "1"},
)


def _type_json(t: pa.DataType):
    if pa.types.is_list(t):
        return {"list": _type_json(t.value_type)}
    if pa.types.is_struct(t):
        return {"struct": [_field_json(t.field(i)) for i in range(t.num_fields)]}
    return str(t)


def _field_json(f: pa.Field) -> dict:
    return {"name": f.name, "type": _type_json(f.type), "nullable": f.nullable}


def schema_json(schema: pa.Schema) -> dict:
    """A readable, stable JSON description of a schema (what ``schemas/*.json`` hold)."""
    meta = {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()}
    return {"kind": meta.get("packtool.kind"), "schema_version": SCHEMA_VERSION, "fields": [_field_json(f) for f in schema]}


def write_schemas(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, schema in (("tokenized", TOKENIZED), ("packed", PACKED), ("packed-mixture", PACKED_MIXTURE)):
        path = out / f"{name}.v{SCHEMA_VERSION}.json"
        path.write_text(json.dumps(schema_json(schema), indent=2) + "\n")
        written.append(path)
    return written


if __name__ == "__main__":  # pragma: no cover - exercised by `make schemas`
    for p in write_schemas(Path(sys.argv[1] if len(sys.argv) > 1 else "schemas")):
        print(p)
