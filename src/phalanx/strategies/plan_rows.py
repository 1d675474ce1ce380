"""What a strategy shows in ``phalanx plan``: its rows, declared on the strategy class
(``Strategy.plan_rows``), which the planner reads from the registry."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# The traffic of a row that moves no parameter-sized volume, but pays otherwise (pipeline: its
# stages idle in the bubble): the plan lists it after every row that moves parameters.
LAST = math.inf


@dataclass(frozen=True)
class PlanRow:
    """One row of the plan: the strategy under the settings that change what it holds."""

    label: str  # the row's name in the plan, e.g. "fsdp-zero2"
    # Parameter-sized volumes a training step moves between processes, as the implementation moves
    # them: the plan lists rows least first and recommends the first that fits.
    traffic: float
    # Settings of the strategy's own options section that give the row (its config lines show them).
    options: dict[str, Any] = field(default_factory=dict)
