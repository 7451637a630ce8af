"""Benchmarks run by ``make bench``: each ``bench/bench_*.py`` module exposes ``run(quick: bool) -> str``
returning a Markdown table measured side by side with its baseline in the same run."""
