"""benchmarks/compare.py, the side-by-side harness: its figures are the measured ones (format and
arithmetic, never speed), computed from hand-made outcomes."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn
from torch.utils.data import TensorDataset

from phalanx import Config
from tests.helpers.cli import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import compare  # noqa: E402
from peers import common, summary  # noqa: E402
from peers.driver import CONTENDERS, Contender, NoConfigFile, Outcome, config_file  # noqa: E402
from peers.report import render  # noqa: E402
from peers.targets import TASKS, Task, chain_accuracies, chain_table, chain_tokens, hits  # noqa: E402
from peers.workloads import token_loss  # noqa: E402


def _outcome(contender: str, nproc: int, rate: float | None, loss: float = 1.0, error: str | None = None) -> Outcome:
    result = None
    if rate is not None:
        figures = {
            "title": "t",
            "global_batch": 64 * nproc,
            "samples_per_s": rate,
            "step_time_median_s": 0.01,
            "final_loss": loss,
            "choices": {"micro_batch": 64, "accumulation": 1, "precision": "fp32"},
        }
        result = {"threads_per_process": 1, "workloads": {"mlp": figures}}
    return Outcome(contender, nproc, 0, 1.0, result, error, 0 if error is None else 2, "log")


def test_ratios_scaling_and_failures_from_the_figures():
    outcomes = [
        _outcome("raw", 1, 100.0),
        _outcome("raw", 1, 300.0),
        _outcome("raw", 1, 200.0),
        _outcome("phalanx", 1, 190.0),
        _outcome("phalanx", 1, 210.0),
        _outcome("raw", 2, 300.0),
        _outcome("phalanx", 2, 297.0),
        _outcome("fabric", 2, 310.0),
        _outcome("phalanx-preset", 1, None, error="preset: unknown key"),
    ]
    rows = summary.throughput_rows(outcomes, ["mlp"], ["raw", "phalanx", "phalanx-preset", "fabric"], [1, 2])
    by = {(r["contender"], r["nproc"]): r for r in rows}
    assert by[("raw", 1)]["samples_per_s"] == 200.0 and by[("raw", 1)]["spread"] == pytest.approx(1.0)
    assert by[("phalanx", 1)]["ratio_to_raw"] == pytest.approx(1.0)
    assert by[("phalanx", 2)]["ratio_to_raw"] == pytest.approx(0.99)
    assert by[("phalanx", 2)]["scaling_efficiency"] == pytest.approx(297 / (2 * 200))
    assert by[("fabric", 2)]["scaling_efficiency"] is None  # no 1-process figure to scale from
    assert (
        by[("phalanx-preset", 1)]["errors"] == ["preset: unknown key"]
        and "samples_per_s" not in by[("phalanx-preset", 1)]
    )

    lines = summary.readings(rows)["mlp"]
    assert lines[1].startswith(
        "2 processes: phalanx defaults run at 0.990x raw DDP's samples/s (target: at most 2% slower, met; one run each"
    )
    assert "0.958x Lightning Fabric (target: not slower, 2% allowed for noise, missed)" in lines[1]
    assert "spread over 2 runs: raw 100%, phalanx 10%" in lines[0]

    markdown = render(
        {
            "throughput": {
                "date": "d",
                "machine": {"cpu": "c", "cores": 2, "os": "o", "gpu": "none", "versions": {}},
                "command": "cmd",
                "settings": "s",
                "workloads": ["mlp"],
                "rows": rows,
                "readings": summary.readings(rows),
                "failures": ["phalanx-preset x1: preset: unknown key"],
                "launches": [],
            }
        }
    )
    assert "| phalanx preset=throughput | 1 | | | failed | | | | | | preset: unknown key |" in markdown
    assert "- phalanx-preset x1: preset: unknown key" in markdown


def test_raw_loop_applies_phalanxs_lr_rule(monkeypatch):
    """The raw loop's hand-written LambdaLR follows phalanx's scaling and warm-up step for step."""
    from compare import raw_lr_args
    from peers.common import lr_rule, parse_args

    from phalanx.config.schema import OptimConfig
    from phalanx.runtime.lr import LRScaling

    for rule, warmup, start in (("linear", 5, None), ("sqrt", 3, 0.25), ("none", 0, None), ("linear", 0, None)):
        optim = OptimConfig(lr_scaling=rule, warmup_steps=warmup, warmup_start_factor=start)
        args = raw_lr_args(optim, 256, 64)
        monkeypatch.setattr(sys, "argv", ["w", "--contender", "raw", "--result", "r", *args])
        by_hand = lr_rule(parse_args())
        expected = LRScaling(rule, 256, 64, warmup, start)
        for step in range(8):
            assert (by_hand(step) if by_hand else 1.0) == pytest.approx(expected.multiplier(step))


def test_contenders_take_turns():
    from compare import rotated

    order = [rotated(["a", "b", "c"], k) for k in range(4)]
    assert order == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def _target(contender: str, seconds: float, reached: bool = True) -> Outcome:
    task = {
        "task": "digits",
        "title": "t",
        "target_accuracy": 0.98,
        "reached": reached,
        "seconds": seconds,
        "eval_seconds": 0.5,
        "samples": 1000,
        "final_accuracy": 0.98 if reached else 0.9,
        "curve": [],
        "choices": {},
    }
    return Outcome(
        contender, 2, 0, seconds + 5, {"threads_per_process": 1, "task": task}, None, 0, "log", unit="digits"
    )


def test_time_to_target_ratio_only_when_every_run_reached():
    outcomes = [
        _target("raw", 10.0),
        _target("raw", 12.0),
        _target("raw", 14.0),
        _target("phalanx-preset", 6.0),
        _target("phalanx-preset", 9.0),
    ]
    rows = summary.target_rows(outcomes, ["digits"], ["raw", "phalanx-preset"], [2])
    by = {r["contender"]: r for r in rows}
    assert by["raw"]["seconds"] == 12.0 and by["phalanx-preset"]["seconds"] == 7.5
    assert by["phalanx-preset"]["ratio_to_raw"] == pytest.approx(7.5 / 12.0)
    assert summary.target_readings(rows) == [
        "digits, 2 processes: phalanx preset=throughput reaches accuracy 0.98 in 0.62x the raw DDP loop's time (7.5 s "
        "against 12.0 s); never above 1.0x: met.",
        "over all tasks (digits): never above 1.0x for every phalanx contender: met.",
    ]
    missed = summary.target_rows(
        [*outcomes, _target("phalanx-preset", 30.0, reached=False)], ["digits"], ["raw", "phalanx-preset"], [2]
    )
    assert {r["contender"]: r["ratio_to_raw"] for r in missed}["phalanx-preset"] is None


# --- time to target, issue 13: config files per contender, skipped contenders, the GPT task's
# token accuracy, the loop's counting under a changing batch, the verdicts on the issue's targets


def _read(path: str | None) -> dict | None:
    return None if path is None else yaml.safe_load(Path(path).read_text(encoding="utf-8"))


# --- config files --------------------------------------------------------------------------------


def test_each_config_file_reaches_its_own_contender_only(tmp_path):
    tuned, timed = tmp_path / "tuned.yaml", tmp_path / "time.yaml"
    tuned.write_text("preset: throughput\nbatch:\n  micro_batch_size: 512\n", encoding="utf-8")
    timed.write_text("batch:\n  micro_batch_size: 32\n", encoding="utf-8")
    files = {"--tuned-config": {None: str(tuned)}, "--time-config": {None: str(timed)}}
    out = tmp_path / "out"
    out.mkdir()
    digits = TASKS["digits"]

    assert _read(config_file(CONTENDERS["phalanx-tuned"], files, out, digits)) == {
        "preset": "throughput",
        "batch": {"micro_batch_size": 512},
    }
    assert _read(config_file(CONTENDERS["phalanx-time"], files, out, digits)) == {"batch": {"micro_batch_size": 32}}
    # The others never see either file.
    assert config_file(CONTENDERS["phalanx"], files, out, digits) is None
    assert config_file(CONTENDERS["raw"], files, out, digits) is None
    assert _read(config_file(CONTENDERS["phalanx-preset"], files, out, None)) == {"preset": "throughput"}
    # The adaptive contender: phalanx defaults plus batch.adaptive, adapt_every per task; the tuned
    # file has no micro-batch limit, so nothing of it reaches this contender.
    for name, task in TASKS.items():
        assert _read(config_file(CONTENDERS["phalanx-adaptive"], files, out, task)) == {
            "batch": {"adaptive": "goodput", "adapt_every": task.adapt_every}
        }, name
    # With one, the limit alone: the memory a forward may use, as the throughput tune found it.
    tuned.write_text("preset: throughput\nbatch:\n  max_micro_batch_size: 512\n  global_batch_size: 1024\n")
    assert _read(config_file(CONTENDERS["phalanx-adaptive"], files, out, digits)) == {
        "batch": {"adaptive": "goodput", "adapt_every": digits.adapt_every, "max_micro_batch_size": 512}
    }
    assert _read(config_file(CONTENDERS["phalanx-adaptive"], {}, out, None)) == {"batch": {"adaptive": "goodput"}}
    # The scheduled contender: phalanx defaults plus the task's batch.schedule, and the same limit.
    assert _read(config_file(CONTENDERS["phalanx-schedule"], files, out, digits)) == {
        "batch": {"schedule": digits.schedule, "max_micro_batch_size": 512}
    }
    for name, task in TASKS.items():  # every task's schedule is one the config accepts
        assert Config.load(batch={"schedule": task.schedule}).batch.schedule == task.schedule, name


def test_per_task_files_and_entries_merge_into_the_files_sections(tmp_path):
    for task in ("digits", "teacher"):
        (tmp_path / f"{task}.yaml").write_text(f"batch:\n  micro_batch_size: {len(task)}\n", encoding="utf-8")
    files = {"--time-config": {"digits": str(tmp_path / "digits.yaml"), "teacher": str(tmp_path / "teacher.yaml")}}
    both = Contender(
        "both",
        "both",
        "phalanx",
        "phalanx_run.py",
        settings=(("batch.adaptive", "goodput"),),
        config_option="--time-config",
        task_settings=(("batch.adapt_every", "adapt_every"),),
    )
    written = config_file(both, files, tmp_path, TASKS["teacher"])
    assert written.endswith("both-teacher.yaml")
    assert _read(written) == {"batch": {"micro_batch_size": 7, "adaptive": "goodput", "adapt_every": 50}}
    assert _read(config_file(CONTENDERS["phalanx-time"], files, tmp_path, TASKS["digits"])) == {
        "batch": {"micro_batch_size": 6}
    }
    with pytest.raises(NoConfigFile, match="phalanx-time: skipped on gpt, --time-config names no file for it"):
        config_file(CONTENDERS["phalanx-time"], files, tmp_path, TASKS["gpt"])
    with pytest.raises(NoConfigFile, match="phalanx-tuned: skipped, no --tuned-config given"):
        config_file(CONTENDERS["phalanx-tuned"], files, tmp_path, TASKS["gpt"])


def test_contenders_without_their_config_option_are_skipped_with_a_line(tmp_path, capsys):
    args = compare.parse_args(["--time-to-target"])
    assert args.contenders == ["raw", "phalanx", "phalanx-adaptive", "phalanx-schedule"]
    assert args.skipped == [
        "phalanx-tuned: skipped, no --tuned-config given",
        "phalanx-time: skipped, no --time-config given",
    ]
    assert args.tasks == ["digits", "teacher", "gpt"]

    args = compare.parse_args(["--time-to-target", "--tuned-config", "t.yaml"])
    assert args.contenders == ["raw", "phalanx", "phalanx-tuned", "phalanx-adaptive", "phalanx-schedule"]
    assert args.files == {"--tuned-config": {None: "t.yaml"}}
    assert args.skipped == ["phalanx-time: skipped, no --time-config given"]

    args = compare.parse_args(
        [
            "--time-to-target",
            "--tasks",
            "digits,gpt",
            "--time-config",
            "digits=d.yaml,gpt=g.yaml",
            "--tuned-config",
            "t",
        ]
    )
    assert args.files["--time-config"] == {"digits": "d.yaml", "gpt": "g.yaml"} and args.skipped == []

    # The throughput mode is as it was.
    args = compare.parse_args([])
    assert args.contenders == compare.THROUGHPUT_CONTENDERS.split(",") and args.skipped == [] and args.files == {}

    with pytest.raises(SystemExit):
        compare.parse_args(["--time-to-target", "--time-config", "digits=d.yaml"])
    assert "--time-config names no file for teacher, gpt; give task=FILE for each task run" in capsys.readouterr().err


@pytest.mark.parametrize("together", [True, False], ids=["taking turns", "one at a time"])
def test_run_all_launches_each_contender_with_its_own_file(tmp_path, monkeypatch, together):
    (tmp_path / "tuned.yaml").write_text("batch:\n  micro_batch_size: 512\n", encoding="utf-8")
    given = [
        "--time-to-target",
        "--tasks",
        "digits,gpt",
        "--repeats",
        "1",
        "--tuned-config",
        str(tmp_path / "tuned.yaml"),
    ]
    args = compare.parse_args(given + ([] if together else ["--one-at-a-time"]))
    launched, groups = [], []

    def fake_launch(contender, n, repeat, run_dir, worker_args, *, timeout, config_file=None):
        launched.append((contender.name, worker_args[1], _read(config_file)))
        return Outcome(contender.name, n, repeat, 1.0, {"task": {}}, None, 0, "log")

    def fake_together(specs, n, repeat, directory, *, timeout):
        groups.append({s.worker_args[1] for s in specs})  # one group per task: every contender of it at once
        return [
            fake_launch(s.contender, n, repeat, s.run_dir, s.worker_args, timeout=timeout, config_file=s.config_file)
            for s in specs
        ]

    monkeypatch.setattr(compare, "launch", fake_launch if not together else None)
    monkeypatch.setattr(compare, "launch_together", fake_together if together else None)
    monkeypatch.setattr(compare, "_progress", lambda *a: "")
    outcomes, failures = compare.run_all(args, tmp_path, lambda contender, unit, n: ["--task", unit])
    assert failures == []
    assert sorted(launched, key=str) == sorted(
        [
            ("raw", "digits", None),
            ("phalanx", "digits", None),
            ("phalanx-tuned", "digits", {"batch": {"micro_batch_size": 512}}),
            ("phalanx-adaptive", "digits", {"batch": {"adaptive": "goodput", "adapt_every": 10}}),
            ("phalanx-schedule", "digits", {"batch": {"schedule": "x2@35,x4@70"}}),
            ("raw", "gpt", None),
            ("phalanx", "gpt", None),
            ("phalanx-tuned", "gpt", {"batch": {"micro_batch_size": 512}}),
            ("phalanx-adaptive", "gpt", {"batch": {"adaptive": "goodput", "adapt_every": 40}}),
            ("phalanx-schedule", "gpt", {"batch": {"schedule": "x2@150,x4@300"}}),
        ],
        key=str,
    )
    assert {o.unit for o in outcomes} == {"digits", "gpt"}
    assert groups == ([{"digits"}, {"gpt"}] if together else [])


# --- the GPT task's accuracy ---------------------------------------------------------------------


def test_token_accuracy_scores_every_position():
    # (B=2, T=3, V=4) logits against (2, 3) next tokens: 4 of 6 positions right.
    logits = torch.zeros(2, 3, 4)
    predicted = torch.tensor([[0, 1, 2], [3, 3, 0]])
    logits.scatter_(2, predicted.unsqueeze(-1), 1.0)
    target = torch.tensor([[0, 1, 3], [3, 2, 0]])
    assert hits(logits, target) == (4, 6)
    # A classifier's (B, C) logits against (B,) labels: per sample, as before.
    assert hits(torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]]), torch.tensor([1, 1, 1])) == (2, 3)


class _Echo(nn.Module):
    """Predicts that each token is followed by itself."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return nn.functional.one_hot(tokens, 5).float()


