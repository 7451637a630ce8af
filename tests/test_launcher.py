"""Ctrl-C at any moment of a command, the first second (imports) and the exit included: one line
and exit code 130, never a traceback.

Each interrupt lands at a moment the child names: a finder at the front of ``sys.meta_path``
stops the child at the import of one module (or in an exit handler), says ``ready`` on stdout
and waits for a line on stdin; the test sends SIGINT there, then the line. No timing is involved:
the same moment every run.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from packtool.launcher import EXIT_INTERRUPT, EXIT_TERMINATED, INTERRUPTED, TERMINATED

ROOT = Path(__file__).resolve().parents[1]

#: The child: ``PAUSE`` (a module name, or ``"exit"``) is where it waits; then the command line
#: runs as ``python -m packtool`` runs it, or as the console script does (``ENTRY``).
CHILD = """\
import atexit, sys

PAUSE, ENTRY, ARGS = sys.argv[1], sys.argv[2], sys.argv[3:]


def wait():
    print("ready", flush=True)
    sys.stdin.readline()


class Pause:
    def find_spec(self, name, path=None, target=None):
        if name == PAUSE:
            sys.meta_path.remove(self)
            wait()
        return None


if PAUSE == "exit":
    atexit.register(wait)  # runs once the command has returned, as the interpreter exits
else:
    sys.meta_path.insert(0, Pause())
sys.argv = ["packtool", *ARGS]
if ENTRY == "-m":
    import runpy

    runpy.run_module("packtool", run_name="__main__", alter_sys=True)
else:  # what the console script's wrapper does
    from packtool.launcher import run

    sys.exit(run())
