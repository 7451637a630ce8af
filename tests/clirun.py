"""``packtool ARGS`` run inside the test process, answered as ``subprocess.run`` would answer it.

Starting ``python -m packtool`` costs a second of imports (numpy, pyarrow, numba, typer) before a
command does anything; most CLI tests are about what a command prints and writes, not about the
process boundary, and :func:`packtool` gives them the same :class:`subprocess.CompletedProcess`
(``returncode``, ``stdout``, ``stderr``) from ``packtool.cli.main`` in this process. The
process-wide state a command may change is put back afterwards: the environment (``--storage-option``
writes it), the working directory, and the root logger (``-v`` configures it).

What this cannot show stays with real subprocesses: the console-script entry point, signals and
kills, two commands running at once, ``-v`` log lines (the test run owns the root logger), and
output that pool workers write to the process's file descriptors rather than through ``sys``.
A bug in a command (an exception other than a ``PacktoolError``) is raised here with its
traceback, where a subprocess would print it and exit 1: a test cannot pass over one unseen.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
from pathlib import Path

__all__ = ["packtool"]


def packtool(*args: str | Path, cwd: str | Path | None = None, env: dict[str, str] | None = None,
             timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run ``packtool ARGS`` in this process; ``env`` replaces the environment for the command's
    duration (as ``subprocess.run(env=...)`` does), ``cwd`` is its working directory. ``timeout``
    is accepted for symmetry with ``subprocess.run`` and ignored."""
    from packtool.cli import main

    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    root = logging.getLogger()
    saved_log = (root.level, list(root.handlers))
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        root.setLevel(saved_log[0])
        root.handlers[:] = saved_log[1]
    return subprocess.CompletedProcess(["packtool", *argv], code, out.getvalue(), err.getvalue())
