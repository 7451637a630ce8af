"""Executors run the same task function in-process, in a process pool, or as Ray tasks."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from packtool.errors import ConfigError, PacktoolError, SampleError  # noqa: E402
from packtool.executors import ExecutorConfig, Reporter, Terminated, run_tasks, sigterm_as_interrupt  # noqa: E402


class TwoArgError(Exception):
    """An exception pickle cannot rebuild (its ``args`` are not its constructor's)."""

    def __init__(self, who: str, what: str) -> None:
        super().__init__(f"{who} {what}")


def square(task: int, report) -> dict:
    for _ in range(task):
        report(1)
    if task == 13:
        raise ValueError("task 13 is unlucky")
    if task == 99:
        os.kill(os.getpid(), signal.SIGKILL)
    if task == 17:
        raise SampleError("missing_media", "task 17 lost its image")
    if task == 19:
        raise TwoArgError("task 19", "cannot be rebuilt from its message")
    return {"task": task, "value": task * task, "pid": os.getpid()}


def loaded(task: int, report) -> dict:
    """What this worker process had loaded when its task started (pandas: after a conversion
    that makes pyarrow look for it)."""
    import pyarrow as pa

    from packtool import knapsack, tokenization

    pa.array([task])

    packer = sys.modules.get("packtool.packer")
    return {"kernels": len(knapsack._ENTRIES), "vocabularies": tokenization._qwen_encoding.cache_info().currsize,
            "pandas": "pandas" in sys.modules, "warm": bool(packer and packer._warm), "parent": os.getppid()}


def environment(task: int, report) -> dict:
    return {"probe": os.environ.get("PACKTOOL_TEST_PROBE"), "cwd": os.getcwd()}


def interrupt_swallowed(task: int, report, signum: int = signal.SIGINT) -> dict:
    """Ctrl-C arriving inside library code that swallows it (numba's cache loads kernels through
    a ctypes callback, which prints a ``KeyboardInterrupt`` and drops it), then the task goes on."""
    if task == 1:
        try:
            signal.raise_signal(signum)
        except KeyboardInterrupt:
            pass
    report(1)
    return {"task": task}


def sigterm_swallowed(task: int, report) -> dict:
    """:func:`interrupt_swallowed` for SIGTERM."""
    return interrupt_swallowed(task, report, signal.SIGTERM)


def started_then_wait(task: str, report) -> dict:
    """Say this task started (a file named ``task``), then outlast any test."""
    Path(task).write_text(str(os.getpid()))
    time.sleep(300)
    return {}


def test_rank_takes_every_world_size_th_task():
    assert ExecutorConfig(rank=0, world_size=1).my_tasks(3) == [0, 1, 2]
    assert ExecutorConfig(rank=2, world_size=3).my_tasks(10) == [2, 5, 8]
    assert ExecutorConfig(rank=3, world_size=4).my_tasks(3) == []


@pytest.mark.parametrize(("kw", "message"), [
    ({"rank": 2, "world_size": 2}, "--rank 2 is outside 0..1"),
    ({"workers": 0}, "--workers must be at least 1"),
    ({"executor": "dask"}, "--executor 'dask': choose local or ray"),
    ({"ray_address": "auto"}, "--ray-address needs --executor ray"),
])
def test_bad_settings_name_the_flag(kw, message):
    with pytest.raises(ConfigError, match=message):
        ExecutorConfig(**kw)


@pytest.mark.parametrize("workers", [1, 2])
def test_results_in_task_order_and_progress_adds_up(workers):
    seen: list[int] = []
    got = run_tasks(square, [3, 1, 4, 1, 5], ExecutorConfig(workers=workers), progress=seen.append)
    assert [r["value"] for r in got] == [9, 1, 16, 1, 25]
    assert sum(seen) == 14
    pids = {r["pid"] for r in got}
    assert (pids == {os.getpid()}) if workers == 1 else (os.getpid() not in pids)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_failing_task_fails_the_run_with_its_own_error(workers):
    with pytest.raises(ValueError, match="task 13 is unlucky"):
        run_tasks(square, [1, 13, 2], ExecutorConfig(workers=workers))


@pytest.mark.parametrize("workers", [1, 2])
def test_a_sample_error_from_a_task_arrives_whole(workers):
    with pytest.raises(SampleError, match="task 17 lost its image") as got:
        run_tasks(square, [1, 17, 2], ExecutorConfig(workers=workers))
    assert got.value.reason == "missing_media" and got.value.message == "task 17 lost its image"


def test_an_exception_pickle_cannot_rebuild_is_named_not_taken_for_a_killed_worker():
    # before: the pool broke while unpickling it, and the run said a worker had died
    with pytest.raises(RuntimeError, match="a task raised TwoArgError: task 19 cannot be rebuilt") as got:
        run_tasks(square, [1, 19, 2], ExecutorConfig(workers=2))
    assert "worker process died" not in str(got.value)
    with pytest.raises(TwoArgError):  # in process it is raised as it is
        run_tasks(square, [19], ExecutorConfig(workers=1))


@pytest.mark.parametrize(("preload", "kernels", "vocabularies"), [
    ("packtool.pipeline", 0, 0), ("packtool.preload.packing", 1, 0), ("packtool.preload.tokenization", 0, 1)])
def test_workers_start_with_what_their_stage_preloads(preload, kernels, vocabularies):
    # a fresh process: its first pool starts the forkserver, which keeps that pool's preload
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            "from test_executors import loaded; from packtool.executors import ExecutorConfig, run_tasks; "
            f"print(json.dumps(run_tasks(loaded, [0, 1, 2, 3], ExecutorConfig(workers=2), preload={preload!r})))")
    got = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    if os.environ.get("NUMBA_DISABLE_JIT") == "1":
        kernels = 0  # no compiled entries to keep
    assert all(r["kernels"] == kernels and r["vocabularies"] == vocabularies for r in got), got
    assert all(r["warm"] == bool(kernels) for r in got), got  # the buffer loop and the gather as well
    # pandas is a test dependency: pyarrow imports it at a worker's first conversion of a list
    # unless the stage's forkserver has made it take pandas as absent (the default preload does not)
    assert [r["pandas"] for r in got] == [preload == "packtool.pipeline"] * 4, got


