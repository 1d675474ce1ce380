"""Loading without executing anything a checkpoint file might smuggle in.

``torch.load(weights_only=True)`` only rebuilds tensors and plain containers. torch's distributed
checkpoint reader unpickles its ``.metadata`` file and non-tensor entries with plain pickle, which
runs whatever code a crafted file names; phalanx reads both through an allow-list instead.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from phalanx._torch_compat import DCP_METADATA_PRIVATE_GLOBALS, dcp_set_element
from phalanx.errors import PhalanxError

_METADATA_CLASSES = (
    DCP_METADATA_PRIVATE_GLOBALS
    | {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "TensorProperties",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "MetadataIndex",
            "StorageMeta",
        )
    }
    | {
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "Path"),
        ("collections", "OrderedDict"),
    }
)

# What torch.load raises on a damaged file: its zip reader, and its weights-only unpickler on a
# pickle cut short (a stack or memo lookup that finds nothing, a check of an opcode's argument).
_READ_ERRORS = (
    RuntimeError,
    EOFError,
    zipfile.BadZipFile,
    ValueError,
    OSError,
    IndexError,
    KeyError,
    AssertionError,
    struct.error,
)


def load_file(path: Path) -> Any:
    """``torch.load`` of a phalanx checkpoint file, tensors onto the CPU, no code executed."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        if "weights only" in first.lower() or "unsupported global" in str(err).lower():
            raise PhalanxError(
                f"checkpoint file '{path}' holds Python objects other than tensors and plain values; "
                "phalanx does not unpickle them (that could run arbitrary code). "
                "Re-save it from a trusted source with tensors only"
            ) from None
        raise PhalanxError(f"checkpoint file '{path}' is corrupt ({first}); use an earlier checkpoint") from None
    except _READ_ERRORS as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise PhalanxError(
            f"checkpoint file '{path}' is truncated or corrupt ({first}); use an earlier checkpoint"
        ) from None


def load_mapped(path: Path) -> tuple[Any, set[int]]:
    """:func:`load_file` with the file memory-mapped instead of read: its tensors are views of the
    page cache, one copy per node however many processes map it, and a page is only read when a
    tensor is (a zero1 rank never touches the other ranks' optimizer state). The mapping is
    copy-on-write, so writing to a tensor never changes the file. Returns the object and the
    addresses of its file-backed storages, so that what is kept can be given its own memory (see
    :func:`own_memory`); none when the file could not be mapped and was read instead."""
    try:
        value = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, *_READ_ERRORS):
        # Not mappable (a file in torch's legacy format, a filesystem without mmap) or damaged:
        # a plain read either succeeds or says what is wrong, as it always has.
        return load_file(path), set()
    return value, {t.untyped_storage().data_ptr() for t in _tensors(value)}


def own_memory(containers: Iterable[Any], mapped: set[int]) -> int:
    """Give every CPU tensor in ``containers`` whose storage is one of ``mapped`` (from
    :func:`load_mapped`, whose object must still be alive: its addresses are not reused until then)
    a private copy of it, in place: everything that refers to the tensor sees the copy. Otherwise a
    kept tensor would hold the file's mapping for the rest of the run: a pruned checkpoint's disk
    space would not come back until the process ends, and a file replaced under a running job
    could fault it. Returns the bytes copied."""
    copies: dict[int, torch.UntypedStorage] = {}
    seen: set[int] = set()
    for tensor in (t for c in containers for t in _tensors(c)):
        if id(tensor) in seen or tensor.device.type != "cpu":
            continue
        seen.add(id(tensor))
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in mapped:
            continue
        if key not in copies:  # views of one storage stay views of one copy
            copies[key] = storage.clone()
        with torch.no_grad():
            tensor.set_(copies[key], tensor.storage_offset(), tensor.shape, tensor.stride())
    return sum(s.nbytes() for s in copies.values())


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


class SafeReader(FileSystemReader):
    """torch.distributed.checkpoint's file reader with an allow-listed metadata unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as fh:
                metadata = _MetadataUnpickler(fh).load()
        except FileNotFoundError:
            raise PhalanxError(
                f"checkpoint '{self.path}' has no .metadata file; it is incomplete, use an earlier one"
            ) from None
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as err:
            raise PhalanxError(
                f"checkpoint metadata '{path}' is corrupt or not a torch.distributed.checkpoint file ({err}); "
                "nothing was executed"
            ) from None
        # What the stock reader adds after unpickling.
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor entries (ints, floats, lists of a state dict) loaded with ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise PhalanxError(
                f"a checkpoint entry ({read_item.dest_index.fqn}) holds Python objects phalanx does not unpickle: "
                f"{str(err).splitlines()[0]}"
            ) from None
        if self.flatten_state_dict:
            # torch's own helper for the nested layout (what the stock planner calls here).
            dcp_set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
