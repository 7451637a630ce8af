"""Pack throughput of this tree against another checkout, alternating, on one corpus shape.

``python -m bench.compare_pack OTHER_TREE [N] [--mix qwen-images] [--media reference] [--rounds R]``
has each tree write the ``bench.corpus`` tokenized corpus (N samples, default 60,000, seed 5)
in its own schema, then runs ``pack_dataset`` (one worker, the defaults) from each tree in
turn for R rounds (default 3): other tree, this tree, other, this, ... Each run is a fresh
interpreter started in its tree's directory, so it imports that tree's ``packtool``
(``OTHER_TREE`` is e.g. ``git worktree add /tmp/before main``). Neighbours on a shared
machine move wall-clock rates by tens of percent from one minute to the next, which is why
the trees alternate and the load average is printed with every run; the CPU rate (samples
per CPU second of the packing process) is the figure that moves least. After the rounds,
each tree packs once more with ``--layout full``: the digests of the shards' sha256 lists
must agree (the same rows, whatever the stored form in between).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from bench.compare_tokenize import run_in_tree

_RUN = """
import hashlib, json, sys, time
from pathlib import Path
import packtool
from packtool.config import PackConfig
from packtool.pipeline import pack_dataset
from bench.corpus import write_tokenized
tok, out, mix, n, media, layout = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6]
if not Path(tok, ".packtool", "manifest.json").is_file():
    write_tokenized(Path(tok), mix, n, seed=5)
cfg = PackConfig(media=media, layout=layout)
pack_dataset(tok, out.with_name(out.name + "-warm"), cfg, overwrite=True, workers=1, dry_run=True)  # numba load
t0, c0 = time.perf_counter(), time.process_time()
m = pack_dataset(tok, out, cfg, workers=1)
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
shas = "".join(s["sha256"] for s in m["shards"])
print(json.dumps({"samples": m["counts"]["samples_in"], "packs": m["counts"]["packs"], "wall": wall, "cpu": cpu,
                  "bytes": sum(s["bytes"] for s in m["shards"]), "version": m["schema_version"],
                  "tree": str(Path(packtool.__file__).parent.parent), "shards": hashlib.sha256(shas.encode()).hexdigest()[:12]}))
"""


def _once(tree: Path, tok: Path, out: Path, mix: str, n: int, media: str, layout: str = "runs") -> dict:
    return run_in_tree(tree, _RUN, [str(tok), str(out), mix, str(n), media, layout], out, "pack")


def main(argv: list[str]) -> int:
    args = list(argv)
    opts = {}
    for key in ("--mix", "--media", "--rounds"):
        if key in args:
            i = args.index(key)
            opts[key] = args[i + 1]
            del args[i:i + 2]
    if not args:
        print(__doc__)
        return 2
    other, here = Path(args[0]).resolve(), Path(__file__).resolve().parents[1]
    n = int(args[1]) if len(args) > 1 else 60_000
    mix, media, rounds = opts.get("--mix", "qwen-images"), opts.get("--media", "reference"), int(opts.get("--rounds", 3))
    with tempfile.TemporaryDirectory(prefix="compare-pack-") as tmp:
        trees = {"other": other, "this": here}
        toks = {name: Path(tmp) / f"tok-{name}" for name in trees}
        print(f"pack {n:,} {mix} samples, --media {media}, one worker; other = {other}")
        print(f"{'tree':<6} {'samples/s':>10} {'CPU rate':>10} {'wall s':>7} {'MB':>7} {'schema':>6}  load")
        rates: dict[str, list[float]] = {name: [] for name in trees}
        for _ in range(rounds):
            for name, tree in trees.items():
                r = _once(tree, toks[name], Path(tmp) / "out", mix, n, media)
                rates[name].append(r["samples"] / r["cpu"])
                print(f"{name:<6} {r['samples'] / r['wall']:>10,.0f} {r['samples'] / r['cpu']:>10,.0f} {r['wall']:>7.2f} "
                      f"{r['bytes'] / 1e6:>7.1f} {r['version']:>6}  {r['load']}", flush=True)
        best = {name: max(v) for name, v in rates.items()}
        print(f"best CPU rate: this {best['this']:,.0f}, other {best['other']:,.0f} samples/s: "
              f"{best['this'] / best['other']:.2f}x")
        full = {name: _once(tree, toks[name], Path(tmp) / "out", mix, n, media, "full")["shards"]
                for name, tree in trees.items()}
        print(f"--layout full shards digest: this {full['this']}, other {full['other']}: "
              f"{'the same bytes' if full['this'] == full['other'] else 'DIFFERENT'}")
        return 0 if full["this"] == full["other"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
