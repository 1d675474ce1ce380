"""Tiny Hugging Face causal language models built from configs (no download), and the worker of the
2-process tests (run inside phalanx.spawn): load pretrained weights from a save_pretrained
directory, train a few steps with or without activation checkpointing (Hugging Face's own, or
phalanx's strategy.activation_checkpointing), save a checkpoint, and return the weights."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

VOCAB, SEQUENCE, SAMPLES, GLOBAL_BATCH = 128, 16, 16, 8
BLOCKS = {"gpt2": "GPT2Block", "llama": "LlamaDecoderLayer"}  # what strategy.activation_checkpointing names


def quiet() -> None:
    """transformers' advice (a deprecated alias, a token id outside the tiny vocabulary) is not the test's."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)


def build(kind: str, seed: int = 0):
    """A 2-layer GPT-2 (tied embedding and head) or Llama (untied) of 32 wide, without dropout, so
    that any number of processes computes the same loss."""
    quiet()
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    ids = {"bos_token_id": 0, "eos_token_id": 0}
    if kind == "gpt2":
        config = GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **ids,
        )  # fmt: skip
        return GPT2LMHeadModel(config)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, **ids,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def pretrained(kind: str, directory: str, max_shard_size: str = "20KB") -> dict[str, torch.Tensor]:
    """A seeded model saved by save_pretrained in shards (with their index); returns its state dict."""
    model = build(kind, seed=1)
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQUENCE), generator=g)
    return DataLoader(TensorDataset(ids), batch_size=GLOBAL_BATCH, shuffle=True)


def train(settings: dict[str, Any]) -> dict[str, Any]:
    """One run: ``settings`` has kind, strategy, source (a save_pretrained directory), and optionally
    checkpointing ("hf", "phalanx" or None), steps (2), ckpt (a checkpoint.dir to save into).
    Returns, on rank 0, the weights right after the load and after training, and the checkpoint;
    on every rank, how often the first block's MLP ran while training (twice a step when recomputed)."""
    import phalanx

    quiet()
    kind, strategy = settings["kind"], settings["strategy"]
    model = build(kind)
    if settings.get("checkpointing") == "hf":
        model.gradient_checkpointing_enable()
    section: dict[str, Any] = {"name": strategy}
    if settings.get("checkpointing") == "phalanx":
        section["activation_checkpointing"] = [BLOCKS[kind]]
    ckpt = settings.get("ckpt")
    session = phalanx.Session(
        strategy=section,
        train={"progress": False, "metrics": False, "seed": 0},
        checkpoint={"dir": ckpt, "resume": "never"} if ckpt else {},
    )
    # A layer inside the first block starts again in backward when the block is checkpointed (a pre-hook:
    # torch's non-reentrant recompute stops once it has what backward needs, before the layer's end).
    calls = []
    inner = next(m for m in model.modules() if type(m).__name__ == BLOCKS[kind]).mlp
    inner.register_forward_pre_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = session.setup(model, optimizer, _data())
    session.load_weights(settings["source"])
    out: dict[str, Any] = {"rank": session.rank, "loaded": _full(session, model)}
    tied = session.strategy.weight_slots(model)
    if kind == "gpt2":
        out["tied"] = tied["lm_head.weight"] is tied["transformer.wte.weight"]
    model.train()
    while session.step_count < settings.get("steps", 2):
        for (ids,) in session.progress(loader):
            with session.accumulate(model):
                session.backward(model(input_ids=ids, labels=ids).loss)
    out["weights"] = _full(session, model)
    out["forwards"] = len(calls)
    if ckpt:
        out["saved"] = str(session.save())
    session.close()
    return out


def train_float64(settings: dict[str, Any]) -> dict[str, Any]:
    """:func:`train` with float64 as the default dtype: rounding out of the way of equivalence."""
    torch.set_default_dtype(torch.float64)
    return train(settings)


def _full(session, model) -> dict[str, torch.Tensor] | None:
    state = session.model_state_dict(model)  # a collective under fsdp: every rank calls it
    return {k: v.detach().clone() for k, v in state.items()} if session.rank == 0 else None