def test_a_pool_started_ahead_is_the_one_the_workers_come_from():
    """``start_pool`` starts the forkserver (with the stage's preload) while the driver sets up; the
    pool forks its workers from it. No pool is started for one worker."""
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            "from multiprocessing import forkserver; from test_executors import loaded; "
            "from packtool.executors import ExecutorConfig, run_tasks, start_pool; "
            "start_pool(ExecutorConfig(workers=1), 'packtool.preload.tokenization'); "
            "alone = forkserver._forkserver._forkserver_pid; "
            "start_pool(ExecutorConfig(workers=2), 'packtool.preload.tokenization'); "
            "ahead = forkserver._forkserver._forkserver_pid; "
            "got = run_tasks(loaded, [0, 1, 2], ExecutorConfig(workers=2), preload='packtool.preload.packing'); "
            "print(json.dumps([alone, ahead, got]))")
    alone, ahead, got = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                  check=True).stdout)
    assert alone is None and isinstance(ahead, int)
    # the forkserver started ahead kept its (tokenize) preload: the vocabulary, no kernels
    assert all(r["parent"] == ahead and r["vocabularies"] == 1 and r["kernels"] == 0 for r in got), got


@pytest.mark.parametrize("preload", ["packtool.preload.packing", "packtool.preload.tokenization"])
def test_ctrl_c_during_a_forkserver_preload_prints_no_traceback(preload, tmp_path):
    """Ctrl-C goes to the whole process group, the forkserver too; during its preload (the first
    second or two of a run with workers) it printed a KeyboardInterrupt traceback beside the
    driver's ``Error: interrupted``. The interrupt arrives here mid-preload, after the package
    is imported and before the stage's steps have run."""
    # the real forkserver loop, its preload list put between the package and the stage by a
    # module that says "ready" and waits: the interrupt lands mid-preload, every time
    (tmp_path / "ready_then_wait.py").write_text("import sys\nprint('ready', flush=True)\nsys.stdin.readline()\n")
    (tmp_path / "say_loaded.py").write_text("print('loaded', flush=True)\n")
    proc, alive_w = _forkserver_child(tmp_path, ["packtool.preload", "ready_then_wait", preload, "say_loaded"])
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGINT)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "loaded\n"  # the stage's steps ran, the driver alive
    finally:
        os.close(alive_w)  # the driver ends: the loop exits
    out, err = proc.communicate(timeout=120)
    assert (proc.returncode, out, err) == (0, "", "")


