"""Every damaged or hostile checkpoint input is one PhalanxError line, never a traceback (issue 15):
the manifest, the ``latest`` pointer and export's output path, through the library functions, the
CLI (``phalanx checkpoint info`` and ``export``, in this process) and the Session's loading path.
The numbered tests are the cases an outside tester found ending in a traceback."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from phalanx.checkpoint import export as export_module
from phalanx.checkpoint import files
from phalanx.checkpoint.export import export, open_checkpoint
from phalanx.cli.main import main
from phalanx.errors import PhalanxError
from tests.helpers.checkpoints import checkpointed_session, saved_checkpoint, train_through

NEWEST, OLDER = "step-00000010", "step-00000005"
not_as_root = pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes whatever the permissions say")


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    """One run's checkpoint directory: step-00000005 and step-00000010, ``latest`` naming the second."""
    return saved_checkpoint(tmp_path_factory.mktemp("original")).parent


@pytest.fixture
def ck(original, tmp_path) -> Path:
    root = tmp_path / "ck"
    shutil.copytree(original, root)
    return root


def _manifest_path(root: Path) -> Path:
    return root / NEWEST / files.MANIFEST


def _good(root: Path) -> dict:
    return json.loads(_manifest_path(root).read_text())


def _write(root: Path, manifest) -> None:
    _manifest_path(root).write_text(json.dumps(manifest))


def _cli(capsys, *args: str, code: int = 2) -> str:
    """``phalanx checkpoint ARGS`` in this process; the one line it printed to stderr."""
    capsys.readouterr()
    assert main(["checkpoint", *args]) == code
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    if code == 0:
        return captured.out
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("phalanx: error: "), captured.err
    return lines[0]


def _load_into_fresh(tmp_path: Path, path: Path) -> None:
    session, _, _ = checkpointed_session(tmp_path / "other")
    try:
        session.load(path)
    finally:
        session.close()


def _refused(capsys, tmp_path: Path, target: Path, *pieces: str) -> str:
    """``target`` is refused with the same one line by resolve + read_manifest, open_checkpoint, both
    CLI commands and session.load(); that line holds every one of ``pieces``."""
    with pytest.raises(PhalanxError) as caught:
        files.read_manifest(files.resolve(target))
    text = str(caught.value)
    assert "\n" not in text and all(piece in text for piece in pieces), text
    with pytest.raises(PhalanxError, match=re.escape(text)):
        open_checkpoint(target)
    out = tmp_path / "exported.pt"
    for args in (["info", str(target)], ["info", "--no-verify", str(target)], ["export", str(target), str(out)]):
        assert _cli(capsys, *args) == f"phalanx: error: {text}"
    assert not out.exists()
    with pytest.raises(PhalanxError, match=re.escape(text)):
        _load_into_fresh(tmp_path, target)
    return text


def _damaged(root: Path, what: str) -> tuple[str, ...]:
    """The pieces of the line for a damaged manifest of the newest checkpoint of ``root``."""
    return (
        f"checkpoint manifest '{_manifest_path(root)}' is damaged ({what}",
        f"use the previous checkpoint: {root / OLDER}",
    )


# ---------------------------------------------------------------- the cases found by the tester


def test_case1_version_that_is_not_a_number(capsys, tmp_path, ck):
    _write(ck, _good(ck) | {"version": "abc"})
    _refused(capsys, tmp_path, ck, *_damaged(ck, '"version" is "abc", not a format version this phalanx reads (1)'))


def test_case2_manifest_without_models(capsys, tmp_path, ck):
    manifest = _good(ck)
    del manifest["models"]
    _write(ck, manifest)
    _refused(capsys, tmp_path, ck, *_damaged(ck, '"models" is missing'))


