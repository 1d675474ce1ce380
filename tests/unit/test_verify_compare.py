"""phalanx verify's pieces without processes: the difference measure, the comparison of two
traces, the causes read from the runs' own warnings, the table and the verdict lines."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from phalanx.session.loop_checks import LoopChecks
from phalanx.session.trace import WeightsTrace, random_modules
from phalanx.strategies.sync_batchnorm import unsynced_line
from phalanx.verify import MOVED_ENOUGH, VerifyOptions, VerifyResult, movement, parted_from_rounding, uses_phalanx
from phalanx.verify.causes import from_first_difference, from_logs, resume_causes
from phalanx.verify.compare import (
    TOLERANCE,
    StepDiff,
    compare_traces,
    compare_weights,
    relative_difference,
    trace_facts,
)
from phalanx.verify.report import summary, table

FEW = settings(derandomize=True, database=None, max_examples=60, deadline=None)
values = st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=1, max_size=16)


@FEW
@given(values, st.floats(1e-3, 1e3))
def test_a_tensor_equals_itself_and_the_measure_is_symmetric_and_scale_free(xs, factor):
    a = torch.tensor(xs, dtype=torch.float64)
    b = a + 0.5
    assert relative_difference(a, a.clone()) == 0.0
    assert relative_difference(a, b) == relative_difference(b, a)
    rms = max(a.square().mean().sqrt().item(), b.square().mean().sqrt().item())
    if rms * factor > 1e-3:  # above the floor, scaling both leaves the measure alone
        assert relative_difference(a * factor, b * factor) == pytest.approx(0.5 / rms, rel=1e-6)


def test_a_few_elements_moved_by_rounding_stay_below_the_tolerance_a_wrong_update_does_not():
    # What 2 processes left in examples/train_phalanx.py's head.1.weight after one AdamW step: 6% of
    # the elements off by rounding (2e-9), and a few whose gradient was near eps by 1.5e-6 (lr 2e-3).
    weights = torch.randn(131072, generator=torch.Generator().manual_seed(0)) * 0.018
    rounded = weights.clone()
    rounded[::16] += 2e-9
    rounded[::16384] += 1.5e-6
    assert relative_difference(weights, rounded) < TOLERANCE / 10
    assert relative_difference(weights, weights * 1.01) > TOLERANCE * 100  # a gradient 1% off, everywhere
    one = weights.clone()
    one[7] += 2e-3  # one element a whole step off
    assert relative_difference(weights, one) > TOLERANCE


def test_a_tensor_near_zero_is_measured_against_the_floor():
    # A bias one Adam step from zero: rounding stays below the tolerance, a wrong step does not.
    bias = torch.tensor([2.8e-4])
    assert relative_difference(bias, bias + 4.7e-10) < 1e-6
    assert relative_difference(bias, bias * 2) > 1e-2


def test_other_shapes_counters_and_non_finite_values_count_as_different():
    assert relative_difference(torch.zeros(2), torch.zeros(3)) == math.inf
    assert relative_difference(torch.tensor(3), torch.tensor(4)) == math.inf
    assert relative_difference(torch.tensor(3), torch.tensor(3)) == 0.0
    assert relative_difference(torch.tensor([1.0, math.nan]), torch.tensor([1.0, 2.0])) == math.inf
    diff = compare_weights(1, {"w": torch.tensor([math.inf])}, {"w": torch.tensor([1.0])})
    assert diff.difference == math.inf and "not finite" in diff.note
    assert "holds other counts" in compare_weights(1, {"n": torch.tensor(2)}, {"n": torch.tensor(3)}).note


def test_the_worst_tensor_is_named_and_a_missing_one_too():
    ours = {"a": torch.ones(3), "b": torch.ones(3) * 2, "c": torch.ones(3)}
    theirs = {"a": torch.ones(3), "b": torch.ones(3), "c": torch.ones(3) * 1.5}
    diff = compare_weights(4, ours, theirs)
    assert (diff.step, diff.tensor) == (4, "b") and diff.difference == pytest.approx(0.5)  # 1 against 2
    assert compare_weights(0, {"a": torch.ones(1)}, {"a": torch.ones(1), "z": torch.ones(1)}).tensor == "z"
    assert compare_weights(0, ours, {k: v.clone() for k, v in ours.items()}).tensor is None


def test_a_trace_written_by_the_session_collaborator_compares(tmp_path):
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1), nn.Linear(2, 1))
    for name in ("one", "two"):
        trace = WeightsTrace(str(tmp_path / name), True, [model], lambda m: m.state_dict(), lambda m: m, lambda: True)
        trace.start(0)
        with torch.no_grad():
            model[0].weight.add_(1.0 if name == "two" else 0.0)
        trace.write(1)
    diffs = compare_traces(tmp_path / "two", tmp_path / "one", [0, 1, 2])
    assert [(d.step, d.tensor) for d in diffs] == [(0, None), (1, "0.weight")]
    assert trace_facts(tmp_path / "one") == {"random_modules": ["1"], "split_batches": True}
    assert random_modules(nn.Sequential(nn.Dropout(0.0))) == []


def test_the_runs_warnings_name_the_causes_in_their_own_words():
    said: list[str] = []
    checks = LoopChecks(None, said.append, limited=False)
    loss = torch.ones(2, requires_grad=True).sum()
    checks.check_loss(loss, shares=2)
    log = [
        "[rank 0] " + unsynced_line(1, None, 2),
        *said,
        "phalanx: scheduler.step() is called between the micro-steps of a global batch; only ...",
        "unrelated",
    ]
    causes = from_logs(log)
    assert [c.split(":")[0] for c in causes] == ["BatchNorm without sync", "a sum loss", "a scheduler stepped by hand"]


def test_the_difference_itself_points_at_causes():
    bn = from_first_difference(StepDiff(3, 0.1, "body.1.running_mean"), {})
    assert bn[0].startswith("BatchNorm without sync")
    start = from_first_difference(StepDiff(0, 0.1, "w"), {"random_modules": ["drop"], "split_batches": False})
    assert "before the first step" in start[0] and "does not split" in start[1] and "dropout (drop)" in start[2]


def _result(scaling: list[float], resume: list[float]) -> VerifyResult:
    return VerifyResult(
        nproc=2,
        steps=len(scaling) - 1,
        tolerance=1e-5,
        scaling=[StepDiff(i, d, "w" if d else None) for i, d in enumerate(scaling)],
        resume=[StepDiff(i + 2, d, "w" if d else None) for i, d in enumerate(resume)],
        resumed_at=2,
        causes=["a sum loss: ..."],
    )


def test_the_table_and_the_verdict():
    good = _result([0, 1e-7, 2e-7, 1e-7, 1e-7], [0, 0, 0])
    assert good.holds
    rows = table(good)
    assert rows[0].split()[:2] == ["step", "1"] and rows[1].startswith("0 (start)") and len(rows) == 6
    assert "2 processes train like 1 for 4 steps" in summary(good)[-1]
    bad = _result([0, 1e-7, 3e-2, math.inf, 1], [0, 0, 1e-3])
    assert not bad.holds and "DIFFERS" in table(bad)[3]
    text = "\n".join(summary(bad))
    assert "do not train like 1: first at step 2, in w (3.0e-02 > 1e-05)" in text
    assert "resumed at step 2 does not match the uninterrupted one: first at step 4" in text
    assert "likely causes:\n  - a sum loss" in text


@pytest.mark.parametrize(
    "changes, words",
    [({"nproc": 1}, "--nproc must be at least 2"), ({"steps": 1}, "--steps"), ({"tolerance": 0}, "--tolerance")],
)
def test_options_that_cannot_verify_are_refused(changes, words):
    with pytest.raises(Exception, match=words):
        VerifyOptions(script="x.py", **changes).check()


def test_only_a_script_that_imports_phalanx_is_run(tmp_path):
    plain, ported = tmp_path / "plain.py", tmp_path / "ported.py"
    plain.write_text("import torch\nimport torch.distributed as dist\n")
    ported.write_text("from phalanx import Session\n")
    assert not uses_phalanx(str(plain)) and uses_phalanx(str(ported))


def test_a_resume_that_parts_at_once_or_later_names_its_own_causes():
    at_once = resume_causes(StepDiff(4, 0.1, "w"), 4, [])
    assert at_once[0].startswith("a checkpoint that does not hold everything")
    later = resume_causes(
        StepDiff(5, 0.3, "w"),
        4,
        ["phalanx: warning: this run resumed at step 4, but nothing in the loop follows phalanx's count"],
    )
    assert [c.split(":")[0] for c in later] == ["a loop that restarts"]  # the run's own line, not repeated
    unsaid = resume_causes(StepDiff(5, 0.3, "w"), 4, ["phalanx: ddp over 2 processes"])
    assert unsaid[0].startswith("a loop that does not pick up where the checkpoint left off")
    own_data = "phalanx: warning: this run resumed at step 4, but phalanx does not see where the loop's data stands"
    assert resume_causes(StepDiff(5, 0.3, "w"), 4, [own_data])[0].startswith("a loop that restarts")


def test_runs_that_agree_to_rounding_then_part_are_pointed_at_fp64():
    parted = _result([0, 1.6e-7, 3.8e-7, 8.5e-5, 1e-2], [0, 0, 0])
    at_once = _result([0, 0.4, 0.4, 0.4, 0.4], [0, 0, 0])
    assert parted_from_rounding(parted) and not parted_from_rounding(at_once)


def test_fp64_makes_the_model_and_its_inputs_float64():
    from phalanx.config.schema import PrecisionConfig
    from phalanx.runtime.precision import Precision

    before = torch.get_default_dtype()
    try:
        precision = Precision(PrecisionConfig(mode="fp64"), torch.device("cpu"))
        model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
        precision.prepare_model(model)
        model.forward = precision.wrap_forward(model.forward)
        out = model(torch.ones(4, 3, dtype=torch.float32))
        assert out.dtype == torch.float64 and model[1].running_mean.dtype == torch.float64
        assert torch.get_default_dtype() == torch.float64  # what the script makes after the Session too
    finally:
        torch.set_default_dtype(before)


def test_ranks_whose_weights_part_make_verify_say_they_differ(tmp_path):
    from phalanx.harness.launching import LaunchRun
    from phalanx.verify.runs import ReplicasDiffer, _run

    log = tmp_path / "launch.log"
    log.write_text("phalanx: error: replicas drifted apart at step 3 (they were equal at step 2): w differs\n")

    class Trials:
        def launch(self, *args, **kwargs):
            return LaunchRun(2, False, 3, 1.0, log, None)

    with pytest.raises(
        ReplicasDiffer, match="2 processes run stopped, its ranks' own weights apart: replicas drifted"
    ) as err:
        _run(Trials(), "train.py", (), 2, (), tmp_path, 8, "2 processes")
    assert err.value.exit_code == 1


def test_weights_that_barely_move_leave_verify_unable_to_tell(tmp_path):
    model = nn.Linear(4, 4)
    trace = WeightsTrace(str(tmp_path), True, [model], lambda m: m.state_dict(), lambda m: m, lambda: True)
    trace.start(0)
    with torch.no_grad():
        model.weight.add_(1e-6)  # a warm-up from lr 0
    trace.write(1)
    assert movement(tmp_path) < MOVED_ENOUGH * TOLERANCE
    inconclusive = _result([0, 0], [0])
    inconclusive.inconclusive = "the weights moved by at most 1e-6"
    assert inconclusive.exit_code == 2 and "cannot tell" in summary(inconclusive)[-1]
    assert _result([0, 1e-7], [0]).exit_code == 0 and _result([0, 1e-2], [0]).exit_code == 1
