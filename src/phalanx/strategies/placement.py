"""Where a model's units go when it is split over devices (model_parallel) or stages (pipeline):
the units themselves, a contiguous assignment balanced by parameters, and the tied-weight check."""

from __future__ import annotations

from torch import nn

from phalanx.errors import ConfigError


def placement_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    units = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)) and len(child) > 1:
            units.extend((f"{name}.{i}", block) for i, block in enumerate(child))
        else:
            units.append((name, child))
    return units


def assign(units: list[tuple[str, nn.Module]], n_devices: int) -> list[int]:
    """Device index per unit: contiguous runs in model order, each device taking about an equal
    share of the parameters (a unit goes to the device where the cumulative share says it starts)."""
    sizes = [sum(p.numel() for p in unit.parameters()) for _, unit in units]
    total = sum(sizes) or 1
    out, seen = [], 0
    for size in sizes:
        # The unit's midpoint decides, so one huge unit does not push all others off its device.
        out.append(min(n_devices - 1, int((seen + size / 2) / total * n_devices)))
        seen += size
    return out


def refuse_shared_across(units: list[tuple[str, nn.Module]], assignment: list[int]) -> None:
    # A tied weight (say, input embedding and output layer) can live on one device only.
    owner: dict[int, tuple[str, int]] = {}
    for (name, unit), device in zip(units, assignment):
        for param in unit.parameters():
            first = owner.setdefault(id(param), (name, device))
            if first[1] != device:
                raise ConfigError(
                    f"{first[0]} and {name} share a parameter but would sit on different devices or stages; "
                    "untie the weights, or use fsdp"
                )
