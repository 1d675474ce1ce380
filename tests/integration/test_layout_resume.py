"""Checkpoints across parallel layouts, on CPU gloo processes: a run saved under fsdp on 2
processes continues under tp on 2, then under single on 1, through torch.distributed.checkpoint's
resharding, and ends where an uninterrupted one-process run ends; under the same layout (fsdp x tp,
2 x 2) the continuation is bit for bit the uninterrupted run."""

from __future__ import annotations

import pytest
import torch

import phalanx
import phalanx.cli.main
from phalanx import PhalanxError
from tests.helpers import layout_resume as lr
from tests.helpers import tensor_parallel as tp_harness
from tests.helpers.training import rel_diff

pytestmark = pytest.mark.multiprocess
TIMEOUT = 180


def _spawn(nprocs: int, *args, **kwargs) -> dict:
    return phalanx.spawn(lr.run, nprocs=nprocs, args=(args, kwargs), cpu=True, timeout=TIMEOUT)[0]


@pytest.mark.timeout(3 * TIMEOUT)
def test_fsdp_then_tp_then_single_continue_from_the_saved_steps(tmp_path):
    checkpoints = str(tmp_path / "checkpoints")
    first = _spawn(2, "fsdp", None, checkpoints, 2, save_at=2)
    second = _spawn(2, "tp", 2, checkpoints, 4, save_at=4)
    third = lr.train("single", None, checkpoints, lr.TOTAL)
    assert (first["started"], second["started"], third["started"]) == (0, 2, 4)
    assert third["steps"] == lr.TOTAL
    reference = tp_harness.reference(steps=lr.TOTAL)
    assert rel_diff(third["state"], reference["state"]) < 1e-5
    # What `phalanx checkpoint export` gathers from tp's shards loads into the bare model.
    exported = tmp_path / "model.pt"
    assert phalanx.cli.main.main(["checkpoint", "export", f"{checkpoints}/step-00000004", str(exported)]) == 0
    bare = tp_harness.build()
    bare.load_state_dict(torch.load(exported, weights_only=True))
    assert rel_diff(bare.state_dict(), second["state"]) == 0


@pytest.mark.timeout(2 * TIMEOUT)
def test_the_same_2d_layout_continues_bit_for_bit(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    whole = _spawn(4, "fsdp", 2, str(checkpoints), lr.TOTAL, save_at=3)
    assert [p.name for p in checkpoints.glob("step-*")] == ["step-00000003"]
    resumed = _spawn(4, "fsdp", 2, str(checkpoints), lr.TOTAL)
    assert resumed["started"] == 3
    assert all(torch.equal(resumed["state"][k], whole["state"][k]) for k in whole["state"])


@pytest.mark.timeout(TIMEOUT)
def test_whole_files_do_not_resume_under_a_sharded_layout(tmp_path):
    checkpoints = str(tmp_path / "checkpoints")
    lr.train("single", None, checkpoints, 1, save_at=1)
    with pytest.raises(PhalanxError) as refused:
        lr.train("tp", 1, checkpoints, 2)  # one process refuses as two would, without starting any
    assert "\n" not in str(refused.value).strip() and "load_weights" in str(refused.value)
