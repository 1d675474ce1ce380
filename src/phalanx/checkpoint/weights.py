"""Pretrained-weights files, read one tensor at a time, and safetensors files written atomically.

:class:`WeightsFile` opens a ``.safetensors`` file or a torch file (``torch.save`` of a state dict:
``.pt``, ``.pth``, ``.bin``), recognised by its content, not its name, and hands out one tensor at
a time, so that a rank that broadcasts a model's weights holds about one tensor at once, not the
file.

safetensors files are read with plain file reads (``seek`` + ``readinto`` into a fresh tensor's
memory), not with ``safetensors.safe_open`` and not memory-mapped: the pages of a mapped file
count in the process's resident memory, so reading a 320 MB file one tensor at a time through
``safe_open`` raised its peak RSS by 323 MB on this project's machine, where plain reads raise it
by about the largest tensor. The header is checked as strictly as the reference implementation
does (a sane length, a JSON object, every entry's dtype, shape and offsets, the data buffer covered
exactly), so a truncated or foreign file is one error line, never a wrong tensor.

torch files are loaded with ``torch.load(weights_only=True, mmap=True)``: nothing is unpickled but
tensors and plain values, and the tensors stay in the mapped file until :meth:`WeightsFile.read`
copies one out (torch's legacy, non-zip format cannot be mapped and is read whole). The mapped
pages a read touches count in the resident memory too, but they are the page cache's, shared by
every process of the node that maps the file, and dropped under memory pressure.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import stat
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from phalanx.errors import PhalanxError

# The reference implementation's bound (safetensors' MAX_HEADER_SIZE): a longer header is a foreign file.
_HEADER_LIMIT = 100_000_000
_OWN_PAGES = 1 << 20  # tensors of this many bytes or more are read into pages of their own (see _empty)
_ZIP = b"PK\x03\x04"
_PICKLE = b"\x80"
# safetensors' dtype names -> torch's, where this torch has the dtype. Sub-byte formats (F4, F6_*)
# pack several values in a byte and have no torch dtype of one element per value.
_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, attr)
    for name, attr in (
        ("F64", "float64"),
        ("F32", "float32"),
        ("F16", "float16"),
        ("BF16", "bfloat16"),
        ("I64", "int64"),
        ("I32", "int32"),
        ("I16", "int16"),
        ("I8", "int8"),
        ("U64", "uint64"),
        ("U32", "uint32"),
        ("U16", "uint16"),
        ("U8", "uint8"),
        ("BOOL", "bool"),
        ("C64", "complex64"),
        ("F8_E4M3", "float8_e4m3fn"),
        ("F8_E5M2", "float8_e5m2"),
        ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
        ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
        ("F8_E8M0", "float8_e8m0fnu"),
    )
    if isinstance(getattr(torch, attr, None), torch.dtype)
}
_FIX = "give a complete .safetensors or .pt weights file"
_STATE_DICT_FIX = "save model.state_dict() alone, or export it with `phalanx checkpoint export`"


class WeightsFile:
    """A pretrained-weights file opened for reading one tensor at a time.

    ``format`` is ``"safetensors"`` or ``"pt"``. A torch file must hold a flat mapping of names to
    tensors (a state dict); one that holds only such a mapping under the single key ``"state_dict"``
    or ``"model"`` is read as that mapping. Every problem with the file is one :class:`PhalanxError`.
    """

    format: str

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._fh: Any = None
        self._entries: dict[str, tuple[tuple[int, ...], torch.dtype, int, int]] = {}
        self._state: dict[str, torch.Tensor] | None = None
        self._size = self._data = 0  # the file's size; where the data buffer of a safetensors file begins
        self.metadata: dict[str, str] = {}  # a safetensors file's "__metadata__" (who wrote it, and how)
        head = self._open()
        try:
            if head[8:9] == b"{":
                self.format = "safetensors"
                self._read_header(head)
            elif head.startswith((_ZIP, _PICKLE)):
                self.format = "pt"
                self._fh.close()
                self._fh = None
                self._state = self._load_torch(mapped=head.startswith(_ZIP))
            else:
                shown = head[:8].hex(" ") if head else "nothing"
                raise PhalanxError(
                    f"'{self.path}' is neither a safetensors nor a torch file (it starts with {shown}); {_FIX}"
                )
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> WeightsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def index(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of every tensor, in the file's order (where the data lies, for safetensors)."""
        if self._state is not None:
            return {k: (tuple(v.shape), v.dtype) for k, v in self._state.items()}
        return {k: (shape, dtype) for k, (shape, dtype, _, _) in self._entries.items()}

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as a fresh, contiguous CPU tensor in its own memory, its bytes those of the file."""
        if self._state is None and self._fh is None:
            raise PhalanxError(f"weights file '{self.path}' is closed; open it again to read {_show(name)}")
        if name not in (self._state if self._state is not None else self._entries):
            raise PhalanxError(f"'{self.path}' holds no tensor named {_show(name)}")
        if self._state is not None:
            source = self._state[name]
            return _empty(tuple(source.shape), source.dtype).copy_(source)
        shape, dtype, begin, end = self._entries[name]
        tensor = _empty(shape, dtype)
        if end > begin:
            self._read_into(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()), self._data + begin, name)
        return tensor

    def close(self) -> None:
        self._state = None  # the mapped torch file is unmapped once the tensors of it are gone
        self._entries = {}
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def _open(self) -> bytes:
        try:
            info = self.path.stat()
            if stat.S_ISDIR(info.st_mode):
                raise PhalanxError(f"'{self.path}' is a directory; give the weights file in it (.safetensors or .pt)")
            if not stat.S_ISREG(info.st_mode):
                raise PhalanxError(f"'{self.path}' is not a regular file; {_FIX}")
            self._size = info.st_size
            self._fh = open(self.path, "rb", buffering=0)
            return self._fh.read(9)
        except FileNotFoundError:
            raise PhalanxError(
                f"weights file '{self.path}' not found; give the path of a .safetensors or .pt file"
            ) from None
        except (OSError, ValueError) as err:  # ValueError: a NUL in the path
            reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
            raise PhalanxError(
                f"cannot read weights file '{self.path}' ({reason}); check that it exists and that you may read it"
            ) from None

    def _bad(self, problem: str, cut: bool = False) -> PhalanxError:
        what = "is truncated or damaged" if cut else "is not a valid safetensors file"
        return PhalanxError(f"'{self.path}' {what} ({problem}); {_FIX}")

    def _read_header(self, head: bytes) -> None:
        if sys.byteorder != "little":
            raise PhalanxError(
                f"cannot read '{self.path}' on this big-endian machine (safetensors data is little-endian); "
                "convert it to a .pt file on a little-endian one"
            )
        length = int.from_bytes(head[:8], "little")
        if length > _HEADER_LIMIT:
            raise self._bad(f"its header claims {length:,} bytes, over the format's limit of {_HEADER_LIMIT:,}")
        if 8 + length > self._size:
            raise self._bad(
                f"its header claims {length:,} bytes, the file has {self._size - 8:,} after the length", cut=True
            )
        raw = bytearray(length)
        self._read_into(memoryview(raw), 8, None)
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
        except (ValueError, RecursionError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise self._bad(f"its header is not JSON: {_one_line(err)}") from None
        if not isinstance(header, dict):
            raise self._bad(f"its header is a JSON {type(header).__name__}, not an object")
        self._data = 8 + length
        buffer = self._size - self._data
        metadata = header.pop("__metadata__", None)
        if metadata is not None and not (
            isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
        ):
            raise self._bad('its "__metadata__" is not an object of strings')
        self.metadata = dict(metadata or {})
        entries = [(name, self._entry(name, info, buffer)) for name, info in header.items()]
        at = 0
        for name, entry in sorted(entries, key=lambda item: item[1][2:]):  # empty tensors first at a tie
            if entry[2] != at:
                raise self._bad(
                    f"tensor {_show(name)} starts at byte {entry[2]:,} of the data, "
                    f"not at {at:,} where the one before ends"
                )
            at = entry[3]
            self._entries[name] = entry
        if at != buffer:
            raise self._bad(f"its tensors cover {at:,} bytes of data, the file holds {buffer:,}")

    def _entry(self, name: str, info: Any, buffer: int) -> tuple[tuple[int, ...], torch.dtype, int, int]:
        if not isinstance(info, dict):
            raise self._bad(f"the entry of tensor {_show(name)} is not an object")
        for key in ("dtype", "shape", "data_offsets"):
            if key not in info:
                raise self._bad(f'tensor {_show(name)} has no "{key}"')
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str):
            raise self._bad(f'the "dtype" of tensor {_show(name)} is not a string')
        if dtype not in _DTYPES:
            raise self._bad(
                f"tensor {_show(name)} has dtype {_show(dtype)}, which phalanx cannot read into this torch "
                f"({', '.join(_DTYPES)})"
            )
        if not (isinstance(shape, list) and all(_whole(d) for d in shape)):
            raise self._bad(f'the "shape" of tensor {_show(name)} is not a list of whole numbers >= 0')
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_whole(o) for o in offsets)):
            raise self._bad(f'the "data_offsets" of tensor {_show(name)} are not two whole numbers >= 0')
        begin, end = offsets
        if begin > end or end > buffer:
            raise self._bad(
                f"tensor {_show(name)} lies at bytes {begin:,}..{end:,} of the data, which holds {buffer:,}",
                cut=begin <= end,
            )
        torch_dtype = _DTYPES[dtype]
        if math.prod(max(d, 1) for d in shape) >= 2**63:  # torch counts elements and strides in int64
            raise self._bad(f"tensor {_show(name)} has shape {shape}, too large for torch")
        try:
            torch.empty(shape, dtype=torch_dtype, device="meta")  # what torch refuses (too many dimensions)
        except (RuntimeError, ValueError, TypeError) as err:
            raise self._bad(f"tensor {_show(name)} has shape {shape}, which torch refuses: {_one_line(err)}") from None
        need = math.prod(shape) * torch_dtype.itemsize
        if end - begin != need:
            raise self._bad(
                f"tensor {_show(name)} of shape {shape} and dtype {dtype} needs {need:,} bytes, "
                f"its offsets hold {end - begin:,}"
            )
        return tuple(shape), torch_dtype, begin, end

    def _read_into(self, view: memoryview, offset: int, name: str | None) -> None:
        """Fill ``view`` from byte ``offset``; a file cut shorter since it was opened is an error."""
        self._fh.seek(offset)
        done = 0
        try:
            while done < len(view):
                got = self._fh.readinto(view[done : done + (1 << 30)])  # a read(2) returns at most ~2 GiB
                if not got:
                    what = "its header" if name is None else f"tensor {_show(name)}"
                    raise self._bad(f"the file ends inside {what}", cut=True)
                done += got
        except OSError as err:
            raise PhalanxError(
                f"cannot read weights file '{self.path}' ({err.strerror or err}); check the file and its disk"
            ) from None

    def _load_torch(self, mapped: bool) -> dict[str, torch.Tensor]:
        try:
            with warnings.catch_warnings():
                # A pickle of another protocol loads or fails on its own; either way the warning adds nothing.
                warnings.filterwarnings("ignore", message="Detected pickle protocol")
                if str(self.path).endswith(".safetensors"):
                    # torch.load hands a path of that name to safetensors; a file it cannot map is read whole.
                    with open(self.path, "rb") as fh:
                        loaded = torch.load(fh, map_location="cpu", weights_only=True)
                else:
                    loaded = torch.load(self.path, map_location="cpu", weights_only=True, mmap=mapped)
        except Exception as err:  # the file is the user's: whatever torch's readers raise on it means "not loadable"
            text = str(err)
            if mapped and "mmap" in text:  # a file system that cannot map; read it whole instead
                return self._load_torch(mapped=False)
            if "weights only" in text.lower() or "unsupported global" in text.lower():
                raise PhalanxError(
                    f"'{self.path}' holds Python objects other than tensors and plain values; phalanx does not "
                    "unpickle them (that could run arbitrary code). Re-save its state dict from a trusted source "
                    "with tensors only, or convert it to .safetensors"
                ) from None
            raise PhalanxError(
                f"'{self.path}' is not a loadable torch weights file ({_one_line(err)}); {_FIX}"
            ) from None
        return self._flat(loaded)

    def _flat(self, loaded: Any) -> dict[str, torch.Tensor]:
        if isinstance(loaded, dict) and len(loaded) == 1:
            ((key, inner),) = loaded.items()
            if key in ("state_dict", "model") and isinstance(inner, dict) and _state_dict(inner):
                loaded = inner
        if isinstance(loaded, dict) and _state_dict(loaded):
            for name, tensor in loaded.items():
                if tensor.layout != torch.strided:
                    raise PhalanxError(
                        f"'{self.path}' holds tensor {_show(name)} in layout {tensor.layout}; "
                        "save dense tensors (tensor.to_dense())"
                    )
            return dict(loaded)
        raise PhalanxError(f"'{self.path}' holds {_describe(loaded)}, not a state dict of tensors; {_STATE_DICT_FIX}")


def write_safetensors(state: dict[str, torch.Tensor], out: Path, metadata: dict[str, str] | None = None) -> None:
    """``state`` as a safetensors file at ``out``, written atomically (see :func:`atomic_output`)."""
    from safetensors.torch import save_file

    plain = safetensors_ready(state)
    out = Path(out)
    with atomic_output(out) as tmp:
        save_file(plain, tmp, metadata=metadata)


def safetensors_ready(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` as safetensors' writer takes it: on the CPU, and tensors that are not contiguous or
    that share memory with another entry (tied weights, which safetensors refuses) as a copy of
    their own. A dtype the format has no name for is one PhalanxError line."""
    for name, tensor in state.items():
        if tensor.dtype not in _DTYPES.values():
            raise PhalanxError(
                f"tensor {_show(name)} has dtype {tensor.dtype}, which safetensors cannot hold; "
                "write a .pt file instead"
            )
    seen: set[int] = set()
    plain: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        tensor = tensor.detach().cpu()
        storage = tensor.untyped_storage().data_ptr() if tensor.numel() else None
        if storage in seen or not tensor.is_contiguous():
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        elif storage is not None:
            seen.add(storage)
        plain[name] = tensor
    return plain


