"""Weights spread over several files (checkpoint/hf_files.py): a Hugging Face model directory (one
model.safetensors, an index and its shards, pytorch_model.bin and its index), an index file given
by path, and a list of files read tensor for tensor as one; every way an index and its shards can
disagree is one PhalanxError line naming the file (also as derandomized property tests over
indexes and their bytes), and session.load_weights takes each kind of source in one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch import nn

from phalanx import Config, Session
from phalanx.checkpoint.hf_files import ShardedWeights, open_weights, read_index
from phalanx.checkpoint.weights import WeightsFile
from phalanx.errors import PhalanxError

FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=120,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
# Three shards of a small model's tensors, as an index lays them out.
SHARDS = {
    "model-00001-of-00003.safetensors": ["0.weight", "0.bias"],
    "model-00002-of-00003.safetensors": ["1.running_mean", "1.running_var", "1.num_batches_tracked", "1.weight"],
    "model-00003-of-00003.safetensors": ["1.bias", "2.weight", "2.bias"],
}
INDEX = "model.safetensors.index.json"


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 3))


def _weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(11)
    return {k: v.clone() for k, v in _model().state_dict().items()}


def _sharded(directory: Path, weights: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """SHARDS written into ``directory`` with their index; returns the tensors."""
    weights = weights or _weights()
    directory.mkdir(parents=True, exist_ok=True)
    for file, names in SHARDS.items():
        save_file({n: weights[n] for n in names}, directory / file, metadata={"format": "pt"})
    _index(directory, {n: f for f, names in SHARDS.items() for n in names})
    return weights


def _index(directory: Path, weight_map: dict, **extra) -> Path:
    path = directory / INDEX
    path.write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map, **extra}))
    return path


def _in_files(directory: Path, files) -> list[str]:
    """The tensors of ``files``, file after file, each in the order its data lies in."""
    out = []
    for file in files:
        with WeightsFile(directory / file) as reader:
            out += list(reader.index())
    return out


def _read_all(reader) -> dict[str, torch.Tensor]:
    try:
        return {name: reader.read(name) for name in reader.index()}
    finally:
        reader.close()


def _one_line(err: PhalanxError) -> str:
    text = str(err)
    assert "\n" not in text and text.strip() == text and text
    return text


# -- what reads ---------------------------------------------------------------------------------
def test_an_index_reads_every_tensor_exactly_shard_after_shard(tmp_path):
    weights = _sharded(tmp_path)
    reader = open_weights(tmp_path / INDEX)
    assert isinstance(reader, ShardedWeights)
    assert list(reader.index()) == _in_files(tmp_path, SHARDS)  # shard after shard, each in its own order
    assert {k: (tuple(v.shape), v.dtype) for k, v in weights.items()} == reader.index()
    got = _read_all(reader)
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in weights.items())


def test_a_directory_is_read_as_from_pretrained_reads_it(tmp_path):
    weights = _sharded(tmp_path / "sharded")
    assert isinstance(open_weights(tmp_path / "sharded"), ShardedWeights)
    single = tmp_path / "single"
    single.mkdir()
    save_file(weights, single / "model.safetensors")
    _index(single, {"0.weight": "nowhere.safetensors"})  # model.safetensors comes first, as in from_pretrained
    reader = open_weights(single)
    assert isinstance(reader, WeightsFile) and reader.format == "safetensors"
    assert all(torch.equal(v, weights[k]) for k, v in _read_all(reader).items())
    bins = tmp_path / "bins"
    bins.mkdir()
    for file, names in SHARDS.items():
        torch.save({n: weights[n] for n in names}, bins / _bin(file))
    bin_map = {n: _bin(f) for f, names in SHARDS.items() for n in names}
    (bins / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": bin_map}))
    got = _read_all(open_weights(bins))
    assert got.keys() == weights.keys() and all(torch.equal(got[k], v) for k, v in weights.items())
    torch.save(weights, bins / "pytorch_model.bin")  # a single file wins over the index
    assert open_weights(bins).format == "pt"


def _bin(shard: str) -> str:
    return shard.replace("model", "pytorch_model").replace(".safetensors", ".bin")


def test_a_list_of_files_reads_as_one(tmp_path):
    weights = _sharded(tmp_path)
    files = [tmp_path / f for f in SHARDS]
    got = _read_all(open_weights([str(f) for f in reversed(files)]))
    assert list(got) == _in_files(tmp_path, reversed(list(SHARDS)))  # the list's order
    assert all(torch.equal(got[k], v) for k, v in weights.items())
    one = _read_all(open_weights([files[0]]))
    assert list(one) == _in_files(tmp_path, [S1])


def test_a_shard_changed_after_it_was_listed_is_one_line(tmp_path):
    weights = _sharded(tmp_path)
    reader = open_weights(tmp_path / INDEX)
    first = "model-00001-of-00003.safetensors"
    save_file({"0.weight": torch.zeros(2, 2), "0.bias": weights["0.bias"]}, tmp_path / first)
    with pytest.raises(PhalanxError, match=r"changed while it was read \(tensor '0\.weight' is now \(2, 2\)") as err:
        reader.read("0.weight")
    _one_line(err.value)
    reader.close()


# -- what is refused ----------------------------------------------------------------------------
S1, S2, S3 = SHARDS


def _two_copies(d: Path) -> None:
    """Shard 3 also holds 0.bias, which shard 1 holds."""
    save_file({"0.bias": torch.zeros(5), **{n: _weights()[n] for n in SHARDS[S3]}}, d / S3)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: (d / S2).unlink(), f"names shard '{S2}', not found in"),
        (lambda d: _index(d, {**_map(), "extra": S1}), f"puts tensor 'extra' in '{S1}', but no shard holds it"),
        (lambda d: _index(d, {**_map(), "0.bias": S3}), f"puts tensor '0.bias' in '{S3}', but it is in '{S1}'"),
        (lambda d: _index(d, _map(drop="2.bias")), f"shard '{S3}' holds tensor '2.bias', which index"),
        (_two_copies, f"tensor '0.bias' is in two weight files ('{{d}}/{S1}' and '{{d}}/{S3}')"),
        (lambda d: (d / INDEX).write_text("{"), "is not a valid weights index (it is not JSON: "),
        (lambda d: (d / INDEX).write_bytes(b"\xff\xfe"), "is not a valid weights index (it is not JSON: "),
        (lambda d: (d / INDEX).write_text("[1, 2]"), "(it holds a JSON list, not an object)"),
        (lambda d: (d / INDEX).write_text('{"metadata": {}}'), '(it has no "weight_map")'),
        (lambda d: (d / INDEX).write_text('{"weight_map": [1]}'), '("weight_map" is not an object)'),
        (lambda d: (d / INDEX).write_text('{"weight_map": {}}'), '("weight_map" lists no tensors)'),
        (lambda d: _index(d, _map(), metadata=3), '("metadata" is not an object)'),
        (lambda d: _index(d, {**_map(), "0.bias": 7}), """("weight_map" puts '0.bias' in 7, not a file beside"""),
        (lambda d: _index(d, {**_map(), "0.bias": "/etc/passwd"}), "in '/etc/passwd', not a file beside the index"),
        (lambda d: _index(d, {**_map(), "0.bias": "../x.st"}), "in '../x.st', not a file beside the index"),
        (lambda d: (d / INDEX).write_text('{"weight_map": {"a": "x", "a": "y"}}'), "(it gives the key 'a' twice)"),
        (lambda d: (d / S1).write_bytes(b"junk"), f"{S1}' is neither a safetensors nor a torch file"),
    ],
)  # fmt: skip
def test_every_disagreement_of_index_and_shards_is_one_line(tmp_path, change, message):
    _sharded(tmp_path)
    change(tmp_path)
    with pytest.raises(PhalanxError) as err:
        open_weights(tmp_path)
    assert message.format(d=tmp_path) in _one_line(err.value)


def _map(drop: str | None = None) -> dict[str, str]:
    return {n: f for f, names in SHARDS.items() for n in names if n != drop}


def test_what_is_not_a_model_directory_says_what_to_give(tmp_path):
    with pytest.raises(PhalanxError, match="holds none of model.safetensors, model.safetensors.index.json, "):
        open_weights(tmp_path)
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(PhalanxError, match=r"is a phalanx checkpoint, not a model directory; resume from it"):
        open_weights(tmp_path)
    with pytest.raises(PhalanxError, match="the list of weight files is empty"):
        open_weights([])
    with pytest.raises(PhalanxError, match="index file '.*nope.index.json' not found"):
        open_weights(tmp_path / "nope.index.json")
    with pytest.raises(PhalanxError, match="weights file '.*nope.safetensors' not found"):
        open_weights([tmp_path / "nope.safetensors"])


# -- property tests -----------------------------------------------------------------------------
_FILES = [*SHARDS, "missing.safetensors", "../up.safetensors", "", "sub/", 3, None]
_NAMES = [n for names in SHARDS.values() for n in names] + ["extra", ""]
_VALUES = st.one_of(st.none(), st.integers(), st.dictionaries(st.text(max_size=2), st.integers(), max_size=2))


def _mutated(changes: list[tuple[str, str, object]]) -> dict:
    """The true weight map with a few changes: a name dropped, moved to another file, or added."""
    weight_map: dict = _map()
    for change, name, file in changes:
        if change == "drop":
            weight_map.pop(name, None)
        elif change == "drop shard":  # the index names fewer shards: those not named are not read
            weight_map = {n: f for n, f in weight_map.items() if f != file}
        else:
            weight_map[name] = file
    return weight_map


_CHANGES = st.lists(
    st.tuples(st.sampled_from(["drop", "set", "drop shard"]), st.sampled_from(_NAMES), st.sampled_from(_FILES)),
    max_size=2,
)


@FUZZ
@given(
    weight_map=st.one_of(
        st.builds(_mutated, _CHANGES),
        st.dictionaries(st.sampled_from(_NAMES), st.sampled_from(_FILES), max_size=12),
    ),
    keep=st.one_of(st.just(set(SHARDS)), st.sets(st.sampled_from(list(SHARDS)))),
    junk=st.dictionaries(st.sampled_from(["metadata", "weight_map_", "x"]), _VALUES),
)
def test_any_index_reads_the_true_tensors_or_is_one_line(tmp_path_factory, weight_map, keep, junk):
    directory = tmp_path_factory.mktemp("idx")
    weights = _sharded(directory)
    for file in SHARDS:
        if file not in keep:
            (directory / file).unlink()
    (directory / INDEX).write_text(json.dumps({**junk, "weight_map": weight_map}))
    try:
        got = _read_all(open_weights(directory / INDEX))
    except PhalanxError as err:
        _one_line(err)
        event("refused")
        return
    event("loaded")
    # It loaded: then the index was right about every tensor of the shards it names.
    assert got.keys() == weight_map.keys()
    assert all(torch.equal(got[k], weights[k]) for k in got)
    assert all(weight_map[k] in SHARDS and k in SHARDS[weight_map[k]] for k in got)


@FUZZ
@given(raw=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode)))
def test_any_bytes_as_an_index_are_one_line(tmp_path_factory, raw):
    directory = tmp_path_factory.mktemp("raw")
    _sharded(directory)
    (directory / INDEX).write_bytes(raw)
    with pytest.raises(PhalanxError) as err:
        read_index(directory / INDEX)
    _one_line(err.value)


@FUZZ
@given(order=st.permutations(list(SHARDS)), drop=st.sampled_from([None, *SHARDS]))
def test_a_complete_index_loads_whatever_its_order(tmp_path_factory, order, drop):
    directory = tmp_path_factory.mktemp("order")
    weights = _sharded(directory)
    weight_map = {n: f for f in order for n in reversed(SHARDS[f])}
    if drop is not None:  # a shard the index does not name is not read, even though it is there
        weight_map = {n: f for n, f in weight_map.items() if f != drop}
    _index(directory, weight_map)
    got = _read_all(open_weights(directory / INDEX))
    assert list(got) == _in_files(directory, sorted(set(weight_map.values())))
    assert all(torch.equal(got[k], weights[k]) for k in got)


# -- session.load_weights -----------------------------------------------------------------------
def _session(strategy: str = "single") -> Session:
    return Session(Config(), strategy=strategy, train={"progress": False, "metrics": False, "seed": 0})


@pytest.mark.parametrize("kind", ["directory", "index", "list"])
def test_load_weights_takes_a_directory_an_index_or_a_list(tmp_path, kind):
    weights = _sharded(tmp_path)
    source = {
        "directory": tmp_path,
        "index": str(tmp_path / INDEX),
        "list": [str(tmp_path / f) for f in SHARDS],
    }[kind]
    session = _session()
    model = session.setup(_model())
    session.load_weights(source)
    state = session.model_state_dict(model)
    assert all(torch.equal(state[k], v) for k, v in weights.items())
    session.close()


def test_load_weights_reports_a_bad_index_or_a_mismatch_in_one_line(tmp_path):
    _sharded(tmp_path)
    session = _session()
    session.setup(_model())
    _index(tmp_path, _map(drop="2.bias"))
    with pytest.raises(PhalanxError, match="holds tensor '2.bias', which index") as err:
        session.load_weights(tmp_path)
    _one_line(err.value)
    (tmp_path / S3).unlink()
    _index(tmp_path, {n: f for n, f in _map().items() if f != S3})
    with pytest.raises(PhalanxError, match=rf"'{tmp_path}' does not match the model: 3 keys of the model missing"):
        session.load_weights(tmp_path)
    shards = [str(tmp_path / f) for f in list(SHARDS)[:2]]
    with pytest.raises(
        PhalanxError, match=r"the set of 2 weight files \('.*00001-of-00003.safetensors', \.\.\.\) does not match"
    ):
        session.load_weights(shards)
    session.load_weights(shards, strict=False)
    with pytest.raises(PhalanxError, match="or a list of weight files, not a list holding int"):
        session.load_weights([str(tmp_path / INDEX), 3])
    session.close()
