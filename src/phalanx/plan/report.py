"""The plan: one row per strategy, whether it fits, and the recommendation."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from phalanx.plan.accounting import model_state, setup_peak, variants
from phalanx.plan.measure import Activations, ShardUnits
from phalanx.strategies import Strategy

# The rows, their order (least communication first) and their config lines are the strategies'
# own (Strategy.plan_rows); accounting.variants() reads them from the registry.
# What deferred construction changes in the training script.
DEFERRED_LINES = (
    "with session.init_module():\n"
    "    model = build()\n"
    'session.load_weights("weights.safetensors")  # after setup(), to start from pretrained weights'
)


@dataclass(frozen=True)
class Row:
    strategy: str
    checkpointing: bool
    parameters: float
    gradients: float
    optimizer: float
    activations: float | None
    total: float  # the training peak
    setup: float  # the set-up peak under ``construction``
    construction: str  # "whole" or "deferred"
    setup_whole: float
    setup_deferred: float
    fits: bool | None  # whether the larger of set-up and training fits

    @property
    def setting(self) -> str:
        """The strategy and checkpointing, without the construction."""
        return self.strategy + (" + checkpointing" if self.checkpointing else "")

    @property
    def label(self) -> str:
        return self.setting + (" (deferred)" if self.construction == "deferred" else "")


@dataclass(frozen=True)
class Plan:
    rows: list[Row]
    recommendation: Row | None
    config_lines: str | None
    n_params: int
    devices: int
    device_memory: float | None
    script_lines: str | None = None  # the recommendation's deferred construction, in the script
    largest_unit: float = 0.0  # parameters of the FSDP unit the set-up assumes (counted, or the bound)
    largest_parameter: float = 0.0
    fsdp_units: ShardUnits | None = None  # counted in the model; None: bounded by n_params / devices

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
    units: ShardUnits | None = None,
) -> Plan:
    """``headroom``: the fraction of device memory a plan may use (allocator, CUDA context, buffers).
    Rows a strategy would refuse are left out (see left_out): fsdp under fp16, pipeline under
    bf16/fp16 or for a model that is not an nn.Sequential (``sequential``). ``units``: the model's
    FSDP shard units; without them no unit (and no tensor) is assumed above n_params / devices.

    Each row assumes whole construction where that fits, else deferred construction where it
    lowers the peak (the larger of set-up and training)."""
    refused = {cls for cls, _ in left_out(precision, sequential)}
    rows_of = variants()
    strategies = [label for label, variant in rows_of.items() if variant.strategy not in refused]
    compute_bytes = 2 if precision in ("bf16", "fp16") else 4
    limit = None if device_memory is None else headroom * device_memory
    largest_unit = n_params / devices if units is None else float(units.largest)
    largest_parameter = n_params / devices if units is None else float(units.largest_parameter)
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
            cls = rows_of[strategy].strategy
            # A strategy that casts parameters itself holds no autocast copies of the weights.
            act = acts.at(micro_batch, autocast=not cls.handles_precision) if acts is not None else None
            if act is not None and cls.splits_layers:
                # A stage stores its own layers' activations: about 1/N of the model's. Under 1F1B
                # the first stage holds at most N pipeline micro-batches at once, but they are cut
                # from the same micro-batch, so at most all of it: 1/N of the activations.
                act = act / devices
            total = state.total + (act or 0.0)
            setup = setup_peak(
                strategy, n_params, devices, largest_unit=largest_unit, largest_parameter=largest_parameter
            )
            whole, deferred = max(total, setup.whole), max(total, setup.deferred)
            # Whole construction needs no change to the script: deferred only where it is needed and helps.
            construction = "deferred" if (limit is None or whole > limit) and deferred < whole else "whole"
            peak = deferred if construction == "deferred" else whole
            fits = None if limit is None else peak <= limit
            used = setup.deferred if construction == "deferred" else setup.whole
            rows.append(
                Row(
                    strategy,
                    ckpt,
                    state.parameters,
                    state.gradients,
                    state.optimizer,
                    act,
                    total,
                    used,
                    construction,
                    setup.whole,
                    setup.deferred,
                    fits,
                )
            )
    choice = next((r for r in rows if r.fits), None)
    lines = script = None
    if choice is not None:
        lines = rows_of[choice.strategy].config_lines
        if choice.checkpointing:
            lines += f"\n  activation_checkpointing: [{', '.join(checkpoint_classes)}]"
        if choice.construction == "deferred":
            script = DEFERRED_LINES
    return Plan(rows, choice, lines, n_params, devices, device_memory, script, largest_unit, largest_parameter, units)


def left_out(precision: str, sequential: bool = True) -> list[tuple[type[Strategy], str]]:
    """The strategies of the plan's rows that refuse this precision or model, once each in row
    order, with why (what `phalanx plan` prints)."""
    out: list[tuple[type[Strategy], str]] = []
    for variant in variants().values():
        cls = variant.strategy
        if any(cls is seen for seen, _ in out):
            continue
        if precision not in cls.precisions:
            others = " or ".join(sorted(cls.precisions - {"fp32"}))
            why = f"it does not support {precision} (use {others})" if others else "it supports fp32 only for now"
            out.append((cls, why))
        elif cls.needs_sequential and not sequential:
            out.append((cls, "the model is not an nn.Sequential"))
    return out
