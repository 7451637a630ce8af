"""What the s3:// and gs:// tests share: two ranks of one CLI run started together against a
bucket, each with its own local state (as on two machines), and a manifest's shard list to
compare a bucket run with a local one."""

from __future__ import annotations

import subprocess
from pathlib import Path

from packtool import storage


def run_two_ranks(command: list[str], env: dict[str, str], tmp_path: Path) -> list[str]:
    """Run ``command --rank 0`` and ``--rank 1`` at once, each with a cache of its own and the
    lock trace on; both must succeed. Returns their stderr logs (the trace in them)."""
    env = {**env, "PACKTOOL_LOCK_TRACE": "1"}
    procs = [subprocess.Popen([*command, "--rank", str(r)], env={**env, storage.CACHE_ENV: str(tmp_path / f"node{r}")},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    logs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    return logs


def assert_planned_once(logs: list[str], n_tasks: int, n_inputs: int = 1) -> None:
    """Exactly one rank planned the tokenize tasks; the other read its stored plan."""
    planned = [f"planned {n_tasks} tokenize tasks from {n_inputs} inputs" in log for log in logs]
    stored = [f"read the stored plan of {n_tasks} tokenize tasks" in log for log in logs]
    assert sorted(planned) == [False, True] and stored == [not p for p in planned], logs


def manifest_shards(manifest: dict) -> list[tuple]:
    """A manifest's shards as ``(file, rows, bytes, sha256)``: equal lists are byte-identical outputs."""
    return [(s["file"], s["rows"], s["bytes"], s["sha256"]) for s in manifest["shards"]]
