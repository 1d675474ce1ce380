"""``phalanx checkpoint export --format hf``: one model of a checkpoint as the directory Hugging
Face's ``save_pretrained`` writes and ``from_pretrained`` reads.

    DIR/model.safetensors                  the weights, when they fit one shard
    DIR/model-00001-of-0000N.safetensors   ... or N shards of at most --max-shard-size each
    DIR/model.safetensors.index.json       with N > 1: metadata.total_size and the weight_map
    DIR/config.json                        the model's config, when the checkpoint recorded one
    DIR/generation_config.json             its generation config, likewise

Shards are filled in the state dict's order, each up to the limit; a tensor larger than the limit
gets a shard of its own (the file is then larger than the limit, as with save_pretrained). A tied
weight is written once, under the name the checkpoint recorded first (hf_model.py: the copy that
``_tied_weights_keys`` declares is left out, as save_pretrained leaves ``lm_head.weight`` out), or
for a checkpoint without that record under its first name among tensors that are one in the file.

The checkpoint is read one shard's tensors at a time, so the memory an export takes is about
twice the largest shard (the tensors, and safetensors' bytes of them), not the model. Everything
is written into a directory beside DIR and renamed into place when complete, so a failed export
leaves no partial DIR, and a previous export in DIR as it was. A killed one leaves that directory,
named ``.phalanx-export-<pid>.tmp``, and, killed between moving a previous export aside and
renaming the new one into its place, the previous export as ``.phalanx-export-<pid>.old``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError

from phalanx.checkpoint import files, hf_model
from phalanx.checkpoint.export import ModelTensors, open_checkpoint
from phalanx.checkpoint.weights import WeightsFile, safetensors_ready, write_failure
from phalanx.errors import PhalanxError
from phalanx.util.units import format_bytes

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
DEFAULT_MAX_SHARD = 5 * 1024**3  # bytes: "5G", the size the Hugging Face Hub has long recommended
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_OURS = {SINGLE, INDEX, hf_model.CONFIG, hf_model.GENERATION_CONFIG}


@dataclass
class HfExport:
    """What an export wrote: the checkpoint's manifest, the files in DIR, the tensors and values
    written, and whether a config.json is among the files."""

    manifest: dict[str, Any]
    files: list[str]
    tensors: int
    values: int
    total_size: int
    config: dict[str, Any] | None


def export_hf(path: str | Path, out: str | Path, model: int = 0, max_shard_size: int = DEFAULT_MAX_SHARD) -> HfExport:
    """Write model ``model`` of the checkpoint at ``path`` into directory ``out`` (see the module)."""
    out = Path(out)
    if max_shard_size < 1:
        raise PhalanxError(f"--max-shard-size must be at least 1 byte, not {max_shard_size}; write e.g. 5G or 500M")
    check_output_directory(out)  # before the checkpoint is read and hashed, which can take long
    manifest = open_checkpoint(path)
    tensors = ModelTensors(manifest, model)
    try:
        names = written_names(tensors, manifest["models"][model])
        sizes = [(n, _nbytes(*tensors.entries[n])) for n in names]
        shards = plan_shards(sizes, max_shard_size)
        config = _config(manifest, model, tensors, names)
        metadata = {
            "format": "pt",  # what from_pretrained reads to know the tensors came from torch
            "phalanx_step": str(manifest["step"]),
            "phalanx_model": str(model),
            "phalanx_strategy": str(manifest["strategy"]),
        }
        with _staging(out) as staging:
            written = []
            for number, shard in enumerate(shards, 1):
                name = shard_name(number, len(shards))
                _save(tensors.read(shard), staging / name, metadata)
                written.append(name)
            total = sum(size for _, size in sizes)
            if len(shards) > 1:
                index = {
                    "metadata": {"total_parameters": manifest["models"][model]["parameters"], "total_size": total},
                    "weight_map": {n: shard_name(i, len(shards)) for i, shard in enumerate(shards, 1) for n in shard},
                }
                _write_text(staging / INDEX, json.dumps(index, indent=2, sort_keys=True) + "\n")
                written.append(INDEX)
            if config is not None:
                _write_text(staging / hf_model.CONFIG, json.dumps(config, indent=2, sort_keys=True) + "\n")
                written.append(hf_model.CONFIG)
                generation = hf_model.stored_as(model, hf_model.GENERATION_CONFIG)
                if generation in manifest["files"]:
                    shutil.copyfile(Path(manifest["path"]) / generation, staging / hf_model.GENERATION_CONFIG)
                    written.append(hf_model.GENERATION_CONFIG)
    finally:
        tensors.close()
    values = sum(math.prod(tensors.entries[n][0]) for n in names)
    return HfExport(manifest, written, len(names), values, total, config)


def plan_shards(sizes: list[tuple[str, int]], limit: int) -> list[list[str]]:
    """``sizes`` (name, bytes) cut into consecutive shards of at most ``limit`` bytes each, greedily
    in their order; a tensor over the limit is a shard on its own."""
    shards: list[list[str]] = []
    used = 0
    for name, size in sizes:
        if not shards or used + size > limit:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def shard_name(number: int, count: int) -> str:
    """Hugging Face's file names: ``model.safetensors`` alone, else ``model-00002-of-00005.safetensors``."""
    return SINGLE if count == 1 else f"model-{number:05d}-of-{count:05d}.safetensors"