def test_held_out_accuracy_is_per_token_for_a_language_model():
    x = torch.tensor([[1, 2, 3, 4], [0, 0, 1, 1]])
    y = torch.tensor([[1, 0, 3, 0], [0, 0, 0, 1]])  # 2 + 3 of 8 tokens repeat the input
    assert common._accuracy(_Echo(), TensorDataset(x, y)) == pytest.approx(5 / 8)


def test_gpt_target_lies_between_one_token_of_context_and_the_bayes_accuracy():
    bayes, one_token = chain_accuracies()
    assert bayes == pytest.approx(0.336, abs=5e-4) and one_token == pytest.approx(0.139, abs=5e-4)
    target = TASKS["gpt"].target
    assert one_token < target < bayes - 10 * 0.0036  # the task's comment: over 10 held-out standard errors
    train, held_out = TASKS["gpt"].data()
    assert held_out.tensors[1].numel() == 16384 and len(train) == 32768
    assert TASKS["gpt"].loss is token_loss and TASKS["gpt"].eval_every % (TASKS["gpt"].micro_batch * 2) == 0


def test_gpt_task_chain_follows_its_table_from_the_third_token():
    x, y = chain_tokens(8, 5).tensors
    table = chain_table()
    tokens = torch.cat([x, y[:, -1:]], dim=1)
    assert x.shape == y.shape == (8, 64) and torch.equal(x[:, 1:], y[:, :-1])
    for t in range(2, tokens.shape[1]):
        follows = (table[tokens[:, t - 2], tokens[:, t - 1]] == tokens[:, t : t + 1]).any(dim=1)
        assert bool(follows.all())


