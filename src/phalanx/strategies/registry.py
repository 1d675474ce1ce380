"""The strategies by name: ``strategy.name`` picks one; each lives in its own module."""

from __future__ import annotations

from phalanx.errors import ConfigError
from phalanx.strategies.base import Strategy
from phalanx.strategies.ddp import DDP
from phalanx.strategies.dp import DataParallel
from phalanx.strategies.fsdp import FSDP
from phalanx.strategies.model_parallel import ModelParallel
from phalanx.strategies.pipeline import Pipeline
from phalanx.strategies.single import SingleDevice
from phalanx.strategies.zero1 import Zero1

_CLASSES = (SingleDevice, DataParallel, DDP, Zero1, FSDP, ModelParallel, Pipeline)
STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in _CLASSES}


def resolve_name(name: str, world_size: int) -> str:
    """``auto`` means ddp with several processes, else single."""
    if name == "auto":
        return DDP.name if world_size > 1 else SingleDevice.name
    return name


def strategy_class(name: str, world_size: int = 1) -> type[Strategy]:
    resolved = resolve_name(name, world_size)
    try:
        return STRATEGIES[resolved]
    except KeyError:
        raise ConfigError(
            f"unknown strategy '{name}' in strategy.name; choose one of: auto, {', '.join(STRATEGIES)}"
        ) from None


def names_with(capability: str) -> list[str]:
    """The strategies whose class attribute ``capability`` is true, in registry order."""
    return [name for name, cls in STRATEGIES.items() if getattr(cls, capability)]
