"""Publishing a run into a bucket: what replaces rename and ``flock`` where the output is ``s3://`` or ``gs://``.

The stages keep their local logic (``shards.prepare_run``, completion markers, ``merge_output``)
and run it on a local *mirror* of the prefix's ``.packtool/`` state; shards live only in the
bucket. An object store has no rename, but a PUT is atomic per object, a task's shards are the
same bytes on every attempt, and readers trust only the manifest, uploaded last: so the output
is all-or-nothing without one (see :class:`RemoteOutput` for the order of writes). For a local
output every function here is the local behaviour itself (``run_lock``, ``write_marker``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from .errors import OutputError
from .shards import PLAN, TASK_SHARD, TASK_STATE_FILE, PlanSlot
from .storage import (
    _HOST,
    RequestCounter,
    _alive,
    _missing_bucket,
    _url_key,
    cache_dir,
    filesystem,
    is_url,
    read_fresh,
    storage_errors,
)

__all__ = ["output_dir", "stored_plan", "task_target", "state_prepared", "tasks_ran", "task_dir", "publish_task", "listed_sizes",
           "remove_state", "RemoteOutput", "remote_output"]

log = logging.getLogger(__name__)

#: Every step of the bucket locks (create, holder read, takeover, renew, release, plan read), at
#: DEBUG. Off by default; ``PACKTOOL_LOCK_TRACE=1`` prints them on stderr with wall-clock times
#: (milliseconds) and the rank, so two ranks' logs can be merged and read as one interleaving.
trace = logging.getLogger("packtool.lock")
TRACE_ENV = "PACKTOOL_LOCK_TRACE"


def _trace_on() -> None:
    if os.environ.get(TRACE_ENV, "") not in ("", "0") and not trace.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(created).3f lock %(message)s"))
        trace.addHandler(handler)
        trace.setLevel(logging.DEBUG)
        trace.propagate = False


#: Local mirrors of remote outputs held by this process: mirror path -> RemoteOutput.
_MIRRORS: dict[str, RemoteOutput] = {}


def listed_sizes(out_dir: str | Path) -> dict[str, int] | None:
    """Sizes of the shards in the object store when ``out_dir`` is the local mirror of a remote
    output (what a completion marker is checked against), else ``None``."""
    mirror = _MIRRORS.get(str(out_dir))
    return None if mirror is None else mirror.sizes


def task_dir(out_dir: str) -> Path:
    """Where a task writes its files: ``out_dir`` itself, or for a URL a local staging folder of
    this process (its files are uploaded by :func:`publish_task`, then removed)."""
    if not is_url(out_dir):
        return Path(out_dir)
    path = cache_dir() / "stage" / f"{_url_key(out_dir)}-{_HOST}-{os.getpid()}"
    (path / ".packtool").mkdir(parents=True, exist_ok=True)
    return path


def publish_task(out_dir: str, local: Path, task: int, record: dict) -> None:
    """Make a finished task final: write its completion marker, last.

    For a URL: each shard is uploaded whole (an object appears complete or not at all, and a
    retry writes the same bytes under the same key), then the task's rejected rows, then the
    marker; the staged files are removed. A task killed before its marker is redone by the
    next run, which uploads the same bytes again.
    """
    from .shards import STATE_DIR, marker_path, task_errors_path, write_marker

    if not is_url(out_dir):
        write_marker(local, task, record)
        return
    fs, root = filesystem(out_dir)
    with storage_errors(out_dir, writing=True):
        for s in record["shards"]:
            fs.put_file(str(local / s["file"]), f"{root}/{s['file']}")
            RequestCounter.add(int(s["bytes"]))
        errors = task_errors_path(local, task)
        if errors.is_file() and errors.stat().st_size:
            fs.put_file(str(errors), f"{root}/{STATE_DIR}/{errors.name}")
            RequestCounter.add(errors.stat().st_size)
        marker = (json.dumps(record, indent=1) + "\n").encode()
        fs.pipe_file(f"{root}/{STATE_DIR}/{marker_path(local, task).name}", marker)
        RequestCounter.add(len(marker))
    for s in record["shards"]:
        (local / s["file"]).unlink(missing_ok=True)
    task_errors_path(local, task).unlink(missing_ok=True)


class BucketLock:
    """A lock that is an object: created with a conditional put (``If-None-Match: *``), so of
    several processes on any machines one creates it; renewed by its holder every third of
    ``ttl_s``; taken over when its holder is a dead process on this host or has not renewed it
    for ``ttl_s`` (a lost node). Used for each rank's lease and for the plan lock. ``rank``
    only names the taker in the trace (:data:`TRACE_ENV`)."""

    def __init__(self, fs, key: str, ttl_s: float, rank: int | None = None) -> None:
        self.fs = fs
        self.key = key
        self.ttl_s = ttl_s
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._who = f"rank {rank if rank is not None else '-'} pid {os.getpid()} {self.token[:8]}"
        _trace_on()

    def _step(self, what: str, *args) -> None:
        trace.debug("%s %s: " + what, self._who, posixpath.basename(self.key), *args)

    def _body(self) -> bytes:
        return json.dumps({"pid": os.getpid(), "host": _HOST, "token": self.token,
                           "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                           "expires": time.time() + self.ttl_s}).encode()

    def try_take(self) -> dict | None:
        """Take the lock and start renewing it: ``None`` when taken, else its live holder's record."""
        for attempt in range(5):
            try:
                self._step("create (attempt %d)", attempt)
                self.fs.pipe_file(self.key, self._body(), mode="create")
                RequestCounter.add(0)
                self._step("created")
            except FileExistsError:
                holder = self.holder()
                self._step("exists; holder %s", holder)
                if holder is None:  # removed since (its holder let go): create it again, never delete blind
                    time.sleep(0.02 * (attempt + 1))
                    continue
                if holder.get("token") == self.token:
                    # our own create: the client retried a PUT whose answer it lost, and the retry was refused
                    return self._hold()
                if not self._stale(holder):
                    return holder
                log.info("%s: taking over a lock whose holder is gone (%s)", self.key, holder)
                self._step("stale: deleting it")
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(self.key)
                continue
            holder = self.holder()  # two takers of one stale lock: the one whose token is there holds it
            if holder is None or holder.get("token") != self.token:
                self._step("lost it after creating: holder %s", holder)
                return holder or {}
            return self._hold()
        raise OutputError(f"cannot take {self.key!r}: it keeps changing hands; wait and run again")

    def _hold(self) -> None:
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew, name="packtool-lease", daemon=True)
        self._renewer.start()
        self._step("holding")

    def holder(self) -> dict | None:
        """The lock's record; ``None`` when there is no lock. A body that does not parse is read
        again once (a store may serve a read racing the write badly), then is a holder nobody can
        name (``{}``: stale, so taken over)."""
        for attempt in range(2):
            try:
                data = read_fresh(self.fs, self.key)  # written by another machine since our listings
            except FileNotFoundError:
                return None
            RequestCounter.add(len(data))
            try:
                holder = json.loads(data)
            except ValueError:
                self._step("unparsable record %r", data[:80])
                if attempt == 0:
                    time.sleep(0.05)
                    continue
                return {}
            return holder if isinstance(holder, dict) else {}
        return {}

    def _stale(self, holder: dict) -> bool:
        if holder.get("host") == _HOST and isinstance(holder.get("pid"), int):
            return not _alive(holder["pid"])
        expires = holder.get("expires")
        return not isinstance(expires, int | float) or expires < time.time()

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            self._step("renew")
            with contextlib.suppress(Exception):
                self.fs.pipe_file(self.key, self._body())

    def release(self) -> None:
        """Stop renewing and remove the lock if it is still ours."""
        self._stop.set()
        if self._renewer is None:
            return
        self._renewer.join(timeout=5)
        self._renewer = None
        holder = self.holder()
        if holder is not None and holder.get("token") == self.token:
            self._step("release: deleting it")
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self.key)
        else:
            self._step("release: not ours any more (%s)", holder)