def _forkserver_child(tmp_path: Path, preload: list[str]) -> tuple[subprocess.Popen, int]:
    """The real forkserver loop in a child with ``preload``; the test holds the write end of its
    ``alive`` pipe, as a driver does (closing it is the driver ending)."""
    alive_r, alive_w = os.pipe()
    code = ("import socket, sys\n"
            "from multiprocessing import forkserver\n"
            "listener = socket.socket(socket.AF_UNIX)\n"
            "listener.bind('')  # an abstract address (a temporary folder's path can pass AF_UNIX's 108 bytes)\n"
            "listener.listen()\n"
            f"sys.path.insert(0, {str(tmp_path)!r})\n"
            f"forkserver.main(listener.fileno(), {alive_r}, {preload!r})\n")
    try:
        proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, pass_fds=(alive_r,))
    except BaseException:
        os.close(alive_w)
        raise
    finally:
        os.close(alive_r)
    return proc, alive_w


@pytest.mark.parametrize("driver", ["alive", "gone", "ends mid-step"])
def test_a_forkserver_whose_driver_ended_stops_its_preload(driver, tmp_path):
    """The command starts its pool's forkserver before it parses its arguments; a command that
    fails on them ends while the forkserver still loads, and a caller reading the command's
    output through a pipe waited for that too (pack's kernels: most of a second). Now the
    preload ends its process as soon as its driver has gone: before a step (numba, pack's
    kernels, never imported) or in the middle of one (the step never finishes); with the driver
    there it loads everything."""
    (tmp_path / "ready_then_wait.py").write_text("import sys\nprint('ready', flush=True)\nsys.stdin.readline()\n")
    (tmp_path / "say_loaded.py").write_text("import sys\nprint('loaded', 'numba' in sys.modules, flush=True)\n")
    (tmp_path / "blocking_step.py").write_text(
        "import sys\nfrom packtool.preload import warm\n\n\ndef step():\n    print('in step', flush=True)\n"
        "    sys.stdin.readline()\n    print('step done', flush=True)\n\n\nwarm(step)\n")
    preload = (["blocking_step", "say_loaded"] if driver == "ends mid-step"
               else ["ready_then_wait", "packtool.preload.packing", "say_loaded"])
    proc, alive_w = _forkserver_child(tmp_path, preload)
    try:
        assert proc.stdout.readline() == ("in step\n" if driver == "ends mid-step" else "ready\n")
        if driver == "alive":
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.stdout.readline() == "loaded True\n"
        os.close(alive_w)  # the driver ends
        alive_w = None
        if driver == "gone":  # then the preload goes on, to its next step
            proc.stdin.write("go\n")
            proc.stdin.flush()
        # mid-step: the step waits on stdin, which stays open; only the process's end frees it
        assert proc.wait(timeout=120) == 0
        assert (proc.stdout.read(), proc.stderr.read()) == ("", ""), driver
    finally:
        if alive_w is not None:
            os.close(alive_w)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            with contextlib.suppress(OSError):
                stream.close()


def _driver(code: str, preload_dir: Path) -> subprocess.Popen:
    """``python -c code`` in its own session (so a signal to its process group reaches only it and
    the pool it starts), pipes on its three streams, ``preload_dir`` on its ``PYTHONPATH``: the
    forkserver imports its preload from the path it starts with, not the driver's ``sys.path``."""
    path = os.pathsep.join([str(preload_dir), *filter(None, [os.environ.get("PYTHONPATH")])])
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env={**os.environ, "PYTHONPATH": path})


def test_ctrl_c_while_a_pool_starts_reaches_only_the_driver(tmp_path):
    """Ctrl-C reaches the whole process group. While a pool started (its forkserver importing
    the preload, up to seconds on a busy machine; a worker being forked) the processes being
    started printed tracebacks beside the driver's ``Error: interrupted``: the forkserver's
    ``KeyboardInterrupt`` from its imports, and a worker forked after the driver stopped its
    pool, which died unpickling the queue's semaphore the stopping driver had removed. The
    interrupt lands here while the forkserver's preload waits, every time."""
    (tmp_path / "ready_then_wait.py").write_text("import sys\nprint('ready', flush=True)\nsys.stdin.readline()\n"
                                                 "import packtool.preload.packing  # noqa: E402, F401\n")
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "from test_executors import square\n"
            "from packtool.executors import ExecutorConfig, run_tasks\n"
            "try:\n"
            "    run_tasks(square, [1, 2, 3, 4], ExecutorConfig(workers=2), preload='ready_then_wait')\n"
            "except KeyboardInterrupt:\n"
            "    print('interrupted', flush=True)\n")
    proc = _driver(code, tmp_path)
    try:
        assert proc.stdout.readline() == "ready\n"  # the forkserver, mid-preload; the driver waits for its workers
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole process group
        proc.stdin.write("go\n")
        proc.stdin.close()
        # reaped before reading to the end: a worker left running stops once its driver is gone
        assert proc.wait(timeout=120) == 0
        assert (proc.stdout.read(), proc.stderr.read()) == ("interrupted\n", "")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("how", ["sigterm to the job", "forkserver killed"])
