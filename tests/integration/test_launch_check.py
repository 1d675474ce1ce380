"""`phalanx launch` reads the script with `phalanx check` first: an error finding stops the launch
before any worker starts, in one block; warnings are shown and the launch goes on; `--no-check`
(launch.check: false) launches whatever it finds."""

from __future__ import annotations

import textwrap

import pytest

from phalanx.launch import launcher
from tests.helpers.cli import call_phalanx, run_phalanx

# A sampler that deals the same order every epoch (no set_epoch): wrong, but harmless to run here.
SAME_ORDER = textwrap.dedent(
    """
    import torch.distributed as dist
    from torch.utils.data.distributed import DistributedSampler

    dist.init_process_group("gloo")
    sampler = DistributedSampler(range(8))
    print("trained", list(sampler))
    """
)


def test_an_error_finding_stops_the_launch_in_one_block(tmp_path):
    (tmp_path / "train.py").write_text(SAME_ORDER)
    result = call_phalanx("launch", "--cpu", "--nproc", "2", "train.py", cwd=tmp_path)
    assert result.returncode == 2, result.output
    block = result.stderr.strip().splitlines()
    assert block[0] == "phalanx: check: 1 error in train.py (docs/check.md):"
    assert block[1].startswith("  train.py:6: error set-epoch-missing: ")
    assert block[2].startswith("phalanx: error: train.py has 1 error that hangs or train") and "--no-check" in block[2]
    assert len(block) == 3 and "trained" not in result.output
    assert not (tmp_path / "runs").exists()  # nothing started, nothing left


@pytest.mark.parametrize("how", ["ignore comment", "launch.check=false", "warning only"])
def test_a_silenced_line_the_setting_or_a_warning_lets_the_workers_start(tmp_path, monkeypatch, how):
    started = []
    monkeypatch.setattr(launcher, "run_workers", lambda plan: started.append(plan) or 0)
    monkeypatch.setattr(launcher, "report_run", lambda run_dir: None)
    source = SAME_ORDER
    flags = ["--set", "launch.check=false"] if how == "launch.check=false" else []
    if how == "ignore comment":
        source = source.replace("DistributedSampler(range(8))", "DistributedSampler(range(8))  # phalanx: ignore")
    if how == "warning only":
        source = source.replace("sampler = ", "model = torch.nn.DataParallel(torch.nn.Linear(2, 2))\nsampler = ")
        source = source.replace("import torch.distributed", "import torch\nimport torch.distributed")
        source = source.replace("DistributedSampler(range(8))", "DistributedSampler(range(8), shuffle=False)")
    (tmp_path / "train.py").write_text(source)
    result = call_phalanx("launch", "--cpu", "--nproc", "2", *flags, "train.py", cwd=tmp_path)
    assert result.returncode == 0 and len(started) == 1, result.output
    if how == "warning only":
        assert "phalanx: check: 1 warning in train.py" in result.stderr and "warning data-parallel" in result.stderr
    else:
        assert "phalanx: check" not in result.output


@pytest.mark.multiprocess
def test_no_check_launches_it_anyway(tmp_path):
    (tmp_path / "train.py").write_text(SAME_ORDER)
    result = run_phalanx("launch", "--cpu", "--nproc", "2", "--no-check", "train.py", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.output
    assert "trained" in result.output and "phalanx: check" not in result.output
