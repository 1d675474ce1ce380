"""WeightsFile reads pretrained-weights files (.safetensors, torch's .pt) one tensor at a time, bit for
bit; write_safetensors writes them atomically. Damaged, truncated and foreign files are one
PhalanxError line (also as a derandomized property test), and reading a safetensors file one tensor
at a time costs about one tensor of resident memory, not the file."""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load as reference_load
from safetensors.torch import load_file, save_file

from phalanx.checkpoint import weights as weights_module
from phalanx.checkpoint.weights import WeightsFile, write_safetensors
from phalanx.errors import PhalanxError

FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=150,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
not_as_root = pytest.mark.skipif(os.geteuid() == 0, reason="root reads whatever the permissions say")

# Every dtype safetensors defines that this torch has (sub-byte F4/F6 have no one-value-per-element dtype).
DTYPES = [
    getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
        "uint16", "uint32", "uint64", "complex64",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
]  # fmt: skip


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bytes of ``dtype`` (every bit pattern: NaNs, subnormals), bools 0 or 1."""
    g = torch.Generator().manual_seed(seed)
    count = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 2 if dtype == torch.bool else 256, (count,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and _bits(a) == _bits(b)


def _state() -> dict[str, torch.Tensor]:
    return {
        f"layer{i}.{dtype}".replace("torch.", ""): _random((3, i + 1), dtype, seed=i) for i, dtype in enumerate(DTYPES)
    } | {"scalar": torch.tensor(2.5), "empty": torch.empty(0), "empty2d": torch.empty(3, 0, 2, dtype=torch.int64)}


def _refused(path: Path, *pieces: str) -> str:
    with pytest.raises(PhalanxError) as caught:
        WeightsFile(path)
    text = str(caught.value)
    assert "\n" not in text and str(path) in text and all(p in text for p in pieces), text
    return text


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_bit_for_bit(tmp_path, dtype):
    tensors = {"a": _random((4, 5), dtype), "b": _random((7,), dtype, seed=1)}
    save_file(tensors, tmp_path / "w.safetensors")
    torch.save(tensors, tmp_path / "w.pt")
    for name, fmt in (("w.safetensors", "safetensors"), ("w.pt", "pt")):
        with WeightsFile(tmp_path / name) as weights:
            assert weights.format == fmt
            assert weights.index() == {k: (tuple(v.shape), dtype) for k, v in tensors.items()}
            for key, tensor in tensors.items():
                got = weights.read(key)
                assert got.device.type == "cpu" and _same(got, tensor), (name, key)


def test_index_order_shapes_and_empty_tensors(tmp_path):
    state = _state()
    save_file(state, tmp_path / "w.safetensors")
    content = (tmp_path / "w.safetensors").read_bytes()
    header = json.loads(content[8 : 8 + int.from_bytes(content[:8], "little")])
    header.pop("__metadata__", None)
    by_offset = sorted(header, key=lambda k: tuple(header[k]["data_offsets"]))
    with WeightsFile(tmp_path / "w.safetensors") as weights:
        index = weights.index()
        assert list(index) == by_offset  # where the data lies: one sequential pass over the file
        assert index["scalar"] == ((), torch.float32) and index["empty2d"] == ((3, 0, 2), torch.int64)
        for name in index:
            assert _same(weights.read(name), state[name]), name
    torch.save(state, tmp_path / "w.pt")
    with WeightsFile(tmp_path / "w.pt") as weights:
        assert list(weights.index()) == list(state)  # the mapping's own order
        assert all(_same(weights.read(k), v) for k, v in state.items())


def test_a_read_tensor_has_its_own_memory(tmp_path):
    torch.save({"w": torch.arange(6.0).reshape(2, 3).t()}, tmp_path / "w.pt")  # a transposed view on disk
    weights = WeightsFile(tmp_path / "w.pt")
    first, second = weights.read("w"), weights.read("w")
    assert first.is_contiguous() and first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    assert torch.equal(first, torch.arange(6.0).reshape(2, 3).t())
    weights.close()
    first.add_(1)  # still usable after close: not a view of the mapping
    with pytest.raises(PhalanxError, match="is closed"):
        weights.read("w")


def test_a_state_dict_under_one_key_is_read_and_a_training_checkpoint_is_refused(tmp_path):
    state = {"w": torch.ones(2), "b": torch.zeros(1)}
    for key in ("state_dict", "model"):
        torch.save({key: state}, tmp_path / f"{key}.pt")
        with WeightsFile(tmp_path / f"{key}.pt") as weights:
            assert list(weights.index()) == ["w", "b"]
    torch.save({"model": state, "optimizer": {"lr": 0.1}}, tmp_path / "train.pt")
    _refused(
        tmp_path / "train.pt",
        "holds a dict with keys 'model', 'optimizer', not a state dict of tensors; save model.state_dict() alone, "
        "or export it with `phalanx checkpoint export`",
    )
    torch.save([state], tmp_path / "list.pt")
    _refused(tmp_path / "list.pt", "holds a list of 1 item(s)")
    torch.save(torch.ones(3), tmp_path / "tensor.pt")
    _refused(tmp_path / "tensor.pt", "holds a single tensor")
    torch.save({"w": torch.ones(2), "step": 3}, tmp_path / "mixed.pt")
    _refused(tmp_path / "mixed.pt", "holds a dict with keys 'w', 'step'")
    torch.save({1: torch.ones(2)}, tmp_path / "intkey.pt")
    _refused(tmp_path / "intkey.pt", "holds a dict with keys '1'")


def test_the_format_comes_from_the_content_not_the_name(tmp_path):
    state = {"w": _random((2, 2), torch.float16)}
    torch.save(state, tmp_path / "torch.safetensors")
    save_file(state, tmp_path / "safetensors.pt")
    for name, fmt in (("torch.safetensors", "pt"), ("safetensors.pt", "safetensors")):
        with WeightsFile(tmp_path / name) as weights:
            assert weights.format == fmt and _same(weights.read("w"), state["w"])


def test_legacy_torch_files_are_read_whole(tmp_path):
    state = {"w": _random((3, 3), torch.float32)}
    torch.save(state, tmp_path / "legacy.bin", _use_new_zipfile_serialization=False)
    with WeightsFile(tmp_path / "legacy.bin") as weights:
        assert weights.format == "pt" and _same(weights.read("w"), state["w"])


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_torch_file_with_code_is_refused_and_not_run(tmp_path):
    payload = _Payload()
    payload.marker = tmp_path / "pwned"
    torch.save({"w": payload}, tmp_path / "evil.pt")
    _refused(tmp_path / "evil.pt", "holds Python objects other than tensors", "does not unpickle them")
    (tmp_path / "evil.pkl").write_bytes(pickle.dumps(payload, protocol=2))  # a legacy-looking pickle
    _refused(tmp_path / "evil.pkl", "holds Python objects other than tensors")
    assert not payload.marker.exists()


def test_paths_that_are_not_weights_files(tmp_path):
    _refused(tmp_path / "nothere.safetensors", "not found; give the path of a .safetensors or .pt file")
    _refused(tmp_path, "is a directory")
    os.mkfifo(tmp_path / "fifo")
    _refused(tmp_path / "fifo", "is not a regular file")  # not opened: that would block
    (tmp_path / "empty.pt").write_bytes(b"")
    _refused(tmp_path / "empty.pt", "is neither a safetensors nor a torch file (it starts with nothing)")
    (tmp_path / "text.safetensors").write_text("hello, this is a text file")
    _refused(tmp_path / "text.safetensors", "is neither a safetensors nor a torch file (it starts with 68 65 6c")
    with zipfile.ZipFile(tmp_path / "other.pt", "w") as archive:
        archive.writestr("readme.txt", "not torch")
    _refused(tmp_path / "other.pt", "is not a loadable torch weights file")


@not_as_root
def test_an_unreadable_file(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.ones(1)}, path)
    path.chmod(0)
    try:
        _refused(path, "cannot read weights file", "(Permission denied); check that it exists and that you may read it")
    finally:
        path.chmod(0o644)


def _file(header: object, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


GOOD_ENTRY = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (_file({"w": GOOD_ENTRY}, bytes(8), length=200_000_000), "over the format's limit of 100,000,000"),
        (
            _file({"w": GOOD_ENTRY}, bytes(8), length=5000),
            "is truncated or damaged (its header claims 5,000 bytes, the file has",
        ),
        (_file(b"{not json}"), "its header is not JSON"),
        (_file(b'{"w": \xff}'), "its header is not JSON"),
        (_file(b"[1, 2]"), "is neither a safetensors nor a torch file"),  # no { at byte 8
        (_file(b'{"a": 1, "a": 2}'), "the key 'a' appears twice"),
        (_file({"w": 3}), "the entry of tensor 'w' is not an object"),
        (_file({"w": {"shape": [2], "data_offsets": [0, 8]}}, bytes(8)), "tensor 'w' has no \"dtype\""),
        (_file({"w": {"dtype": "F32", "data_offsets": [0, 8]}}, bytes(8)), "tensor 'w' has no \"shape\""),
        (_file({"w": {"dtype": "F32", "shape": [2]}}, bytes(8)), "tensor 'w' has no \"data_offsets\""),
        (_file({"w": GOOD_ENTRY | {"dtype": 7}}, bytes(8)), "the \"dtype\" of tensor 'w' is not a string"),
        (_file({"w": GOOD_ENTRY | {"dtype": "F4"}}, bytes(8)), "tensor 'w' has dtype 'F4', which phalanx cannot read"),
        (_file({"w": GOOD_ENTRY | {"shape": [-2]}}, bytes(8)), "the \"shape\" of tensor 'w' is not a list of whole"),
        (_file({"w": GOOD_ENTRY | {"shape": [2.0]}}, bytes(8)), "is not a list of whole numbers"),
        (_file({"w": GOOD_ENTRY | {"shape": [True, 2]}}, bytes(8)), "is not a list of whole numbers"),
        (_file({"w": GOOD_ENTRY | {"shape": 2}}, bytes(8)), "is not a list of whole numbers"),
        (_file({"w": GOOD_ENTRY | {"data_offsets": [0]}}, bytes(8)), "are not two whole numbers"),
        (_file({"w": GOOD_ENTRY | {"data_offsets": [8, 0]}}, bytes(8)), "lies at bytes 8..0 of the data"),
        (
            _file({"w": GOOD_ENTRY | {"data_offsets": [0, 16]}}, bytes(8)),
            "lies at bytes 0..16 of the data, which holds 8",
        ),
        (_file({"w": GOOD_ENTRY | {"shape": [3]}}, bytes(8)), "needs 12 bytes, its offsets hold 8"),
        (_file({"w": GOOD_ENTRY | {"shape": [0, 2**62, 2**62], "data_offsets": [0, 0]}}), "too large for torch"),
        (_file({"w": GOOD_ENTRY}, bytes(12)), "its tensors cover 8 bytes of data, the file holds 12"),
        (
            _file({"w": GOOD_ENTRY, "v": GOOD_ENTRY | {"data_offsets": [12, 20]}}, bytes(20)),
            "tensor 'v' starts at byte 12 of the data, not at 8",
        ),
        (_file({"w": GOOD_ENTRY, "__metadata__": {"a": 1}}, bytes(8)), '"__metadata__" is not an object of strings'),
        (
            _file({"w": GOOD_ENTRY}, bytes(4)),
            "truncated or damaged (tensor 'w' lies at bytes 0..8 of the data, which holds 4",
        ),
    ],
)
def test_damaged_safetensors_files_are_one_line(tmp_path, content, problem):
    path = tmp_path / "w.safetensors"
    path.write_bytes(content)
    text = _refused(path, problem)
    assert text.endswith("give a complete .safetensors or .pt weights file"), text


def test_odd_but_valid_safetensors_files(tmp_path):
    path = tmp_path / "w.safetensors"
    path.write_bytes(_file({}))
    assert WeightsFile(path).index() == {}
    empty = GOOD_ENTRY | {"data_offsets": [8, 8], "shape": [0]}  # after w, at the same offset as w's end
    path.write_bytes(_file({"__metadata__": None, "w": GOOD_ENTRY, "e": empty}, struct.pack("<2f", 1, 2)))
    with WeightsFile(path) as weights:
        assert list(weights.index()) == ["w", "e"]
        assert weights.read("w").tolist() == [1.0, 2.0] and weights.read("e").shape == (0,)
        with pytest.raises(PhalanxError, match="holds no tensor named 'x'"):
            weights.read("x")


def test_write_safetensors_copies_shared_and_strided_tensors(tmp_path):
    base = torch.arange(24.0).reshape(4, 6)
    linear = torch.nn.Linear(3, 3)
    state = {
        "tied.a": linear.weight,  # a parameter, shared with the next entry (safetensors refuses those)
        "tied.b": linear.weight,
        "transposed": base.t(),
        "rows": base[1:3],  # a contiguous view into a larger storage
        "column": base[:, 2],
        "scalar": torch.tensor(7, dtype=torch.int8),
        "empty": torch.empty(0, 3),
    }
    out = tmp_path / "w.safetensors"
    write_safetensors(state, out, {"format": "pt", "note": "x"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]  # no temporary file left
    loaded = load_file(out)
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k].detach()) for k in state)
    with safe_open(out, "pt") as fh:
        assert fh.metadata() == {"format": "pt", "note": "x"}
    with WeightsFile(out) as weights:
        assert all(_same(weights.read(k), state[k].detach()) for k in state)


def test_write_safetensors_refusals_leave_no_file(tmp_path, monkeypatch):
    out = tmp_path / "w.safetensors"
    with pytest.raises(PhalanxError, match=r"tensor 'c' has dtype torch.complex128, which safetensors cannot hold"):
        write_safetensors({"c": torch.ones(2, dtype=torch.complex128)}, out)
    out.write_bytes(b"the previous file")

    def full_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half")
        raise weights_module.SafetensorError("Error while serializing: IoError(No space left on device)")

    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(PhalanxError) as caught:
        write_safetensors({"w": torch.ones(2)}, out)
    assert str(caught.value) == (
        f"cannot write '{out}' (Error while serializing: IoError(No space left on device)); "
        "choose an output path in a writable directory with enough free space"
    )
    assert out.read_bytes() == b"the previous file" and sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]


# --- property tests: whatever the bytes, a correct read or one PhalanxError line -------------------------


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("weights-fuzz")


def _valid_safetensors() -> bytes:
    state = {"a": _random((2, 3), torch.float32), "b": _random((5,), torch.int8, 1), "c": torch.empty(0, 2)}
    state["d"] = _random((), torch.bfloat16, 2)
    return _file_bytes(state)


def _file_bytes(state: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save(state, metadata={"format": "pt"})


def _check(path: Path, content: bytes) -> str:
    """The property. Where the file opens, every tensor reads with the index's shape and dtype and the
    bytes the reference implementation reads (for safetensors); otherwise one PhalanxError line."""
    path.write_bytes(content)
    try:
        weights = WeightsFile(path)
    except PhalanxError as err:
        assert "\n" not in str(err) and str(path) in str(err), str(err)
        _event("refused")
        return "refused"
    with weights:
        index = weights.index()
        tensors = {name: weights.read(name) for name in index}
        assert {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()} == index
        if weights.format == "safetensors":
            reference = reference_load(content)  # what we accept, the reference accepts, with the same bytes
            assert reference.keys() == tensors.keys() and all(_same(reference[k], tensors[k]) for k in tensors)
    _event(f"read {weights.format}")
    return "read"


def _event(what: str) -> None:
    if currently_in_test_context():  # _check runs in plain loops too
        event(what)


def test_every_truncation_of_a_safetensors_file_is_refused(work):
    content = _valid_safetensors()
    for cut in range(len(content)):
        assert _check(work / "cut.safetensors", content[:cut]) == "refused", cut
    assert _check(work / "cut.safetensors", content) == "read"


def test_every_truncation_of_a_torch_file_is_refused(work):
    buffer = work / "full.pt"
    torch.save({"a": torch.ones(3), "b": torch.arange(4)}, buffer)
    content = buffer.read_bytes()
    for cut in range(0, len(content), 7):
        assert _check(work / "cut.pt", content[:cut]) == "refused", cut


@FUZZ
@given(data=st.data())
def test_damaged_header_bytes(work, data):
    content = bytearray(_valid_safetensors())
    end = 8 + int.from_bytes(content[:8], "little")
    for _ in range(data.draw(st.integers(1, 4), label="damages")):
        at = data.draw(st.integers(0, end - 1), label="at")
        kind = data.draw(st.sampled_from(["flip", "digit", "insert", "delete"]), label="kind")
        if kind == "flip":
            content[at] ^= data.draw(st.integers(1, 255), label="bits")
        elif kind == "digit":  # a number in the header changed: offsets and shapes that still parse
            digits = [i for i in range(8, end) if chr(content[i]).isdigit()]
            content[digits[at % len(digits)]] = ord(data.draw(st.sampled_from("0123456789"), label="digit"))
        elif kind == "insert":
            content[at:at] = data.draw(st.binary(min_size=1, max_size=4), label="bytes")
        else:
            del content[at]
    _check(work / "damaged.safetensors", bytes(content))


entry_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 40)
    | st.sampled_from([2**63, 2**64, 10**30, -(2**63)])
    | st.floats(allow_nan=True)
    | st.sampled_from(["F32", "I8", "BF16", "F4", "U8", "", "BOOL"])
    | st.text(max_size=6),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)


@FUZZ
@given(data=st.data())
def test_mutated_header_entries(work, data):
    """The header re-encoded with a correct length: the checks past the JSON parse are reached."""
    content = _valid_safetensors()
    length = int.from_bytes(content[:8], "little")
    header, body = json.loads(content[8 : 8 + length]), content[8 + length :]
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        name = data.draw(st.sampled_from(sorted(header)), label="name")
        if name == "__metadata__" or data.draw(st.booleans(), label="whole entry"):
            header[name] = data.draw(entry_values, label="entry")
        elif isinstance(header[name], dict):
            key = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]), label="key")
            if data.draw(st.booleans(), label="delete"):
                header[name].pop(key, None)
            else:
                header[name][key] = data.draw(entry_values, label="value")
    raw = json.dumps(header).encode()
    _check(work / "mutated.safetensors", struct.pack("<Q", len(raw)) + raw + body)


@FUZZ
@given(
    content=st.binary(max_size=600)
    | st.tuples(st.sampled_from([b"PK\x03\x04", b"\x80\x02", b"\x80"]), st.binary(max_size=300)).map(b"".join)
    | st.tuples(st.integers(0, 300), st.binary(max_size=300)).map(lambda t: struct.pack("<Q", t[0]) + b"{" + t[1])
)
def test_random_bytes(work, content):
    _check(work / "random.bin", content)


# --- memory: one tensor at a time costs about one tensor -------------------------------------------------

_MEMORY_PROBE = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import torch

    from phalanx.checkpoint.weights import WeightsFile

    def peak():
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

    total = int(torch.ones(4096)[::1024].sum()) * 0  # torch's kernel code paged in before the peak is reset
    with WeightsFile(sys.argv[1]) as weights:
        Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
        before = peak()
        for name in weights.index():
            tensor = weights.read(name)
            total += int(tensor[::1024].sum())  # one value of each page, as a check that it was read
            del tensor
        print(peak() - before, total)
    """
)


def test_reading_one_tensor_at_a_time_costs_about_one_tensor(tmp_path):
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pytest.skip("this kernel does not let a process reset its peak resident memory (/proc/self/clear_refs)")
    tensor_bytes = 8 << 20
    state = {f"t{i}": torch.full((tensor_bytes // 4,), float(i + 1)) for i in range(8)}  # 64 MiB in all
    path = tmp_path / "big.safetensors"
    save_file(state, path)
    del state
    result = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, str(path)], capture_output=True, text=True, timeout=120, check=True
    )
    grown, total = (int(x) for x in result.stdout.split())
    assert total == sum(2048 * (i + 1) for i in range(8))
    assert grown < 3 * tensor_bytes, f"peak RSS grew by {grown / 2**20:.1f} MiB reading a 64 MiB file"
