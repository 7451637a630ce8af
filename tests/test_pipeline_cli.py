"""The scale and safety flags as a user meets them on the command line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from clirun import packtool


def run(*args: str) -> subprocess.CompletedProcess:
    return packtool(*args)  # in this process (tests/clirun.py): what a command prints and writes


@pytest.fixture()
def corpus(demo_dirs, tmp_path) -> tuple[Path, Path]:
    """The demo corpus with one broken line appended (31 rows)."""
    sample = demo_dirs["sample"]
    src = tmp_path / "in.jsonl"
    src.write_text((sample / "data.jsonl").read_text() + "{broken\n")
    return src, sample


def test_rank_line_counts_one_task_in_the_singular(corpus, tmp_path):
    src, sample = corpus
    out = tmp_path / "tok"
    r = run("tokenize", str(src), "--media-root", str(sample), "-o", str(out), "--rows-per-shard", "16", "--quiet",
            "--world-size", "2", "--rank", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"rank 0 of 2: 1 task done, 1 task of other ranks remains; when all are done run: packtool merge {out}\n"


def test_ranks_then_merge(corpus, tmp_path):
    src, sample = corpus
    out = tmp_path / "tok"
    base = ["tokenize", str(src), "--media-root", str(sample), "-o", str(out), "--rows-per-shard", "8", "--quiet",
            "--world-size", "2"]
    r = run(*base, "--rank", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout == (f"rank 0 of 2: 2 tasks done, 2 tasks of other ranks remain; when all are done run: "
                        f"packtool merge {out}\n")
    r = run("merge", str(out))
    assert r.returncode == 1
    assert r.stderr == (f"Error: {str(out)!r}: 2 of 4 tasks are not finished (first: [1, 3]); run rank 1 of "
                        "--world-size 2 (the same command resumes) and merge again\n")
    r = run(*base, "--rank", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("30 samples from 31 rows in 4 shards")
    # the last rank merged the run: merge has nothing to write, writes nothing, and says so (a run on
    # read-only storage merges as well)
    state = out / ".packtool"
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes()) for p in state.iterdir() if p.is_file()}
    manifest = out / ".packtool" / "manifest.json"
    r = run("merge", str(out))
    assert (r.returncode, r.stdout) == (0, f"tokenized: nothing to do, merged already: 4 tasks, 4 shards -> {manifest}\n")
    assert json.loads(manifest.read_text())["counts"]["rejected_by_reason"] == {"bad_json": 1}
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes()) for p in state.iterdir() if p.is_file()} \
        == before
    assert json.loads(run("merge", str(out), "--json").stdout)["written"] is False
    # a changed errors.jsonl of a run whose logs are whole is written again from them, as before
    (state / "errors.jsonl").write_bytes(b"{}\n" + (state / "errors.jsonl").read_bytes()[3:])
    r = run("merge", str(out))
    assert (r.returncode, r.stdout) == (0, f"tokenized: 4 tasks, 4 shards -> {manifest}\n")
    assert (state / "errors.jsonl").read_bytes() == before["errors.jsonl"][2]


def _tokenize_ranks(src, sample, out, rows_per_shard: int, world_size: int) -> list[str]:
    """The arguments of a one-worker tokenize split into ``world_size`` ranks (add ``--rank R``)."""
    return ["tokenize", str(src), "--media-root", str(sample), "-o", str(out), "--rows-per-shard", str(rows_per_shard),
            "--quiet", "--workers", "1", "--world-size", str(world_size)]


def test_merge_names_every_rank_that_has_not_finished(corpus, tmp_path):
    """With more than ten ranks missing, merge named the first ten only ("run ranks 1, 2, ..., 10 of
    --world-size 15"): ranks 11 to 14 were found missing only after those ten ran and merge ran
    again. Now every one is named, runs of consecutive ranks as ranges (as a Slurm --array takes them)."""
    src, sample = corpus
    out = tmp_path / "tok"
    base = _tokenize_ranks(src, sample, out, rows_per_shard=2, world_size=15)
    for rank in ("0", "5"):
        assert run(*base, "--rank", rank).returncode == 0
    r = run("merge", str(out))
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr == (f"Error: {str(out)!r}: 13 of 16 tasks are not finished (first: [1, 2, 3, 4, 6]); run ranks "
                        "1-4, 6-14 of --world-size 15 (the same command resumes) and merge again\n")
    assert not (out / ".packtool" / "manifest.json").exists()


def test_overwrite_starts_a_finished_run_of_the_same_settings_over(tmp_path, monkeypatch):
    """The fix errors.jsonl invites: put the missing image in place, run again with --overwrite.
    A finished run of the same settings and unchanged inputs was returned as it was, the row
    still rejected; --overwrite now does it again (without it, the finished run is reused)."""
    from PIL import Image

    monkeypatch.chdir(tmp_path)
    (tmp_path / "img").mkdir()
    (tmp_path / "d.jsonl").write_text(json.dumps({"id": "m1", "image": "img/0.jpg", "conversations": [
        {"from": "human", "value": "<image>\nQ"}, {"from": "gpt", "value": "A"}]}) + "\n")
    cmd = ["tokenize", "d.jsonl", "--media-root", ".", "-o", "out", "--workers", "1", "-q"]
    assert run(*cmd).stdout.startswith("0 samples from 1 row")
    Image.new("RGB", (64, 48), "red").save(tmp_path / "img" / "0.jpg")
    assert run(*cmd).stdout.startswith("0 samples from 1 row")  # the finished run, reused
    r = run(*cmd, "--overwrite")
    assert (r.returncode, r.stdout) == (0, "1 sample from 1 row in 1 shard -> out\n"), r.stderr
    assert (tmp_path / "out" / ".packtool" / "errors.jsonl").read_text() == ""


def test_a_second_run_in_one_process_probes_the_media_again(tmp_path):
    """tokenize keeps its probes for the whole process (a notebook, a library caller, a pool's
    worker): a second run after an image was replaced by one of another size counted the old
    size's tokens, and one after a missing image was put in place still rejected it."""
    import pyarrow.parquet as pq
    from PIL import Image

    from packtool import TokenizeConfig, tokenize_dataset

    (tmp_path / "img").mkdir()
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"id": i, "image": f"img/{i}.jpg", "conversations": [
        {"from": "human", "value": "<image>\nQ"}, {"from": "gpt", "value": "A"}]}) + "\n" for i in ("a", "b")))
    Image.new("RGB", (64, 48), "red").save(tmp_path / "img" / "a.jpg")
    cfg = TokenizeConfig(media_root=str(tmp_path))

    def sizes(out):
        m = tokenize_dataset([tmp_path / "d.jsonl"], tmp_path / out, cfg, workers=1, progress=None)
        rows = [r for s in m["shards"] for r in pq.read_table(tmp_path / out / s["file"], columns=["media"])
                .column("media").to_pylist()]
        return sorted((r[0]["path"], r[0]["width"], r[0]["height"]) for r in rows)

    assert sizes("one") == [("img/a.jpg", 64, 48)]  # b is missing
    Image.new("RGB", (640, 480), "blue").save(tmp_path / "img" / "a.jpg")
    Image.new("RGB", (32, 32), "blue").save(tmp_path / "img" / "b.jpg")
    assert sizes("two") == [("img/a.jpg", 640, 480), ("img/b.jpg", 32, 32)]


