"""Fine-tune a small Hugging Face causal language model with phalanx: a Llama or a GPT-2 (whose
output layer is tied to its input embeddings) built from the config shipped beside this script.

    phalanx launch --cpu --nproc 2 examples/hf_causal_lm.py --model gpt2 --out runs/hf-gpt2

What it shows, in the order it happens:

1. "Pretrained" weights, made locally: the model built from its config under ``torch.manual_seed``
   and written by ``save_pretrained`` as several safetensors shards with an index, as a
   checkpoint from the Hub comes (nothing is downloaded).
2. Deferred construction: the model is built under ``session.init_module(initialize=False)``, so no
   rank ever holds all of it; under fsdp each rank materialises only its shards. Ties survive.
3. ``session.load_weights(directory)`` reads the shards one tensor at a time on rank 0.
4. Variable-length text (``phalanx.demo.text``), padded per micro batch, the loss the model's own
   (a mean over the valid tokens), and ``session.backward(loss, items=n)``, so the step is the mean
   over the global batch's tokens whatever the number of processes.
5. ``session.save()`` and an export back to a Hugging Face directory that ``from_pretrained`` loads.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import AutoConfig, AutoModelForCausalLM

import phalanx
from phalanx.checkpoint.hf_export import export_hf
from phalanx.demo.text import Corpus
from phalanx.util.units import parse_size

CONFIGS = Path(__file__).resolve().parent / "hf_causal_lm"
BLOCKS = {"llama": "LlamaDecoderLayer", "gpt2": "GPT2Block"}  # fsdp's shard units


class Sentences(Dataset):
    """The corpus's training stream cut into sequences of 8 to 64 tokens (the cuts are seeded)."""

    def __init__(self, vocab: int, count: int):
        stream = Corpus(tokens=40 * count, vocab=vocab).train
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(8, 65, (count,), generator=g).tolist()
        starts = torch.tensor([0, *lengths[:-1]]).cumsum(0).tolist()
        self.pieces = [stream[s : s + n] for s, n in zip(starts, lengths)]

    def __len__(self) -> int:
        return len(self.pieces)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.pieces[i]


def pad(pieces: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Right-padded to the longest of the micro batch; padding is masked and labelled -100."""
    longest = max(len(p) for p in pieces)
    ids = torch.zeros(len(pieces), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, piece in enumerate(pieces):
        ids[row, : len(piece)], mask[row, : len(piece)] = piece, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(BLOCKS), default="llama")
    parser.add_argument("--out", type=Path, default=Path("runs/hf-causal-lm"), help="where everything is written")
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per optimizer step, all processes")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--shard-size", default="150KB", help="the largest safetensors shard, in and out")
    args = parser.parse_args()

    settings = {"name": args.strategy, "fsdp": {"wrap": [BLOCKS[args.model]]}}
    session = phalanx.Session(
        strategy=settings,
        batch={"global_batch_size": args.batch_size, "micro_batch_size": 4},
        train={"max_steps": args.steps, "seed": 0},
        checkpoint={"dir": str(args.out / "checkpoints"), "resume": "never"},
    )
    config = AutoConfig.from_pretrained(CONFIGS / args.model)
    pretrained = args.out / "pretrained"
    if session.is_main and not (pretrained / "model.safetensors.index.json").exists():
        torch.manual_seed(1234)
        AutoModelForCausalLM.from_config(config).save_pretrained(pretrained, max_shard_size=args.shard_size)
    session.barrier()

    with session.init_module(initialize=False):  # the weights come from step 1's shards
        model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    loader = DataLoader(
        Sentences(config.vocab_size, args.batch_size * args.steps), args.batch_size, shuffle=True, collate_fn=pad
    )
    model, optimizer, loader = session.setup(model, optimizer, loader)
    session.load_weights(pretrained)

    for _ in session.epochs():
        for batch in session.progress(loader):
            with session.accumulate(model):
                loss = model(**batch).loss  # the mean over this micro batch's predicted tokens
                session.backward(loss, items=(batch["labels"][:, 1:] != -100).sum())
    saved = session.save()
    if session.is_main:
        # What `phalanx checkpoint export --format hf CHECKPOINT DIR --max-shard-size 150KB` does.
        exported = export_hf(saved, args.out / "export", max_shard_size=parse_size(args.shard_size))
        print(f"exported {len(exported.files)} file(s) to {args.out / 'export'}; from_pretrained loads it")
    final = session.model_state_dict()  # every rank takes part (fsdp gathers); rank 0 gets the weights
    if session.is_main:
        torch.save(final, args.out / "final.pt")
    session.close()


if __name__ == "__main__":
    main()
