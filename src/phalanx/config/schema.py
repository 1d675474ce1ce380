"""The one typed config tree: its sections (sections.py), the rules across them, and where each
value came from."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PrivateAttr, model_validator

from phalanx.config.sections import (
    SHORTHAND,
    BatchConfig,
    CheckpointConfig,
    ComputeConfig,
    DataConfig,
    DDPConfig,
    FaultsConfig,
    FSDPConfig,
    LaunchConfig,
    OptimConfig,
    PipelineConfig,
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
    def _first_bucket_fits(self):
        first, cap = self.strategy.ddp.first_bucket_cap_mb, self.strategy.ddp.bucket_cap_mb
        if first is not None and first > cap:
            raise ValueError(
                f"strategy.ddp.first_bucket_cap_mb ({first:g}) is larger than bucket_cap_mb ({cap:g}); "
                "the first bucket is meant to be small, so its all-reduce starts early: lower it or set it to null"
            )
        return self

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


__all__ = [
    "Config",
    "SHORTHAND",
    "flatten",
    "parse_period",
    "BatchConfig",
    "CheckpointConfig",
    "ComputeConfig",
    "DDPConfig",
    "DataConfig",
    "FSDPConfig",
    "FaultsConfig",
    "LaunchConfig",
    "OptimConfig",
    "PipelineConfig",
    "PrecisionConfig",
    "StrategyConfig",
    "TrainConfig",
]
