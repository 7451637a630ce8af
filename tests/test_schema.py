import json
from pathlib import Path

import pyarrow.parquet as pq

from packtool.schema import PACKED, PACKED_FULL, SCHEMA_FILES, TOKENIZED, schema_json

ROOT = Path(__file__).resolve().parents[1]


def test_committed_schema_files_match_the_module():
    for name, schema in SCHEMA_FILES:
        version = schema.metadata[b"packtool.schema_version"].decode()
        committed = json.loads((ROOT / "schemas" / f"{name}.v{version}.json").read_text())
        assert committed == schema_json(schema), f"schemas/{name}.v{version}.json drifted; run `make schemas`"


def test_shards_carry_exactly_the_declared_schema(demo_dirs):
    for kind, schema in (("tokenized", TOKENIZED), ("packed", PACKED), ("packed-full", PACKED_FULL)):
        manifest = json.loads((demo_dirs[kind] / ".packtool" / "manifest.json").read_text())
        for shard in manifest["shards"]:
            got = pq.read_schema(demo_dirs[kind] / shard["file"])
            assert got.remove_metadata().equals(schema.remove_metadata()), kind
            assert got.metadata[b"packtool.kind"].decode() == kind.removesuffix("-full")
            assert got.metadata[b"packtool.schema_version"].decode() == str(manifest["schema_version"])
