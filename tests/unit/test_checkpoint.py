"""Checkpoint files in one process: the atomic protocol, exact resume, and every way a checkpoint
can be wrong (truncated, corrupt, another model, a pickle that carries code)."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from phalanx.checkpoint import files
from phalanx.checkpoint.export import export, open_checkpoint
from phalanx.checkpoint.manager import shape_mismatch
from phalanx.checkpoint.safe import SafeReader
from phalanx.errors import PhalanxError
from tests.helpers.checkpoints import checkpointed_session, saved_checkpoint, train_through


def test_resumed_run_matches_uninterrupted_bit_for_bit(tmp_path):
    session, model, loader = checkpointed_session(tmp_path / "a")
    reference = train_through(session, model, loader)
    session.close()

    session, model, loader = checkpointed_session(tmp_path / "b", save_every=3)
    train_through(session, model, loader, stop_at=7)  # mid-epoch 2 (5 steps per epoch), last save at 6
    session.close()
    session, model, loader = checkpointed_session(tmp_path / "b", save_every=3, resume="auto")
    resumed = train_through(session, model, loader)
    session.close()
    assert session.step_count == 10
    assert resumed.keys() == reference.keys()
    assert all(torch.equal(resumed[k], reference[k]) for k in reference)


def test_atomic_protocol_latest_and_keep_last(tmp_path):
    session, model, loader = checkpointed_session(tmp_path, save_every=2, keep_last=2)
    train_through(session, model, loader)
    session.close()
    kept = [f.path.name for f in files.complete(tmp_path)]
    assert kept == ["step-00000008", "step-00000010"]
    assert (tmp_path / "latest").read_text().strip() == "step-00000010"
    manifest = json.loads((tmp_path / "step-00000010" / files.MANIFEST).read_text())
    assert manifest["step"] == 10 and manifest["layout"] == "plain"
    assert set(manifest["files"]) == {"model.pt", "optimizer.pt", "trainer.pt", "rng.pt"}
    # A save killed half-way leaves a staging directory: never picked, removed by the next save.
    staging = files.staging_path(tmp_path, 12)
    staging.mkdir()
    (staging / "model.pt").write_bytes(b"half")
    assert files.latest(tmp_path).name == "step-00000010"
    (tmp_path / "latest").unlink()  # a stale or missing pointer: the newest complete one is used
    assert files.latest(tmp_path).name == "step-00000010"


def _load_into_fresh(tmp_path: Path, path: Path, hidden: int = 16) -> None:
    session, model, loader = checkpointed_session(tmp_path / "other", hidden=hidden)
    try:
        session.load(path)
    finally:
        session.close()


def test_truncated_file_is_a_clear_error(tmp_path):
    path = saved_checkpoint(tmp_path)
    data = (path / "model.pt").read_bytes()
    (path / "model.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(PhalanxError, match=r"model.pt' is truncated or damaged \(\d+ bytes, \d+ when saved\)"):
        _load_into_fresh(tmp_path, path)


def test_corrupt_file_is_a_clear_error(tmp_path):
    path = saved_checkpoint(tmp_path)
    data = bytearray((path / "optimizer.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / "optimizer.pt").write_bytes(bytes(data))
    with pytest.raises(PhalanxError, match=r"optimizer.pt' is corrupt \(its SHA-256 differs"):
        _load_into_fresh(tmp_path, path)


def test_wrong_model_names_the_mismatch(tmp_path):
    path = saved_checkpoint(tmp_path)
    with pytest.raises(
        PhalanxError,
        match=r"does not fit the model: 3 shape\(s\) differ \(0.weight \[16, 4\] in the checkpoint, \[32, 4\] here",
    ):
        _load_into_fresh(tmp_path, path, hidden=32)


def test_shape_mismatch_lists_missing_and_unexpected():
    problem = shape_mismatch({"a": [1], "b": [2]}, {"a": [1], "c": [3]})
    assert problem == "1 key(s) missing from the checkpoint (c); 1 unexpected key(s) (b)"
    assert shape_mismatch({"a": [1]}, {"a": [1]}) is None


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_with_code_is_refused_and_not_run(tmp_path):
    path = saved_checkpoint(tmp_path)
    payload = _Payload()
    payload.marker = tmp_path / "pwned"
    torch.save({"evil": payload}, path / "model.pt")
    # The attacker also rewrites the manifest, so the checksums pass: weights_only must hold.
    manifest = json.loads((path / files.MANIFEST).read_text())
    manifest["files"]["model.pt"] = files.describe_file(path / "model.pt")
    (path / files.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(PhalanxError, match="holds Python objects other than tensors"):
        _load_into_fresh(tmp_path, path)
    assert not payload.marker.exists()


def test_dcp_metadata_with_code_is_refused_and_not_run(tmp_path):
    marker = tmp_path / "pwned"
    payload = _Payload()
    payload.marker = marker
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / ".metadata").write_bytes(pickle.dumps(payload))
    with pytest.raises(PhalanxError, match="nothing was executed"):
        SafeReader(str(tmp_path / "shards")).read_metadata()
    assert not marker.exists()


def test_export_loads_into_the_bare_model(tmp_path):
    path = saved_checkpoint(tmp_path)
    manifest, state = export(tmp_path / "ckpt", tmp_path / "weights.pt")  # the parent: its latest
    assert manifest["step"] == 10
    bare = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.2), nn.Linear(16, 1))
    bare.load_state_dict(torch.load(tmp_path / "weights.pt"))
    assert all(torch.equal(bare.state_dict()[k], v) for k, v in state.items())
    assert open_checkpoint(path)["path"] == str(path.resolve())