# --- the time-to-target loop's counting ----------------------------------------------------------


def _loop_args(**extra) -> argparse.Namespace:
    base = dict(task="tiny", contender="raw", target=2.0, eval_every=8, max_samples=88, max_seconds=30.0)
    base.update(turn_seconds=1.0)
    base.update(lr_scale=1.0, warmup_steps=0, warmup_start=0.0)
    return argparse.Namespace(**{**base, **extra})


def _tiny_task() -> Task:
    data = TensorDataset(torch.randn(64, 3), torch.randint(0, 2, (64,)))
    return Task("tiny", "t", 4, 4, lambda: nn.Linear(3, 2), lambda: (data, data), torch.optim.SGD, 2.0, 8, 40)


def test_evaluations_fall_on_step_boundaries_of_a_changing_batch(monkeypatch):
    """Micro-batches of 4 rows; the optimizer steps after 1, then 2, then 4, then 1 micro-steps
    again (as batch.adaptive's k would). Samples count the rows trained; each evaluation comes at
    the first step boundary at or past a multiple of eval_every, once per multiple crossed, and
    does not fall behind once the batch shrinks again."""
    monkeypatch.setattr(common, "TASKS", {"tiny": _tiny_task()})
    schedule = [1, 1, 2, 2, 4, 4, 4, 1, 1, 1, 1]  # micro-steps per optimizer step
    boundaries = set()
    total = 0
    for steps in schedule:
        total += steps
        boundaries.add(total)
    taken = []

    def prepare(job):
        rows = [(torch.randn(4, 3), torch.randint(0, 2, (4,))) for _ in range(total)]
        return common.Prepared(
            nn.Linear(3, 2),
            rows,
            lambda x, y: taken.append(len(x)),
            lambda epoch: None,
            4,
            stepped=lambda: len(taken) in boundaries,
        )

    result = common._to_target(_loop_args(), prepare, 1)
    # Step boundaries at samples 4, 8, 16, 24, 40, 56, 72, 76, 80, 84, 88; eval_every 8.
    assert [p["samples"] for p in result["curve"]] == [8, 16, 24, 40, 56, 72, 80, 88]
    assert result["samples"] == sum(taken) == 88 and not result["reached"]


