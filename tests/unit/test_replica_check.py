"""faults.replica_check_every without processes: the fingerprint changes with any change to a
replica's copy, the comparison names the first tensor that differs and who holds which copy, the
check gathers and refuses alike on every rank (the all_gather faked), and which ranks each
strategy compares."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from phalanx import Config
from phalanx.errors import PhalanxError
from phalanx.faults import replicas
from phalanx.faults.replicas import ReplicaCheck, drift, fingerprint
from phalanx.strategies.registry import STRATEGIES
from phalanx.topology import Topology


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


class _Wrapper(nn.Module):
    """What a strategy's wrap leaves (DDP's ``module.`` in front of every name)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module


# -- the fingerprint ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_one_ulp_in_one_element_changes_the_fingerprint(dtype):
    t = torch.randn(64, 33, generator=torch.Generator().manual_seed(0)).to(dtype)
    same = fingerprint([t, t.clone()])
    assert torch.equal(same[[0, 2]], same[[1, 3]])  # equal copies, equal numbers
    other = t.clone()
    other.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])[17, 5] += 1  # the next value
    assert not torch.equal(other, t)
    assert not torch.equal(fingerprint([t]), fingerprint([other]))


def test_a_shift_whose_bit_changes_cancel_is_caught_by_the_sum_of_values():
    # +2^-23 is one ulp up for 1.5's bits and one down for -1.5's: the bit sums are equal.
    t = torch.tensor([1.5, -1.5])
    shifted = t + 2.0**-23
    a, b = fingerprint([t]), fingerprint([shifted])
    assert a[0] == b[0] and a[1] != b[1]


def test_the_fingerprint_reads_slices_in_place_and_complex_tensors():
    t = torch.randn(8, 8)
    strided, contiguous = fingerprint([t.t()]), fingerprint([t.t().contiguous()])
    assert strided[0] == contiguous[0]  # an integer sum: the order the kernel reads in cannot change it
    assert torch.equal(strided, fingerprint([t.t()]))
    z = torch.randn(3, dtype=torch.complex64)
    changed = z.clone()
    changed[1] += 1e-3
    assert not torch.equal(fingerprint([z]), fingerprint([changed]))


# -- the comparison -----------------------------------------------------------------------------


