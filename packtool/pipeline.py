"""The two stages as library calls: ``tokenize_dataset`` and ``pack_dataset``.

Each is a pure function of (input files, config): the same inputs and config give the
same shard bytes. Output is written atomically and the manifest last (see ``shards``).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq

from .config import PackConfig, TokenizeConfig, digest_of
from .errors import ConfigError, TooManyErrorsError
from .formats import Rejected, expand_inputs, iter_samples
from .media import read_media_bytes
from .packer import assemble_packs, plan_packs
from .records import MediaRef
from .rows import EncodeContext, encode_samples, group_by_media
from .schema import TOKENIZED
from .shards import ERRORS, ShardWriter, prepare_output, read_manifest, write_manifest
from .templates import get_template
from .tokenization import load_tokenizer
from .vision import get_family

__all__ = ["tokenize_dataset", "pack_dataset", "lower_bound"]

log = logging.getLogger(__name__)

Progress = Callable[[int], None] | None
BATCH = 512


def _batched(it: Iterable, n: int) -> Iterator[list]:
    batch: list = []
    for x in it:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


class _ErrorLog:
    """``errors.jsonl`` written to a temporary name and moved into place with the manifest."""

    def __init__(self, out_dir: Path, max_errors: int | None) -> None:
        self.final = out_dir / ERRORS
        self.tmp = out_dir / f".{ERRORS}.tmp"
        self.fh = open(self.tmp, "w", encoding="utf-8")
        self.by_reason: Counter[str] = Counter()
        self.max_errors = max_errors

    def add(self, rej: Rejected) -> None:
        self.fh.write(json.dumps(rej.to_json(), ensure_ascii=False) + "\n")
        self.by_reason[rej.reason] += 1
        total = sum(self.by_reason.values())
        if self.max_errors is not None and total > self.max_errors:
            raise TooManyErrorsError(
                f"{total} input rows rejected, more than --max-errors {self.max_errors} "
                f"(latest: {rej.source}:{rej.source_row} {rej.reason}: {rej.message}); "
                f"fix the input or raise --max-errors"
            )

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())

    def commit(self) -> None:
        self.fh.close()
        os.replace(self.tmp, self.final)

    def abort(self) -> None:
        self.fh.close()
        self.tmp.unlink(missing_ok=True)


def tokenize_dataset(
    inputs: list[str | Path], out_dir: str | Path, cfg: TokenizeConfig, progress: Progress = None, overwrite: bool = False
) -> dict:
    """Read raw corpora, count vision tokens, apply the chat template, write tokenized shards.

    Returns the manifest (with ``counts``: rows in, samples written, rejected per reason).
    """
    out = Path(out_dir)
    files = expand_inputs([Path(p) for p in inputs])
    media_root = Path(cfg.media_root)
    if not media_root.is_dir():
        raise ConfigError(f"--media-root {cfg.media_root!r} is not a directory")
    family = get_family(cfg.model, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels, max_frames=cfg.max_frames,
                        fps=cfg.fps, max_crops=cfg.max_crops, max_num=cfg.max_num, exif=cfg.exif)
    template = get_template(cfg.template)
    tokenizer = load_tokenizer(cfg.tokenizer)
    config = cfg.to_dict()
    config["inputs"] = [str(f) for f in files]
    digest = digest_of(config, exclude=("max_errors",))
    done = prepare_output(out, "tokenized", config, digest, overwrite)
    if done is not None:
        log.info("%s already holds this run; nothing to do", out)
        return done
    ctx = EncodeContext(tokenizer, template, family, media_root, cfg.system_prompt,
                        max_branches=cfg.max_branches, max_tokens=cfg.max_tokens)
    errors = _ErrorLog(out, cfg.max_errors)
    n_rows = n_samples = n_tokens = n_units = 0
    tree_counts: Counter[str] = Counter()
    stream = iter_samples(files, cfg.format)
    if cfg.group_by_media:
        stream = group_by_media(stream, media_root, tree_counts)
    try:
        with ShardWriter(out, TOKENIZED, rows_per_shard=cfg.rows_per_shard) as writer:
            for batch in _batched(stream, BATCH):
                samples = []
                for item in batch:
                    if isinstance(item, Rejected):
                        errors.add(item)
                    else:
                        samples.append(item)
                rows, rejected = encode_samples(samples, ctx, tree_counts)
                for rej in rejected:
                    errors.add(rej)
                writer.write_rows(rows)
                n_rows += len(batch) + sum(len(s.meta.get("merged", ())) for s in samples)
                n_samples += len(rows)
                n_tokens += sum(r["n_tokens"] for r in rows)
                n_units += sum(r["n_vision_units"] for r in rows)
                if progress:
                    progress(len(batch))
    except BaseException:
        errors.abort()
        raise
    errors.commit()
    counts = {"rows_in": n_rows, "samples": n_samples, "rejected": errors.total,
              "rejected_by_reason": dict(sorted(errors.by_reason.items())), "tokens": n_tokens, "vision_units": n_units,
              "branches": tree_counts["branches"], "split_extra_trees": tree_counts["split_extra_trees"],
              "merged_records": tree_counts["merged_records"]}
    vision = {**family.settings(), "unit": family.unit_name, "default_max_vision_units": family.default_max_vision_units}
    return write_manifest(out, "tokenized", config, digest, writer.shards, tokenizer=tokenizer.identity(),
                          vision=vision, template=template.settings(), counts=counts)


def lower_bound(total_tokens: int, total_units: int, max_tokens: int, max_units: int) -> int:
    """Fewest packs any packer could use: ``max(ceil(Σtokens/max_tokens), ceil(Σunits/max_units))``.

    Example:
        >>> lower_bound(10_000, 300, 4096, 128)
        3
    """
    a = math.ceil(total_tokens / max_tokens) if max_tokens else 0
    b = math.ceil(total_units / max_units) if max_units else 0
    return max(a, b)


def _media_loader(media_root: Path, frame_quality: int = 90) -> Callable[[dict], list[bytes] | None]:
    def load(m: dict) -> list[bytes] | None:
        if m.get("kind") == "image":
            ref = MediaRef("image", m.get("path"), m.get("data"))
            return [read_media_bytes(ref, media_root)]
        from .media import extract_frames

        return extract_frames(media_root, m, quality=frame_quality)

    return load


def pack_dataset(
    src: str | Path,
    out_dir: str | Path,
    cfg: PackConfig,
    progress: Progress = None,
    overwrite: bool = False,
    dry_run: bool = False,
    media_root: str | Path | None = None,
) -> dict:
    """Pack tokenized shards into training sequences with an exact 2-D knapsack per pack.

    Each tokenized shard is one task, packed with its own buffer, so the output does not
    depend on how tasks are scheduled. With ``dry_run`` only the length columns are read
    and nothing is written; the returned dict holds the same counts, plus ``plans``: the
    :class:`~packtool.packer.PackPlan` of each tokenized shard in manifest order (indices
    are rows of that shard), from which ``stats.plan_stats`` derives fill and padding.
    """
    src = Path(src)
    out = Path(out_dir)
    tok_manifest = read_manifest(src, "tokenized")
    max_units = cfg.max_vision_units
    if max_units is None:
        max_units = int(tok_manifest.get("vision", {}).get("default_max_vision_units") or 0)
    if cfg.text_weight < 1:
        raise ConfigError("--text-weight must be at least 1 so every sample has value to the packer")
    root = Path(media_root) if media_root is not None else Path(tok_manifest["config"].get("media_root", "."))
    config = {**cfg.to_dict(), "max_vision_units": max_units, "source_digest": tok_manifest["config_digest"]}
    digest = digest_of(config)
    if not dry_run:
        done = prepare_output(out, "packed", config, digest, overwrite)
        if done is not None:
            return done
    loader = _media_loader(root, cfg.frame_quality) if cfg.media == "embed" else None
    totals = Counter()
    shards: list[dict] = []
    errors = None if dry_run else _ErrorLog(out, None)
    pack_index = 0
    plans: list = []
    try:
        for task, entry in enumerate(tok_manifest["shards"]):
            file = src / entry["file"]
            lengths = pq.read_table(file, columns=["n_tokens", "n_vision_units", "media", "sample_id", "source", "source_row"])
            tokens = lengths["n_tokens"].to_numpy()
            units = lengths["n_vision_units"].to_numpy()
            has_media = pc.list_value_length(lengths["media"]).to_numpy(zero_copy_only=False) > 0
            plan = plan_packs(tokens, units, has_media, cfg, max_units)
            plans.append(plan)
            packed_tokens = int(tokens[plan.order].sum()) if len(plan.order) else 0
            if plan.truncated:
                packed_tokens -= int(sum(int(tokens[i]) - cfg.max_tokens for i in plan.truncated))
            totals.update(samples_in=len(tokens), samples_packed=len(plan.order), packs=plan.n_packs,
                          dropped=len(plan.dropped), alone=len(plan.alone), truncated=len(plan.truncated),
                          tokens=packed_tokens, vision_units=int(units[plan.order].sum()) if len(plan.order) else 0)
            if errors is not None:
                for i in plan.dropped:
                    errors.add(Rejected(lengths["source"][i].as_py(), lengths["source_row"][i].as_py(),
                                        lengths["sample_id"][i].as_py(), "oversize",
                                        f"needs {int(tokens[i]):,} tokens and {int(units[i]):,} vision units; "
                                        f"a pack holds {cfg.max_tokens:,} and {max_units:,}"))
                if plan.n_packs:
                    table = pq.read_table(file)
                    packed = assemble_packs(table, plan, pack_index, loader, cfg.max_tokens)
                    with ShardWriter(out, packed.schema, rows_per_shard=cfg.packs_per_shard, row_group_rows=256,
                                     prefix=f"part-{task:05d}") as writer:
                        writer.write_table(packed)
                    shards.extend(writer.shards)
            pack_index += plan.n_packs
            if progress:
                progress(len(tokens))
    except BaseException:
        if errors is not None:
            errors.abort()
        raise
    counts = dict(totals)
    counts["lower_bound"] = lower_bound(totals["tokens"], totals["vision_units"], cfg.max_tokens, max_units)
    counts["rejected_by_reason"] = dict(errors.by_reason) if errors is not None else {"oversize": totals["dropped"]}
    capacities = {"max_tokens": cfg.max_tokens, "max_vision_units": max_units}
    if dry_run:
        return {"kind": "packed", "dry_run": True, "config": config, "capacities": capacities, "counts": counts,
                "vision": tok_manifest.get("vision"), "shards": [], "plans": plans}
    errors.commit()
    return write_manifest(out, "packed", config, digest, shards, capacities=capacities, counts=counts,
                          tokenizer=tok_manifest.get("tokenizer"), vision=tok_manifest.get("vision"),
                          template=tok_manifest.get("template"), source={"path": str(src), "config_digest": tok_manifest["config_digest"]})
