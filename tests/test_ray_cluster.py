"""A real two-node Ray cluster, started outside packtool the way an operator starts one.

``ray start --head`` and a second ``ray start --address HEAD`` (its own resources) run on this
machine, each with one CPU, a 100 MB object store, its own ports and a private temporary
directory, so the test touches no other Ray on the machine and stops only the processes it
started. packtool joins it with ``--executor ray --ray-address``: tokenize and pack run on both
nodes (each task's completion marker records its node), and a pack that loses the second
node's raylet while one of its tasks runs still finishes with the bytes of a local run.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.corpus import make_corpus  # noqa: E402

pytest.importorskip("ray")

RAY = [sys.executable, "-m", "ray.scripts.scripts"]
#: Seconds a node may take to start, join, or be declared dead on a busy two-core machine.
DEADLINE_S = 120


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as fh:
                    kids.setdefault(int(fh.read().rsplit(b")", 1)[1].split()[1]), []).append(int(d))
            except OSError:
                pass
    return kids


def _tree(pid: int) -> set[tuple[int, int]]:
    """``(pid, start time)`` of ``pid`` and its descendants; the start time tells a reused pid apart."""
    kids, out, todo = _children(), set(), [pid]
    while todo:
        p = todo.pop()
        start = _start_time(p)
        if start is not None:
            out.add((p, start))
        todo.extend(kids.get(p, []))
    return out


def _start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return int(fh.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _title(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


class Cluster:
    """Two Ray nodes on this machine, each a ``ray start --block`` process this test owns."""

    def __init__(self) -> None:
        # short: Ray's socket paths live under it and a Unix socket path holds at most 107 bytes
        self.temp_dir = tempfile.mkdtemp(prefix="ptray")
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
                    # token authentication, with a token of this cluster only
                    "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
                    # a lost node is declared dead after about 2 s instead of about 30 s
                    "RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "4"}
        self.nodes: dict[str, subprocess.Popen] = {}
        self.seen: set[tuple[int, int]] = set()  # every process of the cluster observed so far
        self.address = ""

    def _ports(self, n: int) -> list[int]:
        socks = [socket.socket() for _ in range(n)]
        for s in socks:
            s.bind(("", 0))
        ports = [s.getsockname()[1] for s in socks]
        for s in socks:
            s.close()
        return ports

    def start(self, name: str, *args: str) -> None:
        p = self._ports(7)
        cmd = [*RAY, "start", "--block", "--num-cpus", "1", "--object-store-memory", str(100 << 20),
               "--temp-dir", self.temp_dir, "--disable-usage-stats", "--node-manager-port", str(p[0]),
               "--object-manager-port", str(p[1]), "--dashboard-agent-listen-port", str(p[2]),
               "--dashboard-agent-grpc-port", str(p[3]), "--metrics-export-port", str(p[4]),
               "--runtime-env-agent-port", str(p[5]), "--min-worker-port", "0", "--max-worker-port", "0", *args]
        if name == "head":
            gcs = p[6]
            cmd += ["--head", "--port", str(gcs), "--include-dashboard", "false"]
        else:
            cmd += ["--address", self.address]
        log = open(Path(self.temp_dir) / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        # the nodes run in their own directory, not the driver's: tasks must not depend on it
        self.nodes[name] = subprocess.Popen(cmd, env=self.env, cwd=self.temp_dir, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        if name == "head":
            self.address = f"127.0.0.1:{gcs}"

    def node_ids(self, n: int) -> dict[str, str]:
        """Wait until ``n`` nodes are alive; ``{"head": id, "node2": id}`` from the cluster itself."""
        probe = ("import json, sys, time, ray\n"
                 f"ray.init(address={self.address!r}, log_to_driver=False)\n"
                 f"deadline = time.monotonic() + {DEADLINE_S}\n"
                 "while True:\n"
                 "    alive = [x for x in ray.nodes() if x['Alive']]\n"
                 f"    if len(alive) == {n} or time.monotonic() > deadline: break\n"
                 "    time.sleep(0.25)\n"
                 "print(json.dumps({('node2' if 'node2' in x['Resources'] else 'head'): x['NodeID'] for x in alive}))\n")
        r = subprocess.run([sys.executable, "-c", probe], env=self.env, capture_output=True, text=True,
                           timeout=2 * DEADLINE_S, cwd=self.temp_dir)
        self.observe()
        assert r.returncode == 0, self.logs() + r.stderr
        ids = json.loads(r.stdout.strip().splitlines()[-1])
        assert len(ids) == n, self.logs()
        return ids

    def observe(self) -> None:
        for proc in self.nodes.values():
            self.seen |= _tree(proc.pid)

    def busy_workers(self, name: str) -> list[int]:
        """Workers of node ``name`` running a packtool task now (Ray titles them ``ray::_ray_entry``)."""
        tree = _tree(self.nodes[name].pid)
        self.seen |= tree
        return [pid for pid, _ in tree if _title(pid).startswith(b"ray::_ray_entry")]

    def raylet(self, name: str) -> int:
        pids = [pid for pid, _ in _tree(self.nodes[name].pid) if b"/raylet/raylet" in _title(pid).split(b"\0")[0]]
        assert len(pids) == 1, pids
        return pids[0]

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in Path(self.temp_dir).glob("*.log"))

    def stop(self) -> None:
        """SIGTERM each ``ray start --block`` (it stops its node's processes), then SIGKILL whatever
        of this cluster is still alive; never a process that this cluster did not start."""
        self.observe()
        for proc in self.nodes.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + 20
        for proc in self.nodes.values():
            try:
                proc.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.observe()
        for pid, start in self.seen:
            if _start_time(pid) == start:  # the same process, not a new one that got its pid
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.nodes.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture()
def cluster():
    c = Cluster()
    try:
        c.start("head")
        c.start("node2", "--resources", json.dumps({"node2": 1}))
        yield c
    finally:
        c.stop()


def packtool(cluster: Cluster, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "packtool", *args], cwd=cwd, env=cluster.env, capture_output=True,
                          text=True, timeout=600)


def ran_on(out: Path) -> dict[int, str]:
    """Task → the Ray node that wrote it, from the completion markers."""
    return {int(m.stem.split("-")[1]): json.loads(m.read_text())["ran_on"]["ray_node"]
            for m in sorted((out / ".packtool").glob("task-*.json"))}


def manifest(out: Path) -> dict:
    """The manifest less the path of the pack input (runs here read ``tok`` or ``local-tok``)."""
    m = json.loads((out / ".packtool" / "manifest.json").read_bytes())
    m.pop("source", None)
    return m


@pytest.mark.slow  # two Ray nodes start, join and one is lost: about a minute on a busy two-core machine
def test_two_node_cluster_spreads_tasks_and_survives_a_lost_node(cluster, tmp_path):
    make_corpus(tmp_path, 1200, seed=15)
    # relative paths from the driver's directory, which no Ray node runs in
    tok_args = ["tokenize", "data.jsonl", "--media-root", ".", "-o", "tok", "--rows-per-shard", "150", "--quiet"]
    pack_args = ["--max-tokens", "4096", "--packs-per-shard", "20", "--quiet"]
    local = [packtool(cluster, tmp_path, *tok_args[:5], "local-tok", *tok_args[6:], "--workers", "1"),
             packtool(cluster, tmp_path, "pack", "local-tok", "-o", "local-packed", *pack_args, "--workers", "1")]
    assert [r.returncode for r in local] == [0, 0], [r.stderr for r in local]
    ids = cluster.node_ids(2)
    on_ray = ["--executor", "ray", "--ray-address", cluster.address]

    r = packtool(cluster, tmp_path, *tok_args, *on_ray)
    assert r.returncode == 0, r.stderr + cluster.logs()
    assert manifest(tmp_path / "tok") == manifest(tmp_path / "local-tok")
    tok_nodes = ran_on(tmp_path / "tok")
    assert len(tok_nodes) == 8 and set(tok_nodes.values()) == set(ids.values()), (tok_nodes, ids)

    r = packtool(cluster, tmp_path, "pack", "tok", "-o", "packed", *pack_args, *on_ray)
    assert r.returncode == 0, r.stderr + cluster.logs()
    assert manifest(tmp_path / "packed") == manifest(tmp_path / "local-packed")
    assert set(ran_on(tmp_path / "packed").values()) == set(ids.values())

    # Pack again and lose node2 the moment one of its workers runs a task: its raylet and that
    # worker are SIGKILLed together, as when the machine goes. A run that ends before node2
    # gets a task (the head took them all) is tried again.
    for attempt in range(3):
        out = f"packed-{attempt}"
        proc = subprocess.Popen([sys.executable, "-m", "packtool", "pack", "tok", "-o", out, *pack_args, *on_ray],
                                cwd=tmp_path, env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        killed: list[int] = []
        try:
            while proc.poll() is None and not killed:
                busy = cluster.busy_workers("node2")
                if busy:
                    killed = [cluster.raylet("node2"), *busy]
                    for pid in killed:
                        os.kill(pid, signal.SIGKILL)
                else:
                    time.sleep(0.005)
            _, err = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:  # the test failed while the run went on: stop it
                proc.kill()
                proc.wait()
        assert proc.returncode == 0, err + cluster.logs()
        if killed:
            break
    assert killed, "node2 never ran a pack task in three runs"
    assert manifest(tmp_path / out) == manifest(tmp_path / "local-packed")
    # every task is marked, none by the killed worker: the task it was running ran again on the head
    writers = [json.loads(m.read_text())["ran_on"] for m in sorted((tmp_path / out / ".packtool").glob("task-*.json"))]
    assert len(writers) == 8 and not {w["pid"] for w in writers} & set(killed[1:])
    assert ids["head"] in {w["ray_node"] for w in writers}
    assert cluster.node_ids(1) == {"head": ids["head"]}  # the cluster itself saw node2 go


@pytest.fixture()
def bare_head():
    """One Ray node whose processes know nothing of any object store: no AWS variables, no
    ``PACKTOOL_STORAGE_OPTIONS`` (a node on another machine, as far as its environment goes)."""
    from packtool.storage import FORWARDED_ENV

    c = Cluster()
    c.env = {k: v for k, v in c.env.items() if k not in FORWARDED_ENV and not k.startswith("AWS_")}
    try:
        c.start("head")
        yield c
    finally:
        c.stop()


@pytest.mark.slow  # a Ray node and an S3 server start: about 30 s on a busy two-core machine
def test_workers_reach_the_bucket_with_only_the_settings_the_driver_was_given(bare_head, tmp_path):
    from bench.s3server import s3_server

    make_corpus(tmp_path, 300, seed=15)
    secret = "s3cr3t-" + secrets.token_hex(8)  # moto takes any key; this one must never be written out
    with s3_server() as server:
        server.client().create_bucket(Bucket="data")
        # the driver has the keys in its environment and the endpoint as a --storage-option only
        env = {**bare_head.env, "AWS_ACCESS_KEY_ID": "driver-key", "AWS_SECRET_ACCESS_KEY": secret,
               "AWS_DEFAULT_REGION": "us-east-1", "PACKTOOL_CACHE": str(tmp_path / "cache")}
        opt = ["--storage-option", f"endpoint_url={server.endpoint}"]
        on_ray = ["--executor", "ray", "--ray-address", bare_head.address, "--quiet"]

        def run(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "packtool", *opt, *args], cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=600)

        ids = bare_head.node_ids(1)
        r = run("tokenize", "data.jsonl", "--media-root", ".", "-o", "s3://data/tok", "--rows-per-shard", "100", *on_ray)
        assert r.returncode == 0, r.stderr + bare_head.logs()
        r2 = run("pack", "s3://data/tok", "-o", "s3://data/packed", "--max-tokens", "4096", *on_ray)
        assert r2.returncode == 0, r2.stderr + bare_head.logs()
        client = server.client()
        written = {o["Key"]: client.get_object(Bucket="data", Key=o["Key"])["Body"].read()
                   for o in client.list_objects_v2(Bucket="data")["Contents"]}
    markers = [json.loads(v) for k, v in written.items() if "/.packtool/task-" in k]
    # every task ran in a worker of the bare node and wrote its shards and marker to the bucket
    assert len(markers) == 3 + 3 and {m["ran_on"]["ray_node"] for m in markers} == {ids["head"]}
    assert "tok/.packtool/manifest.json" in written and "packed/.packtool/manifest.json" in written
    # the secret is in no object, no output and no log of the node
    leaks = [k for k, v in written.items() if secret.encode() in v]
    leaks += [name for name, text in (("tokenize output", r.stdout + r.stderr), ("pack output", r2.stdout + r2.stderr))
              if secret in text]
    leaks += [str(f) for f in Path(bare_head.temp_dir).rglob("*")
              if f.is_file() and not f.is_symlink() and secret.encode() in f.read_bytes()]
    assert not leaks
