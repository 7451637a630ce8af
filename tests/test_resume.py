"""Resume: a re-run skips finished tasks and gives the bytes of an uninterrupted run;
a re-run with other settings is refused, naming what differs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.corpus import make_corpus  # noqa: E402
from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset  # noqa: E402
from packtool.errors import InputError, OutputError, ResumeMismatchError  # noqa: E402
from packtool.shards import STATE_DIR  # noqa: E402


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    make_corpus(root, 400, seed=5)
    return root


def tcfg(corpus: Path, **kw) -> TokenizeConfig:
    return TokenizeConfig(media_root=str(corpus), rows_per_shard=100, **kw)


PCFG = PackConfig(max_tokens=4096, media="reference", packs_per_shard=25)


def files(d: Path) -> dict:
    """Every file's bytes; the manifest decoded, without the tokenized directory's own path."""
    out: dict = {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}
    out.update({f".packtool/{p.name}": p.read_bytes() for p in (d / ".packtool").glob("*.jsonl")})
    manifest = json.loads((d / ".packtool" / "manifest.json").read_bytes())
    manifest.get("source", {}).pop("path", None)
    out[".packtool/manifest.json"] = manifest
    return out


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref")
    tokenize_dataset([corpus / "data.jsonl"], out / "tok", tcfg(corpus), workers=1)
    pack_dataset(out / "tok", out / "packed", PCFG, workers=1)
    return out


def interrupt(d: Path, task: int) -> None:
    """Make ``d`` look like a run killed while task ``task`` was writing: no manifest, no
    errors.jsonl, the task's marker gone and a half-written temporary shard."""
    (d / ".packtool" / "manifest.json").unlink()
    (d / ".packtool" / "errors.jsonl").unlink()
    (d / STATE_DIR / f"task-{task:05d}.json").unlink()
    (d / f".part-{task:05d}-00000.parquet.tmp").write_bytes(b"PAR1 half a shard")


@pytest.mark.jit
@pytest.mark.parametrize("stage", ["tok", "packed"])
def test_resume_skips_finished_tasks_and_matches_an_uninterrupted_run(corpus, reference, tmp_path, stage):
    tokenize_dataset([corpus / "data.jsonl"], tmp_path / "tok", tcfg(corpus), workers=1)
    pack_dataset(tmp_path / "tok", tmp_path / "packed", PCFG, workers=1)
    d = tmp_path / stage
    interrupt(d, 2)
    kept = {p.name: p.stat().st_mtime_ns for p in d.glob("part-0000[013]-*.parquet")}
    assert kept
    if stage == "tok":
        m = tokenize_dataset([corpus / "data.jsonl"], d, tcfg(corpus), workers=2)
    else:
        m = pack_dataset(tmp_path / "tok", d, PCFG, workers=2)
    assert {p.name: p.stat().st_mtime_ns for p in d.glob("part-0000[013]-*.parquet")} == kept, "finished tasks were redone"
    assert not list(d.glob(".*.tmp")), "the half-written shard was not cleaned up"
    assert files(d) == files(reference / stage)
    assert m["counts"]["tasks"] == 4


@pytest.mark.jit
def test_a_finished_task_whose_files_vanish_while_the_run_goes_on_is_an_error_not_a_crash(corpus, reference, tmp_path):
    """Files of a task the run had finished removed while it ran on (a cleanup job, the output
    deleted under a running job): the run's end found a task of its own unmarked and raised an
    internal error, a traceback. It is an ``Error:`` naming the task, and the same call resumes."""
    out = tmp_path / "tok"
    marker = out / STATE_DIR / "task-00000.json"

    def progress(n: int) -> None:  # called in this process as tasks report, the first task done by then
        marker.unlink(missing_ok=True)

    with pytest.raises(OutputError, match=r"the files of 1 of the 4 tasks this run finished are gone .*\(first: \[0\]\)"
                       r".* run the same command again"):
        tokenize_dataset([corpus / "data.jsonl"], out, tcfg(corpus), progress=progress, workers=1)
    assert not marker.exists() and (out / STATE_DIR / "task-00003.json").is_file()
    tokenize_dataset([corpus / "data.jsonl"], out, tcfg(corpus), workers=1)
    assert files(out) == files(reference / "tok")


def test_an_input_rewritten_while_the_run_reads_it_is_refused_not_read_as_one_input(corpus, tmp_path):
    """An input file written again while tokenize ran (an upstream job): tasks after the change
    read the new file at the old file's byte offsets, the run finished with exit 0, rows lost or
    cut mid-line (``bad_json``), under a manifest recording the old file. A task refuses an input
    that is not as the run found it; the same command is refused too, and --overwrite starts over."""
    src = tmp_path / "data.jsonl"
    src.write_bytes((corpus / "data.jsonl").read_bytes())
    lines = src.read_bytes().splitlines(keepends=True)
    out = tmp_path / "tok"

    def progress(n: int) -> None:  # in this process, as tasks report: the input changes after task 0
        if (out / STATE_DIR / "task-00000.json").is_file() and src.read_bytes().splitlines(keepends=True) == lines:
            src.write_bytes(b"".join(lines[::-1]))  # the same bytes in another order: only the mtime says so
            st = src.stat()
            os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))

    with pytest.raises(InputError, match=r"input '.*data\.jsonl' changed while the run read it \(size or modification "
                                         r"time\); .* pass --overwrite"):
        tokenize_dataset([src], out, tcfg(corpus), progress=progress, workers=1)
    assert not (out / STATE_DIR / "manifest.json").exists()
    with pytest.raises(ResumeMismatchError, match="input files changed since the first attempt"):
        tokenize_dataset([src], out, tcfg(corpus), workers=1)
    manifest = tokenize_dataset([src], out, tcfg(corpus), workers=1, overwrite=True)
    assert (manifest["counts"]["rows_in"], manifest["counts"]["rejected"]) == (400, 0)


