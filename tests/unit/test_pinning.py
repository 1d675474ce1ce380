"""data.pin_memory: pinned only when the batches come out of the loader on the CPU. Tensors on
torch's "meta" device stand in for batches already on a GPU, and a CUDA device is only named (the
decision never touches it), so this runs on any machine; tests/gpu/test_pinning.py runs it for real."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from phalanx.errors import ConfigError
from phalanx.runtime.pinning import choose_pin, devices_of, first_batch
from tests.helpers.loaders import numbered, sharded

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


def on_host():
    return {"x": [torch.zeros(2)], "y": (torch.ones(2), "label")}


def on_device():
    return {"x": [torch.zeros(2, device="meta")], "y": (torch.ones(2), "label")}


def never():
    raise AssertionError("the batch was looked at although the decision did not need it")


def test_null_pins_only_batches_on_the_cpu():
    assert choose_pin(None, CUDA, on_host) is True
    assert choose_pin(None, CUDA, on_device) is False
    assert choose_pin(None, CUDA, None) is True  # workers build the batches: taken to be on the CPU
    assert choose_pin(None, CPU, never) is False  # nothing to copy to


def test_false_and_cpu_devices_never_look_at_a_batch():
    assert choose_pin(False, CUDA, never) is False
    assert choose_pin(True, CPU, never) is True  # the user's own choice, ignored by torch without a GPU


def test_true_with_batches_already_on_a_device_is_refused_in_one_line():
    assert choose_pin(True, CUDA, on_host) is True
    with pytest.raises(ConfigError, match=r"data.pin_memory is true, but .* tensors on meta") as refused:
        choose_pin(True, CUDA, on_device)
    assert "\n" not in str(refused.value)


def test_devices_of_a_nested_batch():
    assert devices_of(on_device()) == {"cpu", "meta"}
    assert devices_of(["no tensors"]) == set()


class Drawing(Dataset):
    """A dataset whose samples draw from every random generator, as augmentations do."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        return torch.rand(3) + random.random() + float(np.random.rand())


def test_first_batch_leaves_the_random_generators_where_they_were():
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    expected = (torch.rand(1), random.random(), np.random.rand())
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    batch = first_batch(Drawing(), torch.utils.data.default_collate, CPU)
    assert batch.shape == (1, 3)
    assert (torch.rand(1), random.random(), np.random.rand()) == expected


def test_first_batch_uses_getitems_as_torchs_fetcher_does():
    class Batched(TensorDataset):
        def __getitems__(self, indices):
            return [(torch.tensor(-1),) for _ in indices]

    assert first_batch(Batched(torch.arange(4)), list, CPU) == [(torch.tensor(-1),)]


def test_the_rebuilt_loader_pins_host_batches_and_not_device_ones(monkeypatch):
    # On a machine without CUDA, the CUDA generator's state is stood in for by the CPU one's.
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: torch.get_rng_state())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device=None: None)
    host = sharded(device=CUDA, prefetch_to_device=False)
    assert host.loader.pin_memory and host.non_blocking

    resident = TensorDataset(torch.zeros(40, device="meta"), torch.zeros(40, device="meta"))
    device = sharded(resident, device=CUDA, prefetch_to_device=False)
    assert not device.loader.pin_memory and not device.non_blocking
    with pytest.raises(ConfigError, match="data.pin_memory is true"):
        sharded(resident, device=CUDA, prefetch_to_device=False, pin_memory=True)
    workers = sharded(resident, workers=2, device=CUDA, prefetch_to_device=False)
    assert workers.loader.pin_memory  # batches from workers are not looked at
    assert sharded(numbered(), device=CPU).loader.pin_memory is False
