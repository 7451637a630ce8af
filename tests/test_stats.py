"""`packtool stats`: every figure recomputed here from the shard columns with pyarrow,
the JSON shape pinned by schemas/stats.v1.json, reconciliation of every input row, gates."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from clirun import packtool

from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset
from packtool.runs import read_expanded
from packtool.stats import compute_stats, naive_padding, pack_padding, plan_stats, render_stats

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "schemas" / "stats.v1.json").read_text())


def run(*args: str) -> subprocess.CompletedProcess:
    return packtool(*args)  # in this process (tests/clirun.py): what a command prints and writes


# ----------------------------------------------------------------------------------------------
# a small JSON-Schema validator for the subset stats.v1.json uses (no extra dependency)


def _check(value, schema: dict, path: str = "$") -> list[str]:
    errors: list[str] = []
    if "$ref" in schema:
        name = schema["$ref"].split("/")[-1]
        errors += _check(value, SCHEMA["$defs"][name], path)
    for sub in schema.get("allOf", []):
        errors += _check(value, sub, path)
    if "oneOf" in schema:
        matches = sum(not _check(value, sub, path) for sub in schema["oneOf"])
        if matches != 1:
            errors.append(f"{path}: matches {matches} of oneOf")
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        ok = {
            "object": isinstance(value, dict),
            "array": isinstance(value, list),
            "string": isinstance(value, str),
            "boolean": isinstance(value, bool),
            "integer": isinstance(value, int) and not isinstance(value, bool),
            "number": isinstance(value, int | float) and not isinstance(value, bool),
            "null": value is None,
        }
        if not any(ok[t] for t in types):
            return errors + [f"{path}: {value!r} is not {types}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in {schema['enum']}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: {value} < {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: {value} > {schema['maximum']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                errors.append(f"{path}: missing {key!r}")
        for key, v in value.items():
            if key in props:
                errors += _check(v, props[key], f"{path}.{key}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{path}: unexpected key {key!r}")
            elif isinstance(schema.get("additionalProperties"), dict):
                errors += _check(v, schema["additionalProperties"], f"{path}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            errors += _check(v, schema["items"], f"{path}[{i}]")
    return errors


def validate(stats: dict) -> None:
    errors = _check(stats, SCHEMA)
    assert not errors, "\n".join(errors)
    try:
        import jsonschema
    except ImportError:
        return
    jsonschema.validate(stats, SCHEMA)


def test_the_validator_rejects_what_the_schema_forbids(demo_dirs):
    s = compute_stats(demo_dirs["packed"])
    validate(s)
    bad = dict(s, token_fill={"mean": 1.0})
    assert _check(bad, SCHEMA) == ["$.token_fill: matches 0 of oneOf"]
    assert any("missing 'p5'" in e for e in _check({"mean": 1.0}, SCHEMA["$defs"]["dist"]))
    assert any("unexpected key 'surprise'" in e for e in _check(dict(s, surprise=1), SCHEMA))
    assert any("not in [1]" in e for e in _check(dict(s, stats_version=2), SCHEMA))


# ----------------------------------------------------------------------------------------------
# independent recomputation from the shard columns


def _columns(d: Path, cols: list[str]) -> dict[str, list]:
    manifest = json.loads((d / ".packtool" / "manifest.json").read_text())
    out: dict[str, list] = {c: [] for c in cols}
    for shard in manifest["shards"]:
        t = read_expanded(d / shard["file"], columns=cols)
        for c in cols:
            out[c].extend(t[c].to_pylist())
    return out


def _naive(lengths: list[int], b: int) -> int:
    pad = 0
    for i in range(0, len(lengths), b):
        batch = lengths[i : i + b]
        pad += sum(max(batch) - x for x in batch)
    return pad


def test_packed_stats_match_the_shard_columns(demo_dirs):
    s = compute_stats(demo_dirs["packed"])
    validate(s)
    manifest = json.loads((demo_dirs["packed"] / ".packtool" / "manifest.json").read_text())
    max_t, max_u = manifest["capacities"]["max_tokens"], manifest["capacities"]["max_vision_units"]
    p = _columns(demo_dirs["packed"], ["n_tokens", "n_vision_units", "sample_ids", "input_ids", "media"])
    t = _columns(demo_dirs["tokenized"], ["sample_id", "n_tokens", "n_branches", "source"])
    tokens = np.array([len(x) for x in p["input_ids"]])  # from the token lists, not n_tokens
    units = np.array([sum(m["vision_units"] for m in media) for media in p["media"]])
    per_pack = np.array([len(x) for x in p["sample_ids"]])
    assert s["kind"] == "packed" and s["tokenized"] == str(demo_dirs["tokenized"])
    assert s["packs"] == len(tokens) and s["samples"] == per_pack.sum() == 30
    assert s["tokens"] == tokens.sum() and s["vision_units"] == units.sum()
    assert s["token_fill"]["mean"] == pytest.approx((tokens / max_t).mean(), abs=1e-4)
    assert s["token_fill"]["p5"] == pytest.approx(np.percentile(tokens / max_t, 5), abs=1e-4)
    assert s["token_fill"]["p50"] == pytest.approx(np.median(tokens / max_t), abs=1e-4)
    assert s["vision_fill"]["mean"] == pytest.approx((units / max_u).mean(), abs=1e-4)
    assert s["lower_bound"] == max(-(-tokens.sum() // max_t), -(-units.sum() // max_u))
    assert s["samples_per_pack"]["histogram"] == {str(k): int((per_pack == k).sum()) for k in sorted(set(per_pack))}
    # vision token share: image placeholder tokens counted in the token lists themselves
    pad_ids = {151655, 151656}
    vision = sum(sum(1 for x in ids if x in pad_ids) for ids in p["input_ids"])
    assert s["vision_tokens"] == vision
    assert s["vision_token_share"] == pytest.approx(vision / tokens.sum(), abs=1e-4)
    # naive padding in input (tokenized) order versus pack slack
    for n in s["padding"]["naive"]:
        assert n["pad_tokens"] == _naive(t["n_tokens"], n["batch_size"])
        assert n["slots"] == n["pad_tokens"] + sum(t["n_tokens"])
    assert s["padding"]["packtool"]["pad_tokens"] == int((max_t - tokens).sum())
    assert s["padding"]["naive"][0]["pad_tokens"] > s["padding"]["packtool"]["pad_tokens"]
    assert s["branches_per_sample"]["histogram"] == {"1": 30}
    assert s["sources"] == [{"source": t["source"][0], "samples": 30, "packed": 30, "dropped": 0,
                             "rejected": 0, "tokens": sum(t["n_tokens"]), "vision_units": int(units.sum())}]
    assert s["reconcile"]["balanced"] and s["reconcile"]["rows_in"] == 30


def test_padding_helpers_worked_examples():
    assert naive_padding(np.array([3, 1, 4, 1, 5]), 2) == (5, 19)
    assert naive_padding(np.array([], dtype=np.int64), 8) == (0, 0)
    lengths = np.random.default_rng(0).integers(1, 500, 101)
    assert naive_padding(lengths, 8)[0] == _naive(lengths.tolist(), 8)
    assert pack_padding(np.array([8000, 8192, 9000]), 8192) == (192, 25384)


def test_tokenized_stats_and_human_table(demo_dirs):
    s = compute_stats(demo_dirs["tokenized"])
    validate(s)
    t = _columns(demo_dirs["tokenized"], ["n_tokens", "n_vision_units"])
    assert s["kind"] == "tokenized" and s["packs"] is None and s["token_fill"] is None
    assert s["samples"] == 30 and s["rows_in"] == 30 and s["tokens"] == sum(t["n_tokens"])
    assert s["sample_tokens"]["p50"] == pytest.approx(np.median(t["n_tokens"]), abs=1e-4)
    assert s["sources"][0]["packed"] is None
    text = render_stats(s)
    assert "samples              30" in text and "token fill" not in text
    assert "padding, batch 8" in text and "rejected             0 of 30 rows in" in text


@pytest.fixture(scope="module")
def messy(tmp_path_factory, demo_dirs):
    """A corpus with rejected rows (bad JSON, missing image) packed so that big samples drop."""
    base = tmp_path_factory.mktemp("messy")
    sample = demo_dirs["sample"]
    lines = (sample / "data.jsonl").read_text().splitlines()[:12]
    lines.insert(3, "{not json")
    lines.insert(7, json.dumps({"id": "gone", "image": "images/nope.png",
                                "conversations": [{"from": "human", "value": "<image>\nHi"}, {"from": "gpt", "value": "Hello."}]}))
    (base / "a.jsonl").write_text("\n".join(lines) + "\n")
    (base / "b.jsonl").write_text("\n".join((sample / "data.jsonl").read_text().splitlines()[20:26]) + "\n")
    tok, packed = base / "tok", base / "packed"
    tokenize_dataset([base / "a.jsonl", base / "b.jsonl"], tok, TokenizeConfig(media_root=str(sample)))
    pack_dataset(tok, packed, PackConfig(max_tokens=2048, buffer_size=8))
    return {"tokenized": tok, "packed": packed, "base": base}


def test_pair_reconciles_rows_rejections_and_drops(messy):
    s = compute_stats(messy["tokenized"], messy["packed"])
    validate(s)
    tok_errors = [json.loads(x) for x in (messy["tokenized"] / ".packtool" / "errors.jsonl").read_text().splitlines()]
    pack_errors = [json.loads(x) for x in (messy["packed"] / ".packtool" / "errors.jsonl").read_text().splitlines()]
    packed_ids = [x for ids in _columns(messy["packed"], ["sample_ids"])["sample_ids"] for x in ids]
    assert len(tok_errors) == 2 and len(pack_errors) >= 1  # 1920x1080 images need 2,691+ tokens
    r = s["reconcile"]
    assert r["rows_in"] == 12 + 2 + 6 == len(packed_ids) + len(tok_errors) + len(pack_errors)
    assert r["balanced"] and r["missing"] == r["extra"] == 0
    assert s["rejected"]["tokenize"] == {"bad_json": 1, "missing_media": 1}
    assert s["rejected"]["pack"] == {"oversize": len(pack_errors)} and s["dropped"] == len(pack_errors)
    assert s["rejected"]["total"] == 2 + len(pack_errors)
    by_src = {Path(x["source"]).name: x for x in s["sources"]}
    assert set(by_src) == {"a.jsonl", "b.jsonl"}
    assert by_src["a.jsonl"]["samples"] == 12 and by_src["a.jsonl"]["rejected"] == 2
    assert by_src["b.jsonl"]["samples"] == 6 and by_src["b.jsonl"]["rejected"] == 0
    for src, row in by_src.items():
        dropped_here = sum(1 for e in pack_errors if Path(e["source"]).name == src)
        assert row["dropped"] == dropped_here and row["packed"] == row["samples"] - dropped_here
    # the packed directory alone finds its tokenized directory through its manifest
    assert compute_stats(messy["packed"])["reconcile"] == r
    text = render_stats(s)
    assert (f"rows in = packed + rejected  20 = {len(packed_ids)} + {2 + len(pack_errors)}  ok  (rejected: 2 by tokenize, "
            f"{len(pack_errors)} by pack)") in text
    assert "  tokenize: bad_json" in text and "  pack: oversize" in text


def test_pair_from_another_tokenized_run_is_refused(messy, demo_dirs):
    r = run("stats", str(demo_dirs["tokenized"]), str(messy["packed"]))
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("Error: ") and "config digest" in r.stderr and "Traceback" not in r.stderr


def _orphan(messy, tmp_path: Path) -> Path:
    """A copy of the messy packed directory whose manifest names a tokenized directory that is not there."""
    import shutil

    moved = tmp_path / "packed-alone"
    shutil.copytree(messy["packed"], moved)
    manifest = json.loads((moved / ".packtool" / "manifest.json").read_text())
    manifest["source"].update(path=str(tmp_path / "not-there"), relative="../not-there")
    (moved / ".packtool" / "manifest.json").write_text(json.dumps(manifest))
    return moved


def test_packed_dir_without_its_tokenized_dir_still_reports(messy, tmp_path):
    moved = _orphan(messy, tmp_path)
    s = compute_stats(moved)
    validate(s)
    full = compute_stats(messy["packed"])
    assert s["tokenized"] is None and s["sources"] is None and s["reconcile"] is None
    assert s["padding"]["order"] == "pack" and s["notes"]
    for key in ("packs", "samples", "tokens", "token_fill", "vision_fill", "samples_per_pack", "sample_tokens"):
        assert s[key] == full[key], key


def test_a_pair_packed_with_relative_paths_is_found_from_any_directory(messy, tmp_path):
    # the manifest named the tokenized directory only as typed ("tok"): from another directory
    # stats lost its reconciliation and inspect its tokenizer record
    import shutil

    shutil.copytree(messy["tokenized"], tmp_path / "tok")
    r = packtool("pack", "tok", "-o", "packed", "--max-tokens", "2048", "--buffer-size", "8", "-q", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    source = json.loads((tmp_path / "packed" / ".packtool" / "manifest.json").read_text())["source"]
    assert source["path"] == "tok" and source["relative"] == "../tok"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "moved").mkdir()  # and once both are moved together
    for name in ("tok", "packed"):
        shutil.copytree(tmp_path / name, tmp_path / "moved" / name)
    r = packtool("stats", str(tmp_path / "moved" / "packed"), "--json", cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["reconcile"] == compute_stats(messy["tokenized"], messy["packed"])["reconcile"] and s["reconcile"]["balanced"]
    assert s["tokenized"] is not None and not s["notes"]


def test_packed_dir_whose_tokenized_dir_was_tokenized_again_says_so(messy, tmp_path):
    # the note said "tokenized directory not found ... pass it first", and passing it failed on its digest
    import shutil

    tok, packed = tmp_path / "tok", tmp_path / "packed"
    shutil.copytree(messy["tokenized"], tok)
    pack_dataset(tok, packed, PackConfig(max_tokens=2048, buffer_size=8))
    was = json.loads((tok / ".packtool" / "manifest.json").read_text())["config_digest"]
    tokenize_dataset([messy["base"] / "b.jsonl"], tok, TokenizeConfig(media_root=str(ROOT / "examples" / "sample"),
                                                                      max_pixels=200_000), overwrite=True)
    now = json.loads((tok / ".packtool" / "manifest.json").read_text())["config_digest"]
    assert now != was
    r = run("stats", str(packed))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == (
        f"note: the tokenized directory {str(tok)!r} was tokenized again since (config digest {now}; these packs were "
        f"made from {was}): no input order, sources, branches or reconciliation; to have them, pass the tokenized "
        "directory it was packed from first: packtool stats TOKENIZED PACKED")
    s = compute_stats(packed)
    validate(s)
    assert s["tokenized"] is None and s["reconcile"] is None and s["samples"] == compute_stats(messy["packed"])["samples"]


def test_a_tokenized_dir_made_again_with_the_same_settings_is_not_taken_for_the_packed_ones(tmp_path):
    """Tokenized again in place with the same flags after its input changed, the directory kept its
    config digest, so stats paired the old packs with the new samples: `stats PACKED` (no gate)
    failed with "rows do not reconcile: ... 1 missing", and a gate counted the new run's rejections."""
    src = tmp_path / "in.jsonl"

    def write(n: int) -> None:
        src.write_text("".join(json.dumps({"id": f"t{i}", "conversations": [
            {"from": "human", "value": "hello " * (i + 1)}, {"from": "gpt", "value": "ok"}]}) + "\n" for i in range(n)))

    tok, packed = tmp_path / "tok", tmp_path / "packed"
    write(4)
    assert run("tokenize", str(src), "-o", str(tok), "-q", "--workers", "1").returncode == 0
    r = run("pack", str(tok), "-o", str(packed), "--max-tokens", "512", "-q", "--workers", "1")
    assert r.returncode == 0, r.stderr
    assert run("stats", str(packed)).returncode == 0
    write(5)  # one record more, the same flags, into the same -o
    r = run("tokenize", str(src), "-o", str(tok), "-q", "--workers", "1", "--overwrite")
    assert r.returncode == 0, r.stderr
    r = run("stats", str(packed))
    assert (r.returncode, r.stderr) == (0, ""), r.stderr
    assert r.stdout.splitlines()[-1] == (
        f"note: the tokenized directory {str(tok)!r} was tokenized again since, with the same settings (its shards "
        "are not the ones these packs were made from): no input order, sources, branches or reconciliation; to have "
        "them, pass the tokenized directory it was packed from first: packtool stats TOKENIZED PACKED")
    r = run("stats", str(tok), str(packed))
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr == (f"Error: {str(packed)!r} was packed from other tokenized shards than {str(tok)!r} holds now "
                        "(it was tokenized again since, with the same settings: its inputs changed); pass the "
                        f"tokenized directory it was made from, or pack {str(tok)!r} again\n")


