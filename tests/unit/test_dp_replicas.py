"""Strategy ``dp`` on 2+ GPUs, on a CPU: its replicas compute in the configured autocast dtype.

torch's parallel_apply runs each replica in a thread of its own, where autocast's dtype defaults to
float16 (pytorch/pytorch#125186). The CUDA calls of DataParallel's construction and of
parallel_apply are faked so that its thread path runs on the CPU; replicate and scatter, which
need GPUs, are left out: the replicas are handed to parallel_apply directly."""

from __future__ import annotations

import contextlib
import importlib
import pickle
import threading
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from phalanx.config.schema import Config
from phalanx.runtime.precision import Precision
from phalanx.strategies import create_strategy
from phalanx.topology import Topology


class _Probe(nn.Module):
    """Records, per call, the thread and the autocast state its forward saw."""

    def __init__(self, seen: list) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.seen = seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cuda = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        self.seen.append((threading.current_thread().name, cuda))
        return self.linear(x)


@pytest.fixture
def two_gpus(monkeypatch):
    props = SimpleNamespace(total_memory=80 << 30, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    module = importlib.import_module("torch.nn.parallel.data_parallel")  # the package's name is its function
    monkeypatch.setattr(module, "_get_devices_properties", lambda ids: [props for _ in ids])
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(torch.accelerator, "device_index", lambda *a, **k: contextlib.nullcontext())


def _wrapped(mode: str, seen: list) -> tuple[nn.Module, Precision]:
    config = Config(strategy={"name": "dp"}, precision={"mode": mode})
    device = torch.device("cuda", 0)
    strategy = create_strategy(config, Topology(device=device))
    return strategy.wrap_model(_Probe(seen)), Precision(config.precision, device)


@pytest.mark.parametrize("mode, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_each_replica_computes_in_the_configured_dtype(two_gpus, mode, dtype):
    seen: list = []
    wrapped, precision = _wrapped(mode, seen)
    assert wrapped.device_ids == [0, 1]  # the multi-GPU path, not the CPU's plain call
    replicas = [wrapped.module, wrapped.module]
    x = torch.randn(3, 2)
    with precision.autocast():  # as the Session's forward wrapper around the wrapped model's forward
        outputs = wrapped.parallel_apply(replicas, [(x,), (x,)], [{}, {}])
    assert len(outputs) == 2
    threads = {name for name, _ in seen}
    assert len(seen) == 2 and threading.main_thread().name not in threads  # each replica in its own thread
    assert [state for _, state in seen] == [(True, dtype)] * 2, seen


def test_fp32_replicas_run_without_autocast(two_gpus):
    seen: list = []
    wrapped, precision = _wrapped("fp32", seen)
    x = torch.randn(3, 2)
    with precision.autocast():
        wrapped.parallel_apply([wrapped.module, wrapped.module], [(x,), (x,)], [{}, {}])
    assert [enabled for _, (enabled, _) in seen] == [False, False]


def test_the_wrapper_keeps_torchs_name_keys_and_pickles():
    wrapped, _ = _wrapped("bf16", [])
    plain = nn.DataParallel(_Probe([]))
    assert type(wrapped).__name__ == "DataParallel" and isinstance(wrapped, nn.DataParallel)
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    assert type(pickle.loads(pickle.dumps(wrapped))) is type(wrapped)
