"""Model-state memory per device for each strategy: parameters, gradients, optimizer state.

Two accountings:
- ``zero-paper``: Rajbhandari et al., 2019 (ZeRO), mixed-precision Adam: 2 bytes of fp16
  parameters, 2 of fp16 gradients and K = 12 of fp32 master weights, momentum and variance per
  parameter, divided among the devices as each stage shards them.
- ``phalanx``: what phalanx really keeps. Autocast (bf16/fp16) leaves parameters, gradients and
  optimizer state in fp32, so 4 + 4 + K bytes with K = 0 (SGD), 4 (SGD with momentum), 8 (Adam).

What a row divides comes from its strategy's ``Sharding`` (the layout axes each kind of state is
divided over) and the row's layout on the devices: the divisor is the product of those axes'
sizes, except that ``tp`` divides only the parameters the tensor-parallel plan splits (``split``);
the rest of the model is whole on every tensor peer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import yaml

from phalanx.config.schema import Config
from phalanx.config.sections import StrategyConfig
from phalanx.strategies import Sharding, Strategy
from phalanx.strategies.parallel_layout import AXES, TENSOR, ParallelLayout
from phalanx.strategies.plan_rows import PlanRow
from phalanx.strategies.registry import STRATEGIES, options_key_of

OPTIMIZER_BYTES = {"sgd": 0, "momentum": 4, "adam": 8}  # fp32 state bytes per parameter
PAPER_K = 12


@dataclass(frozen=True)
class Variant:
    """A row of the plan: a strategy under the settings that change what it holds (its PlanRow),
    with ``tp`` tensor-parallel peers (1: none)."""

    strategy: type[Strategy]
    row: PlanRow
    tp: int = 1

    @property
    def label(self) -> str:
        """``row.label``; with tp, its degree: ``tp2`` for a strategy that is tensor parallel by
        default, ``fsdp-zero3 x tp2`` for one that adds tp to its own axis (the 2-D layout)."""
        if self.tp == 1:
            return self.row.label
        return f"{self.row.label}{self.tp}" if self.strategy.tp_by_default else f"{self.row.label} x tp{self.tp}"

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

    def layout(self, devices: int) -> ParallelLayout:
        """How ``devices`` processes split into the row's axes, as the strategy itself splits them."""
        return self.strategy.layout_for(Config(strategy=self._section()), devices)

    def _section(self) -> dict:
        tp = {"tp": {"size": self.tp}} if self.tp > 1 else {}
        own = {options_key_of(self.strategy): self.row.options} if self.row.options else {}
        return {"name": self.strategy.name, **tp, **own}


def variants(tp_degrees: tuple[int, ...] = ()) -> dict[str, Variant]:
    """The plan's rows by label, from the registered strategies' ``plan_rows``: rows without
    tensor parallelism first, least traffic first, then in registry order. A strategy with a ``tp``
    axis also gets a row per degree in ``tp_degrees`` (one that is tensor parallel by default gets
    only those)."""
    found = []
    for i, cls in enumerate(STRATEGIES.values()):
        degrees = ([] if cls.tp_by_default else [1]) + ([d for d in tp_degrees if d > 1] if TENSOR in cls.axes else [])
        for j, row in enumerate(cls.plan_rows):
            found += [((tp > 1, row.traffic, i, j, tp), Variant(cls, row, tp)) for tp in degrees]
    return {variant.label: variant for _, variant in sorted(found, key=lambda pair: pair[0])}


def variant_of(label: str) -> Variant:
    """The row labelled ``label``: a row of variants(), or one with its tensor-parallel degree
    (``tp2``, ``fsdp-zero3 x tp2``)."""
    digits = re.search(r"(\d+)$", label)
    rows = variants((int(digits[1]),) if digits else ())
    if label not in rows:
        raise KeyError(f"no row of the plan is labelled {label!r}")
    return rows[label]


