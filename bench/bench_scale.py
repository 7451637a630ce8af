"""Scale: memory that does not grow with the corpus, and throughput with more workers.

A generated LLaVA-like corpus (``bench.corpus``, media by reference) is tokenized and
packed with the real CLI in a subprocess while the memory of its whole process tree
(driver + workers) is sampled from ``/proc`` every 0.1 s:

* **memory**: peak summed RSS (and PSS, which counts pages shared between workers once)
  at two corpus sizes, and the peak of the largest single process; the bar is < 1.5 GB
  and the larger corpus within 10% of the smaller. The summed peak depends on whether the
  two workers reach their own peaks at the same moment, which more tasks make likelier;
  the largest process shows what one worker needs, which is what the task size bounds;
* **speedup**: samples/s with ``--workers 2`` over ``--workers 1`` (the baseline is packtool
  itself with one worker, measured in the same call): tokenize on the smaller corpus cut
  into 8 tasks, pack on the larger one (the smaller packs in seconds, where start-up would
  dominate).

``python -m bench scale`` runs 100k and 1M samples (about ten minutes on 2 cores);
``--quick`` uses 5k and 20k samples cut into tasks of 2,500. On a machine that other jobs
share, the speedup is a lower bound of what the code can do: the second worker competes
with them for the core.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.corpus import make_corpus

ROOT = Path(__file__).resolve().parents[1]


def _tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (from /proc/*/stat)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as fh:
                stat = fh.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(stat[1]), []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process so far (``/proc/PID/stat``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _memory(pids: list[int]) -> tuple[int, int, int]:
    """Summed RSS and PSS (bytes) of ``pids``, and the largest RSS of one of them."""
    rss = pss = largest = 0
    for p in pids:
        own = 0
        try:
            with open(f"/proc/{p}/smaps_rollup") as fh:
                for line in fh:
                    if line.startswith("Rss:"):
                        own = int(line.split()[1]) * 1024
                        rss += own
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
        except OSError:
            continue
        largest = max(largest, own)
    return rss, pss, largest


def measure(args: list[str]) -> dict:
    """Run ``python -m packtool ARGS``; return wall seconds and peak summed RSS/PSS of its process tree."""
    proc = subprocess.Popen([sys.executable, "-m", "packtool", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    peak = [0, 0, 0]
    cpu_seen: dict[int, float] = {}  # last CPU seconds seen per process of the tree
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            pids = _tree(proc.pid)
            now = _memory(pids)
            for p in pids:
                cpu_seen[p] = max(cpu_seen.get(p, 0.0), _cpu_s(p))
            peak[:] = [max(a, b) for a, b in zip(peak, now, strict=True)]
            stop.wait(0.1)

    t = threading.Thread(target=sample, daemon=True)
    t0 = time.perf_counter()
    t.start()
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    stop.set()
    t.join()
    cpu = sum(cpu_seen.values())
    if proc.returncode != 0:
        raise RuntimeError(f"packtool {' '.join(args)} failed: {err[-2000:]}")
    return {"wall_s": wall, "cpu_s": cpu, "rss": peak[0], "pss": peak[1], "largest": peak[2], "stdout": out}


def _tokenize(corpus: Path, out: Path, workers: int, rows_per_shard: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    return measure(["tokenize", str(corpus / "data.jsonl"), "--media-root", str(corpus), "-o", str(out),
                    "--rows-per-shard", str(rows_per_shard), "--quiet", "--workers", str(workers)])


def _pack(tok: Path, out: Path, workers: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    return measure(["pack", str(tok), "-o", str(out), "--media", "reference", "--quiet", "--workers", str(workers)])


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f}"


def run(quick: bool = False) -> str:
    small, large = (5_000, 20_000) if quick else (100_000, 1_000_000)
    rows_per_shard = 2_500 if quick else 50_000  # the default task size in full runs
    base = Path(os.environ.get("PACKTOOL_BENCH_DIR") or tempfile.mkdtemp(prefix="packtool-scale-"))
    rows = []
    mem: dict[int, dict] = {}
    for n in (small, large):
        corpus = base / f"corpus-{n}"
        if not (corpus / "data.jsonl").is_file():
            make_corpus(corpus, n, seed=1)
        out = base / f"out-{n}"
        mem[n] = {"tokenize": _tokenize(corpus, out / "tok", 2, rows_per_shard)}
        mem[n]["pack"] = _pack(out / "tok", out / "packed", 2)
    for stage in ("tokenize", "pack"):
        a, b = mem[small][stage], mem[large][stage]
        rows.append(f"| {stage} peak memory, 2 workers (all processes) | {_gb(a['rss'])} GB RSS / {_gb(a['pss'])} GB PSS "
                    f"| {_gb(b['rss'])} GB RSS / {_gb(b['pss'])} GB PSS | {b['rss'] / a['rss']:.3f}x "
                    f"| {b['wall_s']:.0f} s ({large / b['wall_s']:,.0f} samples/s) |")
        rows.append(f"| {stage} peak memory, largest process | {_gb(a['largest'])} GB | {_gb(b['largest'])} GB "
                    f"| {b['largest'] / a['largest']:.3f}x | |")
    # Speedup, both runs in this call. tokenize: the small corpus cut into 8 tasks. pack: the
    # large tokenized corpus (its 2-worker run is the one above); the smaller one packs in a
    # few seconds, where start-up (imports, worker start) would dominate the ratio.
    tok_one = _tokenize(base / f"corpus-{small}", base / "speed-tok", 1, small // 8)
    tok_two = _tokenize(base / f"corpus-{small}", base / "speed-tok", 2, small // 8)
    pack_one = _pack(base / f"out-{large}" / "tok", base / "speed-packed", 1)
    for stage, n, one, two, what in (("tokenize", small, tok_one, tok_two, "8 tasks"),
                                      ("pack", large, pack_one, mem[large]["pack"], f"{large // rows_per_shard} tasks")):
        rows.append(f"| {stage} speedup at {n:,} samples ({what}) | 1 worker {n / one['wall_s']:,.0f} samples/s "
                    f"| 2 workers {n / two['wall_s']:,.0f} samples/s | {one['wall_s'] / two['wall_s']:.2f}x "
                    f"| CPU-s: {one['cpu_s']:.0f} vs {two['cpu_s']:.0f} |")
    if not os.environ.get("PACKTOOL_BENCH_DIR"):
        shutil.rmtree(base, ignore_errors=True)
    head = [f"| measure | {small:,} samples | {large:,} samples | ratio | {large:,}: wall time |",
            "| --- | --- | --- | --- | --- |"]
    return "\n".join(head + rows)


if __name__ == "__main__":  # pragma: no cover
    print(run(quick="--quick" in sys.argv))