def test_clear_tasks_removes_what_clear_task_removes_from_one_listing(tmp_path):
    """The driver clears every task it is about to run from one listing of the folder (a task
    listing it itself made a run's task starts quadratic in its tasks); what it removes must be
    what clear_task, task by task, removed: each task's shards, temporaries, log and marker."""
    import shutil

    from packtool.shards import clear_task, clear_tasks

    def lay(d: Path) -> None:
        (d / STATE_DIR).mkdir(parents=True)
        for t in (1, 2, 3, 123456):
            p = f"part-{t:05d}"
            for name in (f"{p}-00000.parquet", f"{p}-00001.parquet", f".{p}-00002.parquet.77@host.tmp"):
                (d / name).write_bytes(b"x")
            for name in (f"errors-{t:05d}.jsonl", f"task-{t:05d}.json", f".errors-{t:05d}.jsonl.9@h.tmp",
                         f".task-{t:05d}.json.9@h.tmp"):
                (d / STATE_DIR / name).write_bytes(b"x")
        for name in ("run.json", "plan.json", "errors.jsonl", "manifest.json", "rank-0.lock"):
            (d / STATE_DIR / name).write_bytes(b"x")
        (d / "notes.txt").write_bytes(b"x")

    def left(d: Path) -> set[str]:
        return {str(f.relative_to(d)) for f in d.rglob("*") if f.is_file()}

    one, each = tmp_path / "one", tmp_path / "each"
    lay(one)
    shutil.copytree(one, each)
    clear_tasks(one, {1, 123456})
    for t in (1, 123456):
        clear_task(each, t)
    assert left(one) == left(each)
    names = [Path(n).name.lstrip(".") for n in left(one)]
    for t in ("00001", "123456"):
        assert not [n for n in names if n.startswith((f"part-{t}-", f"errors-{t}.", f"task-{t}."))], t
    for t in ("00002", "00003"):
        assert len([n for n in names if n.startswith((f"part-{t}-", f"errors-{t}.", f"task-{t}."))]) == 7, t
    assert {"notes.txt", ".packtool/run.json", ".packtool/errors.jsonl"} <= left(one)


def test_overwrite_knows_the_files_of_tasks_past_99999_as_the_runs_own(tmp_path):
    """``--overwrite`` removes what the run wrote and nothing else: the shards of every task it
    planned and their temporaries, also for a task index of six digits (a run of more than
    99,999 tasks), whose names once fell outside every pattern and stayed behind."""
    from packtool.shards import _own_files

    d = tmp_path / "out"
    (d / STATE_DIR).mkdir(parents=True)
    (d / STATE_DIR / "run.json").write_text(json.dumps({"n_tasks": 123457}))
    own = ["part-00007-00000.parquet", "part-123456-00000.parquet", "part-123456-00012.parquet",
           ".part-123456-00001.parquet.77@host.tmp", ".manifest.json.5.tmp"]
    other = ["part-123457-00000.parquet", "part-0123456-00000.parquet", "part-12345-1.parquet", "notes.txt",
             ".part-123456-00001.parquet.tmp"]
    for name in own + other:
        (d / name).write_bytes(b"x")
    assert _own_files(d) == set(own)


def test_a_task_does_not_list_the_output_folder_itself(corpus, tmp_path, monkeypatch):
    """A run of many tasks: the driver clears earlier attempts' files once; a task of a local run
    clears nothing itself (its start no longer lists the folder, whose entries grow as it runs)."""
    import packtool.pipeline as pipeline

    calls = []
    monkeypatch.setattr(pipeline, "clear_task", lambda out, t: calls.append(t))
    out = tmp_path / "tok"
    m = tokenize_dataset([corpus / "data.jsonl"], out, tcfg(corpus), workers=1)
    assert m["counts"]["tasks"] == 4 and calls == []
    m = pack_dataset(out, tmp_path / "packed", PCFG, workers=1)
    assert m["counts"]["tasks"] == 4 and calls == []


def test_finished_run_is_not_redone(corpus, reference, tmp_path):
    tokenize_dataset([corpus / "data.jsonl"], tmp_path / "tok", tcfg(corpus), workers=1)
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "tok").iterdir()}
    m = tokenize_dataset([corpus / "data.jsonl"], tmp_path / "tok", tcfg(corpus), workers=1)
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "tok").iterdir()} == before
    assert m == json.loads((reference / "tok" / ".packtool" / "manifest.json").read_text())


