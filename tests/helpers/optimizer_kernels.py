"""Every strategy under the optimizer kernels torch picks for CUDA tensors (foreach; fused, which
torch also has for CPU tensors) and under each value of compute.optimizer_impl: the variants, and a
small language model whose automatic tensor-parallel plan splits its MLP and leaves its
embedding, LayerNorm and head whole.

On CPU torch's default is the for-loop, so without these the suite never runs what a CUDA run
runs: a tp step once crashed there with "got mixed torch.Tensor and DTensor"."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Config, Session
from tests.helpers.training import train

# name -> (the optimizer constructor's flags, compute.optimizer_impl, the (foreach, fused) of the
# optimizer phalanx returns). On CPU auto picks fused (torch has fused Adam and AdamW for the CPU).
VARIANTS = {
    "foreach=True": ({"foreach": True}, None, (True, None)),
    "fused=True": ({"fused": True}, None, (None, True)),
    "optimizer_impl=auto": ({}, "auto", (False, True)),
    "optimizer_impl=foreach": ({}, "foreach", (True, False)),
    "optimizer_impl=fused": ({}, "fused", (False, True)),
    "optimizer_impl=loop": ({}, "loop", (False, False)),
}
GLOBAL_BATCH, STEPS = 16, 5


def data_parallel(strategy, variant: str) -> dict:
    """Adam on the default MLP through ``strategy`` under ``variant``: the final weights and the
    (foreach, fused) the optimizer ran with."""
    flags, impl, _ = VARIANTS[variant]
    compute = {"optimizer_impl": impl} if impl else {}
    result = train(strategy, GLOBAL_BATCH, None, STEPS, optimizer="adam", optimizer_flags=flags, compute=compute)
    return {"state": result["state"], "runs": (result["optimizer"]["foreach"], result["optimizer"]["fused"])}


# -- a language model with a LayerNorm the tensor-parallel plan leaves whole ----------------------

VOCAB, DIM, SEQ, LM_BATCH, LM_STEPS = 64, 32, 16, 8, 4


class NormLM(nn.Module):
    """Embedding, LayerNorm, a residual MLP block (the automatic plan splits its pair of Linear
    layers) and a head: every tensor-parallel peer holds the embedding, norm and head whole."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        return self.head(x + self.mlp(self.norm(x)))


def lm_tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (LM_BATCH * LM_STEPS, SEQ + 1), generator=torch.Generator().manual_seed(1))


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def adamw(params, **flags) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, **flags)


def lm_reference() -> dict[str, torch.Tensor]:
    """One process, a plain loop, AdamW's for-loop implementation."""
    model = NormLM()
    opt = adamw(model.parameters(), foreach=False)
    for batch in lm_tokens().split(LM_BATCH):
        lm_loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def lm_train(strategy: str, tp: int, variant: str) -> dict:
    """NormLM and AdamW through a Session under ``strategy`` with ``strategy.tp.size`` ``tp``."""
    flags, impl, _ = VARIANTS[variant]
    session = Session(
        Config(),
        strategy={"name": strategy, "tp": {"size": tp}},
        batch={"global_batch_size": LM_BATCH},
        train={"progress": False, "seed": 0, "metrics": False},
        checkpoint={"dir": "checkpoints", "resume": "never"},
        compute={"optimizer_impl": impl} if impl else {},
    )
    model = NormLM()
    model, opt = session.setup(model, adamw(model.parameters(), **flags))
    loader = session.setup_loader(DataLoader(TensorDataset(lm_tokens()), batch_size=LM_BATCH), train=True)
    for _ in session.epochs():
        for (batch,) in loader:
            with session.accumulate(model):
                session.backward(lm_loss(model, batch))
    whole = sorted(n for n, p in session.unwrap(model).named_parameters() if not hasattr(p, "placements"))
    out = {
        "state": {k: v.detach().cpu() for k, v in session.model_state_dict().items()},
        "runs": (opt.defaults.get("foreach"), opt.defaults.get("fused")),
        "steps": session.step_count,
        "whole": whole,
    }
    session.close()
    return out
