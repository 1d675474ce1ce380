"""What a checkpoint records about a Hugging Face model at save time, so that an export can write
the directory ``from_pretrained`` reads: the model's config (``config.json``), its generation config
(``generation_config.json``), and which state-dict names are one tied tensor, with the name that
is written first.

Found by duck typing, never by importing transformers: a model whose ``config`` has
``to_json_string()`` or ``to_dict()`` is taken for one. A config that does not turn into a JSON
object is left out; a checkpoint is never refused for it (the export then writes no config.json).
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

CONFIG, GENERATION_CONFIG = "config.json", "generation_config.json"


def stored_as(model: int, name: str) -> str:
    """Where a checkpoint keeps model ``model``'s ``config.json`` (or generation_config.json)."""
    return f"hf/model{model}/{name}"


def recorded_class(manifest: dict[str, Any], model: int) -> str | None:
    """The class of model ``model`` of a checkpoint whose Hugging Face config it recorded, or None."""
    name = stored_as(model, CONFIG)
    if name not in manifest["files"]:
        return None
    try:
        with open(f"{manifest['path']}/{name}", encoding="utf-8") as fh:
            architectures = json.load(fh).get("architectures")
    except (OSError, ValueError, AttributeError):  # shown, not loaded: a damaged file says nothing here
        return None
    return architectures[0] if isinstance(architectures, list) and architectures else "a Hugging Face model"


def hf_files(model: nn.Module) -> dict[str, str]:
    """``{"config.json": text, "generation_config.json": text}`` for the bare ``model``, either
    absent where the model has no such config."""
    out = {}
    config = _json_object(getattr(model, "config", None))
    if config is not None:
        # save_pretrained records the class that saved the weights; a config built by hand has none.
        if not config.get("architectures"):
            config["architectures"] = [_class_name(model)]
        out[CONFIG] = json.dumps(config, indent=2, sort_keys=True) + "\n"
        generation = _json_object(getattr(model, "generation_config", None))
        if generation is not None:
            out[GENERATION_CONFIG] = json.dumps(generation, indent=2, sort_keys=True) + "\n"
    return out


def tied_groups(model: nn.Module, slots: dict[str, torch.Tensor]) -> list[list[str]]:
    """The names of ``slots`` (strategy.weight_slots: the state dict's tensors as this rank holds
    them) that are one tensor, in groups of two or more. The first name of each group is the one an
    export keeps: as save_pretrained does, the names a Hugging Face model declares as tied copies
    (``lm_head.weight``) go last; otherwise the state dict's order decides."""
    groups: dict[int, list[str]] = {}
    for name, slot in slots.items():
        if not slot.is_meta:  # another pipeline stage's placeholder: not this rank's to group
            groups.setdefault(id(slot), []).append(name)
    copies = _tied_copies(model)
    return [sorted(names, key=lambda n: n in copies) for names in groups.values() if len(names) > 1]


def _tied_copies(model: nn.Module) -> set[str]:
    """The state-dict names a Hugging Face model declares as copies of a tied weight, through its
    public surface: ``all_tied_weights_keys`` (transformers 5: copy -> source, expanded to the
    model's names), else the weight of ``get_output_embeddings()`` (the output layer that ties to
    the input embedding in every version)."""
    declared = getattr(model, "all_tied_weights_keys", None)
    if isinstance(declared, dict):
        return {k for k in declared if isinstance(k, str)}
    get_output = getattr(model, "get_output_embeddings", None)
    try:
        output = get_output() if callable(get_output) else None
    except Exception:  # the model's own code: whatever it raises means "no output embedding"
        return set()
    weight = getattr(output, "weight", None)
    return {name for name, p in model.named_parameters(remove_duplicate=False) if weight is not None and p is weight}


def _json_object(config: Any) -> dict[str, Any] | None:
    for method in ("to_json_string", "to_dict"):
        make = getattr(config, method, None)
        if not callable(make):
            continue
        try:
            made = make()
            value = json.loads(made) if isinstance(made, str) else json.loads(json.dumps(made))
        except Exception:  # the model's own code: whatever it raises means "no usable config"
            return None
        return value if isinstance(value, dict) else None
    return None


def _class_name(model: nn.Module) -> str:
    """The model's own class: fully_shard puts the model in a class of its own (FSDPGPT2LMHeadModel)
    that subclasses torch's FSDPModule and the model's class."""
    for cls in type(model).__mro__:
        if not cls.__module__.startswith("torch.distributed."):
            return cls.__name__
    return type(model).__name__
