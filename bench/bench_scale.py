"""Scale: memory that does not grow with the corpus, and throughput with more workers.

A generated LLaVA-like corpus (``bench.corpus``, media by reference) is tokenized and
packed with the real CLI in a subprocess while the memory of its whole process tree
(driver + workers) is sampled from ``/proc`` every 0.1 s:

* **memory**: peak summed RSS (and PSS, which counts pages shared between workers once)
  at two corpus sizes; the bar is < 1.5 GB and the larger within 10% of the smaller;
* **speedup**: samples/s with ``--workers 2`` over ``--workers 1`` for each stage, on the
  same corpus (the baseline is packtool itself with one worker, measured in this run).

``python -m bench scale`` runs 100k and 1M samples (tens of minutes on 2 cores);
``--quick`` uses 5k and 20k. On a machine that other jobs share, the speedup is a
lower bound of what the code can do: the second worker competes with them for the core.
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


def _memory(pids: list[int]) -> tuple[int, int]:
    """Summed RSS and PSS (bytes) of ``pids``."""
    rss = pss = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/smaps_rollup") as fh:
                for line in fh:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1]) * 1024
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
        except OSError:
            continue
    return rss, pss


def measure(args: list[str]) -> dict:
    """Run ``python -m packtool ARGS``; return wall seconds and peak summed RSS/PSS of its process tree."""
    proc = subprocess.Popen([sys.executable, "-m", "packtool", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    peak = [0, 0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            rss, pss = _memory(_tree(proc.pid))
            peak[0], peak[1] = max(peak[0], rss), max(peak[1], pss)
            stop.wait(0.1)

    t = threading.Thread(target=sample, daemon=True)
    t0 = time.perf_counter()
    t.start()
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    stop.set()
    t.join()
    if proc.returncode != 0:
        raise RuntimeError(f"packtool {' '.join(args)} failed: {err[-2000:]}")
    return {"wall_s": wall, "rss": peak[0], "pss": peak[1], "stdout": out}


def _stages(corpus: Path, out: Path, workers: int, rows_per_shard: int = 50_000) -> dict[str, dict]:
    tok, packed = out / "tok", out / "packed"
    for d in (tok, packed):
        shutil.rmtree(d, ignore_errors=True)
    common = ["--quiet", "--workers", str(workers)]
    t = measure(["tokenize", str(corpus / "data.jsonl"), "--media-root", str(corpus), "-o", str(tok),
                 "--rows-per-shard", str(rows_per_shard), *common])
    p = measure(["pack", str(tok), "-o", str(packed), "--media", "reference", *common])
    return {"tokenize": t, "pack": p}


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f}"


def run(quick: bool = False) -> str:
    small, large = (5_000, 20_000) if quick else (100_000, 1_000_000)
    speed_n = small
    base = Path(os.environ.get("PACKTOOL_BENCH_DIR") or tempfile.mkdtemp(prefix="packtool-scale-"))
    rows = []
    mem: dict[int, dict] = {}
    for n in (small, large):
        corpus = base / f"corpus-{n}"
        if not (corpus / "data.jsonl").is_file():
            make_corpus(corpus, n, seed=1)
        mem[n] = _stages(corpus, base / f"out-{n}", workers=2)
    for stage in ("tokenize", "pack"):
        a, b = mem[small][stage], mem[large][stage]
        rows.append(f"| {stage} peak memory, 2 workers | {_gb(a['rss'])} GB RSS / {_gb(a['pss'])} GB PSS "
                    f"| {_gb(b['rss'])} GB RSS / {_gb(b['pss'])} GB PSS | {b['rss'] / a['rss']:.3f}x "
                    f"| {b['wall_s']:.0f} s ({large / b['wall_s']:,.0f} samples/s) |")
    # eight tasks per stage, so two workers have work to share until near the end
    speed = {w: _stages(base / f"corpus-{speed_n}", base / f"speed-{w}", workers=w, rows_per_shard=speed_n // 8)
             for w in (1, 2)}
    for stage in ("tokenize", "pack"):
        one, two = speed[1][stage]["wall_s"], speed[2][stage]["wall_s"]
        rows.append(f"| {stage} speedup at {speed_n:,} samples (8 tasks) | 1 worker {speed_n / one:,.0f} samples/s "
                    f"| 2 workers {speed_n / two:,.0f} samples/s | {one / two:.2f}x | |")
    if not os.environ.get("PACKTOOL_BENCH_DIR"):
        shutil.rmtree(base, ignore_errors=True)
    head = [f"| measure | {small:,} samples | {large:,} samples | ratio | {large:,}: wall time |",
            "| --- | --- | --- | --- | --- |"]
    return "\n".join(head + rows)


if __name__ == "__main__":  # pragma: no cover
    print(run(quick="--quick" in sys.argv))
