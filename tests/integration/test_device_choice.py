"""The launcher's device choice against a faked GPU count of 0, 1, 2 and 8: the processes it really
starts, and the rank and CUDA_VISIBLE_DEVICES each one sees. torch.cuda.device_count is faked in the
launcher only; the workers run a script that records its environment and never touches CUDA, so
this holds on a machine with any number of GPUs (CUDA_VISIBLE_DEVICES naming GPUs that are not
there is harmless to a process that does not use them)."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from phalanx.launch.launcher import LaunchRequest, prepare, run_workers

pytestmark = pytest.mark.multiprocess

RECORD = textwrap.dedent(
    """
    import json, os
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES")
    with open(os.path.join(os.environ["OUT"], f"rank{os.environ['RANK']}.json"), "w") as out:
        json.dump({key: os.environ.get(key) for key in keys}, out)
    """
)

# (GPUs torch "sees", the launcher's own CUDA_VISIBLE_DEVICES, --gpus) -> (kind, processes, workers' value)
CASES = {
    "0 GPUs": ((0, None, None), ("cpu", 2, None)),
    "1 GPU": ((1, None, None), ("cuda", 1, "0")),
    "2 GPUs": ((2, None, None), ("cuda", 2, "0,1")),
    "8 GPUs": ((8, None, None), ("cuda", 8, "0,1,2,3,4,5,6,7")),
    "--gpus 0,2 of 8": ((8, None, "0,2"), ("cuda", 2, "0,2")),
    # An outer restriction is respected: --gpus indexes into it, as torch does.
    "CUDA_VISIBLE_DEVICES=3,5,6,7": ((4, "3,5,6,7", None), ("cuda", 4, "3,5,6,7")),
    "--gpus 1,3 of CUDA_VISIBLE_DEVICES=3,5,6,7": ((4, "3,5,6,7", "1,3"), ("cuda", 2, "5,7")),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("given, expected", CASES.values(), ids=CASES.keys())
def test_each_worker_sees_the_devices_the_launcher_chose(tmp_path, monkeypatch, given, expected):
    count, outer, gpus = given
    kind, nproc, visible = expected
    monkeypatch.chdir(tmp_path)  # no phalanx.yaml of the repository's
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    if outer is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", outer)
    (tmp_path / "record.py").write_text(RECORD)
    (tmp_path / "out").mkdir()
    request = LaunchRequest("record.py", gpus=gpus, run_dir="runs", extra_env={"OUT": str(tmp_path / "out")})

    plan = prepare(request)
    assert (plan.devices.kind, plan.devices.nproc, plan.devices.cuda_visible_devices) == expected
    plan.run_dir.mkdir(parents=True)
    assert run_workers(plan) == 0  # the real elastic agent and worker bootstrap, as `phalanx launch` runs them

    seen = [json.loads(path.read_text()) for path in sorted((tmp_path / "out").glob("rank*.json"))]
    assert sorted(int(s["RANK"]) for s in seen) == list(range(nproc))
    assert sorted(int(s["LOCAL_RANK"]) for s in seen) == list(range(nproc))
    assert {(s["WORLD_SIZE"], s["LOCAL_WORLD_SIZE"]) for s in seen} == {(str(nproc), str(nproc))}
    # Every worker the same value, naming one GPU per process (or left unset for CPU processes).
    assert {s["CUDA_VISIBLE_DEVICES"] for s in seen} == {visible}
    if kind == "cuda":
        assert len(visible.split(",")) == nproc
