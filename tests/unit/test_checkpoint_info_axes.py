"""`phalanx checkpoint info` names the layout's axes, so a 2 x 2 (fsdp x tp) checkpoint does not read
as "fsdp over 4 processes" of data parallelism alone (issue 41)."""

from __future__ import annotations

import json

from phalanx.checkpoint.files import describe_processes
from phalanx.cli.main import main
from tests.helpers.checkpoints import saved_checkpoint


def test_a_two_by_two_checkpoint_shows_its_tensor_parallel_size():
    manifest = {"strategy": "fsdp", "world_size": 4, "axes": {"dp_shard": 2, "tp": 2}}
    assert describe_processes(manifest) == "fsdp over 4 processes (dp_shard 2 x tp 2)"


def test_a_manifest_from_before_the_axes_shows_the_process_count_alone():
    assert describe_processes({"strategy": "ddp", "world_size": 1}) == "ddp over 1 process"


def test_the_manifest_records_the_axes_and_info_prints_them(tmp_path, capsys):
    path = saved_checkpoint(tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["axes"] == {}  # one process: no axis has more than one rank
    capsys.readouterr()
    assert main(["checkpoint", "info", str(path)]) == 0
    assert f"{manifest['strategy']} over 1 process, full state dicts" in capsys.readouterr().out