def test_a_setting_that_cannot_work_leaves_no_run_to_resume(corpus, tmp_path):
    """A setting refused at the first task (a knapsack table too large, a template whose tokens
    the vocabulary lacks, --oversize fail on data that has oversize samples) stops every run of
    the same command: it left run.json behind, so stats and merge called the folder an
    unfinished run to run again. Nothing is left now, and the output reads as never written."""
    src, sample = corpus
    tok = tmp_path / "tok"
    assert run("tokenize", str(src), "--media-root", str(sample), "-o", str(tok), "-q").returncode == 0
    for args, out in ((["pack", str(tok), "--max-tokens", "2147483647"], tmp_path / "huge"),
                      (["pack", str(tok), "--max-tokens", "1024", "--oversize", "fail"], tmp_path / "strict"),
                      (["tokenize", str(src), "--media-root", str(sample), "--template", "llama3"], tmp_path / "llama")):
        r = run(*args, "-o", str(out), "-q", "--workers", "1")
        assert r.returncode == 1 and r.stderr.startswith("Error: ") and r.stderr.count("\n") == 1, (args, r.stderr)
        assert not (out / ".packtool" / "run.json").exists() and not (out / ".packtool" / "plan.json").exists(), args
        r = run("stats", str(out))
        assert r.returncode == 1 and "unfinished" not in r.stderr and "no .packtool/manifest.json found" in r.stderr


def test_a_tasks_max_errors_stop_names_the_logs_under_the_output(tmp_path, monkeypatch):
    """The stop between tasks said ``see .packtool/errors-*.jsonl``, relative to wherever the
    command ran, not to the output; it names them under ``-o`` as given."""
    lines = []
    for i in range(40):
        lines.append(json.dumps({"id": f"s{i}", "conversations": [{"from": "human", "value": "hi"},
                                                                  {"from": "gpt", "value": "yo"}]}))
        if i % 4 == 0:
            lines.append("{bad")
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.chdir(tmp_path)
    r = run("tokenize", "d.jsonl", "-o", "out/tm", "--rows-per-shard", "5", "-q", "--max-errors", "5", "--workers", "1")
    assert (r.returncode, r.stderr) == (1, "Error: 6 input rows rejected, more than --max-errors 5 (see "
                                           "out/tm/.packtool/errors-*.jsonl); fix the input or raise --max-errors\n")
    assert len(list((tmp_path / "out" / "tm" / ".packtool").glob("errors-*.jsonl"))) > 1