def _tokenizer_file(path: Path, vocab_size: int) -> None:
    """A small real BPE vocabulary with what ChatML and Qwen2.5-VL place by id; another
    ``vocab_size`` gives other ids for the same text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>", "<|video_pad|>"]
    text = ["What is in the picture?", "A red circle on a white background.", "the image shows"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))


def test_a_tokenizer_file_changed_in_place_is_not_resumed_nor_taken_as_done(corpus, tmp_path):
    """The setting names the file; its vocabulary is in the run's set-up: a run resumed (or found
    finished) after the file changed would hold two vocabularies' ids under one manifest."""
    vocab = tmp_path / "tokenizer.json"
    _tokenizer_file(vocab, 290)
    out = tmp_path / "tok"
    cfg = tcfg(corpus, tokenizer=str(vocab))
    tokenize_dataset([corpus / "data.jsonl"], out, cfg, workers=1)
    _tokenizer_file(vocab, 330)  # the same path, another vocabulary
    with pytest.raises(ResumeMismatchError, match=r"finished run with a different configuration \(tokenizer\.vocab_sha256: "):
        tokenize_dataset([corpus / "data.jsonl"], out, cfg, workers=1)
    interrupt(out, 2)  # now an unfinished run with tasks done
    with pytest.raises(ResumeMismatchError, match=r"unfinished run with other settings \(tokenizer\.vocab_sha256: "):
        tokenize_dataset([corpus / "data.jsonl"], out, cfg, workers=1)
    m = tokenize_dataset([corpus / "data.jsonl"], out, cfg, workers=1, overwrite=True)
    fresh = tokenize_dataset([corpus / "data.jsonl"], tmp_path / "fresh", cfg, workers=1)
    assert m["tokenizer"] == fresh["tokenizer"] and m["shards"] == fresh["shards"]


def test_a_tokenizer_config_changed_beside_an_unchanged_vocabulary_is_not_resumed(corpus, tmp_path):
    """A model directory's special-token ids come from its tokenizer_config.json, which the
    vocabulary's fingerprint (tokenizer.json) does not cover: a run resumed after only the config
    changed held two sets of special-token ids. The run's state records both files' digests."""
    model = tmp_path / "model"
    model.mkdir()
    _tokenizer_file(model / "tokenizer.json", 290)
    out = tmp_path / "tok"
    cfg = tcfg(corpus, tokenizer=str(model))
    tokenize_dataset([corpus / "data.jsonl"], out, cfg, workers=1)
    (model / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {}, "eos_token": "<|im_end|>"}))
    with pytest.raises(ResumeMismatchError, match=r"finished run with a different configuration \(tokenizer_config\.json: "
                                                  r"sha256 none \(no such file\) -> [0-9a-f]{12}…\)"):
        tokenize_dataset([corpus / "data.jsonl"], out, cfg, workers=1)
    interrupt(out, 2)
    with pytest.raises(ResumeMismatchError, match=r"unfinished run with other settings \(tokenizer_config\.json: "):
        tokenize_dataset([corpus / "data.jsonl"], out, cfg, workers=1)
    # a run of an earlier packtool recorded no digests: compared by what it did record, as before
    state = json.loads((out / STATE_DIR / "run.json").read_text())
    del state["tokenizer_files"]
    (out / STATE_DIR / "run.json").write_text(json.dumps(state))
    tokenize_dataset([corpus / "data.jsonl"], out, cfg, workers=1)  # resumed


def test_a_run_made_before_models_got_their_own_template_names_the_flag_that_resumes_it(corpus, tmp_path):
    """A qwen3-vl run an earlier packtool made without --template holds chatml; the same command
    now means the qwen3-vl template, so the refusal names --template chatml."""
    out = tmp_path / "tok"
    tokenize_dataset([corpus / "data.jsonl"], out, tcfg(corpus, model="qwen3-vl", template="chatml"), workers=1)
    interrupt(out, 2)
    with pytest.raises(ResumeMismatchError, match=r"\(template: 'chatml' -> 'qwen3-vl'\) \(without --template a model "
                                                  r"now gets its own; pass --template chatml to resume the run as it was\)"):
        tokenize_dataset([corpus / "data.jsonl"], out, tcfg(corpus, model="qwen3-vl"), workers=1)
    tokenize_dataset([corpus / "data.jsonl"], out, tcfg(corpus, model="qwen3-vl", template="chatml"), workers=1)


