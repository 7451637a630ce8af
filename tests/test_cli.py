"""The CLI as a user meets it: help with examples, exact result lines, clear errors, JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from clirun import packtool

from packtool.cli import app, main

COMMANDS = sorted(c.name or c.callback.__name__ for c in app.registered_commands)


def run(*args: str) -> subprocess.CompletedProcess:
    return packtool(*args)  # in this process (tests/clirun.py): what a command prints and writes


def test_top_level_help_shows_an_example(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "Example:" in out and "packtool tokenize" in out
    for name in ("tokenize", "pack", "stats"):
        assert name in out


def test_top_level_help_says_which_command_comes_first(capsys):
    assert main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Start with `tokenize` (raw corpus + media -> one row per sample), then `pack`" in out


def _help(*command: str, capsys) -> str:
    assert main([*command, "--help"]) == 0
    return " ".join(capsys.readouterr().out.split())  # help wraps at the terminal width


@pytest.mark.parametrize("command, shown", [
    ("tokenize", ["--template <chatml|qwen3-vl|llama3|molmo2|plain>", "--exif <apply|ignore>",
                  "--on-error <skip|fail>", "--executor <local|ray>",
                  "--format <auto|llava|qwen-vl|sharegpt|swift|molmo|cauldron>",
                  "--tokenizer <path|hf:ORG/NAME> Tokenizer (default: the embedded Qwen2/Qwen2.5 vocabulary; qwen3: "
                  "it with Qwen3's tool and think tokens (the default for --template qwen3-vl); or a tokenizer.json file, a model directory (its tokenizer.json and tokenizer_config.json), or "
                  "hf:ORG/NAME from the local Hugging Face cache (never downloaded)).",
                  "qwen2-vl, qwen2.5-vl, qwen3-vl, molmo2, llava-ov, internvl, or fixed:N",
                  "--reasoning-loss / --no-reasoning-loss", "--video-sampler <processor|qwen-vl-utils>"]),
    ("pack", ["--oversize <drop|truncate|alone|fail>", "--media <embed|reference>", "--on-error <skip|fail>",
              "--executor <local|ray>"]),
    ("sweep", ["--oversize <drop|truncate|alone>"]),
    ("inspect", ["--tokenizer <path|hf:ORG/NAME>"]),
])
def test_help_lists_the_choices_of_every_enumerated_option(command, shown, capsys):
    out = _help(command, capsys=capsys)
    for text in shown:
        assert text in out


def test_a_choice_outside_the_list_is_a_usage_error(tmp_path, demo_dirs):
    r = run("pack", str(demo_dirs["tokenized"]), "-o", str(tmp_path / "p"), "--oversize", "squeeze")
    assert r.returncode == 2 and "'squeeze' is not one of 'drop', 'truncate', 'alone', 'fail'" in r.stderr


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_help_shows_an_example(command, capsys):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert "Example:" in out and f"packtool {command}" in out


def test_tokenize_names_repeated_sample_ids_apart_within_a_task(tmp_path, demo_dirs):
    """Records sharing an id were stored under one name, which inspect, stats and errors.jsonl
    took for one sample; within a task (one input slice of --rows-per-shard rows) a repeat is
    stored as ID#d1, ID#d2, ..., counted in the manifest, and the summary says so."""
    sample = demo_dirs["sample"]
    lines = (sample / "data.jsonl").read_text().splitlines()[:5]
    records = [json.loads(line) for line in lines]
    for rec, rid in zip(records, ["a", "a", "b", "a", "c"], strict=True):
        rec["id"] = rid
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    tok = tmp_path / "tok"
    r = run("tokenize", str(src), "--media-root", str(sample), "-o", str(tok), "--quiet", "--rows-per-shard", "3")
    assert r.returncode == 0, r.stderr
    # tasks [a a b] and [a c]: one repeat within a task; the a of the second task is not compared
    assert r.stdout == (f"5 samples from 5 rows in 2 shards -> {tok}\n"
                        "warning: 1 sample is stored as NAME#d1 (#d2, ...): an earlier sample of the same task (input "
                        "slice) holds the name (a repeated id, or a split tree's ID#1, ID#2, ...), and a name stands for "
                        "one sample; give each record an id of its own\n")
    manifest = json.loads((tok / ".packtool" / "manifest.json").read_text())
    assert manifest["counts"]["repeated_ids"] == 1
    stored = [pq.read_table(tok / e["file"], columns=["sample_id"])["sample_id"].to_pylist() for e in manifest["shards"]]
    assert stored == [["a", "a#d1", "b"], ["a", "c"]]
    r = run("tokenize", str(src), "--media-root", str(sample), "-o", str(tmp_path / "json"), "--quiet", "--json")
    assert json.loads(r.stdout)["repeated_ids"] == 2
    one = json.loads((tmp_path / "json" / ".packtool" / "manifest.json").read_text())["shards"]
    assert pq.read_table(tmp_path / "json" / one[0]["file"])["sample_id"].to_pylist() == ["a", "a#d1", "b", "a#d2", "c"]
    r = run("tokenize", str(sample / "data.jsonl"), "--media-root", str(sample), "-o", str(tmp_path / "unique"),
            "--quiet", "--json")
    assert "repeated_ids" not in json.loads(r.stdout)


