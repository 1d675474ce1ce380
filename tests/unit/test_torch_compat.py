"""phalanx/_torch_compat.py: each private torch name it relies on is still where it was checked,
and each fallback gives what the private name gives (no process group: DDP is faked where needed)."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from phalanx import _torch_compat as compat
from phalanx.errors import PhalanxError
from phalanx.faults.lifeline import descendants
from tests.helpers.processes import living


class _Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2))  # a root parameter: DDP spells it ".weight"
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)
        self.b.weight = self.a.weight  # shared: waited for once
        self.frozen = nn.Linear(2, 2).requires_grad_(False)


DDP_METHODS = (
    "_remove_autograd_hooks",
    "_build_params_for_reducer",
    "_ddp_init_helper",
    "_build_debug_param_to_name_mapping",
)


def _fake_ddp(**attributes) -> SimpleNamespace:
    """An object with DDP's methods bound to it and the given attributes (DDP itself needs a process group)."""
    fake = SimpleNamespace(**attributes)
    for name in DDP_METHODS:
        setattr(fake, name, getattr(DistributedDataParallel, name).__get__(fake))
    return fake


@pytest.mark.parametrize("ignore", [set(), {".weight", "a.bias"}])
def test_reducer_parameters_fallback_follows_torchs_rule(ignore):
    module = _Shared()
    fake = _fake_ddp(module=module, parameters_to_ignore=ignore, _assign_modules_buffers=lambda: None)
    torchs = compat.ddp_reducer_parameters(fake)
    without = SimpleNamespace(module=module, parameters_to_ignore=ignore)  # no private method: the fallback
    ours = compat.ddp_reducer_parameters(without)
    assert [id(p) for p in ours] == [id(p) for p in torchs]
    assert len(ours) == 4 - len(ignore)  # .weight, a.weight (= b.weight), a.bias, b.bias; frozen is left out


def test_the_ddp_names_the_switch_needs_are_there():
    # What an instance has after DistributedDataParallel.__init__ (which needs a process group).
    assert compat.ddp_can_rebuild_reducer(_fake_ddp(_has_rebuilt_buckets=False, _comm_hooks=[]))
    init = inspect.getsource(DistributedDataParallel.__init__)
    assert "self._comm_hooks" in init and "self._has_rebuilt_buckets" in init
    assert callable(DistributedDataParallel._post_forward)
    assert "self._post_forward(output)" in inspect.getsource(DistributedDataParallel.forward)
    assert "self.reducer.prepare_for_backward(" in inspect.getsource(DistributedDataParallel._post_forward)


def test_without_the_ddp_names_auto_cannot_switch():
    bare = SimpleNamespace(reducer=SimpleNamespace())
    assert not compat.ddp_can_rebuild_reducer(bare)
    with pytest.raises(PhalanxError, match="cannot rebuild DDP's reducer; set strategy.ddp.find_unused_parameters"):
        compat.ddp_rebuild_reducer(bare, find_unused_parameters=False)
    assert compat.ddp_reducer_finalized(bare) is None  # cannot tell: DDP's own error comes a step later
    assert not compat.ddp_intercept_post_forward(bare, lambda output: output)
    assert "_post_forward" not in vars(bare)


def test_reducer_finalized():
    def unfinished():
        raise RuntimeError("Expected to have finished reduction in the prior iteration")

    def ddp(check):
        return SimpleNamespace(reducer=SimpleNamespace(_check_reducer_finalized=check))

    assert compat.ddp_reducer_finalized(ddp(lambda: None)) is True
    assert compat.ddp_reducer_finalized(ddp(unfinished)) is False


def test_compiled_original(monkeypatch):
    plain = nn.Linear(2, 2)
    assert compat.compiled_original(plain) is None
    compiled = torch.compile(plain)  # wraps only; nothing compiles before a call
    assert compat.compiled_original(compiled) is plain
    # Fallback when the wrapper class moved: any module holding an _orig_mod module.
    monkeypatch.delitem(sys.modules, "torch._dynamo.eval_frame")
    assert compat.compiled_original(compiled) is plain
    assert compat.compiled_original(plain) is None


