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

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from phalanx.errors import PhalanxError

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = "phalanx-checkpoint"
VERSION = 1
_STEP_PREFIX = "step-"
_STAGING_PREFIX = ".incomplete-"


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
        _fsync(path)
    _fsync(directory)


def _fsync(path: Path) -> None:
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
        # The same step saved twice (an automatic save, then session.save()): the state is the same.
        shutil.rmtree(staging)
    else:
        os.rename(staging, final)
    _fsync(final.parent)
    pointer = final.parent / LATEST
    tmp = final.parent / f".{LATEST}.tmp"
    tmp.write_text(final.name + "\n", encoding="utf-8")
    _fsync(tmp)
    os.replace(tmp, pointer)
    _fsync(final.parent)
    return final


@dataclass(frozen=True)
class Found:
    step: int
    path: Path


def complete(root: Path) -> list[Found]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        if path.name.startswith(_STEP_PREFIX) and (path / MANIFEST).is_file():
            try:
                found.append(Found(int(path.name[len(_STEP_PREFIX) :]), path))
            except ValueError:
                continue
    return sorted(found, key=lambda f: f.step)


def latest(root: Path) -> Path | None:
    """The checkpoint ``latest`` names, or the newest complete one when the pointer is missing or stale."""
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text(encoding="utf-8").strip()
        if named.name and (named / MANIFEST).is_file():
            return named
    found = complete(root)
    return found[-1].path if found else None


def prune(root: Path, keep_last: int | None) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``keep_last``, and leftovers of killed saves."""
    removed = []
    for path in root.glob(f"{_STAGING_PREFIX}*"):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if keep_last is not None:
        for found in complete(root)[:-keep_last]:
            # Renamed first, so a crash half-way through rmtree never leaves a 'complete' checkpoint
            # with missing files.
            doomed = found.path.with_name(f"{_STAGING_PREFIX}deleting-{found.path.name}")
            os.rename(found.path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            removed.append(found.path)
    return removed


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint directory ``path`` (see :func:`resolve` for what users may type);
    a missing or unreadable one is a clear error."""
    if not path.exists():
        raise PhalanxError(
            f"checkpoint '{path}' not found; give a checkpoint directory (e.g. checkpoints/step-00000120) "
            "or checkpoints/latest"
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
    except (OSError, ValueError) as err:
        raise PhalanxError(
            f"checkpoint manifest '{manifest_path}' is unreadable ({err}); "
            "the checkpoint is damaged, use an earlier one"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise PhalanxError(f"'{manifest_path}' is not a phalanx checkpoint manifest")
    if manifest.get("version", 0) > VERSION:
        raise PhalanxError(
            f"checkpoint '{path}' was written by a newer phalanx (format {manifest['version']}); "
            "upgrade phalanx to load it"
        )
    manifest["path"] = str(path.resolve())
    return manifest


def resolve(path: str | Path) -> Path:
    """A checkpoint directory from what a user may type: the directory, its parent, or ``latest``."""
    path = Path(path)
    if path.is_file() and path.name == LATEST:
        return path.parent / path.read_text(encoding="utf-8").strip()
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
        if not path.is_file():
            return f"checkpoint file '{path}' is missing; the checkpoint is incomplete, use an earlier one"
        size = path.stat().st_size
        if size != expected["bytes"]:
            return (
                f"checkpoint file '{path}' is truncated or damaged ({size} bytes, {expected['bytes']} when saved); "
                "use an earlier checkpoint"
            )
        if sha256(path) != expected["sha256"]:
            return (
                f"checkpoint file '{path}' is corrupt (its SHA-256 differs from the one recorded when it was saved); "
                "use an earlier checkpoint"
            )
    return None


def describe_layout(layout: str) -> str:
    return "full state dicts" if layout == "plain" else "sharded (torch.distributed.checkpoint)"


def timestamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