@pytest.mark.parametrize(
    "change, what",
    [
        (lambda f: [], '"files" is a list, not an object'),
        (lambda f: "model.pt", '"files" is "model.pt", not an object'),
        (lambda f: 4, '"files" is 4, not an object'),
        (lambda f: None, '"files" is null, not an object'),
        (lambda f: f | {"model.pt": 3}, 'files["model.pt"] is 3, not an object'),
        (lambda f: f | {"model.pt": [1, 2]}, 'files["model.pt"] is a list, not an object'),
        (lambda f: f | {"model.pt": {"sha256": f["model.pt"]["sha256"]}}, 'files["model.pt"].bytes is missing'),
        (lambda f: f | {"model.pt": {"bytes": f["model.pt"]["bytes"]}}, 'files["model.pt"].sha256 is missing'),
        (lambda f: f | {"model.pt": f["model.pt"] | {"bytes": "2653"}}, 'files["model.pt"].bytes is "2653"'),
        (lambda f: f | {"model.pt": f["model.pt"] | {"bytes": -1}}, 'files["model.pt"].bytes is -1'),
        (lambda f: f | {"model.pt": f["model.pt"] | {"sha256": "xyz"}}, 'files["model.pt"].sha256 is "xyz"'),
        (lambda f: f | {"../../../etc/passwd": f["rng.pt"]}, 'files["../../../etc/passwd"] is not a file inside'),
        (lambda f: f | {"/etc/passwd": f["rng.pt"]}, 'files["/etc/passwd"] is not a file inside'),
        (lambda f: {k: v for k, v in f.items() if k != "model.pt"}, '"files" does not list model.pt'),
    ],
    ids=[
        "list",
        "string",
        "number",
        "null",
        "entry-number",
        "entry-list",
        "no-bytes",
        "no-sha256",
        "bytes-string",
        "bytes-negative",
        "sha256-not-hex",
        "name-outside",
        "name-absolute",
        "model-not-listed",
    ],
)
def test_case3_files_of_the_wrong_shape(capsys, tmp_path, ck, change, what):
    manifest = _good(ck)
    _write(ck, manifest | {"files": change(manifest["files"])})
    _refused(capsys, tmp_path, ck, *_damaged(ck, what))


def test_case4_deeply_nested_manifest(capsys, tmp_path, ck):
    good = _good(ck)
    _manifest_path(ck).write_text("[" * 100_000 + "]" * 100_000)
    _refused(capsys, tmp_path, ck, *_damaged(ck, "nested too deeply to be one"))
    # Shallow enough for the parser, deeper than any manifest: refused before anything walks it.
    nested: list = []
    for _ in range(200):
        nested = [nested]
    _write(ck, good | {"extra": nested})
    _refused(capsys, tmp_path, ck, *_damaged(ck, "it nests more than 16 levels deep"))


def test_case5_latest_that_is_not_utf8(capsys, tmp_path, ck):
    (ck / files.LATEST).write_bytes(b"\xff\xfe")
    # Like a missing pointer: the newest complete checkpoint, for the library, the CLI and a resume.
    assert files.latest(ck) == ck / NEWEST
    assert files.resolve(ck / files.LATEST) == ck / NEWEST
    assert open_checkpoint(ck / files.LATEST)["step"] == 10
    assert str(ck / NEWEST) in _cli(capsys, "info", str(ck / files.LATEST), code=0)
    session, model, loader = checkpointed_session(ck, resume="auto")
    train_through(session, model, loader)
    session.close()
    assert f"resumed from {(ck / NEWEST).resolve()}: step 10" in capsys.readouterr().out


@pytest.mark.parametrize(
    "content",
    [
        b"../elsewhere/step-00000005\n",  # a complete checkpoint, outside the directory
        b"ELSEWHERE",  # its absolute path
        b"",
        b"\n",
        b"step-00000005\nstep-00000010\n",
        b"step-0000\x000005\n",
        b"step-00000005" + b" " * 300,  # longer than any pointer
        b"step-00000007\n",  # no such checkpoint
        b".incomplete-step-00000012\n",  # a save in progress, manifest already written
        b".\n",
        b"..\n",
        b"latest\n",
    ],
    ids=[
        "outside",
        "absolute",
        "empty",
        "newline",
        "two-lines",
        "nul",
        "too-long",
        "stale",
        "incomplete",
        "dot",
        "dotdot",
        "itself",
    ],
)
def test_case5_latest_that_names_no_checkpoint_of_its_directory(capsys, tmp_path, original, ck, content):
    shutil.copytree(original, tmp_path / "elsewhere")
    staging = files.staging_path(ck, 12)
    shutil.copytree(ck / NEWEST, staging)
    (ck / files.LATEST).write_bytes(content.replace(b"ELSEWHERE", str(tmp_path / "elsewhere" / OLDER).encode()))
    assert files.latest(ck) == ck / NEWEST
    assert files.resolve(ck / files.LATEST) == ck / NEWEST
    assert files.resolve(ck) == ck / NEWEST
    assert str(ck / NEWEST) in _cli(capsys, "info", str(ck / files.LATEST), code=0)
    files.prune(ck, 1)  # the pointer protects nothing it does not name
    assert [f.path.name for f in files.complete(ck)] == [NEWEST] and not staging.exists()


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_case5_latest_that_is_not_a_file(ck, kind):
    (ck / files.LATEST).unlink()
    if kind == "directory":
        (ck / files.LATEST).mkdir()
    else:
        os.mkfifo(ck / files.LATEST)  # an open() of it would block: never opened
    assert files.latest(ck) == ck / NEWEST
    assert files.resolve(ck) == ck / NEWEST


