"""The pack (and mix) workers' forkserver preload: the pipeline, the media module, and the
compiled knapsack and gather kernels, loaded from numba's cache (see :mod:`packtool.preload`)."""

from __future__ import annotations

from . import pandas_shim, warm


def _kernels() -> None:
    import numpy as np

    from ..knapsack import KnapsackSolver
    from ..packer import gather_runs

    KnapsackSolver(1, 1).solve(np.array([1]), np.array([1]), np.array([1]))
    out = np.zeros(1, dtype=np.int32)
    gather_runs(out.copy(), np.zeros(1), np.ones(1), np.zeros(1), np.zeros(1), out)


def _modules() -> None:
    from .. import media, pipeline, runs, shards  # noqa: F401


warm(_modules, pandas_shim, _kernels)
