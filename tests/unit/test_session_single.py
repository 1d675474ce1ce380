"""The Session in one process: accumulation, scheduling, lr scaling, precision and the guards."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from phalanx import Config, PhalanxError, Session
from tests.helpers.models import make_data, make_model
from tests.helpers.probes import evaluate, seen_lrs
from tests.helpers.training import reference, rel_diff, train


@pytest.mark.parametrize("strategy", ["single", "dp", "ddp"])
def test_one_process_matches_plain_loop(strategy):
    out = train(strategy, global_bs=16, micro_bs=None, steps=5)
    assert rel_diff(out["state"], reference(16, 5)) < 1e-5
    assert list(out["state"]) == list(reference(16, 5))  # no `module.` prefix


def test_accumulation_in_one_process_matches_whole_batch():
    out = train("single", global_bs=16, micro_bs=4, steps=5)
    assert out["accumulation"] == 4 and out["micro_steps"] == 20
    assert out["steps"] == out["scheduler_steps"] == 5
    assert rel_diff(out["state"], reference(16, 5)) < 1e-5


def test_scheduler_steps_once_per_optimizer_step_over_epochs():
    out = train("single", global_bs=8, micro_bs=2, steps=3, epochs=2)
    assert out["steps"] == out["scheduler_steps"] == 6
    assert out["lrs"] == pytest.approx([0.05, 0.025, 0.025, 0.0125, 0.0125, 0.00625])


def test_linear_lr_scaling_with_warmup_leaves_the_scheduler_alone():
    out = seen_lrs(64, 4, lr_scaling="linear", warmup_steps=2)  # 64 / reference 16 -> x4
    assert out["used"] == pytest.approx([0.1 * (0.25 + 0.75 * 0.5) * 4, 0.4, 0.4, 0.4])
    assert out["after"] == pytest.approx(0.1)


def test_sqrt_scaling():
    assert seen_lrs(64, 2, lr_scaling="sqrt")["used"] == pytest.approx([0.2, 0.2])


def test_evaluation_in_one_process():
    out = evaluate(11, 4)
    assert out["count"] == 11 and out["reduced_sum"] == 11


def _session(**sections):
    return Session(Config(), train={"progress": False}, **sections)


def test_guards_against_stepping_twice():
    session = _session(batch={"global_batch_size": 8, "micro_batch_size": 4})
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    model, optimizer, scheduler = session.setup(model, optimizer, scheduler)
    x, y = make_data(4).tensors
    with session.accumulate(model):
        session.backward(F.mse_loss(model(x), y))
    with pytest.raises(PhalanxError, match=r"optimizer.step\(\) was called directly"):
        optimizer.step()
    with pytest.raises(PhalanxError, match=r"zero_grad\(\) was called in the middle"):
        optimizer.zero_grad()
    with session.accumulate(model):
        session.backward(F.mse_loss(model(x), y))
    assert session.step_count == 1
    optimizer.zero_grad()  # harmless at a boundary
    session.close()


def test_setup_rejects_unknown_objects_and_custom_samplers():
    session = _session()
    with pytest.raises(PhalanxError, match="setup\\(\\) takes models"):
        session.setup("not a model")
    sampler = torch.utils.data.WeightedRandomSampler([1.0] * 8, 8)
    loader = DataLoader(make_data(8), batch_size=4, sampler=sampler)
    with pytest.raises(PhalanxError, match="WeightedRandomSampler"):
        session.setup_loader(loader, train=True)
    session.close()


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_mixed_precision_trains_on_cpu(mode):
    session = _session(precision=mode, batch={"global_batch_size": 32})
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = DataLoader(make_data(32 * 20), batch_size=32, shuffle=True)
    model, optimizer, loader = session.setup(model, optimizer, loader)
    losses = []
    for x, y in loader:
        with session.accumulate(model):
            out = model(x)
            assert out.dtype == torch.float32  # autocast inside, fp32 out
            loss = F.mse_loss(out, y)
            session.backward(loss)
        losses.append(loss.item())
    assert (session.precision.scaler is not None) == (mode == "fp16")
    assert sum(losses[-5:]) < sum(losses[:5])
    session.close()


def test_clip_grad_norm_from_config_bounds_the_update():
    session = _session(optim={"max_grad_norm": 1e-3}, batch={"global_batch_size": 16})
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model, optimizer = session.setup(model, optimizer)
    x, y = make_data(16).tensors
    with session.accumulate(model):
        session.backward(F.mse_loss(model(x), y) * 1000)
    moved = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)]).norm()
    assert moved.item() == pytest.approx(1e-3, rel=1e-3)
    session.close()


def test_fp16_with_two_optimizers_and_clipping_updates_both_like_fp32():
    def run(mode):
        session = _session(precision=mode, optim={"max_grad_norm": 10.0}, batch={"global_batch_size": 16})
        a, b = make_model(), make_model()
        opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
        a, b, opt_a, opt_b = session.setup(a, b, opt_a, opt_b)
        x, y = make_data(16).tensors
        with session.accumulate(a):
            session.backward(F.mse_loss(a(x), y) + F.mse_loss(b(x), y))
        moved = [
            sum((p.detach() - q).abs().sum() for p, q in zip(m.parameters(), make_model().parameters())).item()
            for m in (a, b)
        ]
        session.close()
        return moved

    fp32, fp16 = run("fp32"), run("fp16")
    # fp16 autocast on CPU changes the numbers a little, never by the 1/65536 of a double unscale.
    assert fp16 == pytest.approx(fp32, rel=0.05)


def test_zero_grad_at_the_start_of_a_window_is_allowed():
    session = _session(batch={"global_batch_size": 8})
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = session.setup(model, optimizer)
    x, y = make_data(8).tensors
    for _ in range(2):
        with session.accumulate(model):
            optimizer.zero_grad()  # a habit from one-GPU loops: harmless here
            session.backward(F.mse_loss(model(x), y))
    assert session.step_count == 2
    session.close()


def test_launcher_set_lines_beat_code_even_with_an_explicit_config(monkeypatch):
    from phalanx.topology import LaunchContext

    monkeypatch.setenv("PHALANX_CONTEXT", LaunchContext(overrides=("train.epochs=4",)).to_env()["PHALANX_CONTEXT"])
    session = Session(Config(), train={"epochs": 3, "progress": False})
    assert session.config.train.epochs == 4
    assert session.config.sources["train.epochs"] == "--set"
    assert session.config.sources["train.progress"] == "code"
    session.close()


def test_evaluation_batches_of_dicts_with_text():
    from phalanx.runtime.data import _batch_len

    assert _batch_len({"text": ["a", "b", "c"], "ids": torch.zeros(3, 5)}) == 3
    assert _batch_len({"text": ["a", "b"]}) == 2
    with pytest.raises(PhalanxError, match="cannot tell the batch size"):
        _batch_len({"n": 3})


def test_unfinished_window_of_an_iterable_loader_is_dropped_at_epoch_end(capsys):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            x, y = make_data(12).tensors
            return iter(zip(x, y))

    session = Session(
        Config(), batch={"global_batch_size": 8, "micro_batch_size": 4}, train={"epochs": 2, "progress": False}
    )
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Stream(), batch_size=4)  # 3 micro-batches: one window and a half
    model, optimizer = session.setup(model, optimizer)
    loader = session.setup_loader(loader, train=True)
    for _ in session.epochs():
        for x, y in session.progress(loader):
            with session.accumulate(model):
                session.backward(F.mse_loss(model(x), y))
    assert session.step_count == 2
    assert all(p.grad is None for p in model.parameters())
    assert capsys.readouterr().out.count("dropping 1 micro-step(s)") == 2
    session.close()


@pytest.mark.parametrize("reduce, warned", [("sum", True), ("mean", False), ("sum of means", False)])
def test_a_sum_loss_under_accumulation_is_said_once(capsys, reduce, warned):
    session = _session(batch={"global_batch_size": 8, "micro_batch_size": 4})
    model = make_model()
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = make_data(4).tensors
    for _ in range(4):
        with session.accumulate(model):
            error = (model(x) - y) ** 2
            loss = {
                "sum": error.sum(),
                "mean": error.mean(),
                "sum of means": error.mean() + error.mean(),
            }[reduce]
            session.backward(loss)
    session.close()
    out = capsys.readouterr().out
    assert out.count("the loss is a sum") == (1 if warned else 0)
    if warned:
        assert "1/2 of the gradient" in out