def test_case5_garbage_latest_without_any_checkpoint(capsys, tmp_path):
    root = tmp_path / "empty"
    root.mkdir()
    (root / files.LATEST).write_bytes(b"\xff\xfe")
    assert files.latest(root) is None
    line = _cli(capsys, "info", str(root / files.LATEST))
    assert line == (
        f"phalanx: error: '{root / files.LATEST}' names no complete checkpoint and '{root}' holds none; "
        "give a checkpoint directory (e.g. checkpoints/step-00000120)"
    )
    session, model, loader = checkpointed_session(root, resume="auto")  # nothing to resume: starts afresh
    train_through(session, model, loader)
    session.close()
    assert session.step_count == 10


def _export_refused(capsys, ck: Path, out: Path, *pieces: str) -> str:
    with pytest.raises(PhalanxError) as caught:
        export(ck, out)
    text = str(caught.value)
    assert all(piece in text for piece in pieces), text
    assert _cli(capsys, "export", str(ck), str(out)) == f"phalanx: error: {text}"
    return text


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if "phalanx-export" in p.name or p.suffix == ".tmp")


@not_as_root
def test_case6_export_into_a_read_only_directory(capsys, tmp_path, ck):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        _export_refused(capsys, ck, locked / "w.pt", f"cannot write '{locked / 'w.pt'}' (Permission denied)")
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o755)


def test_case6_export_where_the_directory_refuses_the_file(capsys, tmp_path, ck, monkeypatch):
    """What a read-only directory does for a user who is not root (this test runs as anyone)."""

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(export_module, "open", refuse, raising=False)
    out = tmp_path / "w.pt"
    line = _export_refused(capsys, ck, out, f"cannot write '{out}' (Permission denied)")
    assert line.endswith("choose an output path in a writable directory with enough free space")
    assert not out.exists() and _leftovers(tmp_path) == []


def test_case6_export_that_fails_half_way_leaves_no_file(capsys, tmp_path, ck, monkeypatch):
    out = tmp_path / "w.pt"
    out.write_bytes(b"the previous export")

    def full_disk(obj, fh, *args, **kwargs):
        fh.write(b"half a file")
        raise RuntimeError("[enforce fail at inline_container.cc:626] . PytorchStreamWriter failed writing file")

    monkeypatch.setattr(torch, "save", full_disk)
    _export_refused(capsys, ck, out, f"cannot write '{out}' (", "PytorchStreamWriter failed writing file")
    assert out.read_bytes() == b"the previous export" and _leftovers(tmp_path) == []


def test_case6_export_under_a_regular_file(capsys, tmp_path, ck):
    (tmp_path / "afile").write_text("")
    _export_refused(
        capsys,
        ck,
        tmp_path / "afile" / "w.pt",
        f"'{tmp_path / 'afile'}' is a file, not a directory; choose an output path inside a directory",
    )


def test_case6_export_to_a_directory(capsys, tmp_path, ck):
    _export_refused(
        capsys, ck, tmp_path, f"'{tmp_path}' is a directory; give the file to write, e.g. {tmp_path}/model.pt"
    )


def test_case6_export_over_something_that_is_not_a_file(capsys, tmp_path, ck):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    _export_refused(capsys, ck, fifo, f"'{fifo}' exists and is not a regular file")
    assert fifo.is_fifo()  # not replaced


def test_case6_export_to_a_missing_directory_or_a_name_too_long(capsys, tmp_path, ck):
    _export_refused(capsys, ck, tmp_path / "nothere" / "w.pt", f"directory '{tmp_path / 'nothere'}' does not exist")
    _export_refused(capsys, ck, tmp_path / ("x" * 300 + ".pt"), "File name too long")
    assert _leftovers(tmp_path) == []


# ---------------------------------------------------------------- neighbours of those cases