def per_device(count: float, split: float, axes: tuple[str, ...], layout: ParallelLayout) -> float:
    """The share of ``count`` parameters one device holds when they are divided over ``axes``:
    the ``split`` of them that the tensor-parallel plan divides over all of ``axes``, the rest over
    those other than tp (every tensor peer holds the layers the plan leaves whole)."""
    whole = layout.divisor(a for a in axes if a != TENSOR)
    peers = layout.tp if TENSOR in axes else 1
    return (count - split) / whole + split / (whole * peers)


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
    split: int = 0,
) -> ModelState:
    """Peak bytes per device of model state under ``strategy`` (a row label, see variant_of()).

    ``trainable``: parameters that get gradients and optimizer state (default: all).
    ``compute_bytes``: bytes per parameter of the copy FSDP gathers for compute (2 under bf16).
    ``split``: parameters the tensor-parallel plan divides among the peers (tp rows; taken as trainable).
    """
    trainable = n_params if trainable is None else trainable
    variant = variant_of(strategy)
    layout, shards = variant.layout(devices), variant.shards
    split_trainable = min(split, trainable)
    params = per_device(n_params, split, shards.parameters, layout)
    grads = per_device(trainable, split_trainable, shards.gradients, layout)
    state = per_device(trainable, split_trainable, shards.optimizer, layout)
    if accounting == "zero-paper":
        return ModelState(parameters=2 * params, gradients=2 * grads, optimizer=PAPER_K * state)
    parameters = 4 * params
    if shards.keeps_gathered:
        # FSDP2 keeps its fp32 shards (divided over every axis of the layout), and without
        # resharding also the gathered compute copy of every parameter (whole over the data axis)
        # from forward until backward: that copy is the peak.
        parameters = 4 * per_device(n_params, split, AXES, layout) + compute_bytes * params
    return ModelState(parameters=parameters, gradients=4 * grads, optimizer=OPTIMIZER_BYTES[optimizer] * state)


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
    split: int = 0,
) -> SetUp:
    """Set-up peak per device under ``strategy`` (a row label, see variant_of()).

    ``largest_unit``: parameters of FSDP's largest shard unit, its own (not those of a unit
    inside it), the model's remainder counting as a unit; ``largest_parameter``: the largest
    single parameter. Unknown (None): at most ``n_params / devices`` each, one shard's worth.
    ``split``: parameters the tensor-parallel plan divides (tp rows).
    """
    bound = n_params / devices
    unit = bound if largest_unit is None else largest_unit
    tensor = bound if largest_parameter is None else largest_parameter
    full = float(SETUP_BYTES * n_params)
    variant = variant_of(strategy)
    if variant.strategy.splits_layers:
        # Only this rank's stage goes onto the device in either construction; whole construction
        # keeps the rest in host memory.
        return SetUp(whole=full / devices, deferred=full / devices)
    layout = variant.layout(devices)
    shard = SETUP_BYTES * per_device(n_params, split, AXES, layout) if _shards_parameters(variant) else 0.0
    if variant.tp > 1:
        # Tensor parallelism cuts real weights: the model is materialised whole on the device in
        # either construction, and the whole stays (the script's optimizer holds it) until setup()
        # is done, next to this peer's slices of the split layers and, under fsdp, its shards.
        peak = full + SETUP_BYTES * split / variant.tp + shard
        return SetUp(whole=peak, deferred=peak)
    if shard:
        # load_weights() broadcasts one whole tensor at a time, of which each rank keeps its shard.
        load = shard + SETUP_BYTES * tensor
        # Whole: the model goes onto the device whole, and fully_shard copies this rank's shards
        # out of it; the whole is freed only when setup() is done. Deferred: one unit at a time
        # is materialised whole, initialised and sharded.
        return SetUp(whole=max(full + shard, load), deferred=max(shard + SETUP_BYTES * unit, load))
    # The whole model on every device, built there directly (deferred) or copied there (whole).
    return SetUp(whole=full, deferred=full)


def _shards_parameters(variant: Variant) -> bool:
    """Whether the row stores parameters sharded over a data axis (fsdp: its shards)."""
    shards = variant.shards
    return not variant.strategy.splits_layers and (bool(set(shards.parameters) - {TENSOR}) or shards.keeps_gathered)


def shards_by_unit(strategy: str) -> bool:
    """Whether the row stores parameters sharded unit by unit (fsdp alone), so that its set-up
    peak depends on the largest shard unit (in the 2-D layout the model is materialised whole)."""
    variant = variant_of(strategy)
    return variant.tp == 1 and _shards_parameters(variant)


def host_bytes_whole(n_params: int, processes: int) -> float:
    """Host memory of whole construction on one node: every process builds the fp32 model."""
    return float(processes * SETUP_BYTES * n_params)
