"""`phalanx launch` on real GPUs: --gpus selects them and each process gets its own over NCCL, and a
GPU that does not exist is refused in one line. The CPU side of these cases is in
tests/integration/test_launch.py and test_device_choice.py."""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

from tests.helpers.cli import run_phalanx

WHO = textwrap.dedent(
    """
    import os
    import torch
    import torch.distributed as dist
    import phalanx
    session = phalanx.Session()
    total = torch.full((1,), float(session.rank + 1), device=session.device)
    dist.all_reduce(total)  # a CUDA tensor through the process group
    print(f"rank {session.rank} on {session.device} over {session.topology.backend}, sum {total.item():g}, "
          f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']}", flush=True)
    session.close()
    """
)


@pytest.mark.cuda(gpus=2)
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_gpus_selects_one_gpu_per_process_over_nccl(tmp_path, gpus):
    (tmp_path / "who.py").write_text(WHO)
    selected = ",".join(str(i) for i in range(gpus))
    result = run_phalanx("launch", "--gpus", selected, "--ranks", "all", "who.py", cwd=tmp_path, timeout=180)
    assert result.returncode == 0, result.output
    # --gpus indexes into an outer CUDA_VISIBLE_DEVICES, as torch does.
    outer = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = ",".join(outer.split(",")[:gpus]) if outer else selected
    assert f"phalanx: {gpus} processes on GPU {names}, strategy ddp" in result.stdout
    total = gpus * (gpus + 1) // 2
    for rank in range(gpus):
        line = f"[rank {rank}] rank {rank} on cuda:{rank} over nccl, sum {total}, CUDA_VISIBLE_DEVICES={names}"
        assert line in result.stdout.splitlines(), result.output


@pytest.mark.cuda
def test_a_gpu_that_does_not_exist_is_one_line(tmp_path):
    (tmp_path / "ok.py").write_text("print('should not run')\n")
    n = torch.cuda.device_count()
    result = run_phalanx("launch", "--gpus", str(n), "ok.py", cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    visible = f"{n} visible GPU{'s are' if n != 1 else ' is'} numbered 0-{n - 1}"
    assert result.stderr.strip() == f"phalanx: error: --gpus {n}: GPU {n} does not exist; {visible}", result.stderr
    assert "should not run" not in result.output and not (tmp_path / "runs").exists()
