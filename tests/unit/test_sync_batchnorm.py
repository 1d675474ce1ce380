"""strategies/sync_batchnorm.py in one process: phalanx's synced BatchNorm computes what torch's
BatchNorm computes (outputs, gradients, running statistics; the all-reduce over one process is the
identity), a converted model set up under ddp on the CPU trains where DistributedDataParallel
refuses torch's layer, keeps its state-dict keys and stays copyable, and the setup() line says what
an unsynced model costs, in each wording."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from phalanx import Config, Session
from phalanx.config.batch import BatchPlan
from phalanx.strategies.sync_batchnorm import BatchNorms, SyncBatchNorm, _Sync, _SyncedBatchNorm, unsynced_line
from tests.helpers.batchnorm import BatchNormNet


class _Alone(_Sync):
    """One process: the all-reduce is the identity (no process group needed)."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()


@pytest.fixture
def one_process_group():
    return _Alone(None, 1, torch.device("cpu"))


@pytest.mark.parametrize("shape", [(16, 5), (6, 4, 3, 3), (5, 3, 7)])
@pytest.mark.parametrize("affine", [True, False])
def test_the_synced_function_is_batch_norm(one_process_group, shape, affine):
    torch.manual_seed(0)
    x = (torch.randn(*shape) * 3 + 2).requires_grad_()
    channels = shape[1]
    w = torch.randn(channels).requires_grad_() if affine else None
    b = torch.randn(channels).requires_grad_() if affine else None
    ours = (torch.zeros(channels), torch.ones(channels))
    torchs = (torch.zeros(channels), torch.ones(channels))
    y = _SyncedBatchNorm.apply(x, w, b, *ours, 1e-5, 0.1, one_process_group)
    want = F.batch_norm(x, *torchs, w, b, True, 0.1, 1e-5)
    grad = torch.randn_like(y)
    inputs = (x, w, b) if affine else (x,)
    for got, expected in zip(torch.autograd.grad(y, inputs, grad), torch.autograd.grad(want, inputs, grad)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    for got, expected in zip(ours, torchs):  # running mean, and the unbiased running variance
        torch.testing.assert_close(got, expected)


def test_the_synced_function_passes_gradcheck(one_process_group):
    x = torch.randn(6, 3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, w, b: _SyncedBatchNorm.apply(x, w, b, None, None, 1e-5, 0.1, one_process_group), (x, w, b)
    )


def _converted_under(strategy: str) -> tuple[Session, nn.Module, nn.Module]:
    session = Session(Config(), strategy=strategy, train={"progress": False})
    net = nn.SyncBatchNorm.convert_sync_batchnorm(BatchNormNet())
    return session, session.setup(net), net


def test_a_converted_model_trains_under_ddp_on_the_cpu_with_its_own_keys():
    session, model, bare = _converted_under("ddp")  # DistributedDataParallel refuses torch's layer on the CPU
    try:
        assert type(bare.bn2d) is type(bare.bn1d) is SyncBatchNorm
        assert list(session.model_state_dict()) == list(BatchNormNet().state_dict())
        model(torch.randn(4, 3, 8, 8)).sum().backward()
        assert bare.bn2d.num_batches_tracked.item() == 1 and bare.bn2d.weight.grad is not None
        # A copy of the model (an EMA, a torch.save of the bare model) holds no process group.
        twin = copy.deepcopy(bare)
        buffer = io.BytesIO()
        torch.save(bare, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        x = torch.randn(4, 3, 8, 8)
        for other in (twin, loaded):
            torch.testing.assert_close(other.eval()(x), bare.eval()(x))
    finally:
        session.close()


def test_eval_mode_uses_the_running_statistics(one_process_group):
    layer = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(3)))[0]
    layer.__class__ = SyncBatchNorm
    layer.running_mean.fill_(1.0)
    layer.eval()
    x = torch.randn(4, 3)
    torch.testing.assert_close(layer(x), F.batch_norm(x, layer.running_mean, layer.running_var, eps=layer.eps))


def test_no_line_for_one_process_or_a_converted_model(capsys):
    for strategy, sync in (("single", False), ("ddp", False), ("ddp", True)):
        session = Session(Config(), strategy=strategy, train={"progress": False})
        net = BatchNormNet()
        session.setup(nn.SyncBatchNorm.convert_sync_batchnorm(net) if sync else net)
        session.close()
    assert "BatchNorm" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "plan, words",
    [
        (BatchPlan(64, 16, 1, 4), "normalise over each process's 16 samples, not the global batch of 64: 4 processes"),
        (BatchPlan(64, 8, 2, 4), "normalise over each process's 8 samples, not the 32 of a micro-step over all 4"),
        (None, "normalise over each process's micro-batch, not the samples of all 4 processes together: 4 processes"),
    ],
)
def test_the_line_names_the_sizes_it_knows(plan, words):
    line = unsynced_line(3, plan, 4)
    assert line.startswith(f"phalanx: 3 BatchNorm layers {words}") and "\n" not in line
    assert line.endswith("convert them with torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) before setup()")
    assert unsynced_line(1, plan, 4).startswith("phalanx: 1 BatchNorm layer normalises over")


def _bare_batch_norms(device: str, data_parallel_size: int):
    group = object()  # stands for the data-parallel process group
    return BatchNorms(torch.device(device), data_parallel_size, lambda: group, torch.device("cpu")), group


@pytest.mark.parametrize(
    "device, processes, kind",
    [("cuda", 2, "torch's kernels"), ("cuda", 1, "phalanx's"), ("cpu", 2, "phalanx's"), ("cpu", 1, "phalanx's")],
)
def test_which_layer_each_device_and_process_count_gets(device, processes, kind):
    norms, group = _bare_batch_norms(device, processes)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(BatchNormNet(), process_group=None)
    keys = list(net.state_dict())
    norms.prepare(net)  # nothing runs: the swap alone, which needs no device
    layer = net.bn2d
    if kind == "torch's kernels":
        assert isinstance(layer, nn.SyncBatchNorm) and layer.process_group is group
    else:
        assert type(layer) is SyncBatchNorm and not isinstance(layer, nn.SyncBatchNorm)
    assert list(net.state_dict()) == keys and "process_group" not in vars(layer)
    copy.deepcopy(net)  # the group is held by key, not by the layer


def test_only_batch_norm_that_normalises_per_process_is_counted():
    norms, _ = _bare_batch_norms("cpu", 2)
    said: list[str] = []
    frozen = BatchNormNet()
    frozen.bn1d.eval()  # a frozen layer normalises with its running statistics
    norms.prepare(frozen)
    norms.prepare(nn.Sequential(nn.Linear(2, 2)))
    norms.say(BatchPlan(32, 8, 2, 2), said.append)
    norms.say(BatchPlan(32, 8, 2, 2), said.append)  # once per model
    assert said == [unsynced_line(1, BatchPlan(32, 8, 2, 2), 2)]
    alone, _ = _bare_batch_norms("cpu", 1)
    alone.prepare(BatchNormNet())
    alone.say(None, said.append)
    assert len(said) == 1
