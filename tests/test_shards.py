"""``shards.rows_table``: rows of numpy arrays become the same table ``from_pylist`` builds."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from packtool.schema import TOKENIZED_ROWS
from packtool.shards import rows_table


def _row(i: int, n: int, rng) -> dict:
    media = [{"kind": "image", "path": f"{i}.jpg", "token_offset": 1, "n_tokens": 4, "width": 9, "height": 8,
              "resized_width": 28, "resized_height": 28, "grid_t": 1, "grid_h": 2, "grid_w": 2, "vision_units": 4,
              "timestamps": None, "data": None, "size_bytes": 10 + i, "mtime_ns": 7}] if i % 2 else []
    return {"sample_id": f"s{i}", "source": "x.jsonl", "source_row": i, "n_tokens": n, "n_vision_units": 4 * (i % 2),
            "n_branches": 1, "input_ids": rng.integers(0, 9, n).astype(np.int32),
            "target_ids": rng.integers(-100, 9, n).astype(np.int32), "position_ids": np.arange(n, dtype=np.int32),
            "subsegment_ids": np.full(n, 10_000, dtype=np.int32), "media": media}


def test_rows_table_equals_from_pylist():
    rng = np.random.default_rng(4)
    rows = [_row(i, int(rng.integers(0, 40)), rng) for i in range(50)]  # empty rows included
    rows[3]["input_ids"] = np.zeros(0, dtype=np.int32)
    rows[3]["n_tokens"] = 0
    want = pa.Table.from_pylist(rows, schema=TOKENIZED_ROWS)
    got = rows_table(rows, TOKENIZED_ROWS)
    assert got.schema == want.schema and got.equals(want)
    # a column given as lists (or another dtype) takes the generic path, same table
    rows[5]["position_ids"] = rows[5]["position_ids"].tolist()
    rows[6]["target_ids"] = rows[6]["target_ids"].astype(np.int64)
    assert rows_table(rows, TOKENIZED_ROWS).equals(pa.Table.from_pylist(rows, schema=TOKENIZED_ROWS))
