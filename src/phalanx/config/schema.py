"""The one typed config tree: its sections (sections.py), the rules across them, and where each
value came from."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PrivateAttr, model_validator
from pydantic.fields import FieldInfo

from phalanx.config.sections import (
    EVERY_STRATEGY,
    SHORTHAND,
    BatchConfig,
    CheckpointConfig,
    ComputeConfig,
    DataConfig,
    FaultsConfig,
    LaunchConfig,
    OptimConfig,
    PrecisionConfig,
    Section,
    StrategyConfig,
    TrainConfig,
    flatten,
    parse_period,
)
from phalanx.config.sources import resolve


class Config(Section):
    preset: Literal["none", "throughput"] = Field(
        "none",
        description=(
            "throughput: turn on what is safe and fast for this device, below your own settings "
            "(docs/performance.md) | none"
        ),
    )
    strategy: StrategyConfig = Field(default_factory=StrategyConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    compute: ComputeConfig = Field(default_factory=ComputeConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    faults: FaultsConfig = Field(default_factory=FaultsConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)

    # Where each leaf value came from ("default", "file <path>", "code", "--set"); filled by the loader.
    _sources: dict[str, str] = PrivateAttr(default_factory=dict)

    @property
    def sources(self) -> dict[str, str]:
        return self._sources

    def record_sources(self, sources: dict[str, str]) -> None:
        """Set where leaf values came from (the loader's provenance, or a preset's note)."""
        self._sources.update(sources)

    @classmethod
    def load(cls, path=None, *, overrides=(), **sections) -> "Config":
        """Defaults < file < keyword arguments < ``--set`` overrides (see docs/config.md)."""
        return resolve(cls, path, overrides=overrides, sections=sections)

    # Rules across sections that depend on the strategy (fsdp and fp16, a comm hook without DDP, ...)
    # are the strategies' own: phalanx.strategies.checks, which the launcher and the Session call.
    @model_validator(mode="after")
    def _compile_mode_needs_compile(self):
        compute = self.compute
        if compute.compile_mode != "default" and not compute.compile:
            raise ValueError(
                f"compute.compile_mode={compute.compile_mode} has no effect while compute.compile is false; "
                "set compute.compile: true, or leave compile_mode at default"
            )
        return self

    def flat(self) -> dict[str, object]:
        """Leaf values keyed by dotted path, e.g. ``{"precision.mode": "bf16", ...}``."""
        return flatten(self.model_dump())


def register_strategy_options(key: str, section: type[Section]) -> None:
    """Add ``section`` to the tree as ``strategy.<key>``, a strategy's own options. The strategies
    call this as they register (strategies/registry.py): they sit above this layer, so the tree
    cannot import their sections. Registering the same section again changes nothing."""
    known = StrategyConfig.model_fields.get(key)
    if known is not None:
        if known.annotation is section:
            return
        raise ValueError(f"strategy.{key} is already {known.annotation.__name__}, not {section.__name__}")
    # pydantic has no public API to add a field to a built model; a new FieldInfo in model_fields
    # and a forced rebuild does it (pydantic 2.14; tests/unit/test_strategy_plugin.py checks it).
    # The class stays the same object, so every module that imported Config sees the new section.
    StrategyConfig.model_fields[key] = FieldInfo.from_annotated_attribute(section, Field(default_factory=section))
    _rebuild()


def unregister_strategy_options(key: str) -> None:
    """Remove ``strategy.<key>`` (a test's strategy, once the test is done)."""
    if key in EVERY_STRATEGY:
        raise ValueError(f"strategy.{key} belongs to every strategy")
    if StrategyConfig.model_fields.pop(key, None) is not None:
        _rebuild()


def describe_strategy_names(description: str) -> None:
    """The comment on ``strategy.name`` that ``phalanx config init`` writes: the registry's names."""
    StrategyConfig.model_fields["name"] = FieldInfo.from_annotated_attribute(
        str, Field("auto", description=description)
    )
    _rebuild()


def _rebuild() -> None:
    # Config's validator holds a copy of StrategyConfig's, so both are rebuilt.
    StrategyConfig.model_rebuild(force=True)
    Config.model_rebuild(force=True)


__all__ = [
    "Config",
    "SHORTHAND",
    "flatten",
    "parse_period",
    "BatchConfig",
    "CheckpointConfig",
    "ComputeConfig",
    "DataConfig",
    "FaultsConfig",
    "LaunchConfig",
    "OptimConfig",
    "PrecisionConfig",
    "StrategyConfig",
    "TrainConfig",
    "describe_strategy_names",
    "register_strategy_options",
    "unregister_strategy_options",
]
