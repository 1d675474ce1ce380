"""The plan: one row per strategy, whether it fits, and the recommendation."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from phalanx.plan.accounting import model_state, setup_peak, variant_of, variants
from phalanx.plan.measure import Activations, ShardUnits
from phalanx.plan.tensor_split import TensorSplit
from phalanx.plan.traffic import step_traffic
from phalanx.strategies import Strategy

# The rows and their config lines are the strategies' own (Strategy.plan_rows); accounting.variants()
# reads them from the registry, with the tensor-parallel degrees the model allows.
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
    traffic: float = 0.0  # bytes a device sends per training step (plan/traffic.py): the order of the rows
    tp: int = 1  # tensor-parallel peers

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
    tensor: TensorSplit | None = None  # what tensor parallelism splits in the model; None: no tp rows

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
    tensor: TensorSplit | None = None,
) -> Plan:
    """``headroom``: the fraction of device memory a plan may use (allocator, CUDA context, buffers).
    Rows a strategy would refuse are left out (see left_out): fsdp under fp16, pipeline under
    bf16/fp16 or for a model that is not an nn.Sequential (``sequential``). ``units``: the model's
    FSDP shard units; without them no unit (and no tensor) is assumed above n_params / devices.
    ``tensor``: what tensor parallelism splits in the model; with it, rows for its degrees.

    Each row assumes whole construction where that fits, else deferred construction where it
    lowers the peak (the larger of set-up and training)."""
    refused = {cls for cls, _ in left_out(precision, sequential)}
    split = tensor.parameters if tensor is not None else 0
    candidates = [v for v in variants(tensor.degrees if tensor else ()).values() if v.strategy not in refused]
    compute_bytes = 2 if precision in ("bf16", "fp16") else 4
    limit = None if device_memory is None else headroom * device_memory
    largest_unit = n_params / devices if units is None else float(units.largest)
    largest_parameter = n_params / devices if units is None else float(units.largest_parameter)
    rows = []
    # Every strategy without checkpointing first: recomputing the forward costs about a third
    # more compute, more than any of the sharding stages costs in communication (tp aside: below).
    for ckpt, acts in ((False, activations), (True, checkpointed)):
        if ckpt and acts is None:
            continue
        kind = []
        for variant in candidates:
            cls, layout = variant.strategy, variant.layout(devices)
            if variant.tp > 1 and not cls.tp_by_default and layout.dp_size == 1:
                continue  # fsdp over one rank: the tp row of the whole node says it
            strategy = variant.label
            state = model_state(
                strategy,
                n_params,
                devices,
                optimizer=optimizer,
                accounting=accounting,
                trainable=trainable,
                compute_bytes=compute_bytes,
                split=split,
            )
            # A strategy that casts parameters itself holds no autocast copies of the weights.
            act = acts.at(micro_batch, autocast=not cls.handles_precision, tp=layout.tp) if acts is not None else None
            if act is not None and cls.splits_layers:
                # A stage stores its own layers' activations: about 1/N of the model's. Under 1F1B
                # the first stage holds at most N pipeline micro-batches at once, but they are cut
                # from the same micro-batch, so at most all of it: 1/N of the activations.
                act = act / devices
            total = state.total + (act or 0.0)
            setup = setup_peak(
                strategy, n_params, devices, largest_unit=largest_unit, largest_parameter=largest_parameter, split=split
            )
            whole, deferred = max(total, setup.whole), max(total, setup.deferred)
            # Whole construction needs no change to the script: deferred only where it is needed and helps.
            construction = "deferred" if (limit is None or whole > limit) and deferred < whole else "whole"
            peak = deferred if construction == "deferred" else whole
            fits = None if limit is None else peak <= limit
            used = setup.deferred if construction == "deferred" else setup.whole
            split_acts = acts.split if acts is not None else None
            traffic = step_traffic(variant.row.traffic, layout, n_params, split, split_acts, micro_batch, ckpt)
            kind.append(
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
                    traffic,
                    layout.tp,
                )
            )
        # Least traffic first; a stable sort: rows of equal traffic keep the strategies' order.
        rows += sorted(kind, key=lambda row: row.traffic)
    # Rows with tensor parallelism after every other, checkpointing ones too: a tensor peer computes
    # again the layers the plan leaves whole (attention, under the automatic plan), and its
    # all-reduces hold up every split layer, forward and backward, where DDP's and FSDP's
    # collectives overlap the computation. Within a node, fsdp with checkpointing fits for less
    # (as torchtitan trains there), so a tp row (2-D: fsdp x tp) is recommended only where no row
    # without it fits. Among them the smallest degree first (the least repeated compute), then
    # without checkpointing, then the least traffic.
    rows = [r for r in rows if r.tp == 1] + sorted(
        (r for r in rows if r.tp > 1), key=lambda row: (row.tp, row.checkpointing, row.traffic)
    )
    choice = next((r for r in rows if r.fits), None)
    lines = script = None
    if choice is not None:
        lines = variant_of(choice.strategy).config_lines
        if choice.checkpointing:
            lines += f"\n  activation_checkpointing: [{', '.join(checkpoint_classes)}]"
        if choice.construction == "deferred":
            script = DEFERRED_LINES
    return Plan(
        rows, choice, lines, n_params, devices, device_memory, script, largest_unit, largest_parameter, units, tensor
    )


def left_out(precision: str, sequential: bool = True) -> list[tuple[type[Strategy], str]]:
    """The strategies of the plan's rows that refuse this precision or model, once each in row
    order, with why (what `phalanx plan` prints)."""
    out: list[tuple[type[Strategy], str]] = []
    for variant in variants(tp_degrees=(2,)).values():  # a degree, so that strategy tp's rows are asked too
        cls = variant.strategy
        if any(cls is seen for seen, _ in out):
            continue
        if precision not in cls.precisions:
            others = " or ".join(sorted(cls.precisions - {"fp32", "fp64"}))  # fp64 is verify's, not training's
            why = f"it does not support {precision} (use {others})" if others else "it supports fp32 only for now"
            out.append((cls, why))
        elif cls.needs_sequential and not sequential:
            out.append((cls, "the model is not an nn.Sequential"))
    return out