def test_other_config_is_refused_naming_the_setting(corpus, tmp_path):
    out = tmp_path / "tok"
    tokenize_dataset([corpus / "data.jsonl"], out, tcfg(corpus), workers=1)
    with pytest.raises(ResumeMismatchError, match=r"finished run with a different configuration \(model: 'qwen2.5-vl' -> 'qwen2-vl'\)"):
        tokenize_dataset([corpus / "data.jsonl"], out, tcfg(corpus, model="qwen2-vl"), workers=1)
    (out / ".packtool" / "manifest.json").unlink()  # now an unfinished run
    with pytest.raises(ResumeMismatchError, match=r"unfinished run with other settings \(model: 'qwen2.5-vl' -> 'qwen2-vl'\)"):
        tokenize_dataset([corpus / "data.jsonl"], out, tcfg(corpus, model="qwen2-vl"), workers=1)
    m = tokenize_dataset([corpus / "data.jsonl"], out, tcfg(corpus, model="qwen2-vl"), workers=1, overwrite=True)
    assert m["config"]["model"] == "qwen2-vl"
    assert json.loads((out / STATE_DIR / "run.json").read_text())["config"]["model"] == "qwen2-vl"


def test_max_errors_is_not_part_of_the_config(corpus, tmp_path):
    out = tmp_path / "tok"
    a = tokenize_dataset([corpus / "data.jsonl"], out, tcfg(corpus), workers=1)
    b = tokenize_dataset([corpus / "data.jsonl"], out, tcfg(corpus, max_errors=5), workers=1)
    assert a == b


def test_other_world_size_is_refused(corpus, tmp_path):
    out = tmp_path / "tok"
    part = tokenize_dataset([corpus / "data.jsonl"], out, tcfg(corpus), rank=0, world_size=2, workers=1)
    assert part["partial"] and part["tasks"] == 2
    with pytest.raises(ResumeMismatchError, match=r"world_size: 2 -> 3"):
        tokenize_dataset([corpus / "data.jsonl"], out, tcfg(corpus), rank=0, world_size=3, workers=1)
    done = tokenize_dataset([corpus / "data.jsonl"], out, tcfg(corpus), rank=1, world_size=2, workers=1)
    assert done["counts"]["rows_in"] == 400 and "partial" not in done