@pytest.mark.parametrize("lookup, private", [
    (compat.foreach_kernel_devices, "_get_foreach_kernels_supported_devices"),
    (compat.fused_kernel_devices, "_get_fused_kernels_supported_devices"),
])  # fmt: skip
def test_kernel_devices_and_their_fallback(monkeypatch, lookup, private):
    module = importlib.import_module("torch.optim.optimizer")
    checked = lookup()
    assert checked == getattr(module, private)() and "cuda" in checked
    monkeypatch.delattr(module, private)
    assert set(lookup()) <= set(checked) and "cuda" in lookup()


def test_custom_num_samples():
    data = list(range(10))
    assert not compat.sampler_has_custom_num_samples(RandomSampler(data))
    assert compat.sampler_has_custom_num_samples(RandomSampler(data, num_samples=4))
    # A torch that keeps the argument elsewhere: the public property decides.
    assert not compat.sampler_has_custom_num_samples(SimpleNamespace(num_samples=10, data_source=data))
    assert compat.sampler_has_custom_num_samples(SimpleNamespace(num_samples=4, data_source=data))


# Leaf paths of one nested state dict, as a flattened checkpoint's mappings hold them.
PATHS = [("x",), ("a", "b", "c"), ("a", "d"), ("l", 2), ("l", 0, "k"), ("m", 1, 3), ("m", 0, "z"), ("n", "k", 0)]


def test_set_element_fallback_builds_what_torchs_does(monkeypatch):
    from torch.distributed.checkpoint._traverse import set_element

    torchs: dict = {}
    for i, path in enumerate(PATHS):
        set_element(torchs, path, i)
    monkeypatch.setitem(sys.modules, "torch.distributed.checkpoint._traverse", None)  # the import fails
    ours: dict = {}
    for i, path in enumerate(PATHS):
        compat.dcp_set_element(ours, path, i)
    assert ours == torchs and ours["m"][1] == [None, None, None, 5]


def test_metadata_globals_exist():
    for module, name in compat.DCP_METADATA_PRIVATE_GLOBALS:
        assert hasattr(importlib.import_module(module), name), f"{module}.{name}"


def test_view_base():
    base = torch.zeros(4)
    assert compat.view_base(base[1:]) is base
    assert compat.view_base(base) is None


class _Sub(torch.Tensor):
    pass


@pytest.mark.parametrize("fallback", [False, True])
def test_make_subclass(monkeypatch, fallback):
    if fallback:
        monkeypatch.setattr(torch.Tensor, "_make_subclass", None, raising=False)  # hides the inherited one
    out = compat.make_subclass(_Sub, torch.empty(0, device="meta"))
    assert type(out) is _Sub and out.device.type == "meta" and not out.requires_grad


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="counts worker processes in /proc")
def test_persistent_workers_end_at_once_and_the_next_pass_starts_new_ones():
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2, num_workers=1, persistent_workers=True)
    assert not compat.shutdown_persistent_workers(loader)  # no pass yet: nothing running
    before = set(descendants(os.getpid()))  # what other tests of this process left running
    first = [batch for (batch,) in loader]
    workers = set(descendants(os.getpid())) - before
    assert workers and compat.shutdown_persistent_workers(loader)
    assert not [pid for pid in workers if living(pid)]
    assert torch.equal(torch.cat([batch for (batch,) in loader]), torch.cat(first))


def test_scale_tensors_and_its_fallback(monkeypatch):
    tensors = [torch.ones(3), torch.full((2, 2), 2.0)]
    compat.scale_tensors(tensors, torch.tensor(0.5))
    assert torch.equal(tensors[0], torch.full((3,), 0.5)) and torch.equal(tensors[1], torch.ones(2, 2))
    monkeypatch.delattr(torch, "_foreach_mul_")
    compat.scale_tensors(tensors, torch.tensor(4.0))
    assert torch.equal(tensors[0], torch.full((3,), 2.0)) and torch.equal(tensors[1], torch.full((2, 2), 4.0))
