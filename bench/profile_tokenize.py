"""Where ``tokenize`` spends its time, per stage, on the LLaVA-like bench corpus.

``python -m bench.profile_tokenize [N] [--cprofile]`` generates the corpus of
``bench/bench_tokenize.py`` (N samples, default 20,000) and runs the steps of one tokenize
task in process, timing each in CPU seconds (the rate one free core gives; wall time on a
shared machine depends on the neighbours): reading and parsing the records, encoding them
into the Arrow table tokenize stores (``rows.encode_stored``: probes, template, tokenizer,
token columns in runs form, the other columns), writing Parquet, and the task's collection of
the young objects every 32 batches (timed apart and left out of the total: it traces every
sample parsed up front here, where a task holds one batch in flight). Each step runs once to
warm the image probes, then is measured with the tokenizer's memo of texts emptied (a task meets
its texts for the first time; the warm run would otherwise have answered every one of them).
``--cprofile`` also prints the top functions by own
time (cProfile slows Python-heavy code several times over, so only the ranking means
anything).
"""

from __future__ import annotations

import cProfile
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path


def _steps(path: Path, root: Path, n: int, out: Path) -> Counter:
    import pyarrow.parquet as pq

    from packtool import TokenizeConfig
    from packtool.formats import iter_records, parse_record
    from packtool.pipeline import BATCH, _batched, _collector_paused, _encode_context
    from packtool.rows import SampleNames, encode_stored
    from packtool.schema import TOKENIZED
    from packtool.shards import writer_options

    cfg = TokenizeConfig(media_root=str(root.resolve()))
    ctx = _encode_context(cfg)
    # every step starts with the tokenizer's memo empty, as a task does: a memo kept from the warm
    # run would answer every text of the measured one and leave tiktoken out of the profile
    ctx.tokenizer.__dict__.pop("_memo", None)
    cpu = time.process_time
    split: Counter = Counter()
    t = cpu()
    with _collector_paused():  # as a tokenize task runs
        samples = [parse_record(rec, str(path), row, cfg.format) for row, rec in iter_records(path)][:n]
    split["read + parse"] += cpu() - t
    names = SampleNames()  # a task names its rows apart, as it goes
    with _collector_paused() as after_batch, pq.ParquetWriter(out, TOKENIZED, **writer_options(TOKENIZED, TOKENIZED.empty_table())) as writer:
        for batch in _batched(samples, BATCH):
            t = cpu()
            table, _ = encode_stored(batch, ctx, Counter(), names)
            split["encode to Arrow table"] += cpu() - t
            t = cpu()
            writer.write_table(table, row_group_size=table.num_rows)
            split["Parquet write"] += cpu() - t
            # timed apart: the collection every 32 batches traces the young objects alive, here
            # every parsed sample of the step (parsed up front), in a task only the batch in flight
            t = cpu()
            after_batch()
            split["collector"] += cpu() - t
    return split


def main(argv: list[str]) -> int:
    from bench.bench_pack import _load
    from bench.bench_tokenize import make_corpus
    from bench.profile_pack import top_functions

    nums = [a for a in argv if a.isdigit()]
    n = int(nums[0]) if nums else 20_000
    tmp = Path(tempfile.mkdtemp(prefix="profile-tokenize-"))
    try:
        path = make_corpus(tmp, n)
        _steps(path, tmp, n, tmp / "warm.parquet")
        prof = cProfile.Profile() if "--cprofile" in argv else None
        if prof:
            prof.enable()
        split = _steps(path, tmp, n, tmp / "out.parquet")
        if prof:
            prof.disable()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    total = sum(v for k, v in split.items() if k != "collector")  # see _steps: the profile's own cost
    print(f"{n:,} samples in {total:.2f} CPU s, the collector apart: {n / total:,.0f} samples per CPU second, one "
          f"process, load {_load()}" + (" (under cProfile)" if prof else ""))
    print(" | ".join(f"{k} {v:.2f} s ({v / n * 1e6:.0f} us a sample)" for k, v in split.items()))
    if prof:
        print(top_functions(prof))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
