"""Train a tiny Qwen2.5-VL on the demo packs for a few steps on the CPU, save, resume, continue.

Runs end to end with no download: the model is a random-init ``Qwen2_5_VLForConditionalGeneration``
built from config with the packs' own vocabulary (the embedded Qwen2 tokenizer), and the
demo corpus in ``examples/sample`` is tokenized and packed first::

    python examples/train_hf.py --out build/train-hf --steps 4

What it shows:

* ``PackedIterableDataset(..., attn_implementation="sdpa", config=model.config)`` yields
  exactly the model's keyword arguments, made in DataLoader workers (mRoPE positions,
  pixels from the processor with the manifest's settings, the boolean mask);
* gradient accumulation normalised by loss tokens: every micro-batch of a step gets the
  step's total ``num_items_in_batch``, so the loss is a mean over the step's tokens
  whatever the packing;
* exact resume: the reader's ``state_dict`` is saved with the model and optimizer; a new
  process that loads them sees the very batch the uninterrupted run would have seen next,
  and computes the same loss on it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import packtool
from packtool.reader import PackedDataset
from packtool.reader.torch import PackedIterableDataset
from packtool.shards import is_output_dir

ROOT = Path(__file__).resolve().parent
ACCUMULATE = 2  # micro-batches per optimizer step


def build_packs(out: Path) -> Path:
    """The demo corpus, images capped at 64 merged patches so a CPU step takes about a second."""
    tok, packed = out / "tokenized", out / "packed"
    if not is_output_dir(packed):
        packtool.tokenize_dataset([ROOT / "sample" / "data.jsonl"], tok,
                                  packtool.TokenizeConfig(media_root=str(ROOT / "sample"), max_pixels=28 * 28 * 64))
        packtool.pack_dataset(tok, packed, packtool.PackConfig(max_tokens=512))
    return packed


def tiny_model(packed: Path, seed: int = 0):
    """A two-layer random-init Qwen2.5-VL whose token ids are the packs' (read from the manifest)."""
    import transformers

    from packtool.tokenization import load_tokenizer

    manifest = PackedDataset(packed).manifest
    tok = load_tokenizer(None)  # the embedded Qwen2 vocabulary the demo packs were made with
    if manifest["tokenizer"]["vocab_sha256"] != tok.identity()["vocab_sha256"]:
        sys.exit("the packs were made with another tokenizer; rebuild them")
    config = transformers.Qwen2_5_VLConfig(
        text_config={"vocab_size": manifest["tokenizer"]["vocab_size"], "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0}},
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "out_hidden_size": 32,
                       "fullatt_block_indexes": [1], "tokens_per_second": 2},
        image_token_id=tok.special_id("<|image_pad|>"), video_token_id=tok.special_id("<|video_pad|>"),
        vision_start_token_id=tok.special_id("<|vision_start|>"), vision_end_token_id=tok.special_id("<|vision_end|>"),
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return transformers.Qwen2_5_VLForConditionalGeneration(config)


def loader(packed: Path, config, state: dict | None = None):
    """The reader (restored from ``state`` when given) and an endless stream of its batches, epoch after epoch."""
    ds = PackedIterableDataset(packed, batch_size=1, seed=0, attn_implementation="sdpa", config=config)
    if state is not None:
        ds.load_state_dict(state)
    dl = DataLoader(ds, batch_size=None, num_workers=2)

    def stream():
        epoch = ds.dataset.epoch
        while True:
            ds.set_epoch(epoch)  # the epoch it is in keeps its position: a resumed run continues mid-epoch
            yield from dl
            epoch += 1

    return ds, stream()


def steps(model, optimizer, batches, n_steps: int):
    """``n_steps`` optimizer steps of ``ACCUMULATE`` micro-batches; yields (step loss, reader position)."""
    for _ in range(n_steps):
        micro = [next(batches) for _ in range(ACCUMULATE)]
        total = sum(int(b["num_items_in_batch"]) for b in micro)  # loss tokens of the whole step
        loss_sum = 0.0
        for b in micro:
            position = {"epoch": b.pop("epoch"), "consumed": b.pop("consumed")}
            b["num_items_in_batch"] = torch.tensor(total)
            loss = model(**b).loss  # sum over this micro-batch's tokens / the step's tokens
            loss.backward()
            loss_sum += float(loss.detach())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        yield loss_sum, position


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("build/train-hf"))
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps before the checkpoint")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    packed = build_packs(args.out)
    print(f"packs: {PackedDataset(packed).n_packs} in {packed}")

    # run 1: train, checkpoint, and note what the next step would have seen
    model = tiny_model(packed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ds, batches = loader(packed, model.config)
    for i, (loss, position) in enumerate(steps(model, optimizer, batches, args.steps), 1):
        print(f"step {i}  loss {loss:.4f}  reader epoch {position['epoch']} consumed {position['consumed']}")
    ckpt = args.out / "checkpoint.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "reader": ds.state_dict({"epoch": position["epoch"], "consumed": position["consumed"]})}, ckpt)
    print(f"saved {ckpt}")
    expected = [next(batches) for _ in range(ACCUMULATE)]  # what the uninterrupted run gets next
    expected_loss, _ = next(steps(model, optimizer, iter(expected), 1))
    del batches

    # run 2: a fresh model, optimizer and reader restored from the checkpoint
    state = torch.load(ckpt, weights_only=False)
    model = tiny_model(packed, seed=1)
    model.load_state_dict(state["model"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.load_state_dict(state["optimizer"])
    _, batches = loader(packed, model.config, state["reader"])
    resumed = [next(batches) for _ in range(ACCUMULATE)]
    same = all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(expected, resumed, strict=True))
    resumed_loss, _ = next(steps(model, optimizer, iter(resumed), 1))
    print(f"resumed at epoch {state['reader']['epoch']} consumed {state['reader']['consumed']}: next batch "
          f"{'identical' if same else 'DIFFERENT'}, loss {resumed_loss:.4f} (uninterrupted run {expected_loss:.4f})")
    return 0 if same and abs(resumed_loss - expected_loss) <= 1e-5 * max(1.0, abs(expected_loss)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
