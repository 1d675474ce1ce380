"""Bytes a device sends in one training step under a row of the plan: what orders the rows.

Counted per training step of one micro-batch per device (no accumulation), an all-reduce of X
bytes over g ranks as 2 (g - 1) / g x X (a ring's reduce-scatter and all-gather), an all-gather
or a reduce-scatter as half of that:

- parameters: the row's ``PlanRow.traffic`` (parameter-sized volumes per step, an all-reduce
  counting 2) x (D - 1) / D x 4 bytes x the parameters a tensor peer holds, P - S + S / T, over
  the D ranks of the data axis (P parameters, S of them split by the tensor-parallel plan, T peers);
- activations (T > 1): each split pair all-reduces its output in forward (the rowwise layer's
  partial sums) and its input's gradient in backward (each colwise layer's), so
  2 (T - 1) / T x (F + B) x micro-batch, with F and B those tensors' bytes per sample
  (measured, SplitActivations); activation checkpointing recomputes the forward, and with it the
  forward all-reduces: F counts twice.
"""

from __future__ import annotations

from phalanx.plan.tensor_split import SplitActivations
from phalanx.strategies.parallel_layout import ParallelLayout

PARAMETER_BYTES = 4  # fp32 gradients and parameters, as phalanx keeps them


def step_traffic(
    volumes: float,
    layout: ParallelLayout,
    n_params: int,
    split: int = 0,
    activations: SplitActivations | None = None,
    micro_batch: int = 1,
    checkpointing: bool = False,
) -> float:
    """Bytes one device sends per training step (see the module's docstring); ``volumes``: the
    row's PlanRow.traffic (math.inf: the row moves none, but pays otherwise; it stays inf)."""
    if volumes == float("inf"):
        return volumes
    data = layout.dp_size
    held = n_params - split + split / layout.tp
    parameters = volumes * (data - 1) / data * PARAMETER_BYTES * held
    if layout.tp == 1 or activations is None:
        return parameters
    exchanged = (activations.forward * (2 if checkpointing else 1) + activations.backward) * micro_batch
    return parameters + 2 * (layout.tp - 1) / layout.tp * exchanged
