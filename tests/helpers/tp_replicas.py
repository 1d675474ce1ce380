"""Scripts that tp's data-parallel replicas must train like DDP does: experts that each rank's data
reaches differently (a parameter without a gradient on one rank), and weights a script changed on
one rank before setup() (a load of its own on rank 0)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Config, Session

N, BATCH = 16, 8
X = torch.randn(N, 4, generator=torch.Generator().manual_seed(1))
ROUTE = ((torch.arange(N) % BATCH) >= BATCH // 2).long()  # rank 0's half takes expert 0, rank 1's expert 1
Y = torch.randn(N, 1, generator=torch.Generator().manual_seed(2))


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 8)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        mixed = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            chosen = route == e
            if chosen.any():
                mixed[chosen] = expert(h[chosen])
        return self.out(mixed)


def _loss(model: nn.Module, x, route, y) -> torch.Tensor:
    return ((model(x, route) - y) ** 2).mean()


def reference() -> dict[str, torch.Tensor]:
    model = Experts()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(0, N, BATCH):
        _loss(model, X[i : i + BATCH], ROUTE[i : i + BATCH], Y[i : i + BATCH]).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(tp: int, changed_on_rank_1: bool = False) -> dict:
    """strategy tp with ``tp`` peers per replica on the spawned processes; its plan keeps every layer
    whole (what is tested is what replicas and peers share, not the split)."""
    session = Session(
        Config(),
        strategy={"name": "tp", "tp": {"size": tp, "plan": {"*": "replicate"}}},
        batch={"global_batch_size": BATCH},
        train={"progress": False, "seed": 0, "metrics": False},
        checkpoint={"resume": "never"},
    )
    model = Experts()
    if changed_on_rank_1 and session.rank == 1:  # rank 0's weights are the script's own
        with torch.no_grad():
            model.out.weight.mul_(2.0)
            model.experts[0].weight.mul_(2.0)
    model, opt = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = session.setup_loader(DataLoader(TensorDataset(X, ROUTE, Y), batch_size=BATCH), train=True)
    for _ in session.epochs():
        for x, route, y in loader:
            with session.accumulate(model):
                session.backward(_loss(model, x, route, y))
    # What this rank itself holds of the layers rank 1 changed (the whole weight: nothing is split).
    held = {"out": model.out.weight.detach().clone(), "expert": model.experts[0].weight.detach().clone()}
    out = {"state": {k: v.detach().cpu() for k, v in session.model_state_dict().items()}, "held": held}
    session.close()
    return out
