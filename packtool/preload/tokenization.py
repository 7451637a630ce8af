"""The tokenize workers' forkserver preload: the pipeline, the record readers, templates, rows
and media modules, and the default (Qwen) vocabulary, built once (see :mod:`packtool.preload`)."""

from __future__ import annotations

from . import arrow_without_pandas, warm


def _modules() -> None:
    from .. import formats, media, pipeline, rows, templates, vision  # noqa: F401


def _vocabulary() -> None:
    from ..tokenization import load_tokenizer

    load_tokenizer(None).encode("warm")


warm(_modules, arrow_without_pandas, _vocabulary)
