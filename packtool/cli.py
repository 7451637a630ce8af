"""The ``packtool`` command line: parse, build a frozen config, make one library call, render.

This is the one place that turns outcomes into exit codes: :class:`~packtool.errors.PacktoolError`
prints ``Error: ...`` on stderr and exits 1, a usage error prints click's usage message and exits 2,
Ctrl-C prints ``Error: interrupted ...`` and exits 130 (while this module loads and after
:func:`main` returns too: :mod:`packtool.launcher`, the entry point, handles it there), SIGTERM (a scheduler stopping the job) prints
``Error: terminated ...`` and exits 143. Progress bars go to stderr, results to stdout.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import math
import sys
from pathlib import Path
from typing import Annotated, Literal

import typer

from . import __version__
from .config import INT32_MAX, LAYOUTS, MEDIA_MODES, OVERSIZE_POLICIES, PackConfig, TokenizeConfig
from .errors import InputError, OutputError, PacktoolError
from .executors import ExecutorConfig, sigterm_as_interrupt
from .formats import FORMATS
from .launcher import EXIT_INTERRUPT, EXIT_TERMINATED, INTERRUPTED, TERMINATED, release
from .mixture import GROUP_BY, SAMPLES_PER_TASK
from .pipeline import ON_ERROR
from .schema import LAYOUTS as LAYOUT_VERSIONS
from .shards import ERRORS, MANIFEST
from .storage import join
from .templates import TEMPLATES
from .vision import EXIF_MODES, FAMILIES, SETTING_LIMITS, VIDEO_SAMPLERS

__all__ = ["app", "main", "run"]

#: ``--format`` choices (``qwen-vl`` is spelled with a dash on the command line).
FormatChoice = enum.Enum("FormatChoice", [(f.replace("-", "_"), f) for f in FORMATS], type=str)
# Enumerated options as Literal types, so --help lists every choice and a typo is a usage error.
TemplateChoice = Literal[tuple(TEMPLATES)]  # type: ignore[valid-type]
OversizeChoice = Literal[OVERSIZE_POLICIES]  # type: ignore[valid-type]
SweepOversizeChoice = Literal[tuple(p for p in OVERSIZE_POLICIES if p != "fail")]  # type: ignore[valid-type]
MediaChoice = Literal[MEDIA_MODES]  # type: ignore[valid-type]
LayoutChoice = Literal[LAYOUTS]  # type: ignore[valid-type]
OnErrorChoice = Literal[ON_ERROR]  # type: ignore[valid-type]
ExifChoice = Literal[EXIF_MODES]  # type: ignore[valid-type]
VideoSamplerChoice = Literal[VIDEO_SAMPLERS]  # type: ignore[valid-type]
ExecutorChoice = Literal["local", "ray"]
GroupByChoice = Literal[GROUP_BY]  # type: ignore[valid-type]
#: What --tokenizer accepts, said once for every command that takes it.
TOKENIZER_FORMS = ("default: the embedded Qwen2/Qwen2.5 vocabulary; qwen3: it with Qwen3's tool and think tokens "
                   "(the default for --template qwen3-vl); "
                   "or a tokenizer.json file, a model directory "
                   "(its tokenizer.json and tokenizer_config.json), or hf:ORG/NAME from the local Hugging Face "
                   "cache (never downloaded)")

app = typer.Typer(
    name="packtool",
    help=(
        "Offline, exact packing of vision-language training data into Parquet shards.\n\n"
        "Start with `tokenize` (raw corpus + media -> one row per sample), then `pack` (samples -> "
        "training sequences), then `stats` (fill, waste, drops). `inspect`, `validate`, `sweep` and "
        "`merge` work on their outputs.\n\n"
        "Example:\n\n"
        "  packtool tokenize data.jsonl --media-root media -o tok\n\n"
        "  packtool pack tok -o packed --max-tokens 8192\n\n"
        "  packtool stats packed"
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

# Flag defaults come from the configs, so the CLI, sweep and the library never disagree.
_PACK_DEFAULTS = PackConfig()

def _location(value):
    """A path argument as the library takes it: a bucket URL stays a string (``Path`` would fold its
    ``//``), a local path becomes a ``Path`` exactly as before."""
    from .storage import is_url

    if value is None:
        return None
    if isinstance(value, list | tuple):
        return [_location(v) for v in value]
    return value if is_url(value) else Path(value)


# Options declared once; flags are the kebab-case names of library parameters.
Output = Annotated[str, typer.Option("--output", "-o", callback=_location,
                                     help="Output directory or bucket prefix (s3://BUCKET/PREFIX, gs://...).")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
Overwrite = Annotated[bool, typer.Option(
    "--overwrite",
    help="Start over: replace a finished run (even of the same settings) or a run made with other settings (only the files it wrote are removed), or write into a non-empty directory that holds no packtool run.")]
def _number(lo: float, hi: float | None = None):
    """The callback of a decimal option: its value when it lies in ``lo..hi`` (``hi`` None: no upper
    bound). ``nan`` is no number: typer's own range check let it through to a message that read
    as if it were above the bound ("should be less than or equal to 1"); nor is ``inf``, which an
    unbounded option (``--fail-above-ratio``) took, and ``stats --json`` then printed as
    ``Infinity``, which no strict JSON parser reads."""

    def check(value: float | None) -> float | None:
        if value is None:
            return None
        if not math.isfinite(value):  # nan, or inf: a limit JSON cannot write (--json would print Infinity)
            raise typer.BadParameter(f"{value} is not a number; give one from {lo:g}" + (f" to {hi:g}" if hi is not None else " up"))
        _check_bounds(value, lo, hi)
        return value

    return check


def _check_bounds(value: float, lo: float, hi: float | None, which: str = "Input") -> None:
    """A usage error for ``value`` outside ``lo..hi`` (``hi`` None: no upper bound), worded as typer
    words an integer option's bounds."""
    def shown(x: float) -> str:
        return f"{x:g}" if isinstance(x, float) else str(x)

    if value < lo:
        raise typer.BadParameter(f"{which} should be greater than or equal to {shown(lo)}")
    if hi is not None and value > hi:
        raise typer.BadParameter(f"{which} should be less than or equal to {shown(hi)}")


# Counts end up in int32 columns (config.INT32_MAX); the processor settings have the bounds of vision.SETTING_LIMITS.
MaxTokens = Annotated[int, typer.Option(min=1, max=INT32_MAX, help="Tokens per pack (sequence length).")]
MaxVisionUnits = Annotated[
    int | None, typer.Option(min=0, max=INT32_MAX, help="Vision units per pack (default: the model family's default).")
]
TextWeight = Annotated[int, typer.Option(min=1, max=INT32_MAX, help="Objective weight of a token.")]
# Where tasks run (executors.ExecutorConfig); none of these changes the output bytes.
Workers = Annotated[int | None, typer.Option(min=1, help="Parallel tasks on this machine (default: every core; 1: in-process).")]
Executor = Annotated[ExecutorChoice, typer.Option(help="local: a process pool; ray: Ray tasks (pip install packtool[ray]).")]
RayAddress = Annotated[str | None, typer.Option(help="Ray cluster to join, e.g. auto or ray://head:10001 (needs --executor ray).")]
Rank = Annotated[int, typer.Option(min=0, help="This process's share of the tasks (Slurm/Kubernetes arrays).")]
WorldSize = Annotated[int, typer.Option(min=1, help="Number of shares; run `packtool merge DIR` when every rank is done.")]
MaxErrors = Annotated[int | None, typer.Option(min=0, help="Fail when more rows than this are rejected (default: no limit).")]
OnError = Annotated[OnErrorChoice, typer.Option(help="skip: record a bad row in .packtool/errors.jsonl and go on; fail: stop at the first.")]


class _Bar:
    """Progress sink for the library: ``bar(n)`` adds samples, ``bar.set_total(n)`` sets the ETA's target."""

    def __init__(self, bar) -> None:
        self.bar = bar

    def __call__(self, n: int) -> None:
        self.bar.update(n)

    def set_total(self, total: int) -> None:
        self.bar.total = total
        self.bar.refresh()


@contextlib.contextmanager
def _progress(desc: str, quiet: bool, total: int | None = None):
    if quiet:
        yield None
        return
    from tqdm import tqdm

    # disable=None: a bar only when stderr is a terminal, so logs and pipes stay clean
    with tqdm(total=total, desc=desc, unit=" samples", file=sys.stderr, dynamic_ncols=True, leave=False,
              disable=None) as bar:
        yield _Bar(bar)


def _count(n: int, word: str) -> str:
    """``n`` and ``word``, plural unless ``n`` is 1: ``_count(1, "shard")`` is ``'1 shard'``."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _rank_line(result: dict, output: Path) -> str:
    done, missing = result["tasks"], result["tasks_missing"]
    return (f"rank {result['rank']} of {result['world_size']}: {done} task{'' if done == 1 else 's'} done, "
            f"{missing} {'task of other ranks remains' if missing == 1 else 'tasks of other ranks remain'}; "
            f"when all are done run: packtool merge {output}")


def _share_json(full: dict, result: dict) -> dict:
    """``--json`` of a rank that is not the last to finish: ``full``, the keys a full run prints,
    counted over this rank's tasks; then what marks a share (``partial``, ``kind``, ``rank``,
    ``world_size``, ``tasks_missing``), and the counts nested and the shard list (``shard_files``)
    as the library returns them."""
    return {**full, "partial": True, "kind": result["kind"], "rank": result["rank"],
            "world_size": result["world_size"], "tasks_missing": result["tasks_missing"],
            "counts": result["counts"], "shard_files": result["shards"]}


def _out(text: str) -> None:
    """Print a result on stdout. A stdout that cannot take it (a full disk under ``> stats.json``, an
    I/O error) is a problem the user can fix, shown as one ``Error:`` line (exit 1), not a traceback;
    a closed pipe (``| head``) stays click's: exit 1, nothing printed."""
    try:
        typer.echo(text)
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise OutputError(f"cannot write to standard output: {exc.strerror or exc}; the output was not (wholly) "
                          "printed: free space where stdout goes, or send it elsewhere, and run the command again") from None


def _emit_json(obj: dict) -> None:
    _out(json.dumps(obj, indent=2, sort_keys=False))


@contextlib.contextmanager
def _flag_errors(ctx: typer.Context):
    """Build a frozen config from the command's flags: a ``ConfigError`` it raises names flags that
    cannot work as given (an unknown ``--model``, ``--min-pixels`` above ``--max-pixels``), so the
    command line shows it as a usage error (exit 2, the usage lines), as it shows a value out of
    a flag's range. From Python the same check is a ``ConfigError``."""
    from .errors import ConfigError

    try:
        yield
    except ConfigError as exc:
        ctx.fail(str(exc))


@app.command()
def tokenize(
    ctx: typer.Context,
    inputs: Annotated[list[str], typer.Argument(
        metavar="INPUT", callback=_location, help="Input files or directories (JSON, JSONL, .gz, .zst, Parquet); directories are searched "
        "recursively, skipping hidden entries and packtool outputs.")],
    output: Output,
    media_root: Annotated[str, typer.Option(callback=_location, help="Directory (or bucket prefix) media paths resolve under.")] = ".",
    model: Annotated[str, typer.Option(help=f"Vision family: {', '.join(FAMILIES)}, or fixed:N (N tokens per image).")] = "qwen2.5-vl",
    template: Annotated[TemplateChoice | None, typer.Option(help=(
        "Chat template (default: the model's own: qwen3-vl for --model qwen3-vl, molmo2 for molmo2, chatml for the "
        "others)."))] = None,
    tokenizer: Annotated[str | None, typer.Option(metavar="<path|hf:ORG/NAME>", help=f"Tokenizer ({TOKENIZER_FORMS}).")] = None,
    format: Annotated[FormatChoice, typer.Option("--format", help="Input record format; auto detects it per record.")] = FormatChoice.auto,
    system_prompt: Annotated[str | None, typer.Option(help="System prompt (default: the template's).")] = None,
    min_pixels: Annotated[int | None, typer.Option(min=1, max=SETTING_LIMITS["min_pixels"], help="Image pixel floor (families with a pixel budget).")] = None,
    max_pixels: Annotated[int | None, typer.Option(min=1, max=SETTING_LIMITS["max_pixels"], help="Image pixel cap (families with a pixel budget).")] = None,
    max_frames: Annotated[int | None, typer.Option(min=1, max=SETTING_LIMITS["max_frames"], help="Most frames sampled per video (default: the family's).")] = None,
    fps: Annotated[float | None, typer.Option(callback=_number(0.01, SETTING_LIMITS["fps"]), help=f"Video sampling rate, 0.01 to {SETTING_LIMITS['fps']:g} (qwen families; default 2).")] = None,
    max_crops: Annotated[int | None, typer.Option(min=1, max=SETTING_LIMITS["max_crops"], help="Molmo2 crops per image (default 8).")] = None,
    max_num: Annotated[int | None, typer.Option(min=1, max=SETTING_LIMITS["max_num"], help="InternVL tiles per image (default 12).")] = None,
    exif: Annotated[ExifChoice | None, typer.Option(help="EXIF orientation / video rotation (default: what the family's loader does).")] = None,
    video_sampler: Annotated[VideoSamplerChoice | None, typer.Option(help=(
        "qwen3-vl: count videos as the transformers processor samples and resizes them (processor, the default) "
        "or as qwen-vl-utils' fetch_video does, each frame capped at 768 tokens (qwen-vl-utils: for training "
        "that prepares videos with it)."))] = None,
    rows_per_shard: Annotated[int, typer.Option(min=1, help="Rows per tokenized shard.")] = 50_000,
    max_errors: Annotated[int | None, typer.Option(min=0, help="Fail when more rows than this are rejected.")] = None,
    max_branches: Annotated[int | None, typer.Option(min=1, help="Branches per message tree; more go to another tree on the same media.")] = None,
    max_tokens: Annotated[int | None, typer.Option(min=1, max=INT32_MAX, help="Tokens per message tree; branches beyond go to another tree on the same media.")] = None,
    group_by_media: Annotated[bool, typer.Option("--group-by-media", help="Merge records that use the same media file into one message tree.")] = False,
    reasoning_loss: Annotated[bool, typer.Option("--reasoning-loss/--no-reasoning-loss", help="Whether kept reasoning (qwen3-vl <think>...</think>) carries loss; the answer always does.")] = True,
    on_error: OnError = "skip",
    workers: Workers = None,
    executor: Executor = "local",
    ray_address: RayAddress = None,
    rank: Rank = 0,
    world_size: WorldSize = 1,
    overwrite: Overwrite = False,
    quiet: Quiet = False,
    as_json: AsJson = False,
) -> None:
    """Tokenize raw corpora into tokenized shards (one row per sample).

    Example:

      packtool tokenize data.jsonl --media-root images -o tok
    """
    from .pipeline import tokenize_dataset

    with _flag_errors(ctx):
        cfg = TokenizeConfig(model=model, template=template, tokenizer=tokenizer, format=format.value,
                             media_root=str(media_root), system_prompt=system_prompt, min_pixels=min_pixels,
                             max_pixels=max_pixels, max_frames=max_frames, fps=fps, max_crops=max_crops,
                             max_num=max_num, exif=exif, video_sampler=video_sampler,
                             rows_per_shard=rows_per_shard, max_errors=max_errors,
                             max_branches=max_branches, max_tokens=max_tokens, group_by_media=group_by_media,
                             reasoning_loss=reasoning_loss)
        ex = ExecutorConfig(executor=executor, workers=workers, ray_address=ray_address, rank=rank,
                            world_size=world_size)
    with _progress("tokenize", quiet) as bar:
        manifest = tokenize_dataset(inputs, output, cfg, progress=bar, overwrite=overwrite, on_error=on_error, ex=ex)
    c = manifest["counts"]
    if manifest.get("partial"):
        full = {"output": str(output), **c, "tasks": manifest["tasks"], "shards": len(manifest["shards"])}
        _emit_json(_share_json(full, manifest)) if as_json else _out(_rank_line(manifest, output))
        return
    if as_json:
        _emit_json({"output": str(output), **c, "shards": len(manifest["shards"])})
        return
    _out(f"{_count(c['samples'], 'sample')} from {_count(c['rows_in'], 'row')} in {_count(len(manifest['shards']), 'shard')} -> {output}")
    _echo_rejected(c, output)
    if not c["rows_in"]:
        _out("warning: the inputs hold no records (empty files, or an empty JSON list); check the paths "
                   "given, or that the step that writes them ran")
    missing = (c.get("rejected_by_reason") or {}).get("missing_media", 0)
    if missing > c["rows_in"] / 2:  # one missing file is a bad row; most of them, a wrong root
        root = manifest.get("config", {}).get("media_root")
        _out(f"warning: {missing:,} of {_count(c['rows_in'], 'row')} name media not found under --media-root "
                   f"{root!r}: check that it is the folder the records' media paths are relative to")
    if c.get("folded_branches"):
        n = c["folded_branches"]
        its, what = ("its", "1 branch lies") if n == 1 else ("their", f"{n:,} branches lie")
        _out(f"note: {what} wholly inside the shared prefix of {its} message tree (a repeat, or a prefix of "
                   f"every other branch): {its} tokens train once, in the prefix, not as a branch of {its} own "
                   "(counts: folded_branches)")
    if c.get("repeated_ids"):
        n = c["repeated_ids"]
        _out(f"warning: {_count(n, 'sample')} {'is' if n == 1 else 'are'} stored as NAME#d1 (#d2, ...): an earlier "
                   "sample of the same task (input slice) holds the name (a repeated id, or a split tree's ID#1, "
                   "ID#2, ...), and a name stands for one sample; give each record an id of its own")


def _echo_rejected(counts: dict, output: str | None) -> None:
    """The line a run's rejected rows get, by reason, and where they are listed."""
    if counts.get("rejected"):
        reasons = ", ".join(f"{k} {v}" for k, v in counts["rejected_by_reason"].items())
        where = f"; see {join(output, ERRORS)}" if output is not None else " (a run lists them in errors.jsonl)"
        _out(f"{_count(counts['rejected'], 'row')} rejected ({reasons}){where}")


@app.command()
def pack(
    ctx: typer.Context,
    inputs: Annotated[list[str] | None, typer.Argument(
        metavar="TOKENIZED", callback=_location,
        help="Tokenized directory or bucket prefix; several make a mixture (see --rates).")] = None,
    output: Annotated[str | None, typer.Option("--output", "-o", callback=_location,
                                               help="Output directory or bucket prefix.")] = None,
    rates: Annotated[str | None, typer.Option(help="Epoch multiplier per input, in order, e.g. 1.0,2.5,0.2 (2.5: every sample twice plus a seeded half).")] = None,
    mixture: Annotated[Path | None, typer.Option(help="Mixture JSON file: sources with a rate or a target sample count (instead of inputs and --rates).")] = None,
    seed: Annotated[int | None, typer.Option(min=0, help="Seed of a mixture's down-sampled subsets (default 0, recorded in the manifest); a mixture only.")] = None,
    group_by: Annotated[GroupByChoice, typer.Option(help="none: packs mix sources; source: a pack never holds two sources.")] = "none",
    samples_per_task: Annotated[int | None, typer.Option(min=1, help=f"Samples of a mixture's stream per pack task (each task packs with its own buffer; default {SAMPLES_PER_TASK:,}); a mixture only.")] = None,
    max_tokens: MaxTokens = _PACK_DEFAULTS.max_tokens,
    max_vision_units: MaxVisionUnits = None,
    buffer_size: Annotated[int, typer.Option(min=1, help="Samples the knapsack chooses from per pack.")] = _PACK_DEFAULTS.buffer_size,
    text_weight: TextWeight = _PACK_DEFAULTS.text_weight,
    vision_weight: Annotated[int, typer.Option(min=0, max=INT32_MAX, help="Objective weight of a vision unit.")] = _PACK_DEFAULTS.vision_weight,
    token_granularity: Annotated[int, typer.Option(min=1, help="Token sizes round up to this in the DP.")] = _PACK_DEFAULTS.token_granularity,
    oversize: Annotated[OversizeChoice, typer.Option(help="Samples that never fit: drop (listed in .packtool/errors.jsonl), truncate (text-only), alone (a pack of their own), fail.")] = "drop",
    max_samples_per_pack: Annotated[int | None, typer.Option(min=1, help="Cap on samples in one pack.")] = None,
    media: Annotated[MediaChoice, typer.Option(help="embed: media bytes (images) and JPEG frames (videos) in the packs; reference: paths only.")] = "embed",
    media_root: Annotated[str | None, typer.Option(callback=_location, help="Media root (default: the one tokenize used).")] = None,
    packs_per_shard: Annotated[int, typer.Option(min=1, help="Packs per output shard.")] = _PACK_DEFAULTS.packs_per_shard,
    frame_quality: Annotated[int, typer.Option(min=1, max=100, help="JPEG quality of embedded video frames.")] = 90,
    layout: Annotated[LayoutChoice, typer.Option(help=f"runs: placeholder runs stored once (schema v{LAYOUT_VERSIONS['runs']}; packtool.reader expands them); full: every token stored (schema v{LAYOUT_VERSIONS['full']}), for reading the Parquet directly.")] = "runs",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Plan only; print stats, write nothing (the whole run, whatever --rank).")] = False,
    max_errors: MaxErrors = None,
    on_error: OnError = "skip",
    workers: Workers = None,
    executor: Executor = "local",
    ray_address: RayAddress = None,
    rank: Rank = 0,
    world_size: WorldSize = 1,
    overwrite: Overwrite = False,
    quiet: Quiet = False,
    as_json: AsJson = False,
) -> None:
    """Pack tokenized samples into training sequences with an exact 2-D knapsack.

    Example:

      packtool pack tok -o packed --max-tokens 8192 --max-vision-units 128

      packtool pack tok_a tok_b tok_c --rates 1.0,2.5,0.2 -o packed
    """
    from .pipeline import pack_dataset

    src = _pack_source(ctx, inputs or [], rates, mixture, seed=seed, group_by=group_by, samples_per_task=samples_per_task)
    if output is None and not dry_run:  # -o is optional only for --dry-run: missing, it is a usage error
        ctx.fail("pack needs -o/--output (or --dry-run to only plan)")
    with _flag_errors(ctx):
        cfg = PackConfig(max_tokens=max_tokens, max_vision_units=max_vision_units, buffer_size=buffer_size,
                         text_weight=text_weight, vision_weight=vision_weight, token_granularity=token_granularity,
                         oversize=oversize, max_samples_per_pack=max_samples_per_pack, media=media,
                         packs_per_shard=packs_per_shard, frame_quality=frame_quality, layout=layout)
        ex = ExecutorConfig(executor=executor, workers=workers, ray_address=ray_address, rank=rank,
                            world_size=world_size)
    with _progress("pack", quiet) as bar:
        result = pack_dataset(src, output or Path("."), cfg, progress=bar, overwrite=overwrite, dry_run=dry_run,
                              media_root=media_root, max_errors=max_errors, on_error=on_error, ex=ex)
    if result.get("partial"):  # never a dry run, which writes nothing and so has no ranks to wait for
        # a mixture's per-source counts (source_*) stay in the nested counts: a full run folds them
        # into its mixture summary, which is made once, of the whole run
        counts = {k: v for k, v in result["counts"].items() if not k.startswith("source_")}
        full = {"output": str(output), "dry_run": False, **result["capacities"], **counts, "tasks": result["tasks"]}
        _emit_json(_share_json(full, result)) if as_json else _out(_rank_line(result, output))
        return
    c = result["counts"]
    plan = None
    mix = None
    if "mixture" in result:
        from .stats import mixture_summary

        mix = mixture_summary(result["mixture"])
    elif dry_run:  # the same statistics `packtool stats` shows, from the plan alone
        from .stats import plan_stats

        plan = plan_stats(src, result)
    if as_json:
        _emit_json({"output": None if dry_run else str(output), "dry_run": dry_run, **result["capacities"], **c,
                    **({"stats": plan} if plan is not None else {}), **({"mixture": mix} if mix is not None else {})})
        return
    lb = c["lower_bound"]
    ratio = f" ({c['packs'] / lb:.3f}x)" if lb else ""
    where = "planned (dry run)" if dry_run else f"-> {output}"
    _out(f"{_count(c['samples_packed'], 'sample')} in {_count(c['packs'], 'pack')}, lower bound {lb:,}{ratio} {where}")
    if c["dropped"] or c["truncated"] or c["alone"]:
        _out(f"oversize: {c['dropped']:,} dropped, {c['truncated']:,} truncated, {c['alone']:,} alone")
    _echo_rejected(c, None if dry_run else output)
    if not c.get("samples_in"):  # an empty tokenize run upstream: the trainer's reader refuses the output
        _out("warning: the tokenized input holds no samples, so there is nothing to train on; check the "
                   "tokenize run that wrote it (packtool stats TOKENIZED)")
    if plan is not None:
        from .stats import render_stats

        _out(render_stats(plan))
    if mix is not None:
        from .stats import render_mixture

        _out(render_mixture(mix))


def _pack_source(ctx: typer.Context, inputs: list[Path], rates: str | None, mixture: Path | None,
                 seed: int | None, samples_per_task: int | None, **kw):
    """What ``pack`` packs: one tokenized directory as it is, or a :class:`~packtool.mixture.Mixture`.

    ``seed`` and ``samples_per_task`` are ``None`` when not given: a mixture then uses 0 and
    ``SAMPLES_PER_TASK``, and one directory packed as it is (nothing random to seed, its tasks
    are its shards) refuses a given one (a usage error) rather than ignore it.
    """
    from .mixture import Mixture, load_mixture

    plain = mixture is None and len(inputs) == 1 and rates is None and kw["group_by"] == "none"
    if plain and seed is not None:
        ctx.fail("--seed only applies to a mixture (--rates, --mixture FILE or several TOKENIZED inputs), where it "
                 "picks the down-sampled subsets; one tokenized directory is packed whole, with no random choice: "
                 "drop --seed, or give --rates to sample it")
    if plain and samples_per_task is not None:
        ctx.fail("--samples-per-task only applies to a mixture (--rates, --mixture FILE or several TOKENIZED "
                 "inputs); one tokenized directory is packed one task per tokenized shard: drop --samples-per-task, "
                 "or re-run tokenize with another --rows-per-shard")
    kw["seed"] = 0 if seed is None else seed
    kw["samples_per_task"] = SAMPLES_PER_TASK if samples_per_task is None else samples_per_task
    if mixture is not None:
        if rates is not None or inputs:
            ctx.fail("--mixture names the sources and their rates itself; drop the TOKENIZED inputs and --rates, or "
                     "drop --mixture")
        return load_mixture(mixture, **kw)
    if not inputs:
        ctx.fail("Missing argument 'TOKENIZED...': pack needs a tokenized directory (several for a mixture) or "
                 "--mixture FILE")
    if plain:
        return inputs[0]
    return Mixture.from_rates(inputs, rates, **kw)


def _figure_path(value: Path | None) -> Path | None:
    """``--plot``: a name whose suffix is no figure format is a bad value (exit 2), refused before
    any statistics are computed."""
    from .plotting import plot_path_problem

    problem = None if value is None else plot_path_problem(value)
    if problem:
        raise typer.BadParameter(problem)
    return value


@app.command()
def stats(
    path: Annotated[str, typer.Argument(callback=_location, help="Tokenized or packed directory (with PACKED: the tokenized one).")],
    packed: Annotated[str | None, typer.Argument(callback=_location, help="Packed directory made from PATH; the pair is reconciled.")] = None,
    as_json: AsJson = False,
    plot: Annotated[Path | None, typer.Option(callback=_figure_path, help=(
        "Also write a figure of fill, samples per pack, padding and drops; the suffix picks the format: .png, .svg "
        "or .pdf (missing folders are created)."))] = None,
    fail_below_fill: Annotated[float | None, typer.Option(callback=_number(0, 1), help="Exit 1 when mean token fill is below this (0..1).")] = None,
    fail_below_vision_fill: Annotated[float | None, typer.Option(callback=_number(0, 1), help="Exit 1 when mean vision fill is below this (0..1).")] = None,
    fail_above_ratio: Annotated[float | None, typer.Option(callback=_number(0), help="Exit 1 when packs / lower bound is above this.")] = None,
    fail_above_rejected: Annotated[float | None, typer.Option(callback=_number(0, 1), help="Exit 1 when the rejected share of rows is above this (0..1).")] = None,
) -> None:
    """Show fill, packs against the lower bound, padding saved, sources, and drops.

    Example:

      packtool stats packed --fail-below-fill 0.95

      packtool stats tok packed --json --plot stats.png
    """
    from .stats import Thresholds, check_thresholds, load_stats_data, render_stats, summarize

    data = load_stats_data(path, packed)
    s = summarize(data)
    try:
        failures = check_thresholds(s, Thresholds(fail_below_fill, fail_below_vision_fill, fail_above_ratio,
                                                  fail_above_rejected))
    except InputError:  # the data cannot answer a gate (a run that packed nothing...): the stats first, as a failed gate
        _out(json.dumps(s, indent=2) if as_json else render_stats(s))
        raise
    if plot is not None:
        from .plotting import plot_stats

        plot_stats(data, s, plot)
    _out(json.dumps(s, indent=2) if as_json else render_stats(s))
    if failures:
        raise PacktoolError("; ".join(failures))


@app.command()
def inspect(
    ctx: typer.Context,
    path: Annotated[str, typer.Argument(callback=_location, help="Packed or tokenized directory.")],
    pack: Annotated[int | None, typer.Option("--pack", min=0, help=(
        "Pack to show, by its pack_index: task × 1000000000 + k for the k-th pack of that pack task "
        "(packed directories; default: the first pack)."))] = None,
    sample: Annotated[str | None, typer.Option("--sample", help="Sample id to show.")] = None,
    source: Annotated[str | None, typer.Option("--source", help=(
        "With --sample: only the sample from this source, when several share the id (a mixture's source by "
        "name or path; a tokenized directory's input file)."))] = None,
    tokenizer: Annotated[str | None, typer.Option(metavar="<path|hf:ORG/NAME>", help="Tokenizer: a tokenizer.json file, a model directory or hf:ORG/NAME (default: the one the manifest names).")] = None,
    as_json: AsJson = False,
) -> None:
    """Show one pack or sample as text: turns, loss, media, position ruler.

    Example:

      packtool inspect packed --pack 0

      packtool inspect tok --sample demo-007

      packtool inspect mixed --sample demo-007 --source tok_b
    """
    from .inspection import inspect_dir, render_inspection

    if pack is not None and sample is not None:  # the command line contradicts itself: a usage error
        ctx.fail("give --pack or --sample, not both")
    if source is not None and sample is None:
        ctx.fail("--source picks among the samples of one name: give --sample ID with it")
    view = inspect_dir(path, pack=pack, sample=sample, tokenizer=tokenizer, source=source)
    _out(json.dumps(view, indent=2, ensure_ascii=False) if as_json else render_inspection(view))


def _int_list(lo: int, hi: int | None, example: str):
    """The callback of a comma-separated list option: its integers, each in ``lo..hi`` (``hi`` None:
    no upper bound); an empty item, a non-integer or a value out of range is a usage error, as the
    same value given to ``pack`` is."""

    def parse(text: str | None) -> list[int] | None:
        if text is None:
            return None
        items = [v.strip() for v in text.split(",")]
        if items == [""]:
            raise typer.BadParameter(f"give at least one integer, e.g. {example}")
        if "" in items:
            raise typer.BadParameter(f"{text!r} has an empty item; give comma-separated integers, e.g. {example}")
        try:
            values = [int(v) for v in items]
        except ValueError:
            raise typer.BadParameter(f"{text!r}: give comma-separated integers, e.g. {example}") from None
        for v in values:  # worded as typer words the same value given to pack
            _check_bounds(v, lo, hi, "Input" if len(values) == 1 else f"{v} in {text!r}")
        return values

    return parse


@app.command()
def sweep(
    ctx: typer.Context,
    src: Annotated[str, typer.Argument(callback=_location, help="Tokenized directory.")],
    max_tokens: Annotated[str, typer.Option(callback=_int_list(1, INT32_MAX, "8192,16384"),
                                            help="Comma-separated --max-tokens values.")] = str(_PACK_DEFAULTS.max_tokens),
    max_vision_units: Annotated[str | None, typer.Option(callback=_int_list(0, INT32_MAX, "64,128"),
                                                         help="Comma-separated --max-vision-units values.")] = None,
    buffer_size: Annotated[str, typer.Option(callback=_int_list(1, None, "48,256"),
                                             help="Comma-separated --buffer-size values.")] = str(_PACK_DEFAULTS.buffer_size),
    vision_weight: Annotated[str, typer.Option(callback=_int_list(0, INT32_MAX, "0,30"),
                                               help="Comma-separated --vision-weight values.")] = "0",
    text_weight: TextWeight = 1,
    token_granularity: Annotated[int, typer.Option(min=1, help="Token sizes round up to this in the DP.")] = _PACK_DEFAULTS.token_granularity,
    oversize: Annotated[SweepOversizeChoice, typer.Option(help="Samples that never fit.")] = "drop",
    as_json: AsJson = False,
) -> None:
    """Plan packs for a grid of settings (dry run, nothing written); print packs and fill.

    Example:

      packtool sweep tok --buffer-size 48,256 --vision-weight 0,30 --max-tokens 8192,16384
    """
    from .stats import render_sweep
    from .stats import sweep as sweep_grid

    # the list options' callbacks (_int_list) have parsed and checked them
    grid: dict[str, list] = {"max_tokens": max_tokens}
    if max_vision_units is not None:
        grid["max_vision_units"] = max_vision_units
    grid["buffer_size"] = buffer_size
    grid["vision_weight"] = vision_weight
    with _flag_errors(ctx):  # a setting no cell can plan is a usage error, found before any cell is planned
        base = PackConfig(text_weight=text_weight, token_granularity=token_granularity, oversize=oversize)
        rows = sweep_grid(src, base, grid)
    _out(json.dumps(rows, indent=2) if as_json else render_sweep(rows))


@app.command()
def validate(
    path: Annotated[str, typer.Argument(callback=_location, help="Tokenized or packed directory.")],
    max_problems: Annotated[int, typer.Option(min=1, help="Stop after this many problems.")] = 20,
    check_media: Annotated[bool, typer.Option(help="Decode embedded media (images, video frames).")] = True,
    tokenizer: Annotated[str | None, typer.Option(metavar="<path|hf:ORG/NAME>", help="The tokenizer the directory was made with, to check media spans id for id (qwen2 and qwen3 are found from the manifest).")] = None,
    as_json: AsJson = False,
) -> None:
    """Check a tokenized or packed directory: files against the manifest, every row's invariants.

    Exit 0 when whole; exit 1 listing the first problems.

    Example:

      packtool validate packed
    """
    from .validate import render_report, validate_dir

    report = validate_dir(path, max_problems=max_problems, check_media=check_media, tokenizer=tokenizer)
    _out(json.dumps(report, indent=2) if as_json else render_report(report))
    if not report["ok"]:
        where = "in the JSON report on stdout" if as_json else "above"
        raise PacktoolError(f"{path} is not whole: {len(report['problems'])} problem(s) listed {where}")


@app.command()
def merge(
    path: Annotated[str, typer.Argument(callback=_location, help="Output directory written by several ranks.")],
    as_json: AsJson = False,
) -> None:
    """Write the manifest of a run split across ranks (--rank/--world-size), once every rank is done.

    Example:

      packtool merge packed
    """
    from .pipeline import merge_output

    report: dict = {}
    manifest = merge_output(path, report)
    c = manifest["counts"]
    if as_json:
        _emit_json({"output": str(path), "kind": manifest["kind"], **c, "shards": len(manifest["shards"]),
                    "written": report["written"]})
        return
    done = "" if report["written"] else "nothing to do, merged already: "
    _out(f"{manifest['kind']}: {done}{_count(c['tasks'], 'task')}, {_count(len(manifest['shards']), 'shard')} -> "
               f"{join(path, MANIFEST)}")


def _version_callback(value: bool) -> None:
    if value:
        _out(f"packtool {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    version: Annotated[bool, typer.Option("--version", callback=_version_callback, is_eager=True, help="Show the version.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log what the library does.")] = False,
    storage_option: Annotated[list[str] | None, typer.Option(
        "--storage-option", metavar="KEY=VALUE",
        help="An option of the object-store file system (s3fs, gcsfs), e.g. endpoint_url=http://127.0.0.1:9000; "
             "repeatable, before the command. Credentials and endpoint also come from the usual environment "
             "(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...).")] = None,
) -> None:
    if storage_option:
        from .storage import set_options

        with _flag_errors(ctx):  # a malformed KEY=VALUE is a usage error (exit 2), as any bad flag value
            set_options(storage_option)
    from .preload import LOG_FORMAT

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format=LOG_FORMAT, stream=sys.stderr)
    if not verbose:
        # gcsfs logs each request it gives up on with a traceback; the error then reaches
        # main(), which shows it as one line naming the fix
        logging.getLogger("gcsfs").setLevel(logging.CRITICAL)


