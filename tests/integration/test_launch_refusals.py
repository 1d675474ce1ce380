"""Every combination a strategy refuses stops `phalanx launch` itself, before a worker starts: exit
code 2, one line naming the setting, no traceback, no run directory, and the script never runs.
The first is refused by a real `phalanx launch` process; the others by the same command called in
this process, since nothing they check needs one."""

from __future__ import annotations

import pytest

from tests.helpers.cli import call_phalanx, run_phalanx

pytestmark = pytest.mark.multiprocess

REFUSED = [
    (
        ["--set", "strategy.name=fsdp", "--set", "precision.mode=fp16"],
        "strategy fsdp does not support precision.mode fp16",
    ),
    (
        ["--set", "strategy.name=pipeline", "--set", "precision.mode=bf16"],
        "strategy pipeline does not support precision.mode bf16",
    ),
    (
        ["--set", "strategy.name=pipeline", "--set", "precision.mode=fp16"],
        "strategy pipeline does not support precision.mode fp16",
    ),
    (
        ["--nproc", "4", "--set", "strategy.name=pipeline", "--set", "strategy.pipeline.microbatches=2"],
        "strategy.pipeline.microbatches=2 is fewer than the 4 pipeline stages",
    ),
    (
        ["--set", "strategy.name=fsdp", "--set", "strategy.fsdp.cpu_offload=true"],
        "strategy.fsdp.cpu_offload needs CUDA devices",
    ),
    (
        ["--set", "strategy.name=fsdp", "--set", "strategy.ddp.comm_hook=fp16"],
        "strategy.ddp.comm_hook=fp16 compresses DDP's gradient all-reduce",
    ),
    (
        ["--set", "strategy.name=dp", "--set", "compute.compile=true"],
        "compute.compile is not supported with strategy dp",
    ),
    (
        ["--set", "strategy.name=model_parallel", "--set", "compute.compile=true"],
        "compute.compile is not supported with strategy model_parallel",
    ),
    (
        ["--set", "strategy.name=pipeline", "--set", "compute.compile=true"],
        "compute.compile is not supported with strategy pipeline",
    ),
    (
        ["--set", "strategy.name=fsdp", "--set", "compute.channels_last=true"],
        "compute.channels_last is not supported with strategy fsdp",
    ),
    (["--max-restarts", "-1"], "--max-restarts must be 0 or more, got -1"),
    (["--set", "launch.max_restarts=-1"], "invalid value -1 for 'launch.max_restarts' (from --set)"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, message", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_refused_before_any_worker_starts(tmp_path, args, message):
    (tmp_path / "x.py").write_text("from pathlib import Path\nPath('worker-ran').write_text('yes')\n")
    argv = ("launch", "--cpu", *args, "x.py")
    result = (
        run_phalanx(*argv, cwd=tmp_path, timeout=60) if args == REFUSED[0][0] else call_phalanx(*argv, cwd=tmp_path)
    )
    assert result.returncode == 2, result.output
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert "Traceback" not in result.output
    assert not (tmp_path / "runs").exists() and not (tmp_path / "worker-ran").exists()
