"""`phalanx launch` as a real subprocess: torchrun scripts, output routing, failures, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.cli import EXAMPLES, call_phalanx, run_phalanx

pytestmark = pytest.mark.multiprocess


def only_run_dir(cwd: Path) -> Path:
    (run_dir,) = (cwd / "runs").iterdir()
    return run_dir


def test_plain_torchrun_script_runs_unchanged(tmp_path):
    result = run_phalanx("launch", "--cpu", "--nproc", "2", str(EXAMPLES / "torchrun_plain.py"), cwd=tmp_path)
    assert result.returncode == 0, result.output
    assert "rank 0 (local 0) of 2: sum of ranks+1 = 3" in result.stdout
    assert "rank 1 (local 1)" not in result.stdout  # rank 0 only by default
    logs = only_run_dir(tmp_path) / "logs"
    assert "rank 1 (local 1) of 2: sum of ranks+1 = 3" in (logs / "rank1.log").read_text()
    assert "rank 0 (local 0) of 2" in (logs / "rank0.log").read_text()


def test_ranks_all_prefixes_every_line(tmp_path):
    result = run_phalanx("launch", "--cpu", "--ranks", "all", str(EXAMPLES / "torchrun_plain.py"), cwd=tmp_path)
    assert result.returncode == 0, result.output
    lines = result.stdout.splitlines()
    assert "[rank 0] rank 0 (local 0) of 2: sum of ranks+1 = 3" in lines
    assert "[rank 1] rank 1 (local 1) of 2: sum of ranks+1 = 3" in lines


def test_script_arguments_and_config_reach_the_workers(tmp_path):
    script = tmp_path / "show.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import phalanx
            session = phalanx.Session()
            config = session.config
            session.print("args", sys.argv[1:], "mode", config.precision.mode, "epochs", config.train.epochs,
                          "world", session.world_size, "strategy", session.strategy.name)
            session.close()
            """
        )
    )
    (tmp_path / "my.yaml").write_text("train:\n  epochs: 7\n")
    result = run_phalanx(
        "launch",
        "--cpu",
        "--config",
        "my.yaml",
        "--set",
        "precision.mode=bf16",
        "show.py",
        "--lr",
        "3e-4",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.output
    assert "args ['--lr', '3e-4'] mode bf16 epochs 7 world 2 strategy ddp" in result.stdout
    saved = (only_run_dir(tmp_path) / "config.yaml").read_text()
    assert "mode: bf16" in saved and "epochs: 7" in saved


def test_two_jobs_at_once_do_not_collide(tmp_path):
    """Two launches of one script in one folder in the same second get run directories of their
    own. Each has its own checkpoint directory: one shared by two running jobs is refused by
    design (checkpoint/lock.py), and whether the second saw the first's depends on timing."""
    cmd = [sys.executable, "-m", "phalanx", "launch", "--cpu"]
    procs = [
        subprocess.Popen(
            [*cmd, "--set", f"checkpoint.dir=checkpoints-{i}", str(EXAMPLES / "torchrun_plain.py")],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), outputs
    assert len(list((tmp_path / "runs").iterdir())) == 2


def test_a_failing_rank_is_named(tmp_path):
    (tmp_path / "crash.py").write_text(
        textwrap.dedent(
            """
            import os
            if os.environ["RANK"] == "1":
                raise ValueError("boom on rank 1")
            """
        )
    )
    result = run_phalanx("launch", "--cpu", "crash.py", cwd=tmp_path, timeout=120)
    assert result.returncode == 1
    assert "phalanx: rank 1 failed first (exit code 1): ValueError: boom on rank 1" in result.stderr
    assert "| ValueError: boom on rank 1" in result.stderr  # tail of its log


def test_user_error_inside_a_worker_is_one_line(tmp_path):
    (tmp_path / "bad.py").write_text("import phalanx\nphalanx.Session(batch={'global_batch_size': 5})\n")
    result = run_phalanx("launch", "--cpu", "bad.py", cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "phalanx: error: global_batch_size 5 cannot be split evenly over 2 processes; "
        "use a multiple of 2 (e.g. 4 or 6) or set batch.micro_batch_size"
    )


BAD_INPUT = [
    (["launch", "--cpu", "missing.py"], "script 'missing.py' not found"),
    (
        ["launch", "--cpu", "--set", "precision.mode=fp8", "ok.py"],
        "invalid value 'fp8' for 'precision.mode' (from --set): Input should be 'fp32', 'bf16', 'fp16' or 'fp64'",
    ),
    (
        ["launch", "--cpu", "--set", "batch.global_batch_size=64", "--set", "batch.micro_batch_size=24", "ok.py"],
        "global_batch_size 64 is not a multiple of micro_batch_size 24 x 2 processes = 48",
    ),
    (
        ["launch", "--cpu", "--set", "strategy.name=zero9", "ok.py"],
        "unknown strategy 'zero9' in strategy.name; choose one of: auto, single, dp, ddp",
    ),
    (["launch", "--cpu", "--config", "broken.yaml", "ok.py"], "config file 'broken.yaml' line 3 is not valid YAML"),
    (["launch", "--cpu", "--config", "nope.yaml", "ok.py"], "config file 'nope.yaml' not found"),
    (
        ["launch", "--cpu", "--set", "strategy.name=dp", "--nproc", "2", "ok.py"],
        "strategy 'dp' runs in 1 process, not 2",
    ),
    (["launch", "--cpu", "--set", "precision", "ok.py"], "--set expects section.key=value"),
    (["launch", "--cpu", "--nproc", "two", "ok.py"], "argument --nproc: invalid int value: 'two'"),
    (["launch", "--cpu"], "the following arguments are required: script"),
]


@pytest.mark.parametrize("args, message", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_before_any_process(tmp_path, args, message):
    # The first through a real process, the others called in this one: none gets as far as a process.
    _write_inputs(tmp_path)
    result = (
        run_phalanx(*args, cwd=tmp_path, timeout=60) if args == BAD_INPUT[0][0] else call_phalanx(*args, cwd=tmp_path)
    )
    _assert_refused_before_any_process(tmp_path, result, message)


def test_gpus_where_no_gpu_is_visible_is_one_line(tmp_path):
    # An empty CUDA_VISIBLE_DEVICES hides every GPU: the same refusal on any machine.
    # (tests/gpu/test_launch_gpus.py has the case of a GPU that does not exist.)
    _write_inputs(tmp_path)
    result = run_phalanx("launch", "--gpus", "0,1", "ok.py", cwd=tmp_path, timeout=60, env={"CUDA_VISIBLE_DEVICES": ""})
    _assert_refused_before_any_process(tmp_path, result, "--gpus 0,1: no CUDA device is visible here")


def _write_inputs(tmp_path: Path) -> None:
    (tmp_path / "ok.py").write_text("print('should not run')\n")
    (tmp_path / "broken.yaml").write_text("strategy:\n  name: [ddp\n")


def _assert_refused_before_any_process(tmp_path: Path, result, message: str) -> None:
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.output and "should not run" not in result.output
    assert not (tmp_path / "runs").exists()


def test_demo_reaches_its_accuracy(tmp_path):
    result = run_phalanx("demo", "--cpu", cwd=tmp_path, timeout=180)
    assert result.returncode == 0, result.output
    assert "test accuracy" in result.stdout and "samples/s" in result.stdout
    assert "global batch 64 = micro batch 32 x 1 accumulation step x 2 processes" in result.stdout
    record = json.loads((only_run_dir(tmp_path) / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["test_accuracy"] >= 0.95
    assert record["test_images"] == 359
    assert record["samples_per_s"] > 0


def test_ctrl_c_stops_every_process(tmp_path):
    import os
    import signal
    import time

    (tmp_path / "sleepy.py").write_text("import time\nprint('sleeping', flush=True)\ntime.sleep(120)\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "phalanx", "launch", "--cpu", "sleepy.py"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not _log_says(tmp_path, "sleeping"):
            assert time.monotonic() < deadline, "workers never started"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    assert proc.returncode == 130, err
    assert "phalanx: stopped by signal SIGINT" in err
    assert "Traceback" not in err


def _log_says(cwd: Path, text: str) -> bool:
    logs = list((cwd / "runs").glob("*/logs/rank0.log")) if (cwd / "runs").exists() else []
    return bool(logs) and text in logs[0].read_text()
