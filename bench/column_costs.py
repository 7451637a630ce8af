"""What each stored column of a shard costs Parquet, one column at a time.

``python -m bench.column_costs SHARD [--codecs]`` reads a shard, then writes each column alone
to memory with the shard writer's options (1,024-row groups) and reads it back, best of
three each, and prints one Markdown row per column: write and read milliseconds, stored and
raw (Arrow) megabytes. ``--codecs`` also tries the token columns with other compressions.
Times are of this machine at this moment (print the load with them); the shares between
columns are what carries over.
"""

from __future__ import annotations

import io
import sys

from bench import best_s

#: Compressions tried with ``--codecs``, as ``(codec, level)``.
CODECS = (("zstd", 1), ("zstd", -1), ("lz4", None), ("snappy", None), ("none", None))


def column_costs(path: str, codecs: bool = False) -> str:
    import pyarrow.parquet as pq

    from bench.bench_pack import _load
    from packtool.runs import COMPACT_COLUMNS
    from packtool.shards import _WRITE_OPTS

    table = pq.read_table(path)
    out = [f"{path}: {table.num_rows:,} rows, load {_load()}", "",
           "| column | codec | write | read | stored MB | raw MB |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for name in table.column_names:
        sub = table.select([name])
        tried = CODECS if codecs and name in COMPACT_COLUMNS else CODECS[:1]
        for codec, level in tried:
            opts = dict(_WRITE_OPTS, compression=codec, compression_level=level)
            buf = io.BytesIO()
            pq.write_table(sub, buf, row_group_size=1024, **opts)
            data = buf.getvalue()
            w = best_s(lambda: pq.write_table(sub, io.BytesIO(), row_group_size=1024, **opts))  # noqa: B023
            r = best_s(lambda: pq.read_table(io.BytesIO(data)))  # noqa: B023
            label = codec if level is None else f"{codec} {level}"
            out.append(f"| `{name}` | {label} | {w * 1e3:.1f} ms | {r * 1e3:.1f} ms | {len(data) / 1e6:.2f} | "
                       f"{sub.nbytes / 1e6:.2f} |")
    return "\n".join(out)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if not args:
        print(__doc__)
        sys.exit(2)
    print(column_costs(args[0], codecs="--codecs" in sys.argv))
