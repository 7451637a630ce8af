"""Training mixtures: several tokenized sources packed at rates or target counts (issue 17).

The demo corpus is cut into three sources of 10, 6 and 14 samples. Every count below follows
the rule written in ``packtool/mixture.py`` and the README: a source of ``n`` samples at rate
``r`` gives ``floor(r * n + 1/2)`` samples, ``count // n`` full copies of every sample, then
the ``count % n`` rows with the smallest ``splitmix64`` key. The packed Parquet rows are read
back and every per-source number ``stats`` prints is recomputed from them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import Counter
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from clirun import packtool

from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset
from packtool.errors import ConfigError
from packtool.mixture import Mixture, interleave, plan_mixture, requested_count, select_rows
from packtool.runs import read_expanded
from packtool.schema import PACKED, PACKED_MIXTURE

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "examples" / "sample"
SIZES = {"a": 10, "b": 6, "c": 14}
MASK64 = (1 << 64) - 1


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return packtool(*args, cwd=cwd)  # in this process (tests/clirun.py): what a command prints and writes


# ---------------------------------------------------------------------------------------------
# a slow twin of the seeded subset, written from the documented rule with Python integers


def splitmix64(x: int) -> int:
    z = x & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def naive_subset(n: int, m: int, seed: int, position: int) -> list[int]:
    base = splitmix64(splitmix64(seed) ^ position)
    keys = sorted((splitmix64((row * 0x9E3779B97F4A7C15 + base) & MASK64), row) for row in range(n))
    return sorted(row for _, row in keys[:m])


@pytest.mark.parametrize(("n", "rate", "want"), [
    (6, "2.5", 15), (14, "0.2", 3), (10, "1.0", 10),  # the done-when mixture
    (3, "2.5", 8), (10, "0.25", 3), (7, "0.2", 1), (5, "0.1", 1), (5, "0.3", 2),  # halves round up
    (10, "0.1", 1), (30, "0.1", 3), (3, "1/3", 1), (4, "0.05", 0), (1, "0.5", 1), (0, "3", 0),
])
def test_the_rounding_rule_is_floor_of_rate_times_n_plus_a_half_exactly(n, rate, want):
    assert requested_count(n, rate=Fraction(rate)) == want
    # 0.1 as a float is not a tenth; the rule reads the rate as written
    assert want == int((Fraction(rate) * n + Fraction(1, 2)) // 1)


@pytest.mark.parametrize(("n", "count", "seed", "position"), [(6, 15, 0, 1), (14, 3, 0, 2), (14, 3, 7, 2),
                                                              (100, 37, 12345, 0), (5, 5, 0, 0), (9, 2, 2**63, 4)])
def test_select_rows_matches_the_slow_twin(n, count, seed, position):
    rows, copies = select_rows(n, count, seed, position)
    k, m = divmod(count, n)
    want = list(range(n)) * k + naive_subset(n, m, seed, position)
    assert rows.tolist() == want, f"seed {seed}"
    assert copies.tolist() == [c for c in range(k) for _ in range(n)] + [k] * m


def test_the_subset_depends_on_seed_and_position():
    a = select_rows(1000, 100, 0, 0)[0].tolist()
    assert a == select_rows(1000, 100, 0, 0)[0].tolist()
    assert a != select_rows(1000, 100, 1, 0)[0].tolist()
    assert a != select_rows(1000, 100, 0, 1)[0].tolist()


def test_interleave_spreads_each_source_evenly():
    src = interleave([10, 15, 3])
    assert Counter(src.tolist()) == {0: 10, 1: 15, 2: 3}
    # entry j of a source of c entries sits at (j + 1/2) / c: every window of the stream holds
    # each source within one entry of its share
    for i, c in enumerate((10, 15, 3)):
        seen = np.cumsum(src == i)
        ideal = np.arange(1, 29) * c / 28
        assert np.abs(seen - ideal).max() <= 1.0


def test_plan_cuts_tasks_and_group_by_source_never_mixes():
    mix = Mixture.from_rates(["a", "b", "c"], "1.0,2.5,0.2", samples_per_task=6)
    plan = plan_mixture(mix, [10, 6, 14])
    assert plan.requested == [10, 15, 3]
    assert [len(t[0]) for t in plan.tasks] == [6, 6, 6, 6, 4]
    assert any(len(set(t[0].tolist())) > 1 for t in plan.tasks)
    grouped = plan_mixture(Mixture.from_rates(["a", "b", "c"], "1.0,2.5,0.2", samples_per_task=6, group_by="source"),
                           [10, 6, 14])
    assert [(set(t[0].tolist()), len(t[0])) for t in grouped.tasks] == [({0}, 6), ({0}, 4), ({1}, 6), ({1}, 6),
                                                                       ({1}, 3), ({2}, 3)]


# ---------------------------------------------------------------------------------------------
# the corpus: three tokenized sources cut from the demo corpus


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("mix")
    lines = (SAMPLE / "data.jsonl").read_text().splitlines(keepends=True)
    start = 0
    for name, n in SIZES.items():
        (base / f"{name}.jsonl").write_text("".join(lines[start:start + n]))
        start += n
        tokenize_dataset([base / f"{name}.jsonl"], base / f"tok_{name}",
                         TokenizeConfig(media_root=str(SAMPLE), rows_per_shard=4))
    return base


def packed_rows(d: Path) -> dict:
    """Per packed sample, in output order: id, source, tokens, vision units, loss tokens."""
    manifest = json.loads((d / ".packtool" / "manifest.json").read_text())
    ids, srcs, tokens, units, loss = [], [], [], [], []
    for entry in manifest["shards"]:
        t = read_expanded(d / entry["file"])
        for row in t.select(["sample_ids", "sample_sources", "cu_seqlens", "target_ids", "media"]).to_pylist():
            ids += row["sample_ids"]
            srcs += row["sample_sources"]
            cu = row["cu_seqlens"]
            per_units = Counter()
            for m in row["media"]:
                per_units[m["sample_index"]] += m["vision_units"]
            for k in range(len(row["sample_ids"])):
                tokens.append(cu[k + 1] - cu[k])
                units.append(per_units[k])
                loss.append(sum(x != -100 for x in row["target_ids"][cu[k]:cu[k + 1]]))
    return {"ids": ids, "sources": np.array(srcs), "tokens": np.array(tokens), "units": np.array(units),
            "loss": np.array(loss), "manifest": manifest}


def tok_ids(sources: Path, name: str) -> list[str]:
    manifest = json.loads((sources / f"tok_{name}" / ".packtool" / "manifest.json").read_text())
    return [i for e in manifest["shards"] for i in pq.read_table(sources / f"tok_{name}" / e["file"],
                                                                    columns=["sample_id"])["sample_id"].to_pylist()]


def pack_cli(sources: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    r = run("pack", *(str(sources / f"tok_{n}") for n in SIZES), "-o", str(out), "--max-tokens", "8192", "--quiet",
            *extra)
    assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def mixed(sources, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("packed") / "mixed"
    pack_cli(sources, out, "--rates", "1.0,2.5,0.2", "--samples-per-task", "6", "--workers", "1")
    return out


@pytest.mark.jit
def test_three_sources_at_rates_give_exact_counts_unique_ids_and_the_same_bytes_at_any_workers(sources, mixed, tmp_path):
    got = packed_rows(mixed)
    # the rule: floor(1.0*10 + 1/2) = 10, floor(2.5*6 + 1/2) = 15, floor(0.2*14 + 1/2) = 3; nothing is oversize
    assert Counter(got["sources"].tolist()) == {0: 10, 1: 15, 2: 3}
    assert len(got["ids"]) == len(set(got["ids"])) == 28
    a, b, c = (tok_ids(sources, n) for n in SIZES)
    by_source = {s: sorted(i for i, x in zip(got["ids"], got["sources"].tolist(), strict=True) if x == s) for s in range(3)}
    assert by_source[0] == sorted(a)
    # two full copies (x, x#c1) and the seeded half as x#c2, every derived id starting with its original
    half = [b[r] + "#c2" for r in naive_subset(6, 3, seed=0, position=1)]
    assert by_source[1] == sorted(b + [x + "#c1" for x in b] + half)
    assert by_source[2] == sorted(c[r] for r in naive_subset(14, 3, seed=0, position=2))
    # packs mix sources by default
    assert (got["manifest"]["counts"]["tasks"], got["manifest"]["counts"]["samples_packed"]) == (5, 28)
    assert pq.read_schema(mixed / got["manifest"]["shards"][0]["file"]).remove_metadata().equals(
        PACKED_MIXTURE.remove_metadata())
    # the same mixture and seed with two workers: the same bytes
    pack_cli(sources, tmp_path / "w2", "--rates", "1.0,2.5,0.2", "--samples-per-task", "6", "--workers", "2")
    for entry in got["manifest"]["shards"]:
        assert (tmp_path / "w2" / entry["file"]).read_bytes() == (mixed / entry["file"]).read_bytes()
    assert json.loads((tmp_path / "w2" / ".packtool" / "manifest.json").read_text()) == got["manifest"]
    # another seed picks other halves, same counts
    pack_cli(sources, tmp_path / "s1", "--rates", "1.0,2.5,0.2", "--samples-per-task", "6", "--seed", "1")
    other = packed_rows(tmp_path / "s1")
    assert Counter(other["sources"].tolist()) == {0: 10, 1: 15, 2: 3}
    assert sorted(i for i in other["ids"] if i.endswith("#c2")) == sorted(
        b[r] + "#c2" for r in naive_subset(6, 3, seed=1, position=1))
    assert other["manifest"]["mixture"]["seed"] == 1


@pytest.mark.jit
def test_stats_shows_requested_and_realised_share_per_source_from_the_rows(sources, mixed):
    got = packed_rows(mixed)
    r = run("stats", str(mixed), "--json")
    assert r.returncode == 0, r.stderr
    mix = json.loads(r.stdout)["mixture"]
    assert (mix["seed"], mix["group_by"], mix["warnings"]) == (0, "none", [])
    rows = {k: np.bincount(got["sources"], weights=got[k], minlength=3).astype(int) for k in ("tokens", "units", "loss")}
    totals = {k: int(v.sum()) for k, v in rows.items()}
    for i, (s, rate) in enumerate(zip(mix["sources"], ("1", "2.5", "0.2"), strict=True)):
        assert (s["rate"], s["target_samples"], s["available"]) == (rate, None, list(SIZES.values())[i])
        want = {"samples": [10, 15, 3][i], "tokens": int(rows["tokens"][i]), "vision_units": int(rows["units"][i]),
                "loss_tokens": int(rows["loss"][i])}
        assert s["realised"] == want
        assert s["realised_share"] == {"samples": round(want["samples"] / 28, 4),
                                       "tokens": round(want["tokens"] / totals["tokens"], 4),
                                       "vision_units": round(want["vision_units"] / totals["units"], 4),
                                       "loss_tokens": round(want["loss_tokens"] / totals["loss"], 4)}
        # nothing was dropped: what was requested is what was packed
        assert s["requested"] == {k: want[k] for k in ("samples", "tokens", "vision_units")}
        assert s["requested_share"] == {k: s["realised_share"][k] for k in ("samples", "tokens", "vision_units")}
    assert got["loss"].min() > 0
    from test_stats import validate

    validate(json.loads(r.stdout))
    text = run("stats", str(mixed)).stdout
    assert "mixture: 3 sources, seed 0, group by none (requested -> realised)" in text
    r = run("stats", str(sources / "tok_a"), str(mixed))
    assert (r.returncode, r.stderr) == (1, f"Error: {str(mixed)!r} is a mixture of 3 tokenized directories; run "
                                           f"`packtool stats {mixed}` for its per-source shares\n")
    line = next(x for x in text.splitlines() if "tok_b " in x)
    assert line.split()[1:5] == ["2.5", "15", "->", "15"]


@pytest.mark.jit
def test_validate_inspect_and_the_reader_know_the_source_column(sources, mixed):
    from packtool.reader import PackedDataset, collate
    from packtool.validate import validate_dir

    report = validate_dir(mixed)
    assert report["ok"], report["problems"]
    rows = list(PackedDataset(mixed, shuffle=False))
    got = packed_rows(mixed)
    assert [s for r in rows for s in r["sample_sources"]] == got["sources"].tolist()
    assert collate(rows[:2])["sample_sources"] == [rows[0]["sample_sources"], rows[1]["sample_sources"]]
    copy = next(i for i in got["ids"] if i.endswith("#c2"))
    r = run("inspect", str(mixed), "--sample", copy, "--json")
    assert r.returncode == 0, r.stderr
    view = json.loads(r.stdout)["samples"]
    assert [(v["sample_id"], v["mixture_source"]) for v in view] == [(copy, str(sources / "tok_b"))]
    assert f"{copy}  tokens" in run("inspect", str(mixed), "--sample", copy).stdout
    assert f"from {sources / 'tok_b'}" in run("inspect", str(mixed), "--sample", copy).stdout


@pytest.mark.jit
def test_group_by_source_keeps_every_pack_to_one_source(sources, tmp_path):
    pack_cli(sources, tmp_path / "g", "--rates", "1.0,2.5,0.2", "--group-by", "source")
    manifest = json.loads((tmp_path / "g" / ".packtool" / "manifest.json").read_text())
    per_pack = [set(r) for e in manifest["shards"]
                for r in pq.read_table(tmp_path / "g" / e["file"], columns=["sample_sources"])["sample_sources"].to_pylist()]
    assert all(len(s) == 1 for s in per_pack)
    assert {next(iter(s)) for s in per_pack} == {0, 1, 2}
    assert Counter(packed_rows(tmp_path / "g")["sources"].tolist()) == {0: 10, 1: 15, 2: 3}
    assert manifest["mixture"]["group_by"] == "source"


@pytest.mark.jit
def test_mixture_file_with_rates_and_targets_resolves_paths_against_itself(sources, tmp_path):
    spec = tmp_path / "specs" / "mix.json"
    spec.parent.mkdir()
    rel = lambda n: str(Path("..") / Path(*[".."] * len(tmp_path.parts)) / sources.relative_to("/") / f"tok_{n}")  # noqa: E731
    spec.write_text(json.dumps({"sources": [
        {"path": rel("a"), "rate": 0.5, "name": "alpha"},
        {"path": str(sources / "tok_c"), "samples": 20, "name": "gamma"},
    ]}))
    out = tmp_path / "out"
    r = run("pack", "--mixture", str(spec.relative_to(tmp_path)), "-o", "out", "--max-tokens", "8192", "--quiet",
            "--seed", "5", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    got = packed_rows(out)
    # 0.5 * 10 = 5 (seeded); a target of 20 from 14: every sample once, 6 seeded twice
    assert Counter(got["sources"].tolist()) == {0: 5, 1: 20}
    c = tok_ids(sources, "c")
    assert sorted(i for i, s in zip(got["ids"], got["sources"].tolist(), strict=True) if s == 1) == sorted(
        c + [c[r] + "#c1" for r in naive_subset(14, 6, seed=5, position=1)])
    s = json.loads(run("stats", str(out), "--json").stdout)["mixture"]
    assert [(x["source"], x["rate"], x["target_samples"]) for x in s["sources"]] == [("alpha", "0.5", None),
                                                                                     ("gamma", None, 20)]
    assert s["warnings"] == ["source 'gamma': target of 20 samples is more than its 14; met by up-sampling "
                             "(every sample 1 time, 6 of them once more)"]
    assert "warning: source 'gamma': target of 20 samples" in r.stdout


def test_mixture_file_keeps_bucket_urls_as_written(tmp_path):
    from packtool.mixture import load_mixture

    spec = tmp_path / "mix.json"
    spec.write_text(json.dumps({"sources": [{"path": "s3://data/tok", "rate": 1}, {"path": "tok_b", "samples": 5}]}))
    assert [s.path for s in load_mixture(spec).sources] == ["s3://data/tok", str(tmp_path / "tok_b")]


def test_mixture_file_with_a_byte_order_mark_is_read(tmp_path):
    """Windows editors start a UTF-8 file with a byte-order mark; the mixture file is the same JSON."""
    from packtool.mixture import load_mixture

    spec = tmp_path / "mix.json"
    spec.write_bytes(b"\xef\xbb\xbf" + json.dumps({"sources": [{"path": "tok_a", "rate": 1}]}).encode())
    assert [s.path for s in load_mixture(spec).sources] == [str(tmp_path / "tok_a")]



def test_a_whole_target_written_as_a_decimal_is_that_count(tmp_path):
    """``json.dump`` writes a computed target as ``20000.0``: it was refused as '"samples" 20000
    must be a whole number of at least 1'. A whole value is that count; 2.5 is still refused."""
    from packtool.mixture import load_mixture

    spec = tmp_path / "mix.json"
    spec.write_text('{"sources": [{"path": "a", "samples": 20000.0}, {"path": "b", "samples": 2e1}]}')
    got = [s.samples for s in load_mixture(spec).sources]
    assert got == [20000, 20] and all(type(n) is int for n in got)

