"""A checkpoint's contents without the training run: its summary, and the consolidated weights of
one model as a plain state dict (no ``module.`` prefix, whichever strategy saved it)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from phalanx.checkpoint import files
from phalanx.checkpoint.weights import atomic_output, write_safetensors
from phalanx.errors import PhalanxError


def open_checkpoint(path: str | Path, *, verify: bool = True) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path`` (a checkpoint, its parent, or ``latest``),
    after checking every file against it when ``verify``."""
    manifest = files.read_manifest(files.resolve(path))
    if verify:
        problem = files.verify(Path(manifest["path"]), manifest, sorted(manifest["files"]))
        if problem:
            raise PhalanxError(problem)
    return manifest


def progress_words(manifest: dict[str, Any]) -> str:
    """Where the run of a checkpoint was: ``step 18, epoch 2, 96 samples into the epoch``, or for
    one taken on the last step of an epoch (which resumes at the next one) ``step 10, after epoch 2``."""
    step, epoch = manifest["step"], manifest["epoch"]
    data = manifest.get("data") or []
    if epoch and data and all(d.get("position") == 0 for d in data):
        return f"step {step}, after epoch {epoch}"
    words = f"step {step}, epoch {epoch + 1}"
    if data and data[0].get("position"):
        words += f", {data[0]['position']} samples into the epoch"
    return words


def model_state_dict(manifest: dict[str, Any], model: int = 0) -> dict[str, torch.Tensor]:
    """The full weights of model ``model`` of a checkpoint, on the CPU."""
    if manifest["layout"] == "plain":
        # Read whole, not mapped: the caller keeps the tensors, and a mapping would pin the file.
        from phalanx.checkpoint.safe import load_file

        path = Path(manifest["path"]) / "model.pt"
        return _one_model(load_file(path), _which(manifest, model), len(manifest["models"]), path)
    tensors = ModelTensors(manifest, model)
    return tensors.read(list(tensors.entries))


class ModelTensors:
    """The weights of model ``model`` of a checkpoint, a few tensors at a time: ``entries`` (name ->
    shape and dtype, in the state dict's order) and ``read(names)``. A dcp checkpoint reads only the
    listed tensors from its shards on each call; a plain one maps ``model.pt`` (see
    checkpoint/safe.py), so a page is read when a tensor on it is."""

    def __init__(self, manifest: dict[str, Any], model: int = 0):
        count = len(manifest["models"])
        _which(manifest, model)
        self.directory = Path(manifest["path"])
        self.layout = manifest["layout"]
        self._prefix = f"model{model}"
        self._state: dict[str, torch.Tensor] | None = None
        order = list(manifest["models"][model]["shapes"])
        if self.layout == "plain":
            entries = self._load_plain(model, count)
        else:
            entries = self._dcp_entries()
        self.entries = {k: entries[k] for k in order if k in entries} | {
            k: v for k, v in entries.items() if k not in order
        }

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        if self._state is not None:
            return {name: self._state[name] for name in names}
        import torch.distributed.checkpoint as dcp

        from phalanx.checkpoint.safe import SafeLoadPlanner, SafeReader

        template = {name: torch.empty(self.entries[name][0], dtype=self.entries[name][1]) for name in names}
        if not template:
            return {}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")  # it is
            dcp.load(
                {self._prefix: template},
                storage_reader=SafeReader(str(self.directory / "shards")),
                planner=SafeLoadPlanner(),
                no_dist=True,
            )
        return template

    def same_storage(self) -> list[list[str]]:
        """Names whose tensors are one tensor in the file (torch.save keeps a tied weight once): the
        groups of a plain checkpoint saved before checkpoints recorded them. A dcp checkpoint holds
        each name on its own, so it has none."""
        if self._state is None:
            return []
        groups: dict[tuple, list[str]] = {}
        for name, tensor in self._state.items():
            if tensor.numel():
                key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape, tensor.stride())
                groups.setdefault(key, []).append(name)
        return [names for names in groups.values() if len(names) > 1]

    def close(self) -> None:
        self._state = None

    def _load_plain(self, model: int, count: int) -> dict[str, tuple]:
        from phalanx.checkpoint.safe import load_mapped

        path = self.directory / "model.pt"
        self._state = state = _one_model(load_mapped(path)[0], model, count, path)
        return {k: (tuple(v.shape), v.dtype) for k, v in state.items()}

    def _dcp_entries(self) -> dict[str, tuple]:
        from phalanx.checkpoint.safe import SafeReader

        metadata = SafeReader(str(self.directory / "shards")).read_metadata()
        prefix = f"{self._prefix}."
        return {
            key[len(prefix) :]: (tuple(meta.size), meta.properties.dtype)
            for key, meta in metadata.state_dict_metadata.items()
            if key.startswith(prefix) and hasattr(meta, "properties")
        }