def _rows(*copies: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([fingerprint(c) for c in copies])


def test_equal_copies_say_nothing():
    w, b = torch.randn(3, 3), torch.randn(3)
    assert drift(_rows([w, b], [w.clone(), b.clone()]), ["fc.weight", "fc.bias"], [0, 1], 4, None) is None


def test_the_line_names_the_step_the_first_tensor_that_differs_and_the_ranks():
    w, b = torch.ones(3, 3), torch.ones(3)
    line = drift(_rows([w, b], [w, b + 1e-6]), ["fc.weight", "fc.bias"], [0, 1], 12, 10)
    assert line.startswith(
        "replicas drifted apart at step 12 (they were equal at step 10): fc.bias differs between ranks 0 and 1 "
        "(sum of its values: 3 on rank 0, 3.00000286102 on rank 1); the update depends on the rank"
    )
    assert "phalanx verify" in line and line.endswith("(docs/faults.md#replicas-that-drift-apart)")
    assert "\n" not in line
    several = drift(_rows([w, b], [w + 1, b + 1]), ["fc.weight", "fc.bias"], [0, 1], 12, None)
    assert "step 12: fc.weight differs" in several and "; 2 of 2 tensors differ)" in several


def test_with_more_ranks_the_copies_are_grouped_by_holder():
    w = torch.ones(4)
    rows = _rows([w], [w], [w + 1], [w])
    assert "differs between ranks 0, 1, 3 and rank 2 " in drift(rows, ["w"], [0, 1, 2, 3], 5, None)
    # Global ranks of a group that is not the world's (tp's replicas: every second rank).
    assert "differs between ranks 1 and 3 " in drift(_rows([w], [w + 1]), ["w"], [1, 3], 5, None)
    three = drift(_rows([w], [w + 1], [w + 2]), ["w"], [0, 1, 2], 5, None)
    assert "differs between ranks 0, 1 and 2 " in three


def test_between_devices_of_different_models_the_float_sums_are_left_out():
    # +2^-23 on 1.5 and -1.5: the integer sums are equal, only the sum of values tells them apart,
    # and a GPU of another model may round that sum's last bit otherwise.
    t = torch.tensor([1.5, -1.5])
    rows = _rows([t], [t + 2.0**-23])
    assert drift(rows, ["w"], [0, 1], 3, None) is not None
    assert drift(rows, ["w"], [0, 1], 3, None, compare_values=False) is None
    assert drift(_rows([t], [t * 2]), ["w"], [0, 1], 3, None, compare_values=False) is not None
    assert replicas.device_kind(torch.device("cpu")) == replicas.device_kind(torch.device("cpu"))


# -- the check ----------------------------------------------------------------------------------


def _fake_gather(monkeypatch, changed_on_rank_1):
    """all_gather over two ranks: rank 0's copy is this one; rank 1's has ``changed_on_rank_1`` applied."""

    def gather(rows, mine, group=None):
        assert group == "group"
        rows[0].copy_(mine)
        rows[1].copy_(changed_on_rank_1(mine.clone()))

    monkeypatch.setattr(replicas.dist, "all_gather", gather)


def _check(models, optimizers, every=2) -> ReplicaCheck:
    return ReplicaCheck(every, "group", [0, 1], torch.device("cpu"), models, optimizers, lambda m: m.module)


def test_a_rank_whose_copy_differs_stops_every_rank_alike(monkeypatch):
    model = _Wrapper(_model())
    check = _check([model], [])
    _fake_gather(monkeypatch, lambda row: row)
    check.after_step(2)
    _fake_gather(monkeypatch, lambda row: row + (torch.arange(len(row)) == 1))  # the bits of the first bias
    check.after_step(3)  # not a step to compare at
    with pytest.raises(PhalanxError, match=r"at step 4 \(they were equal at step 2\): 0.bias differs between ranks 0"):
        check.after_step(4)


def test_what_is_compared_is_named_as_in_the_users_model_and_the_optimizer_state_follows():
    model = _Wrapper(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.module(torch.randn(2, 4)).sum().backward()
    opt.step()
    names, tensors = _check([model], [opt]).tensors()
    assert names[:4] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert "the optimizer's exp_avg of 0.weight" in names and "the optimizer's exp_avg_sq of 2.bias" in names
    assert len(names) == len(tensors) == 4 + 4 * 3  # step, exp_avg, exp_avg_sq per parameter
    assert _check([model], []).tensors()[0] == names[:4]  # optimizer state sharded (zero1): not compared
    two, _ = _check([model, _Wrapper(_model())], []).tensors()
    assert two[0] == "model 0: 0.weight" and two[4] == "model 1: 0.weight"


def test_nothing_to_compare_costs_nothing(monkeypatch):
    assert ReplicaCheck.create(100, None, torch.device("cpu"), [], [], lambda m: m) is None  # no replica
    monkeypatch.setattr(replicas.dist, "get_process_group_ranks", lambda group: [0, 1])
    assert ReplicaCheck.create(0, "group", torch.device("cpu"), [], [], lambda m: m) is None  # turned off
    assert ReplicaCheck.create(100, "group", torch.device("cpu"), [], [], lambda m: m).ranks == [0, 1]
    monkeypatch.setattr(replicas.dist, "get_process_group_ranks", lambda group: [3])
    assert ReplicaCheck.create(100, "group", torch.device("cpu"), [], [], lambda m: m) is None  # a group of one


def test_the_option_defaults_on_and_refuses_negative_counts():
    assert Config().faults.replica_check_every == 100
    assert Config(faults={"replica_check_every": 0}).faults.replica_check_every == 0
    with pytest.raises(ValidationError):
        Config(faults={"replica_check_every": -1})


# -- which ranks each strategy compares ---------------------------------------------------------


@pytest.mark.parametrize(
    "name, settings, world, compared, optimizer_state",
    [
        ("single", {}, 1, False, True),
        ("ddp", {}, 4, True, True),
        ("zero1", {}, 4, True, False),  # parameters replicated, optimizer state sharded
        ("fsdp", {}, 4, False, False),  # sharded over the data axis: no copies
        ("fsdp", {"tp": {"size": 2}}, 4, False, False),
        ("tp", {}, 4, False, False),  # every rank a tensor peer: slices, no copies
        ("tp", {"tp": {"size": 2}}, 4, True, True),  # 2 replicas of 2 peers
        ("pipeline", {}, 4, False, False),  # stages hold different layers
    ],
)
def test_each_strategy_compares_its_replicas(monkeypatch, name, settings, world, compared, optimizer_state):
    cls = STRATEGIES[name]
    monkeypatch.setattr(cls, "data_group", property(lambda self: "the data group"))
    strategy = cls(Config(strategy={"name": name, **settings}), Topology(world_size=world, local_world_size=world))
    assert strategy.replica_group() == ("the data group" if compared else None)
    if compared:
        assert strategy.replicates_optimizer_state is optimizer_state
