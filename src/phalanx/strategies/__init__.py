"""Strategy registry: a strategy is chosen by name from config; each lives in its own module."""

from __future__ import annotations

from phalanx.config.schema import Config
from phalanx.strategies.base import Sharding, Strategy
from phalanx.strategies.checks import check_combination
from phalanx.strategies.registry import STRATEGIES, resolve_name, strategy_class
from phalanx.topology import Topology


def create_strategy(config: Config, topology: Topology) -> Strategy:
    """The strategy ``config`` names, after the same checks the launcher makes before it starts a
    process, so a Session built without the launcher refuses the same combinations."""
    check_combination(config, topology.world_size, topology.device.type, topology.local_world_size)
    return strategy_class(config.strategy.name, topology.world_size)(config, topology)


__all__ = [
    "STRATEGIES",
    "Sharding",
    "Strategy",
    "check_combination",
    "create_strategy",
    "resolve_name",
    "strategy_class",
]