def test_a_loader_that_yields_nothing_ends_the_loop_at_once(monkeypatch):
    """phalanx's train.max_steps ends its loaders (a `phalanx tune` trial): the loop stops instead
    of waiting for --max-seconds."""
    monkeypatch.setattr(common, "TASKS", {"tiny": _tiny_task()})

    def prepare(job):
        return common.Prepared(nn.Linear(3, 2), [], lambda x, y: None, lambda epoch: None, 4)

    began = time.perf_counter()
    result = common._to_target(_loop_args(), prepare, 1)
    assert time.perf_counter() - began < 5 and result["samples"] == 0 and not result["reached"]


def test_taking_turns_the_clock_leaves_out_the_waits_and_a_turn_ends_at_an_evaluation(monkeypatch):
    """Set-up waits for a turn; then a turn ends at the first evaluation past --turn-seconds (0
    here: every evaluation), and the time spent waiting is in no figure."""
    monkeypatch.setattr(common, "TASKS", {"tiny": _tiny_task()})
    waits = []

    class Waiting:
        def wait(self):
            waits.append(len(taken))
            time.sleep(0.3)

    monkeypatch.setattr(common, "_turns", lambda contender: Waiting())
    taken = []

    def prepare(job):
        rows = [(torch.randn(4, 3), torch.randint(0, 2, (4,))) for _ in range(22)]
        return common.Prepared(nn.Linear(3, 2), rows, lambda x, y: taken.append(len(x)), lambda epoch: None, 1)

    began = time.perf_counter()
    result = common._to_target(_loop_args(turn_seconds=0.0), prepare, 1)
    wall = time.perf_counter() - began
    # Evaluations at 8, 16, ..., 88 samples: a turn ends after each but the last (the loop ends there).
    assert waits == [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20]
    assert result["seconds"] < wall - 0.3 * len(waits) + 0.2
    assert all(a["seconds"] <= b["seconds"] for a, b in zip(result["curve"], result["curve"][1:]))
    assert result["curve"][-1]["seconds"] < 0.3


