"""``torch.utils.data.IterableDataset`` over packed shards (``pip install packtool[torch]``).

The adapter batches inside each DataLoader worker, so build the loader with
``batch_size=None``; workers take alternate batches of the rank's stream and the
DataLoader's round-robin hands them to the trainer in stream order::

    ds = PackedIterableDataset("packed/", batch_size=2, rank=rank, world_size=world, seed=0)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    for epoch in range(start_epoch, n_epochs):
        ds.set_epoch(epoch)
        for batch in loader:
            logits = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"])
            loss = F.cross_entropy(logits.flatten(0, 1), batch["shift_labels"].flatten(), ignore_index=-100)
            ...
            state = ds.state_dict(batch)   # the position after this batch: store it with the checkpoint

With torchdata's ``StatefulDataLoader`` in place of ``DataLoader``, ``loader.state_dict()`` is
the checkpoint: inside each worker ``ds.state_dict()`` is that worker's own progress, which the
loader saves per worker and restores into the same worker (same ``num_workers`` and batch size).

A batch holds tensors ``input_ids``, ``shift_labels`` (the pre-shifted ``target_ids``:
``shift_labels[t]`` is what position ``t`` predicts, ``-100`` for no loss),
``position_ids``, ``subsegment_ids`` (all ``(B, T)`` int64), ``lengths`` ``(B,)``,
``attention_mask`` ``(B, 1, T, T)`` bool (True = may attend; the form
``scaled_dot_product_attention`` takes) unless ``masks=False``, ``cu_seqlens`` (list of
int32 tensors); and plain Python ``pixel``, ``media``, ``sample_ids``, ``pack_index``,
``epoch`` and ``consumed`` (the rank's position after this batch).

With ``attn_implementation=`` set, a batch is instead exactly the keyword arguments of
the family's ``transformers`` model class (:func:`packtool.reader.hf.model_inputs`: 3-D
mRoPE positions for Qwen-VL, the processor's pixels, the mask in the form that
attention implementation reads), made inside the DataLoader workers, plus ``epoch``
and ``consumed``; pop those two before calling the model::

    ds = PackedIterableDataset("packed/", batch_size=2, attn_implementation="sdpa", config=model.config)
    for batch in DataLoader(ds, batch_size=None, num_workers=2):
        epoch, consumed = batch.pop("epoch"), batch.pop("consumed")
        model(**batch).loss.backward()
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..errors import ConfigError
from . import MIRROR_SIZE, PackedDataset, _whole, collate

__all__ = ["PackedIterableDataset", "to_tensors"]

log = logging.getLogger(__name__)


def to_tensors(batch: dict[str, Any]) -> dict[str, Any]:
    """Turn a :func:`packtool.reader.collate` batch into tensors; ``target_ids`` becomes ``shift_labels``."""
    out: dict[str, Any] = {}
    for key, value in batch.items():
        name = "shift_labels" if key == "target_ids" else key
        if isinstance(value, np.ndarray):
            out[name] = torch.from_numpy(value)
        elif key == "cu_seqlens":
            out[name] = [torch.from_numpy(np.asarray(c, dtype=np.int32)) for c in value]
        else:
            out[name] = value
    return out


class PackedIterableDataset(IterableDataset):
    """Batches of packed rows as tensors, split by rank and DataLoader worker.

    Args:
        source: a packed directory (then ``dataset_kwargs`` go to
            :class:`~packtool.reader.PackedDataset`) or a ``PackedDataset`` (then
            ``dataset_kwargs`` must be empty: ``rank=`` and the like are refused, not ignored).
        batch_size: packs per batch; the last batch of an epoch may be smaller.
        pad_to: fixed padded length (static shapes), else the longest pack of the batch.
        masks: include ``attention_mask``.
        vision: ``"causal"``, ``"media"`` or ``"sample"`` (see ``attention_mask``).
        pixels: decode media into ``pixel`` (PIL images / ``VideoFrames``).
        media_root: where media packed by reference live.
        pad_token_id: input id used for padding.
        attn_implementation: build model inputs for this attention implementation
            (see :func:`packtool.reader.hf.model_inputs`) instead of plain tensors.
        config: the model's config, for ``attn_implementation`` (checkpoint constants
            such as Qwen2.5-VL's ``tokens_per_second``).
        dtype: float dtype of the additive mask ``attn_implementation="eager"`` builds (the
            model's, e.g. ``torch.bfloat16``: half the bytes of the default float32, which
            the model's attention would promote the scores to).
    """

    def __init__(self, source: str | Path | PackedDataset, *, batch_size: int = 1, pad_to: int | None = None,
                 masks: bool = True, vision: str = "causal", pixels: bool = False,
                 media_root: str | Path | None = None, pad_token_id: int = 0, attn_implementation: str | None = None,
                 config: Any = None, dtype: Any = None, **dataset_kwargs: Any) -> None:
        super().__init__()
        if isinstance(source, PackedDataset) and dataset_kwargs:
            # they would be ignored: every rank would silently read the dataset's own slice
            raise ConfigError(f"{', '.join(f'{k}=' for k in dataset_kwargs)} would be ignored: the PackedDataset given "
                              "is already split; pass them to PackedDataset(...) or give PackedIterableDataset the path")
        self.dataset = source if isinstance(source, PackedDataset) else PackedDataset(source, **dataset_kwargs)
        # persistent DataLoader workers hold copies made when they started: the trainer's later
        # set_epoch / load_state_dict reach them through this vector (shared memory, across fork and spawn)
        try:
            self.dataset._share_position(torch.zeros(MIRROR_SIZE, dtype=torch.int64).share_memory_())
        except (RuntimeError, OSError) as exc:  # no shared memory here: DataLoader workers could not run either
            log.warning("no shared memory for the reader's position (%s): persistent DataLoader workers will not see "
                        "a later set_epoch or load_state_dict; use persistent_workers=False", exc)
        batch_size = _whole("batch_size", batch_size)
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.batch_size = batch_size
        self._collate = dict(pad_to=pad_to, masks=masks, vision=vision, pixels=pixels, media_root=media_root,
                             pad_token_id=pad_token_id)
        self._hf = None
        if attn_implementation is not None:
            from .hf import ATTN_IMPLEMENTATIONS

            if attn_implementation not in ATTN_IMPLEMENTATIONS:
                raise ValueError(f"attn_implementation={attn_implementation!r}: choose one of {', '.join(ATTN_IMPLEMENTATIONS)}")
            self._hf = dict(attn_implementation=attn_implementation, media_root=media_root, pad_to=pad_to,
                            pad_token_id=pad_token_id, config=config, dtype=dtype)
        elif dtype is not None:  # it would be ignored: only an eager mask of model inputs has a float dtype
            raise ConfigError(f"dtype={dtype} is the float dtype of an eager mask: pass it with "
                              "attn_implementation='eager' (the plain batch's attention_mask is bool)")

    def __len__(self) -> int:
        """Batches per rank per epoch."""
        return math.ceil(len(self.dataset) / self.batch_size)

    def __iter__(self):
        info = get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        # the pass is set up now, not at the first batch: StatefulDataLoader asks a worker for its
        # state right after iter(), and a restored worker must already stand where it stopped
        blocks = self.dataset.iter_blocks(worker, n_workers, block=self.batch_size)
        return self._batches(blocks, self.dataset.epoch)

    def _batches(self, blocks, epoch: int):
        for rows, consumed in blocks:
            if self._hf is not None:
                from .hf import model_inputs

                batch = model_inputs(rows, **self._hf)
            else:
                batch = to_tensors(collate(rows, **self._collate))
            batch["epoch"] = epoch
            batch["consumed"] = consumed
            yield batch

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def state_dict(self, batch: dict[str, Any] | None = None) -> dict[str, Any]:
        """The stream position right after ``batch`` (the last batch the trainer used).

        Without a batch, the dataset's own position: exact when iterated in-process; inside a
        DataLoader worker, that worker's own progress, which is what torchdata's
        ``StatefulDataLoader`` saves for each worker and restores into it (the loader's
        ``state_dict()`` is then the whole checkpoint; restore it with the same ``num_workers``
        and batch size).
        """
        if batch is None:
            return self.dataset.state_dict()
        if "consumed" not in batch or "epoch" not in batch:
            # model_inputs batches lose them when popped before model(**batch), as they must be
            raise ConfigError("the batch has no 'epoch' and 'consumed' (popped before the model call?); keep them, "
                              "as in position = {'epoch': b.pop('epoch'), 'consumed': b.pop('consumed')}, and pass "
                              "state_dict(position)")
        return self.dataset.state_dict(batch["consumed"], batch["epoch"])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (see :meth:`PackedDataset.load_state_dict`). Persistent DataLoader
        workers take it too, when they next start a pass (``for batch in loader``)."""
        self.dataset.load_state_dict(state)
