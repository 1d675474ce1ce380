"""Property-based (issue 15): random JSON, mutations of a real manifest (keys deleted, values of
other types, huge integers, NaN and Infinity, strings with odd characters, damaged bytes) and random
``latest`` contents never make the checkpoint reader, ``resolve``/``latest``, ``phalanx checkpoint
info`` or ``export`` raise anything but a PhalanxError: the result is valid or one error line.
Derandomized and bounded, so the same examples run everywhere in a few seconds."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from phalanx.checkpoint import files
from phalanx.checkpoint.export import export
from phalanx.cli.main import main
from phalanx.errors import PhalanxError
from tests.helpers.checkpoints import saved_checkpoint

NEWEST, OLDER = "step-00000010", "step-00000005"
FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=150,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A checkpoint directory (step 5 and step 10) whose newest manifest and ``latest`` each example
    rewrites; the data files stay as saved."""
    original = saved_checkpoint(tmp_path_factory.mktemp("fuzz")).parent
    work = original.parent / "work"
    shutil.copytree(original, work)
    return work


def _good(root: Path) -> dict[str, Any]:
    return json.loads((root.parent / "ckpt" / NEWEST / files.MANIFEST).read_text())


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key and index path into ``value`` (the valid manifest), the root excluded."""
    out = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        out.append((*prefix, key))
        out.extend(_paths(child, (*prefix, key)))
    return out


odd_text = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF), max_size=12)
numbers = (
    st.integers()
    | st.sampled_from([-1, 0, 1, 2, 2**63 - 1, 2**63, 2**64, 10**400, -(10**400)])
    | st.floats(allow_nan=True, allow_infinity=True)
)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | numbers
    | odd_text
    | st.sampled_from(["plain", "dcp", "phalanx-checkpoint", "model.pt"]),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(odd_text, children, max_size=4),
    max_leaves=12,
)


def _set(manifest: Any, path: tuple, value: Any, delete: bool) -> None:
    *parents, last = path
    target = manifest
    for key in parents:
        target = target[key]
    if delete:
        del target[last]
    else:
        target[last] = value


def _check_everything(root: Path, out: Path) -> None:
    """The property: each entry point returns a valid result or raises one PhalanxError line, and
    the CLI exits 0 or 2 with one ``phalanx: error:`` line (anything else propagates: a failure)."""
    found = files.latest(root)
    assert found in {f.path for f in files.complete(root)}
    try:
        manifest = files.read_manifest(files.resolve(root))
    except PhalanxError as err:
        assert "\n" not in str(err) and str(err)
        event("manifest refused")
    else:
        assert manifest["path"] == str(found.resolve())
        event("manifest accepted")
    stderr = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
        codes = [main(["checkpoint", "info", *flag, str(root)]) for flag in ([], ["--no-verify"], ["--json"])]
    assert set(codes) <= {0, 2}, codes
    lines = stderr.getvalue().splitlines()
    assert len(lines) == codes.count(2) and all(line.startswith("phalanx: error: ") for line in lines), lines
    try:
        export(root, out)
    except PhalanxError as err:
        assert "\n" not in str(err)


@FUZZ
@given(value=json_values)
def test_any_json_value_as_the_manifest(root, value):
    (root / NEWEST / files.MANIFEST).write_text(json.dumps(value))
    (root / files.LATEST).write_text(NEWEST + "\n")
    _check_everything(root, root.parent / "out.pt")


def _like(original: Any) -> st.SearchStrategy:
    """Values of the type ``original`` has: they pass the type checks and reach the code past them."""
    if isinstance(original, bool) or original is None:
        return st.none() | st.booleans()
    if isinstance(original, int):
        return st.integers() | st.sampled_from([-1, 0, 2**63 - 1, 2**63, 10**400])
    if isinstance(original, str):
        return odd_text | st.sampled_from(["plain", "dcp", "model.pt", "shards/.metadata", "", "../x"])
    return st.just(type(original)())


@FUZZ
@given(data=st.data())
def test_mutated_manifest(root, data):
    manifest = _good(root)
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        path = data.draw(st.sampled_from(_paths(manifest)), label="path")
        kind = data.draw(st.sampled_from(["delete", "any value", "same type"]), label="kind")
        original = manifest
        for key in path:
            original = original[key]
        value = data.draw(json_values if kind == "any value" else _like(original), label="value")
        _set(manifest, path, value, kind == "delete")
    (root / NEWEST / files.MANIFEST).write_text(json.dumps(manifest))
    (root / files.LATEST).write_text(NEWEST + "\n")
    _check_everything(root, root.parent / "out.pt")


@FUZZ
@given(data=st.data())
def test_manifest_with_damaged_bytes(root, data):
    raw = bytearray(json.dumps(_good(root), indent=1).encode())
    kind = data.draw(st.sampled_from(["truncate", "flip", "insert", "literal"]), label="kind")
    at = data.draw(st.integers(0, len(raw) - 1), label="at")
    if kind == "truncate":
        del raw[at:]
    elif kind == "flip":
        raw[at] ^= data.draw(st.integers(1, 255), label="bits")
    elif kind == "insert":
        raw[at:at] = data.draw(st.binary(min_size=1, max_size=8), label="bytes")
    else:  # a number literal replaced: NaN, Infinity, too many digits, an exponent out of range
        digits = [i for i, b in enumerate(raw) if chr(b).isdigit()]
        i = digits[at % len(digits)]
        literal = data.draw(st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"1e400", b"9" * 5000, b"-0"]))
        raw[i : i + 1] = literal
    (root / NEWEST / files.MANIFEST).write_bytes(bytes(raw))
    (root / files.LATEST).write_text(NEWEST + "\n")
    _check_everything(root, root.parent / "out.pt")


pointers = (
    st.binary(max_size=300)
    | st.sampled_from(
        [NEWEST, OLDER, f"{OLDER}\n", f"./{OLDER}", f"../ckpt/{OLDER}", "/", "latest", ".incomplete-"]
    ).map(str.encode)
    | odd_text.map(lambda t: t.encode("utf-8", "surrogatepass"))
)


@FUZZ
@given(content=pointers)
def test_random_latest(root, content):
    (root / NEWEST / files.MANIFEST).write_text(json.dumps(_good(root)))
    (root / files.LATEST).write_bytes(content)
    try:
        named = content.decode("utf-8").strip()
    except UnicodeDecodeError:
        named = None
    expected = root / (OLDER if named == OLDER else NEWEST)  # only a bare step name counts
    assert files.latest(root) == expected
    assert files.resolve(root) == expected == files.resolve(root / files.LATEST)
    assert files.read_manifest(expected)["path"] == str(expected.resolve())
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(["checkpoint", "info", "--no-verify", str(root / files.LATEST)]) == 0
    assert str(expected) in "".join(stdout.getvalue().split())  # rich may wrap a long path