def test_rejected_gate_without_the_tokenized_dir_refuses_rather_than_count_pack_drops_alone(messy, tmp_path):
    # it measured pack drops over packed + dropped samples (the rows tokenize rejected unknown),
    # a lower share than the pair's, and passed a run the pair fails
    moved = _orphan(messy, tmp_path)
    pair = compute_stats(messy["tokenized"], messy["packed"])
    share = round(2 / 20 + pair["dropped"] / 18 * (18 / 20), 4)  # 2 of 20 rows rejected, then drops of 18 samples
    limit = f"{share - 0.01:.4f}"
    r = run("stats", str(messy["tokenized"]), str(messy["packed"]), "--fail-above-rejected", limit)
    assert r.returncode == 1 and r.stderr == f"Error: rejected_fraction {share:.4g} is above --fail-above-rejected {float(limit):.4g}\n"
    r = run("stats", str(moved), "--fail-above-rejected", limit)
    assert (r.returncode, r.stdout) == (1, run("stats", str(moved)).stdout)  # the stats, then the error
    assert r.stderr == (f"Error: --fail-above-rejected counts the rows tokenize rejected, which only the tokenized "
                        f"directory knows, and the one {str(moved)!r} was packed from is not where its manifest says "
                        f"(or was tokenized again since); pass it first: packtool stats TOKENIZED {moved}\n")
    r = run("stats", str(moved), "--fail-below-fill", "0.01")  # the other gates need only the packs
    assert r.returncode == 0, r.stderr


