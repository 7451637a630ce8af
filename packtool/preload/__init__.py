"""What a process pool's forkserver loads before it forks workers (``executors.run_tasks``'s
``preload``), one module per stage (``packing``: pack and mix; ``tokenization``); nothing else imports them
(the command line's launcher calls :func:`arrow_without_pandas` from this package).

Every pool worker is forked from its process's one forkserver, so whatever the forkserver
loaded, a worker starts with instead of loading again at its first task. Measured per worker
on a 2-vCPU machine: pack's compiled kernels about 0.8 s (importing numba, and its first load
from the cache setting up the compiler's registries), tokenize's vocabulary 0.35 s. (pandas, which
pyarrow would import at its first ``pa.array`` of a Python list, is not loaded at all: see
:func:`arrow_without_pandas`.)
A one-off run spends the same time once in the forkserver instead of once per worker in
parallel (the same wall time, less CPU); a process that starts pools of the same stage again
(a library caller, a notebook) no longer spends it at all: a second 4,000-sample pack on two
workers took 0.19 s instead of 1.55 s. The forkserver keeps the preload of the pool that
started it, so a later pool of the other stage loads its own part in its workers, as before.

A step that fails here is skipped: the worker meets the same failure where it can report it.

Ctrl-C reaches the forkserver with the rest of the terminal's process group. The forkserver
ignores it once its preload is done (the driver stops the run and says so), but not during
it, so an interrupt in the first seconds of a run with workers printed a ``KeyboardInterrupt``
traceback from the preload beside the driver's ``Error: interrupted``. This package ignores
the interrupt from the moment a forkserver imports it. Imported anywhere else (``pkgutil``
walking packtool imports every subpackage, as documentation tools do) it changes nothing: an
ignored SIGINT would also be inherited by every command that process starts.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

#: How the command line writes log records (``WARNING packtool.packer: ...``); a forkserver,
#: which has no handler of its own, says what it logs the same way (:func:`command_line_logging`).
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


def _forkserver_frame():
    """The frame of ``multiprocessing.forkserver.main`` this code runs under (its preload), or None."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "main" and frame.f_globals.get("__name__") == "multiprocessing.forkserver":
            return frame
        frame = frame.f_back
    return None


def _in_forkserver() -> bool:
    """Whether this import runs inside ``multiprocessing.forkserver.main`` (its preload)."""
    return _forkserver_frame() is not None


def _watch_driver() -> Callable[[], None]:
    """In a forkserver's preload, end the process as soon as the process that started it (its
    driver) has ended; return the call that stops watching. Outside a forkserver: nothing.

    The driver holds the write end of the forkserver's ``alive`` pipe (``alive_r`` of the
    forkserver's ``main``), which reads as closed once the driver is gone; a thread waits on it
    (and on a pipe of its own, written to stop it) while the preload runs. It is stopped and
    joined before the preload returns, so no thread of it is left when the forkserver forks its
    workers.
    """
    import select

    frame = _forkserver_frame()
    alive = None if frame is None else frame.f_locals.get("alive_r")
    if not isinstance(alive, int):
        return lambda: None
    stop_r, stop_w = os.pipe()
    poller = select.poll()  # not select(): it refuses a descriptor numbered 1024 or more
    poller.register(alive, select.POLLIN)
    poller.register(stop_r, select.POLLIN)

    def wait() -> None:
        while True:
            events = poller.poll()
            if any(fd == alive for fd, _ in events):
                os._exit(0)  # the driver is gone: nothing here is worth finishing
            if events:
                return

    thread = threading.Thread(target=wait, name="packtool-driver-watch", daemon=True)
    thread.start()

    def stop() -> None:
        os.write(stop_w, b"x")
        thread.join()
        os.close(stop_r)
        os.close(stop_w)

    return stop


if threading.current_thread() is threading.main_thread() and _in_forkserver():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def warm(*steps: Callable[[], object]) -> None:
    """Run each step, skipping any that raises (never stop the forkserver). A forkserver whose
    driver ends meanwhile exits at once (:func:`_watch_driver`), as its loop would right after
    the preload: the ``packtool`` command starts the forkserver before it parses its arguments
    (:mod:`packtool.launcher`), one that fails on them ends while the preload runs, and a caller
    reading the command's output through a pipe waits for every process holding it open, the
    forkserver too (pack's kernels: most of a second)."""
    stop = _watch_driver()
    try:
        for step in steps:
            try:
                step()
            except Exception:  # noqa: BLE001 - see the module docstring
                pass
    finally:
        stop()


class _PandasAbsent:
    """An import finder that reports pandas missing (see :func:`arrow_without_pandas`)."""

    @staticmethod
    def find_spec(name: str, path: object = None, target: object = None) -> None:
        if name == "pandas" or name.startswith("pandas."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def arrow_without_pandas() -> None:
    """Make pyarrow take pandas as not installed, for the rest of this process.

    pyarrow imports pandas, where it is installed, at its first conversion of a Python list
    (to check whether the list is a pandas object): 0.2-0.3 s on a small machine, more than a
    quarter of a forkserver's preload, and about a fifth of a short command such as ``packtool stats``.
    packtool never hands pyarrow a pandas object, so its own processes (a pool's forkserver and
    workers, the ``packtool`` command) let that first check find pandas absent, which pyarrow
    then remembers. A process that has imported pandas already (a notebook calling the library)
    is left alone, as is any library caller: only :mod:`packtool.launcher` and the preloads call this.
    """
    if "pandas" in sys.modules:
        return
    import pyarrow as pa

    sys.meta_path.insert(0, _PandasAbsent)
    try:
        pa.array([0])
    finally:
        sys.meta_path.remove(_PandasAbsent)


def command_line_logging() -> None:
    """Log warnings to stderr as the command line does, where nothing configured logging: in a
    forkserver, whose preload (pack's kernels, compiled on a machine's first pack) would
    otherwise print a bare line through logging's last-resort handler."""
    import logging

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT, stream=sys.stderr)
