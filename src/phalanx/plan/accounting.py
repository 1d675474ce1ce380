"""Model-state memory per device for each strategy: parameters, gradients, optimizer state.

Two accountings:
- ``zero-paper``: Rajbhandari et al., 2019 (ZeRO), mixed-precision Adam: 2 bytes of fp16
  parameters, 2 of fp16 gradients and K = 12 of fp32 master weights, momentum and variance per
  parameter, divided among N devices as each stage shards them.
- ``phalanx``: what phalanx really keeps. Autocast (bf16/fp16) leaves parameters, gradients and
  optimizer state in fp32, so 4 + 4 + K bytes with K = 0 (SGD), 4 (SGD with momentum), 8 (Adam).
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml

from phalanx.config.sections import StrategyConfig
from phalanx.strategies import Sharding, Strategy
from phalanx.strategies.plan_rows import PlanRow
from phalanx.strategies.registry import STRATEGIES, options_key_of

OPTIMIZER_BYTES = {"sgd": 0, "momentum": 4, "adam": 8}  # fp32 state bytes per parameter
PAPER_K = 12


@dataclass(frozen=True)
class Variant:
    """A row of the plan: a strategy under the settings that change what it holds (its PlanRow)."""

    strategy: type[Strategy]
    row: PlanRow

    @property
    def settings(self) -> StrategyConfig:
        """The config's ``strategy`` section under this row."""
        return StrategyConfig.model_validate(self._section())

    @property
    def shards(self) -> Sharding:
        return self.strategy.sharding(self.settings)

    @property
    def config_lines(self) -> str:
        """The phalanx.yaml lines that choose this row."""
        tree = {"strategy": self._section()}
        return yaml.safe_dump(tree, sort_keys=False, default_flow_style=False).rstrip("\n")

    def _section(self) -> dict:
        own = {options_key_of(self.strategy): self.row.options} if self.row.options else {}
        return {"name": self.strategy.name, **own}


def variants() -> dict[str, Variant]:
    """The plan's rows by label, from the registered strategies' ``plan_rows``: least traffic
    first, then in registry order."""
    found = [
        ((row.traffic, i, j), Variant(cls, row))
        for i, cls in enumerate(STRATEGIES.values())
        for j, row in enumerate(cls.plan_rows)
    ]
    return {variant.row.label: variant for _, variant in sorted(found, key=lambda pair: pair[0])}


@dataclass(frozen=True)
class ModelState:
    parameters: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer


def model_state(
    strategy: str,
    n_params: int,
    devices: int,
    *,
    optimizer: str = "adam",
    accounting: str = "phalanx",
    trainable: int | None = None,
    compute_bytes: int = 4,
) -> ModelState:
    """Peak bytes per device of model state under ``strategy`` (a row label of variants()).

    ``trainable``: parameters that get gradients and optimizer state (default: all).
    ``compute_bytes``: bytes per parameter of the copy FSDP gathers for compute (2 under bf16).
    """
    trainable = n_params if trainable is None else trainable
    shards = variants()[strategy].shards
    p, g, o = (devices if sharded else 1 for sharded in (shards.parameters, shards.gradients, shards.optimizer))
    if accounting == "zero-paper":
        return ModelState(parameters=2 * n_params / p, gradients=2 * trainable / g, optimizer=PAPER_K * trainable / o)
    parameters = 4 * n_params / p
    if shards.keeps_gathered:
        # FSDP2 keeps its fp32 shards, and without resharding also the gathered compute copy of
        # every parameter from forward until backward: that copy is the peak.
        parameters = 4 * n_params / devices + compute_bytes * n_params
    optimizer_bytes = OPTIMIZER_BYTES[optimizer] * trainable / o
    return ModelState(parameters=parameters, gradients=4 * trainable / g, optimizer=optimizer_bytes)


# Bytes per parameter while setup() puts the model in place: the fp32 weights as the model builds
# them, under every precision (autocast and FSDP's policy cast later) and either accounting.
SETUP_BYTES = 4


@dataclass(frozen=True)
class SetUp:
    """Peak bytes per device while ``session.setup()`` puts the model in place (and
    ``session.load_weights()`` loads pretrained weights into it), under each construction:
    ``whole`` (the script builds the model whole in every process) or ``deferred`` (built under
    ``session.init_module()``, materialised only where the rank holds it)."""

    whole: float
    deferred: float


def setup_peak(
    strategy: str,
    n_params: int,
    devices: int,
    *,
    largest_unit: float | None = None,
    largest_parameter: float | None = None,
) -> SetUp:
    """Set-up peak per device under ``strategy`` (a row label of variants()).

    ``largest_unit``: parameters of FSDP's largest shard unit, its own (not those of a unit
    inside it), the model's remainder counting as a unit; ``largest_parameter``: the largest
    single parameter. Unknown (None): at most ``n_params / devices`` each, one shard's worth.
    """
    bound = n_params / devices
    unit = bound if largest_unit is None else largest_unit
    tensor = bound if largest_parameter is None else largest_parameter
    full = float(SETUP_BYTES * n_params)
    variant = variants()[strategy]
    if variant.strategy.splits_layers:
        # Only this rank's stage goes onto the device in either construction; whole construction
        # keeps the rest in host memory.
        return SetUp(whole=full / devices, deferred=full / devices)
    shards = variant.shards
    if shards.parameters or shards.keeps_gathered:
        shard = full / devices
        # load_weights() broadcasts one whole tensor at a time, of which each rank keeps its shard.
        load = shard + SETUP_BYTES * tensor
        # Whole: the model goes onto the device whole, and fully_shard copies this rank's shards
        # out of it; the whole is freed only when setup() is done. Deferred: one unit at a time
        # is materialised whole, initialised and sharded.
        return SetUp(whole=max(full + shard, load), deferred=max(shard + SETUP_BYTES * unit, load))
    # The whole model on every device, built there directly (deferred) or copied there (whole).
    return SetUp(whole=full, deferred=full)


def shards_by_unit(strategy: str) -> bool:
    """Whether the row stores parameters sharded unit by unit (fsdp), so that its set-up peak
    depends on the largest shard unit."""
    variant = variants()[strategy]
    return not variant.strategy.splits_layers and (variant.shards.parameters or variant.shards.keeps_gathered)


def host_bytes_whole(n_params: int, processes: int) -> float:
    """Host memory of whole construction on one node: every process builds the fp32 model."""
    return float(processes * SETUP_BYTES * n_params)
