"""Hugging Face Parquet: one record per row, read in record batches.

``datasets`` stores an ``Image`` feature as ``struct<bytes: binary, path: string>``
(and a ``Sequence(Image)`` as a list of those); the readers accept such structs
wherever a media path may appear, so a Parquet row is parsed by the same record
format as its JSON twin (LLaVA ``conversations`` + ``image``, ShareGPT / ms-swift
``messages`` + ``images``, Molmo ``message_list`` + ``image``). Sharded datasets
(``data/train-00000-of-00004.parquet`` ...) are read file by file, in sorted order.

Rows are converted to Python one record batch at a time, so memory stays bounded by
``batch_rows`` rows (images included), not by the file.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from ..errors import InputError

__all__ = ["iter_records", "SUFFIXES"]

SUFFIXES = (".parquet",)


def iter_records(path: Path, batch_rows: int = 512) -> Iterator[tuple[int, dict]]:
    """Yield ``(row, record)`` for every row of a Parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise InputError(f"{path}: not a readable Parquet file ({exc})") from None
    row = 0
    for batch in pf.iter_batches(batch_size=batch_rows):
        for rec in batch.to_pylist():
            yield row, rec
            row += 1
