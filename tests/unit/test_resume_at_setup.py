"""A resumed run is back at its checkpoint when setup() returns: a loop that counts its own steps
and keeps its counter with session.keep() trains exactly the steps asked for, to the weights of an
uninterrupted run, bit for bit; one that keeps nothing is told so at its first step."""

from __future__ import annotations

import pytest
import torch

from phalanx import PhalanxError
from phalanx.session.kept import Kept
from tests.helpers import own_count as oc


def test_a_loop_that_counts_its_own_steps_resumes_exactly(tmp_path):
    whole = oc.train(str(tmp_path / "a"), resume="never")
    first = oc.train(str(tmp_path / "b"), stop_at=5)
    again = oc.train(str(tmp_path / "b"))
    assert (first["steps"], again["at_setup"], again["steps"], again["step_count"]) == (5, 5, oc.MAX_ITERS - 5, 12)
    for key, value in whole["weights"].items():
        assert torch.equal(value, again["weights"][key]), key


def test_a_resumed_loop_that_follows_no_count_is_warned_at_its_first_step(tmp_path, capsys):
    oc.train(str(tmp_path / "c"), stop_at=5, keep=False)
    capsys.readouterr()
    oc.train(str(tmp_path / "c"), keep=False, stop_at=1)
    out = capsys.readouterr().out
    assert out.count("phalanx: warning: this run resumed at step 5, but nothing in the loop follows") == 1
    assert "session.keep(iter_num=0)" in out


def test_kept_values_are_checked_and_named():
    kept = Kept({"iter_num": 0, "best": float("inf")})
    kept.iter_num += 3
    assert kept.state_dict() == {"iter_num": 3, "best": float("inf")}
    with pytest.raises(PhalanxError, match=r"holds iter_num, best, not 'iter'"):
        kept.iter = 1
    with pytest.raises(PhalanxError, match="best is a object, which a checkpoint cannot hold safely"):
        kept.best = object()  # refused when it is set, not at a save hours later
    ema = torch.nn.Linear(2, 2)
    stateful = Kept({"ema": ema})
    saved = {k: v.clone() for k, v in stateful.state_dict()["ema"].items()}
    torch.nn.init.zeros_(ema.weight)
    stateful.load_state_dict({"ema": saved})
    assert torch.equal(ema.weight, saved["weight"])  # restored in place


def test_loss_backward_with_session_step_under_accumulation_is_refused():
    # The shortest port of a one-GPU loop, under batch.micro_batch_size below the global batch.
    from torch import nn

    from phalanx import Config, Session

    session = Session(
        Config(),
        batch={"global_batch_size": 8, "micro_batch_size": 4},
        train={"progress": False, "metrics": False},
        checkpoint={"resume": "never"},
    )
    model = nn.Linear(3, 1)
    model, _ = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.ones(4, 3)).mean().backward()
    with pytest.raises(PhalanxError, match=r"2 micro-steps per optimizer step, but this step's gradients did not"):
        session.step()
    session.close()


def test_a_save_every_checkpoint_holds_the_count_the_script_makes_after_the_step(tmp_path):
    # nanoGPT counts `iter_num += 1` after its step: a checkpoint written inside the step would hold
    # the count one behind, and the resumed run would train that step twice.
    from torch import nn

    from phalanx import Config, Session

    def run(stop: int) -> tuple[int, int, int, int]:
        session = Session(
            Config(),
            batch={"global_batch_size": 4},
            train={"progress": False, "metrics": False, "seed": 0},
            checkpoint={"dir": str(tmp_path / "ck"), "save_every": 3},
        )
        model = nn.Linear(2, 1)
        model, _ = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        progress = session.keep(iter_num=0)
        start = (session.step_count, progress.iter_num)
        while progress.iter_num < stop:
            session.backward(model(torch.randn(4, 2)).pow(2).mean())
            session.step()
            progress.iter_num += 1
        end = (session.step_count, progress.iter_num)
        session.close()
        return (*start, *end)

    assert run(3) == (0, 0, 3, 3)
    assert run(6) == (3, 3, 6, 6)  # resumed at step 3 with iter_num 3; 6 steps in all


def test_starting_weights_given_after_a_resumed_setup_do_not_replace_the_checkpoints(tmp_path, capsys):
    from torch import nn

    from phalanx import Config, Session

    pretrained = {"weight": torch.full((1, 2), 7.0), "bias": torch.zeros(1)}

    def session_and_model():
        session = Session(
            Config(),
            batch={"global_batch_size": 4},
            train={"progress": False, "metrics": False},
            checkpoint={"dir": str(tmp_path / "ck")},
        )
        model = nn.Linear(2, 1)
        model, _ = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return session, model

    session, model = session_and_model()
    session.load_weights(pretrained)  # a fine-tuning start
    session.backward(model(torch.ones(4, 2)).pow(2).mean())
    session.step()
    trained = {k: v.clone() for k, v in session.model_state_dict().items()}
    session.save()
    session.close()

    session, model = session_and_model()  # resumed at setup()
    capsys.readouterr()
    session.load_weights(pretrained)
    session.load(tmp_path / "ck", weights_only=True)
    out = capsys.readouterr().out
    assert out.count("skipped: this run resumed from") == 2
    for key, value in trained.items():
        assert torch.equal(session.model_state_dict()[key], value), key
    session.close()