def test_a_forkserver_that_ends_while_the_pool_starts_is_reported_as_what_ended_it(how, tmp_path):
    """The command line starts its pool's forkserver before it takes SIGTERM, so a scheduler's
    SIGTERM to the whole job ends the forkserver. A driver forking a worker from it then read
    its pipe closed (``EOFError``) before it took its own SIGTERM, which click turned into an
    Abort: ``Error: interrupted`` and exit 130 instead of ``terminated`` and 143. A forkserver
    killed alone (the OOM killer) read as Ctrl-C too; it is a process that died. Both land while
    the forkserver's preload waits and the driver waits for its first worker, every time."""
    (tmp_path / "ready_then_wait.py").write_text("import os, sys\nprint('ready', os.getpid(), flush=True)\n"
                                                 "sys.stdin.readline()\n")
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "from multiprocessing import forkserver\n"
            "from test_executors import square\n"
            "from packtool.errors import PacktoolError\n"
            "from packtool.executors import ExecutorConfig, Terminated, run_tasks, sigterm_as_interrupt, start_pool\n"
            "connect = forkserver.connect_to_new_process\n"
            "def connected(fds):\n"
            "    got = connect(fds)\n"
            "    print('forking', flush=True)\n"
            "    return got\n"
            "forkserver.connect_to_new_process = connected\n"
            "ex = ExecutorConfig(workers=2)\n"
            "start_pool(ex, 'ready_then_wait')  # as the launcher does: before SIGTERM is taken\n"
            "try:\n"
            "    with sigterm_as_interrupt():\n"
            "        run_tasks(square, [1, 2, 3, 4], ex, preload='ready_then_wait')\n"
            "except Terminated:\n"
            "    print('terminated', flush=True)\n"
            "except PacktoolError as exc:\n"
            "    print('error:', exc, flush=True)\n")
    proc = _driver(code, tmp_path)
    try:
        lines = [proc.stdout.readline().split() for _ in range(2)]  # the forkserver mid-preload, the driver forking
        assert sorted(line[0] for line in lines if line) == ["forking", "ready"], (lines, proc.stderr.read())
        forkserver = int(next(line[1] for line in lines if line[0] == "ready"))
        if how == "sigterm to the job":
            os.killpg(proc.pid, signal.SIGTERM)  # Slurm's scancel: every process of the job
            want = "terminated\n"
        else:
            os.kill(forkserver, signal.SIGKILL)
            want = "error: a worker process died (killed, or out of memory); re-run the same command to resume, " \
                   "with fewer --workers if memory is short\n"
        assert proc.wait(timeout=120) == 0, proc.stderr.read()
        assert (proc.stdout.read(), proc.stderr.read()) == (want, "")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_importing_the_preload_package_outside_a_forkserver_keeps_ctrl_c():
    """``pkgutil.walk_packages`` over packtool imports every subpackage (documentation tools and
    the docstring tests do): that import set SIGINT to ignored in the walking process, and every
    command it started then ignored Ctrl-C too."""
    code = ("import pkgutil, signal, subprocess, sys, packtool\n"
            "list(pkgutil.walk_packages(packtool.__path__, 'packtool.'))\n"
            "assert 'packtool.preload' in sys.modules\n"
            "child = subprocess.run([sys.executable, '-c', 'import signal; print(signal.getsignal(signal.SIGINT))'],"
            " capture_output=True, text=True).stdout.strip()\n"
            "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, child)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout, r.stderr) == (0, "True <built-in function default_int_handler>\n", "")


def test_pool_workers_see_the_drivers_environment_as_each_pool_starts(monkeypatch, tmp_path):
    # workers are forked from one forkserver per process, started with the first pool; a
    # variable set or removed after that (credentials, --storage-option) must reach the next pool
    monkeypatch.delenv("PACKTOOL_TEST_PROBE", raising=False)
    assert {r["probe"] for r in run_tasks(environment, [0, 1, 2], ExecutorConfig(workers=2))} == {None}
    monkeypatch.setenv("PACKTOOL_TEST_PROBE", "set later")
    monkeypatch.chdir(tmp_path)
    got = run_tasks(environment, [0, 1, 2], ExecutorConfig(workers=2))
    assert {(r["probe"], r["cwd"]) for r in got} == {("set later", str(tmp_path))}
    monkeypatch.delenv("PACKTOOL_TEST_PROBE")
    assert {r["probe"] for r in run_tasks(environment, [0, 1, 2], ExecutorConfig(workers=2))} == {None}


def test_a_killed_worker_fails_the_run_instead_of_hanging():
    t0 = time.monotonic()
    with pytest.raises(PacktoolError, match="a worker process died"):
        run_tasks(square, [1, 99, 2, 3], ExecutorConfig(workers=2))
    assert time.monotonic() - t0 < 60


def test_workers_of_a_killed_driver_stop_before_it_is_reaped(tmp_path):
    """A driver killed (OOM killer, kill -9) under ``subprocess.run(..., capture_output=True)``:
    its parent reads the output to the end before it reaps the driver, and the workers hold that
    output's pipes. A driver not yet reaped still answers ``kill(pid, 0)``, so its workers ran on
    and the parent waited forever."""
    starts = [str(tmp_path / f"started-{i}") for i in range(2)]
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "from test_executors import started_then_wait\n"
            "from packtool.executors import ExecutorConfig, run_tasks\n"
            f"run_tasks(started_then_wait, {starts!r}, ExecutorConfig(workers=2), preload='packtool.config')\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not all(Path(s).is_file() for s in starts):  # both workers are in their tasks
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        proc.kill()
        t0 = time.monotonic()
        proc.communicate(timeout=30)  # reads to the end, then reaps: as subprocess.run does
        assert time.monotonic() - t0 < 10
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_worker_holding_a_thousand_files_still_stops_with_its_killed_driver():
    """The watch on the driver's pidfd used ``select``, which refuses a descriptor numbered 1024
    or more: in a worker that had opened that many files (a media loader, a cache) the watching
    thread died and the worker ran on after its driver was killed."""
    code = ("import os, resource, subprocess, sys, threading, time\n"
            "from packtool.executors import _exit_with_driver\n"
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, 2048), hard), hard))\n"
            "held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]\n"
            "driver = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "threading.Thread(target=_exit_with_driver, args=(driver.pid,), daemon=True).start()\n"
            "time.sleep(0.5)\n"
            "driver.kill(); driver.wait()\n"
            "time.sleep(20)\n"
            "print('still running')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[1])
    if "RLIMIT" in out.stderr or "Too many open files" in out.stderr:
        pytest.skip(f"this machine allows too few open files: {out.stderr[-200:]}")
    assert (out.returncode, out.stdout) == (1, ""), out.stderr[-2000:]


