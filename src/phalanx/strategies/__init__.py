"""Strategy registry: a strategy is chosen by name from config; each lives in its own module."""

from __future__ import annotations

from phalanx.config.schema import Config
from phalanx.errors import ConfigError
from phalanx.strategies.base import Strategy
from phalanx.strategies.ddp import DDP
from phalanx.strategies.dp import DataParallel
from phalanx.strategies.fsdp import FSDP
from phalanx.strategies.model_parallel import ModelParallel
from phalanx.strategies.pipeline import Pipeline
from phalanx.strategies.single import SingleDevice
from phalanx.strategies.zero1 import Zero1
from phalanx.topology import Topology

STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (SingleDevice, DataParallel, DDP, Zero1, FSDP, ModelParallel, Pipeline)}


def resolve_name(name: str, world_size: int) -> str:
    """``auto`` means ddp with several processes, else single."""
    if name == "auto":
        return "ddp" if world_size > 1 else "single"
    return name


def strategy_class(name: str, world_size: int = 1) -> type[Strategy]:
    resolved = resolve_name(name, world_size)
    try:
        return STRATEGIES[resolved]
    except KeyError:
        raise ConfigError(f"unknown strategy '{name}' in strategy.name; choose one of: auto, {', '.join(STRATEGIES)}") from None


def create_strategy(config: Config, topology: Topology) -> Strategy:
    return strategy_class(config.strategy.name, topology.world_size)(config, topology)


__all__ = ["STRATEGIES", "Strategy", "create_strategy", "resolve_name", "strategy_class"]