class RemotePlanSlot(PlanSlot):
    """A :class:`~packtool.shards.PlanSlot` whose plan is the object ``.packtool/plan.json``."""

    def __init__(self, fs, key: str, plan: dict | None) -> None:
        super().__init__(Path(key), plan)
        self.fs = fs
        self.key = key

    def store(self, plan: dict) -> None:
        if plan != self.plan:
            data = (json.dumps(plan, separators=(",", ":")) + "\n").encode()
            self.fs.pipe_file(self.key, data)
            RequestCounter.add(len(data))
            trace.debug("pid %d plan.json: stored (%d bytes)", os.getpid(), len(data))
            self.plan = plan


class RemoteOutput:
    """A run's hold on an output prefix in a bucket, and the local mirror of its state.

    The stages keep their local logic (``prepare_run``, completion markers, ``merge_output``)
    and run it on a local folder holding the prefix's ``.packtool/`` state; shards stay in the
    bucket (:func:`listed_sizes` answers for them). What changes in the bucket, in order:

    1. a lease object ``.packtool/lease-RRRRR.json``, created with a conditional put
       (``If-None-Match: *``): a second run of this rank into the prefix is refused, naming
       the holder. The holder renews it; a lease left by a dead process on this host, or one
       not renewed for ``ttl_s``, is taken over.
    2. ``run.json`` (and, when the run replaces another, the old run's objects deleted, the
       manifest first, so no reader ever sees a manifest naming a missing shard);
    3. each task's shards, errors and marker (:func:`publish_task`, from wherever the task runs);
    4. ``errors.jsonl``, then ``manifest.json``: the publication. Shards of this run's tasks that
       no marker names (a killed attempt's) are deleted just before it.

    An object store has no rename; a PUT is atomic per object, shards are the same bytes on
    every attempt, and readers trust only the manifest, written last: so the output is
    all-or-nothing without one.
    """

    def __init__(self, url: str, rank: int | None, overwrite: bool = False, ttl_s: float = 120.0) -> None:
        self.url = str(url).rstrip("/")
        self.fs, self.root = filesystem(self.url)
        self.rank = rank
        self.overwrite = overwrite
        self.ttl_s = ttl_s
        self.mirror = cache_dir() / "mirror" / f"{_url_key(self.url)}-{_HOST}-{os.getpid()}"
        self.sizes: dict[str, int] = {}
        self._pulled: dict[str, bytes] = {}
        self._lease = None if rank is None else BucketLock(self.fs, f"{self.root}/.packtool/lease-{rank:05d}.json",
                                                           ttl_s, rank)

    # ---- lease

    def _acquire(self) -> None:
        if self._lease is None:
            return
        holder = self._lease.try_take()
        if holder is not None:
            raise OutputError(
                f"{self.url!r} is being written by another packtool run (pid {holder.get('pid', '?')} on "
                f"{holder.get('host', '?')}, started {holder.get('started', '?')}); wait for it to finish, "
                f"or choose another -o")

    def _release(self) -> None:
        if self._lease is not None:
            self._lease.release()

    # ---- the task plan

    @contextlib.contextmanager
    def plan_slot(self, kind: str, key: str, check, wait_s: float = 0.25) -> Iterator[RemotePlanSlot]:
        """:func:`~packtool.shards.stored_plan` for a bucket: the plan object ``.packtool/plan.json``
        is made by one rank however many machines start, the others read it.

        Ranks on other machines share no file lock, so the planner is whoever creates
        ``.packtool/plan.lock`` with a conditional put (as the lease is taken); it plans,
        prepares the run and uploads the plan (one PUT: whole or absent) before removing the
        lock. A rank that finds a matching plan uses it at once; one that finds the lock held
        waits for the plan (the holder renews the lock while it plans; a lock left by a dead
        process on this host or not renewed for ``ttl_s`` is taken over).
        """
        plan_key = f"{self.root}/.packtool/{PLAN}"
        lock = BucketLock(self.fs, f"{self.root}/.packtool/plan.lock", self.ttl_s, self.rank)
        waited = False
        while True:
            plan = self._plan(plan_key, kind, key, check, quiet=True)
            lock._step("stored plan %s", "found" if plan is not None else "absent or not this run's")
            if plan is not None:
                yield RemotePlanSlot(self.fs, plan_key, plan)
                return
            holder = lock.try_take()
            if holder is None:
                break
            if not waited:
                log.info("%s: another rank (pid %s on %s) is planning; waiting for its plan", self.url,
                         holder.get("pid", "?"), holder.get("host", "?"))
                waited = True
            time.sleep(wait_s)
        try:
            # the plan a rank uploaded between our read and our lock
            plan = self._plan(plan_key, kind, key, check)
            lock._step("holding; stored plan %s", "found" if plan is not None else "absent: planning")
            yield RemotePlanSlot(self.fs, plan_key, plan)
        finally:
            lock.release()

    def _plan(self, plan_key: str, kind: str, key: str, check, quiet: bool = False) -> dict | None:
        try:
            data = read_fresh(self.fs, plan_key)  # another rank's plan, stored after our listing
            RequestCounter.add(len(data))
            plan = json.loads(data)
        except FileNotFoundError:
            return None
        except ValueError:
            trace.debug("rank %s pid %d plan.json: unparsable (%d bytes)", self.rank, os.getpid(), len(data))
            return None
        found = isinstance(plan, dict) and plan.get("kind") == kind and plan.get("key") == key and check(plan)
        if not found:
            trace.debug("rank %s pid %d plan.json: not this run's (kind %s, key %s, want %s)", self.rank, os.getpid(),
                        plan.get("kind") if isinstance(plan, dict) else "?",
                        plan.get("key") if isinstance(plan, dict) else "?", key)
        if not found and not quiet:
            log.info("%s: the stored task plan is of other settings or inputs; planning again", self.url)
        return plan if found else None

    # ---- state

    def _list(self) -> tuple[dict[str, int], list[str], list[str]]:
        """Shard sizes, state file names and other visible names under the prefix (one LIST each)."""
        from .shards import SHARD_NAME

        try:
            top = self.fs.ls(self.root, detail=True, refresh=True)
        except FileNotFoundError:
            _missing_bucket(self.url)
            top = []
        RequestCounter.add(0)
        sizes, foreign = {}, []
        for e in top:
            name = posixpath.basename(e["name"].rstrip("/"))
            if e.get("type") == "file" and SHARD_NAME.fullmatch(name):
                sizes[name] = int(e["size"])
            elif not name.startswith(".") and name not in ("manifest.json", "errors.jsonl"):
                foreign.append(name)
        try:
            state = [posixpath.basename(e["name"]) for e in self.fs.ls(f"{self.root}/.packtool", detail=True, refresh=True)
                     if e.get("type") == "file"]
        except FileNotFoundError:
            state = []
        RequestCounter.add(0)
        return sizes, state, sorted(foreign)

    def pull(self, markers_only: bool = False) -> None:
        """Bring the prefix's state into the mirror: run state, manifest and markers (their errors
        with them); shard sizes from the listing."""
        from .shards import STATE_DIR

        self.sizes, state, foreign = self._list()
        state_dir = self.mirror / STATE_DIR
        state_dir.mkdir(parents=True, exist_ok=True)
        if not markers_only:
            if foreign and not self.overwrite and "run.json" not in state and "manifest.json" not in state:
                shown = ", ".join(repr(n) for n in foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
                raise OutputError(f"output {self.url!r} is not empty and holds no packtool run ({shown}); choose a new "
                                  "or empty -o, or pass --overwrite to write there anyway (objects packtool did not "
                                  "write are never removed)")
            if self.fs.isfile(self.root):
                raise OutputError(f"output {self.url!r} is an object, not a prefix; choose another -o")
        wanted = [n for n in state if TASK_STATE_FILE.fullmatch(n)
                  or (not markers_only and n in ("run.json", "manifest.json", "errors.jsonl"))]
        for name in wanted:
            local = state_dir / name
            if markers_only and local.is_file():
                continue
            try:
                data = self.fs.cat_file(f"{self.root}/{STATE_DIR}/{name}")
            except FileNotFoundError:  # removed meanwhile (a rank clearing its task)
                continue
            RequestCounter.add(len(data))
            local.write_bytes(data)
            self._pulled[name] = data

    def push_state(self) -> None:
        """After ``prepare_run``: mirror what it changed (a new ``run.json``; a wiped run) to the bucket."""
        from .shards import STATE_DIR

        state_dir = self.mirror / STATE_DIR
        gone = [n for n in self._pulled if not (state_dir / n).is_file()]
        if gone:  # prepare_run replaced the run: remove its objects, the manifest first
            self._delete([f"{STATE_DIR}/manifest.json"] if "manifest.json" in gone else [])
            self._delete(sorted(self.sizes))
            self._delete([f"{STATE_DIR}/{n}" for n in sorted(gone) if n != "manifest.json"])
            for n in gone:
                self._pulled.pop(n)
            self.sizes = {}
        run = state_dir / "run.json"
        if run.is_file() and run.read_bytes() != self._pulled.get("run.json"):
            self.fs.pipe_file(f"{self.root}/{STATE_DIR}/run.json", run.read_bytes())
            RequestCounter.add(0)
            self._pulled["run.json"] = run.read_bytes()

    def _delete(self, names: list[str]) -> None:
        if names:
            self.fs.rm([f"{self.root}/{n}" for n in names])
            RequestCounter.add(0)

    def publish(self) -> None:
        """Upload ``errors.jsonl`` and then the manifest when the local merge wrote new ones
        (``errors.jsonl`` alone when only it changed: a repaired one, the manifest the same)."""
        from .shards import ERRORS, MANIFEST

        manifest = self.mirror / MANIFEST
        errors = self.mirror / ERRORS
        if not manifest.is_file():
            return
        new_manifest = manifest.read_bytes() != self._pulled.get("manifest.json")
        if not new_manifest:
            if errors.is_file() and errors.read_bytes() != self._pulled.get("errors.jsonl"):
                self.fs.put_file(str(errors), f"{self.root}/{ERRORS}")
                RequestCounter.add(errors.stat().st_size)
            return
        listed = {s["file"] for s in json.loads(manifest.read_text(encoding="utf-8"))["shards"]}
        strays = [n for n in sorted(self.sizes) if n not in listed and TASK_SHARD.fullmatch(n)]
        self._delete(strays)  # shards of killed attempts that no marker names
        if errors.is_file():
            self.fs.put_file(str(errors), f"{self.root}/{ERRORS}")
            RequestCounter.add(errors.stat().st_size)
        self.fs.put_file(str(manifest), f"{self.root}/{MANIFEST}")
        RequestCounter.add(manifest.stat().st_size)
        self._pulled["manifest.json"] = manifest.read_bytes()

    def drop_unmarked(self, tasks: list[int]) -> None:
        """A failed run: remove the uploaded shards of ``tasks`` that have no completion marker."""
        from .shards import marker_path, task_prefix

        self.sizes, state, _ = self._list()
        names = [n for t in tasks if marker_path(self.mirror, t).name not in state
                 for n in self.sizes if n.startswith(task_prefix(t) + "-")]
        self._delete(names)


@contextlib.contextmanager
def remote_output(url: str, rank: int | None, overwrite: bool = False) -> Iterator[RemoteOutput]:
    """Hold ``url`` for one run of ``rank`` (``None``: ``merge``, which takes no lease) and yield
    its :class:`RemoteOutput`, whose ``mirror`` the stage runs its state logic on; on success
    the new ``errors.jsonl`` and manifest are published, last."""
    out = RemoteOutput(url, rank, overwrite)
    with storage_errors(out.url, writing=True):
        _sweep_dead(out.url)
        shutil.rmtree(out.mirror, ignore_errors=True)
        out._acquire()
    try:
        with storage_errors(out.url, writing=True):
            out.pull()
        _MIRRORS[str(out.mirror)] = out
        yield out
        with storage_errors(out.url, writing=True):
            out.publish()
    finally:
        _MIRRORS.pop(str(out.mirror), None)
        shutil.rmtree(out.mirror, ignore_errors=True)
        with contextlib.suppress(Exception):
            out._release()


def _sweep_dead(url: str) -> None:
    """Remove the local mirror and staging folders that dead processes of this host left for ``url``."""
    key = _url_key(url)
    for kind in ("mirror", "stage"):
        base = cache_dir() / kind
        if not base.is_dir():
            continue
        for d in base.glob(f"{key}-{_HOST}-*"):
            pid = d.name.rsplit("-", 1)[-1]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------- what the stages call


@contextlib.contextmanager
def output_dir(out: str | Path, rank: int | None, overwrite: bool = False) -> Iterator[Path]:
    """Hold the output ``out`` for one run of ``rank`` and yield the folder its state logic runs on.

    A local directory is held by :func:`~packtool.shards.run_lock` and yielded as it is; a URL by
    :func:`remote_output`, yielding the local mirror of its state (``rank=None``: no lease, for merge).
    """
    if not is_url(str(out)):
        from .shards import run_lock

        try:
            str(out).encode("utf-8")
        except UnicodeEncodeError:  # a byte the file system's encoding could not decode: Arrow cannot open it
            from .errors import ConfigError

            shown = str(out).encode("utf-8", "backslashreplace").decode()
            raise ConfigError(f"output directory '{shown}' is not valid UTF-8, which the Parquet writer needs; choose "
                              "a name in UTF-8") from None
        if rank is None:
            yield Path(out)
            return
        with run_lock(Path(out), rank):
            yield Path(out)
        return
    with remote_output(str(out), rank, overwrite) as remote:
        yield remote.mirror


@contextlib.contextmanager
def stored_plan(out: Path, kind: str, key: str, check) -> Iterator[PlanSlot]:
    """:func:`~packtool.shards.stored_plan` (one process plans, the others read its plan) for
    the folder :func:`output_dir` yielded: the plan lives in the bucket when ``out`` mirrors a
    remote output, so ranks on several machines, each with its own mirror, plan once."""
    mirror = _MIRRORS.get(str(out))
    if mirror is None:
        from .shards import stored_plan as local_plan

        with local_plan(out, kind, key, check) as slot:
            yield slot
        return
    with storage_errors(mirror.url, writing=True), mirror.plan_slot(kind, key, check) as slot:
        yield slot


def task_target(out: Path) -> str:
    """What a task is told to write to: the URL when ``out`` mirrors a remote output, else ``out``."""
    mirror = _MIRRORS.get(str(out))
    return mirror.url if mirror is not None else str(out)


def state_prepared(out: Path) -> None:
    """After ``prepare_run`` on a mirror: push the run state it wrote (or the wipe it made)."""
    mirror = _MIRRORS.get(str(out))
    if mirror is not None:
        with storage_errors(mirror.url, writing=True):
            mirror.push_state()


def remove_state(out: Path, name: str) -> None:
    """Remove the run's file ``name`` (``.packtool/...``) from ``out``, and its object too when
    ``out`` mirrors a bucket's output: a command that fails afterwards publishes nothing, and a
    later run reads the prefix, not this mirror."""
    (Path(out) / name).unlink(missing_ok=True)
    mirror = _MIRRORS.get(str(out))
    if mirror is not None:
        with storage_errors(mirror.url, writing=True):
            mirror._delete([name])
        mirror._pulled.pop(posixpath.basename(name), None)


def tasks_ran(out: Path) -> None:
    """After tasks ran elsewhere: bring their markers (and errors) into the mirror."""
    mirror = _MIRRORS.get(str(out))
    if mirror is not None:
        with storage_errors(mirror.url, writing=True):
            mirror.pull(markers_only=True)