@pytest.mark.parametrize(("name", "text"), [("empty.jsonl", ""), ("blank.jsonl", "\n \n"), ("none.json", "[]")])
def test_tokenize_of_inputs_without_a_record_says_so(tmp_path, name, text):
    """An empty input (a failed export upstream, a wrong glob) printed '0 samples from 0 rows' and
    nothing else: in a pipeline the empty output passed on unnoticed. It still succeeds (an empty
    source can be legitimate), with a warning that names what to check."""
    src = tmp_path / name
    src.write_text(text)
    tok = tmp_path / "tok"
    r = run("tokenize", str(src), "-o", str(tok), "--quiet")
    assert (r.returncode, r.stderr) == (0, ""), r.stderr
    assert r.stdout == (f"0 samples from 0 rows in 0 shards -> {tok}\n"
                        "warning: the inputs hold no records (empty files, or an empty JSON list); check the paths "
                        "given, or that the step that writes them ran\n")
    r = run("tokenize", str(src), "-o", str(tmp_path / "json"), "--quiet", "--json")
    assert json.loads(r.stdout)["rows_in"] == 0 and "warning" not in r.stdout
    # packing it succeeds too, and says the output has nothing to train on (the reader refuses it)
    r = run("pack", str(tok), "-o", str(tmp_path / "packed"), "--quiet")
    assert (r.returncode, r.stderr) == (0, ""), r.stderr
    assert r.stdout == (f"0 samples in 0 packs, lower bound 0 -> {tmp_path / 'packed'}\n"
                        "warning: the tokenized input holds no samples, so there is nothing to train on; check the "
                        "tokenize run that wrote it (packtool stats TOKENIZED)\n")


