"""The README's examples, run: every ``console`` and ``pycon`` block is regenerated from what its
commands print now, and every ``python`` block is executed.

    python docs/readme.py            # check: exit 1 and show the differences when a block is stale
    python docs/readme.py --write    # regenerate the blocks in place (``make docs``)

Blocks run in order, in one scratch directory (``build/docs``) that holds ``examples/`` (a link
to the repository's) and the demo outputs ``build/demo/tokenized`` and ``build/demo/packed``
exactly as ``make demo`` writes them, so later blocks see what earlier ones wrote, as a reader
following along would. ``packtool`` is the command of the running interpreter's environment.

* ``console``: each ``$ COMMAND`` line runs in a shell; the lines after it, up to the next
  ``$``, are its output (stdout and stderr, as a terminal shows them). A plain
  ``packtool ARGS`` line (no quoting, redirection or pipe) runs in this process instead, to the
  same output without a second of start-up per command.
* ``pycon``: each ``>>> STATEMENT`` runs in one namespace per block; the lines after it are
  what the interpreter echoes.
* ``python``: executed as a whole, in a fresh namespace; it must not raise.

An HTML comment right before a block's opening fence steers it (several may stand in a row):

* ``<!-- docs: setup SHELL COMMAND -->`` runs first, unseen (e.g. damaging a copy for ``validate``);
* ``<!-- docs: requires torch transformers -->`` runs the block only where those modules import;
  elsewhere it is skipped, and said so (``--write`` keeps such a block as it is);
* ``<!-- docs: skip -->`` never runs the block;
* ``<!-- docs: run-by tests/test_x.py -->`` leaves the block to that test file, which executes it
  with checks of its own (on smaller data, where the block would take long on the demo's).

Other languages (``bash``, ``jsonl``, plain fences) are shown, never run.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import io
import logging
import os
import re
import shutil
import subprocess
import sys
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SCRATCH = ROOT / "build" / "docs"
RUN = ("console", "pycon", "python")

_FENCE = re.compile(r"^```(\w*)\s*$")
_MARK = re.compile(r"^<!-- docs: (setup|requires|skip|run-by)\s*(.*?)\s*-->$")


@dataclass
class Block:
    lang: str
    start: int  # index of the first line inside the fence
    end: int  # index of the closing fence
    lines: list[str]
    setup: list[str] = field(default_factory=list)
    requires: list[str] = field(default_factory=list)
    skip: bool = False
    run_by: str = ""  # the test file that executes this block (with checks of its own) instead

    @property
    def where(self) -> str:
        return f"README.md:{self.start}"


def parse(lines: list[str]) -> list[Block]:
    """The fenced blocks of a Markdown file with the ``docs:`` markers standing before them."""
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        block = Block(m.group(1), i + 1, j, lines[i + 1:j])
        k = i - 1
        while k >= 0 and (mark := _MARK.match(lines[k].strip())):
            kind, arg = mark.groups()
            if kind == "setup":
                block.setup.insert(0, arg)
            elif kind == "requires":
                block.requires += arg.split()
            elif kind == "run-by":
                block.run_by = arg
            else:
                block.skip = True
            k -= 1
        blocks.append(block)
        i = j + 1
    return blocks


def missing_modules(block: Block) -> list[str]:
    return [m for m in block.requires if importlib.util.find_spec(m) is None]


def _env() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(PYTHONUNBUFFERED="1", COLUMNS="120", PYTHONPATH=str(ROOT))  # stdout and stderr as they happen
    return env


#: A plain ``packtool ARGS`` line (an end-of-line comment allowed): nothing for a shell to expand,
#: redirect or chain, so the command can run in this process (see :func:`_packtool`).
_PLAIN = re.compile(r"^packtool(\s+[\w./:,=@%+-]+)*\s*(#.*)?$")


def _shell(command: str) -> str:
    if _PLAIN.match(command):
        return _packtool(command.split("#", 1)[0].split()[1:])[1]
    r = subprocess.run(command, shell=True, cwd=SCRATCH, env=_env(), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    return r.stdout


def _packtool(argv: list[str]) -> tuple[int, str]:
    """``packtool ARGV`` run in this process as the shell would run it (in the scratch directory,
    with :func:`_env`, stdout and stderr in one stream); ``(exit code, output)``.

    A subprocess would spend a second on imports before each of the README's commands; what a
    command prints does not depend on the process it runs in (its progress bars are off when
    stderr is not a terminal, in both). A bug's traceback becomes the output, as a shell shows it.
    """
    buf = io.StringIO()
    try:
        code = run_in_process(argv, cwd=SCRATCH, env=_env(), stdout=buf, stderr=buf)
    except Exception:  # noqa: BLE001 - shown in the block, which is then stale
        traceback.print_exc(file=buf)
        code = 1
    return code, buf.getvalue()


def run_in_process(argv: list[str], *, cwd: Path | str, env: dict[str, str], stdout: io.TextIOBase,
                   stderr: io.TextIOBase) -> int:
    """``packtool.cli.main(argv)`` as a fresh process would run it: in ``cwd``, with exactly ``env``,
    no log handler yet (``-v`` and warnings configure their own on ``stderr``), Python's default
    warning filters, ``sys.stdout``/``sys.stderr`` redirected. Everything process-wide it changes
    (environment, directory, root logger, warning filters) is put back afterwards, so many commands
    can run in one process (here and in tests/clirun.py). Returns the exit code; an exception other
    than the CLI's own errors propagates."""
    from packtool.cli import main

    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    root = logging.getLogger()
    saved_log = (root.level, root.handlers[:])
    try:
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        root.handlers[:] = []
        with warnings.catch_warnings(), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            warnings.resetwarnings()
            for category in (ResourceWarning, ImportWarning, PendingDeprecationWarning, DeprecationWarning):
                warnings.simplefilter("ignore", category)
            return main([str(a) for a in argv])
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        root.setLevel(saved_log[0])
        root.handlers[:] = saved_log[1]


