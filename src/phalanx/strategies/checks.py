"""Every combination of strategy and settings that cannot work, refused in one place: the launcher
calls :func:`check_combination` in ``prepare()``, before any process starts, and every Session
calls it through ``create_strategy``, so a script run without the launcher refuses the same.

The rules read the strategies' capabilities (class attributes, see base.py), never their names;
a strategy's rules about its own section (``strategy.pipeline.*``, ...) are its ``check_settings``.
Each refusal is one line (a ConfigError) naming the setting and the fix."""

from __future__ import annotations

from phalanx.config.schema import Config
from phalanx.errors import ConfigError
from phalanx.strategies.base import PRECISIONS, Strategy
from phalanx.strategies.registry import names_with, strategy_class


def check_combination(config: Config, world_size: int | None = None, device: str | None = None) -> None:
    """Refuse what ``config`` asks of its strategy on ``world_size`` processes on ``device``
    ("cuda" or "cpu"); either may be None where it is not known yet (``phalanx config show``),
    and the rules that need it are then left to the launcher and the Session."""
    named = config.strategy.name
    cls = strategy_class(named, world_size or 1)
    hook = config.strategy.ddp.comm_hook
    # auto is ddp wherever there is something to all-reduce; alone, the hook has nothing to do.
    if hook != "none" and named != "auto" and not cls.ddp_buckets:
        raise ConfigError(
            f"strategy.ddp.comm_hook={hook} compresses DDP's gradient all-reduce, which strategy {cls.name} does "
            f"not use; use strategy {_listed(names_with('ddp_buckets'), 'or')}, or set comm_hook none"
        )
    if config.compute.compile and not cls.supports_compile:
        raise ConfigError(
            f"compute.compile is not supported with strategy {cls.name} (phalanx compiles the wrapped model of "
            f"{_listed(names_with('supports_compile'), 'and')} only); use one of those, or set compute.compile: false"
        )
    if config.compute.channels_last and not cls.supports_channels_last:
        head = f"compute.channels_last is not supported with strategy {cls.name}"
        raise ConfigError(_refusal(head, cls, "compute.channels_last", "set compute.channels_last: false"))
    mode = config.precision.mode
    if mode not in cls.precisions:
        supported = " or ".join(p for p in PRECISIONS if p in cls.precisions)
        head = f"strategy {cls.name} does not support precision.mode {mode}"
        raise ConfigError(_refusal(head, cls, "precision.mode", f"use precision.mode {supported}"))
    if world_size is not None:
        cls.check_world(world_size)
    cls.check_settings(config, world_size, device)


def _refusal(head: str, cls: type[Strategy], setting: str, fix: str) -> str:
    advice = cls.advice.get(setting)
    return f"{head} {advice}" if advice else f"{head}; {fix}"


def _listed(names: list[str], conjunction: str) -> str:
    """["a", "b", "c"] -> "a, b or c"."""
    return f"{', '.join(names[:-1])} {conjunction} {names[-1]}" if len(names) > 1 else names[0]