@pytest.mark.parametrize(
    "raw, what",
    [
        (b"[]", "damaged (it holds a list, not an object)"),
        (b"null", "damaged (it holds null, not an object)"),
        (b"3", "damaged (it holds 3, not an object)"),
        (b'"phalanx-checkpoint"', 'damaged (it holds "phalanx-checkpoint", not an object)'),
        (b"hello", "unreadable (Expecting value: line 1 column 1 (char 0))"),
        (b"", "unreadable (Expecting value"),
        (b'{"format": "phalanx-checkpoint", "version": 1, "step"', "unreadable ("),
        (b'{"format": "\xff\xfe"}', "unreadable ('utf-8' codec can't decode byte 0xff"),
    ],
    ids=["list", "null", "number", "string", "not-json", "empty", "truncated", "not-utf8"],
)
def test_manifest_that_is_no_json_object(capsys, tmp_path, ck, raw, what):
    _manifest_path(ck).write_bytes(raw)
    _refused(capsys, tmp_path, ck, f"checkpoint manifest '{_manifest_path(ck)}' is {what}", f"{ck / OLDER}")


@pytest.mark.parametrize(
    "key, value, what",
    [
        ("step", "ten", '"step" is "ten", not a whole number of 0 or more'),
        ("step", 10.0, '"step" is 10.0, not a whole number of 0 or more'),
        ("step", True, '"step" is true, not a whole number of 0 or more'),
        ("step", -3, '"step" is -3, not a whole number of 0 or more'),
        ("step", 10**30, '"step" is 1000000000000000000000000000000, too large to be real'),
        ("epoch", None, '"epoch" is null, not a whole number of 0 or more'),
        ("world_size", 0, '"world_size" is 0, not a whole number of 1 or more'),
        ("models", {"0": {}}, '"models" is an object, not a list'),
        ("models", [1], "models[0] is 1, not an object"),
        ("models", [], '"models" is empty'),
        ("models", [{"parameters": 97}], "models[0].shapes is missing"),
        ("models", [{"parameters": 97, "shapes": [[16, 4]]}], "models[0].shapes is a list, not an object"),
        ("models", [{"parameters": 97, "shapes": {"0.weight": "16x4"}}], 'models[0].shapes["0.weight"] is "16x4"'),
        ("models", [{"parameters": 97, "shapes": {"0.weight": [16, 4.5]}}], 'models[0].shapes["0.weight"][1] is 4.5'),
        ("models", [{"parameters": 97, "shapes": {"a\nb": [1]}}], 'models[0].shapes["a\\nb"] is not a plain parameter'),
        ("optimizers", "AdamW", '"optimizers" is "AdamW", not a list'),
        ("optimizers", [None], "optimizers[0] is null, not a string"),
        ("data", [{"epoch": 1}], "data[0].position is missing"),
        ("data", ["x"], 'data[0] is "x", not an object'),
        ("layout", "zip", '"layout" is "zip", not one of "plain", "dcp"'),
        ("strategy", ["ddp"], '"strategy" is a list, not a string'),
        ("created", "2026\n-12-01", '"created" is "2026\\n-12-01", which holds control characters'),
        ("torch", "\ud800", '"torch" is "\\ud800", which holds control characters or is not valid UTF-8'),
        ("run_dir", 7, '"run_dir" is 7, not a string'),
        ("global_batch_size", "8", '"global_batch_size" is "8", not a whole number of 0 or more'),
        ("format", "other-tool", "is not a phalanx checkpoint manifest"),
    ],
)
def test_manifest_key_of_the_wrong_type(capsys, tmp_path, ck, key, value, what):
    _write(ck, _good(ck) | {key: value})
    _refused(capsys, tmp_path, ck, str(_manifest_path(ck)), what)


@pytest.mark.parametrize(
    "literal, what",
    [("NaN", '"step" is NaN'), ("Infinity", '"step" is Infinity'), ("-Infinity", '"step" is -Infinity')],
)
def test_manifest_with_non_finite_numbers(capsys, tmp_path, ck, literal, what):
    text = _manifest_path(ck).read_text()
    _manifest_path(ck).write_text(re.sub(r'"step": \d+', f'"step": {literal}', text))
    _refused(capsys, tmp_path, ck, *_damaged(ck, what))


def test_manifest_version_newer_or_huge(capsys, tmp_path, ck):
    _write(ck, _good(ck) | {"version": 2})
    _refused(capsys, tmp_path, ck, f"checkpoint '{ck / NEWEST}' was written by a newer phalanx (format 2)")
    _write(ck, _good(ck) | {"version": 10**400})
    line = _refused(capsys, tmp_path, ck, f"written by a newer phalanx (format 1{'0' * 36}...)")
    assert len(line) < 300
    _write(ck, _good(ck) | {"version": 0})
    _refused(capsys, tmp_path, ck, *_damaged(ck, '"version" is 0'))


