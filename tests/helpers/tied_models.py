"""Language models with tied weights, and a worker that trains one a few SGD steps (run inside
phalanx.spawn, or called directly for one process): tiny GPT-2 and Llama models built from
Hugging Face configs (nothing downloaded), and a pure-torch model whose embedding is its output
layer, each built eagerly under a seed or under ``session.init_module()``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from phalanx import Config, Session

VOCAB, SEQ, GLOBAL_BATCH = 128, 16, 4


class TinyTied(nn.Module):
    """An embedding, two blocks and an output layer that is the embedding (no transformers)."""

    def __init__(self, vocab: int = VOCAB, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(2))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))


def gpt2_config():
    from transformers import GPT2Config

    # Token ids inside the tiny vocabulary (the defaults, 50256, are outside it and warned about);
    # no dropout, whose masks differ per rank and would make N processes train unlike one.
    no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    return GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0, **no_dropout
    )


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def build(kind: str) -> nn.Module:
    if kind == "tiny":
        return TinyTied()
    if kind == "gpt2":
        from transformers import GPT2LMHeadModel

        return GPT2LMHeadModel(gpt2_config())
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config())


def tied(model: nn.Module) -> bool:
    """Whether the output layer's weight is the embedding's (one object)."""
    if isinstance(model, TinyTied):
        return model.head.weight is model.embed.weight
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def _batches(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g) for _ in range(steps)]


def train(kind: str, strategy: str, deferred: bool, settings: dict[str, Any]) -> dict[str, Any]:
    """Build ``kind`` (eagerly under seed 0, or deferred), set it up under ``strategy`` with
    ``settings`` (its options section, ``steps``, ``weights`` to load), take the steps (each on
    this rank's share of one global batch of next-token prediction) and return rank 0's initial
    and final weights, and every rank's answer to whether the tie survived."""
    settings = dict(settings)
    steps, weights = settings.pop("steps", 3), settings.pop("weights", None)
    session = Session(
        Config(),
        strategy={"name": strategy, **settings},
        train={"progress": False, "metrics": False, "seed": 0},
    )
    if deferred:
        with session.init_module():
            model = build(kind)
    else:
        torch.manual_seed(0)
        model = build(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = session.setup(model, optimizer)
    if weights is not None:
        session.load_weights(weights)
    inner = session.unwrap(model)
    out: dict[str, Any] = {"rank": session.rank, "tied": tied(inner), "initial": _full(session, model)}
    share = GLOBAL_BATCH // session.world_size
    for ids in _batches(steps):
        mine = ids[session.rank * share : (session.rank + 1) * share]
        with session.accumulate(model):
            out_logits = logits(model, mine[:, :-1])
            session.backward(F.cross_entropy(out_logits.flatten(0, 1), mine[:, 1:].flatten()))
    out["final"] = _full(session, model)
    out["tied_after"] = tied(session.unwrap(model))
    session.close()
    return out


def _full(session: Session, model: nn.Module) -> dict[str, torch.Tensor] | None:
    state = session.model_state_dict(model)  # a collective under fsdp: every rank calls it
    return {k: v.detach().clone() for k, v in state.items()} if session.rank == 0 else None


def save_pretrained(path: str) -> str:
    """GPT-2's own weights file, written by transformers (which keeps one name of a tied weight)."""
    torch.manual_seed(7)
    build("gpt2").save_pretrained(path)
    return f"{path}/model.safetensors"
