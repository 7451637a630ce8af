"""How tasks run: in-process, a local process pool, or Ray (DESIGN.md §6).

A *task* is the unit of work of a stage: one input slice in, one set of output shards and
a completion marker out. The task function is a plain top-level function
``fn(task, report) -> dict``; ``report(n)`` tells the driver that ``n`` more samples are
done, so one progress bar can add up every worker. Every executor runs the very same
function, so the output never depends on which one ran it, or with how many workers::

    tasks (sorted, cut from the inputs)
      │  rank r of world_size w keeps tasks[r::w]
      ▼
    in-process ─┐
    pool (N)   ─┼─▶ fn(task, report) ─▶ shards + marker ─▶ result dict to the driver
    Ray tasks  ─┘

Results come back to ``on_result`` in completion order; callers that need a fixed order
(manifests) sort by task index. When a task raises, the remaining ones are cancelled and
the first error is re-raised in the driver.

On a Ray cluster (``ray_address``) tasks are spread over the nodes, one CPU each, and a task
whose worker or node dies is run again elsewhere (:data:`RAY_TASK_RETRIES`): a task clears
what an earlier attempt left and publishes through its completion marker, so the retry
writes the same bytes. A worker's working directory is its node's, so tasks open relative
paths against the driver's (``pipeline._at``); every node must see inputs, media and output
at the same paths (shared storage), or use bucket URLs. A worker's environment is also its
node's: the driver's ``--storage-option`` values and S3 variables travel with each task
(``storage.forwarded_env``). A local pool's workers get the driver's whole environment as
the pool starts (not the forkserver's, which is the driver's when its first pool started).
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .config import check_types
from .errors import ConfigError, PacktoolError

__all__ = ["ExecutorConfig", "run_tasks", "default_workers", "Reporter", "set_total", "worker_place",
           "RAY_TASK_RETRIES", "Terminated", "sigterm_as_interrupt"]

log = logging.getLogger(__name__)

#: Seconds between progress messages from one worker (fewer, larger updates are cheaper).
_REPORT_EVERY_S = 0.25


def default_workers() -> int:
    """The cores this process may use (``--workers`` default)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


#: What ``--executor ray`` says where Ray is not installed.
RAY_MISSING = "--executor ray needs Ray; run `pip install packtool[ray]`"


@dataclass(frozen=True, slots=True)
class ExecutorConfig:
    """Where and how widely the tasks of one stage run; none of this changes the output.

    Attributes:
        executor: ``local`` (in-process or a process pool) or ``ray``.
        workers: parallel tasks on this machine (``None``: every core; ``1``: in-process).
        ray_address: the Ray cluster to join (``None``: an already initialized Ray, else a
            local one started for this call).
        rank: which share of the tasks this process runs (Slurm/Kubernetes arrays).
        world_size: how many shares there are; task ``i`` belongs to rank ``i % world_size``.
    """

    executor: str = "local"
    workers: int | None = None
    ray_address: str | None = None
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        check_types(self)  # a rank read from the environment is a string
        if self.executor not in ("local", "ray"):
            raise ConfigError(f"--executor {self.executor!r}: choose local or ray")
        if self.workers is not None and self.workers < 1:
            raise ConfigError("--workers must be at least 1")
        if self.world_size < 1:
            raise ConfigError("--world-size must be at least 1")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"--rank {self.rank} is outside 0..{self.world_size - 1}; ranks count from 0 below --world-size")
        if self.ray_address is not None and self.executor != "ray":
            raise ConfigError("--ray-address needs --executor ray")
        if self.executor == "ray" and importlib.util.find_spec("ray") is None:  # found, not imported
            raise ConfigError(RAY_MISSING)

    def my_tasks(self, n_tasks: int) -> list[int]:
        """Task indices this rank runs: ``range(rank, n_tasks, world_size)``.

        Example:
            >>> ExecutorConfig(rank=1, world_size=3).my_tasks(8)
            [1, 4, 7]
        """
        return list(range(self.rank, n_tasks, self.world_size))


class Terminated(KeyboardInterrupt):
    """SIGTERM, under :func:`sigterm_as_interrupt`: a scheduler stopping the job (Slurm's
    ``scancel`` or time limit, a Kubernetes pod's eviction or preemption).

    A ``KeyboardInterrupt``, so a run stops as it does for Ctrl-C: every worker stopped,
    unfinished tasks' temporaries removed, finished tasks kept for the same command to resume.
    """


