"""``phalanx plan``: per-device memory of each strategy, and which one to use."""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter

import torch
import yaml
from rich.console import Console
from rich.table import Table
from torch import nn

from phalanx.cli import options
from phalanx.cli.console import console as make_console
from phalanx.errors import PhalanxError
from phalanx.plan import count_parameters, load_factory, make_plan, measure_activations
from phalanx.plan.accounting import host_bytes_whole, shards_by_unit, variant_of
from phalanx.plan.measure import build, count_shard_units
from phalanx.plan.report import left_out
from phalanx.plan.tensor_split import find_split
from phalanx.strategies.fsdp import FSDPConfig

EXAMPLES = {  # name: (factory path, per-sample input shape, input dtype)
    "digits": ("phalanx.demo.digits:DigitsCNN", "1,8,8", "float"),
    "gpt": ("phalanx.demo.gpt:TinyGPT", "64", "long"),
}
_DTYPES = {"float": torch.float32, "long": torch.long}
_GIB = 1024**3


def register(commands) -> None:
    p = commands.add_parser(
        "plan",
        help="per-device memory of each strategy before you launch",
        description=(
            "Per-device memory of parameters, gradients, optimizer state and activations under each strategy, "
            "whether it fits, and which to use."
        ),
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", metavar="PKG.MODULE:FACTORY", help="a callable that builds your model")
    what.add_argument(
        "--example", choices=sorted(EXAMPLES), help="a built-in model: digits (CNN) or gpt (small transformer)"
    )
    what.add_argument(
        "--params", type=float, metavar="N", help="no model, a parameter count (e.g. 7.5e9): model state only"
    )
    p.add_argument(
        "--model-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument for the factory (repeatable)",
    )
    p.add_argument(
        "--input-shape", metavar="DIMS", help="one sample's input shape without the batch, e.g. 3,224,224 or 128"
    )
    p.add_argument(
        "--inputs",
        metavar="PKG.MODULE:FUNCTION",
        help=(
            "instead of --input-shape: a function of the micro-batch size B returning one micro-batch's inputs "
            "in the model's own layout: a tensor, a tuple of positional arguments or a dict of keyword arguments"
        ),
    )
    p.add_argument("--input-dtype", choices=sorted(_DTYPES), help="float (default) or long (token ids)")
    p.add_argument("--micro-batch", type=int, default=8, metavar="N", help="samples per device per forward (default 8)")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32", help="default fp32")
    p.add_argument(
        "--optimizer",
        choices=["sgd", "momentum", "adam"],
        default="adam",
        help="sgd, sgd with momentum, or adam/adamw (default)",
    )
    p.add_argument("--devices", type=int, metavar="N", help="devices to shard over (default: visible GPUs, else 2)")
    p.add_argument(
        "--device-memory", type=float, metavar="GIB", help="memory per device in GiB (default: GPU 0's, when visible)"
    )
    p.add_argument(
        "--checkpoint",
        action="append",
        default=[],
        metavar="CLASS",
        help="module class for activation checkpointing (default: the most repeated block)",
    )
    p.add_argument(
        "--fsdp-wrap",
        action="append",
        default=[],
        metavar="CLASS",
        help="as strategy.fsdp.wrap: a module class that becomes an FSDP shard unit (repeatable; default automatic)",
    )
    p.add_argument(
        "--fsdp-min-params",
        type=int,
        metavar="N",
        help="as strategy.fsdp.min_params: automatic FSDP units' least parameters (default 100000)",
    )
    p.add_argument(
        "--accounting",
        choices=["phalanx", "zero-paper"],
        default="phalanx",
        help="phalanx: what phalanx keeps (fp32 state); zero-paper: 2+2+12 bytes per parameter",
    )
    options.add_json(p)
    p.set_defaults(run=_run)


# Each numeric flag: (attribute, what it must be, the smallest value, the largest). Beyond the
# largest nothing is planned that exists, and the arithmetic would leave floats (1e400 is inf).
_NUMBERS = {
    "--params": ("params", "a positive count, at most 1e15", 1, 1e15),
    "--micro-batch": ("micro_batch", "at least 1 (and at most 2147483647)", 1, 2**31 - 1),
    "--devices": ("devices", "at least 1 (and at most 1048576)", 1, 2**20),
    "--device-memory": ("device_memory", "a positive number of GiB, at most 1048576", math.ulp(0), 2**20),
    "--fsdp-min-params": ("fsdp_min_params", "at least 1 (and at most 1e15)", 1, 1e15),
}


def _check_numbers(args: argparse.Namespace) -> None:
    for flag, (attribute, rule, least, most) in _NUMBERS.items():
        value = getattr(args, attribute)
        if value is not None and not least <= value <= most:  # nan compares false: refused too
            shown = f"{value:g}" if isinstance(value, float) else value
            raise PhalanxError(f"{flag} must be {rule}, got {shown}")


def _run(args: argparse.Namespace) -> int:
    _check_numbers(args)
    devices = args.devices or (torch.cuda.device_count() or 2)
    memory = args.device_memory * _GIB if args.device_memory is not None else _gpu_memory()
    activations = checkpointed = trainable = None
    sequential = True  # unknown with --params: the pipeline row stays, with its note
    classes: list[str] = []
    measured_on = units = tensor = None
    if args.params is not None:
        if args.inputs:
            raise PhalanxError("--inputs needs --model or --example: with --params there is no model to run")
        if args.fsdp_wrap or args.fsdp_min_params is not None:
            given = "--fsdp-wrap" if args.fsdp_wrap else "--fsdp-min-params"
            raise PhalanxError(f"{given} needs --model or --example: with --params there is no model to find units in")
        n_params = int(args.params)
    else:
        path, shape, dtype = EXAMPLES[args.example] if args.example else (args.model, None, "float")
        if args.inputs and (args.input_shape or args.input_dtype):
            given = "--input-shape" if args.input_shape else "--input-dtype"
            raise PhalanxError(f"give --inputs or {given}, not both: the inputs function makes the whole micro-batch")
        inputs = load_factory(args.inputs, "--inputs", "function", "mypkg.data:example_batch") if args.inputs else None
        shape = None if inputs else args.input_shape or shape
        if shape is None and inputs is None:
            raise PhalanxError(
                "--input-shape is needed with --model: one sample's shape without the batch, e.g. 3,224,224 "
                "(or --inputs MODULE:FUNCTION, a function returning one micro-batch's inputs)"
            )
        dims = _parse_shape(shape) if shape else None
        factory = load_factory(path)
        kwargs = dict(_parse_kv(kv) for kv in args.model_arg)
        model = build(factory, kwargs, "meta")
        n_params = count_parameters(model)
        trainable = count_parameters(model, trainable_only=True)
        sequential = isinstance(model, nn.Sequential)
        fsdp = FSDPConfig(wrap=args.fsdp_wrap, min_params=args.fsdp_min_params or FSDPConfig().min_params)
        units = count_shard_units(model, fsdp, "--fsdp-wrap")
        tensor = find_split(model, devices)
        classes = args.checkpoint or _repeated_block(model)
        input_dtype = _DTYPES[args.input_dtype or dtype]
        given = {"inputs": inputs, "inputs_name": args.inputs or "", "tensor": tensor if tensor.degrees else None}
        activations = measure_activations(factory, kwargs, dims, input_dtype, args.precision, **given)
        if classes:
            checkpointed = measure_activations(factory, kwargs, dims, input_dtype, args.precision, classes, **given)
        measured_on = activations.measured_on
    plan = make_plan(
        n_params,
        devices,
        optimizer=args.optimizer,
        accounting=args.accounting,
        micro_batch=args.micro_batch,
        activations=activations,
        checkpointed=checkpointed,
        checkpoint_classes=classes,
        device_memory=memory,
        trainable=trainable,
        precision=args.precision,
        sequential=sequential,
        units=units,
        tensor=tensor,
    )
    if args.json:
        print(
            json.dumps(
                plan.to_dict() | {"activations_measured_on": measured_on, "checkpoint_classes": classes}, indent=2
            )
        )
        return 0
    _print(plan, args, measured_on, classes, sequential)
    return 0


def _print(plan, args, measured_on, classes, sequential: bool) -> None:
    state = (
        "mixed-precision Adam, 2+2+12 bytes per parameter (ZeRO paper)"
        if args.accounting == "zero-paper"
        else f"{args.precision}, {args.optimizer}"
    )
    title = f"{plan.n_params:,} parameters, {plan.devices} devices, micro-batch {args.micro_batch}, {state}"
    table = Table(title=title)
    columns = ("strategy", "parameters", "gradients", "optimizer", "activations", "set-up", "training", "fits")
    for col in columns:
        table.add_column(col, justify="left" if col == "strategy" else "right")
    largest = max(max(r.total, r.setup) for r in plan.rows)
    unit, scale = ("GiB", _GIB) if largest >= _GIB else ("MiB", 1024**2)
    fmt = lambda value: f"{value / scale:,.2f} {unit}"  # noqa: E731 - one unit for the whole table
    for row in plan.rows:
        fits = "-" if row.fits is None else ("yes" if row.fits else "no")
        acts = fmt(row.activations) if row.activations is not None else "-"
        cells = (row.parameters, row.gradients, row.optimizer)
        table.add_row(row.label, *map(fmt, cells), acts, fmt(row.setup), fmt(row.total), fits)
    # Pipes and logs get the whole table (a big model's "+ checkpointing (deferred)" rows pass 120
    # columns); a terminal keeps its own width.
    console = make_console(max(120, Console(width=1000).measure(table).maximum))
    console.print(table)
    console.print("set-up: the peak while session.setup() places the model; a row fits when set-up and training do")
    if any(r.construction == "deferred" for r in plan.rows):
        console.print(
            "(deferred): built under session.init_module(), each rank materialising only its part; other rows: whole"
        )
    else:
        console.print(
            "construction: whole in every row (the script builds the model in each process: nothing to change)"
        )
    refused = left_out(args.precision, sequential)
    for cls, why in refused:
        console.print(f"{cls.name} is left out: {why}")
    _print_tensor(console, plan, refused)
    for cls in dict.fromkeys(variant_of(r.strategy).strategy for r in plan.rows):
        if cls.splits_layers:
            needs = "needs an nn.Sequential model; " if cls.needs_sequential else ""
            console.print(f"{cls.name}: {needs}stages assumed balanced (parameters and activations / devices)")
    sharded = [r for r in plan.rows if shards_by_unit(r.strategy)]
    if sharded:
        name = variant_of(sharded[0].strategy).strategy.name
        if plan.fsdp_units is None:
            console.print(
                f"{name} set-up assumes no FSDP unit above 1/{plan.devices} of the parameters; "
                "give --model to count the real units"
            )
        else:
            units = plan.fsdp_units
            where = f"{units.largest_name or 'the model itself'} ({units.largest_class})"
            console.print(
                f"{name} set-up: largest unit {where}, {units.largest:,} parameters, of {units.count} ({units.rule})"
            )
    console.print(
        f"host memory: whole construction, {plan.devices} processes x {fmt(host_bytes_whole(plan.n_params, 1))} "
        f"of fp32 weights = {fmt(host_bytes_whole(plan.n_params, plan.devices))}; deferred, only buffers"
    )
    if measured_on:
        console.print(
            f"activations: measured on {'the meta device (nothing allocated)' if measured_on == 'meta' else 'the CPU'} "
            "and scaled to the micro-batch"
        )
        if classes:
            console.print(f"checkpointing rows recompute: {', '.join(classes)}")
    if plan.device_memory is None:
        console.print(
            "device memory unknown (no GPU visible): pass --device-memory GIB to see what fits and get a recommendation"
        )
    elif plan.recommendation is None:
        console.print(
            f"nothing fits in {plan.device_memory / _GIB:.2f} GiB per device: "
            "lower --micro-batch, use more devices, or bf16"
        )
    else:
        choice = plan.recommendation
        console.print(
            f"recommended: {choice.setting} with {choice.construction} construction "
            f"(the least communication that fits in 90% of {plan.device_memory / _GIB:.2f} GiB)"
        )
        if choice.tp > 1:
            # Its model state is above fsdp-zero3's: it fits only by dividing the split layers' activations.
            console.print(
                f"no row above fits without tensor parallelism: {choice.strategy} divides the split layers' activations"
            )
        console.print("phalanx.yaml:\n" + plan.config_lines)
        if plan.script_lines:
            console.print("in the script (deferred construction):\n" + plan.script_lines)


def _print_tensor(console, plan, refused) -> None:
    """What the tp rows split, or why there are none."""
    if any(cls.tp_by_default for cls, _ in refused):
        return  # strategy tp refuses the precision: said above
    tensor = plan.tensor
    if tensor is None:
        console.print("tp is left out: with --params there is no model whose layers it would split")
        return
    for line in tensor.left_out:
        console.print(line)
    if not any(r.tp > 1 for r in plan.rows):
        return
    whole = "; attention whole on every peer" if tensor.kept_whole else ""
    console.print(
        f"tp rows ({tensor.source}): {len(tensor.styles)} layers split, "
        f"{tensor.parameters:,} of {plan.n_params:,} parameters{whole}"
    )
    console.print(
        "tp rows come last: each split pair all-reduces activations, forward and backward; peers repeat the rest"
    )


def _gpu_memory() -> float | None:
    return float(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else None


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.split(",") if d.strip())
    except ValueError:
        dims = ()
    if not dims or any(d < 1 for d in dims):
        raise PhalanxError(f"--input-shape expects positive comma-separated sizes such as 3,224,224; got '{text}'")
    return dims


def _parse_kv(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise PhalanxError(f"--model-arg expects key=value, got '{text}'")
    try:
        return key, yaml.safe_load(value)
    except (yaml.YAMLError, RecursionError):  # as with --set: text that is not YAML is the text itself
        return key, value


def _repeated_block(model) -> list[str]:
    """The module class with parameters that repeats most (transformer blocks, residual stages)."""
    containers = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
    counts = Counter(
        type(m).__name__
        for m in model.modules()
        if m is not model
        and not isinstance(m, containers)
        and len(list(m.children())) > 0
        and any(True for _ in m.parameters())
    )
    repeated = [(n, c) for n, c in counts.items() if c > 1]
    return [max(repeated, key=lambda nc: nc[1])[0]] if repeated else []