def test_rejected_gate_of_a_mixture_counts_the_rows_its_sources_rejected(messy, tmp_path):
    """A mixture's packed manifest recorded nothing of what tokenize rejected, and the gate skipped
    that part for mixtures: the same tokenized directory failed the gate packed alone and passed it
    packed with --rates 1. Each source's rows read and rejected now travel in the mixture."""
    pair = compute_stats(messy["tokenized"], messy["packed"])
    share = round(2 / 20 + pair["dropped"] / 18 * (18 / 20), 4)  # as packed alone
    limit = f"{share - 0.01:.4f}"
    mixed = tmp_path / "mixed"
    r = run("pack", str(messy["tokenized"]), "--rates", "1", "-o", str(mixed), "--max-tokens", "2048",
            "--buffer-size", "8", "--quiet")
    assert r.returncode == 0, r.stderr
    s = compute_stats(mixed)
    validate(s)
    by_reason = pair["rejected"]["tokenize"]
    assert [x["tokenized"] for x in s["mixture"]["sources"]] == [{"rows_in": 20, "rejected": 2,
                                                                   "rejected_by_reason": by_reason}]
    assert s["mixture"]["sources"][0]["realised"]["samples"] == pair["samples"]
    # the summary says what the gate counts: the sources' rows and rejections, not "rejected 0"
    assert (s["rows_in"], s["rejected"]["tokenize"]) == (20, by_reason) and sum(by_reason.values()) == 2
    assert s["rejected"]["total"] == 2 + sum(s["rejected"]["pack"].values())
    shown = run("stats", str(mixed)).stdout
    n_pack = sum(s["rejected"]["pack"].values())
    assert (f"rejected                     {s['rejected']['total']}: 2 of 20 rows in by tokenize (the sources' rows, "
            f"each once), {n_pack} of 18 selected samples by pack;") in shown
    r = run("stats", str(mixed), "--fail-above-rejected", limit)
    assert (r.returncode, r.stderr) == (1, f"Error: rejected_fraction {share:.4g} is above --fail-above-rejected "
                                           f"{float(limit):.4g}\n")
    assert run("stats", str(mixed), "--fail-above-rejected", f"{share:.4f}").returncode == 0
    # a mixture packed before the rows were recorded: refused, naming the fixes, not passed
    file = mixed / ".packtool" / "manifest.json"
    manifest = json.loads(file.read_text())
    for source in manifest["mixture"]["sources"]:
        del source["tokenized"]["rejected_by_reason"]  # an earlier packtool recorded the total alone
    file.write_text(json.dumps(manifest))
    assert compute_stats(mixed)["rejected"]["tokenize"] == {"unknown": 2}
    for source in manifest["mixture"]["sources"]:
        del source["tokenized"]
    file.write_text(json.dumps(manifest))
    r = run("stats", str(mixed), "--fail-above-rejected", "0.99")
    assert (r.returncode, r.stdout) == (1, run("stats", str(mixed)).stdout)  # the stats, then the error
    assert r.stderr == (f"Error: --fail-above-rejected counts the rows tokenize rejected of each source, which the "
                        f"manifest of {str(mixed)!r} does not record (a mixture packed by an earlier packtool); pack it "
                        "again, or gate each source: packtool stats TOKENIZED --fail-above-rejected ...\n")
    validate(compute_stats(mixed))


