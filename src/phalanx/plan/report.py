"""The plan: one row per strategy, whether it fits, and the recommendation."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from phalanx.plan.accounting import VARIANTS, model_state
from phalanx.plan.measure import Activations
from phalanx.strategies import Strategy

# Least communication first, in parameter-sized volumes per step as these implementations move
# them: ddp all-reduces (2); fsdp-zero2 reduce-scatters and all-gathers once (2); zero1 is DDP's
# all-reduce plus ZeroRedundancyOptimizer's broadcast of updated parameters (3); fsdp-zero3
# all-gathers again for backward (3).
# pipeline comes last: it sends only activations between stages, but its stages idle in the
# pipeline bubble, (N-1)/(M+N-1) of each step with M pipeline micro-batches.
ORDER = ["ddp", "fsdp-zero2", "zero1", "fsdp-zero3", "pipeline"]
CONFIG_LINES = {
    "ddp": "strategy:\n  name: ddp",
    "zero1": "strategy:\n  name: zero1",
    "fsdp-zero2": "strategy:\n  name: fsdp\n  fsdp:\n    reshard_after_forward: false",
    "fsdp-zero3": "strategy:\n  name: fsdp\n  fsdp:\n    reshard_after_forward: true",
    "pipeline": "strategy:\n  name: pipeline\n  pipeline:\n    schedule: 1f1b",
}


@dataclass(frozen=True)
class Row:
    strategy: str
    checkpointing: bool
    parameters: float
    gradients: float
    optimizer: float
    activations: float | None
    total: float
    fits: bool | None

    @property
    def label(self) -> str:
        return self.strategy + (" + checkpointing" if self.checkpointing else "")


@dataclass(frozen=True)
class Plan:
    rows: list[Row]
    recommendation: Row | None
    config_lines: str | None
    n_params: int
    devices: int
    device_memory: float | None

    def to_dict(self) -> dict:
        out = asdict(self)
        out["rows"] = [asdict(r) | {"label": r.label} for r in self.rows]
        out["recommendation"] = self.recommendation.label if self.recommendation else None
        return out


def make_plan(
    n_params: int,
    devices: int,
    *,
    optimizer: str,
    accounting: str,
    micro_batch: int,
    activations: Activations | None,
    checkpointed: Activations | None,
    checkpoint_classes: list[str],
    device_memory: float | None,
    headroom: float = 0.9,
    trainable: int | None = None,
    precision: str = "fp32",
    sequential: bool = True,
) -> Plan:
    """``headroom``: the fraction of device memory a plan may use (allocator, CUDA context, buffers).
    Rows a strategy would refuse are left out (see left_out): fsdp under fp16, pipeline under
    bf16/fp16 or for a model that is not an nn.Sequential (``sequential``)."""
    refused = {cls for cls, _ in left_out(precision, sequential)}
    strategies = [s for s in ORDER if VARIANTS[s].strategy not in refused]
    compute_bytes = 2 if precision in ("bf16", "fp16") else 4
    rows = []
    # Every strategy without checkpointing first: recomputing the forward costs about a third
    # more compute, more than any of the sharding stages costs in communication.
    for ckpt, acts in ((False, activations), (True, checkpointed)):
        if ckpt and acts is None:
            continue
        for strategy in strategies:
            state = model_state(
                strategy,
                n_params,
                devices,
                optimizer=optimizer,
                accounting=accounting,
                trainable=trainable,
                compute_bytes=compute_bytes,
            )
            cls = VARIANTS[strategy].strategy
            # A strategy that casts parameters itself holds no autocast copies of the weights.
            act = acts.at(micro_batch, autocast=not cls.handles_precision) if acts is not None else None
            if act is not None and cls.splits_layers:
                # A stage stores its own layers' activations: about 1/N of the model's. Under 1F1B
                # the first stage holds at most N pipeline micro-batches at once, but they are cut
                # from the same micro-batch, so at most all of it: 1/N of the activations.
                act = act / devices
            total = state.total + (act or 0.0)
            fits = None if device_memory is None else total <= headroom * device_memory
            rows.append(Row(strategy, ckpt, state.parameters, state.gradients, state.optimizer, act, total, fits))
    choice = next((r for r in rows if r.fits), None)
    lines = None
    if choice is not None:
        lines = CONFIG_LINES[choice.strategy]
        if choice.checkpointing:
            lines += f"\n  activation_checkpointing: [{', '.join(checkpoint_classes)}]"
    return Plan(rows, choice, lines, n_params, devices, device_memory)


def left_out(precision: str, sequential: bool = True) -> list[tuple[type[Strategy], str]]:
    """The strategies of the plan's rows that refuse this precision or model, once each in row
    order, with why (what `phalanx plan` prints)."""
    out: list[tuple[type[Strategy], str]] = []
    for name in ORDER:
        cls = VARIANTS[name].strategy
        if any(cls is seen for seen, _ in out):
            continue
        if precision not in cls.precisions:
            others = " or ".join(sorted(cls.precisions - {"fp32"}))
            why = f"it does not support {precision} (use {others})" if others else "it supports fp32 only for now"
            out.append((cls, why))
        elif cls.needs_sequential and not sequential:
            out.append((cls, "the model is not an nn.Sequential"))
    return out
