"""``phalanx checkpoint export --format hf`` (checkpoint/hf_export.py) without transformers: the
shard plan (property tests over tensor sizes and limits), Hugging Face's file names and index, a
tied weight written once under the name the checkpoint recorded, the exported files read back by
phalanx equal to the checkpoint's weights (plain and dcp layouts, any shard size), and the output
directory: written whole or not at all, a previous export replaced, anything else refused in one
line before the checkpoint is read."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import phalanx
from phalanx.checkpoint import hf_export
from phalanx.checkpoint.export import model_state_dict, open_checkpoint
from phalanx.checkpoint.hf_export import export_hf, plan_shards, shard_name
from phalanx.checkpoint.hf_files import open_weights
from phalanx.checkpoint.weights import WeightsFile
from phalanx.cli.main import main
from phalanx.errors import PhalanxError
from tests.helpers.checkpoints import saved_checkpoint
from tests.helpers.models import TiedLM

FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


# -- the shard plan ------------------------------------------------------------------------------
@FUZZ
@given(sizes=st.lists(st.integers(0, 5000), max_size=40), limit=st.integers(1, 6000))
def test_shards_keep_the_order_stay_under_the_limit_and_are_as_few_as_greedy_filling_gives(sizes, limit):
    named = [(f"t{i}", size) for i, size in enumerate(sizes)]
    shards = plan_shards(named, limit)
    size = dict(named)
    assert [n for shard in shards for n in shard] == [n for n, _ in named]
    assert all(shard for shard in shards)
    for i, shard in enumerate(shards):
        total = sum(size[n] for n in shard)
        assert total <= limit or len(shard) == 1  # only a tensor over the limit makes a shard over it
        if i + 1 < len(shards):  # greedy: the next tensor did not fit
            assert total + size[shards[i + 1][0]] > limit


def test_hugging_face_file_names():
    assert shard_name(1, 1) == "model.safetensors"
    assert [shard_name(i, 3) for i in (1, 3)] == [
        "model-00001-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    ]
    assert shard_name(12, 100000)[:-12] == "model-00012-of-100000"


# -- exports of real checkpoints -------------------------------------------------------------------
def _tied_checkpoint(root: Path, strategy: str = "single") -> Path:
    """TiedLM trained two steps (the tie holds: embed and head are one tensor), saved."""
    torch.manual_seed(0)
    session = phalanx.Session(
        strategy=strategy,
        train={"progress": False, "metrics": False},
        checkpoint={"dir": str(root), "resume": "never"},
    )
    model = TiedLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = session.setup(model, optimizer)
    try:
        for _ in range(2):
            with session.accumulate(model):
                session.backward(model(torch.arange(10)).square().mean())
        return session.save()
    finally:
        session.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    return {
        "plain": saved_checkpoint(tmp_path_factory.mktemp("plain")),
        "tied": _tied_checkpoint(tmp_path_factory.mktemp("tied") / "ck"),
        "tied-dcp": _tied_checkpoint(tmp_path_factory.mktemp("tieddcp") / "ck", "fsdp"),
    }


def _read_back(directory: Path) -> dict[str, torch.Tensor]:
    reader = open_weights(directory)
    try:
        return {name: reader.read(name) for name in reader.index()}
    finally:
        reader.close()


def _cli(capsys, *args: str, code: int = 0) -> str:
    capsys.readouterr()
    assert main(["checkpoint", "export", *args]) == code
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return captured.out.strip() if code == 0 else captured.err.strip()


def test_one_shard_is_model_safetensors_without_an_index(capsys, tmp_path, checkpoints):
    out = tmp_path / "hf"
    line = _cli(capsys, "--format", "hf", str(checkpoints["plain"]), str(out))
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert line.startswith(f"phalanx: wrote {out}: 4 tensors, 97 values of model 0 at step 10 (saved by single)")
    assert "in model.safetensors (388 B); the checkpoint holds no Hugging Face config" in line
    state = model_state_dict(open_checkpoint(checkpoints["plain"]))
    got = _read_back(out)
    assert list(got) and all(torch.equal(got[k], v) for k, v in state.items()) and got.keys() == state.keys()
    with WeightsFile(out / "model.safetensors") as weights:
        assert weights.metadata == {
            "format": "pt",
            "phalanx_step": "10",
            "phalanx_model": "0",
            "phalanx_strategy": "single",
        }


def test_shards_and_index_as_save_pretrained_writes_them(capsys, tmp_path, checkpoints):
    out = tmp_path / "hf"
    line = _cli(capsys, "--format", "hf", "--max-shard-size", "100", str(checkpoints["plain"]), str(out))
    assert "in 3 shards of at most 100 B (388 B)" in line
    index = json.loads((out / "model.safetensors.index.json").read_text())
    state = model_state_dict(open_checkpoint(checkpoints["plain"]))
    assert index["metadata"] == {"total_size": 388, "total_parameters": 97}
    assert index["weight_map"] == {  # 256 B alone, then 64 B, then 64 + 4 B: filled in the state dict's order
        "0.weight": "model-00001-of-00003.safetensors",
        "0.bias": "model-00002-of-00003.safetensors",
        "2.weight": "model-00003-of-00003.safetensors",
        "2.bias": "model-00003-of-00003.safetensors",
    }
    assert sorted(p.name for p in out.iterdir()) == sorted(
        {*index["weight_map"].values(), "model.safetensors.index.json"}
    )
    got = _read_back(out)
    assert got.keys() == state.keys() and all(torch.equal(got[k], v) for k, v in state.items())


@pytest.mark.parametrize("layout", ["tied", "tied-dcp"])
def test_a_tied_weight_is_written_once_and_loads_back_strictly(tmp_path, checkpoints, layout):
    manifest = open_checkpoint(checkpoints[layout])
    assert manifest["models"][0]["tied"] == [["embed.weight", "head.weight"]]
    done = export_hf(checkpoints[layout], tmp_path / "hf", max_shard_size=100)
    got = _read_back(tmp_path / "hf")
    assert set(got) == {"embed.weight", "body.weight", "body.bias"} and done.tensors == 3
    state = model_state_dict(manifest)
    assert all(torch.equal(got[k], state[k]) for k in got)
    session = phalanx.Session(train={"progress": False, "metrics": False})
    model = session.setup(TiedLM())
    session.load_weights(tmp_path / "hf")  # strict: the file holds one name of the tied pair
    assert torch.equal(model.head.weight, state["embed.weight"]) and model.head.weight is model.embed.weight
    session.close()


def test_a_checkpoint_without_recorded_ties_writes_a_shared_tensor_once(tmp_path, checkpoints):
    """Checkpoints saved before ties were recorded: tensors that are one in model.pt are written once."""
    copy = tmp_path / "old"
    copy.mkdir()
    for item in checkpoints["tied"].iterdir():
        (copy / item.name).write_bytes(item.read_bytes())
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["models"][0]["tied"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    export_hf(copy, tmp_path / "hf")
    assert set(_read_back(tmp_path / "hf")) == {"embed.weight", "body.weight", "body.bias"}


@FUZZ
@given(limit=st.integers(1, 600))
def test_any_shard_size_reads_back_as_the_checkpoint(tmp_path_factory, checkpoints, limit):
    out = tmp_path_factory.mktemp("any") / "hf"
    done = export_hf(checkpoints["tied-dcp"], out, max_shard_size=limit)
    shards = [f for f in done.files if f.endswith(".safetensors")]
    assert (len(shards) == 1) == (not (out / "model.safetensors.index.json").exists())
    for shard in shards:
        with WeightsFile(out / shard) as weights:
            sizes = [torch.Size(shape).numel() * dtype.itemsize for shape, dtype in weights.index().values()]
        assert sum(sizes) <= limit or len(sizes) == 1
    state = model_state_dict(open_checkpoint(checkpoints["tied-dcp"]))
    got = _read_back(out)
    assert all(torch.equal(got[k], state[k]) for k in got) and len(got) == 3


# -- the output directory -------------------------------------------------------------------------
def _refused(capsys, checkpoint: Path, out: Path, *pieces: str, args: tuple = ()) -> str:
    text = _cli(capsys, "--format", "hf", *args, str(checkpoint), str(out), code=2)
    assert text.count("\n") == 0 and all(p in text for p in pieces), text
    return text


def test_what_cannot_be_an_export_directory_is_refused_in_one_line(capsys, tmp_path, checkpoints):
    ck = checkpoints["plain"]
    (tmp_path / "afile").write_text("x")
    _refused(capsys, ck, tmp_path / "afile", f"'{tmp_path / 'afile'}' is a file; --format hf writes a directory")
    _refused(capsys, ck, tmp_path / "no" / "hf", f"'{tmp_path / 'no'}' does not exist; create the directory")
    _refused(capsys, ck, tmp_path / "afile" / "hf", f"'{tmp_path / 'afile'}' is a file, not a directory")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    _refused(capsys, ck, mine, f"'{mine}' holds 'notes.txt', which a phalanx export does not write")
    (mine / "notes.txt").unlink()
    torch.save({}, mine / "model.safetensors")  # a name an export writes, but not phalanx's weights
    _refused(capsys, ck, mine, "holds 'model.safetensors' (weights phalanx did not export)")
    _refused(
        capsys, ck, tmp_path / "x", "--max-shard-size must be at least 1 byte, not 0", args=("--max-shard-size", "0")
    )
    _refused(capsys, ck, tmp_path / "x", "'5 apples' is not a size", args=("--max-shard-size", "5 apples"))
    text = _cli(capsys, "--max-shard-size", "5G", str(ck), str(tmp_path / "w.pt"), code=2)
    assert text == "phalanx: error: --max-shard-size applies to --format hf only; add --format hf, or leave it out"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "mine"]


def test_a_previous_export_is_replaced_whole(capsys, tmp_path, checkpoints):
    out = tmp_path / "hf"
    out.mkdir()  # an empty directory is fine
    _cli(capsys, "--format", "hf", "--max-shard-size", "100", str(checkpoints["plain"]), str(out))
    assert len(list(out.glob("model-*"))) == 3
    _cli(capsys, "--format", "hf", str(checkpoints["plain"]), str(out))  # one shard now: no stale shards stay
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_an_export_that_fails_half_way_leaves_no_directory(capsys, tmp_path, checkpoints, monkeypatch):
    written = []

    def full_disk(state, path, metadata):
        if written:
            Path(path).write_bytes(b"half a shard")
            raise OSError(28, "No space left on device")
        written.append(path)
        original(state, path, metadata)

    original = hf_export._save
    monkeypatch.setattr(hf_export, "_save", full_disk)
    out = tmp_path / "hf"
    small = ("--max-shard-size", "100")
    _refused(capsys, checkpoints["plain"], out, f"cannot write '{out}' (No space left on device)", args=small)
    assert list(tmp_path.iterdir()) == []
    previous = tmp_path / "prev"
    monkeypatch.setattr(hf_export, "_save", original)
    _cli(capsys, "--format", "hf", str(checkpoints["plain"]), str(previous))
    before = (previous / "model.safetensors").read_bytes()
    monkeypatch.setattr(hf_export, "_save", full_disk)
    _refused(capsys, checkpoints["plain"], previous, "No space left on device", args=small)
    assert (previous / "model.safetensors").read_bytes() == before  # the previous export is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prev"]


def _renames_failing(monkeypatch, *failing: int) -> list[tuple[str, str]]:
    """os.rename raising (as a rename across file systems does) on the ``failing`` calls, counted
    from 1; returns the calls made."""
    calls = []
    rename = os.rename

    def flaky(src, dst, *args, **kwargs):
        calls.append((Path(src).name, Path(dst).name))
        if len(calls) in failing:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", flaky)
    return calls


def test_a_previous_export_is_put_back_when_the_new_one_cannot_take_its_place(
    capsys, tmp_path, checkpoints, monkeypatch
):
    out = tmp_path / "hf"
    _cli(capsys, "--format", "hf", str(checkpoints["plain"]), str(out))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calls = _renames_failing(monkeypatch, 2)  # DIR is moved aside, then staging -> DIR fails
    _refused(capsys, checkpoints["plain"], out, f"cannot write '{out}' (Invalid cross-device link)")
    old, staging = f".phalanx-export-{os.getpid()}.old", f".phalanx-export-{os.getpid()}.tmp"
    assert calls == [("hf", old), (staging, "hf"), (old, "hf")]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the previous export, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_a_previous_export_that_cannot_be_put_back_is_named(capsys, tmp_path, checkpoints, monkeypatch):
    out = tmp_path / "hf"
    _cli(capsys, "--format", "hf", str(checkpoints["plain"]), str(out))
    before = (out / "model.safetensors").read_bytes()
    _renames_failing(monkeypatch, 2, 3)
    old = tmp_path / f".phalanx-export-{os.getpid()}.old"
    _refused(
        capsys,
        checkpoints["plain"],
        out,
        f"cannot write '{out}' (Invalid cross-device link), and the previous export could not be put back: it is "
        f"in '{old}'; rename it to '{out}'",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [old.name]  # no DIR, no staging left
    assert (old / "model.safetensors").read_bytes() == before


def test_a_damaged_tie_record_is_one_line(tmp_path, checkpoints):
    copy = tmp_path / "ck"
    copy.mkdir()
    for item in checkpoints["tied"].iterdir():
        (copy / item.name).write_bytes(item.read_bytes())
    manifest = json.loads((copy / "manifest.json").read_text())
    for bad in (["embed.weight"], ["embed.weight", "nothere"], "embed.weight", [["embed.weight", 3]]):
        manifest["models"][0]["tied"] = [bad] if not isinstance(bad, list) or isinstance(bad[0], str) else bad
        (copy / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(PhalanxError, match=r"is damaged \(models\[0\]\.tied(\[0\])? is") as err:
            open_checkpoint(copy)
        assert "\n" not in str(err.value)


def test_a_model_without_a_config_saves_no_hugging_face_files(checkpoints):
    manifest = open_checkpoint(checkpoints["tied"])
    assert not [name for name in manifest["files"] if name.startswith("hf/")]


class _Configured(nn.Module):
    """A model with a config of the Hugging Face kind, and one whose config breaks."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layer = nn.Linear(2, 2)

    def forward(self, x):
        return self.layer(x)


class _Config:
    def __init__(self, value):
        self.value = value

    def to_json_string(self):
        if isinstance(self.value, Exception):
            raise self.value
        return self.value


@pytest.mark.parametrize(
    "config, written",
    [
        (_Config('{"model_type": "toy", "n": 2}'), {"model_type": "toy", "n": 2, "architectures": ["_Configured"]}),
        (_Config(ValueError("cannot")), None),
        (_Config("[1, 2]"), None),
        (_Config("not json"), None),
        ({"model_type": "a dict has no to_json_string"}, None),
    ],
)  # fmt: skip
def test_the_config_is_recorded_when_it_is_a_json_object_and_never_fails_a_save(tmp_path, config, written):
    session = phalanx.Session(
        train={"progress": False, "metrics": False}, checkpoint={"dir": str(tmp_path / "ck"), "resume": "never"}
    )
    session.setup(_Configured(config))
    path = session.save()
    session.close()
    manifest = open_checkpoint(path)
    if written is None:
        assert "hf/model0/config.json" not in manifest["files"]
        return
    assert json.loads((path / "hf/model0/config.json").read_text()) == written
    done = export_hf(path, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config == {**written, "dtype": "float32"} and done.config == config
