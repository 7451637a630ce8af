"""Docs as tests: every console and pycon block of the README is what its commands print now,
every python block runs, and the figure shows the current demo data. `make docs` rewrites
stale blocks and the figure (docs/readme.py says how blocks are marked)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("readme_runner", ROOT / "docs" / "readme.py")
readme = importlib.util.module_from_spec(spec)
sys.modules["readme_runner"] = readme
spec.loader.exec_module(readme)


@pytest.mark.slow
@pytest.mark.jit
def test_every_readme_block_is_current(tmp_path):
    problems, skipped = readme.check(scratch=tmp_path / "docs")
    for s in skipped:
        print(f"skipped {s}")
    assert not problems, "\n\n".join(problems)


def test_the_block_markers_are_parsed():
    lines = ["text", "<!-- docs: setup touch a -->", "<!-- docs: requires torch transformers -->", "```python",
             "import torch", "```", "<!-- docs: skip -->", "```console", "$ false", "```", "```bash", "ls", "```"]
    a, b, c = readme.parse(lines)
    assert (a.lang, a.setup, a.requires, a.skip, a.lines) == ("python", ["touch a"], ["torch", "transformers"], False,
                                                              ["import torch"])
    assert (b.lang, b.skip) == ("console", True) and c.lang == "bash"
    assert readme.missing_modules(readme.Block("python", 0, 0, [], requires=["no_such_module_x"])) == ["no_such_module_x"]
    (d,) = readme.parse(["<!-- docs: run-by tests/test_reader.py -->", "```python", "loop()", "```"])
    assert (d.run_by, d.skip) == ("tests/test_reader.py", False)


def test_a_block_left_to_a_test_file_is_not_run_but_the_file_must_read_the_readme(tmp_path):
    doc = tmp_path / "README.md"
    doc.write_text("<!-- docs: run-by tests/test_reader.py -->\n```python\nraise SystemExit(1)\n```\n\n"
                   "<!-- docs: run-by tests/no_such_test.py -->\n```python\nraise SystemExit(1)\n```\n")
    problems, skipped = readme.check(readme=doc, scratch=tmp_path / "s")
    assert skipped == [] and problems == ["README.md:7: tests/no_such_test.py, named to run this block, does not read README.md"]


def test_a_stale_console_block_is_reported_and_rewritten(tmp_path):
    doc = tmp_path / "README.md"
    doc.write_text("```console\n$ echo hello\nhullo\n```\n\n```pycon\n>>> 1 + 1\n3\n```\n\n"
                   "<!-- docs: requires no_such_module_x -->\n```python\nraise SystemExit(1)\n```\n")
    problems, skipped = readme.check(readme=doc, scratch=tmp_path / "s")
    assert len(problems) == 2 and "hullo" in problems[0] and skipped == ["README.md:12: python block needs no_such_module_x"]
    readme.check(write=True, readme=doc, scratch=tmp_path / "s")
    assert doc.read_text().startswith("```console\n$ echo hello\nhello\n```\n\n```pycon\n>>> 1 + 1\n2\n```")
    assert readme.check(readme=doc, scratch=tmp_path / "s")[0] == []


def test_the_figure_shows_the_current_demo_data(demo_dirs):
    pytest.importorskip("matplotlib")
    from packtool.plotting import figure_digest
    from packtool.stats import load_stats_data, summarize

    data = load_stats_data(demo_dirs["tokenized"], demo_dirs["packed"])
    with Image.open(ROOT / "docs" / "demo-stats.png") as im:
        recorded = im.info.get("Description", "")
    assert recorded == f"packtool stats figure, data sha256 {figure_digest(data, summarize(data))}", \
        "docs/demo-stats.png is stale: run make docs"


def test_every_command_and_option_is_in_the_readme():
    """A flag that ``--help`` offers and the README never names is a flag no reader finds."""
    import re

    import typer

    from packtool.cli import app

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    group = typer.main.get_command(app)
    missing = [f"packtool {name}: no ### `packtool {name}` section" for name in group.commands
               if f"### `packtool {name}`" not in text]
    for name, command in [("", group), *group.commands.items()]:
        for param in command.params:
            names = [o for o in [*param.opts, *param.secondary_opts] if o.startswith("-") and o != "--help"]
            if names and not any(re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", text) for o in names):
                missing.append(f"packtool {name} {'/'.join(names)}".replace("  ", " "))
    assert not missing, "not in README.md: " + "; ".join(missing)
