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


def model_state_dict(manifest: dict[str, Any], model: int = 0) -> dict[str, torch.Tensor]:
    """The full weights of model ``model`` of a checkpoint, on the CPU."""
    count = len(manifest["models"])
    if not 0 <= model < count:
        raise PhalanxError(f"the checkpoint holds {count} model(s); --model must be 0..{count - 1}")
    # Imported here: torch.distributed.checkpoint costs every `phalanx` command most of a second.
    from phalanx.checkpoint.safe import SafeLoadPlanner, SafeReader, load_file

    directory = Path(manifest["path"])
    if manifest["layout"] == "plain":
        models = load_file(directory / "model.pt")
        state = models[model] if isinstance(models, list) and len(models) == count else None
        if not (isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values())):
            raise PhalanxError(
                f"checkpoint file '{directory / 'model.pt'}' does not hold the {count} model state dict(s) "
                "its manifest lists; use an earlier checkpoint"
            )
        return state
    import torch.distributed.checkpoint as dcp

    reader = SafeReader(str(directory / "shards"))
    metadata = reader.read_metadata()
    prefix = f"model{model}."
    template: dict[str, torch.Tensor] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith(prefix) and hasattr(meta, "properties"):
            template[key[len(prefix) :]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    state = {f"model{model}": template}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")  # it is
        dcp.load(state, storage_reader=SafeReader(str(directory / "shards")), planner=SafeLoadPlanner(), no_dist=True)
    order = list(manifest["models"][model]["shapes"])
    return {k: template[k] for k in order if k in template} | {k: v for k, v in template.items() if k not in order}


FORMATS = ("pt", "safetensors")


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
        raise PhalanxError(f"'{out}' is a directory; give the file to write, e.g. {out / f'model.{format}'}")
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