class _SigtermHandler:
    """The SIGTERM handler :func:`sigterm_as_interrupt` installs; ``received``: whether it fired."""

    def __init__(self) -> None:
        self.received = False

    def __call__(self, signum, frame) -> None:
        self.received = True
        # the first SIGTERM stops the run in order; a second one (or the scheduler's SIGKILL after
        # its grace period) ends the process at once
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Terminated


@contextmanager
def sigterm_as_interrupt() -> Iterator[_SigtermHandler]:
    """Within it, SIGTERM raises :class:`Terminated` in the main thread, as Ctrl-C raises
    ``KeyboardInterrupt``; the handler it yields says whether one arrived.

    SIGTERM's default ends the process on the spot: no message, the unfinished tasks'
    temporaries left behind, and a pool's semaphores reported leaked by multiprocessing's
    resource tracker. The command line runs every command inside this; a library caller
    keeps its own SIGTERM unless it does too. Outside the main thread (where no handler can
    be set) it changes nothing.
    """
    import threading

    handler = _SigtermHandler()
    if threading.current_thread() is not threading.main_thread():
        yield handler
        return
    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield handler
    finally:
        signal.signal(signal.SIGTERM, old)


def _interrupt(noted: list[int]) -> KeyboardInterrupt:
    """What a noted signal raises again: :class:`Terminated` for SIGTERM, else ``KeyboardInterrupt``."""
    return Terminated() if signal.SIGTERM in noted else KeyboardInterrupt()


class Reporter:
    """Adds up ``report(n)`` calls and forwards them at most every 0.25 s (and on ``flush``).

    ``interrupted``: the interrupts an in-process run noted (:func:`_interrupts_noted`); a report
    after one raises it again, should the code it arrived in have dropped it.
    """

    def __init__(self, sink: Callable[[int], None] | None, interrupted: list[int] | None = None) -> None:
        self.sink = sink
        self.interrupted = interrupted
        self.pending = 0
        self.total = 0  # every n reported, sent or not
        self.last = time.monotonic()

    def __call__(self, n: int) -> None:
        if self.interrupted:
            raise _interrupt(self.interrupted)
        self.pending += n
        self.total += n
        now = time.monotonic()
        if self.sink is not None and now - self.last >= _REPORT_EVERY_S:
            self.flush()

    def flush(self) -> None:
        if self.sink is not None and self.pending:
            self.sink(self.pending)
        self.pending = 0
        self.last = time.monotonic()


def set_total(progress: Callable | None, total: int | None) -> None:
    """Tell a progress sink how many samples to expect, when it can take it (``set_total``)."""
    setter = getattr(progress, "set_total", None)
    if setter is not None and total is not None:
        setter(total)


#: What a pool's forkserver imports when the caller names no stage (``run_tasks``'s ``preload``).
DEFAULT_PRELOAD = "packtool.pipeline"


def run_tasks(
    fn: Callable[[Any, Callable[[int], None]], dict],
    tasks: Sequence[Any],
    ex: ExecutorConfig,
    progress: Callable[[int], None] | None = None,
    on_result: Callable[[dict], None] | None = None,
    preload: str = DEFAULT_PRELOAD,
) -> list[dict]:
    """Run ``fn`` over ``tasks`` with the chosen executor; return the results in task order.

    ``tasks`` are the tasks *this* process should run (already filtered by rank and by
    completion markers). ``on_result`` is called in the driver as each task finishes.
    ``preload``: the module the process pool's forkserver imports when this process starts
    it (its first pool), so that every worker forked from it starts with what it loads
    (:mod:`packtool.preload`).
    """
    results: dict[int, dict] = {}

    def collect(i: int, res: dict) -> None:
        results[i] = res
        if on_result is not None:
            on_result(res)

    if not tasks:
        return []
    if ex.executor == "ray":
        _run_ray(fn, tasks, ex, progress, collect)
    else:
        workers = min(ex.workers or default_workers(), len(tasks))
        if workers <= 1:
            with _interrupts_noted() as interrupted:
                for i, task in enumerate(tasks):
                    rep = Reporter(progress, interrupted)
                    res = fn(task, rep)
                    if interrupted:
                        raise _interrupt(interrupted)
                    rep.flush()
                    collect(i, res)
        else:
            _run_pool(fn, tasks, workers, progress, collect, preload)
    return [results[i] for i in range(len(tasks))]


