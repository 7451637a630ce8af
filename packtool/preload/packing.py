"""The pack (and mix) workers' forkserver preload: the pipeline, the media module, and the
compiled knapsack and gather kernels, loaded from numba's cache (see :mod:`packtool.preload`)."""

from __future__ import annotations

from . import arrow_without_pandas, command_line_logging, warm


def _kernels() -> None:
    from ..packer import warm_kernels

    warm_kernels()


def _modules() -> None:
    from .. import media, pipeline, runs, shards  # noqa: F401


warm(_modules, arrow_without_pandas, command_line_logging, _kernels)