# --- verdicts ------------------------------------------------------------------------------------


def _run(contender: str, task: str, seconds: float, reached: bool = True) -> Outcome:
    figures = {
        "task": task,
        "title": task,
        "target_accuracy": 0.5,
        "reached": reached,
        "seconds": seconds,
        "eval_seconds": 0.1,
        "samples": 1000,
        "final_accuracy": 0.5 if reached else 0.4,
        "curve": [],
        "choices": {},
    }
    return Outcome(contender, 2, 0, seconds + 5, {"threads_per_process": 1, "task": figures}, None, 0, "log", unit=task)


CONTENDER_LIST = ["raw", "phalanx", "phalanx-tuned", "phalanx-time", "phalanx-adaptive"]


def test_verdicts_on_the_issues_targets():
    seconds = {  # per task: raw, phalanx, tuned (throughput), time, adaptive
        "digits": (10.0, 10.5, 19.6, 5.5, 7.0),
        "teacher": (50.0, 49.0, 49.5, 35.0, 25.0),
        "gpt": (20.0, 20.0, 18.0, 16.0, None),  # adaptive missed the target
    }
    outcomes = [
        _run(name, task, s if s is not None else 240.0, reached=s is not None)
        for task, figures in seconds.items()
        for name, s in zip(CONTENDER_LIST, figures)
    ]
    rows = summary.target_rows(outcomes, list(seconds), CONTENDER_LIST, [2])
    lines = summary.target_readings(rows)
    assert lines[:5] == [
        "digits, 2 processes: phalanx defaults reaches accuracy 0.5 in 1.05x the raw DDP loop's time (10.5 s against "
        "10.0 s); never above 1.0x: not met.",
        "digits, 2 processes: phalanx tuned (throughput) reaches accuracy 0.5 in 1.96x the raw DDP loop's time (19.6 s "
        "against 10.0 s); never above 1.0x: not met.",
        "digits, 2 processes: phalanx tuned (time) reaches accuracy 0.5 in 0.55x the raw DDP loop's time (5.5 s "
        "against 10.0 s); never above 1.0x: met.",
        "digits, 2 processes: phalanx adaptive reaches accuracy 0.5 in 0.70x the raw DDP loop's time (7.0 s against "
        "10.0 s); never above 1.0x: met.",
        "digits, 2 processes: at most 0.6x the raw loop's time (phalanx tuned for time, adaptive or scheduled, "
        "the best): "
        "phalanx tuned (time) at 0.55x, met.",
    ]
    assert (
        "teacher, 2 processes: at most 0.6x the raw loop's time (phalanx tuned for time, adaptive or scheduled, "
        "the best): "
        "phalanx adaptive at 0.50x, met." in lines
    )
    assert (
        "gpt, 2 processes: phalanx adaptive: no ratio (it reached the target in 0 of 1 runs); never above 1.0x: "
        "not met." in lines
    )
    assert (
        "gpt, 2 processes: at most 0.6x the raw loop's time (phalanx tuned for time, adaptive or scheduled, "
        "the best): "
        "phalanx tuned (time) at 0.80x, not met." in lines
    )
    assert lines[-2:] == [
        "over all tasks (digits, teacher, gpt): at most 0.6x on every task: not met (missed on gpt x2).",
        "over all tasks (digits, teacher, gpt): never above 1.0x for every phalanx contender: not met, phalanx "
        "defaults (digits: 1.05x); phalanx tuned (throughput) (digits: 1.96x); phalanx adaptive (gpt: no ratio).",
    ]


