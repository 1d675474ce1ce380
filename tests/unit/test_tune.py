"""`phalanx tune`: the search and the choices on fake trial results, the memory cap on CPU, reading
a trial's outcome, writing the config file, and bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from phalanx.cli.main import main
from phalanx.config import Config
from phalanx.config.batch import BatchPlan
from phalanx.errors import ConfigError
from phalanx.harness.launching import LaunchRun
from phalanx.runtime.memory_cap import MemoryCap
from phalanx.session.facts import write_run_facts
from phalanx.tune import search
from phalanx.tune.config_file import edit_yaml, write_values
from phalanx.tune.runner import TuneOptions
from phalanx.tune.trials import FAILED, OK, OOM, Announced, Settings, Trial, announced, code_settings, conclude

MIB = 2**20


# ---------------------------------------------------------------- micro-batch search


def _counting(limit: int):
    asked: list[int] = []

    def fits(size: int) -> bool:
        asked.append(size)
        return size <= limit

    return fits, asked


@pytest.mark.parametrize("start", [1, 3, 8, 40])
def test_doubling_and_bisection_find_exactly_the_largest_that_fits(start):
    candidates = search.micro_candidates(16, start, keep_global=False, most=64)  # 1, 2, 4, 8, 16, 17, 18, ..., 64
    for limit in range(1, 65):
        fits, asked = _counting(limit)
        assert search.largest_fitting(candidates, start, fits) == max(c for c in candidates if c <= limit)
        assert len(asked) == len(set(asked)), asked  # no size tried twice
        assert len(asked) <= 2 * math.ceil(math.log2(64)) + 1, (limit, asked)


def test_a_start_that_does_not_fit_halves_then_bisects():
    candidates = search.micro_candidates(64, 64, keep_global=True, most=64)  # the divisors 1, 2, 4, ..., 64
    fits, asked = _counting(5)
    assert search.largest_fitting(candidates, 64, fits) == 4
    assert asked == [64, 32, 16, 8, 4]
    candidates = list(range(1, 25))
    fits, asked = _counting(13)
    assert search.largest_fitting(candidates, 24, fits) == 13
    assert asked[:2] == [24, 12] and len(asked) <= 6


def test_nothing_fits():
    fits, asked = _counting(0)
    assert search.largest_fitting([1, 2, 4], 4, fits) is None
    assert asked == [4, 2, 1]


def test_candidates_keep_the_global_batch_unless_allowed():
    # 48 samples per process: only divisors keep the global batch (the accumulation steps change).
    assert search.micro_candidates(48, 3, keep_global=True, most=48) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]
    assert search.micro_candidates(48, 3, keep_global=True, most=10) == [1, 2, 3, 4, 6, 8]
    allowed = search.micro_candidates(8, 8, keep_global=False, most=12)
    assert allowed == [1, 2, 4, 8, 9, 10, 11, 12]
    assert search.micro_candidates(16, 8, keep_global=True, most=16, multiple_of=4) == [4, 8, 16]
    assert search.global_batch_for(4, 64, 2) == 64  # 4 divides 32 per process: 8 accumulation steps
    assert search.global_batch_for(48, 64, 2) == 96  # past the share: one micro-batch per process


def test_a_change_must_measure_faster_than_the_noise():
    m = search.Measured
    assert search.fastest([m(8, 100.0), m(16, 102.0), m(32, None)], current=8).value == 8
    assert search.fastest([m(8, 100.0), m(16, 110.0)], current=8).value == 16
    assert search.fastest([m(8, None), m(4, 50.0), m(2, 60.0)], current=8).value == 2  # the current one did not fit
    assert search.fastest([m(8, None)], current=8) is None


def test_a_change_is_confirmed_by_a_second_pair_of_trials():
    assert search.confirmed(100.0, 104.0) and not search.confirmed(100.0, 102.0)
    assert not search.confirmed(None, 200.0) and not search.confirmed(
        100.0, None
    )  # a repeat that failed confirms nothing


def test_workers_stop_once_the_data_wait_is_gone_and_the_fewest_that_lower_it_win():
    m = search.Measured
    assert not search.stop_adding_workers(m(0, 100.0, 0.40))
    assert search.stop_adding_workers(m(2, 150.0, 0.01))
    assert search.stop_adding_workers(m(3, None))  # a failed trial: more workers will not help
    assert (
        search.choose_workers([m(0, 100.0, 0.40), m(1, 149.0, 0.05), m(2, 150.0, 0.01)]).value == 2
    )  # the wait is gone
    assert search.choose_workers([m(0, 100.0, 0.02), m(1, 150.0, 0.01)]).value == 0  # already gone: faster is noise
    assert search.choose_workers([m(0, 100.0, 0.4), m(1, 200.0, 0.2), m(2, None)]).value == 1  # the lowest wait
    assert search.choose_workers([m(0, 416.0, 0.05), m(1, 441.0, 0.06)]).value == 0  # a worker that does not lower it
    assert search.choose_workers([m(0, None), m(1, None)]) is None
    assert search.worker_counts(4) == [0, 1, 2, 3, 4] and search.worker_counts(0) == [0, 1]
    assert search.bucket_sizes(25.0) == [10.0, 25.0, 50.0, 100.0] and search.bucket_sizes(40) == [
        10.0,
        25.0,
        40.0,
        50.0,
        100.0,
    ]


def test_bucket_sizes_that_hold_every_gradient_in_one_bucket_behave_alike():
    assert search.bucket_sizes(25.0, gradient_mib=500.0) == [10.0, 25.0, 50.0, 100.0]
    assert search.bucket_sizes(25.0, gradient_mib=40.0) == [10.0, 25.0, 50.0]  # 50 and 100: one bucket each
    assert search.bucket_sizes(100.0, gradient_mib=40.0) == [10.0, 25.0, 100.0]  # the current one stands for them
    assert search.bucket_sizes(25.0, gradient_mib=0.1) == [25.0]  # nothing to tune


def test_a_larger_global_batch_brings_the_learning_rate_rule():
    assert search.lr_settings(64, 64, rule="none", reference=None, warmup_steps=0) == {}
    values = search.lr_settings(64, 256, rule="none", reference=None, warmup_steps=0)
    assert values == {
        "batch.global_batch_size": 256,
        "optim.lr_scaling": "sqrt",
        "optim.reference_batch_size": 64,
        "optim.warmup_steps": 100,
    }
    assert search.lr_multiplier(values) == 2.0
    kept = search.lr_settings(64, 256, rule="linear", reference=32, warmup_steps=500)
    assert (
        kept["optim.lr_scaling"] == "linear"
        and kept["optim.reference_batch_size"] == 32
        and kept["optim.warmup_steps"] == 500
    )
    assert search.lr_multiplier(kept) == 8.0


# ---------------------------------------------------------------- the memory cap


def test_memory_cap_on_cpu_raises_torch_out_of_memory_past_the_cap():
    cap = MemoryCap(64 * MIB, torch.device("cpu"))
    cap.start()
    small = torch.ones(8 * MIB // 4)  # ones, not zeros: pages must be written to be resident
    cap.check()
    del small
    # 2 MiB over what is asserted: with the cap, freed blocks go back to the kernel at once
    # (track_live_memory), so memory other code frees meanwhile lowers the resident size a little.
    big = torch.ones(130 * MIB // 4)
    del big  # freed again: the peak is what counts
    with pytest.raises(torch.OutOfMemoryError, match="train.memory_cap 64.0 MiB"):
        cap.check()
    assert cap.used_bytes() >= 128 * MIB
    cap.start()  # counting starts again from here
    cap.check()


def test_the_session_announces_the_gradient_size_tune_reads():
    from phalanx.session.facts import describe_model_size

    frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    assert (
        describe_model_size([torch.nn.Linear(1024, 1024), frozen])
        == "1,049,600 trainable parameters (4.0 MiB of gradients)"
    )
    assert describe_model_size([torch.nn.Linear(8, 16)]) == "144 trainable parameters (576 B of gradients)"


def test_memory_cap_config():
    assert Config.load(overrides=["train.memory_cap=2GiB"]).train.memory_cap == "2GiB"
    assert Config.load(overrides=["train.memory_cap=1048576"]).train.memory_cap == 1048576
    assert Config.load().train.memory_cap is None
    for bad in ("lots", "0", "-5"):
        with pytest.raises(ConfigError, match="train.memory_cap"):
            Config.load(overrides=[f"train.memory_cap={bad}"])
    assert MemoryCap.create(None, torch.device("cpu")) is None
    assert MemoryCap.create("1.5GiB", torch.device("cpu")).cap_bytes == int(1.5 * 2**30)


# ---------------------------------------------------------------- reading a trial


def _write_session_facts(run_dir: Path, gradient_bytes: int) -> None:
    """What the Session of a ddp run on 2 processes writes at setup, with micro-batch 8 set in code."""
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.empty(gradient_bytes // 4, device="meta"))  # sizes without memory
    write_run_facts(
        run_dir,
        strategy="ddp",
        strategy_description="ddp over 2 processes",
        device="cpu",
        precision="fp32",
        batch=BatchPlan(16, 8, 1, 2),
        models=[model],
        lr_scaling=None,
        config_sources={"batch.micro_batch_size": "code", "batch.global_batch_size": "default"},
    )


def _fake_run(
    tmp_path: Path, *, code: int, stopped: bool, logs: dict[int, str], launcher: str = "", metrics: int = 0
) -> LaunchRun:
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    _write_session_facts(run_dir, int(3.5 * MIB))
    for rank, text in logs.items():
        (run_dir / "logs" / f"rank{rank}.log").write_text(text)
    (run_dir / "metrics").mkdir()
    for rank in logs:
        records = [
            {"step": s, "step_time": 0.1, "data_wait": 0.02, "samples": 16, "peak_mem_bytes": 5 * MIB}
            for s in range(1, metrics + 1)
        ]
        (run_dir / "metrics" / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    log = tmp_path / "launch.log"
    log.write_text(launcher)
    return LaunchRun(code, stopped, metrics, 3.0, log, run_dir)


def _trial():
    return Trial(1, "micro-batch", Settings(8, 16), "micro-batch 8")


def test_out_of_memory_on_one_rank_is_the_outcome_even_when_another_rank_is_blamed(tmp_path):
    announce = (
        "phalanx: ddp over 2 processes | 1,234 trainable parameters (3.5 MiB of gradients) | "
        "global batch 16 = micro batch 8 x 1 accumulation step x 2 processes\n"
    )
    run = _fake_run(
        tmp_path,
        code=1,
        stopped=False,
        logs={
            0: announce + "RuntimeError: Connection closed by peer\n",
            1: "Traceback ...\ntorch.OutOfMemoryError: phalanx memory cap: ...\n",
        },
        launcher="phalanx: rank 0 failed first (exit code 1): RuntimeError: Connection closed by peer\n",
    )
    trial = conclude(_trial(), run, nproc=2, warmup=1, steps=5)
    assert (trial.outcome, trial.detail) == (OOM, "rank 1")
    assert trial.describe_outcome() == "out of memory (rank 1)"
    assert announced(run.run_dir) == Announced(16, 8, 2, 3.5)
    _write_session_facts(run.run_dir, 512 * 1024)
    assert announced(run.run_dir).gradient_mib == 0.5
    _write_session_facts(run.run_dir, 36)
    assert announced(run.run_dir).gradient_mib == 36 / 2**20
    assert code_settings(run.run_dir) == {"batch.micro_batch_size"}
    (run.run_dir / "session.json").unlink()  # a script that never reached session.setup()
    assert announced(run.run_dir) is None and code_settings(run.run_dir) == set()


def test_cuda_out_of_memory_text_and_other_failures(tmp_path):
    run = _fake_run(
        tmp_path / "a",
        code=1,
        stopped=False,
        logs={0: "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"},
    )
    assert conclude(_trial(), run, nproc=1, warmup=1, steps=5).outcome == OOM
    # The summary alone is enough (a rank's log may have been cut short), and a source line quoting
    # the exception in a traceback is not an out-of-memory error.
    run = _fake_run(
        tmp_path / "s",
        code=1,
        stopped=False,
        logs={0: ""},
        launcher="phalanx: rank 0 failed first (exit code 1): OutOfMemoryError: phalanx memory cap: ...\n",
    )
    assert conclude(_trial(), run, nproc=1, warmup=1, steps=5).outcome == OOM
    quoted = "Traceback:\n    except torch.OutOfMemoryError:\nValueError: bad\n"
    run = _fake_run(
        tmp_path / "b",
        code=1,
        stopped=False,
        logs={0: quoted},
        launcher="phalanx: rank 0 failed first (exit code 1): ValueError: bad\n",
    )
    trial = conclude(_trial(), run, nproc=1, warmup=1, steps=5)
    assert (trial.outcome, trial.detail) == (FAILED, "rank 0 failed first (exit code 1): ValueError: bad")
    run = _fake_run(tmp_path / "c", code=130, stopped=True, logs={0: "", 1: ""}, metrics=5)
    trial = conclude(_trial(), run, nproc=2, warmup=1, steps=5)
    assert (
        trial.outcome == OK
        and trial.samples_per_s == pytest.approx(160.0)
        and trial.data_wait_share == pytest.approx(0.2)
    )
    assert trial.figures.peak_mem_bytes == 5 * MIB


# ---------------------------------------------------------------- writing the config file


def test_the_config_file_keeps_comments_and_other_keys_and_a_backup(tmp_path):
    path = tmp_path / "phalanx.yaml"
    original = "# my settings\nbatch:\n  micro_batch_size: 3   # what I had\n\ntrain:\n  seed: 7\n# the end\n"
    path.write_text(original)
    written = write_values(
        path, {"batch.micro_batch_size": 8, "data.num_workers": 2, "strategy.ddp.bucket_cap_mb": 50.0}
    )
    text = path.read_text()
    assert (
        "  micro_batch_size: 8   # what I had\n" in text and text.startswith("# my settings\n") and "# the end" in text
    )
    assert yaml.safe_load(text) == {
        "batch": {"micro_batch_size": 8},
        "train": {"seed": 7},
        "data": {"num_workers": 2},
        "strategy": {"ddp": {"bucket_cap_mb": 50.0}},
    }
    assert (
        written.backup == tmp_path / "phalanx.yaml.bak"
        and written.backup.read_text() == original
        and written.comments_kept
    )
    config = Config.load(path)
    assert (
        config.batch.micro_batch_size,
        config.data.num_workers,
        config.strategy.ddp.bucket_cap_mb,
        config.train.seed,
    ) == (8, 2, 50.0, 7)


def test_a_flow_style_file_is_rewritten_with_its_values_and_a_missing_file_is_created(tmp_path):
    flow = tmp_path / "flow.yaml"
    flow.write_text("batch: {global_batch_size: 64}  # flow\n")
    assert edit_yaml(flow.read_text(), {"batch.micro_batch_size": 8}) != flow.read_text()
    written = write_values(flow, {"batch.micro_batch_size": 8})
    assert not written.comments_kept and (tmp_path / "flow.yaml.bak").read_text().endswith("# flow\n")
    assert yaml.safe_load(flow.read_text()) == {"batch": {"global_batch_size": 64, "micro_batch_size": 8}}
    new = tmp_path / "new.yaml"
    assert write_values(new, {"data.num_workers": 1}).backup is None
    assert Config.load(new).data.num_workers == 1


def test_a_toml_file_is_edited_in_place(tmp_path):
    path = tmp_path / "phalanx.toml"
    path.write_text("[batch]\nglobal_batch_size = 64 # tuned for this\n\n[strategy.ddp]\nbucket_cap_mb = 25\n")
    write_values(path, {"batch.micro_batch_size": 8, "strategy.ddp.bucket_cap_mb": 100.0, "optim.lr_scaling": "sqrt"})
    config = Config.load(path)
    assert (
        config.batch.global_batch_size,
        config.batch.micro_batch_size,
        config.strategy.ddp.bucket_cap_mb,
        config.optim.lr_scaling,
    ) == (64, 8, 100.0, "sqrt")
    assert "# tuned for this" in path.read_text()


# ---------------------------------------------------------------- the command


BAD_INPUT = [
    (["tune"], "give the training script to tune, or --demo"),
    (["tune", "--demo", "train.py"], "either a script or --demo"),
    (["tune", "missing.py"], "script 'missing.py' not found"),
    (["tune", "--demo", "--memory-cap", "lots"], "--memory-cap 'lots' is not a size"),
    (["tune", "--demo", "--search", "micro-batch,speed"], "--search takes"),
    (["tune", "--demo", "--steps", "3", "--warmup", "3"], "--steps must be"),
    (["tune", "--demo", "--max-micro-batch", "0"], "--max-micro-batch must be"),
]


@pytest.mark.parametrize("argv, message", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_and_exit_2_before_any_trial(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("phalanx: error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "phalanx.yaml").exists()


def test_command_repeats_the_tune():
    options = TuneOptions(
        script="train.py",
        script_args=("--lr", "1"),
        memory_cap="2GiB",
        steps=8,
        warmup=2,
        search=("micro-batch",),
        dry_run=True,
    )
    assert (
        options.command()
        == "phalanx tune --memory-cap 2GiB --steps 8 --warmup 2 --search micro-batch --dry-run train.py --lr 1"
    )
