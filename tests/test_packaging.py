"""What a newcomer installs: `make demo` only the runtime, heavy test-only packages with
`make test`, pip visible, and no deprecation warnings from the project's own files."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "torchvision", "transformers", "ray", "pandas", "polars", "duckdb", "datasets", "pytest")


def _make_rules() -> dict[str, tuple[list[str], list[str]]]:
    """``target -> (prerequisites, recipe lines)`` of the Makefile, variables expanded once."""
    text = (ROOT / "Makefile").read_text()
    variables = dict(re.findall(r"^([A-Z_]+) :?= ?(.*)$", text, re.M))

    def expand(s: str) -> str:
        for _ in range(3):
            s = re.sub(r"\$\(([A-Z_]+)\)", lambda m: variables.get(m.group(1), m.group(0)), s)
        return s

    rules: dict[str, tuple[list[str], list[str]]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("\t") and current:
            rules[current][1].append(expand(line.strip()))
        elif m := re.match(r"^([^\s#:=]+):(?!=)\s*(.*)$", line):
            current = expand(m.group(1))
            rules[current] = (expand(m.group(2)).split(), [])
        elif not line.strip().startswith("#"):
            current = None
    return rules


def _installs(rules, target: str, seen=None) -> list[str]:
    """Every pip install line ``target`` runs, its prerequisites' included."""
    seen = set() if seen is None else seen
    if target in seen or target not in rules:
        return []
    seen.add(target)
    prereqs, recipe = rules[target]
    out = [line for line in recipe if "pip install" in line]
    for p in prereqs:
        out += _installs(rules, p, seen)
    return out


def test_make_demo_installs_only_the_runtime_dependencies():
    rules = _make_rules()
    demo = _installs(rules, "demo")
    assert demo and all(re.search(r"-e \.$|--upgrade pip", line) for line in demo), demo
    assert not any(pkg in line for line in demo for pkg in HEAVY)
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in deps if re.split(r"[<>=\[ ]", d)[0] in HEAVY]


def test_make_test_installs_the_pinned_trainer_stack_and_the_readers():
    lines = " ".join(_installs(_make_rules(), "test"))
    for pin in ("torch==2.14.1", "torchvision==0.29.1", "transformers==5.24.0", "torchdata==0.11.0"):
        assert pin in lines
    assert "test" in re.search(r"-e '\.\[([^\]]*)\]'", lines).group(1).split(",")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {re.split(r"[<>=]", d)[0] for d in extras["test"]} == {"pandas", "polars", "duckdb", "datasets",
                                                                      # the S3-compatible server and clients of the storage tests
                                                                      "moto[server]", "boto3", "s3fs",
                                                                      # the GCS emulator process of tests/test_gcs.py
                                                                      "gcp-storage-emulator"}


def test_pip_shows_what_it_does():
    for target, (_, recipe) in _make_rules().items():
        for line in recipe:
            if "pip install" in line:
                assert " -q" not in line and "--quiet" not in line, (target, line)


def test_pyproject_uses_the_spdx_license_string():
    """setuptools deprecates ``license = {text = ...}`` (warned three times per install)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    requires = project["build-system"]["requires"]
    setuptools = next(r for r in requires if r.startswith("setuptools"))
    assert int(re.search(r">=(\d+)", setuptools).group(1)) >= 77  # PEP 639 license strings
