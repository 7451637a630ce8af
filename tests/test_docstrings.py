"""Every ``>>>`` example in packtool's docstrings runs and prints what it shows.

Examples are documentation a reader copies; one that no longer runs (a renamed column, a
changed signature) is a wrong answer in the docs. Examples that need files or a model
are written as plain code blocks (``Example::``), not as ``>>>`` lines.
"""

from __future__ import annotations

import doctest
import importlib
import os
import pkgutil

import pytest

import packtool

#: Modules whose import runs a command (the CLI entry) are not example modules.
NOT_EXAMPLES = {"packtool.__main__"}
MODULES = sorted(m.name for m in pkgutil.walk_packages(packtool.__path__, "packtool.") if m.name not in NOT_EXAMPLES)


@pytest.fixture(autouse=True)
def _process_state_put_back():
    """Examples may set what a command sets (``storage.set_options`` writes the options into the
    environment for workers): put the environment and the file-system cache back, so no later
    test meets an example's endpoint."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    from packtool import storage

    storage._FILESYSTEMS.clear()


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    mod = importlib.import_module(name)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, report=True)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} fail (printed above)"


def test_the_examples_are_found():
    """The walk sees the modules with examples (a broken walk would pass every module vacuously)."""
    attempted = {name: doctest.testmod(importlib.import_module(name), report=False).attempted
                 for name in ("packtool.runs", "packtool.vision.qwen", "packtool.stats")}
    assert all(n > 0 for n in attempted.values()), attempted


@pytest.mark.parametrize("name", ["tokenize_dataset", "pack_dataset", "compute_stats"])
def test_help_of_a_library_entry_point_names_every_parameter(name):
    import inspect
    import re

    fn = getattr(packtool, name)
    doc = inspect.getdoc(fn)
    missing = [p for p in inspect.signature(fn).parameters if not re.search(rf"\b{p}\b", doc)]
    assert not missing, f"help(packtool.{name}) does not mention {missing}"
