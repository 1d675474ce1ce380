"""Plain-layout checkpoint files are memory-mapped when loaded: the same values and the same errors
as a plain read, and no mapping left once the load returns (what a rank keeps has its own memory)."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from phalanx.checkpoint import files
from phalanx.checkpoint.export import open_checkpoint
from phalanx.checkpoint.safe import load_file, load_mapped, own_memory
from phalanx.errors import PhalanxError
from tests.helpers.checkpoints import checkpointed_session, saved_checkpoint, train_through

_MAPS = Path("/proc/self/maps")
needs_proc = pytest.mark.skipif(not _MAPS.exists(), reason="reads /proc/self/maps (Linux)")


def _mapped(*paths: Path) -> list[str]:
    names = {str(p.resolve()) for p in paths}
    return [line for line in _MAPS.read_text().splitlines() if line.split()[-1] in names]


@needs_proc
def test_mapped_values_and_own_memory_in_place(tmp_path):
    base = torch.arange(12.0)
    saved = {"a": base.view(3, 4), "b": base[4:8], "c": torch.tensor(3.0), "n": [torch.ones(2), 7]}
    torch.save(saved, tmp_path / "x.pt")
    loaded, mapped = load_mapped(tmp_path / "x.pt")
    assert torch.equal(loaded["a"], saved["a"]) and torch.equal(loaded["b"], saved["b"]) and loaded["n"][1] == 7
    assert len(mapped) == 3 and _mapped(tmp_path / "x.pt")  # a and b share one storage
    kept = {"a": loaded["a"], "b": loaded["b"], "n": loaded["n"]}
    copied = own_memory([kept, {"again": loaded["a"]}], mapped)
    assert copied == 12 * 4 + 2 * 4  # one copy of the shared storage, one of n[0]; c is not kept
    kept["a"][0, 0] = 100.0  # still views of one storage, and the file is not written
    assert kept["b"][0] == 4.0 and kept["a"].view(-1)[0] == 100.0
    assert not any(t.untyped_storage().data_ptr() in mapped for t in (kept["a"], kept["b"], kept["n"][0]))
    del loaded
    assert not _mapped(tmp_path / "x.pt")
    assert torch.load(tmp_path / "x.pt", weights_only=True)["a"][0, 0] == 0.0


def test_legacy_format_falls_back_to_a_plain_read(tmp_path):
    torch.save({"w": torch.ones(3)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    loaded, mapped = load_mapped(tmp_path / "old.pt")
    assert torch.equal(loaded["w"], torch.ones(3)) and mapped == set()


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _messages(path: Path) -> tuple[str, str]:
    out = []
    for load in (load_file, load_mapped):
        with pytest.raises(PhalanxError) as err:
            load(path)
        out.append(str(err.value))
    return out[0], out[1]


def test_mapped_load_keeps_every_error(tmp_path):
    (tmp_path / "garbage.pt").write_bytes(b"garbage")
    plain, mapped = _messages(tmp_path / "garbage.pt")
    assert plain == mapped and "garbage.pt'" in mapped
    torch.save({"w": torch.ones(1000)}, tmp_path / "t.pt")
    data = (tmp_path / "t.pt").read_bytes()
    (tmp_path / "t.pt").write_bytes(data[: len(data) // 2])
    plain, mapped = _messages(tmp_path / "t.pt")
    assert plain == mapped and "t.pt' is truncated or corrupt" in mapped
    payload = _Payload()
    payload.marker = tmp_path / "pwned"
    torch.save({"evil": payload}, tmp_path / "code.pt")
    plain, mapped = _messages(tmp_path / "code.pt")
    assert plain == mapped and "holds Python objects other than tensors" in mapped
    assert not payload.marker.exists()
    (tmp_path / "p.pkl").write_bytes(pickle.dumps([1, 2], protocol=2)[:-3])
    plain, mapped = _messages(tmp_path / "p.pkl")
    assert plain == mapped and "p.pkl'" in mapped


@needs_proc
def test_session_load_leaves_no_mapping_and_resumes(tmp_path):
    path = saved_checkpoint(tmp_path)
    session, model, loader = checkpointed_session(tmp_path / "other")
    try:
        session.load(path)
        assert not _mapped(path / "model.pt", path / "optimizer.pt")
        saved = torch.load(path / "model.pt", weights_only=True)[0]
        assert all(torch.equal(v, saved[k]) for k, v in session.model_state_dict().items())
        train_through(session, model, loader)  # the loaded state is updated in place: the file is not
    finally:
        session.close()
    manifest = json.loads((path / files.MANIFEST).read_text())
    assert open_checkpoint(path)["step"] == manifest["step"]  # every SHA-256 still matches