def test_ctrl_c_that_a_library_swallows_still_stops_an_in_process_run():
    """A Ctrl-C during the first kernel load of an in-process run (``--workers 1``, or a run of
    one task) was lost inside numba: the run went on to the end and exited 0."""
    done: list[dict] = []
    with pytest.raises(KeyboardInterrupt):
        run_tasks(interrupt_swallowed, [0, 1, 2, 3], ExecutorConfig(workers=1), on_result=done.append)
    assert [r["task"] for r in done] == [0]  # the interrupted task and those after it never finish
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert [r["task"] for r in run_tasks(interrupt_swallowed, [0, 2], ExecutorConfig(workers=1))] == [0, 2]


def test_sigterm_that_a_library_swallows_still_stops_an_in_process_run():
    """SIGTERM under the command line's handler stops an in-process run as Ctrl-C does, even
    where library code drops the exception; a second SIGTERM would end the process (the default
    is back in place), and leaving the handler restores what was there."""
    before = signal.getsignal(signal.SIGTERM)
    done: list[dict] = []
    with sigterm_as_interrupt() as term:
        with pytest.raises(Terminated):
            run_tasks(sigterm_swallowed, [0, 1, 2, 3], ExecutorConfig(workers=1), on_result=done.append)
        assert term.received and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert [r["task"] for r in done] == [0]
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_pool_driver_takes_signals_only_between_its_steps():
    """A pool's driver raised Ctrl-C or SIGTERM wherever it landed: once inside
    ``concurrent.futures.wait``, between taking a future's lock and entering the block that
    releases it, and the pool's shutdown then waited for that lock forever (a SIGTERM-stopped job
    hung). The signal is noted and raised where the driver asks (between its steps), through the
    handler in place, which still arms the default for a second SIGTERM."""
    import threading

    from packtool.executors import _signals_at_safe_points

    lock = threading.Lock()
    before = signal.getsignal(signal.SIGTERM)
    with sigterm_as_interrupt() as term:
        with _signals_at_safe_points() as safe_point:
            with lock:  # a lock held while the signal lands: nothing is raised here
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
                assert not term.received
            assert not lock.locked()
            with pytest.raises(Terminated):
                safe_point()
            assert term.received and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        # Ctrl-C noted after the last safe point comes out when the block ends
        with pytest.raises(KeyboardInterrupt), _signals_at_safe_points():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_second_sigterm_before_the_first_is_raised_ends_the_driver_at_once():
    code = ("import os, signal, time\n"
            "from packtool.executors import sigterm_as_interrupt, _signals_at_safe_points\n"
            "with sigterm_as_interrupt(), _signals_at_safe_points():\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(5)\n"
            "print('not ended')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (-signal.SIGTERM, ""), (r.returncode, r.stdout, r.stderr)


def test_reporter_batches_and_flushes():
    got: list[int] = []
    rep = Reporter(got.append)
    for _ in range(1000):
        rep(1)
    rep.flush()
    assert sum(got) == 1000 and len(got) < 1000


@pytest.mark.slow  # starting a Ray cluster: 15 s on an idle machine, a minute on a busy one
def test_ray_output_is_identical_to_the_local_executor(tmp_path):
    import shutil

    ray = pytest.importorskip("ray")
    from bench.corpus import make_corpus
    from packtool import Mixture, PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset

    corpus = tmp_path / "corpus"
    make_corpus(corpus, 600, seed=11)
    tcfg = TokenizeConfig(media_root=str(corpus), rows_per_shard=200)
    pcfg = PackConfig(max_tokens=4096, media="reference", packs_per_shard=30)
    hashes = {}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for name, kw in (("local", {"workers": 2}), ("ray", {"executor": "ray"})):
            seen: list[int] = []
            tokenize_dataset([corpus / "data.jsonl"], tmp_path / name / "tok", tcfg, progress=seen.append, **kw)
            assert sum(seen) == 600  # progress streams back from every task
            pack_dataset(tmp_path / name / "tok", tmp_path / name / "packed", pcfg, **kw)
            # a mixture (the corpus and a copy of it at half rate; the same directory twice is
            # refused) in tasks of 250 samples
            shutil.copytree(tmp_path / name / "tok", tmp_path / name / "tok-copy")
            mixture = Mixture.from_rates([tmp_path / name / "tok", tmp_path / name / "tok-copy"], "1.0,0.5",
                                         samples_per_task=250)
            pack_dataset(mixture, tmp_path / name / "mixed", pcfg, **kw)
            hashes[name] = {stage: {s["file"]: s["sha256"] for s in
                                    json.loads((tmp_path / name / stage / ".packtool" / "manifest.json").read_text())["shards"]}
                            for stage in ("tok", "packed", "mixed")}
        assert len(hashes["local"]["tok"]) == 3 and len({f[:10] for f in hashes["local"]["mixed"]}) == 4  # tasks
        assert hashes["ray"] == hashes["local"]
        # a task's own PacktoolError reaches the caller unwrapped (the CLI prints its message)
        with open(corpus / "data.jsonl", "a") as fh:
            fh.write("{not json\n")
        from packtool.errors import TooManyErrorsError

        with pytest.raises(TooManyErrorsError) as info:
            tokenize_dataset([corpus / "data.jsonl"], tmp_path / "bad", tcfg, executor="ray", on_error="fail")
        assert str(info.value).startswith(f"{corpus / 'data.jsonl'}:600 rejected, bad_json")
        assert not (tmp_path / "bad" / ".packtool" / "manifest.json").exists()
    finally:
        ray.shutdown()