def test_verdicts_when_every_target_is_met_and_when_neither_goodput_contender_ran():
    outcomes = [
        _run(name, task, s)
        for task in ("digits", "teacher")
        for name, s in zip(CONTENDER_LIST, (10.0, 9.9, 8.0, 5.0, 6.0))
    ]
    lines = summary.target_readings(summary.target_rows(outcomes, ["digits", "teacher"], CONTENDER_LIST, [2]))
    assert lines[-2:] == [
        "over all tasks (digits, teacher): at most 0.6x on every task: met.",
        "over all tasks (digits, teacher): never above 1.0x for every phalanx contender: met.",
    ]
    # Only the time-tuned contender ran, and failed on teacher: not met there, with the reason.
    failed = Outcome("phalanx-time", 2, 0, 1.0, None, "exit code 2: bad config", 2, "log", unit="teacher")
    outcomes = [_run("raw", "teacher", 10.0), failed]
    lines = summary.target_readings(summary.target_rows(outcomes, ["teacher"], ["raw", "phalanx-time"], [2]))
    assert lines == [
        "teacher, 2 processes: phalanx tuned (time): no ratio (no run finished: exit code 2: bad config); never above "
        "1.0x: not met.",
        "teacher, 2 processes: at most 0.6x the raw loop's time (phalanx tuned for time, adaptive or scheduled, "
        "the best): not "
        "met, no ratio for phalanx tuned (time).",
        "over all tasks (teacher): at most 0.6x on every task: not met (missed on teacher x2).",
        "over all tasks (teacher): never above 1.0x for every phalanx contender: not met, phalanx tuned (time) "
        "(teacher: no ratio).",
    ]