def test_a_rank_of_other_settings_does_not_replace_a_running_rank_that_finished_no_task_yet(corpus, tmp_path):
    """Rank 1 started with another --model while rank 0 was on its first task took rank 0's run
    for a failed start, wiped it and went on; rank 0's tasks were lost to the merge."""
    import subprocess

    out = tmp_path / "tok"
    tokenize_dataset([corpus / "data.jsonl"], out, tcfg(corpus), rank=0, world_size=2, workers=1)
    for marker in (out / STATE_DIR).glob("task-*.json"):  # rank 0 as it is while on its first task
        marker.unlink()
    hold = ("import fcntl, json, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); "
            "os.ftruncate(fd, 0); os.pwrite(fd, json.dumps({'pid': os.getpid(), 'host': 'node7'}).encode(), 0); "
            "print('held', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(out / STATE_DIR / "rank-00000.lock")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(ResumeMismatchError, match=rf"unfinished run with other settings \(model: 'qwen2.5-vl' -> "
                                                      rf"'qwen2-vl'\); its rank 0 is running now \(pid {holder.pid} on node7\)"):
            tokenize_dataset([corpus / "data.jsonl"], out, tcfg(corpus, model="qwen2-vl"), rank=1, world_size=2, workers=1)
        assert json.loads((out / STATE_DIR / "run.json").read_text())["config"]["model"] == "qwen2.5-vl"
    finally:
        holder.communicate("")
    # rank 0 gone without finishing a task: a failed start, replaced as before
    part = tokenize_dataset([corpus / "data.jsonl"], out, tcfg(corpus, model="qwen2-vl"), rank=1, world_size=2, workers=1)
    assert part["partial"] and json.loads((out / STATE_DIR / "run.json").read_text())["config"]["model"] == "qwen2-vl"


def test_changed_input_is_refused(corpus, tmp_path):
    src = tmp_path / "data.jsonl"
    src.write_bytes((corpus / "data.jsonl").read_bytes())
    out = tmp_path / "tok"
    tokenize_dataset([src], out, tcfg(corpus), rank=0, world_size=2, workers=1)
    with open(src, "a") as fh:
        fh.write(src.read_text().splitlines()[0] + "\n")
    with pytest.raises(ResumeMismatchError, match="input files changed since the first attempt"):
        tokenize_dataset([src], out, tcfg(corpus), rank=1, world_size=2, workers=1)


@pytest.mark.jit
def test_pack_refuses_a_changed_tokenized_input(corpus, tmp_path):
    tokenize_dataset([corpus / "data.jsonl"], tmp_path / "tok", tcfg(corpus), workers=1)
    pack_dataset(tmp_path / "tok", tmp_path / "packed", PCFG, rank=0, world_size=2, workers=1)
    tokenize_dataset([corpus / "data.jsonl"], tmp_path / "tok", tcfg(corpus, system_prompt="Be brief."), workers=1,
                     overwrite=True)
    with pytest.raises(ResumeMismatchError, match="source_digest"):
        pack_dataset(tmp_path / "tok", tmp_path / "packed", PCFG, rank=1, world_size=2, workers=1)


def test_max_errors_holds_for_the_whole_run_across_ranks(corpus, tmp_path):
    from packtool.errors import TooManyErrorsError

    src = tmp_path / "in.jsonl"
    lines = (corpus / "data.jsonl").read_text().splitlines()
    lines[10] = lines[150] = "{broken"  # one bad line in task 0 (rank 0), one in task 1 (rank 1)
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "tok"
    part = tokenize_dataset([src], out, tcfg(corpus, max_errors=1), rank=0, world_size=2, workers=1)
    assert part["partial"] and part["counts"]["rejected"] == 1
    with pytest.raises(TooManyErrorsError, match=r"2 input rows rejected, more than --max-errors 1"):
        tokenize_dataset([src], out, tcfg(corpus, max_errors=1), rank=1, world_size=2, workers=1)
    assert not (out / ".packtool" / "manifest.json").exists() and not (out / ".packtool" / "errors.jsonl").exists()
    m = tokenize_dataset([src], out, tcfg(corpus, max_errors=2), rank=1, world_size=2, workers=1)
    assert m["counts"]["rejected_by_reason"] == {"bad_json": 2}


@pytest.mark.jit
def test_a_finished_run_is_held_to_the_error_limits_of_the_command_that_finds_it(corpus, tmp_path):
    """A CI gate (``--max-errors 0``, ``--on-error fail``) passed when the output held a finished
    run already: the run was returned as done, its rejected rows never compared with the limit
    that fails the same command on an empty -o (or on an unfinished run of the same settings)."""
    from packtool.errors import TooManyErrorsError

    src = tmp_path / "in.jsonl"
    lines = (corpus / "data.jsonl").read_text().splitlines()
    lines[10] = lines[150] = "{broken"
    src.write_text("\n".join(lines) + "\n")
    tok = tmp_path / "tok"
    first = tokenize_dataset([src], tok, tcfg(corpus), workers=1)
    assert first["counts"]["rejected"] == 2
    with pytest.raises(TooManyErrorsError, match=r"^2 input rows rejected, more than --max-errors 1 \(see .*errors\.jsonl\)"):
        tokenize_dataset([src], tok, tcfg(corpus, max_errors=1), workers=1)
    with pytest.raises(TooManyErrorsError, match=r"--on-error fail"):
        tokenize_dataset([src], tok, tcfg(corpus), workers=1, on_error="fail")
    assert tokenize_dataset([src], tok, tcfg(corpus, max_errors=2), workers=1) == first  # within the limit: as it was
    # an unfinished run resumed under --on-error fail: the rows its finished tasks rejected count too
    (tok / STATE_DIR / "manifest.json").unlink()
    (tok / STATE_DIR / "task-00003.json").unlink()
    with pytest.raises(TooManyErrorsError, match=r"--on-error fail"):
        tokenize_dataset([src], tok, tcfg(corpus), workers=1, on_error="fail")
    assert tokenize_dataset([src], tok, tcfg(corpus), workers=1) == first
    # pack: an oversize sample dropped is a rejected row
    cfg = PackConfig(max_tokens=1200, media="reference")
    packed = pack_dataset(tok, tmp_path / "packed", cfg, workers=1)
    n = packed["counts"]["rejected"]
    assert n > 0
    with pytest.raises(TooManyErrorsError, match=rf"^{n:,} input rows rejected, more than --max-errors 0"):
        pack_dataset(tok, tmp_path / "packed", cfg, workers=1, max_errors=0)
    assert pack_dataset(tok, tmp_path / "packed", cfg, workers=1, max_errors=n) == packed


@pytest.mark.jit
def test_a_dry_run_fails_where_the_run_would_on_its_error_limits(corpus, tmp_path):
    """``pack --dry-run --max-errors 0`` planned and exited 0 where the same pack without
    ``--dry-run`` fails, while ``--oversize fail`` did fail a dry run: a check before a costly
    run said it would pass."""
    from packtool import Mixture
    from packtool.errors import TooManyErrorsError

    tok = tmp_path / "tok"
    tokenize_dataset([corpus / "data.jsonl"], tok, tcfg(corpus), workers=1)
    cfg = PackConfig(max_tokens=1200, media="reference")
    dry = pack_dataset(tok, tmp_path / "unused", cfg, dry_run=True, workers=1)
    n = dry["counts"]["rejected"]
    assert n > 0 and dry["counts"]["rejected_by_reason"] == {"oversize": n}
    with pytest.raises(TooManyErrorsError, match=rf"^{n:,} input rows would be rejected, more than --max-errors 5 "):
        pack_dataset(tok, tmp_path / "unused", cfg, dry_run=True, workers=1, max_errors=5)
    with pytest.raises(TooManyErrorsError, match=r"--on-error fail"):
        pack_dataset(tok, tmp_path / "unused", cfg, dry_run=True, workers=1, on_error="fail")
    assert pack_dataset(tok, tmp_path / "unused", cfg, dry_run=True, workers=1, max_errors=n)["counts"] == dry["counts"]
    mix = Mixture.from_rates([tok], "0.5")
    with pytest.raises(TooManyErrorsError, match=r"input rows would be rejected, more than --max-errors 0 "):
        pack_dataset(mix, tmp_path / "unused", cfg, dry_run=True, workers=1, max_errors=0)
    assert not (tmp_path / "unused").exists()
    with pytest.raises(TooManyErrorsError, match=r"input rows rejected, more than --max-errors 5 "):
        pack_dataset(tok, tmp_path / "packed", cfg, workers=1, max_errors=5)


_REMOVED: list[str] | None = None  # paths removed while a test listens (None: not listening)


def _listen_removals(event: str, args: tuple) -> None:
    if _REMOVED is not None and event == "os.remove":
        _REMOVED.append(os.fspath(args[0]))


def test_overwrite_removes_the_manifest_before_the_shards_it_names(corpus, tmp_path):
    """``--overwrite`` removed a finished run's shards first and its manifest last, so a run
    killed while replacing another left a manifest naming shards that were gone (a reader, or
    the next command, met "listed in the manifest but missing"), where a bucket's output drops
    the manifest first."""
    global _REMOVED
    out = tmp_path / "tok"
    tokenize_dataset([corpus / "data.jsonl"], out, tcfg(corpus), workers=1)
    sys.addaudithook(_listen_removals)
    _REMOVED = []
    try:
        tokenize_dataset([corpus / "data.jsonl"], out, tcfg(corpus, model="qwen2-vl"), workers=1, overwrite=True)
        removed = [Path(p).relative_to(out).as_posix() for p in _REMOVED if Path(p).is_relative_to(out)]
    finally:
        _REMOVED = None
    shards = [i for i, p in enumerate(removed) if p.startswith("part-")]
    assert len(shards) == 4 and removed.index(".packtool/manifest.json") < min(shards), removed


def damage(d: Path, how: str, name: str) -> None:
    """Lose one shard of a finished output (``missing``) or cut it short (``cut``)."""
    shard = d / name
    if how == "missing":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:1000])


