"""Activation checkpointing (runtime/recompute.py) on a module that is copied: each copy runs its own
forward on its own weights. ``nn.DataParallel`` replicates the model onto every GPU each step by
copying each module's ``__dict__`` and replacing its parameters (torch.nn.parallel.replicate, which
needs GPUs; emulated here), so a forward bound to the original module ran the first GPU's weights
on every GPU's inputs."""

from __future__ import annotations

import copy
import inspect
import pickle

import torch
from torch import nn

from phalanx.runtime import recompute
from phalanx.runtime.recompute import apply_activation_checkpointing


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))
        self.calls = 0

    def forward(self, x: torch.Tensor, shift: float = 0.0) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(x * self.weight) + shift


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x, shift=1.0))


def _replica(module: nn.Module, scale: float) -> nn.Module:
    """What torch.nn.parallel.replicate makes of ``module`` for another GPU: a new object of its
    class holding a copy of its ``__dict__``, submodules replicated, parameters replaced by copies
    set as plain attributes (here scaled, to tell them apart)."""
    replica = module.__new__(type(module))
    replica.__dict__ = module.__dict__.copy()
    replica._parameters = {}
    replica._buffers = replica._buffers.copy()
    replica._modules = {name: _replica(child, scale) for name, child in module._modules.items()}
    for name, param in module._parameters.items():
        setattr(replica, name, (param.detach() * scale).requires_grad_())
    return replica


def test_a_replica_runs_its_own_forward_on_its_own_weights():
    model = Net()
    assert apply_activation_checkpointing(model, ["Block"]) == 1
    replica = _replica(model, 3.0)
    x = torch.randn(4, 3)
    out = replica(x)
    expected = replica.head(torch.tanh(x * replica.block.weight) + 1.0)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert replica.block.weight.grad is not None
    assert model.block.weight.grad is None  # the original's weights took no part


def test_the_block_is_recomputed_in_backward():
    model = Net()
    apply_activation_checkpointing(model, ["Block"])
    model(torch.randn(4, 3, requires_grad=True)).sum().backward()
    assert model.block.calls == 2  # its forward, and again in backward
    assert model.block.weight.grad is not None


def test_names_keys_and_signature_stay_the_users():
    model, plain = Net(), Net()
    apply_activation_checkpointing(model, ["Block"])
    assert type(model.block).__name__ == "Block" and isinstance(model.block, Block)
    assert list(model.state_dict()) == list(plain.state_dict())
    assert list(inspect.signature(model.block.forward).parameters) == ["x", "shift"]
    assert apply_activation_checkpointing(model, ["Block"]) == 1  # a second setup() of the same model
    assert type(model.block).__mro__.count(recompute.Recomputed) == 1


def test_pickled_as_written_and_copied_with_checkpointing():
    model = Net()
    apply_activation_checkpointing(model, ["Block"])
    loaded = pickle.loads(pickle.dumps(model))
    assert type(loaded.block) is Block  # loads without phalanx; the run applies checkpointing at setup
    clone = copy.deepcopy(model)
    assert isinstance(clone.block, recompute.Recomputed) and clone.block.weight is not model.block.weight
    clone.block.calls = 0
    clone(torch.randn(2, 3)).sum().backward()
    assert clone.block.calls == 2


def test_a_forward_set_on_the_instance_is_still_checkpointed():
    model = Net()
    model.block.forward = model.block.forward  # as a library's hook would, bound to the instance
    apply_activation_checkpointing(model, ["Block"])
    model(torch.randn(2, 3)).sum().backward()
    assert model.block.calls == 2