@pytest.mark.jit
def test_stats_warns_when_oversize_drops_cut_a_sources_share(sources, tmp_path):
    r = run("pack", *(str(sources / f"tok_{n}") for n in SIZES), "-o", str(tmp_path / "p"), "--max-tokens", "2048",
            "--rates", "1.0,2.5,0.2", "--quiet", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    got = packed_rows(tmp_path / "p")
    realised = Counter(got["sources"].tolist())
    dropped = {i: [10, 15, 3][i] - realised[i] for i in range(3)}
    assert sum(dropped.values()) == out["dropped"] > 0
    errors = [json.loads(x) for x in (tmp_path / "p" / ".packtool" / "errors.jsonl").read_text().splitlines()]
    assert len(errors) == out["dropped"] and {e["reason"] for e in errors} == {"oversize"}
    s = json.loads(run("stats", str(tmp_path / "p"), "--json").stdout)["mixture"]
    warned = [w for w in s["warnings"] if "rejected at pack time" in w]
    assert len(warned) == sum(1 for v in dropped.values() if v)
    for i, name in enumerate(SIZES):
        if dropped[i]:
            assert any(w.startswith(f"source '{sources / f'tok_{name}'}': {realised[i]} of {[10, 15, 3][i]} requested")
                       for w in warned)
    assert out["mixture"]["warnings"] == s["warnings"]


def test_a_single_input_without_rates_packs_exactly_as_before(demo_dirs, tmp_path):
    tok = demo_dirs["tokenized"]
    pack_dataset([tok], tmp_path / "list", PackConfig(max_tokens=8192))
    r = run("pack", str(tok), "-o", str(tmp_path / "cli"), "--max-tokens", "8192", "--quiet")
    assert r.returncode == 0, r.stderr
    ref = json.loads((demo_dirs["packed"] / ".packtool" / "manifest.json").read_text())
    assert "mixture" not in ref and "source_samples" not in ref["counts"]
    for out in (tmp_path / "list", tmp_path / "cli"):
        m = json.loads((out / ".packtool" / "manifest.json").read_text())
        assert m["config"] == ref["config"] and m["config_digest"] == ref["config_digest"]
        for a, b in zip(ref["shards"], m["shards"], strict=True):
            assert (out / b["file"]).read_bytes() == (demo_dirs["packed"] / a["file"]).read_bytes()
            assert pq.read_schema(out / b["file"]).remove_metadata().equals(PACKED.remove_metadata())


@pytest.mark.jit
def test_ranks_then_merge_give_the_same_bytes_and_a_resume_keeps_the_mixture(sources, mixed, tmp_path):
    out = tmp_path / "ranks"
    args = ["--rates", "1.0,2.5,0.2", "--samples-per-task", "6", "--world-size", "2"]
    assert "rank 0 of 2: 3 tasks done" in pack_cli(sources, out, *args, "--rank", "0").stdout
    pack_cli(sources, out, *args, "--rank", "1")
    a = json.loads((mixed / ".packtool" / "manifest.json").read_text())
    b = json.loads((out / ".packtool" / "manifest.json").read_text())
    assert [s["sha256"] for s in a["shards"]] == [s["sha256"] for s in b["shards"]]
    assert a["mixture"] == b["mixture"]
    # the same command again is a no-op; other rates into the same directory are refused
    assert pack_cli(sources, out, *args, "--rank", "1").returncode == 0
    r = run("pack", *(str(sources / f"tok_{n}") for n in SIZES), "-o", str(out), "--rates", "1,1,1", "--quiet")
    assert r.returncode == 1
    assert "already holds a finished run with a different configuration" in r.stderr and "mixture" in r.stderr
    # a source tokenized again from changed text (same file, rows and settings): the finished run is not reused
    text = (sources / "b.jsonl").read_text()
    (tmp_path / "b.jsonl").write_text(text)
    changed = tmp_path / "tok_b"
    cfg = TokenizeConfig(media_root=str(SAMPLE))
    tokenize_dataset([tmp_path / "b.jsonl"], changed, cfg)
    again = ["pack", str(sources / "tok_a"), str(changed), "-o", str(tmp_path / "again"), "--rates", "1,2", "--quiet"]
    assert run(*again).returncode == 0
    (tmp_path / "b.jsonl").write_text(text.replace("canvas", "sheet"))
    tokenize_dataset([tmp_path / "b.jsonl"], changed, cfg, overwrite=True)
    r = run(*again)
    assert r.returncode == 1
    assert "holds a finished run of these settings, but input files changed since" in r.stderr
    # named from the output directory, as the run records its sources
    assert f": {os.path.relpath(changed, tmp_path / 'again')}/part-00000-00000.parquet;" in r.stderr


@pytest.mark.jit
def test_a_resume_with_another_seed_rates_or_source_order_is_refused_naming_what_differs(sources, mixed, tmp_path):
    """The refusal printed both whole mixtures (every source's path, rate, digest and counts,
    twice) instead of the setting that differs."""
    out = tmp_path / "mixed"
    shutil.copytree(mixed, out)
    (out / ".packtool" / "manifest.json").unlink()  # killed after task 0, before the manifest
    for marker in sorted((out / ".packtool").glob("task-*.json"))[1:]:
        marker.unlink()
    a, b, c = (str(sources / f"tok_{n}") for n in SIZES)
    ra, rb = (os.path.relpath(x, out) for x in (a, b))  # the run names its sources from its output
    for args, named in [((a, b, c, "--rates", "1.0,2.5,0.2", "--seed", "1"), "mixture.seed: 0 -> 1"),
                        ((a, b, c, "--rates", "1.0,2.5,0.3"), "mixture.sources[2].rate: '0.2' -> '0.3'; "
                                                              "mixture.sources[2].requested: 3 -> 4"),
                        ((b, a, c, "--rates", "2.5,1.0,0.2"), f"mixture.sources[0].path: {ra!r} -> {rb!r}; "
                                                              f"mixture.sources[1].path: {rb!r} -> {ra!r}")]:
        r = run("pack", *args, "-o", str(out), "--max-tokens", "8192", "--samples-per-task", "6", "--quiet")
        assert r.returncode == 1, r.stderr
        assert f"holds an unfinished run with other settings ({named}); resume it with the same command" in r.stderr
    pack_cli(sources, out, "--rates", "1.0,2.5,0.2", "--samples-per-task", "6")
    assert (out / ".packtool" / "manifest.json").read_bytes() == (mixed / ".packtool" / "manifest.json").read_bytes()


@pytest.mark.jit
def test_a_resume_finds_the_same_sources_however_their_paths_are_written(sources, mixed, tmp_path):
    """A mixture killed after its first task and resumed with the same directories written
    another way (absolute instead of relative, from another working directory) was refused as
    "an unfinished run with other settings" whose "input files changed", offering only
    --overwrite, which throws the finished tasks away; a finished run was refused the same way."""
    out = tmp_path / "mixed"
    shutil.copytree(mixed, out)
    (out / ".packtool" / "manifest.json").unlink()  # killed after task 0, before the manifest
    for marker in sorted((out / ".packtool").glob("task-*.json"))[1:]:
        marker.unlink()
    kept = (out / ".packtool" / "task-00000.json").read_bytes()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    rel = [os.path.relpath(sources / f"tok_{n}", elsewhere) for n in SIZES]
    r = run("pack", *rel, "-o", os.path.relpath(out, elsewhere), "--rates", "1.0,2.5,0.2", "--max-tokens", "8192",
            "--samples-per-task", "6", "--quiet", cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    assert (out / ".packtool" / "task-00000.json").read_bytes() == kept  # task 0 was not packed again
    got, want = (json.loads((d / ".packtool" / "manifest.json").read_text()) for d in (out, mixed))
    assert [s["sha256"] for s in got["shards"]] == [s["sha256"] for s in want["shards"]]
    assert got["config_digest"] == want["config_digest"]
    assert [s["realised"] for s in got["mixture"]["sources"]] == [s["realised"] for s in want["mixture"]["sources"]]
    # the finished run, asked for again with the paths written as the first command wrote them
    r = pack_cli(sources, out, "--rates", "1.0,2.5,0.2", "--samples-per-task", "6")
    assert r.returncode == 0 and (out / ".packtool" / "task-00000.json").read_bytes() == kept


@pytest.mark.jit
def test_tasks_run_from_another_directory_open_relative_paths_against_the_drivers(sources, mixed, tmp_path,
                                                                                 monkeypatch):
    """A Ray worker on another node runs in its own directory: a mixture task given relative
    source and output paths must open them against the driver's working directory."""
    import packtool.pipeline as pipeline

    elsewhere = tmp_path / "worker-cwd"
    elsewhere.mkdir()
    real = pipeline._mix_task
    ran = []

    def on_another_node(task, report):
        here = Path.cwd()
        monkeypatch.chdir(elsewhere)  # as a worker whose directory is its node's
        try:
            ran.append(task.index)
            return real(task, report)
        finally:
            monkeypatch.chdir(here)

    monkeypatch.setattr(pipeline, "_mix_task", on_another_node)
    monkeypatch.chdir(tmp_path)
    rel = [os.path.relpath(sources / f"tok_{n}", tmp_path) for n in SIZES]
    mix = Mixture.from_rates(rel, "1.0,2.5,0.2", samples_per_task=6)
    pack_dataset(mix, "rel-out", PackConfig(max_tokens=8192), workers=1)
    assert ran == [0, 1, 2, 3, 4]
    assert not list(elsewhere.iterdir())  # nothing written where the worker ran
    want = json.loads((mixed / ".packtool" / "manifest.json").read_text())
    got = json.loads((tmp_path / "rel-out" / ".packtool" / "manifest.json").read_text())
    assert [s["sha256"] for s in got["shards"]] == [s["sha256"] for s in want["shards"]]


# ---------------------------------------------------------------------------------------------
# errors a user can cause: exit 1, "Error: ..." naming the fix, nothing written


@pytest.mark.parametrize(("rates", "message"), [
    ("1.0,2.5", "--rates '1.0,2.5' gives 2 rates for 3 inputs; give one rate per input, in order (e.g. --rates "
                "1.0,1.0,1.0)"),
    ("1.0,-2,0.2", "--rates, input 2: rate '-2' must be above 0; leave the source out instead of giving it rate 0"),
    ("1.0,0,0.2", "--rates, input 2: rate '0' must be above 0; leave the source out instead of giving it rate 0"),
    ("1.0,lots,0.2", "--rates, input 2: rate 'lots' is not a number; give a positive number such as 0.5 or 2.5"),
    ("1.0,nan,0.2", "--rates, input 2: rate 'nan' is not a number; give a positive number such as 0.5 or 2.5"),
    ("1.0,inf,0.2", "--rates, input 2: rate 'inf' is not a number; give a positive number such as 0.5 or 2.5"),
    ("1e400,1,1", "--rates, input 1: rate '1e400' is not a finite number; give a positive number such as 0.5 or 2.5"),
    ("1,1,1,", "--rates '1,1,1,' gives 4 rates for 3 inputs; give one rate per input, in order (e.g. --rates "
               "1.0,1.0,1.0)"),
])
def test_bad_rates_are_refused(sources, tmp_path, rates, message):
    r = run("pack", *(str(sources / f"tok_{n}") for n in SIZES), "-o", str(tmp_path / "x"), "--rates", rates)
    assert (r.returncode, r.stdout, r.stderr) == (1, "", f"Error: {message}\n")
    assert not (tmp_path / "x").exists()


def test_rates_and_mixture_together_and_a_missing_source_are_refused(sources, tmp_path):
    spec = tmp_path / "mix.json"
    spec.write_text(json.dumps({"sources": [{"path": "nowhere", "rate": 1}]}))
    r = run("pack", str(sources / "tok_a"), "--mixture", str(spec), "--rates", "1", "-o", str(tmp_path / "x"))
    assert (r.returncode, r.stdout) == (2, "") and r.stderr.startswith("Usage: packtool pack ")
    assert r.stderr.endswith("\n\nError: --mixture names the sources and their rates itself; drop the TOKENIZED inputs "
                             "and --rates, or drop --mixture\n"), r.stderr
    r = run("pack", "--mixture", str(spec), "-o", str(tmp_path / "x"))
    assert (r.returncode, r.stderr) == (1, f"Error: mixture source {str(tmp_path / 'nowhere')!r} is not a directory; "
                                           "give the output directory of packtool tokenize (mixture-file paths are "
                                           "relative to the file)\n")
    assert not (tmp_path / "x").exists()


def test_the_same_source_twice_is_refused_and_a_rate_says_it(sources, tmp_path):
    """``pack A A`` packed every sample of A twice under one id, in a mixture table of two rows
    that read alike; the same directory however written (a trailing slash, ``./``, a link) is
    refused, naming both positions and the rate that takes it twice."""
    a = sources / "tok_a"
    os.symlink(a, tmp_path / "link")
    spec = tmp_path / "mix.json"
    spec.write_text(json.dumps({"sources": [{"path": str(a), "rate": 1}, {"path": str(sources / "tok_b"), "rate": 1},
                                            {"path": os.path.relpath(a, tmp_path), "samples": 3}]}))
    for args, first, second in (([str(a), str(a)], 1, 2), ([str(a), f"{a}/"], 1, 2),
                                ([str(sources / "tok_b"), str(a), str(sources / "." / "tok_a")], 2, 3),
                                ([str(a), str(tmp_path / "link")], 1, 2), (["--mixture", str(spec)], 1, 3)):
        r = run("pack", *args, "-o", str(tmp_path / "x"))
        assert (r.returncode, r.stdout) == (1, ""), r.stderr
        assert r.stderr.startswith(f"Error: mixture sources {first} and {second} are the same tokenized directory ")
        assert r.stderr.endswith("; give it once, at the sum of their rates or samples (a rate of 2 takes every "
                                 "sample twice)\n"), r.stderr
        assert not (tmp_path / "x").exists()
    with pytest.raises(ConfigError, match="mixture sources 1 and 2 are the same"):
        Mixture.from_rates(["s3://bucket/tok", "s3://bucket/tok/"])
    r = run("pack", str(a), "--rates", "2", "-o", str(tmp_path / "twice"), "--max-tokens", "8192", "--quiet")
    assert r.returncode == 0, r.stderr
    ids = packed_rows(tmp_path / "twice")["ids"]
    assert len(ids) == 20 and len(set(ids)) == 20 and Counter(i.split("#c")[0] for i in ids) == Counter(
        tok_ids(sources, "a") * 2)


@pytest.mark.parametrize(("body", "message"), [
    ("{not json", "is not valid JSON"),
    ("[]", 'must hold one object with a non-empty "sources" list'),
    ('{"sources": [{"rate": 1}]}', 'source 1: give an object with a "path"'),
    ('{"sources": [{"path": "a", "rate": 1, "samples": 3}]}', "source 1 ('a'): give exactly one of \"rate\""),
    ('{"sources": [{"path": "a"}]}', "source 1 ('a'): give exactly one of \"rate\""),
    ('{"sources": [{"path": "a", "weight": 1, "rate": 1}]}', "source 1: unknown key 'weight'; a source takes name, "
                                                             "path, rate, samples"),
    ('{"sources": [{"path": "a", "samples": 2.5}]}', "source 1 ('a'): \"samples\" 2.5 must be a whole number"),
    ('{"sources": [{"path": "a", "rate": true}]}', "source 1: rate True is not a number"),
    ('{"sources": [{"path": "a", "rate": 1e400}]}', "source 1: rate 1.00e+400 is not a finite number"),
    ('{"sources": [], "seed": 3}', "unknown top-level key 'seed'; the file holds \"sources\" only (give --seed and "
                                   "--group-by on the command line)"),
    ('{"sources": []}', 'must hold one object with a non-empty "sources" list'),
], ids=["json", "shape", "path", "both", "neither", "unknown", "samples", "rate", "huge-rate", "top", "empty"])
def test_malformed_mixture_files_are_refused(tmp_path, body, message):
    spec = tmp_path / "mix.json"
    spec.write_text(body)
    r = run("pack", "--mixture", str(spec), "-o", str(tmp_path / "x"))
    assert r.returncode == 1 and r.stderr.startswith(f"Error: --mixture {str(spec)!r}")
    assert message in r.stderr
    assert not (tmp_path / "x").exists()


def test_sources_tokenized_differently_are_refused_naming_both(sources, tmp_path):
    other = tmp_path / "tok_fixed"
    tokenize_dataset([sources / "a.jsonl"], other, TokenizeConfig(media_root=str(SAMPLE), model="fixed:64"))
    r = run("pack", str(sources / "tok_a"), str(other), "-o", str(tmp_path / "x"))
    assert r.returncode == 1
    assert r.stderr.startswith(f"Error: mixture sources {str(sources / 'tok_a')!r} and {str(other)!r} were tokenized "
                               "with a different model / vision settings (")
    assert "name: 'qwen2.5-vl' vs 'fixed:64'" in r.stderr
    assert r.stderr.endswith(f"re-tokenize {str(other)!r} with the settings of {str(sources / 'tok_a')!r} (or pack "
                             "them separately)\n")
    templ = tmp_path / "tok_templ"
    # the same vocabulary as tok_a (qwen3-vl's own default adds Qwen3's tokens, which is refused first)
    tokenize_dataset([sources / "a.jsonl"], templ, TokenizeConfig(media_root=str(SAMPLE), template="qwen3-vl",
                                                                tokenizer="qwen2"))
    with pytest.raises(ConfigError, match=r"different chat template \(name: 'chatml' vs 'qwen3-vl'; default_system"):
        pack_dataset([sources / "tok_a", templ], tmp_path / "y", PackConfig())


def test_a_stream_larger_than_memory_is_refused_before_anything_is_written(sources, tmp_path, monkeypatch):
    # 10 samples at rate 1e9 plus 6 + 14: 10,000,000,020 entries of 40 bytes, 372.5 GiB
    monkeypatch.setattr("packtool.mixture._memory_bytes", lambda: 16 * 2**30)
    want = ("Error: the mixture asks for 10,000,000,020 samples, the most from source 1 ("
            f"{str(sources / 'tok_a')!r}: 10 samples at rate 1000000000 give 10,000,000,000); listing them takes 40 "
            "bytes a sample, 372.5 GiB, more than this machine's 16.0 GiB of memory: lower the rates or targets\n")
    for extra in (["-o", str(tmp_path / "x")], ["--dry-run"]):
        r = run("pack", *(str(sources / f"tok_{n}") for n in SIZES), "--rates", "1e9,1,1", *extra)
        assert (r.returncode, r.stdout, r.stderr) == (1, "", want)
    assert not (tmp_path / "x").exists()


@pytest.mark.jit
def test_a_source_whose_rate_rounds_to_no_sample_is_named_with_the_rate_that_gives_one(sources, tmp_path):
    """6 samples at rate 0.05 give floor(0.3 + 1/2) = 0: the source was packed as nothing, with
    no word but a 0 in the table."""
    r = pack_cli(sources, tmp_path / "p", "--rates", "1,0.05,1")
    assert r.stdout.splitlines()[-1] == (
        f"warning: source {str(sources / 'tok_b')!r}: rate 0.05 of its 6 samples rounds to 0 samples, so it "
        "contributes nothing; give it a rate of at least 1/12 (0.0834), or leave it out")
    assert r.stdout.startswith("24 samples in ")
    # the rate the warning names does give one sample
    assert requested_count(6, rate=Fraction("1/12")) == requested_count(6, rate=Fraction("0.0834")) == 1


def test_a_mixture_that_selects_no_sample_is_refused_before_anything_is_written(sources, tmp_path):
    """Every rate rounding to 0 samples wrote a run of no packs and exited 0."""
    a, b, c = (str(sources / f"tok_{n}") for n in SIZES)
    want = (f"Error: the mixture selects no sample, every rate rounds to 0 samples (source 1 ({a!r}): 10 samples at "
            f"rate 0.01 give 0, a rate of at least 0.05 gives one; source 2 ({b!r}): 6 samples at rate 0.05 give 0, a "
            f"rate of at least 1/12 (0.0834) gives one; source 3 ({c!r}): 14 samples at rate 0.01 give 0, a rate of "
            "at least 1/28 (0.0358) gives one); raise the rates or give \"samples\" targets\n")
    for extra in (["-o", str(tmp_path / "x")], ["--dry-run"]):
        r = run("pack", a, b, c, "--rates", "0.01,0.05,0.01", *extra)
        assert (r.returncode, r.stdout, r.stderr) == (1, "", want)
    assert not (tmp_path / "x").exists()
    with pytest.raises(ConfigError, match="the mixture selects no sample"):
        plan_mixture(Mixture.from_rates(["a", "b"], "0.1,0.1"), [4, 0])
    assert plan_mixture(Mixture.from_rates(["a", "b"], "0.1,0.1"), [0, 0]).requested == [0, 0]  # empty sources: as before


def test_the_schedule_limit_is_what_the_plan_allocates(monkeypatch):
    # 1:1000 of 1,000 samples each: 1,001,000 entries of 40 bytes
    mix = Mixture.from_rates(["a", "b"], "1000,1")
    monkeypatch.setattr("packtool.mixture._memory_bytes", lambda: 40 * 1_001_000)
    assert plan_mixture(mix, [1000, 1000]).requested == [1_000_000, 1000]
    monkeypatch.setattr("packtool.mixture._memory_bytes", lambda: 40 * 1_001_000 - 1)
    with pytest.raises(ConfigError, match=r"^the mixture asks for 1,001,000 samples, the most from source 1 \('a': "
                                          r"1,000 samples at rate 1000 give 1,000,000\); listing them takes 40 bytes"):
        plan_mixture(mix, [1000, 1000])
    monkeypatch.setattr("packtool.mixture._memory_bytes", lambda: None)  # a platform that does not tell
    assert plan_mixture(mix, [1000, 1000]).requested == [1_000_000, 1000]


def test_copy_numbers_beyond_int32_are_refused_whatever_the_memory():
    from packtool.mixture import MixtureSource

    with pytest.raises(ConfigError) as err:
        plan_mixture(Mixture.from_rates(["a", "b"], "1,3000000000"), [1, 1])
    assert str(err.value) == ("mixture source 2 ('b': 1 sample at rate 3000000000 give 3,000,000,000) copies each "
                              "sample 3,000,000,000 times; copy numbers are int32, at most 2,147,483,647: lower its "
                              "rate or target")
    with pytest.raises(ConfigError, match=r"^mixture source 1 \('a': a target of 1.00e\+20 samples from its 3\) "
                                          r"copies each sample 3.33e\+19 times"):
        plan_mixture(Mixture((MixtureSource("a", samples=10**20),)), [3])


def test_mixture_config_errors_from_the_library():
    with pytest.raises(ConfigError, match="--group-by 'media': choose none or source"):
        Mixture.from_rates(["a"], None, group_by="media")
    with pytest.raises(ConfigError, match="give either a rate or a samples count"):
        from packtool.mixture import MixtureSource
        MixtureSource("a")


@pytest.mark.jit
def test_a_dry_run_plans_the_same_mixture_and_writes_nothing(sources, mixed, tmp_path):
    mix = Mixture.from_rates([str(sources / f"tok_{n}") for n in SIZES], "1.0,2.5,0.2", samples_per_task=6)
    plan = pack_dataset(mix, tmp_path / "dry", PackConfig(max_tokens=8192), dry_run=True, workers=1)
    real = json.loads((mixed / ".packtool" / "manifest.json").read_text())
    assert not (tmp_path / "dry").exists()
    assert plan["counts"] == real["counts"]
    for a, b in zip(plan["mixture"]["sources"], real["mixture"]["sources"], strict=True):
        assert "loss_tokens" not in a["realised"]
        assert a["realised"] == {k: v for k, v in b["realised"].items() if k != "loss_tokens"}
    r = run("pack", *(str(sources / f"tok_{n}") for n in SIZES), "--rates", "1.0,2.5,0.2", "--dry-run",
            "--max-tokens", "8192")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("28 samples in ")
    assert "loss share" in r.stdout and r.stdout.splitlines()[-1].endswith("-")


@pytest.mark.jit
def test_sources_with_their_own_media_roots_embed_their_own_files(sources, tmp_path):
    import shutil

    from PIL import Image

    # the second source's media live under another root, where every image is a different picture
    other = tmp_path / "root"
    shutil.copytree(SAMPLE, other)
    for f in (other / "images").iterdir():
        if f.suffix in (".png", ".jpg"):
            with Image.open(f) as im:
                im = im.convert("RGB")
            im.putpixel((0, 0), (1, 2, 3))
            im.save(f)
            assert f.read_bytes() != (SAMPLE / "images" / f.name).read_bytes()
    tokenize_dataset([sources / "b.jsonl"], tmp_path / "tok_b2", TokenizeConfig(media_root=str(other)))
    roots = [SAMPLE, other]
    out = tmp_path / "p"
    pack_dataset([sources / "tok_a", tmp_path / "tok_b2"], out, PackConfig(max_tokens=8192))
    manifest = json.loads((out / ".packtool" / "manifest.json").read_text())
    seen = Counter()
    for entry in manifest["shards"]:
        for row in pq.read_table(out / entry["file"], columns=["sample_sources", "media"]).to_pylist():
            for m in row["media"]:
                if m["kind"] == "image":
                    src = row["sample_sources"][m["sample_index"]]
                    assert m["data"] == (roots[src] / m["path"]).read_bytes()
                    seen[src] += 1
    assert seen[0] > 0 and seen[1] > 0


def test_warnings_name_every_source_whose_request_was_not_met():
    from packtool.stats import mixture_summary, render_mixture

    def source(path, available, requested, got, **kw):
        selected = requested if available else 0
        counts = {"samples": selected, "tokens": 10 * selected, "vision_units": 0}
        return {"path": path, **kw, "available": available, "requested": requested, "selected": counts,
                "realised": {"samples": got, "tokens": 10 * got, "vision_units": 0, "loss_tokens": got,
                             "rejected": counts["samples"] - got}}

    m = mixture_summary({"seed": 3, "group_by": "source", "sources": [
        source("full", 4, 4, 4, rate="1"),
        source("empty", 0, 0, 0, rate="2"),
        source("short", 0, 50, 0, samples=50, name="wanted"),
        source("big", 3, 7, 6, samples=7),
    ]})
    assert m["warnings"] == [
        "source 'empty' holds no samples; it contributes nothing",
        "source 'wanted' holds no samples; it contributes nothing (target 50)",
        "source 'big': target of 7 samples is more than its 3; met by up-sampling (every sample 2 times, 1 of them "
        "once more)",
        "source 'big': 6 of 7 requested samples packed (1 rejected at pack time; see .packtool/errors.jsonl); its "
        "share of samples is 60.0%, requested 63.6%",
    ]
    assert [r["realised_share"]["samples"] for r in m["sources"]] == [0.4, 0.0, 0.0, 0.6]
    text = render_mixture(m)
    assert text.splitlines()[0] == "mixture: 4 sources, seed 3, group by source (requested -> realised)"
    line = next(x for x in text.splitlines() if x.startswith("wanted"))
    assert line.split() == ["wanted", "50", "samples", "0", "->", "0", "0.0%", "->", "0.0%", "0.0%", "->", "0.0%",
                            "0.0%", "->", "0.0%", "0.0%"]


def test_copies_of_split_trees_keep_ids_unique_within_their_source(tmp_path):
    """tokenize names the trees it splits off ``x`` ``x#1``, ``x#2``; a copy suffix of ``#1``
    made copy 1 of ``x`` and copy 0 of the tree ``x#1`` the same id in one source."""
    record = {"id": "t", "image": "images/img00.png",
              "message_list": [{"question": f"Q{i}?", "answer": f"A{i}."} for i in range(3)]}
    (tmp_path / "trees.jsonl").write_text(json.dumps(record) + "\n")
    tok = tmp_path / "tok"
    tokenize_dataset([tmp_path / "trees.jsonl"], tok, TokenizeConfig(media_root=str(SAMPLE), max_branches=1))
    out = tmp_path / "packed"
    pack_dataset(Mixture.from_rates([str(tok)], "2"), out, PackConfig(max_tokens=8192))
    ids = packed_rows(out)["ids"]
    assert sorted(ids) == ["t", "t#1", "t#1#c1", "t#2", "t#2#c1", "t#c1"]


@pytest.mark.jit
def test_a_copy_named_like_a_record_of_its_source_takes_the_next_free_name(tmp_path):
    """A source holding ``x`` and a record whose own id is ``x#c1``: copy 1 of ``x`` was named
    ``x#c1`` too. The record keeps its id and the copy takes the first free ``#dK`` (``x#c1#d1``
    is a record's id here too), in the packs and in errors.jsonl, the same at any worker count."""
    def rec(sid: str, answer: str = "Fine.") -> dict:
        return {"id": sid, "conversations": [{"from": "human", "value": f"About {sid}?"}, {"from": "gpt", "value": answer}]}

    records = [rec("x"), rec("x#c1"), rec("x#c1#d1"), rec("y"), rec("z", "long " * 80), rec("z#c2")]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenize_dataset([tmp_path / "a.jsonl"], tmp_path / "tok", TokenizeConfig())
    runs = []
    for workers in (1, 2):
        out = tmp_path / f"packed{workers}"
        pack_dataset(Mixture.from_rates([str(tmp_path / "tok")], "3", samples_per_task=5), out,
                     PackConfig(max_tokens=64), workers=workers)
        errors = [json.loads(line) for line in (out / ".packtool" / "errors.jsonl").read_text().splitlines()]
        runs.append((packed_rows(out)["ids"], [(e["sample_id"], e["reason"]) for e in errors]))
    assert runs[0] == runs[1]
    ids, dropped = runs[0]
    assert sorted(dropped) == [("z", "oversize"), ("z#c1", "oversize"), ("z#c2#d1", "oversize")]
    assert sorted(ids) == ["x", "x#c1", "x#c1#c1", "x#c1#c2", "x#c1#d1", "x#c1#d1#c1", "x#c1#d1#c2", "x#c1#d2",
                           "x#c2", "y", "y#c1", "y#c2", "z#c2", "z#c2#c1", "z#c2#c2"]
    names = ids + [sid for sid, _ in dropped]
    assert len(names) == len(set(names)) == 3 * len(records)


def test_from_rates_takes_what_python_holds_as_the_flags_would():
    flags = Mixture.from_rates(["a", "b", "c"], "1.0,0.1,2.5", seed=3, samples_per_task=6)
    for paths, rates in [(["a", "b", "c"], [1.0, 0.1, 2.5]), ((p for p in "abc"), np.array([1.0, 0.1, 2.5])),
                         ([Path("a"), Path("b"), Path("c")], [1, Fraction(1, 10), "2.5"]),
                         (["a", "b", "c"], [np.float32(1), np.float32(0.1), np.float64(2.5)])]:
        assert Mixture.from_rates(paths, rates, seed=np.int64(3), samples_per_task=np.int32(6)) == flags
    one = Mixture.from_rates("tok_a", 2.5)  # one path given alone is one source, not its characters
    assert [s.to_dict() for s in one.sources] == [{"path": "tok_a", "rate": "2.5"}]
    assert type(Mixture.from_rates(["a"], seed=np.uint64(7)).seed) is int
    for kw, message in [({"rates": [1.0]}, "--rates '1.0' gives 1 rate for 2 inputs"),
                        ({"rates": [1.0, True]}, "input 2: rate 'True' is not a number"),
                        ({"rates": [1.0, float("nan")]}, "input 2: rate 'nan' is not a number"),
                        ({"samples_per_task": 10.5}, "samples_per_task 10.5: give a non-negative integer"),
                        ({"seed": "0"}, "--seed '0': give a non-negative integer")]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            Mixture.from_rates(["a", "b"], **kw)


@pytest.mark.jit
def test_inspect_of_an_id_two_sources_share_lists_both_and_source_picks_one(tmp_path):
    """Two sources of a mixture both holding an id (the same corpus cut twice, or FILE:ROW ids of
    files of one name): inspect --sample showed the first source's sample and said nothing of the
    other. It lists every sample of the name with its source, and --source keeps one source's."""
    lines = (SAMPLE / "data.jsonl").read_text().splitlines(keepends=True)
    for name, part in (("a", lines[0:3]), ("b", lines[2:4])):  # both hold demo-002
        (tmp_path / f"{name}.jsonl").write_text("".join(part))
        tokenize_dataset([tmp_path / f"{name}.jsonl"], tmp_path / f"tok_{name}", TokenizeConfig(media_root=str(SAMPLE)))
    out = tmp_path / "mixed"
    r = run("pack", "tok_a", "tok_b", "--rates", "1,1", "--group-by", "source", "-o", "mixed", "--max-tokens", "8192",
            "-q", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = run("inspect", str(out), "--sample", "demo-002", "--json")
    assert r.returncode == 0, r.stderr
    view = json.loads(r.stdout)
    got = [(m["mixture_source"], m["index"], m["shown"]) for m in view["matches"]]
    assert [(s, shown) for s, _, shown in got] == [("tok_a", True), ("tok_b", False)]  # --group-by source: two packs
    assert [(v["sample_id"], v["mixture_source"]) for v in view["samples"]] == [("demo-002", "tok_a")]
    b_pack = view["matches"][1]["pack_index"]
    text = run("inspect", str(out), "--sample", "demo-002").stdout.splitlines()
    assert text[1] == (f"note: 2 samples are named 'demo-002': pack {view['pack_index']} [{got[0][1]}] from tok_a (shown), "
                       f"pack {b_pack} [{got[1][1]}] from tok_b; pick a source with --source NAME, or a pack with --pack N")
    for given in ("tok_b", "./tok_b/"):  # by the path the manifest records, written either way
        r = run("inspect", str(out), "--sample", "demo-002", "--source", given, "--json")
        view = json.loads(r.stdout)
        assert (view["pack_index"], [v["mixture_source"] for v in view["samples"]]) == (b_pack, ["tok_b"]), given
        assert "matches" not in view  # one sample of the name from that source
    r = run("inspect", str(out), "--sample", "demo-000", "--source", "tok_b")
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr == (f"Error: sample 'demo-000' of {str(out)!r} is not from 'tok_b': the sample of that name is from "
                        "'tok_a'; give one of those to --source, or leave it out\n")
    r = run("inspect", str(out), "--sample", "demo-002", "--source", "tok_c")
    assert (r.returncode, r.stderr) == (1, f"Error: --source 'tok_c' is none of the 2 sources of the mixture "
                                           f"{str(out)!r}: 'tok_a', 'tok_b'; give one of those (a name, or the path "
                                           "the manifest records)\n")
    r = run("inspect", str(out), "--source", "tok_a")
    assert r.returncode == 2 and r.stderr.endswith("Error: --source picks among the samples of one name: give --sample "
                                                   "ID with it\n")


def test_truncate_rejects_a_cut_that_keeps_no_target_in_a_mixture_too(tmp_path):
    """--oversize truncate leaves out (no_loss) a text sample whose cut keeps no target, so no pack
    trains on 0/0. A mixture packed such samples all the same: at rate 2 six samples, each cut to a
    pack of its own without a target, where one directory packed alone rejects them; the dry run,
    the manifest and stats all counted them as packed."""
    rows = [{"id": f"t{i}", "conversations": [{"from": "human", "value": "word " * 80 if i % 2 == 0 else "hi"},
                                              {"from": "gpt", "value": "ok." if i % 2 == 0 else "answer " * 80}]}
            for i in range(6)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = tmp_path / "tok"
    assert run("tokenize", str(tmp_path / "t.jsonl"), "-o", str(tok), "-q").returncode == 0
    flags = ("--max-tokens", "64", "--oversize", "truncate", "-q", "--json")
    alone = json.loads(run("pack", str(tok), "--dry-run", *flags).stdout)
    assert (alone["samples_packed"], alone["rejected_by_reason"]) == (3, {"no_loss": 3})
    dry = json.loads(run("pack", str(tok), "--rates", "2", "--dry-run", *flags).stdout)
    r = run("pack", str(tok), "--rates", "2", "-o", str(tmp_path / "mix"), *flags)
    assert r.returncode == 0, r.stderr
    for counts in (dry, json.loads(r.stdout)):
        assert (counts["samples_packed"], counts["truncated"], counts["rejected_by_reason"]) == (6, 6, {"no_loss": 6})
        assert counts["mixture"]["sources"][0]["realised"]["samples"] == 6
    errors = [json.loads(x) for x in (tmp_path / "mix" / ".packtool" / "errors.jsonl").read_text().splitlines()]
    assert sorted((e["sample_id"], e["reason"]) for e in errors) == sorted(
        (f"t{i}{c}", "no_loss") for i in (0, 2, 4) for c in ("", "#c1"))
    targets = [t for f in sorted((tmp_path / "mix").glob("*.parquet"))
               for t in read_expanded(f, ["target_ids"]).column("target_ids").to_pylist()]
    assert len(targets) == 6 and all(any(x != -100 for x in t) for t in targets)
    s = json.loads(run("stats", str(tmp_path / "mix"), "--json").stdout)
    assert (s["samples"], s["rejected"]["pack"]) == (6, {"no_loss": 6})
