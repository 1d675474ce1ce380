"""``preset: throughput``: settings that are safe and fast, applied as a layer between the defaults
and the user's own values (file, code, ``--set``), so anything the user sets wins. The whole table
is here; docs/performance.md shows it with the measurements behind each value.

It never touches the batch or the learning rate (``phalanx tune`` is for those), and nothing that
changes which model is trained (compile, channels_last, gradient compression): see the docs.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from phalanx.topology import LaunchContext

# Values per device kind: "any" applies everywhere, then the device's own entries.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "throughput": {
        "any": {
            # Fused kernels where the optimizer has them (Adam, AdamW, SGD, Adagrad), else foreach on CUDA.
            "compute.optimizer_impl": "auto",
        },
        "cuda": {
            # bf16 autocast (no loss scaling needed); fp32 on a GPU without native bf16 (see fit_to_device).
            "precision.mode": "bf16",
            "precision.tf32": True,
            "precision.cudnn_benchmark": True,
            # DDP's own layout when no size is given: a 1 MiB first bucket, so the first all-reduce
            # starts early in backward, then 25 MiB buckets.
            "strategy.ddp.first_bucket_cap_mb": 1.0,
        },
        # CPU: nothing more. Measured on 2 gloo processes (docs/performance.md), smaller buckets
        # or a small first bucket were slower than the 25 MiB default: the all-reduce threads take
        # the cores the overlapped backward would use. bf16 autocast is slower than fp32 there.
        "cpu": {},
    },
}

SOURCE = "preset {}"


def preset_values(name: str, device_kind: str) -> dict[str, Any]:
    """The dotted settings preset ``name`` sets on ``device_kind`` ("cuda" or "cpu")."""
    table = PRESETS.get(name, {})
    return {**table.get("any", {}), **table.get(device_kind, {})}


def device_kind(context: LaunchContext | None) -> str:
    """Where the config will run, without initialising CUDA (the launcher's own process must not)."""
    return "cuda" if torch.cuda.is_available() and not (context and context.force_cpu) else "cpu"


def apply_preset(tree: dict[str, Any], sources: dict[str, str], defaults: Mapping[str, Any], kind: str) -> None:
    """Put the preset named in ``tree`` under every value that still has its default, recording
    the source. Values an earlier resolution took from a preset go back to their defaults first,
    so a config resolved again (code or ``--set`` on top of a file) follows its current preset."""
    for key, source in list(sources.items()):
        if source.startswith("preset "):
            _put(tree, key, defaults[key])
            sources[key] = "default"
    name = tree.get("preset", "none")
    if not isinstance(name, str):
        return  # not a preset's name: validation names the value
    for key, value in preset_values(name, kind).items():
        if sources.get(key, "default") == "default":
            _put(tree, key, value)
            sources[key] = SOURCE.format(name)


def fit_to_device(config, device: torch.device):
    """In a worker, where CUDA may be initialised: a GPU without native bf16 keeps fp32 rather
    than the preset's bf16 (emulated bf16 is slower than fp32)."""
    if config.sources.get("precision.mode", "").startswith("preset ") and config.precision.mode == "bf16":
        if device.type != "cuda" or not torch.cuda.is_bf16_supported(including_emulation=False):
            fitted = config.model_copy(deep=True)
            fitted.precision.mode = "fp32"
            fitted.record_sources({"precision.mode": f"{config.sources['precision.mode']} (no native bf16: fp32)"})
            return fitted
    return config


def _put(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
        if not isinstance(tree, dict):
            return  # a section given as a value: validation names it
    tree[leaf] = value