@pytest.mark.jit
@pytest.mark.parametrize("how", ["missing", "cut"])
@pytest.mark.parametrize("stage", ["tok", "packed"])
def test_a_finished_run_that_lost_a_shard_is_repaired_by_the_same_command(corpus, reference, tmp_path, caplog, stage,
                                                                           how):
    """A finished output that lost a shard (deleted, or cut short by a copy) was returned as
    finished by the same command, even with --overwrite: "already holds this run", the shard
    still gone, and nothing but deleting the whole output would redo it. Now the command redoes
    the task that wrote the shard, keeps the other tasks' files, says so in one line and gives
    the bytes of a clean run."""
    tokenize_dataset([corpus / "data.jsonl"], tmp_path / "tok", tcfg(corpus), workers=1)
    pack_dataset(tmp_path / "tok", tmp_path / "packed", PCFG, workers=1)
    d = tmp_path / stage
    name = "part-00002-00001.parquet" if stage == "packed" else "part-00002-00000.parquet"
    assert (d / name).is_file()
    listed = json.loads((d / STATE_DIR / "manifest.json").read_text())
    size = next(s["bytes"] for s in listed["shards"] if s["file"] == name)
    damage(d, how, name)
    kept = {p.name: p.stat().st_mtime_ns for p in d.glob("part-0000[013]-*.parquet")}
    assert kept
    caplog.set_level("WARNING", logger="packtool.shards")
    if stage == "tok":
        m = tokenize_dataset([corpus / "data.jsonl"], d, tcfg(corpus), workers=1)
    else:
        m = pack_dataset(tmp_path / "tok", d, PCFG, workers=1)
    what = "missing" if how == "missing" else f"1,000 bytes, listed {size:,}"
    assert [r.getMessage() for r in caplog.records] == [
        f"{d}: 1 of {len(listed['shards'])} shards of the finished run is missing or changed: {name} ({what}); "
        "redoing task 2, which wrote it, and keeping the rest"]
    assert {p.name: p.stat().st_mtime_ns for p in d.glob("part-0000[013]-*.parquet")} == kept, "other tasks were redone"
    assert files(d) == files(reference / stage)
    assert m == listed
    caplog.clear()  # repaired: the next run finds it whole and does nothing
    before = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}
    if stage == "tok":
        tokenize_dataset([corpus / "data.jsonl"], d, tcfg(corpus), workers=1)
    else:
        pack_dataset(tmp_path / "tok", d, PCFG, workers=1)
    assert {p.name: p.stat().st_mtime_ns for p in d.iterdir()} == before and not caplog.records
    # --overwrite starts it over: every shard written again, to the same bytes
    if stage == "tok":
        tokenize_dataset([corpus / "data.jsonl"], d, tcfg(corpus), workers=1, overwrite=True)
    else:
        pack_dataset(tmp_path / "tok", d, PCFG, workers=1, overwrite=True)
    assert all(p.stat().st_mtime_ns != before[p.name] for p in d.glob("part-*.parquet"))
    assert files(d) == files(reference / stage) and not caplog.records


