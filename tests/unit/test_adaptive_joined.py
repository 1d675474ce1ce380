"""batch.adaptive with batch.max_micro_batch_size: a larger global batch is trained in forwards
that join several of the loader's micro-batches, which trains the same samples per step with the
same weights (to rounding) as one micro-batch per forward, and in fewer forwards."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from phalanx import Config, Session
from phalanx.util.tree import NotConcatenable, concat_batches, layout


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True) + 30.0 * torch.randn(1024, 1, generator=g))  # B_noise ~ 900


class _Mapped(Dataset):
    """_data()'s samples, each passed through ``sample(i, x, y)``."""

    def __init__(self, sample):
        self.inner, self.sample = _data(), sample

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        return self.sample(i, *self.inner[i])


def _labelled() -> Dataset:
    """(x, y, name): a string per sample, which collates to a list of strings."""
    return _Mapped(lambda i, x, y: (x, y, f"sample-{i}"))


def _padded() -> Dataset:
    """Variable-length samples, padded per batch to the batch's longest (a text loader's collate):
    4 of 10 batches of 8 are one longer."""
    return _Mapped(lambda i, x, y: (torch.cat([x, torch.zeros(1 if i % 16 == 0 else 0)]), y))


def _pad(samples):
    longest = max(x.shape[0] for x, _ in samples)
    xs = torch.stack([torch.cat([x, torch.zeros(longest - x.shape[0])]) for x, _ in samples])
    return xs, torch.stack([y for _, y in samples])


class _FirstFour(nn.Module):
    def __init__(self, inputs: int, outputs: int):
        super().__init__()
        self.linear = nn.Linear(inputs, outputs)

    def forward(self, x):
        return self.linear(x[:, :4])


def _train(dataset, tmp_path, progress=False, collate=None, model=nn.Linear, evaluate_every=0, **batch):
    session = Session(
        Config(),
        # Given step times: the choices depend on the data alone, so both runs choose alike.
        batch={
            "micro_batch_size": 4,
            "adaptive": "goodput",
            "adapt_every": 4,
            "adaptive_step_times": [0.001, 0.05],
            "adaptive_loss_check": False,  # the mechanics of joining, not when to grow
            **batch,
        },
        train={"progress": False, "metrics": False, "noise_scale_every": 1, "max_steps": 30},
        launch={"run_dir": str(tmp_path)},
    )
    torch.manual_seed(0)
    model = model(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1000)
    model, optimizer, loader, scheduler, held_out = session.setup(
        model,
        optimizer,
        DataLoader(dataset, batch_size=8, shuffle=True, collate_fn=collate),
        scheduler,
        DataLoader(_data(), batch_size=64),
    )
    sizes, counted = [], []
    for _ in session.epochs(1000):
        for i, (xb, yb, *_) in enumerate(session.progress(loader) if progress else loader):
            if evaluate_every and i % evaluate_every == 0:
                with torch.no_grad():  # an evaluation loader between a batch and its forward
                    for ex, _ in held_out:
                        model(ex)
            sizes.append(xb.shape[0])
            with session.accumulate(model):
                session.backward(nn.functional.mse_loss(model(xb), yb))
        if progress:
            counted.append(session.last_throughput.samples)
    out = {
        "counted": counted,
        "weights": [p.detach().clone() for p in model.parameters()],
        "history": list(session.adaptive.history),
        "steps": session.step_count,
        "schedule": scheduler.last_epoch,
        "sizes": sizes,
        "position": loader.position,
        "noise": {"small": session.noise.estimate.small, "value": session.noise.value},
    }
    session.close()
    return out


