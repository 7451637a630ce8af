"""The ``packtool`` command's entry point, for ``python -m packtool`` and the console script.

Starting the command line imports numpy, pyarrow, typer and the stages: most of a second, in
which Python's own Ctrl-C handler raises ``KeyboardInterrupt`` wherever that import happens to
be, with nothing there to catch it: a traceback, where a Ctrl-C a moment later prints one line.
:func:`run` imports only the standard library before it makes Ctrl-C (:func:`hold`) end the
process on the spot with that same line and exit code (``Error: interrupted ...``, 130): before
the command has started nothing is written, so nothing needs cleaning up. Once
:func:`packtool.cli.main` can catch ``KeyboardInterrupt`` itself it gives Ctrl-C back to
Python (:func:`release`), and the run stops as it always did; when ``main`` has returned,
:func:`run` holds Ctrl-C again for the interpreter's shutdown. Between the two, ``tokenize`` and
``pack`` start their worker pool's forkserver (:func:`_start_pool_early`), so that its preload
overlaps the command line's loading.

SIGTERM (a scheduler stopping the job) is held the same way, with ``Error: terminated ...``
and 143, the line and code the command gives once it runs.

A Ctrl-C ignored when the process starts (a background job of a script, ``nohup``) stays
ignored. ``import packtool`` loads nothing heavy, so what comes before :func:`run` is the
interpreter's own start (its ``site`` and ``.pth`` imports, some tens of milliseconds), which
no package can reach.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

__all__ = ["run", "hold", "release", "INTERRUPTED", "EXIT_INTERRUPT", "TERMINATED", "EXIT_TERMINATED"]

#: What an interrupted command prints; a stage's finished tasks keep their markers, so the same command resumes.
INTERRUPTED = "interrupted; finished tasks are kept: re-run the same command to resume"
#: Exit code of an interrupted command (128 + SIGINT, as a shell reports it).
EXIT_INTERRUPT = 130
#: What a command stopped by SIGTERM (Slurm, Kubernetes) prints; as after Ctrl-C, the same command resumes.
TERMINATED = "terminated (SIGTERM); finished tasks are kept: re-run the same command to resume"
#: Exit code of a command stopped by SIGTERM (128 + SIGTERM, as a shell reports it).
EXIT_TERMINATED = 143


def _exit_interrupted(signum: int, frame: object) -> None:
    """Ctrl-C outside the command: the line and code of an interrupt, at once. ``os._exit``, not
    an exception: an exception raised here could land in an import half done or in a finalizer
    (which prints it and goes on), and nothing buffered is lost (stdout holds nothing before the
    command, and :func:`run` flushes it after)."""
    os.write(2, f"Error: {INTERRUPTED}\n".encode())
    os._exit(EXIT_INTERRUPT)


def _exit_terminated(signum: int, frame: object) -> None:
    """SIGTERM outside the command (a scheduler stopping a job in its first second, or as it
    exits): the line and code the command gives, at once, as :func:`_exit_interrupted` does. The
    default ended the process silently, killed by the signal (``-15`` to a Python caller)."""
    os.write(2, f"Error: {TERMINATED}\n".encode())
    os._exit(EXIT_TERMINATED)


def hold() -> None:
    """Make Ctrl-C end the process with ``Error: interrupted ...`` and exit code 130, and SIGTERM
    with ``Error: terminated ...`` and 143, unless the process does not take the default for it
    (an ignored SIGINT or SIGTERM stays ignored)."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _exit_interrupted)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_terminated)


def release() -> None:
    """Give Ctrl-C back to Python (``KeyboardInterrupt``), and SIGTERM its default, where
    :func:`hold` took them; else nothing."""
    if signal.getsignal(signal.SIGINT) is _exit_interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGTERM) is _exit_terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


#: The commands whose process pool :func:`_start_pool_early` starts, and their pool's preload
#: (``pipeline``'s ``_TOKENIZATION`` / ``_PACKING``).
POOL_PRELOADS = {"tokenize": "packtool.preload.tokenization", "pack": "packtool.preload.packing"}


def _start_pool_early(args: list[str]) -> None:
    """Start the forkserver of ``tokenize``'s or ``pack``'s worker pool before the command line
    loads, where the arguments ask for a local pool (``--workers`` above 1, or left to the cores).

    The stage starts it too (``executors.start_pool``), but only once the command line has
    loaded and parsed its arguments, about 0.4 s into the process on a small machine, and its
    workers then wait for the forkserver's own imports and preload (another 0.6 s for the
    vocabulary, more for pack's kernels): started here, the two overlap. The stage's call then
    finds it running. Only the flags that decide whether a pool runs are read (``--workers``,
    ``--executor``), as the command line would read them; anything unusual (``--help``, a
    bucket's ``--storage-option``, a value that is not a number) leaves the start to the stage,
    and so does any error here. A command that then fails on its arguments has started a
    forkserver for nothing, which ends as soon as the command has (its preload watches its
    driver: :func:`packtool.preload.warm`).
    """
    command, rest = None, []
    for i, arg in enumerate(args):
        if arg in ("-h", "--help", "--") or arg.startswith("--storage-option"):
            return
        if not arg.startswith("-"):
            command, rest = arg, args[i + 1:]
            break
    preload = POOL_PRELOADS.get(command)
    if preload is None:
        return
    options: dict[str, str] = {}
    for i, arg in enumerate(rest):
        if arg in ("-h", "--help", "--"):
            return
        name, eq, value = arg.partition("=")
        if name in ("--workers", "--executor"):
            options[name] = value if eq else (rest[i + 1] if i + 1 < len(rest) else "")
    from .executors import ExecutorConfig, start_pool

    workers = options.get("--workers")
    start_pool(ExecutorConfig(executor=options.get("--executor", "local"), workers=None if workers is None else int(workers)),
               preload)


def run() -> None:
    """Run the command line on ``sys.argv`` and exit with its code, Ctrl-C handled throughout."""
    hold()
    with contextlib.suppress(Exception):  # an optimization only: the stage starts its pool anyway
        _start_pool_early(sys.argv[1:])
    from .cli import main
    from .preload import arrow_without_pandas

    arrow_without_pandas()  # the command never needs pandas: about a fifth of a short command's time
    code = main()
    for stream in (sys.stdout, sys.stderr):  # what the command printed, before a Ctrl-C could cut it off
        if stream is None:  # started with the descriptor closed (`>&-`): Python has no stream to flush
            continue
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: as before, the exit reports it
            stream.flush()
    hold()
    sys.exit(code)
