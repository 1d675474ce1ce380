"""``phalanx checkpoint export`` to safetensors: the default by OUT's suffix, ``--format``, files that
``safetensors.torch.load_file`` loads into the bare model with the same tensors as the .pt export,
from a plain (single) and a dcp (fsdp, a process group of one) checkpoint, and the output errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors import safe_open
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.checkpoint.export import export
from phalanx.checkpoint.weights import WeightsFile
from phalanx.cli.main import main
from phalanx.errors import PhalanxError
from tests.helpers.checkpoints import saved_checkpoint

not_as_root = pytest.mark.skipif(os.geteuid() == 0, reason="root writes whatever the permissions say")


def _bare() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.2), nn.Linear(16, 1))


def _fsdp_checkpoint(root: Path) -> Path:
    torch.manual_seed(0)
    session = phalanx.Session(
        strategy="fsdp",
        batch={"global_batch_size": 8},
        train={"epochs": 1, "progress": False},
        checkpoint={"dir": str(root), "resume": "never"},
    )
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    model = _bare()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer, loader = session.setup(model, optimizer, DataLoader(data, batch_size=8))
    try:
        for _ in session.epochs():
            for x, y in session.progress(loader):
                with session.accumulate(model):
                    session.backward(nn.functional.mse_loss(model(x), y))
        return session.save()
    finally:
        session.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    return {
        "plain": saved_checkpoint(tmp_path_factory.mktemp("plain")),
        "dcp": _fsdp_checkpoint(tmp_path_factory.mktemp("dcp") / "ck"),
    }


def _cli(capsys, *args: str, code: int = 0) -> str:
    capsys.readouterr()
    assert main(["checkpoint", "export", *args]) == code
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return captured.out if code == 0 else captured.err.strip()


@pytest.mark.parametrize("layout", ["plain", "dcp"])
def test_safetensors_export_equals_the_pt_export(capsys, tmp_path, checkpoints, layout):
    ck = checkpoints[layout]
    line = _cli(capsys, str(ck), str(tmp_path / "w.safetensors"))
    assert line.strip().endswith(
        f"load it with model.load_state_dict(safetensors.torch.load_file('{tmp_path / 'w.safetensors'}'))"
    )
    manifest, state = export(ck, tmp_path / "w.pt")
    assert WeightsFile(tmp_path / "w.safetensors").format == "safetensors"
    from_st = safetensors.torch.load_file(tmp_path / "w.safetensors")
    from_pt = torch.load(tmp_path / "w.pt", weights_only=True)
    assert list(from_pt) == list(state) and from_st.keys() == from_pt.keys()
    assert all(from_st[k].dtype == v.dtype and torch.equal(from_st[k], v) for k, v in from_pt.items())
    bare = _bare()
    assert not bare.load_state_dict(from_st).missing_keys
    assert all(torch.equal(bare.state_dict()[k], v) for k, v in from_pt.items())
    with safe_open(tmp_path / "w.safetensors", "pt") as fh:
        assert fh.metadata() == {
            "format": "pt",
            "phalanx_step": str(manifest["step"]),
            "phalanx_model": "0",
            "phalanx_strategy": manifest["strategy"],
        }
    assert manifest["layout"] == layout and sorted(p.name for p in tmp_path.iterdir()) == ["w.pt", "w.safetensors"]


def test_format_overrides_the_suffix(capsys, tmp_path, checkpoints):
    ck = checkpoints["plain"]
    out = _cli(capsys, "--format", "safetensors", str(ck), str(tmp_path / "w.bin"))
    assert "safetensors.torch.load_file" in out
    assert WeightsFile(tmp_path / "w.bin").format == "safetensors"
    out = _cli(capsys, "--format", "pt", str(ck), str(tmp_path / "w.safetensors"))
    assert "model.load_state_dict(torch.load(" in out
    assert WeightsFile(tmp_path / "w.safetensors").format == "pt"
    _cli(capsys, str(ck), str(tmp_path / "w.weights"))  # any other suffix: torch's format
    assert WeightsFile(tmp_path / "w.weights").format == "pt"
    with pytest.raises(PhalanxError, match="export format 'npz' is not one of pt, safetensors; choose one of them"):
        export(ck, tmp_path / "w.npz", format="npz")


def _refused(capsys, ck: Path, out: Path, *pieces: str) -> str:
    with pytest.raises(PhalanxError) as caught:
        export(ck, out)
    text = str(caught.value)
    assert "\n" not in text and all(piece in text for piece in pieces), text
    assert _cli(capsys, str(ck), str(out), code=2) == f"phalanx: error: {text}"
    return text


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if "phalanx-export" in p.name or p.suffix == ".tmp")


def test_output_paths_that_cannot_be_written(capsys, tmp_path, checkpoints):
    ck = checkpoints["plain"]
    _refused(capsys, ck, tmp_path, f"'{tmp_path}' is a directory")  # a directory has no .safetensors suffix
    (tmp_path / "d.safetensors").mkdir()
    _refused(
        capsys,
        ck,
        tmp_path / "d.safetensors",
        f"is a directory; give the file to write, e.g. {tmp_path / 'd.safetensors' / 'model.safetensors'}",
    )
    _refused(capsys, ck, tmp_path / "nothere" / "w.safetensors", f"directory '{tmp_path / 'nothere'}' does not exist")
    _refused(capsys, ck, tmp_path / ("x" * 300 + ".safetensors"), "File name too long")
    assert _leftovers(tmp_path) == []


@not_as_root
def test_export_into_a_read_only_directory(capsys, tmp_path, checkpoints):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        out = locked / "w.safetensors"
        _refused(capsys, checkpoints["plain"], out, f"cannot write '{out}' (Permission denied)")
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o755)


def test_export_that_fails_half_way_leaves_the_previous_file(capsys, tmp_path, checkpoints, monkeypatch):
    out = tmp_path / "w.safetensors"
    out.write_bytes(b"the previous export")

    def full_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    line = _refused(capsys, checkpoints["plain"], out, f"cannot write '{out}' (No space left on device)")
    assert line.endswith("choose an output path in a writable directory with enough free space")
    assert out.read_bytes() == b"the previous export" and _leftovers(tmp_path) == []
