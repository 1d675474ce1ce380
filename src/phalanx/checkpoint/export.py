"""A checkpoint's contents without the training run: its summary, and the consolidated weights of
one model as a plain state dict (no ``module.`` prefix, whichever strategy saved it)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch

from phalanx.checkpoint import files
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
        return load_file(directory / "model.pt")[model]
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


def export(path: str | Path, out: str | Path, model: int = 0) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Write model ``model``'s consolidated state dict to ``out`` (atomically); returns both."""
    manifest = open_checkpoint(path)
    state = model_state_dict(manifest, model)
    out = Path(out)
    if out.is_dir():
        raise PhalanxError(f"'{out}' is a directory; give the file to write, e.g. {out / 'model.pt'}")
    if not out.parent.is_dir():
        raise PhalanxError(f"directory '{out.parent}' does not exist; create it or choose another output path")
    tmp = out.with_name(f".{out.name}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, out)
    return manifest, state
