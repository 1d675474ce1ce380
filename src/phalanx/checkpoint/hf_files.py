"""Pretrained weights spread over several files, read one tensor at a time: a Hugging Face model
directory, a ``*.index.json`` file (its ``weight_map`` names the shard of each tensor), or a list
of weight files.

Of a directory, the file ``from_pretrained`` would pick is read: ``model.safetensors``, else
``model.safetensors.index.json`` and its shards, else ``pytorch_model.bin``, else
``pytorch_model.bin.index.json``; the tensor names are handed out as the files have them (no
``base_model_prefix`` handling, none of transformers' key conversions). Before any tensor is handed
out the index is checked against its shards (a missing shard, a tensor the index puts in a shard
that lacks it, a tensor in two shards, a shard tensor the index does not list), so that a damaged
download is one line naming the file, not a model half loaded. Each shard is opened on its own
(:class:`WeightsFile`): once to list its tensors, once more to read them, one shard open at a time,
so the memory a read costs is still about one tensor (plus, for a torch shard, the pages of the one
mapped file).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from phalanx.checkpoint.weights import WeightsFile
from phalanx.errors import PhalanxError

# What from_pretrained looks for in a directory, in its order of preference.
DIRECTORY_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
INDEX_SUFFIX = ".index.json"
_INDEX_LIMIT = 100_000_000  # bytes; the index of a 400-billion-parameter model is a few MB
_SHOWN = 3
_FIX_INDEX = "save the model again (save_pretrained) or fetch the whole directory again"


def open_weights(source: str | os.PathLike | Sequence[str | os.PathLike]) -> WeightsFile | ShardedWeights:
    """A reader (``index()``, ``read(name)``, ``close()``) for a weights file, a Hugging Face model
    directory, an index file or a list of weight files."""
    if isinstance(source, (list, tuple)):
        return ShardedWeights.from_files([Path(p) for p in source])
    path = Path(source)
    try:
        directory = path.is_dir()
    except OSError:  # not searchable: WeightsFile says so in its own words
        directory = False
    if directory:
        return _open_directory(path)
    if path.name.endswith(INDEX_SUFFIX):
        return ShardedWeights.from_index(path)
    return WeightsFile(path)


def _open_directory(path: Path) -> WeightsFile | ShardedWeights:
    for name in DIRECTORY_FILES:
        if (path / name).is_file():
            return ShardedWeights.from_index(path / name) if name.endswith(INDEX_SUFFIX) else WeightsFile(path / name)
    if (path / "manifest.json").is_file():
        raise PhalanxError(
            f"'{path}' is a phalanx checkpoint, not a model directory; resume from it with session.load('{path}'), "
            f"load its weights with session.load('{path}', weights_only=True), or export it with "
            f"`phalanx checkpoint export --format hf {path} DIR`"
        )
    raise PhalanxError(
        f"'{path}' holds none of {', '.join(DIRECTORY_FILES)}; give a directory that save_pretrained "
        "wrote, an index file, or the path of a .safetensors or .pt file"
    )


def read_index(path: Path) -> dict[str, str]:
    """The ``weight_map`` of index file ``path`` (tensor name -> shard file, relative to the index's
    directory), checked for shape: a JSON object whose ``weight_map`` maps each name once to a
    relative file name, and whose ``metadata``, if any, is an object."""
    try:
        size = path.stat().st_size
        if size > _INDEX_LIMIT:
            raise _bad_index(path, f"it has {size:,} bytes, far more than an index holds")
        raw = path.read_bytes()
    except FileNotFoundError:
        raise PhalanxError(
            f"index file '{path}' not found; give a model directory, an index file or a weights file"
        ) from None
    except (OSError, ValueError) as err:  # ValueError: a NUL in the path
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise PhalanxError(
            f"cannot read index file '{path}' ({reason}); check that it exists and that you may read it"
        ) from None
    try:
        index = json.loads(raw.decode("utf-8"), object_pairs_hook=_pairs)
    except _Twice as twice:
        raise _bad_index(path, f"it gives the key {_show(str(twice))} twice") from None
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise _bad_index(path, f"it is not JSON: {first}") from None
    if not isinstance(index, dict):
        raise _bad_index(path, f"it holds a JSON {type(index).__name__}, not an object")
    if "metadata" in index and not isinstance(index["metadata"], dict):
        raise _bad_index(path, '"metadata" is not an object')
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        problem = 'it has no "weight_map"' if weight_map is None else '"weight_map" is not an object'
        raise _bad_index(path, problem)
    if not weight_map:
        raise _bad_index(path, '"weight_map" lists no tensors')
    for name, shard in weight_map.items():
        if not (isinstance(shard, str) and _relative_file(shard)):
            raise _bad_index(path, f'"weight_map" puts {_show(name)} in {_show(shard)}, not a file beside the index')
    return dict(weight_map)


class ShardedWeights:
    """Several weight files read as one: ``index()`` lists every tensor, shard after shard (each in
    its file's order), and ``read(name)`` opens the shard that holds ``name`` when it is not the
    one open already. Build one with :meth:`from_index` or :meth:`from_files`."""

    def __init__(self, files: list[Path], where: dict[str, int], index: dict[str, tuple[tuple[int, ...], Any]]):
        self.files = files
        self._where = where  # tensor name -> position of its file in ``files``
        self._index = index
        self._open: tuple[int, WeightsFile] | None = None

    @classmethod
    def from_index(cls, path: Path) -> ShardedWeights:
        weight_map = read_index(path)
        names = sorted(set(weight_map.values()))  # HF's shard names sort in their numeric order
        files = [path.parent / n for n in names]
        absent = [n for n, f in zip(names, files) if not f.is_file()]
        if absent:
            more = f" and {len(absent) - 1} more of its {len(names)}" if len(absent) > 1 else ""
            raise PhalanxError(
                f"index '{path}' names shard {_show(absent[0])}{more}, not found in '{path.parent}'; "
                "fetch the missing shards, or give a complete model directory"
            )
        listing = _Listing(files)
        listing.refuse_twice()
        position = {n: i for i, n in enumerate(names)}
        for name, shard in weight_map.items():
            holders = listing.found.get(name, [])
            if position[shard] not in holders:
                where = f"it is in {_show(names[holders[0]])}" if holders else "no shard holds it"
                raise PhalanxError(
                    f"index '{path}' puts tensor {_show(name)} in {_show(shard)}, but {where}; {_FIX_INDEX}"
                )
        unlisted = [n for n in listing.found if n not in weight_map]
        if unlisted:
            raise PhalanxError(
                f"shard {_show(names[listing.found[unlisted[0]][0]])} holds tensor {_show(unlisted[0])}, which "
                f"index '{path}' does not list ({len(unlisted)} such tensor(s)); {_FIX_INDEX}"
            )
        return cls(files, listing.where, listing.index)

    @classmethod
    def from_files(cls, files: list[Path]) -> ShardedWeights:
        if not files:
            raise PhalanxError("the list of weight files is empty; give at least one .safetensors or .pt file")
        listing = _Listing(files)
        listing.refuse_twice()
        return cls(files, listing.where, listing.index)

    def index(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        return dict(self._index)

    def read(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise PhalanxError(f"none of the weight files holds a tensor named {_show(name)}")
        position = self._where[name]
        if self._open is None or self._open[0] != position:
            self.close()
            self._open = (position, WeightsFile(self.files[position]))
        reader = self._open[1]
        tensor = reader.read(name)
        shape, dtype = self._index[name]
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise PhalanxError(
                f"weights file '{reader.path}' changed while it was read (tensor {_show(name)} is now "
                f"{tuple(tensor.shape)} {tensor.dtype}, was {tuple(shape)} {dtype}); load it again once it is complete"
            )
        return tensor

    def close(self) -> None:
        if self._open is not None:
            self._open[1].close()
            self._open = None


class _Listing:
    """What each of ``files`` holds, each file opened and closed in turn: ``found`` (tensor name ->
    the positions of the files that hold it), ``index`` (name -> shape and dtype, shard after shard,
    each in its file's order) and ``where`` (name -> the position of the first file that holds it)."""

    def __init__(self, files: list[Path]):
        self.files = files
        self.found: dict[str, list[int]] = {}
        self.index: dict[str, tuple[tuple[int, ...], Any]] = {}
        self.where: dict[str, int] = {}
        for position, path in enumerate(files):
            with WeightsFile(path) as reader:
                for name, meta in reader.index().items():
                    self.found.setdefault(name, []).append(position)
                    self.index.setdefault(name, meta)
                    self.where.setdefault(name, position)

    def refuse_twice(self) -> None:
        twice = [(name, holders) for name, holders in self.found.items() if len(holders) > 1]
        if twice:
            name, holders = twice[0]
            more = f", and {len(twice) - 1} more tensor(s) are" if len(twice) > 1 else ""
            raise PhalanxError(
                f"tensor {_show(name)} is in two weight files ('{self.files[holders[0]]}' and "
                f"'{self.files[holders[1]]}'){more}; give each tensor in one file only"
            )


class _Twice(ValueError):
    """A key of a JSON object given twice; its text is the key."""


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Twice(key)
        out[key] = value
    return out


def _relative_file(name: str) -> bool:
    """A file name inside the index's directory: relative, no '..', nothing that splits a message."""
    if not name or "\x00" in name or any(c in name for c in "\n\r") or os.path.isabs(name) or "\\" in name:
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def _bad_index(path: Path, problem: str) -> PhalanxError:
    return PhalanxError(f"index file '{path}' is not a valid weights index ({problem}); {_FIX_INDEX}")


def _show(value: Any, limit: int = 60) -> str:
    """A name from the index, quoted, on one line and of bounded length (the file may be hostile)."""
    text = repr(value) if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= limit else text[: limit - 4] + "...'"
