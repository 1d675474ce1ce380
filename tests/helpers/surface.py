"""A model with the surface a real script uses (a method, attributes, named submodules), and a probe
of what the model setup() returns shows of it, under any strategy (runs inside phalanx.spawn too)."""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from phalanx import Config, PhalanxError, Session
from tests.helpers.models import make_data


class Tagger(nn.Sequential):
    """An nn.Sequential (so pipeline can split it) with named children and methods of its own."""

    def __init__(self):
        torch.manual_seed(0)
        layers = [("encoder", nn.Linear(8, 32)), ("act", nn.Tanh()), ("body", nn.Linear(32, 32))]
        layers += [("act2", nn.Tanh()), ("head", nn.Linear(32, 2))]
        super().__init__(OrderedDict(layers))
        self.hidden_size = 32

    def init_hidden(self, bsz: int) -> torch.Tensor:
        return torch.zeros(bsz, self.hidden_size, device=self.encoder.weight.device)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).argmax(1)  # runs the layers itself, outside any wrapper


def reference_steps(global_bs: int, steps: int) -> dict[str, torch.Tensor]:
    net = Tagger()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for x, y in DataLoader(make_data(global_bs * steps), batch_size=global_bs):
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
    return net.state_dict()


def probe(strategy, global_bs: int = 16, steps: int = 2, compiled_by_user: bool = False, **sections) -> dict:
    session = Session(
        Config(),
        strategy=strategy,
        batch={"global_batch_size": global_bs},
        train={"progress": False, "seed": 0, "epochs": 1},
        checkpoint={"resume": "never"},
        **sections,
    )
    bare = Tagger()
    given = torch.compile(bare) if compiled_by_user else bare
    optimizer = torch.optim.SGD(given.parameters(), lr=0.05)
    model, optimizer = session.setup(given, optimizer)
    out: dict = {"type": type(model).__name__, "world": session.world_size, "rank": session.rank}
    hidden = model.init_hidden(3)
    out["hidden"] = (tuple(hidden.shape), str(hidden.device) == str(session.device))
    out["hidden_size"] = model.hidden_size
    out["encoder_is_users"] = model.encoder is bare.encoder
    model.temperature = 2.0  # a new attribute lands on the user's module
    model.hidden_size = 16  # and an existing one is set there
    out["set_on_user"] = (getattr(bare, "temperature", None), bare.hidden_size, model.init_hidden(1).shape[1])
    model.hidden_size = 32
    out["isinstance"] = {"module": isinstance(model, nn.Module), "user_class": isinstance(model, Tagger)}
    out["unwrap_is_user"] = session.unwrap(model) is bare
    out["state_keys"] = list(model.state_dict())
    out["user_keys"] = list(Tagger().state_dict())
    halved = {k: v / 2 for k, v in Tagger().state_dict().items()}
    model.load_state_dict(halved)  # the user's keys load, plain tensors also under fsdp
    loaded = session.model_state_dict()  # (rank 0 only under fsdp and pipeline)
    out["loaded"] = all(torch.equal(loaded[k].cpu(), halved[k]) for k in halved) if loaded else None
    model.load_state_dict(Tagger().state_dict())  # back to the initial weights
    x = torch.randn(4, 8, device=session.device)
    model.eval()
    with torch.no_grad():
        try:
            out["predict_no_grad"] = tuple(model.predict(x).shape)
        except PhalanxError as err:
            out["predict_no_grad"] = str(err)
    model.train()
    try:
        out["predict_training"] = tuple(model.predict(x).shape)
    except PhalanxError as err:
        out["predict_training"] = str(err)
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))  # on the wrapper: model(x) goes through it
    loader = session.setup_loader(DataLoader(make_data(global_bs * steps), batch_size=global_bs), train=True)
    for _ in session.epochs():
        for xb, yb in loader:
            with session.accumulate(model):
                session.backward(F.mse_loss(model(xb), yb))
    out["wrapper_calls"] = len(calls)
    out["steps"] = session.step_count
    out["state"] = {k: v.detach().cpu() for k, v in session.model_state_dict().items()}
    out["own_state"] = {k: v.detach().cpu() for k, v in model.state_dict().items() if not _sharded(v)}
    session.close()
    return out


def _sharded(value: torch.Tensor) -> bool:
    return hasattr(value, "full_tensor")  # an fsdp DTensor: its values are this rank's shard
