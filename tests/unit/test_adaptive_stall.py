"""batch.adaptive backs off a larger batch that the training loss says is not paying
(session/batch_stall.py): no growth on a plateau, a growth on trial, the back-off and its hold,
the same choices after a resume, and no read of the device per step."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx import Config
from phalanx.config.batch import BatchPlan
from phalanx.session import batch_stall
from phalanx.session.adaptive import AdaptiveBatch
from phalanx.session.batch_stall import HOLD, TRIAL, LossWindows
from phalanx.topology import Topology
from tests.helpers.tensor_reads import counting

EVERY = 10
BASE = BatchPlan(global_batch_size=16, micro_batch_size=16, accumulation_steps=1, data_parallel_size=1)
NOISE = 1e6  # far above every batch: the noise scale alone would always take the largest


def _adaptive() -> AdaptiveBatch:
    # Times given: a large fixed part per step, so a larger batch promises much more goodput.
    config = Config.load(batch={"adaptive": "goodput", "adapt_every": EVERY, "adaptive_step_times": [1e-3, 1.0]})
    a = AdaptiveBatch(config, Topology())
    a.plan(BASE)
    return a


def _train(a: AdaptiveBatch, steps: range, loss, noise_scale: float = NOISE) -> list[int]:
    """Optimizer steps ``steps`` with ``loss(step, k)`` handed over (None: no loss); the k after each."""
    out = []
    for step in steps:
        value = loss(step, a.k)
        if value is not None:
            a.observe_loss(torch.tensor(value))
        a.note(1.0, 0.5, False)
        a.decide(step, noise_scale, adam=False)
        out.append(a.k)
    return out


def _wiggle(step: int) -> float:
    return 0.01 * math.sin(step * 1.7)  # a deterministic noise, the same in every run


def test_without_losses_it_chooses_as_the_noise_scale_says():
    a = _adaptive()
    _train(a, range(1, EVERY + 1), lambda s, k: None)
    assert a.k == 8 and a.history == [(EVERY, 8)]


def test_no_growth_while_the_loss_is_on_a_plateau():
    a = _adaptive()
    ks = _train(a, range(1, 20 * EVERY + 1), lambda s, k: 2.0 + _wiggle(s))
    assert set(ks) == {1}


def test_a_growth_waits_for_two_windows_of_falling_loss():
    a = _adaptive()
    ks = _train(a, range(1, 2 * EVERY + 1), lambda s, k: 5.0 - 0.01 * s + _wiggle(s) / 10)
    assert ks[EVERY - 1] == 1  # one window: nothing to compare yet
    assert ks[2 * EVERY - 1] == 8 and a.stall.trial is not None


def test_a_growth_that_buys_no_progress_per_step_goes_back_and_holds():
    a = _adaptive()
    # The loss falls as fast per step at any batch: 8x the batch, 1/8 the progress per sample.
    ks = _train(a, range(1, 2 * EVERY + 1), lambda s, k: 5.0 - 0.01 * s)
    assert ks[-1] == 8
    ks = _train(a, range(2 * EVERY + 1, (2 + TRIAL) * EVERY + 1), lambda s, k: 5.0 - 0.01 * s)
    assert ks[-1] == 1 and a.history[-1] == ((2 + TRIAL) * EVERY, 1)
    assert "back from x8" in a.stall.why
    # Held at 1 for HOLD choices, then free to try again.
    end = (2 + TRIAL + HOLD) * EVERY
    ks = _train(a, range((2 + TRIAL) * EVERY + 1, end + 1), lambda s, k: 5.0 - 0.01 * s)
    assert set(ks[:-1]) == {1}
    assert ks[-1] == 8  # the hold ends and the loss is still falling: another trial
    # The second back-off in a row holds twice as long.
    _train(a, range(end + 1, end + TRIAL * EVERY + 1), lambda s, k: 5.0 - 0.01 * s)
    assert a.k == 1 and a.stall.strikes == 2
    assert a.stall.hold_until == end + TRIAL * EVERY + 2 * HOLD * EVERY


def test_a_growth_that_pays_per_step_is_kept():
    a = _adaptive()
    # Progress per step grows with the batch, as the noise scale predicts when it is large.
    ks = _train(a, range(1, 10 * EVERY + 1), lambda s, k: 5.0 - 0.001 * s * k)
    assert ks[-1] == 8 and a.stall.strikes == 0 and a.history == [(2 * EVERY, 8)]


def test_the_verdict_weighs_what_the_noise_scale_predicted():
    a = _adaptive()
    a.stall.trial = {"at": 0, "from": 1, "to": 4, "before": 1.0, "expect": 0.5}
    # Per step 4 x 0.5 x 1.0 = 2 predicted; half of it (1.0) is the least kept.
    a.stall.losses.closed = [[0, 4, 3.0, 0.0], [EVERY, 4, 3.0 - 0.99 * EVERY, 0.0]]
    assert a.stall._failed(a.stall.trial)
    a.stall.losses.closed = [[0, 4, 3.0, 0.0], [EVERY, 4, 3.0 - 1.01 * EVERY, 0.0]]
    assert not a.stall._failed(a.stall.trial)


def test_a_resumed_run_decides_as_the_uninterrupted_one():
    def loss(s, k):
        return 5.0 - 0.01 * s + _wiggle(s) / 10

    whole = _adaptive()
    ks_whole = _train(whole, range(1, 12 * EVERY + 1), loss)
    first = _adaptive()
    cut = 2 * EVERY + 3  # inside a trial, inside a window
    _train(first, range(1, cut + 1), loss)
    saved = copy.deepcopy(first.state_dict())
    resumed = _adaptive()
    resumed.load_state_dict(saved)
    ks_resumed = _train(resumed, range(cut + 1, 12 * EVERY + 1), loss)
    assert ks_whole[cut:] == ks_resumed
    assert resumed.history == whole.history
    assert resumed.stall.state_dict() == whole.stall.state_dict()


def test_an_old_checkpoint_without_the_check_still_loads():
    a = _adaptive()
    state = a.state_dict()
    del state["stall"]
    a.load_state_dict(state)
    assert a.stall.trial is None


def test_the_losses_are_read_once_a_window_and_never_per_step():
    windows = LossWindows()
    with counting() as reads:
        reads.counting = True
        for step in range(1, 51):
            windows.add(torch.tensor(float(step)))
        assert not reads.stray  # added up on the device
        windows.close(50, 1)
    assert sum(reads.stray.values()) == 1  # the window's sums, at the choice (a read point in a run)
    assert windows.closed[-1][2] == pytest.approx(25.5)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3), min_size=2, max_size=40))
def test_a_window_is_its_mean_and_standard_error(values):
    windows = LossWindows()
    for v in values:
        windows.add(v)
    windows.close(10, 1)
    _, _, mean, error = windows.closed[-1]
    t = torch.tensor(values, dtype=torch.float64)
    assert mean == pytest.approx(float(t.mean()), abs=1e-9)
    assert error == pytest.approx(float(t.std() / math.sqrt(len(values))), abs=1e-6)


def test_a_non_finite_loss_leaves_its_window_unmeasured():
    windows = LossWindows()
    for v in (1.0, float("nan"), 2.0):
        windows.add(v)
    windows.close(EVERY, 1)
    assert windows.closed[-1][2] is None
    assert windows.progress(EVERY) is None


def test_the_constants_are_what_the_docs_say():
    assert (batch_stall.STALL, batch_stall.Z, batch_stall.TRIAL, batch_stall.HOLD) == (0.5, 2.0, 2, 4)
    assert batch_stall.SLOWING_FLOOR == 0.5


def test_the_verdict_counts_the_slowing_the_smaller_batch_would_have_seen():
    a = _adaptive()
    # At x1 the fall halved from one window to the next (1.0, then 0.5): two windows on, x1 would
    # have fallen 0.125 a window, and x2, at the noise scale's full promise, twice that.
    a.stall.losses.closed = [[EVERY, 1, 3.0, 0.0], [2 * EVERY, 1, 2.0, 0.0], [3 * EVERY, 1, 1.5, 0.0]]
    a.stall.losses.seen = True
    assert a.stall.losses.slowing(EVERY) == pytest.approx(0.5)
    a.stall.grew(3 * EVERY, 1, 2, BASE.global_batch_size, NOISE)
    assert a.stall.trial["before"] == pytest.approx(0.5 / EVERY * 0.5**TRIAL)
    # x2 falls 0.2 a window: 0.8x of the 0.25 promised, above the half asked (against the fall before
    # the growth, unslowed, it would be 0.2x, and go back).
    a.stall.losses.closed = [[3 * EVERY, 1, 1.5, 0.0], [4 * EVERY, 2, 1.2, 0.0], [5 * EVERY, 2, 1.0, 0.0]]
    assert not a.stall._failed(a.stall.trial)


@pytest.mark.parametrize(
    ("means", "expected"),
    [
        ([3.0, 2.0, 1.9], 0.5),  # a fall that shrinks tenfold: no lower than the floor
        ([3.0, 2.0, 0.5], 1.0),  # a fall that grows: no more than none
        ([3.0, 3.0, 2.0], 1.0),  # the earlier was no fall
        ([3.0, 2.0, 2.5], 1.0),  # the last was no fall
    ],
)
def test_the_slowing_is_bounded(means, expected):
    windows = LossWindows()
    windows.closed = [[(i + 1) * EVERY, 1, m, 0.0] for i, m in enumerate(means)]
    assert windows.slowing(EVERY) == pytest.approx(expected)
    windows.closed[0][1] = 2  # windows at another multiple say nothing of this one's slowing
    assert windows.slowing(EVERY) == 1.0


def _reviewed(back_means: list[float]) -> tuple[tuple[str, int], AdaptiveBatch]:
    """A back-off from x8 to x1 at step 4 EVERY, its trial having fallen 0.8 a window at x8 (0.1 per
    sample), then two windows back at x1 with ``back_means``; the ruling when they are in."""
    a = _adaptive()
    at = 4 * EVERY
    a.stall.cap, a.stall.hold_until, a.stall.strikes = 1, at + HOLD * EVERY, 1
    a.stall.review = {"at": at, "from": 1, "to": 8, "after": 0.8 / EVERY, "error": 0.01 / EVERY, "expect": 1.0}
    a.stall.losses.closed = [[at, 8, 3.0, 0.0]] + [
        [at + (i + 1) * EVERY, 1, m, 0.001] for i, m in enumerate(back_means)
    ]
    return a.stall.ruling(at + TRIAL * EVERY, 1), a


def test_a_back_off_that_the_smaller_batch_does_not_bear_out_is_undone():
    # Back at x1 the loss no longer falls: x8's 0.1 per sample was the better, the slowing the run's.
    ruling, a = _reviewed([2.0, 1.99])
    assert ruling == ("again", 8)
    assert a.stall.cap is None and a.stall.strikes == 0 and a.stall.review is None
    assert a.stall.why.startswith("x8 again: back at x1 the loss fell 0.10x as much per sample as x8's")
    ruling, a = _reviewed([2.0, 2.1])  # back at x1 the loss rose: the verdict was wrong
    assert ruling == ("again", 8) and "back at x1 the loss did not fall, where x8's on trial did" in a.stall.why


def test_a_back_off_that_the_smaller_batch_bears_out_holds():
    # Back at x1 the loss falls 0.5 a window, per sample five times x8's: the verdict was right.
    ruling, a = _reviewed([2.0, 1.5])
    assert ruling == ("free", 1) and a.stall.cap == 1 and a.stall.strikes == 1
    # Within the noise it holds as well: x1 falls 0.16 a window (weighed, 0.08 against x8's 0.1 per
    # sample), but with standard errors of 0.05 a window the difference is not 2 of them.
    a = _adaptive()
    a.stall.review = {"at": 0, "from": 1, "to": 8, "after": 0.8 / EVERY, "error": 0.4 / EVERY, "expect": 1.0}
    a.stall.losses.closed = [[0, 8, 3.0, 0.0], [EVERY, 1, 2.0, 0.05], [2 * EVERY, 1, 1.84, 0.05]]
    assert a.stall.ruling(TRIAL * EVERY, 1) == ("free", 0)
    assert a.stall.review is None  # reviewed once, either way


def test_a_checkpoint_from_before_the_review_loads():
    a = _adaptive()
    state = a.state_dict()
    del state["stall"]["review"]
    a.load_state_dict(state)
    assert a.stall.review is None