def start_pool(ex: ExecutorConfig, preload: str = DEFAULT_PRELOAD) -> None:
    """Start this process's forkserver now, if a run with ``ex`` will use a local process pool,
    so that its import of ``preload`` overlaps what the driver does before it runs tasks.

    A pool's first workers wait for the forkserver to import ``preload`` (packtool, pyarrow, a
    stage's kernels or vocabulary: most of a second on a small machine) while the other cores
    idle; the driver meanwhile does its own setup (imports, the tokenizer, the task plan), which
    is now spent in parallel. Nothing else changes: the pool then starts its workers from this
    forkserver as it would have started it itself. A run that ends up with one task (so no pool)
    leaves an idle forkserver, which exits with this process.
    """
    if ex.executor == "ray" or not sys.platform.startswith("linux") or (ex.workers or default_workers()) <= 1:
        return
    from multiprocessing import forkserver

    _context(preload)
    with _MainHidden(), _interrupt_held():
        forkserver.ensure_running()


def _own_handlers() -> dict[int, Any]:
    """The SIGINT and SIGTERM handlers in place that are packtool's to wrap: Python's Ctrl-C
    handler and :func:`sigterm_as_interrupt`'s (a caller's own, or the default, are left alone)."""
    handlers = {signal.SIGINT: signal.getsignal(signal.SIGINT), signal.SIGTERM: signal.getsignal(signal.SIGTERM)}
    return {signum: old for signum, old in handlers.items()
            if old is signal.default_int_handler or isinstance(old, _SigtermHandler)}


@contextmanager
def _interrupts_noted() -> Iterator[list[int]]:
    """Note each Ctrl-C (and SIGTERM, under :func:`sigterm_as_interrupt`) of an in-process run,
    and raise it as usual.

    Library code can drop the ``KeyboardInterrupt``: numba loads cached kernels through a ctypes
    callback, where an exception is printed and discarded, and a run interrupted in that second
    went on to the end and exited 0. The list this yields holds the signals seen, which
    :class:`Reporter` and the task loop raise again. Left alone where Python's own handler is
    not in place (another thread, or a caller's handler).
    """
    import threading

    noted: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield noted
        return
    handlers = _own_handlers()

    def note(signum, frame):
        noted.append(signum)
        handlers[signum](signum, frame)

    for signum in handlers:
        signal.signal(signum, note)
    try:
        yield noted
    finally:
        for signum, old in handlers.items():
            if signal.getsignal(signum) is note:  # a SIGTERM handler that fired left the default in place
                signal.signal(signum, old)


# ---------------------------------------------------------------- local process pool

_QUEUE: Any = None


def _pool_init(q, driver: int, env: dict[str, str], leave_term: bool = False) -> None:
    global _QUEUE
    _QUEUE = q
    # A worker is forked from the forkserver, whose environment is the driver's when that
    # started (its first pool), not now: credentials, endpoints or --storage-option values
    # set since would be missing, or stale ones used. The driver's, as this pool started:
    if dict(os.environ) != env:
        os.environ.clear()
        os.environ.update(env)
    # Workers leave the interrupt to the driver, which terminates the pool; SIGTERM too where the
    # driver stops on it (sigterm_as_interrupt): a scheduler sends it to every process of the job,
    # and a worker it ended first read as a crash ("a worker process died") instead.
    import threading

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if leave_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_with_driver, args=(driver,), daemon=True).start()


def _exit_with_driver(driver: int) -> None:
    """A worker whose driver was killed (kill -9, node lost) stops within a second instead
    of finishing its task unseen.

    Ended means ended, not reaped: a killed driver stays a zombie, still answering
    ``kill(pid, 0)``, until its parent reaps it, and ``subprocess.run(..., capture_output=True)``
    reaps only once the output pipes close, which these workers hold open. So the wait is on a
    pidfd (readable once the process ends), else on ``/proc``'s state, else on ``kill``.
    """
    import select

    try:
        fd = os.pidfd_open(driver)
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):  # not Linux, or a kernel before 5.3
        fd = None
    if fd is not None:
        poller = select.poll()  # not select(): it refuses a descriptor numbered 1024 or more
        poller.register(fd, select.POLLIN)
        while not poller.poll():
            pass
        os._exit(1)
    while True:
        time.sleep(1.0)
        if _ended(driver):
            os._exit(1)