def test_tokenize_with_a_wrong_media_root_says_so(tmp_path, demo_dirs):
    """Each missing file is a clear errors.jsonl line, but a run whose media are mostly missing
    (a wrong --media-root) ended in exit 0 with a rejected count: the summary now names the root.
    One missing file among many is a bad row, not a wrong root: no warning."""
    sample = demo_dirs["sample"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    tok = tmp_path / "tok"
    r = run("tokenize", str(sample / "data.jsonl"), "--media-root", str(elsewhere), "-o", str(tok), "--quiet")
    assert (r.returncode, r.stderr) == (0, ""), r.stderr
    c = json.loads((tok / ".packtool" / "manifest.json").read_text())["counts"]
    n = c["rejected_by_reason"]["missing_media"]
    assert n > c["rows_in"] / 2
    assert r.stdout.splitlines()[-1] == (f"warning: {n} of {c['rows_in']} rows name media not found under --media-root "
                                         f"{str(elsewhere.resolve())!r}: check that it is the folder the records' "
                                         "media paths are relative to")
    lines = (sample / "data.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    first["image"] = "images/gone.png"
    src = tmp_path / "one-missing.jsonl"
    src.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    r = run("tokenize", str(src), "--media-root", str(sample), "-o", str(tmp_path / "one"), "--quiet")
    assert "missing_media 1" in r.stdout and "warning" not in r.stdout


def test_tokenize_pack_stats_exact_output(tmp_path, demo_dirs):
    sample = demo_dirs["sample"]
    tok, packed = tmp_path / "tok", tmp_path / "packed"
    r = run("tokenize", str(sample / "data.jsonl"), "--media-root", str(sample), "-o", str(tok), "--quiet")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"30 samples from 30 rows in 1 shard -> {tok}\n"
    assert r.stderr == ""
    r = run("pack", str(tok), "-o", str(packed), "--max-tokens", "8192", "--quiet", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["samples_in"] == summary["samples_packed"] == 30
    assert summary["packs"] >= summary["lower_bound"] >= 1
    r = run("stats", str(packed), "--json")
    stats = json.loads(r.stdout)
    assert stats["packs"] == summary["packs"] and stats["samples"] == 30


def test_library_errors_become_one_line_and_exit_1(tmp_path):
    r = run("pack", str(tmp_path / "nope"), "-o", str(tmp_path / "out"))
    assert r.returncode == 1
    assert r.stdout == ""
    assert r.stderr.startswith("Error: ") and "manifest.json" in r.stderr
    assert "Traceback" not in r.stderr


def test_pack_without_output_is_a_usage_error(demo_dirs):
    """A missing -o is a bad command line (exit 2, as for tokenize), not a library error."""
    r = run("pack", str(demo_dirs["tokenized"]), "--max-tokens", "8192", "-q")
    assert _usage_error(r, "pack", "pack needs -o/--output (or --dry-run to only plan)"), r.stderr


def test_bad_flag_value_names_the_flag(tmp_path, demo_dirs):
    r = run("tokenize", str(demo_dirs["sample"] / "data.jsonl"), "-o", str(tmp_path / "t"), "--model", "nope")
    assert r.returncode == 2
    assert "unknown --model 'nope'" in r.stderr and "qwen2.5-vl" in r.stderr


def test_rerun_into_finished_output_with_other_config_is_refused(tmp_path, demo_dirs):
    out = tmp_path / "packed"
    assert run("pack", str(demo_dirs["tokenized"]), "-o", str(out), "--max-tokens", "8192", "-q").returncode == 0
    r = run("pack", str(demo_dirs["tokenized"]), "-o", str(out), "--max-tokens", "4096", "-q")
    assert r.returncode == 1
    assert "max_tokens: 8192 -> 4096" in r.stderr and "--overwrite" in r.stderr


def test_version():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.startswith("packtool ")


def _usage_error(r, command: str, message: str) -> bool:
    """Exit 2, nothing on stdout, click's usage lines and then exactly ``Error: message``."""
    return (r.returncode == 2 and r.stdout == "" and r.stderr.startswith(f"Usage: packtool {command} ")
            and r.stderr.endswith(f"\n\nError: {message}\n"))


@pytest.mark.parametrize(("args", "message"), [
    (["--max-pixels", "0"], "Invalid value for '--max-pixels': Input should be greater than or equal to 1"),
    (["--max-pixels", "-5"], "Invalid value for '--max-pixels': Input should be greater than or equal to 1"),
    (["--min-pixels", "99999999999999999999999"],
     "Invalid value for '--min-pixels': Input should be less than or equal to 2147483647"),
    (["--model", "molmo2", "--max-crops", "40000"],
     "Invalid value for '--max-crops': Input should be less than or equal to 256"),
    (["--model", "internvl", "--max-num", "1000"],
     "Invalid value for '--max-num': Input should be less than or equal to 256"),
    (["--model", "internvl", "--max-frames", "99999999999999999999"],
     "Invalid value for '--max-frames': Input should be less than or equal to 65536"),
    (["--max-tokens", "3000000000"], "Invalid value for '--max-tokens': Input should be less than or equal to 2147483647"),
], ids=["max-pixels-0", "max-pixels-negative", "min-pixels-huge", "max-crops", "max-num", "max-frames", "max-tokens"])
def test_a_tokenize_setting_out_of_bounds_is_a_usage_error_before_any_work(tmp_path, demo_dirs, args, message):
    out = tmp_path / "t"
    r = run("tokenize", str(demo_dirs["sample"] / "data.jsonl"), "-o", str(out), "-q", *args)
    assert _usage_error(r, "tokenize", message), r.stderr
    assert not out.exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "fixed:3000000000"], "--model 'fixed:3000000000': fixed:N takes N from 1 to 2,147,483,647 (the "
                                      "largest int32, the type of the shards' token, unit and size columns), e.g. "
                                      "fixed:576"),
    (["--min-pixels", "100000000", "--max-pixels", "10"],
     "--min-pixels 100000000 is above --max-pixels 10; give a pixel floor no larger than the cap"),
    (["--model", "nope"], "unknown --model 'nope'; choose one of: internvl, llava-ov, molmo2, qwen2-vl, qwen2.5-vl, "
                          "qwen3-vl, fixed:N"),
    (["--model", "fixed:0"], "--model 'fixed:0': fixed:N needs a positive N, e.g. fixed:576"),
    (["--max-crops", "4"], "--max-crops does not apply to --model qwen2.5-vl; it accepts: --fps, --max-frames, "
                           "--max-pixels, --min-pixels"),
    # a family's setting that no option sets (Molmo2's single_crop_col_tokens) is not offered
    (["--model", "molmo2", "--fps", "1"], "--fps does not apply to --model molmo2; it accepts: --max-crops, "
                                          "--max-frames"),
    (["--video-sampler", "qwen-vl-utils"], "--video-sampler does not apply to --model qwen2.5-vl: it counts videos "
                                           "as qwen-vl-utils samples and resizes them already; leave the flag out "
                                           "(it chooses the rule for --model qwen3-vl only)"),
    (["--model", "internvl", "--video-sampler", "processor"], "--video-sampler does not apply to --model internvl; "
                                                              "it accepts: --max-frames, --max-num"),
], ids=["fixed-huge", "min-above-max", "unknown-model", "fixed-zero", "setting-of-another-family",
        "only-options-offered", "sampler-of-qwen3-only", "sampler-elsewhere"])
