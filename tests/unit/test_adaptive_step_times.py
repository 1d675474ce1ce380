"""batch.adaptive's step times (session/step_times.py): the prior fitted before the first choice, the
times measured at each multiple taking over from it, a growth cut short when its measured steps do
not pay, and the measured times kept across a resume."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx import Config
from phalanx.config.batch import BatchPlan
from phalanx.session.adaptive import AdaptiveBatch
from phalanx.session.step_times import BACKWARD_PER_FORWARD, StepTimes, fit
from phalanx.topology import Topology

EVERY = 10
BASE = BatchPlan(global_batch_size=16, micro_batch_size=16, accumulation_steps=1, data_parallel_size=1)


def test_one_micro_step_counts_its_backward_in_the_micro_step():
    # 77 ms a step, 53 of them from the backward's start on (a GPT on 2 CPU processes): the forward is
    # 24 ms, and a micro-step is the forward and its backward, not the forward alone.
    t_micro, t_step = fit([(0.077, 0.053, False)] * 5, accumulation=1)
    assert t_micro == pytest.approx(0.024 * (1 + BACKWARD_PER_FORWARD))
    assert t_micro + t_step == pytest.approx(0.077)  # the step it was fitted to, predicted back
    # The backward's share never exceeds the synchronising part: a step that is nearly all forward.
    t_micro, t_step = fit([(0.1, 0.01, False)] * 5, accumulation=1)
    assert t_micro == pytest.approx(0.1) and t_step == pytest.approx(0.0)


def test_several_micro_steps_are_measured_from_the_ones_before_the_last():
    t_micro, t_step = fit([(0.5, 0.2, False)] * 3 + [(9.0, 9.0, True)], accumulation=4)
    assert t_micro == pytest.approx(0.1) and t_step == pytest.approx(0.1)  # the estimating step left out
    assert fit([(0.5, 0.2, False)], accumulation=4) is None  # one step is not a median


def test_a_measured_multiple_replaces_the_prior_and_the_rest_follow_the_line_through_it():
    times = StepTimes(None)
    times.record(1, [(1.0, 0.9, False)] * EVERY, accumulation=1)  # prior: 0.2 a micro-step, 0.8 fixed
    assert times.seconds(1, 1) == pytest.approx(1.0)
    assert times.seconds(4, 1) == pytest.approx(1.0 + 3 * 0.2)  # the prior's slope through k = 1
    times.record(4, [(4.0, 0.9, False)] * EVERY, accumulation=4)
    assert times.seconds(4, 1) == pytest.approx(4.0)
    assert times.seconds(2, 1) == pytest.approx(2.0)  # between the two measured
    assert times.seconds(8, 1) == pytest.approx(8.0)  # past them, the same line
    # The first window at a multiple is the one kept: a later window there changes nothing.
    times.record(4, [(9.0, 0.9, False)] * EVERY, accumulation=4)
    assert times.seconds(4, 1) == pytest.approx(4.0)


def test_given_times_are_never_replaced():
    times = StepTimes([0.001, 0.05])
    times.record(1, [(1.0, 0.9, False)] * EVERY, accumulation=1)
    assert times.measured == {} and times.seconds(2, 1) == pytest.approx(0.052)


@settings(max_examples=100, deadline=None)
@given(
    st.dictionaries(st.sampled_from([1, 2, 4, 8, 16]), st.floats(1e-4, 10.0), min_size=1, max_size=5),
    st.sampled_from([1, 2, 4, 8, 16, 32]),
    st.floats(1e-5, 1.0),
)
def test_every_prediction_is_positive_and_follows_the_measured(measured, k, t_micro):
    times = StepTimes(None)
    times.prior = (t_micro, 0.01)
    times.measured = dict(measured)
    seconds = times.seconds(k, 2)
    assert seconds > 0
    if k in measured:
        assert seconds == measured[k]
    # Step times that grow with the batch predict, between and past them, times that grow too.
    rising = dict(zip(sorted(measured), sorted(measured.values())))
    times.measured = rising
    predicted = [times.seconds(j, 2) for j in (1, 2, 4, 8, 16, 32)]
    assert all(b >= a - 1e-12 for a, b in zip(predicted, predicted[1:]))


def _adaptive() -> AdaptiveBatch:
    a = AdaptiveBatch(Config.load(batch={"adaptive": "goodput", "adapt_every": EVERY}), Topology())
    a.plan(BASE)
    return a


def _train(a: AdaptiveBatch, steps: range, seconds, noise_scale: float = 1e6) -> list[int]:
    """Optimizer steps whose time is ``seconds(k)`` (a tenth of it before the backward) and whose loss
    falls steadily; the k after each."""
    out = []
    for step in steps:
        a.observe_loss(5.0 - 0.001 * step * a.k)  # progress per step that grows with the batch
        a.note(seconds(a.k), 0.9 * seconds(a.k), False)
        a.decide(step, noise_scale, adam=False)
        out.append(a.k)
    return out


def test_a_growth_whose_steps_give_no_more_samples_per_second_goes_back_after_one_window():
    a = _adaptive()
    # The prior, from 1 s steps at x1, promises x8 in 2.4 s; a step at x8 really takes 8 times one.
    ks = _train(a, range(1, 2 * EVERY + 1), lambda k: 1.0 * k)
    assert ks[-1] == 8 and a.stall.trial is not None
    ks = _train(a, range(2 * EVERY + 1, 3 * EVERY + 1), lambda k: 1.0 * k)
    assert ks[-1] == 1 and a.history[-1] == (3 * EVERY, 1)  # one window, not the trial's two
    assert "back from x8" in a.stall.why and "1.00x the samples/s of x1" in a.stall.why
    assert a.stall.strikes == 0 and a.stall.cap is None  # no hold: the measured times decide from here
    # The line through the measured x1 and x8 says no multiple pays: it stays at x1.
    ks = _train(a, range(3 * EVERY + 1, 10 * EVERY + 1), lambda k: 1.0 * k)
    assert set(ks) == {1}


def test_a_growth_whose_steps_pay_stays_on_trial():
    a = _adaptive()
    ks = _train(a, range(1, 6 * EVERY + 1), lambda k: 0.8 + 0.2 * k)  # as the prior predicted
    assert ks[-1] == 8 and a.history == [(2 * EVERY, 8)] and a.stall.strikes == 0


def test_the_measured_times_survive_a_resume():
    def seconds(k):
        return 1.0 * k

    whole = _adaptive()
    ks_whole = _train(whole, range(1, 8 * EVERY + 1), seconds)
    first = _adaptive()
    cut = 3 * EVERY + 4
    _train(first, range(1, cut + 1), seconds)
    saved = copy.deepcopy(first.state_dict())
    assert saved["measured"] == [[1, 1.0], [8, 8.0]]
    resumed = _adaptive()
    resumed.load_state_dict(saved)
    # The resumed run's own steps are slower: its choices still follow the times measured before.
    assert _train(resumed, range(cut + 1, 8 * EVERY + 1), lambda k: 3.0 * k) == ks_whole[cut:]
    assert resumed.times.measured == whole.times.measured


def test_a_checkpoint_from_before_the_measured_times_loads():
    a = _adaptive()
    state = a.state_dict()
    state["model"] = [0.2, 0.8]
    del state["measured"]
    a.load_state_dict(state)
    assert a.times.prior == (0.2, 0.8) and a.times.measured == {}


def test_the_estimating_steps_are_left_out_unless_every_step_estimates():
    times = StepTimes(None)
    times.record(1, [(1.0, 0.9, False)] * 3 + [(5.0, 0.9, True)] * 4, accumulation=1)
    times.record(2, [(3.0, 0.9, True)] * 4, accumulation=2)
    assert times.measured == {1: 1.0, 2: 3.0}