def test_session_step_inside_the_accumulate_block_is_refused():
    from torch import nn

    from phalanx import Config, Session

    session = Session(
        Config(),
        batch={"global_batch_size": 4},
        train={"progress": False, "metrics": False},
        checkpoint={"resume": "never"},
    )
    model = nn.Linear(3, 1)
    model, _ = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(PhalanxError, match=r"session.step\(\) was called inside `with session.accumulate"):
        with session.accumulate(model):
            session.backward(model(torch.ones(4, 3)).mean())
            if session.sync_gradients:
                session.step()  # Accelerate's idiom: the block steps at its end already
    session.close()


def _bn_run(ck, resume: str, save_every: int | None, steps: int = 6) -> dict:
    """A backward+step loop on tensors in memory, BatchNorm in the model, a counter kept: an
    automatic save waits for the next call, after the next forward moved the statistics."""
    from torch import nn

    from phalanx import Config, Session

    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(steps, 8, 4, generator=g), torch.randn(steps, 8, 1, generator=g)
    torch.manual_seed(0)
    every = {"save_every": save_every} if save_every else {}
    session = Session(
        Config(),
        batch={"global_batch_size": 8},
        train={"progress": False, "metrics": False},
        checkpoint={"dir": str(ck), "resume": resume, **every},
    )
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    model, _ = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    progress = session.keep(iter_num=0)
    while progress.iter_num < steps:
        i = progress.iter_num
        session.backward(torch.nn.functional.mse_loss(model(xs[i]), ys[i]))
        session.step()
        progress.iter_num += 1
    out = {k: v.clone() for k, v in session.model_state_dict().items()}
    session.close()
    return out


def test_a_deferred_save_holds_the_buffers_of_its_step(tmp_path):
    whole = _bn_run(tmp_path / "a", "never", 2)
    resumed = _bn_run(tmp_path / "b", str(tmp_path / "a" / "step-00000002"), None)
    for key, value in whole.items():  # running_mean, running_var and num_batches_tracked included
        assert torch.equal(value, resumed[key]), key


def test_a_weights_only_load_before_the_resume_does_not_cancel_it(tmp_path, capsys):
    from torch import nn

    from phalanx import Config, Session

    def run(steps: int) -> tuple[int, int]:
        session = Session(
            Config(),
            batch={"global_batch_size": 4},
            train={"progress": False, "metrics": False},
            checkpoint={"dir": str(tmp_path / "ck")},
        )
        model = session.setup(nn.Linear(2, 1))
        if (tmp_path / "ck").exists():
            session.load(tmp_path / "ck", weights_only=True)  # starting weights, before the optimizer is set up
        session.setup(torch.optim.SGD(model.parameters(), lr=0.1))  # the resume waited for this
        start = session.step_count
        for _ in range(steps):
            session.backward(model(torch.ones(4, 2)).pow(2).mean())
            session.step()
        session.save()
        session.close()
        return start, session.state.step

    assert run(2) == (0, 2)
    assert run(2) == (2, 4)  # resumed, though the script loaded starting weights before setting all up


def _own_data_loop(ckpt: str, *, stop_at: int | None = None, keep: bool = False) -> None:
    """Tensors dealt by session.shard and walked by the loop's own range, ended by session.should_stop
    (train.max_steps): phalanx's count ends it, but where its data stands is the loop's alone."""
    from torch import nn

    from phalanx import Config, Session

    session = Session(
        Config(),
        batch={"global_batch_size": 4},
        train={"progress": False, "metrics": False, "max_steps": 6},
        checkpoint={"dir": ckpt},
    )
    model = nn.Linear(4, 1)
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    position = session.keep(batch=0) if keep else None
    data = session.shard(torch.randn(24, 4, generator=torch.Generator().manual_seed(0)))
    for i in range(position.batch if position else 0, len(data) // 4):
        if session.should_stop:
            break
        session.backward(model(data[4 * i : 4 * i + 4]).pow(2).mean())
        session.step()
        if position is not None:
            position.batch = i + 1
        if stop_at is not None and session.state.step == stop_at:
            session.save()
            break
    session.close()


@pytest.mark.parametrize("keep", [False, True])
def test_a_resumed_loop_over_its_own_data_is_warned_unless_it_keeps_its_position(tmp_path, capsys, keep):
    _own_data_loop(str(tmp_path), stop_at=2, keep=keep)
    assert "phalanx: warning" not in capsys.readouterr().out  # a fresh run has nothing to say
    _own_data_loop(str(tmp_path), keep=keep)
    out = capsys.readouterr().out
    said = out.count("this run resumed at step 2, but phalanx does not see where the loop's data stands")
    assert said == (0 if keep else 1), out
    assert "nothing in the loop follows" not in out  # should_stop ends it at phalanx's count
