"""One corpus holding every input format tokenizes in one command with ``--format auto``,
and the sample counts match the input exactly; bad rows land in errors.jsonl."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard
from PIL import Image
from test_formats import (
    IMAGE_STRUCT,
    LLAVA,
    MLLM_DEMO,
    MOLMO,
    QWEN_VL,
    SHAREGPT_DEFAULT_TAGS,
    TURN,
    png_bytes,
)

from packtool.cli import main
from packtool.errors import REASON_CODES


def make_corpus(root: Path) -> tuple[Path, Path, dict]:
    """Every format, every container; returns (input dir, media root, expected counts)."""
    media = root / "media"
    for rel, size in [("000000033471.jpg", (640, 480)), ("mllm_demo_data/1.jpg", (320, 240)),
                      ("shapes/square.png", (64, 64)), ("images/a.png", (56, 56)), ("images/b.png", (84, 56)),
                      ("images/17.jpg", (200, 100)), ("images/red.png", (60, 40))]:
        (media / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", size, (120, 40, 40)).save(media / rel)
    data = root / "data"
    data.mkdir()
    swift = {"messages": [{"role": "user", "content": "<image>What is in the picture?"},
                          {"role": "assistant", "content": "A red rectangle."}], "images": ["images/red.png"]}
    (data / "a_llava.json").write_text(json.dumps([LLAVA, QWEN_VL]))
    (data / "b_sharegpt.jsonl").write_text(json.dumps(SHAREGPT_DEFAULT_TAGS) + "\n" + json.dumps(MLLM_DEMO) + "\n")
    (data / "c_swift.jsonl.gz").write_bytes(gzip.compress((json.dumps(swift) + "\n").encode()))
    (data / "d_molmo.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress((json.dumps(MOLMO) + "\n").encode()))
    conv = [{"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": "Red."}]
    shard_dir = data / "e_parquet"
    shard_dir.mkdir()
    for i in range(2):
        pq.write_table(pa.table({
            "id": [f"pq{i}"], "image": pa.array([{"bytes": png_bytes(), "path": f"{i}.png"}], IMAGE_STRUCT),
            "conversations": pa.array([conv], pa.list_(TURN))}), shard_dir / f"train-{i:05d}-of-00002.parquet")
    bad = [b'{"broken', json.dumps({"id": "ghost", "image": "nope.png", "conversations": conv}).encode(),
           json.dumps({"id": "first", "conversations": [{"from": "gpt", "value": "Hi"}, {"from": "human", "value": "x"}]}).encode(),
           b'{"id": "enc", "conversations": [{"from": "human", "value": "caf\xe9"}]}']
    (data / "f_bad.jsonl").write_bytes(b"\n".join(bad) + b"\n")
    expected = {"rows_in": 2 + 2 + 1 + 1 + 2 + 4, "samples": 8, "rejected": 4, "branches": 10,
                "rejected_by_reason": {"bad_encoding": 1, "bad_json": 1, "bad_turn_order": 1, "missing_media": 1}}
    return data, media, expected


def test_every_format_in_one_command(tmp_path, capsys):
    data, media, expected = make_corpus(tmp_path)
    out = tmp_path / "tok"
    assert main(["tokenize", str(data), "--media-root", str(media), "-o", str(out), "--format", "auto",
                 "--quiet", "--json", "--workers", "1"] if _has_workers() else
                ["tokenize", str(data), "--media-root", str(media), "-o", str(out), "--quiet", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    for key, value in expected.items():
        assert got[key] == value, key
    table = pq.read_table(sorted(out.glob("*.parquet")))
    ids = table["sample_id"].to_pylist()
    assert sorted(ids) == sorted(["000000033471", "a_llava.json:1", "b_sharegpt.jsonl:0", "b_sharegpt.jsonl:1",
                                  "c_swift.jsonl.gz:0", "pixmo-17", "pq0", "pq1"])
    by_id = dict(zip(ids, table["n_branches"].to_pylist(), strict=True))
    assert by_id["pixmo-17"] == 3
    inline = [m["data"] for ms in table["media"].to_pylist() for m in ms]
    assert sum(d is not None for d in inline) == 2  # the Parquet image bytes travel inline
    errors = [json.loads(line) for line in (out / ".packtool" / "errors.jsonl").read_text().splitlines()]
    assert sorted(e["reason"] for e in errors) == ["bad_encoding", "bad_json", "bad_turn_order", "missing_media"]
    assert all(e["reason"] in REASON_CODES and e["source"].endswith("f_bad.jsonl") for e in errors)


def _has_workers() -> bool:
    import inspect

    from packtool.cli import tokenize

    return "workers" in inspect.signature(tokenize).parameters


def test_group_by_media_and_max_branches_from_the_cli(tmp_path, capsys):
    media = tmp_path / "media"
    media.mkdir()
    Image.new("RGB", (56, 56), (1, 2, 3)).save(media / "cat.png")
    recs = [{"id": f"q{i}", "image": "cat.png", "conversations": [
        {"from": "human", "value": f"<image>\nQuestion {i}?"}, {"from": "gpt", "value": f"Answer {i}."}]} for i in range(5)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    base = ["tokenize", str(path), "--media-root", str(media), "--quiet", "--json"]
    assert main([*base, "-o", str(tmp_path / "plain")]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert (plain["samples"], plain["merged_records"]) == (5, 0)  # off by default
    assert main([*base, "-o", str(tmp_path / "grouped"), "--group-by-media", "--max-branches", "2"]) == 0
    grouped = json.loads(capsys.readouterr().out)
    assert grouped["rows_in"] == 5 and grouped["merged_records"] == 4
    assert grouped["samples"] == 3 and grouped["split_extra_trees"] == 2 and grouped["branches"] == 5
    table = pq.read_table(sorted((tmp_path / "grouped").glob("*.parquet")))
    assert table["sample_id"].to_pylist() == ["q0", "q0#1", "q0#2"]
    assert table["n_branches"].to_pylist() == [2, 2, 1]
