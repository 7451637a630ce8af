"""The trainer side: stream packed shards with exact masks and exact resume.

This package imports numpy, pyarrow and (for media only) Pillow / PyAV; never numba or
typer, so it is cheap to import on every training process. ``packtool.reader.torch``
adds a ``torch.utils.data.IterableDataset`` adapter.

One packed row holds several samples; a sample may be a message tree (a shared prefix
plus branches). Four columns say who may see whom (DESIGN.md §3.2)::

    tokens          s0 s0 s0 s0 | s1 s1 s1 s1 s1 s1 s1
    subsegment_ids  10000 x4    | 110000 x3  100000 x2   100001 x2
                                  (prefix)   (branch 0)  (branch 1)
    position_ids    0 1 2 3     | 0 1 2      3 4         3 4
    cu_seqlens      [0, 4, 11]

Query ``q`` attends key ``j`` iff ``j <= q`` and ``sub[q] <= sub[j]`` (same sample
implied): branch tokens see their prefix, never another branch or another sample.

How the stream is split (what makes resume exact):

1. **Global order per epoch.** Shards are permuted with ``seed`` and the epoch, row
   groups inside each shard are permuted, rows inside each row group are permuted
   (``shuffle=False`` keeps manifest order, i.e. ``pack_index`` order). This is a list
   ``G`` of all ``N`` packs; only one row group is decoded at a time. Each permutation
   draws from its own random stream, ``SeedSequence(seed, spawn_key=(level, epoch, shard,
   group))``, so the three levels are independent (order 2). A state saved without an
   ``order`` resumes in order 1, which that run was reading.
2. **Ranks take contiguous slices.** Every rank gets ``L = ceil(N / world_size)`` packs
   (``drop_last=True``: ``floor``). Rank ``r`` reads ``G[r*L : (r+1)*L]``; positions past
   ``N`` wrap around to the start of ``G`` (the tail is padded by repeating the first
   packs of the epoch), so all ranks take the same number of steps.
3. **Workers take blocks.** Inside a rank's slice, DataLoader worker ``w`` of ``K`` takes
   blocks ``w, w+K, w+2K, ...`` of ``block`` packs (the batch size in the torch adapter).
   A DataLoader visits workers round-robin, so the trainer sees the rank's slice in order.
4. **State = (epoch, consumed).** ``consumed`` counts packs of the rank's slice the
   trainer has taken. It is the same on every rank (ranks step together), so saving
   rank 0's state is enough; resuming continues at ``G[r*L + consumed]`` for any number
   of workers or batch size. The shards (by their sha256 in the manifest), world size,
   seed, shuffle and ``drop_last`` must match (a mismatch raises
   :class:`~packtool.errors.ResumeMismatchError`); the state's ``order`` is adopted.
5. **A worker's own state.** Inside a DataLoader worker, ``state_dict()`` describes what
   that worker has produced: the pass it reads (``epoch``, and ``consumed`` where the pass
   began) plus ``worker`` = ``{"id", "num_workers", "block", "next"}``, ``next`` being the
   position of its next block (``len()`` once it has none left). This is what torchdata's
   ``StatefulDataLoader`` saves for every worker and hands back to the same worker on
   restore; with the DataLoader's round robin resumed after the last worker used, the
   trainer gets exactly the blocks an uninterrupted run would have given it. A worker's
   state resumes only the same worker of the same split (else ``ResumeMismatchError``).
6. **Persistent workers follow the trainer.** A ``set_epoch`` or ``load_state_dict`` on
   the trainer's reader reaches persistent DataLoader workers (which hold copies made at
   their start) through a small vector in shared memory that the torch adapter sets up:
   each worker takes the new position when it next starts a pass (``for batch in loader``).
7. **Fresh workers move on as the others do.** Each DataLoader worker that reads its share
   of an epoch to the end says so in the same vector; a worker that starts a pass from a
   copy still in that epoch (non-persistent workers are copied from the trainer's reader,
   which never iterated) moves on to the next epoch once every worker of the split has
   finished it, as an in-process reader and persistent workers do by themselves. So the same
   loop reads the same packs whatever ``num_workers`` and ``persistent_workers``, with
   ``set_epoch`` or without it (a ``set_epoch`` or ``load_state_dict`` clears what the
   workers said). Up to :data:`MIRROR_WORKERS` workers are followed so.

Example::

    ds = PackedDataset("packed/", rank=0, world_size=8, seed=1)
    ds.set_epoch(0)
    for row in ds:
        mask = attention_mask(row["subsegment_ids"])   # (L, L) bool
    state = ds.state_dict()                            # {"epoch": 1, "consumed": 0, ...}
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from ..config import whole_number
from ..errors import ConfigError, InputError, ResumeMismatchError
from ..runs import expand_table
from ..schema import PREFIX_SUBSEGMENT, SUBSEGMENT_STRIDE
from ..shards import MANIFEST, read_manifest, sha256_file

__all__ = [
    "PackedDataset",
    "attention_mask",
    "position_ids",
    "flash_attn_varlen_kwargs",
    "collate",
    "decode_image",
    "decode_video",
    "decode_media",
    "VideoFrames",
    "IGNORE_INDEX",
    "PAD_SUBSEGMENT",
    "VISION_MODES",
    "ORDER",
]

log = logging.getLogger(__name__)

#: Target id meaning "no loss here" (what ``torch.nn.functional.cross_entropy`` ignores).
IGNORE_INDEX = -100
#: Subsegment id of padding added by :func:`collate`: a sample of its own, seen by nothing else.
PAD_SUBSEGMENT = -1
#: ``vision`` modes of :func:`attention_mask`.
VISION_MODES = ("causal", "media", "sample")
#: Shuffle order of a fresh reader (``state_dict()["order"]``); 1 is the order of states saved without one.
ORDER = 2
_ORDERS = (1, 2)
#: The shared position vector (item 6, 7): a head of 8 entries, then one per DataLoader worker.
_MIRROR_HEAD = 8
#: DataLoader workers whose finished epochs the vector follows (item 7).
MIRROR_WORKERS = 64
MIRROR_SIZE = _MIRROR_HEAD + MIRROR_WORKERS

_TOKEN_COLUMNS = ("input_ids", "target_ids", "position_ids", "subsegment_ids", "cu_seqlens")


# --------------------------------------------------------------------------- the dataset


def _state_count(state: dict[str, Any], key: str) -> int:
    """``state[key]`` as a count (a whole number >= 0; numpy and torch integers welcome), or a
    :class:`ResumeMismatchError` naming the key: a position is never rounded or guessed."""
    value = state.get(key)
    try:
        ok = not isinstance(value, bool) and value is not None and int(value) == value and int(value) >= 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ResumeMismatchError(f"reader state has {key}={value!r}, where a whole number >= 0 is needed; load the "
                                  "dict PackedDataset.state_dict() returned, unchanged")
    return int(value)


class PackedDataset:
    """Packed shards as a stream of rows, split by rank and DataLoader worker.

    Each row is a dict: ``pack_index``, ``n_tokens``, ``n_vision_units``, ``sample_ids``
    (list of str), ``input_ids``, ``target_ids``, ``position_ids``, ``subsegment_ids``,
    ``cu_seqlens`` (``np.int32`` arrays) and ``media`` (list of dicts, see
    ``schema.PACKED``); a mixture's rows also hold ``sample_sources`` (list of int: each
    sample's position in the manifest's ``mixture.sources``, for per-source loss). See the
    module docstring for how the stream is split. Shards in runs form (packed schema version
    4, the default, or 3) are expanded one row group at a time (``packtool.runs.expand_table``), so
    rows are the same whichever ``--layout`` wrote them; a run table that does not expand to
    the row's ``n_tokens`` raises ``InputError``.

    Args:
        path: a ``packtool pack`` output directory (holding ``.packtool/manifest.json``).
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: number of data-parallel ranks.
        shuffle: permute shards, row groups and rows, differently every epoch.
        seed: base of the permutation; every rank must use the same seed.
        verify: check each shard's sha256 against the manifest when first opened. Without it
            the size and row count are checked, and every Parquet page is read with its CRC32
            verified, so a damaged page raises instead of decoding to wrong values.
        drop_last: when the pack count does not divide ``world_size``, drop the tail
            (``True``) instead of padding by repeating the epoch's first packs (``False``).
        cache_bytes: with ``path`` a bucket URL (``s3://...``, ``gs://...``): the most bytes of row
            groups kept in the local cache (``PACKTOOL_CACHE``, default ``$XDG_CACHE_HOME/packtool``,
            else ``~/.cache/packtool``), least recently used out first. Row groups are streamed: each is fetched whole with
            one ranged GET, up to ``prefetch`` groups ahead of the one being read. Order, the
            rank/worker split and resume are those of a local directory; each shard's size in the
            bucket is checked against the manifest when first opened and every page's CRC32 as it
            is read (``verify``'s whole-file sha256 applies to local shards). The cap may be passed
            by the ``prefetch + 2`` newest groups, which are never evicted. The cap is each
            process's: the ranks and DataLoader workers of a machine share the cache folder, so
            it holds up to their number times ``cache_bytes`` (a group one process evicts under
            another's read is fetched again by that one).
        prefetch: row groups fetched ahead of the reader (bucket URLs).

    Attributes:
        order: the version of the shuffle order read: :data:`ORDER` for a fresh reader, the
            state's after :meth:`load_state_dict` (1 for a state saved without ``order``).

    Raises:
        InputError: no manifest, wrong kind, no packs at all, a shard missing or of the wrong size.
        ConfigError: invalid rank, world size or seed; ``drop_last=True`` with fewer packs than ranks.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        verify: bool = False,
        drop_last: bool = False,
        cache_bytes: int = 4 << 30,
        prefetch: int = 4,
    ) -> None:
        world_size = _whole("world_size", world_size)
        rank = _whole("rank", rank)
        seed = _whole("seed", seed)
        if world_size < 1:
            raise ConfigError(f"world_size must be at least 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside 0..{world_size - 1} for world_size {world_size}")
        if seed < 0:
            raise ConfigError(f"seed must be non-negative, got {seed}")
        from ..storage import fetch_manifest, is_url

        # a bucket URL stays a string; its row groups stream through a GroupCache made in each process
        self.url = str(path).rstrip("/") if is_url(str(path)) else None
        self.path = self.url if self.url is not None else Path(path)
        self.manifest = fetch_manifest(self.url, "packed") if self.url is not None else read_manifest(self.path, "packed")
        self.cache_bytes = cache_bytes
        self.prefetch = prefetch
        self._cache = None  # (pid, GroupCache): threads and locks do not cross a fork or a pickle
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = seed
        self.verify = verify
        self.drop_last = drop_last
        self._shards = list(self.manifest["shards"])
        self._rows = np.array([int(s["rows"]) for s in self._shards], dtype=np.int64)
        # which shards these are: a corpus edited and re-packed with the same settings keeps its
        # config digest (inputs are named by path) and often its pack count, never its shards' bytes
        self._shards_digest = hashlib.sha256("".join(str(s.get("sha256")) for s in self._shards).encode()).hexdigest()[:16]
        self.n_packs = int(self._rows.sum())
        n = self.n_packs
        # an epoch of nothing would let a training loop "finish" without a step: refuse it here
        if n == 0:
            raise InputError(f"{str(self.path)!r} holds no packs (every sample was rejected or dropped); "
                             f"see `packtool stats {self.path}` and its tokenized errors.jsonl, fix the inputs and re-pack")
        if drop_last and n < world_size:
            raise ConfigError(f"drop_last=True splits {n} packs over {world_size} ranks: every rank would get none; "
                              "use drop_last=False (the last ranks are topped up with the epoch's first packs) or fewer ranks")
        self._len = n // world_size if drop_last else -(-n // world_size)
        self.epoch = 0
        self.consumed = 0
        self.order = ORDER
        # the last pass begun (a dict updated as its blocks are yielded) and a worker's own
        # position to continue at (set by load_state_dict of a worker's state, taken by the next pass)
        self._pass: dict[str, int] | None = None
        self._resume: dict[str, int] | None = None
        # how the trainer's set_epoch / load_state_dict reach persistent DataLoader workers: the
        # torch adapter shares an int64 vector (generation, epoch, consumed, order, worker's id,
        # num_workers, block, next; then per worker the epoch after the last it finished, item 7);
        # a copy whose generation differs takes it at its next pass
        self._generation = 0
        self._mirror = None
        self._groups: dict[int, np.ndarray] = {}  # shard -> rows per row group
        self._checked: set[int] = set()
        self._vision = self.manifest.get("vision")

    # ---- schedule

    def __len__(self) -> int:
        """Packs this rank yields per epoch (the same on every rank)."""
        return self._len

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (call before each epoch, as with ``DistributedSampler``).

        Setting the epoch the dataset is already in keeps its position, so a loop
        ``for e in range(state["epoch"], n): ds.set_epoch(e)`` resumes mid-epoch correctly.
        Called on the trainer's reader, it reaches persistent DataLoader workers too, when
        they next start a pass (module docstring, item 6).
        """
        epoch = _whole("epoch", epoch)
        if epoch < 0:
            raise ConfigError(f"epoch must be non-negative, got {epoch}")
        if epoch != self.epoch:
            self.epoch = epoch
            self.consumed = 0
            self._pass = self._resume = None
        self._publish()

    def state_dict(self, consumed: int | None = None, epoch: int | None = None) -> dict[str, Any]:
        """The position in the stream, to store with a checkpoint.

        Args:
            consumed: packs of the epoch the trainer has taken. Leave ``None`` when
                iterating this object in-process (it counts what it yielded); with
                DataLoader workers pass the ``consumed`` value of the last batch used
                (the torch adapter puts it, and ``epoch``, in every batch).
            epoch: the epoch ``consumed`` counts in (default: the current one).

        With neither argument, inside a DataLoader worker (or on a copy iterating one worker's
        share, :meth:`iter_blocks`), the state is that worker's own progress, with a
        ``worker`` entry (module docstring, item 5): what torchdata's ``StatefulDataLoader``
        saves per worker. In-process, right after the last block of an epoch and before the
        loop has ended, it is ``consumed == len(self)`` of that epoch (a pass whose end is still
        to come), so a loader restored from it ends that pass as the uninterrupted one did;
        ``state_dict(consumed=len(self))`` names the start of the next epoch instead.
        """
        if consumed is None and epoch is None:
            progress = self._progress()
            if progress is not None:
                return progress
        c = self.consumed if consumed is None else _whole("consumed", consumed)
        if not 0 <= c <= self._len:
            raise ConfigError(f"consumed {c} is outside 0..{self._len} (packs per rank per epoch)")
        epoch = self.epoch if epoch is None else _whole("epoch", epoch)
        if epoch < 0:  # a checkpoint holding it could never be loaded
            raise ConfigError(f"epoch must be non-negative, got {epoch}; pass the 'epoch' of the batch last used")
        if c == self._len and self._len > 0:
            epoch, c = epoch + 1, 0  # a finished epoch resumes at the next one
        return {
            "epoch": epoch,
            "consumed": c,
            "world_size": self.world_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "order": self.order,
            "n_packs": self.n_packs,
            "config_digest": self.manifest.get("config_digest"),
            "shards_digest": self._shards_digest,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict` (taken on any rank, with any worker count).

        The reader takes the state's shuffle ``order`` for this and every later epoch: a
        state saved without one (by a packtool that had only the first order) continues in
        the first order, so the run reads no pack twice and skips none.

        A worker's own state (with a ``worker`` entry, as ``StatefulDataLoader`` restores each
        worker) continues that worker where it stopped at the next pass; it must be iterated as
        the same worker of the same split, else that pass raises ``ResumeMismatchError``.

        Raises:
            ResumeMismatchError: the state belongs to other data or another split.
        """
        for key in ("n_packs", "config_digest", "shards_digest"):
            if key == "shards_digest" and key not in state:
                continue  # a state saved before the shards were part of it
            if state.get(key) != self.state_dict(0)[key]:
                raise ResumeMismatchError(
                    f"reader state was saved for another packed dataset ({key} {state.get(key)!r}, "
                    f"{str(self.path)!r} has {self.state_dict(0)[key]!r}); load the matching checkpoint, point the reader "
                    "at the packed directory the checkpoint was trained on, or start the data afresh"
                )
        for key in ("world_size", "seed", "shuffle", "drop_last"):
            mine = getattr(self, key)
            if state.get(key) != mine:
                raise ResumeMismatchError(
                    f"reader state was saved with {key}={state.get(key)!r} but this reader has {key}={mine!r}; "
                    f"exact resume needs the same {key}"
                )
        consumed, epoch = (_state_count(state, key) for key in ("consumed", "epoch"))
        if not 0 <= consumed <= self._len:
            raise ResumeMismatchError(f"reader state has consumed={consumed}, outside 0..{self._len}")
        order = state.get("order", 1)
        if isinstance(order, bool) or not isinstance(order, int | np.integer) or int(order) not in _ORDERS:
            raise ResumeMismatchError(f"reader state has order={order!r}, a shuffle order this packtool does not know "
                                      f"(it reads {' and '.join(map(str, _ORDERS))}); resume with the packtool that saved it")
        resume = _worker_entry(state, consumed, self._len) if "worker" in state else None
        self.epoch = epoch
        self.consumed = consumed
        self.order = int(order)
        self._pass, self._resume = None, resume
        self._publish()

    def _progress(self) -> dict[str, Any] | None:
        """The state a plain ``state_dict()`` gives during a pass, or ``None`` for the rank-level one."""
        if self._resume is not None:  # loaded, not yet iterated: the same state back
            return {**self.state_dict(self.consumed), "epoch": self.epoch, "consumed": self.consumed,
                    "worker": dict(self._resume)}
        p = self._pass
        if p is None:
            return None
        if not p["in_process"]:
            return {**self.state_dict(p["base"], p["epoch"]), "epoch": p["epoch"], "consumed": p["base"],
                    "worker": {k: p[k] for k in ("id", "num_workers", "block", "next")}}
        if p["next"] == self._len and self.consumed == self._len and self.epoch == p["epoch"]:
            return {**self.state_dict(0, p["epoch"]), "consumed": self._len}
        return None

    def _publish(self) -> None:
        """Tell persistent DataLoader workers the trainer moved this reader (its set_epoch / load_state_dict)."""
        if _in_worker():  # a worker's own copy restored by StatefulDataLoader: nothing to tell
            return
        self._generation += 1
        if self._mirror is not None:
            self._write_mirror()

    def _write_mirror(self) -> None:
        r = self._resume or {}
        values = (self.epoch, self.consumed, self.order, r.get("id", 0), r.get("num_workers", 0), r.get("block", 0),
                  r.get("next", 0))
        for i, v in enumerate(values, 1):
            self._mirror[i] = v
        if len(self._mirror) > _MIRROR_HEAD:  # the trainer moved the reader: what workers finished no longer counts
            self._mirror[_MIRROR_HEAD:] = 0
        self._mirror[0] = self._generation  # last: a worker reading a new generation reads the values with it

    def _finished_by_all(self, num_workers: int) -> int | None:
        """In a worker's copy: the epoch after the last one every worker of a ``num_workers`` split
        read to the end, when that is past this copy's epoch (item 7); else ``None``."""
        if self._mirror is None or not 0 < num_workers <= len(self._mirror) - _MIRROR_HEAD:
            return None
        done = min(int(self._mirror[_MIRROR_HEAD + w]) for w in range(num_workers))
        return done if done > self.epoch else None

    def _share_position(self, vector) -> None:
        """Keep this reader's position also in ``vector`` (int64, :data:`MIRROR_SIZE` entries, in
        memory shared with the DataLoader workers: the torch adapter's); workers follow it at
        their next pass, and say there which epochs they read to the end."""
        if self._mirror is None:
            self._mirror = vector
            self._write_mirror()

    def _follow_trainer(self) -> None:
        """In a worker's copy: take the trainer's position if it was moved since this copy last looked."""
        if self._mirror is None:
            return
        generation = int(self._mirror[0])
        if generation == self._generation:
            return
        epoch, consumed, order, wid, k, block, nxt = (int(self._mirror[i]) for i in range(1, 8))
        self._generation = generation
        self.epoch, self.consumed, self.order = epoch, consumed, order
        self._pass = None
        self._resume = {"id": wid, "num_workers": k, "block": block, "next": nxt} if k else None

    # ---- iteration

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Rows of this rank (and DataLoader worker, when inside one) from the current position."""
        worker, n_workers = _worker()
        return (rows[0] for rows, _ in self.iter_blocks(worker, n_workers, block=1))

    def iter_blocks(self, worker: int = 0, num_workers: int = 1, block: int = 1) -> Iterator[tuple[list[dict], int]]:
        """Blocks of up to ``block`` rows for DataLoader worker ``worker`` of ``num_workers``.

        Yields ``(rows, consumed)``: ``consumed`` is the rank-level position right after
        this block (what :meth:`state_dict` wants once the trainer has used it). Iterated
        in-process (one worker, not inside a DataLoader worker) the dataset also advances its
        own position as it yields; a DataLoader worker's copy does not, since it fetches ahead
        of what the trainer takes (a persistent worker left mid-epoch starts again where the
        reader stands, whatever the worker count: the trainer's position, when it moved the
        reader with ``set_epoch`` or ``load_state_dict`` since). Instead the copy records
        its own progress, which :meth:`state_dict` returns. Once the blocks run out, every
        copy moves on to the next epoch (so persistent DataLoader workers, which never see
        ``set_epoch``, still change order every epoch).

        The pass is set up when this is called (a restored worker's position taken, its
        split checked), so a ``state_dict()`` right after already describes it.
        """
        worker, num_workers, block = _whole("worker", worker), _whole("num_workers", num_workers), _whole("block", block)
        if block < 1 or not 0 <= worker < num_workers:
            raise ConfigError(f"bad split: worker {worker} of {num_workers}, block {block}")
        self._follow_trainer()
        resume, self._resume = self._resume, None
        if resume is not None and (resume["id"], resume["num_workers"], resume["block"]) != (worker, num_workers, block):
            self._resume = resume  # still this copy's state: another try with the right split continues it
            raise ResumeMismatchError(
                f"reader state is the own state of DataLoader worker {resume['id']} of {resume['num_workers']} (blocks "
                f"of {resume['block']} packs), but this reader is worker {worker} of {num_workers} (blocks of {block}); "
                "restore it through StatefulDataLoader.load_state_dict with the same num_workers and batch size, or "
                "checkpoint ds.state_dict(batch) instead, which resumes with any"
            )
        if resume is None and not (num_workers == 1 and not _in_worker()):
            moved = self._finished_by_all(num_workers)  # a fresh copy of an epoch the workers have read
            if moved is not None:
                self.epoch, self.consumed = moved, 0
        start = self.consumed
        first = resume["next"] if resume is not None else min(self._len, start + worker * block)
        record = {"epoch": self.epoch, "base": start, "id": worker, "num_workers": num_workers, "block": block,
                  "next": first, "in_process": num_workers == 1 and not _in_worker()}
        self._pass = record
        return self._blocks(record)

    def _blocks(self, record: dict[str, int]) -> Iterator[tuple[list[dict], int]]:
        epoch, start, first = record["epoch"], record["base"], record["next"]
        worker, num_workers, block, in_process = (record[k] for k in ("id", "num_workers", "block", "in_process"))
        rel = np.arange(first - start, self._len - start, dtype=np.int64)
        mine = rel[(rel // block) % num_workers == worker]
        local = start + mine  # positions within the rank's slice
        rows_out: list[dict] = []
        last_block = -1

        def taken(b: int) -> int:
            # the block is yielded: the rank's position after it, and this worker's next block
            record["next"] = min(self._len, start + (b + num_workers) * block)
            consumed = min(self._len, start + (b + 1) * block)
            if in_process:
                self.consumed = consumed
            return consumed

        for t, row in zip(local, self._rows_at(epoch, local) if len(local) else (), strict=True):
            b = (int(t) - start) // block
            if rows_out and b != last_block:
                yield rows_out, taken(last_block)
                rows_out = []
            last_block = b
            rows_out.append(row)
        if rows_out:
            yield rows_out, taken(last_block)
        record["next"] = self._len
        # a finished epoch moves on by itself, here and in a persistent DataLoader worker's copy
        if self._len and self.epoch == epoch:
            self.epoch, self.consumed = epoch + 1, 0
        if not in_process and self._mirror is not None and worker < len(self._mirror) - _MIRROR_HEAD:
            # this worker's share is read: fresh copies of the next pass move on once every worker's is (item 7)
            self._mirror[_MIRROR_HEAD + worker] = max(int(self._mirror[_MIRROR_HEAD + worker]), epoch + 1)
        if in_process and self._pass is record:
            self._pass = None  # in-process, the position says it all once the pass has ended

    def _global(self, local: np.ndarray) -> np.ndarray:
        """Positions in the epoch's global order ``G`` of positions in this rank's slice."""
        g = self.rank * self._len + np.asarray(local, dtype=np.int64)
        return g % self.n_packs if self.n_packs else g

    def _locate(self, epoch: int, positions: np.ndarray) -> Iterator[tuple[int, int, int]]:
        """``(shard, row_group, row)`` of each global position of ``epoch``, lazily (footers opened as needed)."""
        shard_order = self._perm(self._rng(epoch), len(self._shards))
        cum = np.concatenate([[0], np.cumsum(self._rows[shard_order])])
        k = np.searchsorted(cum, positions, side="right") - 1
        # positions of one row group are adjacent in G, so one cached entry of each kind suffices
        shard_key, order, gcum = -1, np.zeros(0, np.int64), np.zeros(1, np.int64)
        group_key, row_perm = (-1, -1), np.zeros(0, np.int64)
        for p, kk in zip(positions.tolist(), k.tolist(), strict=True):
            shard = int(shard_order[kk])
            i = p - int(cum[kk])
            if shard != shard_key:
                sizes = self._group_rows(shard)
                order = self._perm(self._rng(epoch, shard), len(sizes))
                gcum = np.concatenate([[0], np.cumsum(sizes[order])])
                shard_key = shard
            gk = int(np.searchsorted(gcum, i, side="right") - 1)
            group = int(order[gk])
            if (shard, group) != group_key:
                row_perm = self._perm(self._rng(epoch, shard, group), int(self._groups[shard][group]))
                group_key = (shard, group)
            yield shard, group, int(row_perm[i - int(gcum[gk])])

    def _rows_at(self, epoch: int, local: np.ndarray) -> Iterator[dict[str, Any]]:
        """Decode the rows at rank-slice positions ``local``, one row group in memory at a time."""
        where = self._locate(epoch, self._global(local))
        current: tuple[int, int] | None = None
        group: _Group | None = None
        ahead = self._prefetcher(epoch, local) if self.url is not None else None
        try:
            for shard, g, row in where:
                if (shard, g) != current:
                    group = None  # release the previous group before reading the next
                    file = self._file(shard)
                    try:
                        # a runs-form group (schema v3 or v4) is expanded once, whole: rows come out as documented
                        table = expand_table(self._read_group(shard, g))
                    except (OSError, ValueError) as exc:  # pyarrow's errors derive from these
                        raise _corrupt(file, exc) from None
                    group = _Group(table, file)
                    if current is not None and ahead is not None:
                        ahead.advance()
                    current = (shard, g)
                out = group.row(row)
                out["vision"] = self._vision  # the family settings: what packtool.reader.hf builds model inputs from
                yield out
        finally:
            if ahead is not None:
                ahead.close()

    # ---- shards

    def _rng(self, epoch: int, shard: int | None = None, group: int | None = None) -> np.random.Generator:
        """The random stream of one permutation: the epoch's shards, a shard's row groups, or a group's rows.

        Order 2 seeds each stream with ``SeedSequence(seed, spawn_key=(level, epoch, shard, group))``,
        ``level`` 1, 2 or 3 and unused keys 0: the spawn key always has four words and the
        level tells the three kinds apart, so no two permutations share a stream and each
        level is independent of the others. Order 1 (states saved without ``order``) seeded
        ``[seed, epoch]``, ``[seed, epoch, shard]``, ``[seed, epoch, shard, group]``, which
        numpy pads with zeros to the same entropy: shard 0's row groups came in the epoch's
        shard order, and its group 0's rows in that order again. It is kept only so such
        states resume exactly.
        """
        if self.order == 1:
            return np.random.default_rng([self.seed, *(k for k in (epoch, shard, group) if k is not None)])
        level = 1 if shard is None else 2 if group is None else 3
        return np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(level, epoch, shard or 0, group or 0)))

    def _perm(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.permutation(n) if self.shuffle else np.arange(n)

    def _file(self, shard: int) -> Path | str:
        if self.url is not None:
            return f"{self.url}/{self._shards[shard]['file']}"
        return self.path / self._shards[shard]["file"]

    # ---- shards in a bucket

    def _group_cache(self):
        from .cache import GroupCache

        if self._cache is None or self._cache[0] != os.getpid():
            self._cache = (os.getpid(), GroupCache(self.cache_bytes, keep=self.prefetch + 2))
        return self._cache[1]

    def _remote(self, shard: int) -> tuple[str, int, str]:
        entry = self._shards[shard]
        return self._file(shard), int(entry["bytes"]), str(entry["sha256"])

    def _read_group(self, shard: int, group: int):
        if self.url is None:
            return self._open(shard).read_row_group(group)
        cache = self._group_cache()
        # failing every time, it is the shard's own fault (reported as corrupt by the caller)
        return cache.refetching(self._remote(shard)[2], lambda: self._read_cached_group(cache, shard, group))

    def _read_cached_group(self, cache, shard: int, group: int):
        with cache.held(*self._remote(shard), group) as path:  # not evicted by this process while read
            pf = pq.ParquetFile(path, page_checksum_verification=True)
            if pf.metadata.num_rows != int(self._shards[shard]["rows"]):
                raise InputError(f"shard {self._file(shard)!r} holds {pf.metadata.num_rows} rows but {MANIFEST} says "
                                 f"{self._shards[shard]['rows']}; re-run packtool pack")
            return pf.read_row_group(group)

    def _prefetcher(self, epoch: int, local: np.ndarray):
        from .cache import Prefetcher

        def groups() -> Iterator[tuple[str, int, str, int]]:
            last = None
            for shard, g, _ in self._locate(epoch, self._global(local)):
                if (shard, g) != last:
                    last = (shard, g)
                    yield (*self._remote(shard), g)

        return Prefetcher(self._group_cache(), groups(), ahead=self.prefetch)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_cache"] = None
        return state

    def _open(self, shard: int) -> pq.ParquetFile:
        file = self._file(shard)
        entry = self._shards[shard]
        if shard not in self._checked:
            if not file.is_file():
                raise InputError(f"shard {str(file)!r} is listed in {MANIFEST} but missing; copy it again or re-run packtool pack")
            size = file.stat().st_size
            if size != int(entry["bytes"]):
                raise InputError(
                    f"shard {str(file)!r} is {size:,} bytes but {MANIFEST} says {int(entry['bytes']):,}; "
                    "the copy is incomplete or was modified: copy it again or re-run packtool pack"
                )
            if self.verify and sha256_file(file) != entry["sha256"]:
                raise InputError(
                    f"shard {str(file)!r} does not match the sha256 in {MANIFEST}; the file is corrupt: "
                    "copy it again or re-run packtool pack"
                )
            self._checked.add(shard)
        try:
            # pages are read with their CRC32 checked: a flipped bit raises, never decodes to wrong ids
            pf = pq.ParquetFile(file, page_checksum_verification=True)
        except (OSError, ValueError) as exc:
            raise _corrupt(file, exc) from None
        if pf.metadata.num_rows != int(entry["rows"]):
            raise InputError(f"shard {str(file)!r} holds {pf.metadata.num_rows} rows but {MANIFEST} says {entry['rows']}; re-run packtool pack")
        return pf

    def _group_rows(self, shard: int) -> np.ndarray:
        if shard not in self._groups:
            md = self._group_cache().metadata(*self._remote(shard)) if self.url is not None else self._open(shard).metadata
            self._groups[shard] = np.array([md.row_group(i).num_rows for i in range(md.num_row_groups)], dtype=np.int64)
        return self._groups[shard]

    def __repr__(self) -> str:
        return (f"PackedDataset({str(self.path)!r}, rank={self.rank}, world_size={self.world_size}, "
                f"packs={self.n_packs}, per_rank={self._len}, epoch={self.epoch}, consumed={self.consumed})")


def _corrupt(file: Path, exc: Exception) -> InputError:
    return InputError(
        f"shard {str(file)!r} cannot be read ({exc}); the file is corrupt: copy it again or re-run packtool pack "
        "(verify=True checks every shard's sha256 first)"
    )


class _Group:
    """One decoded row group: flat numpy token columns plus list offsets."""

    def __init__(self, table, file: Path) -> None:
        missing = [c for c in (*_TOKEN_COLUMNS, "pack_index", "media", "sample_ids") if c not in table.column_names]
        if missing:
            raise InputError(f"shard {str(file)!r} lacks packed columns {missing}; is it a packtool pack output?")
        self.table = table
        self.cols: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for name in _TOKEN_COLUMNS:
            arr = table.column(name).combine_chunks()
            self.cols[name] = (arr.offsets.to_numpy(), arr.values.to_numpy(zero_copy_only=False))
        self.pack_index = table.column("pack_index").to_numpy()
        self.n_tokens = table.column("n_tokens").to_numpy()
        lengths = np.diff(self.cols["input_ids"][0])
        if not np.array_equal(lengths, self.n_tokens):
            i = int(np.flatnonzero(lengths != self.n_tokens)[0])
            raise InputError(f"shard {str(file)!r}: pack {int(self.pack_index[i])} has n_tokens {int(self.n_tokens[i])} "
                             f"but {int(lengths[i])} tokens; the file is corrupt: copy it again or re-run packtool pack")
        self.n_units = table.column("n_vision_units").to_numpy()

    def row(self, i: int) -> dict[str, Any]:
        out: dict[str, Any] = {
            "pack_index": int(self.pack_index[i]),
            "n_tokens": int(self.n_tokens[i]),
            "n_vision_units": int(self.n_units[i]),
            "sample_ids": self.table.column("sample_ids")[i].as_py(),
        }
        for name, (off, values) in self.cols.items():
            out[name] = values[off[i]:off[i + 1]].astype(np.int32, copy=True)  # a copy: the group can be freed
        out["media"] = self.table.column("media")[i].as_py()
        if "sample_sources" in self.table.column_names:  # a mixture: each sample's source position
            out["sample_sources"] = self.table.column("sample_sources")[i].as_py()
        return out


def _whole(name: str, value: Any) -> int:
    """``value`` as a Python ``int``; a float, string, bool or ``None`` is a :class:`ConfigError`.

    A rank read from the environment is a string, and a float batch size or rank would
    cut the stream at fractional positions (and resume at the wrong pack).

    Example:
        >>> _whole("rank", np.int64(3))
        3
    """
    try:
        return whole_number(value)
    except TypeError:
        raise ConfigError(f"{name} must be an integer, got {value!r} ({type(value).__name__}); pass {name}=int(...) "
                          "(environment variables such as RANK are strings)") from None


def _worker_entry(state: dict[str, Any], base: int, n: int) -> dict[str, int]:
    """The ``worker`` entry of a worker's own state, checked: a block of that worker's share of
    the pass that began at ``base``, or ``n`` (none left)."""
    entry = state["worker"]
    if not isinstance(entry, dict):
        raise ResumeMismatchError(f"reader state has worker={entry!r}, where a dict is needed; load the dict "
                                  "PackedDataset.state_dict() returned, unchanged")
    out = {key: _state_count(entry, key) for key in ("id", "num_workers", "block", "next")}
    wid, k, block, nxt = out["id"], out["num_workers"], out["block"], out["next"]
    ok = k >= 1 and block >= 1 and wid < k and base <= nxt <= n
    if not (ok and (nxt == n or ((nxt - base) % block == 0 and (nxt - base) // block % k == wid))):
        raise ResumeMismatchError(f"reader state has worker={entry!r}, which is no block of worker {wid}'s share of "
                                  f"a pass begun at {base} (packs per rank {n}); load the dict "
                                  "PackedDataset.state_dict() returned, unchanged")
    return out


def _worker() -> tuple[int, int]:
    """``(worker id, worker count)`` inside a torch DataLoader worker, else ``(0, 1)``."""
    info = _worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


def _in_worker() -> bool:
    """True inside a torch DataLoader worker process (even the only one)."""
    return _worker_info() is not None


def _worker_info():
    if "torch" not in sys.modules:  # a DataLoader worker has torch loaded; never import it here
        return None
    from torch.utils.data import get_worker_info

    return get_worker_info()


# --------------------------------------------------------------------------- masks


def attention_mask(subsegment_ids: Sequence[int] | np.ndarray, media: Sequence[dict] | None = None, *,
                   vision: str = "causal") -> np.ndarray:
    """Boolean ``(L, L)`` mask of one packed row: ``mask[q, j]`` is True when query ``q`` may attend key ``j``.

    The rule (DESIGN.md §3.2): ``j <= q`` and ``sub[q] <= sub[j]`` and both in the same
    sample (``sub // 100000`` equal). Padding (:data:`PAD_SUBSEGMENT`) forms its own
    sample, so padded queries see only padding and no row is fully masked.

    Args:
        subsegment_ids: the row's ``subsegment_ids``.
        media: the row's ``media`` list; needed when ``vision`` is not ``"causal"``.
        vision: ``"causal"`` (vision tokens like any other), ``"media"`` (each image or
            video attends to all of its own tokens in both directions) or ``"sample"``
            (all vision tokens of a sample attend to each other in both directions).

    Example:
        >>> attention_mask([10000, 10000, 0, 1]).astype(int).tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]]
    """
    if vision not in VISION_MODES:
        raise ConfigError(f"vision={vision!r}: choose one of {', '.join(VISION_MODES)}")
    sub = np.asarray(subsegment_ids, dtype=np.int64)
    n = len(sub)
    sample = sub // SUBSEGMENT_STRIDE
    mask = sub[:, None] <= sub[None, :]
    mask &= sample[:, None] == sample[None, :]
    mask &= np.tri(n, dtype=bool)
    if vision != "causal":
        if media is None:
            raise ConfigError(f"vision={vision!r} needs the row's media list to know where vision tokens are")
        for idx in _vision_groups(media, vision):
            mask[np.ix_(idx, idx)] = True
    return mask


def _vision_groups(media: Sequence[dict], vision: str) -> list[np.ndarray]:
    spans: dict[Any, list[np.ndarray]] = {}
    for i, m in enumerate(media):
        key = i if vision == "media" else m.get("sample_index", 0)
        start = int(m["token_offset"])
        spans.setdefault(key, []).append(np.arange(start, start + int(m["n_tokens"])))
    return [np.concatenate(v) for v in spans.values()]


def position_ids(subsegment_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Position ids implied by subsegment ids (equal to a packed row's ``position_ids``).

    Every sample restarts at 0; a tree's prefix counts ``0..p-1`` and every branch
    continues from ``p``. Useful to check a row, or to rebuild positions after editing one.

    Example:
        >>> position_ids([10000, 10000, 0, 0, 1, 110000, 110000]).tolist()
        [0, 1, 2, 3, 2, 0, 1]
    """
    sub = np.asarray(subsegment_ids, dtype=np.int64)
    if len(sub) == 0:
        return np.zeros(0, dtype=np.int64)
    keys, inverse = np.unique(sub, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    counts = np.bincount(inverse, minlength=len(keys))
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    within = np.empty(len(sub), dtype=np.int64)
    within[order] = np.arange(len(sub)) - np.repeat(first, counts)
    # branch tokens continue after their sample's prefix
    key_sample = keys // SUBSEGMENT_STRIDE
    is_prefix = keys % SUBSEGMENT_STRIDE == PREFIX_SUBSEGMENT
    prefix_len = {int(s): int(c) for s, c, p in zip(key_sample, counts, is_prefix, strict=True) if p}
    base = np.array([0 if p else prefix_len.get(int(s), 0) for s, p in zip(key_sample, is_prefix, strict=True)], dtype=np.int64)
    return within + base[inverse]


def _has_trees(sub: np.ndarray) -> bool:
    return bool(np.any((sub >= 0) & (sub % SUBSEGMENT_STRIDE != PREFIX_SUBSEGMENT)))


def flash_attn_varlen_kwargs(row: dict | Sequence[dict]) -> dict[str, Any]:
    """Keyword arguments for ``flash_attn_varlen_func`` over one row or rows laid end to end.

    Returns ``cu_seqlens_q``/``cu_seqlens_k`` (``np.int32``), ``max_seqlen_q``/``max_seqlen_k``
    and ``causal=True``. For several rows, their tokens must be concatenated without
    padding (a padding-free batch) in the same order.

    Varlen kernels make each segment causal and isolated, which is exact for ordinary
    samples but cannot express message trees (branches would see each other) or
    bidirectional vision: rows holding trees raise, use :func:`attention_mask` then.

    Example:
        >>> flash_attn_varlen_kwargs({"cu_seqlens": [0, 3, 7], "subsegment_ids": [10000] * 3 + [110000] * 4})["max_seqlen_q"]
        4
    """
    rows = [row] if isinstance(row, dict) else list(row)
    cus, offset = [np.zeros(1, dtype=np.int64)], 0
    for r in rows:
        sub = np.asarray(r["subsegment_ids"], dtype=np.int64)
        if _has_trees(sub):
            raise InputError(
                f"pack {r.get('pack_index', '?')} holds message trees, which varlen attention cannot express "
                "(branches would attend to each other); use packtool.reader.attention_mask instead"
            )
        cu = np.asarray(r["cu_seqlens"], dtype=np.int64)
        cus.append(cu[1:] + offset)
        offset += int(cu[-1])
    cu_all = np.concatenate(cus).astype(np.int32)
    max_len = int(np.diff(cu_all).max()) if len(cu_all) > 1 else 0
    return {"cu_seqlens_q": cu_all, "cu_seqlens_k": cu_all, "max_seqlen_q": max_len, "max_seqlen_k": max_len, "causal": True}


# --------------------------------------------------------------------------- media


@dataclass(frozen=True, slots=True)
class VideoFrames:
    """The frames of one video exactly as counted at tokenize time.

    Attributes:
        frames: decoded RGB frames (``PIL.Image.Image``), in time order.
        timestamps: each frame's time in seconds.
    """

    frames: tuple
    timestamps: tuple[float, ...]


#: Bucket media roots of this process (each keeps its directory listings): URL -> RemoteRoot.
_REMOTE_ROOTS: dict = {}


def _media_file(item: dict, media_root: str | Path | None):
    """The file a media item packed by reference names: a ``Path``, or under a bucket
    ``media_root`` (``s3://``, ``gs://``) a ``storage.RemoteFile``."""
    path = item.get("path")
    if media_root is None or path is None:
        raise InputError(
            f"{item.get('kind', 'media')} {path!r} is stored by reference (packed with --media reference); "
            "pass media_root= the --media-root used at tokenize time, or re-pack with --media embed"
        )
    from ..errors import SampleError
    from ..media import resolve_media_path
    from ..storage import RemoteRoot, is_url

    try:
        if is_url(str(media_root)):
            url = str(media_root).rstrip("/")
            root = _REMOTE_ROOTS.get(url) or _REMOTE_ROOTS.setdefault(url, RemoteRoot(url))
            return root.file(path)
        # tokenize's own rules, so every path it accepted is found again (``imgs\a.jpg`` included)
        return resolve_media_path(path, Path(media_root))
    except SampleError as err:
        raise InputError(f"{err.message.replace('--media-root', 'media_root')}; pass the right media_root") from None


def decode_image(item: dict, media_root: str | Path | None = None, *, exif: bool = False):
    """The RGB ``PIL.Image`` of one image media item (embedded bytes, else ``media_root/path``).

    ``exif=True`` turns the image by its EXIF orientation first, as families whose
    loader does so were counted (the manifest's ``vision.exif == "apply"``). Transparency
    (an alpha band, a palette's transparent colour) is laid over white, as ``transformers``'
    ``convert_to_rgb`` and qwen-vl-utils do: a plain ``convert("RGB")`` would show whatever
    colour the transparent pixels hide (usually black), not what the model's processor shows.

    Raises:
        InputError: the image is refused (a format outside the allow-list) or does not decode
            (tokenize reads headers only, so damaged pixel data is found here or by
            ``packtool validate``), naming the image.
    """
    from PIL import Image, ImageOps

    data = item.get("data")
    src = io.BytesIO(data) if data else _media_file(item, media_root)
    if not isinstance(src, io.BytesIO | Path):  # in a bucket: the whole image in one GET
        src = io.BytesIO(src.read_bytes())
    try:
        with _open_image(src) as im:
            im = ImageOps.exif_transpose(im) if exif else im
            if "A" not in im.getbands() and im.info.get("transparency") is None:
                return im.convert("RGB")
            rgba = im.convert("RGBA")
            return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        # UnidentifiedImageError's text holds the file object's address: the path says which file
        why = "not an image Pillow can identify" if isinstance(exc, Image.UnidentifiedImageError) else str(exc)[:200]
        where = "embedded in the pack" if data else "under media_root"
        raise InputError(f"image {item.get('path')!r} ({where}) does not decode: {why}; replace the file and "
                         "re-run tokenize and pack (packtool validate lists every such image)") from None


def _open_image(src):
    """Open an image with packtool's allow-list (``media.IMAGE_FORMATS``): an EPS or PDF placed
    in a shard or under the media root is refused, never handed to Ghostscript."""
    from ..errors import SampleError
    from ..media import open_image

    try:
        return open_image(src)
    except SampleError as err:
        raise InputError(f"{err.message}: {src if isinstance(src, Path) else 'embedded bytes'}") from None


def decode_video(item: dict, media_root: str | Path | None = None, *, exif: bool | None = None) -> VideoFrames:
    """The frames of one video media item with their timestamps.

    Embedded videos carry one JPEG per counted timestamp. For videos packed by
    reference the file under ``media_root`` (or the file's bytes the item holds, for a
    video that came as bytes) is decoded with PyAV and the frames are
    picked by the rule pack embeds with (:func:`packtool.media.counted_frames`: the
    frame on screen at each timestamp after the stream's first frame, turned by the
    rotation tokenize counted), so both media modes give the same frames. ``exif``: whether
    tokenize applied the display rotation (the manifest's ``vision.exif == "apply"``, which
    :func:`decode_media` reads); ``None`` guesses it from the recorded size, which misses a
    half turn and any turn of a square video.
    """
    stamps = tuple(float(t) for t in (item.get("timestamps") or ()))
    data = item.get("frames")
    if data:
        from PIL import Image

        frames = []
        for i, blob in enumerate(data):
            try:
                with _open_image(io.BytesIO(blob)) as im:
                    frames.append(im.convert("RGB"))
            except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
                # as decode_image: which video and frame, and the fix, not Pillow's traceback
                why = "not an image Pillow can identify" if isinstance(exc, Image.UnidentifiedImageError) else str(exc)[:200]
                raise InputError(f"video {item.get('path')!r}: embedded frame {i} of {len(data)} does not decode: {why}; "
                                 "the pack is damaged: copy it again or re-run packtool pack") from None
        if stamps and len(stamps) != len(frames):
            raise InputError(f"video {item.get('path')!r} has {len(frames)} embedded frames but {len(stamps)} timestamps; re-run packtool pack")
        sizes = sorted({f.size for f in frames})
        if len(sizes) > 1:  # packed by a packtool that let a stream whose size changes through
            raise InputError(f"video {item.get('path')!r} has embedded frames of {len(sizes)} sizes "
                             f"({', '.join(f'{w}x{h}' for w, h in sizes)}), which a model's processor cannot take as "
                             "one video; re-run packtool tokenize and pack, which reject it")
        return VideoFrames(tuple(frames), stamps)
    from ..errors import SampleError
    from ..media import counted_frames

    inline = item.get("data")  # a video that came as bytes keeps its file in the pack (--media reference)
    file = inline if inline else _media_file(item, media_root)
    try:
        # in a bucket: every frame is decoded, so the whole file in one GET
        frames = counted_frames(file if isinstance(file, Path | bytes) else file.read_bytes(), item, exif)
    except SampleError as err:
        where = "held in the pack" if inline else repr(str(file))
        raise InputError(f"video {where}: {err.message}; re-check the file or re-pack with --media embed") from None
    return VideoFrames(tuple(f.convert("RGB") for f in frames), stamps)


def decode_media(row: dict, media_root: str | Path | None = None) -> list:
    """Every media item of a row, in row order: ``PIL.Image`` for images, :class:`VideoFrames` for videos.

    Images are turned by their EXIF orientation when the pack's family settings say tokenize
    counted them so (``row["vision"]["exif"] == "apply"``: Molmo2's default, or ``--exif apply``),
    so each image has the size its media item records and its vision tokens were counted for;
    videos packed by reference, by their display rotation under the same setting.
    """
    setting = (row.get("vision") or {}).get("exif")
    exif = setting == "apply"
    return [decode_video(m, media_root, exif=None if setting is None else exif) if m["kind"] == "video"
            else decode_image(m, media_root, exif=exif) for m in row["media"]]


# --------------------------------------------------------------------------- batches


def collate(rows: Sequence[dict], pad_to: int | None = None, *, pad_token_id: int = 0, masks: bool = False,
            vision: str = "causal", pixels: bool = True, media_root: str | Path | None = None) -> dict[str, Any]:
    """Stack packed rows into a batch, padded on the right.

    Args:
        rows: rows from :class:`PackedDataset`.
        pad_to: pad every row to this length (static shapes, e.g. for ``torch.compile``);
            ``None`` pads to the longest row.
        pad_token_id: input id placed in padding.
        masks: also return ``attention_mask`` (``(B, 1, T, T)`` bool, True = may attend;
            memory grows with ``T**2``).
        vision: see :func:`attention_mask`.
        pixels: decode media into ``pixel``.
        media_root: where media packed by reference live.

    Returns:
        ``input_ids``, ``target_ids`` (padding ``-100``), ``position_ids`` (padding 0),
        ``subsegment_ids`` (padding :data:`PAD_SUBSEGMENT`): ``(B, T)`` ``int64`` arrays;
        ``lengths`` ``(B,)``; ``cu_seqlens``: per row an ``int32`` array whose padding,
        if any, is one more segment; ``pixel``: per row the decoded media in row order
        (``PIL.Image`` or :class:`VideoFrames`; empty lists when ``pixels=False``);
        ``media``: per row the media metadata (no bytes); ``sample_ids``, ``pack_index``;
        ``sample_sources`` when the rows carry it (a mixture).

    Raises:
        ConfigError: a row is longer than ``pad_to``.

    Example:
        >>> b = collate([{"input_ids": [5, 6], "target_ids": [6, -100], "position_ids": [0, 1],
        ...               "subsegment_ids": [10000, 10000], "cu_seqlens": [0, 2], "media": []}], pad_to=3)
        >>> b["target_ids"].tolist(), b["cu_seqlens"][0].tolist()
        ([[6, -100, -100]], [0, 2, 3])
    """
    lengths = np.array([len(r["input_ids"]) for r in rows], dtype=np.int64)
    longest = int(lengths.max()) if len(rows) else 0
    width = longest if pad_to is None else int(pad_to)
    if longest > width:
        i = int(np.argmax(lengths))
        # an --oversize alone pack is longer than --max-tokens, so max_tokens is not always enough
        raise ConfigError(
            f"pack {rows[i].get('pack_index', '?')} has {longest:,} tokens but pad_to is {width:,}; raise pad_to to the "
            "longest pack (packs over --max-tokens hold an --oversize alone sample: re-pack with --oversize drop or "
            "truncate to keep every pack within --max-tokens)"
        )
    fills = {"input_ids": pad_token_id, "target_ids": IGNORE_INDEX, "position_ids": 0, "subsegment_ids": PAD_SUBSEGMENT}
    out: dict[str, Any] = {}
    for name, fill in fills.items():
        arr = np.full((len(rows), width), fill, dtype=np.int64)
        for i, r in enumerate(rows):
            arr[i, : lengths[i]] = r[name]
        out[name] = arr
    out["lengths"] = lengths
    cus = []
    for i, r in enumerate(rows):
        cu = np.asarray(r["cu_seqlens"], dtype=np.int32)
        cus.append(np.append(cu, np.int32(width)) if lengths[i] < width else cu)
    out["cu_seqlens"] = cus
    if masks:
        out["attention_mask"] = np.stack(
            [attention_mask(out["subsegment_ids"][i], r["media"], vision=vision) for i, r in enumerate(rows)]
        )[:, None] if rows else np.zeros((0, 1, width, width), dtype=bool)
    out["pixel"] = [decode_media(r, media_root) if pixels else [] for r in rows]
    out["media"] = [[{k: v for k, v in m.items() if k not in ("data", "frames")} for m in r["media"]] for r in rows]
    out["sample_ids"] = [list(r.get("sample_ids", [])) for r in rows]
    if rows and all("sample_sources" in r for r in rows):
        out["sample_sources"] = [list(r["sample_sources"]) for r in rows]
    out["pack_index"] = [r.get("pack_index") for r in rows]
    return out
