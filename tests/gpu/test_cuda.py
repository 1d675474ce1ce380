"""CUDA paths: skipped without a GPU; benchmarks/gpu_check.sh runs them on a GPU machine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from phalanx import Config, Session
from tests.helpers.models import make_data, make_model
from tests.helpers.training import reference

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _train(mode: str, steps: int = 30) -> tuple[list[float], Session]:
    session = Session(
        Config(), strategy="single", precision=mode, batch={"global_batch_size": 32}, train={"progress": False}
    )
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = DataLoader(make_data(32 * steps), batch_size=32, shuffle=True)
    model, optimizer, loader = session.setup(model, optimizer, loader)
    assert next(model.parameters()).device.type == "cuda"
    assert loader.loader.pin_memory and loader.non_blocking
    losses = []
    for x, y in loader:
        assert x.device.type == "cuda"
        with session.accumulate(model):
            out = model(x)
            assert out.dtype == torch.float32
            loss = F.mse_loss(out, y)
            session.backward(loss)
        losses.append(loss.item())
    return losses, session


def test_fp32_on_gpu_matches_cpu_reference():
    session = Session(Config(), strategy="single", batch={"global_batch_size": 16}, train={"progress": False})
    from tests.helpers.models import make_optim

    model = make_model()
    optimizer, scheduler = make_optim(model)
    loader = DataLoader(make_data(16 * 5), batch_size=16, shuffle=False)
    model, optimizer, scheduler = session.setup(model, optimizer, scheduler)
    loader = session.setup_loader(loader, train=True)
    for x, y in loader:
        with session.accumulate(model):
            session.backward(F.mse_loss(model(x), y))
    ref = reference(16, 5)
    state = {k: v.cpu() for k, v in session.model_state_dict().items()}
    for key in ref:
        torch.testing.assert_close(state[key], ref[key], rtol=1e-4, atol=1e-5)
    session.close()


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_mixed_precision_on_gpu_learns_like_fp32(mode):
    fp32, s32 = _train("fp32")
    mixed, session = _train(mode)
    assert (session.precision.scaler is not None) == (mode == "fp16")
    assert sum(mixed[-5:]) < 0.5 * sum(mixed[:5])
    assert abs(sum(mixed[-5:]) - sum(fp32[-5:])) < 0.25 * sum(fp32[-5:]) + 0.05
    s32.close()
    session.close()


@pytest.fixture(autouse=True)
def cuda_math_switches():
    """precision.tf32 and cudnn_benchmark set process-wide switches: put them back after every test, so
    a later comparison with a CPU reference does not run its matmuls in TF32."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = saved


def test_tf32_true_turns_tf32_on_and_false_leaves_it_as_it_is():
    # docs/precision.md: true sets both switches; false (the default) leaves both as they are.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    Session(Config(), strategy="single", train={"progress": False}).close()
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    session = Session(Config(), strategy="single", precision={"tf32": True}, train={"progress": False})
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    session.close()
    Session(Config(), strategy="single", train={"progress": False}).close()
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32  # false never turns it off


def test_cudnn_benchmark_true_turns_it_on_and_false_leaves_it_as_it_is():
    torch.backends.cudnn.benchmark = False
    Session(Config(), strategy="single", train={"progress": False}).close()
    assert not torch.backends.cudnn.benchmark
    Session(Config(), strategy="single", precision={"cudnn_benchmark": True}, train={"progress": False}).close()
    assert torch.backends.cudnn.benchmark
    Session(Config(), strategy="single", train={"progress": False}).close()
    assert torch.backends.cudnn.benchmark


def test_model_parallel_on_the_visible_gpus_matches_cpu_reference():
    from tests.helpers.training import train

    out = train("model_parallel", 16, 4, 5)
    ref = reference(16, 5)
    for key in ref:
        torch.testing.assert_close(out["state"][key].cpu(), ref[key], rtol=1e-4, atol=1e-5)