def test_a_negative_turn_length_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        compare.parse_args(["--time-to-target", "--turn-seconds", "-1"])
    assert exit_.value.code == 2
    assert "--turn-seconds must be 0 or more, got -1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, to_docs",
    [
        ([], True),
        (["--time-to-target"], True),
        (["--contenders", "raw,phalanx"], True),  # every workload still: the section stays whole
        (["--workloads", "conv"], False),
        (["--time-to-target", "--tasks", "digits"], False),
        (["--quick"], False),
        (["--steps", "100"], False),
        (["--warmup", "1"], False),
    ],
)
def test_a_partial_run_does_not_replace_the_published_section(argv, to_docs, capsys):
    """A run of one workload wrote its one table over docs/benchmarks.md's whole throughput section."""
    args = compare.parse_args(argv)
    assert (args.out == "docs") is to_docs
    if not to_docs:
        assert Path(args.out).is_dir() and "not docs/" in capsys.readouterr().out
        Path(args.out).rmdir()
    assert compare.parse_args([*argv, "--out", "docs"]).out == "docs"


def test_a_refused_partial_run_makes_no_output_directory(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(compare.tempfile, "tempdir", str(tmp_path))
    with pytest.raises(SystemExit):
        compare.parse_args(["--workloads", "nonesuch"])
    captured = capsys.readouterr()
    assert "unknown workload nonesuch" in captured.err and "partial run" not in captured.out
    assert list(tmp_path.iterdir()) == []
