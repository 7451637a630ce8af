"""``python -m bench [NAME ...] [--quick]``: run every ``bench_*.py`` module (or the named ones)
and print their tables. ``--quick`` uses smaller sizes for a smoke run."""

from __future__ import annotations

import importlib
import pkgutil
import sys
import time

import bench


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    names = [a for a in argv if not a.startswith("--")]
    modules = sorted(m.name for m in pkgutil.iter_modules(bench.__path__) if m.name.startswith("bench_"))
    if names:
        modules = [m for m in modules if any(n in m for n in names)]
    for name in modules:
        mod = importlib.import_module(f"bench.{name}")
        t0 = time.perf_counter()
        table = mod.run(quick=quick)
        print(f"\n## {name} ({time.perf_counter() - t0:.1f} s)\n")
        print(table)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
