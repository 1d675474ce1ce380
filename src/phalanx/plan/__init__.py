"""Per-device memory of each strategy, before launching: ``phalanx plan``."""

from phalanx.plan.accounting import ModelState, model_state
from phalanx.plan.measure import Activations, count_parameters, load_factory, measure_activations
from phalanx.plan.report import Plan, Row, make_plan

__all__ = [
    "Activations",
    "ModelState",
    "Plan",
    "Row",
    "count_parameters",
    "load_factory",
    "make_plan",
    "measure_activations",
    "model_state",
]
