"""``packtool ARGS`` run inside the test process, answered as ``subprocess.run`` would answer it.

Starting ``python -m packtool`` costs a second of imports (numpy, pyarrow, numba, typer) before a
command does anything; most CLI tests are about what a command prints and writes, not about the
process boundary, and :func:`packtool` gives them the same :class:`subprocess.CompletedProcess`
(``returncode``, ``stdout``, ``stderr``) from ``packtool.cli.main`` in this process, through the
README runner's :func:`run_in_process` (docs/readme.py), which puts back everything process-wide a
command changes: the environment (``--storage-option`` writes it), the working directory, the
root logger (``-v`` configures it) and the warning filters.

What this cannot show stays with real subprocesses: the console-script entry point, signals and
kills, two commands running at once, and output that pool workers write to the process's file
descriptors rather than through ``sys``. A bug in a command (an exception other than a
``PacktoolError``) is raised here with its traceback, where a subprocess would print it and exit
1: a test cannot pass over one unseen.
"""

from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["packtool", "wait_for_group_exit"]

_spec = importlib.util.spec_from_file_location("_readme_runner", Path(__file__).resolve().parents[1] / "docs" / "readme.py")
_readme = sys.modules["_readme_runner"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(_readme)


def packtool(*args: str | Path, cwd: str | Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``packtool ARGS`` in this process; ``env`` replaces the environment for the command's
    duration (as ``subprocess.run(env=...)`` does), ``cwd`` is its working directory."""
    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    code = _readme.run_in_process(argv, cwd=cwd or os.getcwd(), env=dict(os.environ) if env is None else env,
                                  stdout=out, stderr=err)
    return subprocess.CompletedProcess(["packtool", *argv], code, out.getvalue(), err.getvalue())


def wait_for_group_exit(pgid: int, timeout_s: float = 30.0) -> None:
    """Until every process of a run stopped by a signal is gone (the workers of a driver ended by
    a signal stop within a second by themselves), so what a test does next races with none of them."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"processes of group {pgid} still run {timeout_s:.0f} s after the signal")