def test_merge_over_the_runs_max_errors_says_how_to_raise_it(corpus, tmp_path):
    """The last rank's merge (and ``packtool merge``) past the ranks' --max-errors said "raise
    --max-errors", which merge has no flag for, and pointed at ``.packtool/errors-*.jsonl``
    relative to wherever the command ran. Now it names the files under the output and the
    command that raises the limit: a rank's, which then merges."""
    src, sample = corpus
    lines = src.read_text().splitlines()
    lines[1] = "{broken"  # task 0 (rank 0); the last line, also broken, is in task 3 (rank 1)
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "tok"
    base = _tokenize_ranks(src, sample, out, rows_per_shard=8, world_size=2)
    assert run(*base, "--rank", "0", "--max-errors", "1").returncode == 0
    want = (f"Error: 2 input rows rejected, more than --max-errors 1 (see {out / '.packtool' / 'errors-*.jsonl'}); fix "
            "the input or raise --max-errors: merge holds the run to the limit its ranks were given, so re-run one "
            "rank's command with a higher --max-errors (it merges the run)\n")
    r = run(*base, "--rank", "1", "--max-errors", "1")
    assert (r.returncode, r.stdout, r.stderr) == (1, "", want)
    r = run("merge", str(out))
    assert (r.returncode, r.stdout, r.stderr) == (1, "", want)
    assert not (out / ".packtool" / "manifest.json").exists() and not (out / ".packtool" / "errors.jsonl").exists()
    r = run(*base, "--rank", "0", "--max-errors", "2")
    assert (r.returncode, r.stdout) == (0, f"29 samples from 31 rows in 4 shards -> {out}\n2 rows rejected (bad_json 2); "
                                           f"see {out / '.packtool' / 'errors.jsonl'}\n"), r.stderr


