"""Loading without executing anything a checkpoint file might smuggle in.

``torch.load(weights_only=True)`` only rebuilds tensors and plain containers. torch's distributed
checkpoint reader unpickles its ``.metadata`` file and non-tensor entries with plain pickle, which
runs whatever code a crafted file names; phalanx reads both through an allow-list instead.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path
from typing import Any

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
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise PhalanxError(
            f"checkpoint file '{path}' is truncated or corrupt ({first}); use an earlier checkpoint"
        ) from None


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