def _ended(pid: int) -> bool:
    """Whether process ``pid`` has ended: gone, or a zombie waiting to be reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            # pid (comm) state ...: comm may hold spaces and parentheses, the state follows the last ")"
            return fh.read().rpartition(b")")[2].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def _pool_entry(fn, task, driver: int) -> tuple[dict, int]:
    if _ended(driver):  # the driver is gone: start nothing new
        os._exit(1)
    rep = Reporter(_QUEUE.put)
    try:
        res = fn(task, rep)
    except Exception as exc:
        if _round_trips(exc):
            raise
        # the pool pickles a task's exception to the driver; one that cannot be rebuilt there
        # would break the pool and read as a killed worker, so it travels as a RuntimeError
        # naming it (its traceback, chained, comes with it)
        raise RuntimeError(f"a task raised {type(exc).__name__}: {exc}") from exc
    rep.flush()
    # the total travels with the result: queue messages may still be in flight when it arrives
    return res, rep.total


def _round_trips(exc: BaseException) -> bool:
    """Whether ``exc`` survives the pickling a process pool puts a task's exception through."""
    import pickle

    try:
        back = pickle.loads(pickle.dumps(exc))
    except Exception:
        return False
    return type(back) is type(exc) and str(back) == str(exc)


def _drain(q, progress) -> int:
    got = 0
    while True:
        try:
            n = q.get_nowait()
        except (queue_mod.Empty, OSError, ValueError):
            return got
        got += n
        if progress is not None:
            progress(n)


def _context(preload: str):
    # fork would copy the driver's threads (Arrow's pool, tqdm's monitor) mid-state;
    # forkserver starts workers from a clean process that has imported packtool once. A
    # process has one forkserver, started by its first pool: that pool's ``preload`` is the
    # one it keeps (a later pool of another stage loads the rest in its workers, as before).
    if sys.platform.startswith("linux"):
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([preload])
        return ctx
    return mp.get_context("spawn")


class _MainHidden:
    """Start workers without re-running the caller's ``__main__``.

    Workers only need ``packtool``; hiding the main module while the pool starts means a
    plain script that calls the library at top level (no ``if __name__ == "__main__"``)
    does not get re-executed in every worker.
    """

    def __enter__(self) -> None:
        self.main = sys.modules.get("__main__")
        self.saved = {k: getattr(self.main, k) for k in ("__file__", "__spec__") if hasattr(self.main, k)}
        if self.main is not None:
            self.main.__spec__ = None
            if "__file__" in self.saved:
                del self.main.__file__

    def __exit__(self, *exc) -> None:
        for k, v in self.saved.items():
            setattr(self.main, k, v)


@contextmanager
def _interrupt_held() -> Iterator[None]:
    """Hold Ctrl-C (and SIGTERM, under :func:`sigterm_as_interrupt`) back while the pool starts
    its processes; it arrives when they are started.

    Ctrl-C reaches the whole process group. A process the pool was starting then printed a
    traceback beside the driver's ``Error: interrupted``: the forkserver while it imported
    its preload (before it ignores SIGINT), or a worker the interrupt caught between its fork
    and the pool's record of it, which was not stopped with the others and failed to unpickle
    its start data once the stopping driver had removed the queue's semaphore. Here the signals
    are blocked, so the processes started meanwhile inherit the block and never see them (CPython
    starts its resource tracker the same way), and the driver's handler only notes them (another
    thread of the driver may take the signal), to raise the first once every worker is recorded.
    """
    import threading

    if not hasattr(signal, "pthread_sigmask"):  # no signal masks (Windows): as before
        yield
        return
    caught: list[int] = []
    held = {signal.SIGINT}
    old: dict[int, Any] = {}
    # only the main thread sets handlers; a handler Python did not install (None) is left alone
    if threading.current_thread() is threading.main_thread():
        old = {signal.SIGINT: signal.getsignal(signal.SIGINT), signal.SIGTERM: signal.getsignal(signal.SIGTERM)}
        term = old[signal.SIGTERM]
        if not (isinstance(term, _SigtermHandler) or getattr(term, "defers", False)):  # the default stays: it ends the process
            del old[signal.SIGTERM]
        old = {signum: h for signum, h in old.items() if h is not None}
        held |= set(old)
        for signum in old:
            signal.signal(signum, lambda signum, frame: caught.append(signum))
    signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, held)
        for signum, h in old.items():
            signal.signal(signum, h)
        if caught:
            signal.raise_signal(caught[0])  # through the handler in place again: KeyboardInterrupt or Terminated