def written_names(tensors: ModelTensors, model_info: dict[str, Any]) -> list[str]:
    """The state dict's names less the tied copies: every group of names of one tensor keeps its first."""
    groups = model_info["tied"] if "tied" in model_info else tensors.same_storage()
    dropped = {n for group in groups if group and group[0] in tensors.entries for n in group[1:]}
    return [n for n in tensors.entries if n not in dropped]


def check_output_directory(out: Path) -> None:
    """``out`` may be written: new (in an existing directory), empty, or a previous export (which the
    new one replaces); anything else is refused in one line before any work is done."""
    try:
        if "\x00" in str(out):
            raise PhalanxError(f"the output path {str(out)!r} holds a NUL character; give a directory path")
        if out.exists() and not out.is_dir():
            raise PhalanxError(
                f"'{out}' is a file; --format hf writes a directory: give a new or empty directory, "
                "or a previous export to replace"
            )
        parent = out.absolute().parent
        if not parent.is_dir():
            what = "is a file, not a directory" if parent.exists() else "does not exist"
            raise PhalanxError(f"'{parent}' {what}; create the directory or choose another output path")
        if out.is_dir():
            foreign = _not_an_export(out)
            if foreign:
                raise PhalanxError(
                    f"'{out}' holds {foreign}, which a phalanx export does not write; give a new or empty directory, "
                    "or a previous export to replace"
                )
    except OSError as err:  # a name too long, a directory that may not be searched
        raise PhalanxError(f"cannot write '{out}' ({err.strerror or err}); choose another output directory") from None


def _not_an_export(directory: Path) -> str | None:
    """What in ``directory`` shows it is not a previous export (the first such entry), or None."""
    for entry in sorted(directory.iterdir()):
        if entry.is_symlink() or not entry.is_file() or not (entry.name in _OURS or _SHARD.fullmatch(entry.name)):
            return f"'{entry.name}'"
        if entry.suffix == ".safetensors":
            try:
                with WeightsFile(entry) as weights:
                    ours = "phalanx_model" in weights.metadata
            except PhalanxError:
                ours = False
            if not ours:
                return f"'{entry.name}' (weights phalanx did not export)"
    return None


@contextlib.contextmanager
def _staging(out: Path) -> Iterator[Path]:
    """A directory beside ``out`` to write into, renamed to ``out`` when the block ends (a previous
    export there is replaced), removed when it fails. A previous export is moved aside (to
    ``.phalanx-export-<pid>.old``) for the moment between the two renames, and put back if the
    second fails, so a failed export leaves it in place; only a kill in that moment leaves it
    aside (docs/checkpoints.md says what to do then)."""
    staging = out.absolute().parent / f".phalanx-export-{os.getpid()}.tmp"
    old = staging.with_suffix(".old")
    done = False
    try:
        for stale in (staging, old):  # left by a killed export that had this process id
            shutil.rmtree(stale, ignore_errors=True)
        staging.mkdir()
        yield staging
        files.fsync_tree(staging)
        if out.exists():
            os.rename(out, old)
            try:
                os.rename(staging, out)
            except OSError as err:
                _put_back(old, out, err)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, out)
        files.fsync_path(out.absolute().parent)  # the renames are only as durable as the parent's entries
        done = True
    except (OSError, RuntimeError, SafetensorError) as err:
        raise PhalanxError(
            f"cannot write '{out}' ({write_failure(err)}); choose an output directory on a writable disk with "
            "enough free space"
        ) from None
    finally:
        if not done:
            shutil.rmtree(staging, ignore_errors=True)


def _put_back(old: Path, out: Path, err: OSError) -> None:
    """The previous export, moved to ``old``, renamed back to ``out`` after the new one could not
    take its place (``err``); where that fails too, the line says where it is."""
    try:
        os.rename(old, out)
    except OSError:
        raise PhalanxError(
            f"cannot write '{out}' ({write_failure(err)}), and the previous export could not be put back: it is in "
            f"'{old}'; rename it to '{out}'"
        ) from None


def _save(state: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    save_file(safetensors_ready(state), path, metadata=metadata)


def _write_text(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")


def _config(manifest: dict[str, Any], model: int, tensors: ModelTensors, names: list[str]) -> dict[str, Any] | None:
    """The config.json the checkpoint recorded, its dtype that of the weights written (as
    save_pretrained records the model's): from_pretrained loads in that dtype by default."""
    name = hf_model.stored_as(model, hf_model.CONFIG)
    if name not in manifest["files"]:
        return None
    path = Path(manifest["path"]) / name
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise PhalanxError(f"checkpoint file '{path}' is unreadable ({err}); use an earlier checkpoint") from None
    if not isinstance(config, dict):
        raise PhalanxError(f"checkpoint file '{path}' holds no JSON object; use an earlier checkpoint")
    floating = next((tensors.entries[n][1] for n in names if tensors.entries[n][1].is_floating_point), None)
    if floating is not None:
        key = "torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"  # transformers 4's key
        config[key] = str(floating).removeprefix("torch.")
    return config


def describe_shards(export: HfExport, max_shard_size: int) -> str:
    shards = [f for f in export.files if f.endswith(".safetensors")]
    if len(shards) == 1:
        return f"in {shards[0]} ({format_bytes(export.total_size)})"
    return f"in {len(shards)} shards of at most {format_bytes(max_shard_size)} ({format_bytes(export.total_size)})"


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize
