"""Where ``tokenize`` spends its time, per stage, on the LLaVA-like bench corpus.

``python -m bench.profile_tokenize [N] [--cprofile] [--steps]`` generates the corpus of
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
anything). ``--steps`` splits the encoding into its own steps as well (:func:`_encode_steps`):
probing, rendering and staging the pieces; the tokenizer (its memo and tiktoken); the token
arrays and runs form; the stored table. Each batch's table is checked equal to
``encode_stored``'s, outside the timing, so the split cannot drift from what a task runs.
"""

from __future__ import annotations

import cProfile
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path


def _steps(path: Path, root: Path, n: int, out: Path, steps: bool = False) -> Counter:
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
        records = list(iter_records(path))[:n]
        split["read + JSON"] += cpu() - t
        t = cpu()
        samples = [parse_record(rec, str(path), row, cfg.format) for row, rec in records]
    split["parse records"] += cpu() - t
    names = SampleNames()  # a task names its rows apart, as it goes
    with _collector_paused() as after_batch, pq.ParquetWriter(out, TOKENIZED, **writer_options(TOKENIZED, TOKENIZED.empty_table())) as writer:
        for batch in _batched(samples, BATCH):
            if steps:
                table = _encode_steps(batch, ctx, names, split, cpu)
            else:
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


def _encode_steps(batch, ctx, names, split: Counter, cpu):
    """``rows.encode_stored`` of a batch of one-branch samples (every sample of the bench corpus),
    step by step, each step's CPU time added to ``split``; the table, checked equal to what
    ``encode_stored`` gives for the same batch (run after, outside the timing, with the
    tokenizer's memo as it was before the batch, so the memo's share stays in the split)."""
    from packtool import rows

    memo = dict(ctx.tokenizer.__dict__.get("_memo") or {})
    t = cpu()
    pieces, staged, rejected = rows._stage_samples(batch, ctx, Counter())
    split["probe + render + stage"] += cpu() - t
    if rejected or any(len(branches) != 1 for _, _, branches in staged):
        raise SystemExit("--steps times one-branch samples only (the bench corpus has nothing else)")
    t = cpu()
    encoded = rows._encode_texts(pieces, ctx)
    split["tokenizer (memo + tiktoken)"] += cpu() - t
    t = cpu()
    arrays = rows._PieceArrays(pieces, encoded)
    ranges = [branches[0] for _, _, branches in staged]
    spans = rows._single_spans(arrays, ranges)
    compact = rows._compact_pieces(arrays, ranges)
    split["token arrays + runs form"] += cpu() - t
    t = cpu()
    starts = arrays.starts
    meta = [[names.take(s.sample_id), s, probed, sp, int(starts[p1] - starts[p0]), 1]
            for (s, probed, _), (p0, p1), sp in zip(staged, ranges, spans, strict=True)]
    table = rows._stored_table(meta, compact)
    split["stored table"] += cpu() - t
    kept = ctx.tokenizer.__dict__.get("_memo")
    ctx.tokenizer._memo = memo
    names_again = rows.SampleNames()
    names_again.taken = set(names.taken) - {m[0] for m in meta}
    expected, _ = rows.encode_stored(batch, ctx, Counter(), names_again)
    ctx.tokenizer._memo = kept
    if not table.equals(expected):
        raise SystemExit("internal error: the step-by-step table differs from encode_stored's; update _encode_steps")
    return table


def main(argv: list[str]) -> int:
    from bench.bench_pack import _load
    from bench.bench_tokenize import make_corpus
    from bench.profile_pack import top_functions

    nums = [a for a in argv if a.isdigit()]
    n = int(nums[0]) if nums else 20_000
    tmp = Path(tempfile.mkdtemp(prefix="profile-tokenize-"))
    try:
        path = make_corpus(tmp, n)
        steps = "--steps" in argv
        _steps(path, tmp, n, tmp / "warm.parquet", steps)
        prof = cProfile.Profile() if "--cprofile" in argv else None
        if prof:
            prof.enable()
        split = _steps(path, tmp, n, tmp / "out.parquet", steps)
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