@contextmanager
def _signals_at_safe_points() -> Iterator[Callable[[], None]]:
    """Take Ctrl-C (and SIGTERM, under :func:`sigterm_as_interrupt`) where the driver calls the
    function this yields, not wherever the signal lands.

    The driver of a pool waits on its futures, reads the progress queue and shuts the pool down,
    all holding locks for moments (``concurrent.futures.wait`` takes every future's condition).
    Python raises a handler's exception between any two bytecodes: one raised after a lock was
    taken and before its ``with`` block began left it taken, and the pool's shutdown then waited
    forever for it (a job stopped by SIGTERM hung instead of exiting 143). Here the handler only
    notes the signal; the call raises it, through the handler that was in place (so a SIGTERM
    still arms the default for the next one), between the loop's steps. A SIGTERM that comes
    again before the first was raised ends the process at once, as a second SIGTERM always does.
    Signals noted after the last call are raised when the block ends without an exception. Left
    alone where Python's own handler is not in place (another thread, or a caller's handler).
    """
    import threading

    pending: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    handlers = _own_handlers()

    def note(signum, frame):
        if signum == signal.SIGTERM and signum in pending:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
        if signum not in pending:
            pending.append(signum)

    def safe_point() -> None:
        if pending:
            signum = pending.pop(0)
            handlers[signum](signum, None)  # raises KeyboardInterrupt or Terminated

    note.defers = True  # a handler that raises nothing: _interrupt_held holds SIGTERM back for it too
    for signum in handlers:
        signal.signal(signum, note)
    try:
        yield safe_point
        safe_point()
    except Exception:
        # the block failed with a signal noted: the signal is why (a SIGTERM sent to the whole
        # job also ends the pool's forkserver, and the driver found its pipe closed before it
        # took the signal), so it is raised, not the failure it caused
        safe_point()
        raise
    finally:
        for signum, old in handlers.items():
            if signal.getsignal(signum) is note:  # a SIGTERM raised left the default in place
                signal.signal(signum, old)


#: What a run whose pool lost a process says (a worker, or the forkserver it is forked from).
_WORKER_DIED = ("a worker process died (killed, or out of memory); re-run the same command to resume, "
                "with fewer --workers if memory is short")


def _run_pool(fn, tasks, workers, progress, collect, preload: str) -> None:
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    ctx = _context(preload)
    q = ctx.Queue()
    # A pool of processes that dies loudly: a worker killed (OOM, kill -9) breaks the pool
    # instead of leaving its task waiting forever.
    leave_term = isinstance(signal.getsignal(signal.SIGTERM), _SigtermHandler)
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_pool_init,
                               initargs=(q, os.getpid(), dict(os.environ), leave_term))
    ok = False
    with _signals_at_safe_points() as safe_point:
        try:
            with _MainHidden(), _interrupt_held():  # submit starts the forkserver and the workers
                try:
                    futures = {pool.submit(_pool_entry, fn, task, os.getpid()): i for i, task in enumerate(tasks)}
                except (EOFError, ConnectionError):
                    # the forkserver ended while it forked a worker: killed (the OOM killer), or by a
                    # SIGTERM sent to the whole job (the command line starts it before it takes
                    # SIGTERM), which waits here, held, and is raised instead (_signals_at_safe_points).
                    # A bare EOFError reached the command line as Ctrl-C ("interrupted", 130)
                    raise PacktoolError(_WORKER_DIED) from None
            drained = reported = 0
            while futures:
                safe_point()
                done, _ = wait(list(futures), timeout=0.2, return_when=FIRST_COMPLETED)
                safe_point()
                drained += _drain(q, progress)
                for fut in sorted(done, key=futures.get):
                    i = futures.pop(fut)
                    try:
                        res, total = fut.result()
                    except BrokenProcessPool:
                        raise PacktoolError(_WORKER_DIED) from None
                    reported += total
                    collect(i, res)
            drained += _drain(q, progress)
            if progress is not None and reported > drained:  # updates still in the queue's pipe
                progress(reported - drained)
            ok = True
        finally:
            if not ok:
                # Stop every other task now; their temporary files are removed by the caller.
                for proc in list((getattr(pool, "_processes", None) or {}).values()):
                    proc.kill()
            pool.shutdown(wait=True, cancel_futures=True)
            q.close()