def test_manifest_without_an_earlier_checkpoint(capsys, tmp_path, ck):
    shutil.rmtree(ck / OLDER)
    _write(ck, _good(ck) | {"step": "ten"})
    _refused(
        capsys, tmp_path, ck, f"there is no earlier checkpoint in '{ck}': restore this one from a copy, or start again"
    )


def test_missing_data_file(capsys, tmp_path, ck):
    (ck / NEWEST / "optimizer.pt").unlink()
    line = f"checkpoint file '{ck / NEWEST / 'optimizer.pt'}' is missing; the checkpoint is incomplete"
    with pytest.raises(PhalanxError, match=re.escape(line)):
        open_checkpoint(ck)
    assert line in _cli(capsys, "info", str(ck))
    assert line in _cli(capsys, "export", str(ck), str(tmp_path / "w.pt"))
    with pytest.raises(PhalanxError, match=re.escape(line)):
        _load_into_fresh(tmp_path, ck)
    assert "4 files" in _cli(capsys, "info", "--no-verify", str(ck), code=0)  # what it lists, not what is there


def test_checkpoint_directory_that_is_a_file(capsys, tmp_path, ck):
    _refused(capsys, tmp_path, ck / NEWEST / "model.pt", f"'{ck / NEWEST / 'model.pt'}' is a file, not a checkpoint")


@not_as_root
def test_manifest_that_may_not_be_read(capsys, tmp_path, ck):
    _manifest_path(ck).chmod(0)
    try:
        _refused(capsys, tmp_path, ck, f"checkpoint manifest '{_manifest_path(ck)}' is unreadable (")
    finally:
        _manifest_path(ck).chmod(0o644)


def test_model_file_of_the_wrong_content_is_refused_by_export(capsys, tmp_path, ck):
    """The manifest rewritten to match: the file's hash passes, its content must still be a state dict."""
    torch.save({"not": "a list of state dicts"}, ck / NEWEST / "model.pt")
    manifest = _good(ck)
    manifest["files"]["model.pt"] = files.describe_file(ck / NEWEST / "model.pt")
    _write(ck, manifest)
    _export_refused(capsys, ck, tmp_path / "w.pt", "model.pt' does not hold the 1 model state dict(s)")


# ---------------------------------------------------------------- which checkpoint 'latest' means


def test_latest_naming_an_older_checkpoint_is_the_one_resumed(capsys, ck):
    """Documented in docs/checkpoints.md: 'latest' wins over a newer complete checkpoint, and the
    resumed run's save of that newer step replaces the one of the abandoned history."""
    (ck / files.LATEST).write_text(f"{OLDER}\n")
    (ck / NEWEST / "abandoned").write_text("")  # marks the old history's checkpoint
    assert files.latest(ck) == ck / OLDER and files.resolve(ck) == ck / OLDER
    assert str(ck / OLDER) in _cli(capsys, "info", str(ck), code=0)
    session, model, loader = checkpointed_session(ck, save_every=5, resume="auto")
    train_through(session, model, loader)
    session.close()
    assert f"resumed from {(ck / OLDER).resolve()}: step 5" in capsys.readouterr().out
    assert session.step_count == 10
    assert (ck / files.LATEST).read_text().strip() == NEWEST
    assert not (ck / NEWEST / "abandoned").exists()
    assert not list(ck.glob(".incomplete-*"))
    assert open_checkpoint(ck)["step"] == 10


def test_prune_keeps_the_checkpoint_latest_names(ck):
    (ck / files.LATEST).write_text(f"{OLDER}\n")
    files.prune(ck, 1)
    assert [f.path.name for f in files.complete(ck)] == [OLDER, NEWEST]
    (ck / files.LATEST).write_text(f"{NEWEST}\n")
    files.prune(ck, 1)
    assert [f.path.name for f in files.complete(ck)] == [NEWEST]


def test_dcp_manifest_lists_its_metadata(ck):
    """The sharded layout's manifest (as fsdp writes it) passes; without shards/.metadata it is refused."""
    manifest = _good(ck) | {"layout": "dcp", "strategy": "fsdp", "world_size": 2, "data_parallel_size": 2}
    entry = manifest["files"]["rng.pt"]
    manifest["files"] = {name: entry for name in ("rng.pt", "trainer.pt", "shards/.metadata", "shards/__0_0.distcp")}
    files.check_manifest(manifest, _manifest_path(ck))
    del manifest["files"]["shards/.metadata"]
    with pytest.raises(PhalanxError, match=r'"files" does not list shards/.metadata, which a dcp checkpoint has'):
        files.check_manifest(manifest, _manifest_path(ck))