@contextlib.contextmanager
def atomic_output(out: Path) -> Iterator[Path]:
    """The temporary path to write ``out``'s content to: flushed to disk and renamed over ``out`` when
    the block ends, deleted when it fails, so that a failed write leaves no partial file. The name is
    short, so that an ``out`` near the file system's name limit still fits. A failure to write is one
    PhalanxError line."""
    tmp = out.parent / f".phalanx-export-{os.getpid()}.tmp"
    done = False
    try:
        yield tmp
        with open(tmp, "rb") as fh:  # the writer has closed its own handle by now
            os.fsync(fh.fileno())
        os.replace(tmp, out)
        done = True
    except (OSError, RuntimeError, SafetensorError) as err:
        raise PhalanxError(
            f"cannot write '{out}' ({write_failure(err)}); choose an output path in a writable directory with "
            "enough free space"
        ) from None
    finally:
        if not done:
            with contextlib.suppress(OSError):
                tmp.unlink()


def write_failure(err: Exception) -> str:
    """Why a write failed, in a few words: the system's reason (``No space left on device``), or the
    last line of what a writer raised."""
    lines = str(err).strip().splitlines() or [type(err).__name__]
    return err.strerror if isinstance(err, OSError) and err.strerror else lines[-1]


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of its own memory. A large one gets pages of its own, given back to the system when it
    is freed: glibc's malloc keeps freed blocks of this size in its heap and, measured here, reading 8
    tensors of 8 MiB one at a time through torch.empty raised the peak RSS by 25 to 50 MiB, not 8."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < _OWN_PAGES:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).reshape(shape)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {_show(key)} appears twice")
        out[key] = value
    return out


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _state_dict(mapping: dict) -> bool:
    return all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in mapping.items())


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        keys = ", ".join(_show(k) for k in list(value)[:4]) + (", ..." if len(value) > 4 else "")
        return f"a dict with keys {keys}" if value else "an empty dict"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} item(s)"
    if isinstance(value, torch.Tensor):
        return "a single tensor"
    return f"a {type(value).__name__}"


def _show(value: Any, limit: int = 60) -> str:
    """A name from the file, quoted, on one line and of bounded length (the file may be hostile)."""
    text = repr(value) if isinstance(value, str) else repr(str(value))
    return text if len(text) <= limit else text[: limit - 4] + "...'"


def _one_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return (lines[0] if lines else type(err).__name__)[:200]