def test_a_model_spec_or_pixel_pair_that_cannot_work_is_a_usage_error_before_any_work(tmp_path, demo_dirs, args,
                                                                                       message):
    """Like a value out of a flag's range: exit 2 with the usage lines, the message naming the
    choices or the fix, nothing written (``ConfigError`` from Python, tests/test_config.py)."""
    out = tmp_path / "t"
    r = run("tokenize", str(demo_dirs["sample"] / "data.jsonl"), "-o", str(out), "-q", *args)
    assert _usage_error(r, "tokenize", message), r.stderr
    assert not out.exists()


@pytest.mark.parametrize(("flag", "value", "bound"), [
    ("--max-vision-units", "99999999999999999999", "less than or equal to 2147483647"),
    ("--max-tokens", "2147483648", "less than or equal to 2147483647"),
    ("--text-weight", "99999999999999999999", "less than or equal to 2147483647"),
    ("--vision-weight", "99999999999999999999", "less than or equal to 2147483647"),
])
def test_pack_counts_beyond_int32_are_usage_errors(tmp_path, demo_dirs, flag, value, bound):
    r = run("pack", str(demo_dirs["tokenized"]), "-o", str(tmp_path / "p"), "-q", flag, value)
    assert _usage_error(r, "pack", f"Invalid value for '{flag}': Input should be {bound}"), r.stderr
    assert not (tmp_path / "p").exists()


SEED_WITHOUT_MIXTURE = ("--seed only applies to a mixture (--rates, --mixture FILE or several TOKENIZED inputs), where "
                        "it picks the down-sampled subsets; one tokenized directory is packed whole, with no random "
                        "choice: drop --seed, or give --rates to sample it")


@pytest.mark.parametrize("seed", ["5", "0"])
def test_pack_seed_without_a_mixture_is_a_usage_error(tmp_path, demo_dirs, seed):
    """Packing one tokenized directory has no randomness, so a --seed there would be silently
    ignored (a user expecting another shuffle or subset would get the same bytes): it is
    refused, naming the options that make a mixture, even when it is the default value."""
    r = run("pack", str(demo_dirs["tokenized"]), "-o", str(tmp_path / "p"), "-q", "--seed", seed)
    assert _usage_error(r, "pack", SEED_WITHOUT_MIXTURE), r.stderr
    assert not (tmp_path / "p").exists()


def test_pack_samples_per_task_without_a_mixture_is_a_usage_error(tmp_path, demo_dirs):
    """One tokenized directory is packed one task per tokenized shard, so --samples-per-task
    (a mixture's stream cut) would be ignored: it is refused, naming what sets the tasks there."""
    r = run("pack", str(demo_dirs["tokenized"]), "-o", str(tmp_path / "p"), "-q", "--samples-per-task", "6")
    assert _usage_error(r, "pack", "--samples-per-task only applies to a mixture (--rates, --mixture FILE or several "
                        "TOKENIZED inputs); one tokenized directory is packed one task per tokenized shard: drop "
                        "--samples-per-task, or re-run tokenize with another --rows-per-shard"), r.stderr
    assert not (tmp_path / "p").exists()


