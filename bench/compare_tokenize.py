"""Tokenize throughput of this tree against another checkout, alternating, on one corpus.

``python -m bench.compare_tokenize OTHER_TREE [N] [--rounds R]`` generates the LLaVA-like
corpus of ``bench/bench_tokenize.py`` (N samples, default 100,000) once, then runs
``tokenize_dataset`` on it from each tree in turn, one process and then ``--workers 2``
(8 tasks), for R rounds (default 2): other tree, this tree, other, this. Each run is a fresh
interpreter started in its tree's directory, so it imports that tree's ``packtool``
(``OTHER_TREE`` is e.g. ``git worktree add /tmp/before main``). A shared machine's
neighbours move wall-clock rates by tens of percent from one minute to the next, which is
why the trees alternate and the load average is printed with every run; one process also
reports its CPU rate (samples per CPU second of that process), the figure that moves least.
The last column is a digest of the shards' sha256 list: equal digests, equal bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.bench_pack import _load

_RUN = """
import hashlib, json, sys, time
from pathlib import Path
from packtool import TokenizeConfig, tokenize_dataset
import packtool
data, out, n, workers = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
cfg = TokenizeConfig(media_root=str(Path(data).parent), rows_per_shard=1_000_000 if workers == 1 else -(-n // 8))
t0, c0 = time.perf_counter(), time.process_time()
m = tokenize_dataset([data], out, cfg, workers=workers, progress=None)
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
shas = "".join(s["sha256"] for s in m["shards"])
print(json.dumps({"samples": m["counts"]["samples"], "wall": wall, "cpu": cpu, "tree": str(Path(packtool.__file__).parent.parent),
                  "shards": hashlib.sha256(shas.encode()).hexdigest()[:12]}))
"""


def _once(tree: Path, data: Path, out: Path, n: int, workers: int) -> dict:
    return run_in_tree(tree, _RUN, [str(data), str(out), str(n), str(workers)], out, "tokenize")


def run_in_tree(tree: Path, script: str, args: list[str], out: Path, stage: str) -> dict:
    """Run ``script`` in a fresh interpreter in ``tree`` (so it imports that tree's packtool),
    ``out`` cleared before and after; its last stdout line is a JSON object with ``tree``."""
    shutil.rmtree(out, ignore_errors=True)
    load = _load()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", script, *args], cwd=tree, env=env, capture_output=True, text=True,
                          check=False)
    shutil.rmtree(out, ignore_errors=True)
    if done.returncode:
        raise RuntimeError(f"{stage} from {tree} failed:\n{done.stderr[-2000:]}")
    res = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(res["tree"]).resolve() != tree.resolve():
        raise RuntimeError(f"internal error: the run in {tree} imported packtool from {res['tree']}")
    res["load"] = f"{load} -> {_load()}"
    return res


def main(argv: list[str]) -> int:
    from bench.bench_tokenize import make_corpus

    args = [a for a in argv if not a.startswith("--")]
    if not args:
        print(__doc__)
        return 2
    other = Path(args[0]).resolve()
    n = int(args[1]) if len(args) > 1 else 100_000
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 2
    here = Path(__file__).resolve().parent.parent
    tmp = Path(tempfile.mkdtemp(prefix="compare-tokenize-"))
    try:
        data = make_corpus(tmp, n)
        _once(here, data, tmp / "warm", min(n, 5_000), 1)  # page cache, forkserver imports
        print(f"LLaVA-like JSONL, {n:,} samples, qwen2.5-vl + chatml; other = {other}")
        print()
        print("| round | tree | workers | samples/s | samples per CPU-s | load (1 min, before -> after) | shards |")
        print("| ---: | --- | ---: | ---: | ---: | --- | --- |")
        for r in range(rounds):
            for name, tree in (("other", other), ("this", here)):
                for workers in (1, 2):
                    res = _once(tree, data, tmp / "out", n, workers)
                    if res["samples"] != n:
                        raise RuntimeError(f"internal error: {name} tokenized {res['samples']} of {n} samples")
                    cpu = f"{n / res['cpu']:,.0f}" if workers == 1 else "(wall only)"
                    print(f"| {r + 1} | {name} | {workers} | {n / res['wall']:,.0f} | {cpu} | {res['load']} | "
                          f"{res['shards']} |", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