# ---------------------------------------------------------------- Ray


#: Attempts Ray makes again at a task whose worker or node died (``max_retries``). A task is
#: idempotent: it clears what an earlier attempt left and publishes through its completion
#: marker, so a retry on another node writes the same bytes. A task's own error is not retried.
RAY_TASK_RETRIES = 3

#: Where the current process runs tasks, for the completion markers (:func:`worker_place`).
_RAY_NODE: str | None = None


def worker_place() -> dict:
    """Where this task runs: ``{"host", "pid"}``, plus ``"ray_node"`` (the node id) in a Ray task.

    Recorded in each completion marker, so a run spread over a cluster says which node wrote
    which task; nothing else reads it and it never reaches a shard or the manifest.
    """
    place = {"host": socket.gethostname(), "pid": os.getpid()}
    if _RAY_NODE is not None:
        place["ray_node"] = _RAY_NODE
    return place


#: Whether this process runs Ray tasks, which Ray attempts again where a worker or node died.
_RAY_WORKER = False


def attempt_may_repeat() -> bool:
    """Whether a task starting in this process may be an attempt again at a task begun earlier in
    the same run (a Ray retry, whose first attempt may have left files): such a task clears them
    itself. Elsewhere the run's driver cleared what earlier runs left of every task before
    starting them (``shards.clear_tasks``), and a task that fails ends the run."""
    return _RAY_WORKER


def _ray_entry(fn, task, q, env: dict[str, str] | None = None) -> dict:
    global _RAY_NODE, _RAY_WORKER
    import ray

    from .storage import with_env

    _RAY_WORKER = True
    _RAY_NODE = ray.get_runtime_context().get_node_id()
    rep = Reporter(q.put if q is not None else None)
    with with_env(env or {}):  # the driver's store settings: this worker may be on another machine
        res = fn(task, rep)
    rep.flush()
    return res


def _unwrap_ray_error(exc: BaseException) -> BaseException:
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def _run_ray(fn, tasks, ex: ExecutorConfig, progress, collect) -> None:
    try:
        import ray
        from ray.util.queue import Queue
    except ImportError:
        raise ConfigError(RAY_MISSING) from None
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from .storage import forwarded_env

    started = False
    if not ray.is_initialized():
        # a local runtime is started without its dashboard; a cluster's own settings are its own
        extra = {} if ex.ray_address else {"include_dashboard": False}
        ray.init(address=ex.ray_address, log_to_driver=False, **extra)
        started = True
    # The progress queue lives on the driver's node: on any other node, losing that node
    # would fail every task that reports to it.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    q = Queue(actor_options={"num_cpus": 0, "scheduling_strategy": here})
    # SPREAD: tasks go round the nodes that have a free CPU; Ray's default keeps tasks on the
    # driver's node until half its CPUs are busy, which on a cluster of small nodes leaves
    # the others idle at the start of every stage.
    remote = ray.remote(num_cpus=1, scheduling_strategy="SPREAD", max_retries=RAY_TASK_RETRIES,
                        retry_exceptions=False)(_ray_entry)
    fn_ref = ray.put(fn)
    # --storage-option values and the S3 variables the driver was given: a worker on another
    # node has its own environment. In the arguments, not a runtime_env that the dashboard shows.
    env_ref = ray.put(forwarded_env())
    refs = {remote.remote(fn_ref, task, q, env_ref): i for i, task in enumerate(tasks)}
    try:
        while refs:
            done, _ = ray.wait(list(refs), num_returns=1, timeout=0.2)
            _drain_ray(q, progress)
            for ref in done:
                i = refs.pop(ref)
                try:
                    res = ray.get(ref)
                except Exception as exc:  # a task failed: surface the original error, not Ray's wrapper
                    raise _unwrap_ray_error(exc) from None
                collect(i, res)
        _drain_ray(q, progress)
    finally:
        for ref in refs:
            ray.cancel(ref, force=True)
        try:
            q.shutdown()
        except Exception:  # noqa: BLE001 - best effort
            pass
        if started:
            ray.shutdown()


def _drain_ray(q, progress) -> None:
    while True:
        try:
            n = q.get_nowait()
        except Exception:  # ray.util.queue.Empty
            return
        if progress is not None:
            progress(n)
