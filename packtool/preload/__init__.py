"""What a process pool's forkserver loads before it forks workers (``executors.run_tasks``'s
``preload``), one module per stage (``packing``: pack and mix; ``tokenization``); nothing else imports them.

Every pool worker is forked from its process's one forkserver, so whatever the forkserver
loaded, a worker starts with instead of loading again at its first task. Measured per worker
on a 2-vCPU machine: pack's compiled kernels about 0.8 s (importing numba, and its first load
from the cache setting up the compiler's registries), pandas about 0.3 s where it is installed
(pyarrow imports it at the first ``pa.array`` of a Python list), tokenize's vocabulary 0.35 s.
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

import signal
import sys
import threading
from collections.abc import Callable


def _in_forkserver() -> bool:
    """Whether this import runs inside ``multiprocessing.forkserver.main`` (its preload)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "main" and frame.f_globals.get("__name__") == "multiprocessing.forkserver":
            return True
        frame = frame.f_back
    return False


if threading.current_thread() is threading.main_thread() and _in_forkserver():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def warm(*steps: Callable[[], object]) -> None:
    """Run each step, skipping any that raises (never stop the forkserver)."""
    for step in steps:
        try:
            step()
        except Exception:  # noqa: BLE001 - see the module docstring
            pass


def pandas_shim() -> None:
    """pyarrow's first conversion of a Python list, which imports pandas where installed."""
    import pyarrow as pa

    pa.array([0])