def test_a_mixtures_rejected_line_counts_pack_drops_of_the_selected_samples_not_of_the_rows(messy, tmp_path):
    """At rate 3 every dropped sample is dropped three times: the line said "rejected 8 of 20 rows in"
    (pack drops of copies over the sources' rows, each once: 40%, where the gate counts 20%; at a
    higher rate more rows than were read). Each stage's count is now shown against what it counted."""
    mixed = tmp_path / "mixed3"
    r = run("pack", str(messy["tokenized"]), "--rates", "3", "-o", str(mixed), "--max-tokens", "2048",
            "--buffer-size", "8", "--quiet")
    assert r.returncode == 0, r.stderr
    s = compute_stats(mixed)
    dropped = compute_stats(messy["tokenized"], messy["packed"])["dropped"]
    assert dropped and s["dropped"] == 3 * dropped and s["rejected"]["total"] == 2 + 3 * dropped
    shown = run("stats", str(mixed)).stdout
    assert (f"rejected                     {2 + 3 * dropped}: 2 of 20 rows in by tokenize (the sources' rows, each "
            f"once), {3 * dropped} of 54 selected samples by pack;") in shown
    share = round(2 / 20 + 3 * dropped / 54 * (18 / 20), 4)  # the gate's share: as packed alone
    assert run("stats", str(mixed), "--fail-above-rejected", f"{share:.4f}").returncode == 0
    assert run("stats", str(mixed), "--fail-above-rejected", f"{share - 0.001:.4f}").returncode == 1


