"""``packtool validate`` on a packed directory: the family-layout span rule against the one-pad rule.

The directory is ``make_corpus`` LLaVA records (80% one image, 5% two) tokenized for
qwen2.5-vl with the built-in vocabulary and packed with the defaults. Both rules run in the
same process on the same files: ``layout`` rebuilds every span with the family's layout
code and compares it id for id (what ``validate`` does); ``one-pad`` is the rule a
directory whose vision settings cannot be rebuilt falls back to (a span starts and ends
on its kind's placeholder). The ratio is the cost of the exact check.

    .venv/bin/python -m bench validate
"""

from __future__ import annotations

import os
from pathlib import Path

from bench import best_interleaved_s
from bench.corpus import make_corpus

CACHE = Path(os.environ.get("PACKTOOL_BENCH_DIR", "build/bench"))


def validate_bench(n: int, rounds: int = 3) -> dict:
    from packtool import PackConfig, TokenizeConfig, pack_dataset, tokenize_dataset
    from packtool import validate as v
    from packtool.shards import read_manifest

    root = CACHE / f"validate-{n}"
    corpus = make_corpus(root / "corpus", n, seed=5)
    tok, packed = root / "tokenized", root / "packed"
    if not (packed / ".packtool" / "manifest.json").is_file():
        tokenize_dataset([str(corpus)], tok, TokenizeConfig(media_root=str(root / "corpus"), model="qwen2.5-vl"))
        pack_dataset(tok, packed, PackConfig(media="reference"))
    layout = v.validate_dir(packed, check_media=False)
    if not layout["ok"]:
        raise RuntimeError(f"the bench directory does not validate: {layout['problems'][:3]}")
    rebuild = v._family_of

    def one_pad() -> None:
        v._family_of = lambda manifest: None  # the fallback rule, for the baseline only
        try:
            v.validate_dir(packed, check_media=False)
        finally:
            v._family_of = rebuild

    seconds = best_interleaved_s({"layout": lambda: v.validate_dir(packed, check_media=False), "one-pad": one_pad},
                                 rounds)
    counts = read_manifest(packed)["counts"]
    return {"samples": counts["samples_packed"], "packs": counts["packs"], **seconds}


def run(quick: bool = False) -> str:
    r = validate_bench(500 if quick else 5000)
    return "\n".join([
        f"### `packtool validate` on {r['samples']:,} qwen2.5-vl samples ({r['packs']:,} packs), best of 3 interleaved", "",
        "| span rule | seconds | ratio |",
        "| --- | ---: | ---: |",
        f"| one-pad (baseline) | {r['one-pad']:.2f} | 1.00 |",
        f"| family layout, id for id | {r['layout']:.2f} | {r['layout'] / r['one-pad']:.2f} |",
    ])
