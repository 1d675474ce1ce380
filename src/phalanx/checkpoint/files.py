"""On-disk layout of checkpoints and the atomic protocol that keeps the previous one loadable.

    <dir>/step-00000120/          one complete checkpoint: manifest.json written last, then renamed
    <dir>/.incomplete-step-.../   a save in progress (or one that was killed): never loaded
    <dir>/latest                  the name of the newest complete checkpoint, replaced atomically

A save writes into the ``.incomplete-`` directory, flushes every file to disk, writes the manifest
(sizes and SHA-256 of every file), and renames the directory into place: a rename within one
filesystem is atomic, so at any instant a ``step-`` directory is either absent or complete.
The ``latest`` pointer moves only after that.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from phalanx.errors import PhalanxError
from phalanx.util.words import plural

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = "phalanx-checkpoint"
VERSION = 1
_STEP_PREFIX = "step-"
_STAGING_PREFIX = ".incomplete-"
_POINTER_BYTES = 256  # far more than a step name: a 'latest' longer than this is not one


def step_name(step: int) -> str:
    return f"{_STEP_PREFIX}{step:08d}"


def staging_path(root: Path, step: int) -> Path:
    return root / f"{_STAGING_PREFIX}{step_name(step)}"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def describe_file(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": sha256(path)}


def data_files(directory: Path) -> list[str]:
    """Every file of a checkpoint but the manifest, relative and sorted (the same list on every rank)."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def fsync_tree(directory: Path) -> None:
    """Flush file contents and directory entries: a rename is only as durable as what it renames."""
    for path in sorted(directory.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        fsync_path(path)
    fsync_path(directory)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's entries: what a rename into it wrote)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def commit(staging: Path, manifest: dict[str, Any]) -> Path:
    """Write the manifest into ``staging``, flush, rename it to its ``step-`` name, move ``latest``."""
    final = staging.with_name(staging.name[len(_STAGING_PREFIX) :])
    write_json_atomic(staging / MANIFEST, manifest)
    fsync_tree(staging)
    if final.exists():
        # The same step saved twice: within a run (an automatic save, then session.save()) the state is
        # the same, but after a resume from an earlier checkpoint the one on disk belongs to the abandoned
        # history, and keeping it would make 'latest' name that history. The new one replaces it.
        doomed = final.with_name(f"{_STAGING_PREFIX}replaced-{final.name}")
        shutil.rmtree(doomed, ignore_errors=True)
        os.rename(final, doomed)
        os.rename(staging, final)
        shutil.rmtree(doomed, ignore_errors=True)
    else:
        os.rename(staging, final)
    fsync_path(final.parent)
    pointer = final.parent / LATEST
    tmp = final.parent / f".{LATEST}.tmp"
    tmp.write_text(final.name + "\n", encoding="utf-8")
    fsync_path(tmp)
    os.replace(tmp, pointer)
    fsync_path(final.parent)
    return final


@dataclass(frozen=True)
class Found:
    step: int
    path: Path


def complete(root: Path) -> list[Found]:
    """Complete checkpoints under ``root``, oldest first."""
    with _readable(root):
        if not root.is_dir():
            return []
        found = []
        for path in root.iterdir():
            step = _step_of(path.name)
            if step is not None and (path / MANIFEST).is_file():
                found.append(Found(step, path))
    return sorted(found, key=lambda f: f.step)


@contextlib.contextmanager
def _readable(path: Path) -> Iterator[None]:
    """An OSError (no permission, a name too long, an I/O error) as the one line that names ``path``."""
    try:
        yield
    except OSError as err:
        raise PhalanxError(
            f"cannot read checkpoint '{path}' ({err.strerror or err}); check that it exists and that you may read it"
        ) from None


def _pointed(root: Path, found: list[Found]) -> Path | None:
    """The complete checkpoint of ``found`` that ``root/latest`` names, or None. Only a bare step name
    counts: a pointer that is unreadable, not UTF-8, empty, names a path (outside ``root`` or not) or
    an incomplete checkpoint is treated as missing, like one a crash never let a save write."""
    try:
        if not (root / LATEST).is_file():  # a FIFO there would block the open
            return None
        with open(root / LATEST, "rb") as fh:
            raw = fh.read(_POINTER_BYTES + 1)
        name = raw.decode("utf-8").strip()
    except (OSError, ValueError):  # missing, a directory, unreadable, not UTF-8, a NUL in the path
        return None
    if len(raw) > _POINTER_BYTES:
        return None
    return next((f.path for f in found if f.path.name == name), None)


def latest(root: Path) -> Path | None:
    """The checkpoint ``latest`` names, or the newest complete one when the pointer is missing or stale.

    ``latest`` wins over a newer complete checkpoint: it is either a save that a crash stopped between
    its rename and the pointer's move (the older one resumes exactly too, a few steps earlier), or a
    checkpoint the user chose to go back to by writing its name there."""
    found = complete(root)
    return _pointed(root, found) or (found[-1].path if found else None)


def prune(root: Path, keep_last: int | None) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``keep_last``, and leftovers of killed saves."""
    removed = []
    for path in root.glob(f"{_STAGING_PREFIX}*"):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if keep_last is not None:
        found_all = complete(root)
        pointed = _pointed(root, found_all)
        # The one 'latest' names stays even when it is not among the newest (a run that went back to
        # an earlier checkpoint): deleting it would send the next resume to the abandoned history.
        for found in [f for f in found_all[:-keep_last] if f.path != pointed]:
            # Renamed first, so a crash half-way through rmtree never leaves a 'complete' checkpoint
            # with missing files.
            doomed = found.path.with_name(f"{_STAGING_PREFIX}deleting-{found.path.name}")
            os.rename(found.path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            removed.append(found.path)
    return removed


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint directory ``path`` (see :func:`resolve` for what users may type);
    a missing, unreadable or damaged one is a clear error (a PhalanxError, whatever the input)."""
    with _readable(path):
        return _read_manifest(path)


def _read_manifest(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise PhalanxError(
            f"checkpoint '{path}' not found; give a checkpoint directory (e.g. checkpoints/step-00000120) "
            "or checkpoints/latest"
        )
    if not path.is_dir():
        raise PhalanxError(
            f"'{path}' is a file, not a checkpoint; give the directory that holds its {MANIFEST} "
            "(e.g. checkpoints/step-00000120) or checkpoints/latest"
        )
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        if path.name.startswith(_STAGING_PREFIX):
            raise PhalanxError(
                f"checkpoint '{path}' is incomplete (its save was interrupted); "
                f"use the previous one: {latest(path.parent) or 'none left'}"
            )
        raise PhalanxError(
            f"'{path}' is not a phalanx checkpoint (no {MANIFEST}); give a directory written by session.save()"
        )
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except RecursionError:
        raise PhalanxError(
            f"checkpoint manifest '{manifest_path}' is damaged (nested too deeply to be one); {instead(path)}"
        ) from None
    except (OSError, ValueError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise PhalanxError(f"checkpoint manifest '{manifest_path}' is unreadable ({first}); {instead(path)}") from None
    if not isinstance(manifest, dict):
        check_manifest(manifest, manifest_path)  # raises: "it holds a list, not an object"
    if manifest.get("format") != FORMAT:
        raise PhalanxError(f"'{manifest_path}' is not a phalanx checkpoint manifest")
    version = manifest.get("version")
    if type(version) is int and version > VERSION:
        raise PhalanxError(
            f"checkpoint '{path}' was written by a newer phalanx (format {_show(version)}); upgrade phalanx to load it"
        )
    check_manifest(manifest, manifest_path)
    manifest["path"] = str(path.resolve())
    return manifest


def instead(path: Path) -> str:
    """What to load when checkpoint ``path`` cannot be: the complete one before it, if any."""
    step = _step_of(path.name)
    try:
        others = [f for f in complete(path.parent) if f.path.name != path.name and (step is None or f.step < step)]
    except PhalanxError:  # the directory cannot be listed: no suggestion
        others = []
    if others:
        return f"use the previous checkpoint: {others[-1].path}"
    return f"there is no earlier checkpoint in '{path.parent}': restore this one from a copy, or start again"


def _step_of(name: str) -> int | None:
    if not name.startswith(_STEP_PREFIX):
        return None
    try:
        return int(name[len(_STEP_PREFIX) :])
    except ValueError:
        return None


# -- the shape of a manifest ---------------------------------------------------------------------
# Everything phalanx reads from a manifest is checked here, once, right after it is parsed: the
# loader, `phalanx checkpoint info` and export then index it freely, and a damaged or hand-edited
# one is one line naming the key instead of a TypeError or KeyError deep inside them.

_INT_MAX = 2**63 - 1
_MAX_DEPTH = 16  # a manifest nests 5 levels (models, a model, shapes, a shape); more is not one
_LAYOUT_FILES = {
    "plain": ("model.pt", "optimizer.pt", "trainer.pt", "rng.pt"),
    "dcp": ("trainer.pt", "rng.pt", "shards/.metadata"),
}
_SHA256 = re.compile(r"[0-9a-f]{64}")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class _Bad(Exception):
    """A manifest value of the wrong shape; its text says which key and what it holds."""


def check_manifest(manifest: Any, manifest_path: Path) -> None:
    """Raise a PhalanxError naming ``manifest_path`` and the first key whose value phalanx cannot use."""
    try:
        _check(manifest)
    except _Bad as bad:
        raise PhalanxError(
            f"checkpoint manifest '{manifest_path}' is damaged ({bad}); {instead(manifest_path.parent)}"
        ) from None


def _check(m: Any) -> None:
    _check_depth(m)
    if not isinstance(m, dict):
        raise _Bad(f"it holds {_show(m)}, not an object")
    if m.get("format") != FORMAT:
        raise _Bad(f'"format" is {_show(m.get("format"))}, not "{FORMAT}"')
    version = _need(m, "version")
    if type(version) is not int or not 1 <= version <= VERSION:
        known = "1" if VERSION == 1 else f"1 to {VERSION}"
        raise _Bad(f'"version" is {_show(version)}, not a format version this phalanx reads ({known})')
    for key in ("created", "phalanx", "torch", "strategy"):
        _text(_need(m, key), key)
    layout = _need(m, "layout")
    if not isinstance(layout, str) or layout not in _LAYOUT_FILES:
        raise _Bad(f'"layout" is {_show(layout)}, not one of {", ".join(map(json.dumps, _LAYOUT_FILES))}')
    for key, low in (("step", 0), ("epoch", 0), ("world_size", 1), ("data_parallel_size", 1)):
        _whole(_need(m, key), key, low)
    for key, check in (("run_dir", _text), ("precision", _text), ("global_batch_size", _whole)):
        value = _need(m, key)
        if value is not None:
            check(value, key)
    for i, entry in enumerate(_list(_need(m, "data"), "data")):
        where = f"data[{i}]"
        _whole(_need(_object(entry, where), "epoch", where), f"{where}.epoch")
        position = _need(entry, "position", where)
        if position is not None:
            _whole(position, f"{where}.position")
    models = _list(_need(m, "models"), "models")
    if not models:
        raise _Bad('"models" is empty: a checkpoint holds at least one model')
    for i, model in enumerate(models):
        where = f"models[{i}]"
        _whole(_need(_object(model, where), "parameters", where), f"{where}.parameters")
        shapes = _object(_need(model, "shapes", where), f"{where}.shapes")
        for name, shape in shapes.items():
            if not _plain_text(name):
                raise _Bad(f"{_child(f'{where}.shapes', name)} is not a plain parameter name")
            for j, size in enumerate(_list(shape, _child(f"{where}.shapes", name))):
                _whole(size, f"{_child(f'{where}.shapes', name)}[{j}]")
        for j, group in enumerate(_list(model.get("tied", []), f"{where}.tied")):  # absent before tied groups
            names = _list(group, f"{where}.tied[{j}]")
            if len(names) < 2 or not all(isinstance(n, str) and n in shapes for n in names):
                raise _Bad(f"{where}.tied[{j}] is not a list of two or more of the model's tensor names")
    for i, name in enumerate(_list(_need(m, "optimizers"), "optimizers")):
        _text(name, f"optimizers[{i}]")
    listed = _object(_need(m, "files"), "files")
    for name, entry in listed.items():
        where = _child("files", name)
        if not _relative_name(name):
            raise _Bad(f"{where} is not a file inside the checkpoint")
        _whole(_need(_object(entry, where), "bytes", where), f"{where}.bytes")
        digest = _need(entry, "sha256", where)
        if not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
            raise _Bad(f"{where}.sha256 is {_show(digest)}, not a SHA-256 in hex")
    for name in _LAYOUT_FILES[layout]:
        if name not in listed:
            raise _Bad(f'"files" does not list {name}, which a {layout} checkpoint has')
    run = m.get("run")  # absent before checkpoints recorded their run (checkpoint/run_identity.py)
    if run is not None:
        _check_run(_object(run, "run"), "run")
        launch = run.get("launch")
        if launch is not None:
            _check_run(_object(launch, "run.launch"), "run.launch")


def _check_run(run: dict, where: str) -> None:
    """A run's settings (names and JSON values) and its script, as run_identity compares them."""
    for name in _object(_need(run, "settings", where), f"{where}.settings"):
        if not _plain_text(name):
            raise _Bad(f"{_child(f'{where}.settings', name)} is not a plain setting name")
    script = _need(run, "script", where)
    if script is None:
        return
    at = f"{where}.script"
    # Any text: a path or an argument may hold what a message must escape (one_line does).
    path = _need(_object(script, at), "path", at)
    if not isinstance(path, str):
        raise _Bad(f"{at}.path is {_show(path)}, not a string")
    digest = _need(script, "sha256", at)
    if not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
        raise _Bad(f"{at}.sha256 is {_show(digest)}, not a SHA-256 in hex")
    for i, arg in enumerate(_list(_need(script, "args", at), f"{at}.args")):
        if not isinstance(arg, str):
            raise _Bad(f"{at}.args[{i}] is {_show(arg)}, not a string")


def _check_depth(value: Any) -> None:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > _MAX_DEPTH:
            raise _Bad(f"it nests more than {_MAX_DEPTH} levels deep")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


def _need(obj: dict, key: str, where: str | None = None) -> Any:
    if key not in obj:
        raise _Bad(f"{_child(where, key) if where else json.dumps(key)} is missing")
    return obj[key]


def _whole(value: Any, where: str, low: int = 0) -> int:
    if type(value) is not int or value < low:
        raise _Bad(f"{_quoted(where)} is {_show(value)}, not a whole number of {low} or more")
    if value > _INT_MAX:
        raise _Bad(f"{_quoted(where)} is {_show(value)}, too large to be real")
    return value


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _Bad(f"{_quoted(where)} is {_show(value)}, not a string")
    if not _plain_text(value):
        raise _Bad(f"{_quoted(where)} is {_show(value)}, which holds control characters or is not valid UTF-8")
    return value


def _plain_text(text: str) -> bool:
    """No control characters (a newline would split an error line) and printable as UTF-8 (JSON's
    escapes can make lone surrogates, which no file name or terminal takes)."""
    if _CONTROL.search(text):
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise _Bad(f"{_quoted(where)} is {_show(value)}, not a list")
    return value


def _object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise _Bad(f"{_quoted(where)} is {_show(value)}, not an object")
    return value


def _quoted(where: str) -> str:
    return json.dumps(where) if _KEY.fullmatch(where) else where


def _child(where: str | None, key: str) -> str:
    """``where`` followed by ``key``, in the notation of a path into JSON: models[0].shapes["0.weight"]."""
    if where is None:
        return json.dumps(key)
    return f"{where}.{key}" if _KEY.fullmatch(key) else f"{where}[{_show(key)}]"


def _relative_name(name: str) -> bool:
    """A path the save could have written: relative, inside the checkpoint, nothing odd in it."""
    return _plain_text(name) and all(part not in ("", ".", "..") for part in name.split("/"))


def _show(value: Any) -> str:
    """A JSON value as a short, one-line piece of a message (the type, for containers)."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, float) and not math.isfinite(value):
        text = "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    elif isinstance(value, (int, float, str)):
        text = json.dumps(value)  # escapes newlines, NULs and every non-ASCII character
    else:
        return type(value).__name__
    return text if len(text) <= 40 else f"{text[:37]}..."


def resolve(path: str | Path) -> Path:
    """A checkpoint directory from what a user may type: the directory, its parent, or ``latest``
    (which resolves like its directory: the checkpoint it names, else the newest complete one)."""
    path = Path(path)
    with _readable(path):
        return _resolve(path)


def _resolve(path: Path) -> Path:
    if path.is_file() and path.name == LATEST:
        found = latest(path.parent)
        if found is None:
            raise PhalanxError(
                f"'{path}' names no complete checkpoint and '{path.parent}' holds none; "
                "give a checkpoint directory (e.g. checkpoints/step-00000120)"
            )
        return found
    if path.is_dir() and not (path / MANIFEST).is_file():
        found = latest(path)
        if found is not None:
            return found
    return path


def verify(directory: Path, manifest: dict[str, Any], names: Iterable[str]) -> str | None:
    """Check the listed files against the manifest; returns the first problem, or None."""
    listed = manifest.get("files", {})
    for name in names:
        expected = listed.get(name)
        path = directory / name
        if expected is None:
            return f"checkpoint '{directory}' has a file the manifest does not list: {name}"
        try:
            if not path.is_file():
                return f"checkpoint file '{path}' is missing; the checkpoint is incomplete, use an earlier one"
            size = path.stat().st_size
            digest = sha256(path) if size == expected["bytes"] else None
        except OSError as err:
            return f"cannot read checkpoint file '{path}' ({err.strerror or err}); check that you may read it"
        if size != expected["bytes"]:
            return (
                f"checkpoint file '{path}' is truncated or damaged ({size} bytes, {expected['bytes']} when saved); "
                "use an earlier checkpoint"
            )
        if digest != expected["sha256"]:
            return (
                f"checkpoint file '{path}' is corrupt (its SHA-256 differs from the one recorded when it was saved); "
                "use an earlier checkpoint"
            )
    return None


def describe_processes(manifest: dict[str, Any]) -> str:
    """The strategy and its axes, "fsdp over 4 processes (dp_shard 2 x tp 2)"; a manifest written
    before axes were recorded gives the strategy and the process count alone."""
    axes = manifest.get("axes") or {}
    shape = f" ({' x '.join(f'{axis} {size}' for axis, size in axes.items())})" if axes else ""
    return f"{manifest['strategy']} over {plural(manifest['world_size'], 'process')}{shape}"


def describe_layout(layout: str) -> str:
    return "full state dicts" if layout == "plain" else "sharded (torch.distributed.checkpoint)"


def timestamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