def test_a_repair_cut_short_is_resumed_by_the_same_command(corpus, reference, tmp_path):
    """The manifest of a run being repaired is removed before the redone task removes its shards:
    a repair stopped half-way is an unfinished run, never a manifest naming files packtool removed."""
    out = tmp_path / "tok"
    tokenize_dataset([corpus / "data.jsonl"], out, tcfg(corpus), workers=1)
    (out / "part-00001-00000.parquet").unlink()
    stop = RuntimeError("stopped")

    def stopped(n: int) -> None:
        raise stop

    with pytest.raises(RuntimeError) as info:
        tokenize_dataset([corpus / "data.jsonl"], out, tcfg(corpus), workers=1, progress=stopped)
    assert info.value is stop
    assert not (out / STATE_DIR / "manifest.json").exists()
    tokenize_dataset([corpus / "data.jsonl"], out, tcfg(corpus), workers=1)
    assert files(out) == files(reference / "tok")


def test_a_damaged_run_of_shards_not_named_by_task_is_refused_unless_overwrite(corpus, reference, tmp_path):
    """Shards named ``part-NNNNN.parquet`` (a run of an older packtool) say no task: such a run is
    not repaired task by task; the message names the shard and the fix."""
    out = tmp_path / "tok"
    tokenize_dataset([corpus / "data.jsonl"], out, tcfg(corpus), workers=1)
    manifest = json.loads((out / STATE_DIR / "manifest.json").read_text())
    for i, entry in enumerate(manifest["shards"]):
        (out / entry["file"]).rename(out / f"part-{i:05d}.parquet")
        entry["file"] = f"part-{i:05d}.parquet"
    (out / STATE_DIR / "manifest.json").write_text(json.dumps(manifest))
    (out / "part-00003.parquet").unlink()
    with pytest.raises(ResumeMismatchError, match=r"finished run of these settings, but 1 listed shard is missing or "
                                                  r"changed: part-00003\.parquet \(missing\); .* pass --overwrite"):
        tokenize_dataset([corpus / "data.jsonl"], out, tcfg(corpus), workers=1)
    assert (out / "part-00000.parquet").is_file()
    tokenize_dataset([corpus / "data.jsonl"], out, tcfg(corpus), workers=1, overwrite=True)
    assert files(out) == files(reference / "tok")


@pytest.mark.parametrize("text", ['{"kind": "tokeni', "[]", '{"kind": "tokenized", "schema_version": 6}'])
def test_a_finished_run_whose_manifest_is_damaged_is_resumed_by_the_same_command(corpus, reference, tmp_path, caplog,
                                                                                  text):
    """validate says of a damaged manifest "re-run the command that wrote it"; that command said
    the output held a finished run "with a different configuration (kind: None -> tokenized; ...)"
    and wrote nothing. Now it resumes the run from its markers and writes the manifest again."""
    out = tmp_path / "tok"
    tokenize_dataset([corpus / "data.jsonl"], out, tcfg(corpus), workers=1)
    (out / STATE_DIR / "manifest.json").write_text(text)
    (out / "part-00003-00000.parquet").unlink()
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("part-0000[012]-*.parquet")}
    with pytest.raises(ResumeMismatchError, match=r"unfinished run with other settings \(model: 'qwen2.5-vl' -> "):
        tokenize_dataset([corpus / "data.jsonl"], out, tcfg(corpus, model="qwen2-vl"), workers=1)
    caplog.set_level("WARNING", logger="packtool.shards")
    tokenize_dataset([corpus / "data.jsonl"], out, tcfg(corpus), workers=1)
    assert [r.getMessage() for r in caplog.records] == [
        f"{out}: the manifest of its run is damaged; resuming the run from its completion markers (finished tasks are "
        "kept) to write it again"]
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("part-0000[012]-*.parquet")} == kept
    assert files(out) == files(reference / "tok")


@pytest.fixture(scope="module")
def rejecting(corpus, tmp_path_factory) -> tuple[Path, Path]:
    """The corpus with rejected rows in tasks 0, 1 and 3 (none in task 2), and a clean run of it."""
    lines = (corpus / "data.jsonl").read_text(encoding="utf-8").splitlines()
    lines[5] = '{"id": "cut'  # bad_json
    lines[150] = '{"id": "none", "conversations": []}'  # empty_conversation
    lines[320] = '{"id": "cut too'
    src = corpus / "rejecting.jsonl"
    src.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    ref = tmp_path_factory.mktemp("rejecting") / "tok"
    tokenize_dataset([src], ref, tcfg(corpus), workers=1)
    return src, ref


def mtimes(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in d.glob("part-*.parquet")}