def test_dry_run_plan_stats_equal_the_written_packs(messy):
    cfg = PackConfig(max_tokens=2048, buffer_size=8)
    result = pack_dataset(messy["tokenized"], messy["base"] / "unused", cfg, dry_run=True)
    planned = plan_stats(messy["tokenized"], result)
    validate(planned)
    written = compute_stats(messy["packed"])
    assert not (messy["base"] / "unused").exists()
    assert planned["kind"] == "plan"
    for key in ("packs", "lower_bound", "samples", "tokens", "vision_tokens", "vision_units", "token_fill",
                "vision_fill", "samples_per_pack", "sample_tokens", "padding", "dropped", "rejected"):
        assert planned[key] == written[key], key


def test_cli_json_and_fill_gate(messy):
    r = run("stats", str(messy["packed"]), "--json", "--fail-below-fill", "0.05", "--fail-above-ratio", "10")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    validate(s)
    assert [c["name"] for c in s["thresholds"]] == ["token_fill_mean", "packs_over_lower_bound"]
    assert all(c["passed"] for c in s["thresholds"])
    r = run("stats", str(messy["packed"]), "--fail-below-fill", "0.999")
    assert r.returncode == 1
    assert "token fill" in r.stdout and "gate --fail-below-fill" in r.stdout and "FAIL" in r.stdout
    mean = compute_stats(messy["packed"])["token_fill"]["mean"]
    assert r.stderr == f"Error: token_fill_mean {mean:.4g} is below --fail-below-fill 0.999\n"
    r = run("stats", str(messy["packed"]), "--fail-above-rejected", "0.01", "--json")
    assert r.returncode == 1 and "rejected_fraction" in r.stderr
    assert json.loads(r.stdout)["thresholds"][0]["passed"] is False


def test_a_failed_gate_never_prints_its_value_equal_to_its_limit(demo_dirs):
    """The message rounded both numbers to 4 significant digits: a limit just past the value read
    "packs_over_lower_bound 1 is above --fail-above-ratio 1", a failure that seems to contradict itself."""
    s = compute_stats(demo_dirs["packed"])
    mean, ratio = s["token_fill"]["mean"], s["packs_over_lower_bound"]
    assert ratio == 1.0 and len(str(mean)) <= 6  # the demo: 4 packs, its lower bound; the mean at 4 decimals
    fill_limit = round(mean + 0.00001, 5)
    r = run("stats", str(demo_dirs["packed"]), "--fail-below-fill", str(fill_limit), "--fail-above-ratio", "0.99999")
    assert r.returncode == 1
    assert r.stderr == (f"Error: token_fill_mean {mean} is below --fail-below-fill {fill_limit}; "
                        "packs_over_lower_bound 1 is above --fail-above-ratio 0.99999\n")
    assert f"gate --fail-below-fill       {mean} vs {fill_limit}  FAIL\n" in r.stdout  # the same in the stats
    assert "gate --fail-above-ratio      1 vs 0.99999  FAIL\n" in r.stdout
    r = run("stats", str(demo_dirs["packed"]), "--fail-above-ratio", "0.9999999")  # past 6 digits too
    assert r.stderr == "Error: packs_over_lower_bound 1 is above --fail-above-ratio 0.9999999\n"


