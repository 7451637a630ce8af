"""``shards.rows_table``: rows of numpy arrays become the same table ``from_pylist`` builds."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from packtool.schema import TOKENIZED_ROWS, packed_schema
from packtool.shards import rows_table


def _row(i: int, n: int, rng) -> dict:
    media = [{"kind": "image", "path": f"{i}.jpg", "token_offset": 1, "n_tokens": 4, "width": 9, "height": 8,
              "resized_width": 28, "resized_height": 28, "grid_t": 1, "grid_h": 2, "grid_w": 2, "vision_units": 4,
              "timestamps": None, "data": None, "size_bytes": 10 + i, "mtime_ns": 7}] if i % 2 else []
    return {"sample_id": f"s{i}", "source": "x.jsonl", "source_row": i, "n_tokens": n, "n_vision_units": 4 * (i % 2),
            "n_branches": 1, "input_ids": rng.integers(0, 9, n).astype(np.int32),
            "target_ids": rng.integers(-100, 9, n).astype(np.int32), "position_ids": np.arange(n, dtype=np.int32),
            "subsegment_ids": np.full(n, 10_000, dtype=np.int32), "media": media}


def test_rows_table_equals_from_pylist():
    rng = np.random.default_rng(4)
    rows = [_row(i, int(rng.integers(0, 40)), rng) for i in range(50)]  # empty rows included
    rows[3]["input_ids"] = np.zeros(0, dtype=np.int32)
    rows[3]["n_tokens"] = 0
    want = pa.Table.from_pylist(rows, schema=TOKENIZED_ROWS)
    got = rows_table(rows, TOKENIZED_ROWS)
    assert got.schema == want.schema and got.equals(want)
    # a column given as lists (or another dtype) takes the generic path, same table
    rows[5]["position_ids"] = rows[5]["position_ids"].tolist()
    rows[6]["target_ids"] = rows[6]["target_ids"].astype(np.int64)
    assert rows_table(rows, TOKENIZED_ROWS).equals(pa.Table.from_pylist(rows, schema=TOKENIZED_ROWS))


def _packed_media_table(blobs: list[bytes | None], frames: list[list[bytes] | None] | None = None) -> pa.Table:
    """A one-column table of the packed media type, one media item per blob."""

    schema = pa.schema([packed_schema("runs").field("media")])
    frames = frames or [None] * len(blobs)
    rows = [[{"sample_index": 0, "kind": "image" if f is None else "video", "path": f"{i}.jpg", "data": b,
              "frames": f}] for i, (b, f) in enumerate(zip(blobs, frames, strict=True))]
    return pa.table({"media": rows}, schema=schema)


def test_payload_leaves_are_stored_as_they_are_only_when_zstd_cannot_shrink_them():
    """Incompressible image bytes or frames (real JPEGs) are written uncompressed; bytes that
    compress (flat images), no bytes at all (``--media reference``) and tables without media
    keep the one zstd setting every other column has."""
    from packtool.shards import (
        _WRITE_OPTS,
        FAST_LEAVES,
        PAYLOAD_LEAVES,
        PAYLOAD_SAMPLE_BYTES,
        writer_options,
    )

    seed = 21
    rng = np.random.default_rng(seed)
    noise = [rng.bytes(int(rng.integers(1_000, 60_000))) for _ in range(40)]
    flat = [bytes(len(b)) for b in noise]
    data, frames = PAYLOAD_LEAVES
    t = _packed_media_table(noise)
    opts = writer_options(t.schema, t)
    assert opts["compression"][data] == "none" and data not in opts["compression_level"], f"seed {seed}"
    assert opts["compression"][frames] == "zstd"  # no frames in the group: nothing says they would not shrink
    assert {k for k, v in opts["compression"].items() if v == "zstd"} == set(opts["compression_level"])
    assert all(v == "zstd" for k, v in opts["compression"].items() if k not in PAYLOAD_LEAVES)
    tokens = packed_schema("runs")
    both = writer_options(tokens, tokens.empty_table())["compression"]
    assert [k for k, v in both.items() if v != "zstd"] == [FAST_LEAVES[0]] and both[FAST_LEAVES[0]] == "lz4"
    assert {k: v for k, v in opts.items() if k not in ("compression", "compression_level")} == \
        {k: v for k, v in _WRITE_OPTS.items() if k not in ("compression", "compression_level")}
    videos = _packed_media_table([None] * 8, [noise[5 * i:5 * i + 5] for i in range(8)])
    assert writer_options(videos.schema, videos)["compression"][frames] == "none", f"seed {seed}"
    for t in (_packed_media_table(flat), _packed_media_table([None] * 40), _packed_media_table([]),
              _packed_media_table([None, b""] * 3)):
        assert writer_options(t.schema, t) is _WRITE_OPTS
    # the sample is the first bytes of the group: compressible ones first decide for the shard
    mixed = _packed_media_table(flat[:1] + [bytes(PAYLOAD_SAMPLE_BYTES)] + noise)
    assert writer_options(mixed.schema, mixed) is _WRITE_OPTS
    plain = pa.table({"x": [1, 2]})
    assert writer_options(plain.schema, plain) is _WRITE_OPTS


def test_the_payload_sample_is_the_first_bytes_of_the_values_in_row_order():
    """``_payload_sample`` slices the value buffer; a one-value-at-a-time twin agrees on tables
    with nulls, empty values and row offsets (a slice of a larger table)."""
    from packtool.shards import PAYLOAD_LEAVES, PAYLOAD_SAMPLE_BYTES, _payload_sample

    for seed in range(6):
        rng = np.random.default_rng(100 + seed)

        def blob(rng=rng):
            return None if rng.random() < 0.3 else rng.bytes(int(rng.integers(0, 300_000)))

        n = int(rng.integers(1, 30))
        t = _packed_media_table([blob() for _ in range(n)], [None if rng.random() < 0.5 else
                                                             [b for b in (blob(), blob()) if b is not None]
                                                             for _ in range(n)])
        lo = int(rng.integers(0, n))
        t = t.slice(lo, int(rng.integers(0, n - lo + 1)))
        items = [m for r in t.column("media").to_pylist() for m in r]
        for leaf, values in ((PAYLOAD_LEAVES[0], [m["data"] for m in items]),
                             (PAYLOAD_LEAVES[1], [f for m in items for f in (m["frames"] or [])])):
            want = b"".join(v for v in values if v)[:PAYLOAD_SAMPLE_BYTES]
            assert _payload_sample(t, leaf) == want, f"seed {100 + seed}, {leaf}"


def test_a_pack_of_real_images_stores_their_bytes_uncompressed_and_the_same_on_any_workers(tmp_path):
    """End to end: distinct photo-like JPEGs embed into a column Parquet does not compress (the
    other columns stay zstd but the token id blob, LZ4), read back as the files' bytes, and the shards are the same bytes
    on one worker and two; a corpus of flat images keeps zstd for the same column."""
    import json

    import pyarrow.parquet as pq
    from PIL import Image

    from bench.bench_media import photo_like_jpeg
    from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset
    from packtool.shards import FAST_LEAVES, read_manifest

    seed = 8
    rng = np.random.default_rng(seed)
    codecs = {}
    for kind in ("photo", "flat"):
        root = tmp_path / kind
        (root / "images").mkdir(parents=True)
        with open(root / "data.jsonl", "w") as fh:
            for i in range(12):
                path = root / "images" / f"{i}.jpg"
                if kind == "photo":
                    path.write_bytes(photo_like_jpeg(rng, 320 + 8 * i, 240))  # headers a small share
                else:
                    Image.new("RGB", (96 + 8 * i, 80), (i * 20, 90, 160)).save(path, quality=90)
                fh.write(json.dumps({"id": str(i), "image": f"images/{i}.jpg", "conversations": [
                    {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A picture."}]}) + "\n")
        tokenize_dataset([root / "data.jsonl"], root / "tok", TokenizeConfig(media_root=str(root), rows_per_shard=4))
        digests = []
        for workers in (1, 2):
            out = root / f"packed-{workers}"
            pack_dataset(root / "tok", out, PackConfig(max_tokens=2048, packs_per_shard=2), workers=workers)
            digests.append([s["sha256"] for s in read_manifest(out)["shards"]])
        assert digests[0] == digests[1] and len(digests[0]) >= 2, f"{kind}, seed {seed}"
        files = sorted((root / "packed-1").glob("part-*.parquet"))
        codecs[kind] = set()
        for f in files:
            md = pq.read_metadata(f)
            for g in range(md.num_row_groups):
                for c in range(md.num_columns):
                    col = md.row_group(g).column(c)
                    if col.path_in_schema == "media.list.element.data":
                        codecs[kind].add(col.compression)
                    elif not col.path_in_schema.startswith("media.list.element.frames"):
                        want = "LZ4" if col.path_in_schema in FAST_LEAVES else "ZSTD"
                        assert col.compression == want, (kind, col.path_in_schema)
        embedded = [m for f in files for r in pq.read_table(f, columns=["media"])["media"].to_pylist() for m in r]
        assert len(embedded) == 12
        assert all(m["data"] == (root / m["path"]).read_bytes() for m in embedded), kind
    assert codecs == {"photo": {"UNCOMPRESSED"}, "flat": {"ZSTD"}}, f"seed {seed}"


def _value_bytes(value, t: pa.DataType) -> int:
    """:func:`row_bytes`'s rule on one Python value: binaries at their length, list values at
    theirs, struct fields summed, any other value at its type's width (null: 0 for a binary or
    list, the width for a fixed-width field)."""
    if pa.types.is_binary(t) or pa.types.is_string(t):
        return 0 if value is None else len(value if isinstance(value, bytes) else value.encode())
    if pa.types.is_list(t):
        return 0 if value is None else sum(_value_bytes(x, t.value_type) for x in value)
    if pa.types.is_struct(t):
        return sum(_value_bytes(None if value is None else value[f.name], f.type) for f in t)
    return max(1, t.bit_width // 8)


@pytest.mark.parametrize("seed", range(4))
def test_row_bytes_follows_its_rule_through_nulls_slices_and_nesting(seed):
    from packtool.shards import row_bytes

    rng = np.random.default_rng(seed)
    item = pa.struct([("kind", pa.string()), ("n", pa.int32()), ("ok", pa.bool_()), ("ts", pa.list_(pa.float64())),
                      ("data", pa.binary()), ("frames", pa.list_(pa.binary()))])
    schema = pa.schema([("id", pa.string()), ("ids", pa.list_(pa.int32())), ("media", pa.list_(item))])

    def maybe(make):
        return None if rng.random() < 0.25 else make()

    def media():
        return {"kind": maybe(lambda: "image"), "n": int(rng.integers(9)), "ok": bool(rng.random() < 0.5),
                "ts": maybe(lambda: rng.random(int(rng.integers(4))).tolist()),
                "data": maybe(lambda: rng.bytes(int(rng.integers(20)))),
                "frames": maybe(lambda: [rng.bytes(int(rng.integers(5))) for _ in range(int(rng.integers(3)))])}

    rows = [{"id": maybe(lambda: "x" * int(rng.integers(6))), "ids": maybe(lambda: list(range(int(rng.integers(5))))),
             "media": maybe(lambda: [maybe(media) for _ in range(int(rng.integers(4)))])} for _ in range(40)]
    table = pa.Table.from_pylist(rows, schema=schema)
    for lo, n in [(0, 40), (7, 20), (39, 1), (13, 0)]:
        part = table.slice(lo, n)
        want = [sum(_value_bytes(r[f.name], f.type) for f in schema) for r in part.to_pylist()]
        assert row_bytes(part).tolist() == want, f"seed {seed}, rows {lo}..{lo + n}"


def test_clear_task_removes_the_temporary_of_a_marker_stopped_before_its_rename(tmp_path):
    """A worker stopped (SIGTERM, Ctrl-C) between writing its completion marker's temporary and
    renaming it leaves ``.task-TTTTT.json.PID@HOST.tmp``; clearing the unfinished task removes
    it, and only that task's."""
    from packtool.shards import STATE_DIR, clear_task, marker_path
    from packtool.shards import tmp_path as writer_tmp

    (tmp_path / STATE_DIR).mkdir()
    mine, other = writer_tmp(marker_path(tmp_path, 1)), writer_tmp(marker_path(tmp_path, 12))
    for f in (mine, other):
        f.write_text("{}")
    clear_task(tmp_path, 1)
    assert not mine.exists() and other.exists()



@pytest.mark.parametrize("size", [0, 1, (1 << 18) - 1, (1 << 20) + 5, 3 << 20])
def test_sha256_file_is_the_digest_of_the_whole_file(tmp_path, size):
    import hashlib

    from packtool.shards import sha256_file

    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    assert sha256_file(path) == hashlib.sha256(data).hexdigest()