def prepare() -> None:
    """A fresh scratch directory with the demo outputs of ``make demo``."""
    shutil.rmtree(SCRATCH, ignore_errors=True)
    SCRATCH.mkdir(parents=True)
    (SCRATCH / "examples").symlink_to(ROOT / "examples")
    for command in ("packtool tokenize examples/sample/data.jsonl --media-root examples/sample -o build/demo/tokenized --quiet",
                    "packtool pack build/demo/tokenized -o build/demo/packed --max-tokens 8192 --quiet"):
        code, out = _packtool(command.split()[1:])
        if code:
            raise RuntimeError(f"{command}: {out}")


def run_console(block: Block) -> list[str]:
    out: list[str] = []
    previous = ""
    for line in block.lines:
        if line.startswith("$ "):
            if out and not previous.strip():
                out.append("")  # the blank line that separated two commands stays
            out.append(line)
            text = _shell(line[2:]).rstrip("\n")
            out += text.split("\n") if text else []
        previous = line
    return out


def run_pycon(block: Block) -> list[str]:
    namespace: dict = {"__name__": "__readme__"}
    out: list[str] = []
    cwd = os.getcwd()
    os.chdir(SCRATCH)
    try:
        for line in block.lines:
            if not line.startswith(">>> "):
                continue
            out.append(line)
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                code = compile(line[4:], block.where, "single")
                exec(code, namespace)  # noqa: S102 - the README's own example
            out += buf.getvalue().rstrip("\n").split("\n") if buf.getvalue() else []
    finally:
        os.chdir(cwd)
    return out


def run_python(block: Block) -> str | None:
    """``None`` when the block runs; else the traceback."""
    cwd = os.getcwd()
    os.chdir(SCRATCH)
    try:
        exec(compile("\n".join(block.lines), block.where, "exec"), {"__name__": "__readme__"})  # noqa: S102
    except Exception:  # noqa: BLE001 - reported as the finding
        return traceback.format_exc()
    finally:
        os.chdir(cwd)
    return None


def check(write: bool = False, readme: Path = README, scratch: Path | None = None) -> tuple[list[str], list[str]]:
    """Run every block; return ``(problems, skipped)``. With ``write`` stale blocks are rewritten.

    ``scratch`` replaces ``build/docs`` as the directory the blocks run in.
    """
    global SCRATCH
    if scratch is not None:
        SCRATCH = Path(scratch)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # examples read local files; nothing is fetched
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    lines = readme.read_text(encoding="utf-8").split("\n")
    prepare()
    problems, skipped = [], []
    edits: list[tuple[Block, list[str]]] = []
    for block in parse(lines):
        if block.lang not in RUN or block.skip:
            continue
        if block.run_by:  # the named file must exist and read the README
            by = ROOT / block.run_by
            if not by.is_file() or "README.md" not in by.read_text(encoding="utf-8"):
                problems.append(f"{block.where}: {block.run_by}, named to run this block, does not read README.md")
            continue
        if missing := missing_modules(block):
            skipped.append(f"{block.where}: {block.lang} block needs {', '.join(missing)}")
            continue
        for command in block.setup:
            _shell(command)
        if block.lang == "python":
            if (err := run_python(block)) is not None:
                problems.append(f"{block.where}: python block raised\n{err}")
            continue
        got = run_console(block) if block.lang == "console" else run_pycon(block)
        if got != block.lines:
            edits.append((block, got))
            if not write:
                diff = difflib.unified_diff(block.lines, got, "README.md", "what it prints now", lineterm="", n=1)
                problems.append(f"{block.where}: {block.lang} block is stale (make docs)\n" + "\n".join(diff))
    if write and edits:
        for block, got in sorted(edits, key=lambda e: -e[0].start):
            lines[block.start:block.end] = got
        readme.write_text("\n".join(lines), encoding="utf-8")
    return problems, skipped


def main(argv: list[str]) -> int:
    write = "--write" in argv
    problems, skipped = check(write=write)
    for s in skipped:
        print(f"skipped {s}", file=sys.stderr)
    if write:
        from packtool.plotting import write_demo_figure

        write_demo_figure(SCRATCH / "build" / "demo", ROOT / "docs" / "demo-stats.png")
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