def test_pack_help_names_the_schema_versions_each_layout_writes(demo_dirs, capsys):
    from packtool.shards import read_manifest

    out = _help("pack", capsys=capsys)
    runs = read_manifest(demo_dirs["packed"], "packed")["schema_version"]
    full = read_manifest(demo_dirs["packed-full"], "packed")["schema_version"]
    assert (f"runs: placeholder runs stored once (schema v{runs}; packtool.reader expands them); "
            f"full: every token stored (schema v{full})") in out


def _no_output(tmp_path, state: str) -> tuple:
    """A directory that holds no finished packtool output, and what it is called in the message."""
    d = tmp_path / "out"
    if state == "missing":
        return d, "the directory does not exist"
    d.mkdir()
    if state == "empty":
        return d, "the directory is empty"
    (d / "notes.txt").write_text("x")
    return d, "nor any shard: it is not a packtool output"


@pytest.mark.parametrize("command", ["stats", "inspect", "validate"])
@pytest.mark.parametrize("state", ["missing", "empty", "unrelated"])
def test_a_directory_with_no_output_says_what_is_missing_and_what_makes_it(tmp_path, command, state):
    """stats, inspect and validate read a finished run's manifest; on a directory with none
    (missing, empty, other files) all three say what is missing and the command that writes
    one, as one ``Error:`` line and exit 1 (validate has nothing to check, so no report)."""
    d, what = _no_output(tmp_path, state)
    r = run(command, str(d))
    assert (r.returncode, r.stdout) == (1, ""), r.stdout
    assert r.stderr == (f"Error: no .packtool/manifest.json found in {str(d)!r} ({what}); run `packtool tokenize "
                        f"INPUT -o {d}` or `packtool pack TOKENIZED -o {d}` first\n")


@pytest.mark.parametrize("command", ["stats", "inspect", "validate"])
def test_a_file_of_an_output_names_the_directory_to_pass(demo_dirs, command):
    """A shard (or the manifest) of a finished output passed instead of its directory: the
    message names the directory. It had said to run ``packtool pack ... -o`` onto the shard."""
    packed = demo_dirs["packed"]
    for f in (next(packed.glob("part-*.parquet")), packed / ".packtool" / "manifest.json"):
        r = run(command, str(f))
        assert (r.returncode, r.stdout) == (1, ""), r.stdout
        assert r.stderr == (f"Error: {str(f)!r} is a file of the output directory {str(packed)!r}; pass the "
                            "directory (its shards are read through the manifest beside them)\n")
    from packtool.errors import NoOutputError
    from packtool.reader import PackedDataset

    with pytest.raises(NoOutputError, match="is a file of the output directory"):
        PackedDataset(next(packed.glob("part-*.parquet")))


@pytest.mark.parametrize("command", ["stats", "inspect", "validate"])
def test_shards_without_their_manifest_are_named_as_such(tmp_path, demo_dirs, command):
    """Shards copied without the hidden ``.packtool/`` folder (``cp *.parquet``) are not an
    empty directory: the message says the manifest was left behind and how to bring it."""
    import shutil

    d = tmp_path / "copy"
    d.mkdir()
    for f in demo_dirs["packed"].glob("part-*.parquet"):
        shutil.copy(f, d / f.name)
    n = len(list(d.iterdir()))
    r = run(command, str(d))
    message = (f"no .packtool/manifest.json found in {str(d)!r}, though it holds {n} shard file(s): shards are read "
               "only through the manifest written beside them (were they copied without the hidden .packtool "
               "folder?); copy .packtool/ along with them, or re-run the command that wrote them")
    if command == "validate":  # a damaged output: the finding of a report
        assert r.returncode == 1 and message in r.stdout, r.stdout
    else:
        assert (r.returncode, r.stdout, r.stderr) == (1, "", f"Error: {message}\n")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("args", [["stats", "{packed}", "--json"], ["validate", "{packed}"]])
def test_a_full_disk_under_stdout_is_one_error_line_not_a_traceback(demo_dirs, args):
    """`packtool stats packed --json > stats.json` on a full disk printed a Python traceback
    (OSError from click's echo); the README lists a full disk among the problems shown as one
    `Error:` line with exit 1."""
    argv = [a.format(packed=demo_dirs["packed"]) for a in args]
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "packtool", *argv], stdout=full, stderr=subprocess.PIPE, text=True,
                           timeout=120)
    assert (r.returncode, r.stderr) == (1, "Error: cannot write to standard output: No space left on device; the "
                                           "output was not (wholly) printed: free space where stdout goes, or send it "
                                           "elsewhere, and run the command again\n")