@pytest.mark.parametrize(("flag", "value", "bound"), [
    ("--fail-below-fill", "1.5", "less than or equal to 1"),
    ("--fail-below-vision-fill", "2", "less than or equal to 1"),
    ("--fail-above-rejected", "1.01", "less than or equal to 1"),
    ("--fail-above-ratio", "-1", "greater than or equal to 0"),
])
def test_a_gate_outside_its_range_is_a_usage_error(demo_dirs, flag, value, bound):
    r = run("stats", str(demo_dirs["packed"]), flag, value)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.startswith("Usage: packtool stats ")
    assert r.stderr.endswith(f"\n\nError: Invalid value for '{flag}': Input should be {bound}\n"), r.stderr


@pytest.mark.parametrize(("gates", "message"), [
    ({"fail_below_fill": 1.5}, "--fail-below-fill 1.5: give a fraction from 0 to 1 (0.95 for 95%)"),
    ({"fail_above_rejected": float("nan")}, "--fail-above-rejected nan: give a fraction from 0 to 1 (0.95 for 95%)"),
    ({"fail_above_ratio": -0.5}, "--fail-above-ratio -0.5: give a non-negative ratio (1.05 for 5% above the lower "
                                 "bound)"),
    ({"fail_above_ratio": float("inf")}, "--fail-above-ratio inf: give a non-negative ratio (1.05 for 5% above the "
                                         "lower bound)"),
])
def test_thresholds_refuse_a_gate_outside_its_range_from_python(gates, message):
    from packtool.errors import ConfigError
    from packtool.stats import Thresholds

    with pytest.raises(ConfigError) as err:
        Thresholds(**gates)
    assert str(err.value) == message
    Thresholds(0, 1, 0, 1)  # the ends of the ranges are gates


def test_fill_gate_on_a_tokenized_dir_says_what_to_pass(demo_dirs):
    r = run("stats", str(demo_dirs["tokenized"]), "--fail-below-fill", "0.9")
    assert r.returncode == 1 and "--fail-below-fill needs packs" in r.stderr and "packed directory" in r.stderr


@pytest.mark.parametrize("flag", ["--fail-below-fill", "--fail-below-vision-fill", "--fail-above-ratio"])
def test_a_pack_gate_on_a_packed_dir_without_packs_says_why_it_has_none(demo_dirs, tmp_path, flag):
    """A packed directory whose run packed nothing (every sample oversize here) is a packed
    directory: the gate says it holds no pack, why, and the fix, not "pass a packed directory"."""
    empty = tmp_path / "empty"
    r = run("pack", str(demo_dirs["tokenized"]), "-o", str(empty), "--max-tokens", "16", "--workers", "1", "-q")
    assert r.returncode == 0 and r.stdout.startswith("0 samples in 0 packs"), r.stderr
    r = run("stats", str(empty), flag, "0.5")
    # the stats first, as for a gate that fails (the README: gates exit 1 after printing them)
    assert r.returncode == 1 and r.stdout == run("stats", str(empty)).stdout and "packs                        0" in r.stdout
    assert r.stderr == (f"Error: {flag} needs packs, and {str(empty)!r} holds none: all 30 of its samples were dropped "
                        "as oversize (listed in .packtool/errors.jsonl); pack again with a larger --max-tokens or "
                        "--max-vision-units, or with --oversize alone\n")
    assert "Traceback" not in r.stderr and run("stats", str(empty)).returncode == 0  # without a gate: the zeros


def test_vision_fill_gate_on_packs_without_vision_capacity_says_so(demo_dirs, tmp_path):
    """Packs made with --max-vision-units 0 have no vision fill; the gate said the directory "holds
    none" (no packs) "packed from a tokenized directory with no samples", neither of which is so."""
    out = tmp_path / "no-vision"
    r = run("pack", str(demo_dirs["tokenized"]), "-o", str(out), "--max-tokens", "8192", "--max-vision-units", "0",
            "--workers", "1", "-q")
    assert r.returncode == 0 and r.stdout.startswith("4 samples in 1 pack"), (r.stdout, r.stderr)  # the text-only ones
    r = run("stats", str(out), "--fail-below-vision-fill", "0.5")
    assert r.returncode == 1 and r.stdout == run("stats", str(out)).stdout  # the stats, then the error
    assert r.stderr == (f"Error: --fail-below-vision-fill needs a vision capacity, and {str(out)!r} was packed with "
                        "--max-vision-units 0, so its packs have no vision fill; leave the gate out, or pack again "
                        "with a vision capacity\n")
    assert run("stats", str(out), "--fail-below-fill", "0.01").returncode == 0  # the token gate measures them


def test_stats_reads_no_token_or_media_bytes(demo_dirs, monkeypatch):
    """Stats stay cheap: only length columns (and one media leaf) are read from the shards."""
    read = []
    orig = pq.ParquetFile.read

    def spy(self, columns=None, **kw):
        read.append(tuple(columns or ("<all>",)))
        return orig(self, columns=columns, **kw)

    monkeypatch.setattr(pq.ParquetFile, "read", spy)
    compute_stats(demo_dirs["packed"])
    cols = {c for r in read for c in r}
    assert read and not cols & {"<all>", "input_ids", "target_ids", "media", "media.list.element.data.list.element"}


