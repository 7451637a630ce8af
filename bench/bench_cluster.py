"""What bounds a run spread over many nodes: the plan, and the cost of each task.

Two measures, each against its baseline in the same call:

* **planning**: ``plan_tokenize_tasks`` reading a generated LLaVA-like JSONL (line counts and
  byte offsets, the one pass over every input a run makes) on one thread against the one-pass
  scan it replaced, on every core's thread against one, and a rank reading the stored
  ``.packtool/plan.json`` instead; and the plan's size per task;
* **per-task cost**: the same corpus tokenized as many small tasks and as a few large ones,
  on a local Ray runtime (2 CPUs, 100 MB object store) and on the local process pool
  (``--workers 2``); ``(wall(many) - wall(few)) / (tasks(many) - tasks(few))`` is what one
  more task costs end to end (scheduling, the worker's start of the task, its shard, errors
  file and completion marker), the figure that sets the smallest sensible task. A bare Ray
  round trip (a task that returns at once) is measured on the same runtime for scale.

``python -m bench cluster`` generates 1,000,000 records for the planning pass and tokenizes
4,000 records as 400 tasks and as 4 (about 90 s on 2 cores); ``--quick`` uses 200,000 and
1,000 records (100 and 2 tasks).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from bench import best_interleaved_s, best_s
from bench.corpus import make_corpus


def _planning(base: Path, n: int) -> list[str]:
    from packtool import pipeline

    corpus = base / "plan-corpus"
    if not (corpus / "data.jsonl").is_file():
        make_corpus(corpus, n, seed=3)
    files = [corpus / "data.jsonl"]
    size = files[0].stat().st_size
    with open(files[0], "rb") as fh:  # both sides read from the page cache: the scan is CPU, not the disk
        while fh.read(1 << 24):
            pass
    from packtool.executors import default_workers

    workers = default_workers()
    took = best_interleaved_s({"one pass": lambda: _one_pass_cuts(files[0], 50_000),
                               "one thread": lambda: pipeline.plan_tokenize_tasks(files, 50_000, 1),
                               "threads": lambda: pipeline.plan_tokenize_tasks(files, 50_000, workers)})
    one_pass_s, plan_s, plan_n_s = took["one pass"], took["one thread"], took["threads"]
    load = os.getloadavg()[0]
    # the plan as a run stores it in .packtool/plan.json, and read back as a second rank reads it
    slices, total = pipeline.plan_tokenize_tasks(files, 50_000, workers)
    if (slices, total) != pipeline.plan_tokenize_tasks(files, 50_000, 1):
        raise RuntimeError("internal error: the plan depends on the scan's threads")
    want = _one_pass_cuts(files[0], 50_000)
    if [t[0].offset for t in slices[1:]] != [o for _, o in want[1]] or total != want[0]:
        raise RuntimeError("internal error: the range scan disagrees with the one-pass scan")
    stored = {"kind": "tokenized", "key": "0" * 16, "n_tasks": len(slices), "total": total,
              "tasks": [[[s.path, s.start, s.stop, s.offset, None] for s in t] for t in slices]}
    plan_file = base / "plan.json"
    plan_file.write_text(json.dumps(stored, separators=(",", ":")) + "\n")
    inputs = {str(files[0]): [size, 0]}

    def read_stored() -> None:
        plan = json.loads(plan_file.read_text())
        assert pipeline._tokenize_plan_ok(plan, inputs)

    read_s = best_s(read_stored)
    per_task = plan_file.stat().st_size / len(slices)
    return [f"| plan a tokenize run: scan {n:,} records ({size / 1e6:,.0f} MB JSONL, {len(slices)} tasks), one thread "
            f"| {plan_s:.2f} s ({size / plan_s / 1e6:,.0f} MB/s, {n / plan_s / 1e6:.1f}M lines/s) "
            f"| the one-pass scan it replaced: {one_pass_s:.2f} s | {one_pass_s / plan_s:.2f}x |",
            f"| the same plan, byte ranges on {workers} threads | {plan_n_s:.2f} s ({size / plan_n_s / 1e6:,.0f} MB/s) "
            f"| one thread: {plan_s:.2f} s | {plan_s / plan_n_s:.2f}x |",
            f"| (load average during the scans: {load:.1f} on {os.cpu_count()} CPUs) | | | |",
            f"| a rank reading the stored plan | {read_s * 1e3:.2f} ms | planning on {workers} threads: "
            f"{plan_n_s:.2f} s | {plan_n_s / read_s:,.0f}x |",
            f"| stored plan size | {per_task:,.0f} bytes per task (one slice each) | | |"]


def _one_pass_cuts(path: Path, every: int) -> tuple[int, list[tuple[int, int]]]:
    """The baseline: the plan's scan before it was cut into byte ranges, one pass on one thread
    recording the offset of lines ``every, 2 * every, ...`` as it counts."""
    import numpy as np

    cuts, target, count, pos, last = [], every, 0, 0, b"\n"
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            nl = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10)
            while target - 1 < count + len(nl):
                cuts.append((target, pos + int(nl[target - 1 - count]) + 1))
                target += every
            count += len(nl)
            pos += len(chunk)
            last = chunk[-1:]
    n_lines = count + (1 if pos and last != b"\n" else 0)
    return n_lines, [c for c in cuts if c[0] < n_lines]


def _tokenize_wall(corpus: Path, out: Path, rows_per_shard: int, **kw) -> tuple[float, int]:
    from packtool import TokenizeConfig, tokenize_dataset

    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    m = tokenize_dataset([corpus / "data.jsonl"], out, TokenizeConfig(media_root=str(corpus), rows_per_shard=rows_per_shard),
                         **kw)
    return time.perf_counter() - t0, m["counts"]["tasks"]


def _per_task(base: Path, n: int, many: int, few: int) -> list[str]:
    import ray

    corpus = base / "task-corpus"
    if not (corpus / "data.jsonl").is_file():
        make_corpus(corpus, n, seed=4)
    ray.init(num_cpus=2, object_store_memory=100 << 20, include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        bare = ray.remote(num_cpus=1, scheduling_strategy="SPREAD")(lambda: None)
        ray.get([bare.remote() for _ in range(20)])  # start the workers
        k = 1_000
        t0 = time.perf_counter()
        ray.get([bare.remote() for _ in range(k)])
        bare_ms = (time.perf_counter() - t0) / k * 1e3
        cost = {}
        for name, label, kw in (("ray", "Ray", {"executor": "ray"}), ("pool", "the pool", {"workers": 2})):
            _tokenize_wall(corpus, base / "warm", n // few, **kw)  # workers started, tokenizer loaded
            wall_few, t_few = _tokenize_wall(corpus, base / f"{name}-few", n // few, **kw)
            wall_many, t_many = _tokenize_wall(corpus, base / f"{name}-many", n // many, **kw)
            cost[name] = (wall_many - wall_few) / (t_many - t_few) * 1e3
            rows.append(f"| tokenize {n:,} records on {label} (2 CPUs) | {t_few} tasks: {wall_few:.2f} s "
                        f"| {t_many} tasks: {wall_many:.2f} s | {cost[name]:.1f} ms per extra task |")
        rows.append(f"| one more task, Ray vs the local pool | {cost['ray']:.1f} ms | {cost['pool']:.1f} ms "
                    f"| {cost['ray'] / cost['pool']:.2f}x |")
        rows.append(f"| bare Ray task round trip ({k:,} no-op tasks, 2 CPUs) | {bare_ms:.2f} ms per task | | |")
    finally:
        ray.shutdown()
    return rows


def run(quick: bool = False) -> str:
    plan_n, task_n, many, few = (200_000, 1_000, 100, 2) if quick else (1_000_000, 4_000, 400, 4)
    base = Path(os.environ.get("PACKTOOL_BENCH_DIR") or tempfile.mkdtemp(prefix="packtool-cluster-"))
    try:
        rows = _planning(base, plan_n) + _per_task(base, task_n, many, few)
    finally:
        if not os.environ.get("PACKTOOL_BENCH_DIR"):
            shutil.rmtree(base, ignore_errors=True)
    return "\n".join(["| measure | packtool | baseline / second setting | ratio |", "| --- | --- | --- | --- |", *rows])


if __name__ == "__main__":  # pragma: no cover
    import sys

    print(run(quick="--quick" in sys.argv))