def _click_exceptions() -> tuple[type[BaseException], ...]:
    """The ``ClickException`` classes the installed typer raises for usage errors.

    typer >= 0.2x vendors click as ``typer._click``; older releases use the ``click``
    package. Both are caught, so a usage error is a usage error whichever is installed.
    """
    import importlib

    found = []
    for name in ("typer._click.exceptions", "click.exceptions"):
        try:
            found.append(importlib.import_module(name).ClickException)
        except (ImportError, AttributeError):
            continue
    return tuple(found)


#: Exit code of a usage error (bad flag, missing option, unknown command), as click uses.
EXIT_USAGE = 2


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the app and turn every outcome into an exit code.

    ``PacktoolError`` -> ``Error: ...`` and 1; a usage error -> click's usage message and 2;
    Ctrl-C -> ``Error: interrupted ...`` and 130; SIGTERM -> ``Error: terminated ...`` and 143
    (the run stops as for Ctrl-C; a second SIGTERM ends the process at once). Anything else is
    a bug and keeps its traceback.
    """
    usage_errors = _click_exceptions()
    term = None
    try:
        release()  # Ctrl-C while the command line loaded ended the process (launcher); from here it is caught below
        with sigterm_as_interrupt() as term:
            rv = app(args=argv, prog_name="packtool", standalone_mode=False)
    except PacktoolError as exc:
        typer.echo(f"Error: {exc}", err=True)
        return exc.exit_code
    except typer.Exit as exc:
        return _interrupted(term) if exc.exit_code == EXIT_INTERRUPT else exc.exit_code
    except (typer.Abort, KeyboardInterrupt):  # older click turns Ctrl-C into Abort
        return _interrupted(term)
    except usage_errors as exc:
        exc.show()  # type: ignore[attr-defined]
        return exc.exit_code  # type: ignore[attr-defined]
    # typer >= 0.2x returns 130 for Ctrl-C (it raises Exit(130), which non-standalone mode returns)
    if isinstance(rv, int) and not isinstance(rv, bool):
        return _interrupted(term) if rv == EXIT_INTERRUPT else rv
    return 0


def _interrupted(term) -> int:
    """The line and exit code of a stopped command: SIGTERM's when ``term`` (the
    :func:`~packtool.executors.sigterm_as_interrupt` handler) received one, else Ctrl-C's.
    (typer turns either interrupt into its exit code 130, so they are told apart by the handler.)"""
    if term is not None and term.received:
        typer.echo(f"Error: {TERMINATED}", err=True)
        return EXIT_TERMINATED
    typer.echo(f"Error: {INTERRUPTED}", err=True)
    return EXIT_INTERRUPT


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


def run() -> None:
    """Console-script entry point of an install made before :func:`packtool.launcher.run` was
    (which handles a Ctrl-C while this module loads, too)."""
    from .launcher import run as launch

    launch()
