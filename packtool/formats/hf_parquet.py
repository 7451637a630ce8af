"""Hugging Face Parquet: one record per row, read in record batches.

``datasets`` stores an ``Image`` feature as ``struct<bytes: binary, path: string>``
(and a ``Sequence(Image)`` as a list of those); the readers accept such structs
wherever a media path may appear, so a Parquet row is parsed by the same record
format as its JSON twin (LLaVA ``conversations`` + ``image``, ShareGPT / ms-swift
``messages`` + ``images``, Molmo ``message_list`` + ``image``, the Cauldron's ``texts`` +
``images``). Sharded datasets
(``data/train-00000-of-00004.parquet`` ...) are read file by file, in sorted order.

Rows are converted to Python one record batch at a time, so memory stays bounded by
``batch_rows`` rows (images included), not by the file.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from ..errors import SampleError

__all__ = ["iter_records", "SUFFIXES"]

SUFFIXES = (".parquet",)


def iter_records(path: Path, batch_rows: int = 512, row_groups: tuple[int, int] | None = None,
                 first_row: int = 0) -> Iterator[tuple[int, object]]:
    """Yield ``(row, record)`` for every row of a Parquet file (or of row groups ``row_groups``,
    whose first row is ``first_row``).

    A file that is not Parquet, or whose pages cannot be decoded, ends with one ``corrupt_file``
    :class:`~packtool.errors.SampleError` in place of its remaining rows; the rows before it
    are kept. Permission and I/O errors stop the run (they are the environment's, not the file's).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = first_row
    try:
        pf = pq.ParquetFile(path)
        groups = list(range(*row_groups)) if row_groups is not None else None
        for batch in pf.iter_batches(batch_size=batch_rows, row_groups=groups):
            try:
                records = batch.to_pylist()
            except _CONVERSION_ERRORS:  # a value Python cannot hold: only its row is lost, not the file
                records = _records_one_by_one(batch)
            for rec in records:
                yield row, rec
                row += 1
    except OSError as exc:
        if exc.errno is not None:  # EACCES, EIO ...: not the file's contents
            raise
        yield row, _corrupt(exc)
    except (pa.ArrowException, ValueError) as exc:
        yield row, _corrupt(exc)


#: What converting a decoded batch to Python raises for a value Python has no type for: a
#: timestamp or date past year 9999 (``OverflowError``), a time zone name the zone database
#: lacks (``ArrowInvalid``, a ``ValueError``). The file reads; the row holding it cannot.
_CONVERSION_ERRORS = (OverflowError, ValueError, NotImplementedError)


def _records_one_by_one(batch) -> list:
    """The rows of ``batch`` as records, one at a time; a row with a value Python cannot hold
    becomes a ``bad_record`` :class:`~packtool.errors.SampleError` naming its column."""
    records: list = []
    for i in range(batch.num_rows):
        try:
            records.append(batch.slice(i, 1).to_pylist()[0])
        except _CONVERSION_ERRORS as exc:
            column = next((name for name, col in zip(batch.schema.names, batch.columns, strict=True)
                           if not _converts(col, i)), "?")
            records.append(SampleError("bad_record", f"column {column!r} holds a value Python cannot represent "
                                                     f"({str(exc)[:120]}); fix the value, or drop the column"))
    return records


def _converts(column, i: int) -> bool:
    try:
        column[i].as_py()
    except _CONVERSION_ERRORS:
        return False
    return True


def _corrupt(exc: BaseException) -> SampleError:
    return SampleError("corrupt_file", f"not a readable Parquet file from this row on ({str(exc)[:200]}); "
                                       "re-copy or re-write the file")
