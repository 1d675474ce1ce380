"""Per-device memory of each strategy, before launching: ``phalanx plan``."""

from phalanx.plan.accounting import ModelState, SetUp, model_state, setup_peak
from phalanx.plan.measure import (
    Activations,
    ShardUnits,
    count_parameters,
    count_shard_units,
    load_factory,
    measure_activations,
)
from phalanx.plan.report import Plan, Row, make_plan

__all__ = [
    "Activations",
    "ModelState",
    "Plan",
    "Row",
    "SetUp",
    "ShardUnits",
    "count_parameters",
    "count_shard_units",
    "load_factory",
    "make_plan",
    "measure_activations",
    "model_state",
    "setup_peak",
]