"""


def interrupted_at(pause: str, entry: str, tmp_path: Path, ignored: bool = False,
                   signum: int = signal.SIGINT) -> subprocess.CompletedProcess:
    """``packtool stats MISSING`` stopped at ``pause``, sent ``signum`` there and let go; ``ignored``:
    started with it ignored, as a background job of a script is."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, pause, entry, "stats", str(tmp_path / "none")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            preexec_fn=(lambda: signal.signal(signum, signal.SIG_IGN)) if ignored else None)
    try:
        assert proc.stdout.readline() == "ready\n", proc.stderr.read() if proc.poll() is not None else "no ready"
        proc.send_signal(signum)
        out, err = proc.communicate("go\n", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# numpy: the package's first heavy import; typer and pyarrow: the command line's; packtool.pipeline:
# a stage, half a second in; exit: after the command's own error, as the interpreter shuts down
@pytest.mark.parametrize(("pause", "entry"), [("numpy", "-m"), ("typer", "-m"), ("pyarrow", "-m"),
                                              ("packtool.pipeline", "-m"), ("typer", "script"), ("exit", "-m")])
def test_ctrl_c_while_the_command_line_loads_or_exits_is_one_line_and_130(pause, entry, tmp_path):
    """Ctrl-C in the first second of a command (Python importing numpy, pyarrow, typer and the
    stages) printed a KeyboardInterrupt traceback and left a killed process's status; later it
    printed one line and exited 130. Now it is that line and 130 at each of these moments, and
    after the command returned (its own result printed first)."""
    r = interrupted_at(pause, entry, tmp_path)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == EXIT_INTERRUPT, (r.returncode, r.stderr)
    before = "Error: no .packtool/manifest.json found" if pause == "exit" else ""
    assert r.stderr.startswith(before) and r.stderr.endswith(f"Error: {INTERRUPTED}\n"), r.stderr
    assert r.stderr.count("\n") == (2 if before else 1), r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize(("pause", "entry"), [("numpy", "-m"), ("packtool.pipeline", "-m"), ("typer", "script"),
                                              ("exit", "-m")])
def test_sigterm_while_the_command_line_loads_or_exits_is_one_line_and_143(pause, entry, tmp_path):
    """A scheduler's SIGTERM in the first second of a command (a job array started and cancelled
    at once), or as it exits, ended the process by the signal: no line, and ``-15`` to a Python
    caller where the command gives ``Error: terminated ...`` and 143 once it runs."""
    r = interrupted_at(pause, entry, tmp_path, signum=signal.SIGTERM)
    assert r.returncode == EXIT_TERMINATED, (r.returncode, r.stderr)
    before = "Error: no .packtool/manifest.json found" if pause == "exit" else ""
    assert r.stderr.startswith(before) and r.stderr.endswith(f"Error: {TERMINATED}\n"), r.stderr
    assert r.stderr.count("\n") == (2 if before else 1), r.stderr
    assert r.stdout == ""


def test_sigterm_ignored_from_the_start_stays_ignored(tmp_path):
    r = interrupted_at("typer", "-m", tmp_path, ignored=True, signum=signal.SIGTERM)
    assert r.returncode == 1 and r.stderr.startswith("Error: no .packtool/manifest.json found"), r.stderr


def test_ctrl_c_ignored_from_the_start_stays_ignored(tmp_path):
    """A command started with SIGINT ignored (``cmd &`` in a script, ``nohup``) is not ended by
    one: it runs to its own result."""
    r = interrupted_at("typer", "-m", tmp_path, ignored=True)
    assert r.returncode == 1 and r.stderr.startswith("Error: no .packtool/manifest.json found"), r.stderr


def test_the_command_never_loads_pandas(demo_dirs):
    """pyarrow imports pandas (where installed, as here) at its first conversion of a Python list;
    the command has it take pandas as absent: the same output, without a fifth of a second of import."""
    code = ("import atexit, sys\n"
            "atexit.register(lambda: print('pandas loaded:', 'pandas' in sys.modules, file=sys.stderr))\n"
            f"sys.argv = ['packtool', 'stats', {str(demo_dirs['packed'])!r}, '--json']\n"
            "from packtool.launcher import run\n"
            "run()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "pandas loaded: False" in proc.stderr
    # the library called in this process (pandas not kept away) prints the same report
    from packtool.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["stats", str(demo_dirs["packed"]), "--json"]) == 0
    assert json.loads(proc.stdout) == json.loads(buf.getvalue())


@pytest.mark.parametrize(("args", "expected"), [
    (["tokenize", "data.jsonl", "-o", "out"], ("packtool.preload.tokenization", "local", None)),
    (["-v", "pack", "tok", "-o", "out", "--workers", "3"], ("packtool.preload.packing", "local", 3)),
    (["pack", "tok", "--workers=1", "-o", "out"], ("packtool.preload.packing", "local", 1)),
    (["tokenize", "in", "--executor", "ray", "--workers", "2"], ("packtool.preload.tokenization", "ray", 2)),
    (["stats", "packed"], None),
    (["inspect", "packed", "--workers", "2"], None),
    (["--version"], None),
    (["tokenize", "--help"], None),
    (["pack", "tok", "-o", "out", "-h"], None),
    (["--storage-option", "endpoint_url=http://127.0.0.1:9", "tokenize", "s3://b/in", "-o", "s3://b/out"], None),
    (["tokenize", "in", "--workers", "many"], "raises"),
])
def test_the_launcher_starts_a_stage_pool_only_where_its_arguments_ask_for_one(monkeypatch, args, expected):
    """``tokenize`` and ``pack`` start their pool's forkserver before the command line loads; what
    the launcher reads of the arguments is what decides whether a pool runs (start_pool itself
    returns at once for one worker or Ray). Help, a bucket run and anything it cannot read are
    left to the stage (and a value that is not a number raises, which run() ignores)."""
    import packtool.executors as executors
    from packtool.launcher import _start_pool_early

    calls = []
    monkeypatch.setattr(executors, "start_pool", lambda ex, preload: calls.append((preload, ex.executor, ex.workers)))
    if expected == "raises":
        with pytest.raises(ValueError):
            _start_pool_early(args)
        assert calls == []
        return
    _start_pool_early(args)
    assert calls == ([] if expected is None else [expected])


POOL_AHEAD = """\
import sys

seen = {}


class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "packtool.cli":  # the command line starts loading: is the forkserver up already?
            from multiprocessing import forkserver

            seen["forkserver"] = forkserver._forkserver._forkserver_pid
            sys.meta_path.remove(self)
        return None


sys.meta_path.insert(0, Watch())
sys.argv = ["packtool", *sys.argv[1:]]
from packtool.launcher import run

try:
    run()
finally:
    print("forkserver before the command line:", seen.get("forkserver") is not None, file=sys.stderr)
"""


@pytest.mark.parametrize("workers", ["2", "1"])
def test_tokenize_starts_its_workers_forkserver_before_the_command_line_loads(workers, tmp_path):
    """The forkserver of a pool (``--workers 2``) is running before ``packtool.cli`` is imported,
    so its preload overlaps the command line's loading; the run is the same as ever. With one
    worker (in-process) none is started."""
    sample = ROOT / "examples" / "sample"
    out = tmp_path / "tok"
    proc = subprocess.run([sys.executable, "-c", POOL_AHEAD, "tokenize", str(sample / "data.jsonl"), "--media-root",
                           str(sample), "-o", str(out), "--rows-per-shard", "4", "--workers", workers, "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"forkserver before the command line: {workers == '2'}" in proc.stderr, proc.stderr
    result = json.loads(proc.stdout)
    manifest = json.loads((out / ".packtool" / "manifest.json").read_text())
    assert result["samples"] == manifest["counts"]["samples"] > 0
    assert result["tasks"] == manifest["counts"]["tasks"] > 1  # several tasks: the pool ran them


@pytest.mark.parametrize("closed", ["stdout", "stderr"])
def test_a_command_started_with_a_closed_stream_exits_without_a_traceback(closed):
    """Started with stdout closed (`packtool --version >&-`, a daemon's or cron's closed descriptor)
    Python has no ``sys.stdout``; the launcher's last flush called ``None.flush()`` and ended the
    command with an AttributeError traceback and exit 1."""
    fd = 1 if closed == "stdout" else 2
    r = subprocess.run([sys.executable, "-m", "packtool", "--version"], capture_output=True, text=True, timeout=60,
                       preexec_fn=lambda: os.close(fd))
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