def _which(manifest: dict[str, Any], model: int) -> int:
    count = len(manifest["models"])
    if not 0 <= model < count:
        raise PhalanxError(f"the checkpoint holds {count} model(s); --model must be 0..{count - 1}")
    return model


def _one_model(models: Any, model: int, count: int, path: Path) -> dict[str, torch.Tensor]:
    state = models[model] if isinstance(models, list) and len(models) == count else None
    if not (isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values())):
        raise PhalanxError(
            f"checkpoint file '{path}' does not hold the {count} model state dict(s) "
            "its manifest lists; use an earlier checkpoint"
        )
    return state


FORMATS = ("pt", "safetensors")  # files; `--format hf` (a directory) is hf_export.py's


def output_format(out: str | Path, format: str | None = None) -> str:
    """``format``, or by default ``safetensors`` for an ``out`` ending in ``.safetensors`` and ``pt`` otherwise."""
    if format is None:
        return "safetensors" if str(out).lower().endswith(".safetensors") else "pt"
    if format not in FORMATS:
        raise PhalanxError(f"export format {format!r} is not one of {', '.join(FORMATS)}; choose one of them")
    return format


def export(
    path: str | Path, out: str | Path, model: int = 0, format: str | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Write model ``model``'s consolidated state dict to ``out`` (atomically) as a torch file or, with
    ``format="safetensors"`` (the default for an ``out`` ending in ``.safetensors``), a safetensors
    file; returns the manifest and the state dict."""
    out = Path(out)
    format = output_format(out, format)
    try:
        _check_output(out, format)  # before the checkpoint is read and hashed, which can take long
    except OSError as err:  # a name too long, a directory that may not be searched
        raise PhalanxError(f"cannot write '{out}' ({err.strerror or err}); choose another output path") from None
    manifest = open_checkpoint(path)
    state = model_state_dict(manifest, model)
    if format == "safetensors":
        # Hugging Face's loaders read "format" to know the tensors came from torch; the rest says where from.
        metadata = {
            "format": "pt",
            "phalanx_step": str(manifest["step"]),
            "phalanx_model": str(model),
            "phalanx_strategy": str(manifest["strategy"]),
        }
        write_safetensors(state, out, metadata)
    else:
        _write(state, out)
    return manifest, state


def _check_output(out: Path, format: str = "pt") -> None:
    if "\x00" in str(out):
        raise PhalanxError(f"the output path {str(out)!r} holds a NUL character; give a file path")
    if out.is_dir():
        raise PhalanxError(
            f"'{out}' is a directory; give the file to write, e.g. {out / f'model.{format}'}, "
            "or write a Hugging Face model directory with --format hf"
        )
    if out.exists() and not out.is_file():
        # os.replace would put the export in place of a device, FIFO or socket.
        raise PhalanxError(f"'{out}' exists and is not a regular file; give the path of a file to write")
    if out.parent.exists() and not out.parent.is_dir():
        raise PhalanxError(f"'{out.parent}' is a file, not a directory; choose an output path inside a directory")
    if not out.parent.is_dir():
        raise PhalanxError(f"directory '{out.parent}' does not exist; create it or choose another output path")


def _write(state: dict[str, torch.Tensor], out: Path) -> None:
    with atomic_output(out) as tmp, open(tmp, "wb") as fh:
        torch.save(state, fh)