@pytest.mark.parametrize("how", ["missing", "cut"])
def test_a_finished_run_whose_errors_file_was_lost_or_cut_writes_it_again(corpus, rejecting, tmp_path, caplog, how):
    """A finished output whose .packtool/errors.jsonl was deleted or cut short was returned as
    finished by the same command ("already holds this run"), the rejected rows still gone, and
    only validate said so. errors.jsonl is the tasks' error logs end to end: the command now
    writes it again from them (no task redone, no shard touched), says so in one line, and gives
    the bytes of a clean run; the manifest records its size, so a whole run costs one more stat."""
    from packtool.validate import validate_dir

    src, ref = rejecting
    d = tmp_path / "tok"
    listed = tokenize_dataset([src], d, tcfg(corpus), workers=1)
    errors = d / STATE_DIR / "errors.jsonl"
    size = errors.stat().st_size
    assert listed["counts"]["rejected"] == 3 and listed["errors_file"]["bytes"] == size > 0
    if how == "missing":
        errors.unlink()
    else:
        errors.write_bytes(errors.read_bytes()[:100])
    assert not validate_dir(d, check_rows=False)["ok"]
    kept = mtimes(d)
    caplog.set_level("WARNING", logger="packtool.shards")
    m = tokenize_dataset([src], d, tcfg(corpus), workers=1)
    what = "missing" if how == "missing" else f"100 bytes, listed {size:,}"
    assert [r.getMessage() for r in caplog.records] == [
        f"{d}: the finished run's .packtool/errors.jsonl is {what}; writing it again from the tasks' error logs (no "
        "task is redone)"]
    assert mtimes(d) == kept, "a task was redone"
    assert files(d) == files(ref) and m == listed
    assert validate_dir(d, check_rows=False)["ok"]
    caplog.clear()  # repaired: the next run finds it whole and does nothing
    def written() -> dict[str, int]:  # every file but the run lock, which each run takes
        return {p.name: p.stat().st_mtime_ns for p in [*d.iterdir(), *(d / STATE_DIR).iterdir()]
                if not p.name.endswith(".lock")}

    before = written()
    tokenize_dataset([src], d, tcfg(corpus), workers=1)
    assert written() == before
    assert not caplog.records


def test_a_lost_errors_file_whose_task_log_is_gone_too_redoes_that_task(corpus, rejecting, tmp_path, caplog):
    """When a task's own error log is gone as well, errors.jsonl cannot be made from the logs
    alone: that task (and only it) is redone, which writes its log again with the same bytes."""
    src, ref = rejecting
    d = tmp_path / "tok"
    tokenize_dataset([src], d, tcfg(corpus), workers=1)
    (d / STATE_DIR / "errors.jsonl").unlink()
    (d / STATE_DIR / "errors-00001.jsonl").unlink()
    kept = {k: v for k, v in mtimes(d).items() if not k.startswith("part-00001-")}
    caplog.set_level("WARNING", logger="packtool.shards")
    tokenize_dataset([src], d, tcfg(corpus), workers=1)
    assert [r.getMessage() for r in caplog.records] == [
        f"{d}: the finished run's .packtool/errors.jsonl is missing; redoing task 1, whose error log is missing or "
        "changed, and keeping the rest"]
    assert {k: v for k, v in mtimes(d).items() if not k.startswith("part-00001-")} == kept
    assert files(d) == files(ref)
    assert (d / STATE_DIR / "errors-00001.jsonl").read_bytes() == (ref / STATE_DIR / "errors-00001.jsonl").read_bytes()


@pytest.mark.jit
def test_a_packed_run_that_lost_its_errors_file_writes_it_again(corpus, reference, tmp_path, caplog):
    """The same for pack, whose errors.jsonl is empty here: a clean run writes the empty file, and so
    does the repair."""
    tokenize_dataset([corpus / "data.jsonl"], tmp_path / "tok", tcfg(corpus), workers=1)
    d = tmp_path / "packed"
    pack_dataset(tmp_path / "tok", d, PCFG, workers=1)
    (d / STATE_DIR / "errors.jsonl").unlink()
    caplog.set_level("WARNING", logger="packtool.shards")
    pack_dataset(tmp_path / "tok", d, PCFG, workers=1)
    assert len(caplog.records) == 1 and "errors.jsonl is missing; writing it again" in caplog.records[0].getMessage()
    assert files(d) == files(reference / "packed")


def test_a_merge_or_state_write_that_fails_leaves_no_temporary(rejecting, tmp_path, monkeypatch):
    """A disk that fills while merge writes errors.jsonl (or while a state file is written) failed
    with a clear message but left its temporary: the user was asked to free the space packtool
    itself held. The temporary goes with the failure; the same merge then writes the same bytes."""
    import errno
    import shutil

    import packtool.pipeline as pipeline
    import packtool.shards as shards
    from packtool.errors import OutputError
    from packtool.pipeline import merge_output

    _, ref = rejecting
    out = tmp_path / "tok"
    shutil.copytree(ref, out)
    whole = (out / ".packtool" / "errors.jsonl").read_bytes()
    (out / ".packtool" / "errors.jsonl").unlink()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(pipeline.shutil, "copyfileobj", full)
        with pytest.raises(OutputError, match="no space left writing to .*; free space on its disk"):
            merge_output(out)
    assert not [p.name for p in (out / ".packtool").iterdir() if p.name.endswith(".tmp")]
    with monkeypatch.context() as m:
        m.setattr(shards.os, "fsync", full)
        with pytest.raises(OSError, match="No space left"):
            shards.atomic_write_text(out / ".packtool" / "state.json", "{}")
    assert not [p.name for p in (out / ".packtool").iterdir() if p.name.endswith(".tmp")]
    assert not (out / ".packtool" / "state.json").exists()
    merge_output(out)
    assert (out / ".packtool" / "errors.jsonl").read_bytes() == whole