def test_samples_per_pack_counts_cu_seqlens(demo_dirs):
    t = pq.read_table(next(demo_dirs["packed"].glob("*.parquet")), columns=["cu_seqlens", "sample_ids"])
    lens = pc.list_value_length(t["cu_seqlens"]).to_numpy() - 1
    s = compute_stats(demo_dirs["packed"])
    assert s["samples_per_pack"]["max"] == lens.max() and s["samples_per_pack"]["min"] == lens.min()


def test_trees_from_grouped_records_still_reconcile(demo_dirs, tmp_path):
    """--group-by-media folds records into trees: rows in = packed + rejected + merged."""
    sample = demo_dirs["sample"]
    tok, packed = tmp_path / "tok", tmp_path / "packed"
    tokenize_dataset([sample / "data.jsonl"], tok, TokenizeConfig(media_root=str(sample), group_by_media=True))
    pack_dataset(tok, packed, PackConfig(max_tokens=8192))
    s = compute_stats(packed)
    validate(s)
    t = _columns(tok, ["n_branches"])["n_branches"]
    merged = json.loads((tok / ".packtool" / "manifest.json").read_text())["counts"]["merged_records"]
    assert merged == 30 - len(t) > 0
    assert s["reconcile"]["merged_records"] == merged and s["reconcile"]["balanced"]
    assert s["branches_per_sample"]["histogram"] == {str(b): t.count(b) for b in sorted(set(t))}
    assert sum(b * n for b, n in ((int(k), v) for k, v in s["branches_per_sample"]["histogram"].items())) == 30
    assert f"30 = {len(t)} + 0 + {merged} merged - 0 split  ok  (rejected: 0 by tokenize, 0 by pack)" in render_stats(s)


def test_grouped_records_of_a_missing_image_are_each_rejected(demo_dirs, tmp_path):
    """--group-by-media folds the records of one image into a tree before its media are probed;
    a tree rejected then (its image is gone) used to give one errors.jsonl line, for its first
    record, and count the others as merged into a tree no shard holds. Every record is a
    rejected row of its own now, and the rows still reconcile."""
    sample = demo_dirs["sample"]
    records = [json.loads(line) for line in (sample / "data.jsonl").read_text().splitlines()]
    gone = next(r["image"] for r in records if "image" in r)
    shared = [r["id"] for r in records if r.get("image") == gone]
    assert len(shared) > 1, "the demo corpus should share an image between records"
    expect = [r["id"] for r in records if gone in (r["image"] if isinstance(r.get("image"), list) else [r.get("image")])]
    data = tmp_path / "data.jsonl"
    data.write_text((sample / "data.jsonl").read_text())
    root = tmp_path / "root"
    root.mkdir()
    for f in (sample / "images").iterdir():
        (root / "images").mkdir(exist_ok=True)
        if f"images/{f.name}" != gone:
            (root / "images" / f.name).write_bytes(f.read_bytes())
    tok, packed = tmp_path / "tok", tmp_path / "packed"
    m = tokenize_dataset([data], tok, TokenizeConfig(media_root=str(root), group_by_media=True))
    errors = [json.loads(line) for line in (tok / ".packtool" / "errors.jsonl").read_text().splitlines()]
    assert sorted(e["sample_id"] for e in errors) == sorted(expect)
    assert {e["reason"] for e in errors} == {"missing_media"}
    assert m["counts"]["rejected"] == len(expect) and m["counts"]["rows_in"] == len(records)
    pack_dataset(tok, packed, PackConfig(max_tokens=8192))
    s = compute_stats(packed)
    assert s["reconcile"]["balanced"], s["reconcile"]
    assert s["reconcile"]["merged_records"] == m["counts"]["merged_records"]


def test_the_lower_bound_gives_each_alone_sample_its_own_pack(demo_dirs, tmp_path):
    """``--oversize alone`` packs over-capacity samples one a pack; counting their tokens in the
    bound's Σtokens put the bound above the packs (0.41x on the demo at 512 tokens), so
    ``--fail-above-ratio`` could never fail. The bound is now the fitting samples' plus one pack
    per alone sample, the same in the manifest, the dry run and ``stats``."""
    from packtool.pipeline import lower_bound

    packed = tmp_path / "alone"
    cfg = PackConfig(max_tokens=512, oversize="alone")
    dry = pack_dataset(demo_dirs["tokenized"], tmp_path / "dry", cfg, dry_run=True)
    m = pack_dataset(demo_dirs["tokenized"], packed, cfg)
    c = m["counts"]
    lengths = _columns(demo_dirs["tokenized"], ["n_tokens"])["n_tokens"]
    over = [n for n in lengths if n > 512]
    assert c["alone"] == len(over) > 0 and c["alone_tokens"] == sum(over)
    expect = lower_bound(sum(lengths) - sum(over), c["vision_units"] - c["alone_vision_units"], 512,
                         m["capacities"]["max_vision_units"]) + len(over)
    assert c["lower_bound"] == dry["counts"]["lower_bound"] == expect <= c["packs"]
    s = compute_stats(packed)
    assert (s["lower_bound"], s["packs"]) == (expect, c["packs"]) and s["packs_over_lower_bound"] >= 1


