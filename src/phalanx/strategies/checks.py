"""Every combination of strategy and settings that cannot work, refused in one place: the launcher
calls :func:`check_combination` in ``prepare()``, before any process starts, and every Session
calls it through ``create_strategy``, so a script run without the launcher refuses the same.

The rules read the strategies' capabilities (class attributes, see base.py), never their names;
a strategy's rules about its own section (``strategy.pipeline.*``, ...) are its ``check_settings``,
and those about its section's settings under another strategy its ``options_apply``.
Each refusal is one line (a ConfigError) naming the setting and the fix."""

from __future__ import annotations

from phalanx.config.schema import Config
from phalanx.errors import ConfigError
from phalanx.strategies.base import PRECISIONS, Strategy
from phalanx.strategies.registry import STRATEGIES, names_with, options_key_of, strategy_class


def check_combination(
    config: Config, world_size: int | None = None, device: str | None = None, per_node: int | None = None
) -> None:
    """Refuse what ``config`` asks of its strategy on ``world_size`` processes (``per_node`` of
    them on each node) on ``device`` ("cuda" or "cpu"); any may be None where it is not known yet
    (``phalanx config show``), and the rules that need it are then left to the launcher and the Session."""
    named = config.strategy.name
    cls = strategy_class(named, world_size or 1)
    tp = config.strategy.tp.size or 1
    if tp > 1 and "tp" not in cls.axes:
        holders = _listed([n for n, other in STRATEGIES.items() if "tp" in other.axes], "or")
        raise ConfigError(
            f"strategy.tp.size {tp} splits layers over tensor-parallel peers, which strategy {cls.name} cannot hold; "
            f"use strategy {holders}, or set strategy.tp.size: 1"
        )
    for owner in _section_owners():
        _refuse_foreign_options(config, owner, cls)
    if config.compute.compile and not cls.supports_compile:
        head = f"compute.compile is not supported with strategy {cls.name}"
        fix = (
            f"(phalanx compiles the wrapped model of {_listed(names_with('supports_compile'), 'and')} only); "
            "use one of those, or set compute.compile: false"
        )
        raise ConfigError(_refusal(head, cls, "compute.compile", fix, joined=" "))
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
        cls.layout_for(config, world_size, per_node)
    cls.check_settings(config, world_size, device)


def _refusal(head: str, cls: type[Strategy], setting: str, fix: str, joined: str = "; ") -> str:
    """``head`` and the strategy's own advice for ``setting``, else ``fix`` after ``joined``."""
    advice = cls.advice.get(setting)
    return f"{head} {advice}" if advice else f"{head}{joined}{fix}"


def _section_owners() -> list[type[Strategy]]:
    """One strategy per options section: the first registered that declares it."""
    owners: dict[str, type[Strategy]] = {}
    for cls in STRATEGIES.values():
        if cls.options is not None:
            owners.setdefault(options_key_of(cls), cls)
    return list(owners.values())


def _refuse_foreign_options(config: Config, owner: type[Strategy], cls: type[Strategy]) -> None:
    """Refuse a setting of ``owner``'s section that does nothing under strategy ``cls``
    (strategy.ddp.comm_hook under fsdp); its ``options_apply`` says which and why."""
    # auto resolves to a strategy with the capability wherever the setting has something to do
    # (ddp for several processes); alone, there is nothing to compress.
    if config.strategy.name == "auto":
        return
    key = options_key_of(owner)
    section = getattr(config.strategy, key)
    for setting, (capability, what) in owner.options_apply.items():
        value, default = getattr(section, setting), type(section).model_fields[setting].get_default()
        if value != default and not getattr(cls, capability):
            shown = str(value).lower() if isinstance(value, bool) else value
            head = f"strategy.{key}.{setting}={shown} {what}, which strategy {cls.name} does not use"
            fix = f"use strategy {_listed(names_with(capability), 'or')}, or set {setting} {default}"
            raise ConfigError(_refusal(head, cls, f"strategy.{key}.{setting}", fix))


def _listed(names: list[str], conjunction: str) -> str:
    """["a", "b", "c"] -> "a, b or c"."""
    return f"{', '.join(names[:-1])} {conjunction} {names[-1]}" if len(names) > 1 else names[0]
