"""A checkpoint's contents without the training run: its summary, and the consolidated weights of
one model as a plain state dict (no ``module.`` prefix, whichever strategy saved it)."""

from __future__ import annotations

import contextlib
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


def export(path: str | Path, out: str | Path, model: int = 0) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Write model ``model``'s consolidated state dict to ``out`` (atomically); returns both."""
    out = Path(out)
    try:
        _check_output(out)  # before the checkpoint is read and hashed, which can take long
    except OSError as err:  # a name too long, a directory that may not be searched
        raise PhalanxError(f"cannot write '{out}' ({err.strerror or err}); choose another output path") from None
    manifest = open_checkpoint(path)
    state = model_state_dict(manifest, model)
    _write(state, out)
    return manifest, state


def _check_output(out: Path) -> None:
    if "\x00" in str(out):
        raise PhalanxError(f"the output path {str(out)!r} holds a NUL character; give a file path")
    if out.is_dir():
        raise PhalanxError(f"'{out}' is a directory; give the file to write, e.g. {out / 'model.pt'}")
    if out.exists() and not out.is_file():
        # os.replace would put the export in place of a device, FIFO or socket.
        raise PhalanxError(f"'{out}' exists and is not a regular file; give the path of a file to write")
    if out.parent.exists() and not out.parent.is_dir():
        raise PhalanxError(f"'{out.parent}' is a file, not a directory; choose an output path inside a directory")
    if not out.parent.is_dir():
        raise PhalanxError(f"directory '{out.parent}' does not exist; create it or choose another output path")


def _write(state: dict[str, torch.Tensor], out: Path) -> None:
    """Into a temporary file beside ``out``, renamed over it: a failed export leaves no partial file.
    The temporary name is short, so that an ``out`` near the file system's name limit still fits."""
    tmp = out.parent / f".phalanx-export-{os.getpid()}.tmp"
    done = False
    try:
        with open(tmp, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out)
        done = True
    except (OSError, RuntimeError) as err:
        lines = str(err).strip().splitlines() or [type(err).__name__]
        reason = err.strerror if isinstance(err, OSError) and err.strerror else lines[-1]
        raise PhalanxError(
            f"cannot write '{out}' ({reason}); choose an output path in a writable directory with enough free space"
        ) from None
    finally:
        if not done:
            with contextlib.suppress(OSError):
                tmp.unlink()