def test_merge_of_a_finished_run_that_lost_a_shard_names_a_fix_that_works(corpus, tmp_path):
    """A finished run whose shard was deleted since: merge said "run rank 1 (the same command
    resumes)", but the same command found the run finished and redid nothing, so merge said it
    again. Now the rank's command repairs its lost task, and merge says to run it."""
    src, sample = corpus
    out = tmp_path / "tok"
    base = _tokenize_ranks(src, sample, out, rows_per_shard=8, world_size=2)
    for rank in ("0", "1"):
        assert run(*base, "--rank", rank).returncode == 0
    whole = {p.name: p.read_bytes() for p in out.glob("part-*.parquet")}
    manifest = (out / ".packtool" / "manifest.json").read_bytes()
    (out / "part-00003-00000.parquet").unlink()
    r = run("merge", str(out))
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr == (f"Error: {str(out)!r}: the run had finished, but the files of 1 of 4 tasks are gone or changed since "
                        "(first: [3]); run rank 1 of --world-size 2 again (it redoes those tasks and merges)\n")
    # rank 0 owns none of it: it says who does, and leaves the run to rank 1
    r = run(*base, "--rank", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("rank 0 of 2: 2 tasks done, 1 task of other ranks remains")
    assert r.stderr == (f"WARNING packtool.shards: {out}: 1 of 4 shards of the finished run is missing or changed: "
                        "part-00003-00000.parquet (missing); task 3, which wrote it, is redone by rank 1 of "
                        "--world-size 2; the rest is kept\n")
    r = run(*base, "--rank", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("30 samples from 31 rows in 4 shards")
    assert {p.name: p.read_bytes() for p in out.glob("part-*.parquet")} == whole
    assert (out / ".packtool" / "manifest.json").read_bytes() == manifest
    assert run("validate", str(out)).returncode == 0


def test_a_cut_errors_file_whose_task_log_is_gone_is_repaired_by_that_tasks_rank(corpus, tmp_path):
    """errors.jsonl cut short after the run finished, and the error log of task 3 (rank 1's) gone
    too: rank 0's command says so in one warning and leaves task 3 to rank 1, whose command
    redoes it and writes errors.jsonl again: the bytes of the first run, and validate passes."""
    src, sample = corpus
    out = tmp_path / "tok"
    base = _tokenize_ranks(src, sample, out, rows_per_shard=8, world_size=2)
    for rank in ("0", "1"):
        assert run(*base, "--rank", rank).returncode == 0
    state = out / ".packtool"
    whole = {p.name: p.read_bytes() for p in [*out.glob("part-*.parquet"), state / "errors.jsonl", state / "manifest.json"]}
    assert whole["errors.jsonl"].count(b"\n") == 1
    (state / "errors.jsonl").write_bytes(whole["errors.jsonl"][:10])
    (state / "errors-00003.jsonl").unlink()
    r = run(*base, "--rank", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("rank 0 of 2: 2 tasks done, 1 task of other ranks remains")
    assert r.stderr == (f"WARNING packtool.shards: {out}: the finished run's .packtool/errors.jsonl is 10 bytes, listed "
                        f"{len(whole['errors.jsonl'])}; task 3, whose error log is missing or changed, is redone by "
                        "rank 1 of --world-size 2; the rest is kept\n")
    r = run(*base, "--rank", "1")
    assert (r.returncode, r.stderr) == (0, "")
    assert r.stdout == (f"30 samples from 31 rows in 4 shards -> {out}\n1 row rejected (bad_json 1); see "
                        f"{state / 'errors.jsonl'}\n")
    assert {p.name: p.read_bytes() for p in [*out.glob("part-*.parquet"), state / "errors.jsonl",
                                               state / "manifest.json"]} == whole
    assert run("validate", str(out)).returncode == 0


def _finished_ranks(corpus, tmp_path) -> tuple[list[str], Path, dict[str, bytes]]:
    """A tokenize run split into two ranks, both run (so merged), and the bytes of its files."""
    src, sample = corpus
    out = tmp_path / "tok"
    base = _tokenize_ranks(src, sample, out, rows_per_shard=8, world_size=2)
    for rank in ("0", "1"):
        assert run(*base, "--rank", rank).returncode == 0
    return base, out, _outputs(out)


def _outputs(out: Path) -> dict[str, bytes]:
    state = out / ".packtool"
    return {p.name: p.read_bytes() for p in [*out.glob("part-*.parquet"), state / "errors.jsonl", state / "manifest.json"]}


@pytest.mark.parametrize("lost", ["errors-00003.jsonl", "task-00003.json"])
def test_merge_of_a_merged_run_that_lost_a_task_log_or_marker_has_nothing_to_do(corpus, tmp_path, lost):
    """A finished run that lost task 3's error log (or its completion marker), its errors.jsonl
    whole: merge said "run rank 1 again (it redoes those tasks and merges)", rank 1's command
    found the run whole and did nothing, and merge said the same again, for ever. The merged run
    needs no task log: merge says there is nothing to do and succeeds, changing no file; a later
    repair that needs the lost log redoes task 3."""
    base, out, whole = _finished_ranks(corpus, tmp_path)
    state = out / ".packtool"
    (state / lost).unlink()
    at = {p.name: p.stat().st_mtime_ns for p in state.iterdir()}
    for _ in range(2):
        r = run("merge", str(out))
        assert (r.returncode, r.stdout) == (0, f"tokenized: nothing to do, merged already: 4 tasks, 4 shards -> {state / 'manifest.json'}\n")
        assert r.stderr == (f"WARNING packtool.pipeline: {out}: the run is merged already, and its shards and "
                            ".packtool/errors.jsonl are as its manifest lists them: nothing to do (the completion "
                            "markers or error logs of 1 of 4 tasks (first: [3]) are gone or changed since; the merged "
                            "run needs none of them, and a later repair redoes those tasks)\n")
        assert {p.name: p.stat().st_mtime_ns for p in state.iterdir()} == at
    assert _outputs(out) == whole and run("validate", str(out)).returncode == 0
    # errors.jsonl lost as well: now it needs task 3's log, and rank 1's command redoes the task
    (state / "errors.jsonl").unlink()
    r = run("merge", str(out))
    assert (r.returncode, r.stderr) == (1, f"Error: {str(out)!r}: the run had finished, but the files of 1 of 4 tasks "
                                           "are gone or changed since (first: [3]); run rank 1 of --world-size 2 again "
                                           "(it redoes those tasks and merges)\n")
    r = run(*base, "--rank", "1")
    assert r.returncode == 0 and "task 3, whose" in r.stderr and "is redone by rank 1" in r.stderr, r.stderr
    assert _outputs(out) == whole and (state / lost).is_file()


def test_merge_of_a_changed_errors_file_whose_task_log_is_gone_names_a_fix_that_works(corpus, tmp_path):
    """errors.jsonl edited at its size after the run finished (validate: "sha256 differs ...;
    `packtool merge` ... writes it again") and task 3's log gone: merge cannot write it again,
    and the rank's command, finding every file at its listed size, redid nothing, so merge's
    "run rank 1 again" went round in a circle. merge now removes the errors.jsonl it knows to be
    wrong, so rank 1's command finds it missing and redoes task 3: the first run's bytes."""
    base, out, whole = _finished_ranks(corpus, tmp_path)
    state = out / ".packtool"
    (state / "errors.jsonl").write_bytes(whole["errors.jsonl"].replace(b"not valid JSON", b"not valid JSOM"))
    (state / "errors-00003.jsonl").unlink()
    # validate sends the user where the fix works: merge cannot write it without task 3's log
    r = run("validate", str(out))
    assert r.returncode == 1 and "`packtool merge`" not in r.stdout
    assert ("the tasks' error logs it is written from are gone too: run the command that wrote the directory again "
            "(it redoes those tasks and writes it)") in r.stdout
    # a copy without the run's state (how validate sees a bucket output: manifest, errors.jsonl and
    # shards) cannot tell: it names merge, which finds the logs or names the command that writes them
    copy = tmp_path / "copy"
    (copy / ".packtool").mkdir(parents=True)
    for f in out.glob("*.parquet"):
        shutil.copy(f, copy / f.name)
    for name in ("manifest.json", "errors.jsonl"):
        shutil.copy(state / name, copy / ".packtool" / name)
    r = run("validate", str(copy))
    assert r.returncode == 1 and "`packtool merge` on the directory writes it again" in r.stdout
    r = run("merge", str(out))
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr == (f"Error: {str(out)!r}: the run had finished, but its .packtool/errors.jsonl is not the one its "
                        "manifest lists, and the files of 1 of 4 tasks it is written from are gone or changed since "
                        "(first: [3]); removed it: run rank 1 of --world-size 2 again (it redoes those tasks and "
                        "writes it)\n")
    assert not (state / "errors.jsonl").exists()
    r = run(*base, "--rank", "1")
    assert r.returncode == 0, r.stderr
    assert r.stderr == (f"WARNING packtool.shards: {out}: the finished run's .packtool/errors.jsonl is missing; task 3, "
                        "whose error log is missing or changed, is redone by rank 1 of --world-size 2; the rest is "
                        "kept\n")
    assert _outputs(out) == whole
    assert run("validate", str(out)).returncode == 0
    r = run("merge", str(out))
    assert (r.returncode, r.stderr) == (0, "") and _outputs(out) == whole


def test_merge_of_an_unfinished_single_run_names_its_command(corpus, tmp_path):
    """A run without --world-size that stopped before its merge: merge said "run rank 0 of
    --world-size 1", a flag the user never passed; it now says to run the command again, which
    resumes the run and merges it."""
    src, sample = corpus
    out = tmp_path / "tok"
    cmd = ["tokenize", str(src), "--media-root", str(sample), "-o", str(out), "--rows-per-shard", "8", "--quiet",
           "--workers", "1"]
    assert run(*cmd).returncode == 0
    whole = _outputs(out)
    state = out / ".packtool"
    (state / "manifest.json").unlink()  # as a run killed between its last task and its merge, less task 2
    (state / "task-00002.json").unlink()
    r = run("merge", str(out))
    assert (r.returncode, r.stderr) == (1, f"Error: {str(out)!r}: 1 of 4 tasks is not finished (first: [2]); run the "
                                           "command that wrote it again (it resumes the run and merges)\n")
    r = run(*cmd)
    assert r.returncode == 0, r.stderr
    assert _outputs(out) == whole


SHARE_KEYS = ["partial", "kind", "rank", "world_size", "tasks_missing", "counts", "shard_files"]


def test_json_of_a_rank_that_is_not_the_last_has_the_full_runs_keys(corpus, tmp_path):
    """``--json`` of a rank whose run others finish printed another shape (no ``output``, the counts
    nested, ``shards`` a list where a full run prints a number): a script reading one rank's
    result broke on the others'. Now a share prints a full run's keys, counted over its own
    tasks, then the keys that mark it a share."""
    src, sample = corpus
    tok_args = ["--media-root", str(sample), "--rows-per-shard", "8", "--quiet", "--json"]
    full = json.loads(run("tokenize", str(src), "-o", str(tmp_path / "tok"), *tok_args).stdout)
    r = run("tokenize", str(src), "-o", str(tmp_path / "tok2"), *tok_args, "--world-size", "2", "--rank", "0")
    share = json.loads(r.stdout)
    assert list(share) == [*full, *SHARE_KEYS]
    assert (share["output"], share["tasks"], share["shards"], share["tasks_missing"], share["rank"]) == \
        (str(tmp_path / "tok2"), 2, 2, 2, 0)
    assert {k: share[k] for k in share["counts"]} == share["counts"] and share["samples"] == 16
    assert [s["file"] for s in share["shard_files"]] == ["part-00000-00000.parquet", "part-00002-00000.parquet"]
    pack_args = ["--max-tokens", "8192", "--quiet", "--json"]
    full = json.loads(run("pack", str(tmp_path / "tok"), "-o", str(tmp_path / "packed"), *pack_args).stdout)
    share = json.loads(run("pack", str(tmp_path / "tok"), "-o", str(tmp_path / "packed2"), *pack_args,
                           "--world-size", "2", "--rank", "1").stdout)
    assert list(share) == [*full, *SHARE_KEYS]
    assert (share["output"], share["dry_run"], share["max_tokens"], share["max_vision_units"], share["tasks"]) == \
        (str(tmp_path / "packed2"), False, 8192, full["max_vision_units"], 2)
    assert share["samples_packed"] == share["counts"]["samples_packed"] < full["samples_packed"]
    assert 1 <= share["lower_bound"] <= share["packs"]


def test_json_of_a_rank_with_no_tasks_has_the_full_runs_keys(corpus, tmp_path):
    """A rank beyond the task count (a 32-rank array over a small corpus) printed tokenize's JSON
    without ``branches``, ``split_extra_trees`` and ``merged_records``, which every other rank
    and a full run print; a script summing the ranks' results failed on that one."""
    src, sample = corpus
    tok_args = ["--media-root", str(sample), "--rows-per-shard", "10", "--quiet", "--json", "--workers", "1"]
    full = json.loads(run("tokenize", str(src), "-o", str(tmp_path / "tok"), *tok_args).stdout)
    assert full["tasks"] == 4
    r = run("tokenize", str(src), "-o", str(tmp_path / "tok2"), *tok_args, "--world-size", "5", "--rank", "4")
    share = json.loads(r.stdout)
    assert list(share) == [*full, *SHARE_KEYS]
    assert {k: share[k] for k in ("tasks", "shards", "samples", "branches", "split_extra_trees", "merged_records")} == \
        dict.fromkeys(("tasks", "shards", "samples", "branches", "split_extra_trees", "merged_records"), 0)
    assert list(share["counts"]) == [k for k in full if k not in ("output", "tasks", "shards")]


def test_on_error_fail_and_max_errors_exit_1_with_the_row(corpus, tmp_path):
    src, sample = corpus
    common = [str(src), "--media-root", str(sample), "--quiet"]
    r = run("tokenize", *common, "-o", str(tmp_path / "a"), "--on-error", "fail")
    assert r.returncode == 1
    assert r.stderr.startswith(f"Error: {src}:30 rejected, bad_json: line is not valid JSON")
    assert "--on-error fail stops the run at the first rejected row a task meets" in r.stderr
    assert not (tmp_path / "a" / ".packtool" / "manifest.json").exists()
    r = run("tokenize", *common, "-o", str(tmp_path / "b"), "--max-errors", "0")
    assert r.returncode == 1
    assert r.stderr.startswith("Error: 1 input row rejected, more than --max-errors 0")
    assert r.stderr.endswith("); fix the input or raise --max-errors\n")
    r = run("tokenize", *common, "-o", str(tmp_path / "b"), "--max-errors", "1", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["rejected"] == 1


OVERSIZE_FIX = ("the samples do not fit a pack: raise --max-tokens or --max-vision-units, keep them with --oversize "
                "alone or truncate (text-only), or raise --max-errors\n")


def test_max_errors_stopping_pack_on_oversize_drops_names_the_capacities(corpus, tmp_path):
    """12 of the 30 demo samples need more than 1,024 tokens: pack's --max-errors stop said
    "fix the input or raise --max-errors", where the fix is the pack's capacities or --oversize.
    Every place the limit is checked says so: a task, a dry run, a finished run found again."""
    src, sample = corpus
    tok = tmp_path / "tok"
    assert run("tokenize", str(src), "--media-root", str(sample), "-o", str(tok), "--rows-per-shard", "10",
               "--quiet").returncode == 0
    pack = ["pack", str(tok), "--max-tokens", "1024", "--quiet", "--workers", "1"]
    r = run(*pack, "-o", str(tmp_path / "a"), "--max-errors", "2")
    assert r.returncode == 1 and r.stderr.startswith("Error: 3 input rows rejected, more than --max-errors 2 (latest: ")
    assert r.stderr.endswith("oversize: needs 1,238 tokens and 4,784 vision units; a pack holds 1,024 and 65,536); "
                             + OVERSIZE_FIX)
    r = run(*pack, "--dry-run", "--max-errors", "2")
    assert (r.returncode, r.stderr) == (1, "Error: 12 input rows would be rejected, more than --max-errors 2 "
                                           "(oversize 12); " + OVERSIZE_FIX)
    assert run(*pack, "-o", str(tmp_path / "b")).returncode == 0
    r = run(*pack, "-o", str(tmp_path / "b"), "--max-errors", "2")
    assert (r.returncode, r.stderr) == (1, "Error: 12 input rows rejected, more than --max-errors 2 (see "
                                           f"{tmp_path / 'b' / '.packtool' / 'errors.jsonl'}); " + OVERSIZE_FIX)
    # rows rejected for other reasons beside them: both fixes
    from packtool.pipeline import _max_errors_fix

    assert _max_errors_fix({"oversize": 2, "missing_media": 1}) == (
        "fix the input (samples that do not fit a pack: raise --max-tokens or --max-vision-units, keep them with "
        "--oversize alone or truncate (text-only)) or raise --max-errors")


def test_on_error_fail_stopping_pack_on_an_oversize_sample_names_the_capacity_flag(demo_dirs, tmp_path):
    """--on-error fail on an oversize sample said "fix the input, or use --on-error skip": the input
    is fine, the capacity is what to change. The line names the flag of the capacity passed, in a
    task, a dry run, a mixture and a finished run found again."""
    tok = demo_dirs["tokenized"]
    pack = ["pack", str(tok), "--quiet", "--workers", "1", "--on-error", "fail"]
    r = run(*pack, "-o", str(tmp_path / "a"), "--max-tokens", "4096")
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr.startswith("Error: ") and r.stderr.count("\n") == 1
    assert r.stderr.endswith("(sample 'demo-017') rejected, oversize: needs 4,230 tokens and 16,728 vision units; a "
                             "pack holds 4,096 and 65,536; --on-error fail stops the run at the first rejected row a task meets (raise "
                             "--max-tokens, keep such samples with --oversize alone or truncate (text-only), or use "
                             "--on-error skip)\n")
    # vision units over the capacity: truncating text cannot help, so it is not offered
    r = run(*pack, "-o", str(tmp_path / "b"), "--max-tokens", "8192", "--max-vision-units", "1000")
    assert r.returncode == 1
    assert r.stderr.endswith("(sample 'demo-000') rejected, oversize: needs 433 tokens and 1,564 vision units; a pack "
                             "holds 8,192 and 1,000; --on-error fail stops the run at the first rejected row a task meets (raise "
                             "--max-vision-units, keep such samples with --oversize alone, or use --on-error skip)\n")
    r = run(*pack, "--dry-run", "--max-tokens", "4096")
    assert (r.returncode, r.stderr) == (1, "Error: 1 input row would be rejected (oversize 1); --on-error fail stops "
                                           "at the first (raise --max-tokens or --max-vision-units, keep such samples "
                                           "with --oversize alone or truncate (text-only), or use --on-error skip)\n")
    # a mixture's task says the same
    r = run(*pack, "--rates", "2", "-o", str(tmp_path / "c"), "--max-tokens", "4096")
    assert r.returncode == 1 and r.stderr.endswith("; --on-error fail stops the run at the first rejected row a task meets (raise "
                                                   "--max-tokens, keep such samples with --oversize alone or truncate "
                                                   "(text-only), or use --on-error skip)\n")
    # a finished run found again, its drops made under --on-error skip
    d = tmp_path / "d"
    assert run("pack", str(tok), "--quiet", "--workers", "1", "-o", str(d), "--max-tokens", "4096").returncode == 0
    r = run(*pack, "-o", str(d), "--max-tokens", "4096")
    assert (r.returncode, r.stderr) == (1, f"Error: 1 input row rejected by tasks that finished before (see "
                                           f"{d / '.packtool' / 'errors.jsonl'}); --on-error fail allows none: raise "
                                           "--max-tokens or --max-vision-units, keep such samples with --oversize "
                                           "alone or truncate (text-only) and start over with --overwrite, or use "
                                           "--on-error skip\n")


@pytest.mark.parametrize(("flags", "code", "message"), [
    # flags that cannot work together are usage errors too (they were exit 1, as a failed run)
    (["--rank", "2", "--world-size", "2"], 2, "Error: --rank 2 is outside 0..1"),
    (["--ray-address", "10.0.0.1:6379"], 2, "Error: --ray-address needs --executor ray"),
    # enumerated options are checked by the parser, which lists the choices (a usage error)
    (["--executor", "spark"], 2, "'spark' is not one of 'local', 'ray'"),
    (["--on-error", "ignore"], 2, "'ignore' is not one of 'skip', 'fail'"),
])
@pytest.mark.parametrize("stage", ["tokenize", "pack"])
def test_bad_flags_name_the_fix(corpus, demo_dirs, tmp_path, stage, flags, code, message):
    src, sample = corpus
    args = [str(src), "--media-root", str(sample)] if stage == "tokenize" else [str(demo_dirs["tokenized"])]
    r = run(stage, *args, "-o", str(tmp_path / "t"), "--quiet", *flags)
    assert r.returncode == code and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("Usage: ") and not (tmp_path / "t").exists()


def test_executor_ray_without_ray_installed_is_a_usage_error(demo_dirs, tmp_path):
    """Without Ray, ``--executor ray`` failed as a run (exit 1) once the output was prepared.
    Ray is hidden from a fresh interpreter the way Python documents (``sys.modules[name] = None``)."""
    code = ("import sys; sys.modules['ray'] = None; from packtool.cli import main; "
            f"sys.exit(main(['pack', {str(demo_dirs['tokenized'])!r}, '-o', {str(tmp_path / 'p')!r}, "
            "'--executor', 'ray', '--ray-address', '10.0.0.1:6379', '--quiet']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "Error: --executor ray needs Ray; run `pip install packtool[ray]`" in r.stderr
    assert not (tmp_path / "p").exists()


def test_resume_refusal_names_the_setting(demo_dirs, tmp_path):
    out = tmp_path / "packed"
    assert run("pack", str(demo_dirs["tokenized"]), "-o", str(out), "--quiet", "--workers", "1").returncode == 0
    r = run("pack", str(demo_dirs["tokenized"]), "-o", str(out), "--quiet", "--max-tokens", "4096")
    assert r.returncode == 1
    assert "already holds a finished run with a different configuration (max_tokens: 16384 -> 4096)" in r.stderr
    assert "--overwrite" in r.stderr
    r = run("pack", str(demo_dirs["tokenized"]), "-o", str(out), "--quiet", "--max-tokens", "4096", "--overwrite")
    assert r.returncode == 0, r.stderr
    assert run("validate", str(out)).returncode == 0


def test_a_corpus_directory_holding_earlier_outputs_is_read_as_the_corpus_only(demo_dirs, tmp_path):
    """``tokenize DIR -o DIR/out`` twice: the second run must not read the first run's files."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(demo_dirs["sample"], data)
    (data / ".cache").mkdir()
    (data / ".cache" / "notes.jsonl").write_text("{broken\n")  # hidden: not input
    (data / ".hidden.jsonl").write_text("{broken\n")
    old = data / "old"  # an output directory of the earlier layout
    shutil.copytree(demo_dirs["tokenized"], old)
    (old / ".packtool" / "manifest.json").rename(old / "manifest.json")
    shutil.rmtree(old / ".packtool")
    base = ["tokenize", str(data), "--media-root", str(data), "-o", str(data / "out"), "--quiet"]
    first = run(*base)
    assert (first.returncode, first.stdout) == (0, f"30 samples from 30 rows in 1 shard -> {data / 'out'}\n"), first.stderr
    again = run(*base, "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["rows_in"] == 30
    r = run("tokenize", str(data / "out"), "-o", str(tmp_path / "x"))
    assert r.returncode == 1 and "is a packtool output directory, not raw records" in r.stderr


def test_output_into_a_foreign_directory_is_refused_unless_asked(demo_dirs, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("keep me")
    (out / ".DS_Store").write_text("")  # hidden entries do not make a directory non-empty
    base = ["tokenize", str(demo_dirs["sample"] / "data.jsonl"), "--media-root", str(demo_dirs["sample"]), "-o", str(out),
            "--quiet"]
    r = run(*base)
    assert r.returncode == 1
    assert r.stderr == (f"Error: output {str(out)!r} is not empty and holds no packtool run ('thesis.tex'); choose a "
                        "new or empty -o, or pass --overwrite to write there anyway (files packtool did not write "
                        "are never removed)\n")
    assert sorted(p.name for p in out.iterdir()) == [".DS_Store", "thesis.tex"]
    r = run(*base, "--overwrite")
    assert r.returncode == 0, r.stderr
    assert (out / "thesis.tex").read_text() == "keep me"
    empty = tmp_path / "empty"
    (empty / ".git").mkdir(parents=True)
    assert run("tokenize", *base[1:4], "-o", str(empty), "--quiet").returncode == 0


def test_overwrite_removes_only_the_files_the_run_wrote(demo_dirs, tmp_path):
    import shutil

    out = tmp_path / "packed"
    shutil.copytree(demo_dirs["packed"], out)
    own = sorted(p.name for p in out.glob("part-*.parquet"))
    (out / "part-00042-00000.parquet").write_bytes(b"someone else's shard")  # named like ours, listed nowhere
    (out / "README.txt").write_text("mine")
    pack = ["pack", str(demo_dirs["tokenized"]), "-o", str(out), "--max-tokens", "4096", "--quiet", "--overwrite"]
    # it would sit among the shards (validate refuses such a folder), or be replaced by one: refused, nothing touched
    before = {p.name: p.read_bytes() for p in out.glob("part-*.parquet")}
    r = run(*pack)
    assert (r.returncode, r.stderr) == (1, f"Error: output {str(out)!r} holds files named like packtool shards that "
                                           "no packtool run there lists ('part-00042-00000.parquet'); move them out of "
                                           "the folder, or choose another -o\n")
    assert {p.name: p.read_bytes() for p in out.glob("part-*.parquet")} == before
    (out / "part-00042-00000.parquet").rename(tmp_path / "kept.parquet")
    r = run(*pack)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "kept.parquet").read_bytes() == b"someone else's shard"
    assert (out / "README.txt").read_text() == "mine"
    assert run("validate", str(out)).returncode == 0
    manifest = json.loads((out / ".packtool" / "manifest.json").read_text())
    assert manifest["capacities"]["max_tokens"] == 4096
    assert sorted(s["file"] for s in manifest["shards"]) == own  # the same names, rewritten


def test_absolute_media_paths_under_the_root_are_recorded_relative_so_the_media_can_move(tmp_path):
    """Records naming their images by absolute path under --media-root (LLaVA JSON written on a
    cluster: ``/data/coco/x.jpg`` with ``--media-root /data``), or by ``file://`` URI, were recorded
    as written: once the media moved, ``pack --media-root NEW`` rejected every such row as
    ``path_outside_root`` ("pass the right media_root"), which no root could fix."""
    import pyarrow.parquet as pq
    from PIL import Image

    media, alias = tmp_path / "data", tmp_path / "mount"
    (media / "coco").mkdir(parents=True)
    for i, colour in enumerate([(200, 30, 30), (30, 200, 30), (30, 30, 200)]):
        Image.new("RGB", (64 + 8 * i, 48), colour).save(media / "coco" / f"{i}.png")
    alias.symlink_to(media)  # the same folder under another name, as a link or a mount gives it
    (tmp_path / "elsewhere.png").write_bytes((media / "coco" / "0.png").read_bytes())
    images = {"abs": f"{media}/coco/0.png", "uri": f"file://{media}/coco/1.png", "alias": f"{alias}/coco/2.png",
              "dots": f"{media}//coco/../coco/./0.png", "rel": "coco/1.png", "out": f"{tmp_path}/elsewhere.png"}
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": k, "image": v, "conversations": [
        {"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": f"Shape {k}."}]}) + "\n"
        for k, v in images.items()))
    tok = tmp_path / "tok"
    r = run("tokenize", str(src), "--media-root", str(alias), "-o", str(tok), "--quiet")
    assert r.returncode == 0, r.stderr
    rows = pq.read_table(next(tok.glob("part-*.parquet")), columns=["sample_id", "media"]).to_pylist()
    assert {row["sample_id"]: [m["path"] for m in row["media"]] for row in rows} == {
        "abs": ["coco/0.png"], "uri": ["coco/1.png"], "alias": ["coco/2.png"], "dots": ["coco/0.png"],
        "rel": ["coco/1.png"]}
    # outside the root: refused as before, naming the path as written
    [err] = [json.loads(line) for line in (tok / ".packtool" / "errors.jsonl").read_text().splitlines()]
    assert (err["sample_id"], err["reason"], err["message"]) == (
        "out", "path_outside_root", f"media path {images['out']!r} resolves outside --media-root {str(media.resolve())!r}")

    media.rename(tmp_path / "moved")  # another machine, a bucket mirror, a renamed mount
    for mode in ("reference", "embed"):
        out = tmp_path / mode
        r = run("pack", str(tok), "-o", str(out), "--media", mode, "--media-root", str(tmp_path / "moved"), "--json")
        assert r.returncode == 0, r.stderr
        summary = json.loads(r.stdout)
        assert (summary["samples_packed"], summary["rejected"]) == (5, 0), summary


@pytest.mark.slow  # two CLI processes at once
def test_ranks_started_together_plan_once(corpus, tmp_path):
    """Two ranks started at the same moment: one plans (under the plan lock) and the other
    reads the plan it stored; together they write what one rank writes."""
    src, sample = corpus
    out = tmp_path / "tok"
    base = [sys.executable, "-m", "packtool", "-v", "tokenize", str(src), "--media-root", str(sample), "-o", str(out),
            "--rows-per-shard", "8", "--quiet", "--world-size", "2"]
    procs = [subprocess.Popen([*base, "--rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    logs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    planned = ["planned 4 tokenize tasks from 1 inputs" in log for log in logs]
    stored = ["read the stored plan of 4 tokenize tasks" in log for log in logs]
    assert sorted(planned) == [False, True] and stored == [not p for p in planned], logs
    one = tmp_path / "one"
    r = run("tokenize", str(src), "--media-root", str(sample), "-o", str(one), "--rows-per-shard", "8", "--quiet")
    assert r.returncode == 0, r.stderr
    run("merge", str(out))  # whichever rank finished last wrote the manifest already; merging again changes nothing
    for name in ("manifest.json", "errors.jsonl"):
        assert (out / ".packtool" / name).read_bytes() == (one / ".packtool" / name).read_bytes()
