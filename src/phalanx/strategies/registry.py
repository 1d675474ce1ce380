"""The strategies by name: ``strategy.name`` picks one; each lives in its own module and is added
here with :func:`register`, which also adds its options section to the config tree."""

from __future__ import annotations

from phalanx.config.schema import describe_strategy_names, register_strategy_options, unregister_strategy_options
from phalanx.errors import ConfigError
from phalanx.strategies.base import Strategy
from phalanx.strategies.ddp import DDP
from phalanx.strategies.dp import DataParallel
from phalanx.strategies.fsdp import FSDP
from phalanx.strategies.model_parallel import ModelParallel
from phalanx.strategies.pipeline import Pipeline
from phalanx.strategies.single import SingleDevice
from phalanx.strategies.tp import TensorParallel
from phalanx.strategies.zero1 import Zero1

STRATEGIES: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Make ``cls`` a value of ``strategy.name``, its options ``strategy.<cls.options_key>``, and
    its plan rows rows of ``phalanx plan``. Returns ``cls``, so it works as a class decorator."""
    if cls.name in ("auto", *STRATEGIES):
        raise ValueError(f"a strategy named '{cls.name}' is already registered")
    _refuse_old_surface(cls)
    labels = {row.label for other in STRATEGIES.values() for row in other.plan_rows}
    clash = sorted(labels & {row.label for row in cls.plan_rows})
    if clash:
        raise ValueError(f"strategy '{cls.name}' declares plan rows that others have: {', '.join(clash)}")
    if cls.options is not None:
        register_strategy_options(options_key_of(cls), cls.options)
    STRATEGIES[cls.name] = cls
    _describe()
    return cls


def _refuse_old_surface(cls: type[Strategy]) -> None:
    """A strategy written for the surface before the parallel layout would plan its batch wrong
    (its data_parallel_size_for is no longer asked) or fail at setup (booleans in Sharding)."""
    if "data_parallel_size_for" in vars(cls):
        raise ValueError(
            f"strategy '{cls.name}' defines data_parallel_size_for, which phalanx no longer calls; declare its "
            "layout axes instead (axes = ('dp_replicate',), ...: strategies/parallel_layout.py)"
        )
    shards = cls.shards
    if any(not isinstance(getattr(shards, kind), tuple) for kind in ("parameters", "gradients", "optimizer")):
        raise ValueError(
            f"strategy '{cls.name}' declares Sharding with booleans; give the layout axes each kind is divided "
            "over, e.g. Sharding(optimizer=('dp_replicate',))"
        )


def unregister(name: str) -> None:
    """Undo :func:`register`; its options section goes too unless another strategy reads it."""
    cls = STRATEGIES.pop(name)
    key = options_key_of(cls)
    if cls.options is not None and not any(options_key_of(other) == key for other in STRATEGIES.values()):
        unregister_strategy_options(key)
    _describe()


def options_key_of(cls: type[Strategy]) -> str:
    """The key of ``cls``'s options section under ``strategy.``: its own, else its name."""
    return cls.options_key or cls.name


def _describe() -> None:
    names = " | ".join(["auto", *STRATEGIES])
    describe_strategy_names(f"{names} (auto: {DDP.name} with several processes, else {SingleDevice.name})")


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


def _register_builtins() -> None:
    for cls in (SingleDevice, DataParallel, DDP, Zero1, FSDP, TensorParallel, ModelParallel, Pipeline):
        register(cls)


_register_builtins()