@pytest.mark.jit
def test_pair_stats_stay_linear_in_the_samples(tmp_path):
    """40,000 samples: matching tokenized ids to packed ids must be a hash join. The old
    ``np.isin`` over object arrays took ~70 s here (quadratic); linear work takes about 1 s,
    so the bound below is an order of magnitude away from either."""
    import time

    from bench.corpus import write_tokenized

    tok = tmp_path / "tok"
    write_tokenized(tok, "llava", 40_000, seed=5, rows_per_shard=20_000)
    pack_dataset(tok, tmp_path / "packed", PackConfig(media="reference"), workers=1)
    t0 = time.perf_counter()
    s = compute_stats(tok, tmp_path / "packed")
    seconds = time.perf_counter() - t0
    assert s["samples"] == 40_000 and s["reconcile"]["balanced"]
    assert sum(x["packed"] for x in s["sources"]) == 40_000
    assert seconds < 12, f"stats took {seconds:.1f} s for 40,000 samples"


def test_rejected_share_counts_a_dropped_tree_as_its_share_of_the_row(tmp_path):
    """A row split into trees (``--max-branches 1``) loses one tree at pack: the gate's share is
    the rows tokenize rejected plus that tree's share of the rows it kept, never above 1. Pack
    drops counted as rows put 1 of 3 trees of one row (and one rejected row of two) at 1.0, and
    every tree of one row at 3.0: "rejected_fraction 3 is above --fail-above-rejected 0.25"."""
    record = {"id": "t", "image": "images/img00.png", "message_list": [
        {"question": "Short?", "answer": "Yes."}, {"question": "Long?", "answer": " ".join(["word"] * 400)},
        {"question": "Again?", "answer": "No."}]}
    gone = {"id": "gone", "image": "images/none.png",
            "conversations": [{"from": "human", "value": "<image>\nQ?"}, {"from": "gpt", "value": "A."}]}
    (tmp_path / "in.jsonl").write_text(json.dumps(record) + "\n" + json.dumps(gone) + "\n")
    tok, packed = tmp_path / "tok", tmp_path / "packed"
    tokenize_dataset([tmp_path / "in.jsonl"], tok, TokenizeConfig(media_root=str(ROOT / "examples" / "sample"),
                                                                   max_branches=1))
    counts = pack_dataset(tok, packed, PackConfig(max_tokens=600))["counts"]
    assert (counts["samples_in"], counts["dropped"]) == (3, 1)
    r = run("stats", str(packed), "--json", "--fail-above-rejected", "0.7")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    validate(s)
    assert (s["rows_in"], s["rejected"]["total"], s["reconcile"]["balanced"]) == (2, 2, True)
    assert s["thresholds"][0]["value"] == round(1 / 2 + 1 / 3 * 1 / 2, 4)
    # the text says what was rejected of what: a tree is not a row ("2 of 2 rows in" read as all of them)
    line = next(ln for ln in render_stats(s).splitlines() if ln.startswith("rejected "))
    assert line.split() == "rejected 2: 1 of 2 rows in by tokenize, 1 of 3 tokenized samples (message trees) by pack".split()
    pack_dataset(tok, tmp_path / "none", PackConfig(max_tokens=300))  # every tree dropped: all of the row
    r = run("stats", str(tmp_path / "none"), "--fail-above-rejected", "0.99")
    assert (r.returncode, r.stderr) == (1, "Error: rejected_fraction 1 is above --fail-above-rejected 0.99\n")


def test_an_id_samples_of_two_tasks_share_is_counted_and_a_drop_lands_on_its_own_source(tmp_path):
    """Tasks name their samples apart only within themselves. A sample packed and another of the
    same id dropped gave both sources 'packed' (the drop matched by id alone, which the packed one
    also bore): the source of the dropped sample showed no drop. A drop is matched by id and input
    row, and the shared ids are noted."""
    lines = (ROOT / "examples" / "sample" / "data.jsonl").read_text().splitlines()
    small = [{**json.loads(lines[i]), "id": sid} for i, sid in ((0, "a"), (2, "b"), (4, "c"))]  # 433, 433, 119 tokens
    big = {**json.loads(lines[1]), "id": "a"}  # 2,733 tokens: over --max-tokens 1000
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    one.write_text("".join(json.dumps(r) + "\n" for r in small))
    two.write_text(json.dumps(big) + "\n")
    tok, packed = tmp_path / "tok", tmp_path / "packed"
    tokenize_dataset([one, two], tok, TokenizeConfig(media_root=str(ROOT / "examples" / "sample"), rows_per_shard=3))
    pack_dataset(tok, packed, PackConfig(max_tokens=1000))
    s = compute_stats(tok, packed)
    assert [(r["source"], r["samples"], r["packed"], r["dropped"]) for r in s["sources"]] == [
        (str(one), 3, 3, 0), (str(two), 1, 0, 1)]
    assert s["reconcile"]["balanced"] and s["dropped"] == 1
    assert s["notes"] == ["2 samples of the tokenized directory share their id with another (tokenize names samples "
                          "apart only within one task, an input slice): `packtool inspect --sample ID` lists each; "
                          "give the records ids of their own"]
    assert compute_stats(tok)["notes"] == s["notes"]
    assert s["branches_per_sample"]["histogram"] == {"1": 3}  # the packed samples: the dropped one is not