def test_joined_forwards_train_as_one_micro_batch_each(tmp_path):
    # The noise scale too: an estimating step's first forward stays one micro-batch, so the
    # estimates, the batch choices and the learning-rate gains are the plain run's.
    plain = _train(_data(), tmp_path / "plain")
    joined = _train(_data(), tmp_path / "joined", max_micro_batch_size=16)
    assert plain["history"] and plain["history"] == joined["history"], plain["history"]  # the batch grew alike
    assert (plain["steps"], plain["schedule"], plain["position"]) == (
        joined["steps"],
        joined["schedule"],
        joined["position"],
    )
    assert set(plain["sizes"]) == {4} and max(joined["sizes"]) == 16  # 4 micro-batches per forward at most
    assert sum(plain["sizes"]) == sum(joined["sizes"]) and len(joined["sizes"]) < len(plain["sizes"])
    for a, b in zip(plain["weights"], joined["weights"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_an_evaluation_between_a_batch_and_its_forward_changes_nothing(tmp_path):
    plain = _train(_data(), tmp_path / "plain", max_micro_batch_size=16)
    evaluated = _train(_data(), tmp_path / "evaluated", evaluate_every=3, max_micro_batch_size=16)
    assert plain["sizes"] == evaluated["sizes"] and plain["history"] == evaluated["history"]
    for a, b in zip(plain["weights"], evaluated["weights"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_batches_of_different_shapes_take_one_forward_each(tmp_path):
    joined = _train(_padded(), tmp_path / "joined", collate=_pad, model=_FirstFour, max_micro_batch_size=16)
    plain = _train(_padded(), tmp_path / "plain", collate=_pad, model=_FirstFour)
    assert joined["history"] and joined["steps"] == plain["steps"] and sum(joined["sizes"]) == sum(plain["sizes"])
    assert max(joined["sizes"]) > 4 and len(joined["sizes"]) < len(plain["sizes"])  # joined where shapes agree
    for a, b in zip(plain["weights"], joined["weights"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_batches_of_different_shapes_are_refused_where_ranks_must_take_the_same_forwards():
    from phalanx.errors import PhalanxError
    from phalanx.runtime.data import DeviceLoader

    loader = DataLoader(_padded(), batch_size=8, collate_fn=_pad)  # in order: every other batch is longer
    wrapped = DeviceLoader(loader, None, torch.device("cpu"), train=True, non_blocking=False)
    wrapped.group, wrapped.join_strictly = (lambda: 3), True
    with pytest.raises(PhalanxError, match=r"^batch.adaptive: the training loader's batches differ in shape"):
        list(wrapped)


def test_the_progress_bar_counts_every_sample_of_a_joined_forward(tmp_path):
    joined = _train(_data(), tmp_path, progress=True, max_micro_batch_size=16)
    assert max(joined["sizes"]) == 16 and sum(joined["counted"]) == sum(joined["sizes"])


def test_the_noise_scale_goes_on_from_joined_forwards(tmp_path):
    joined = _train(_data(), tmp_path, max_micro_batch_size=16)
    # An estimating step's first forward is one micro-batch, as without joining.
    assert joined["history"][-1][1] >= 4 and joined["noise"]["small"] == 4
    assert 100 < joined["noise"]["value"] < 10_000  # B_noise ~ 900 (a noisy problem), not a broken estimate


def test_batches_that_cannot_be_joined_keep_one_micro_batch_per_forward(tmp_path, capsys):
    joined = _train(_labelled(), tmp_path, max_micro_batch_size=16)
    assert joined["history"] and set(joined["sizes"]) == {4}
    lines = [line for line in capsys.readouterr().out.splitlines() if "cannot join" in line]
    assert lines == [
        "phalanx: batch.adaptive: the loader's batches hold a str, which phalanx cannot join into a larger batch; "
        "each forward stays one micro-batch (a step takes more of them)"
    ]


_leaves = st.integers(1, 3).map(lambda n: torch.arange(n * 2.0).reshape(n, 2))


@settings(max_examples=60, deadline=None)
@given(
    st.recursive(
        _leaves,
        lambda inner: st.one_of(
            st.lists(inner, min_size=1, max_size=3), st.dictionaries(st.sampled_from("abc"), inner, min_size=1)
        ),
        max_leaves=6,
    ),
    st.integers(1, 4),
)
def test_a_joined_batch_holds_each_batch_in_order(batch, count):
    batches = [_scaled(batch, i + 1) for i in range(count)]
    layout(batch)  # joinable
    joined = concat_batches(batches)
    assert _leaves_of(joined) == [torch.cat(parts).tolist() for parts in zip(*map(_leaves_of_tensors, batches))]


@pytest.mark.parametrize("leaf", ["text", 3, 2.5, torch.tensor(1.0), None])
def test_anything_but_batched_tensors_cannot_be_joined(leaf):
    with pytest.raises(NotConcatenable):
        layout((torch.zeros(2, 1), [leaf]))


def _scaled(batch, factor):
    if isinstance(batch, torch.Tensor):
        return batch * factor
    if isinstance(batch, dict):
        return {k: _scaled(v, factor) for k, v in batch.items()}
    return [_scaled(v, factor) for v in batch]


def _leaves_of_tensors(batch):
    if isinstance(batch, torch.Tensor):
        return [batch]
    values = batch.values() if isinstance(batch, dict) else batch
    return [t for v in values for t in _leaves_of_tensors(v)]


def _leaves_of(batch):
    return [t.tolist() for t in _leaves_of_tensors(batch)]
