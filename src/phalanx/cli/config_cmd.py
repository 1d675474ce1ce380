"""``phalanx config init`` and ``phalanx config show``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.prompt import Confirm, IntPrompt, Prompt
from rich.table import Table

from phalanx.cli import options
from phalanx.cli.console import console
from phalanx.config.loader import DEFAULT_FILE, load_config
from phalanx.config.schema import Config
from phalanx.config.template import render, scalar
from phalanx.errors import PhalanxError
from phalanx.strategies import STRATEGIES, check_combination
from phalanx.topology import LaunchContext


def register(commands) -> None:
    config = commands.add_parser(
        "config", help="write or inspect phalanx.yaml", description="Write or inspect the phalanx configuration."
    )
    sub = config.add_subparsers(dest="config_command", metavar="SUBCOMMAND", parser_class=type(config))
    init = sub.add_parser("init", help="write a commented phalanx.yaml (asks a few questions unless --defaults)")
    init.add_argument("--defaults", action="store_true", help="ask nothing, write the defaults")
    init.add_argument(
        "--output", "-o", default=DEFAULT_FILE, metavar="FILE", help=f"where to write (default {DEFAULT_FILE})"
    )
    init.add_argument("--force", action="store_true", help="overwrite an existing file")
    init.set_defaults(run=_run_init)
    show = sub.add_parser("show", help="print the resolved config and where each value came from")
    options.add_config(show)
    options.add_set(show)
    options.add_json(show)
    show.set_defaults(run=_run_show)
    config.set_defaults(run=lambda args: config.print_help() or 2)


def _run_init(args: argparse.Namespace) -> int:
    out = Path(args.output)
    if out.exists() and not args.force:
        raise PhalanxError(f"'{out}' already exists; pass --force to overwrite it or --output to write elsewhere")
    interactive = not args.defaults and sys.stdin.isatty()
    if not args.defaults and not interactive:
        print("phalanx: stdin is not a terminal, writing the defaults (as with --defaults)")
    config = _ask() if interactive else Config()
    try:
        out.write_text(render(config), encoding="utf-8")
    except OSError as err:
        raise PhalanxError(f"cannot write '{out}': {err.strerror}") from None
    print(f"phalanx: wrote {out}; check it with `phalanx config show`")
    return 0


def _ask() -> Config:
    names = ["auto", *STRATEGIES]
    strategy = Prompt.ask("Strategy (auto = ddp with several processes)", choices=names, default="auto")
    precision = Prompt.ask("Precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    global_bs = IntPrompt.ask("Global batch size per optimizer step (0 = your DataLoader's batch_size)", default=0)
    micro_bs = IntPrompt.ask("Micro batch size per device (0 = global / processes)", default=0)
    scaling = Prompt.ask(
        "Scale the learning rate with the global batch", choices=["none", "linear", "sqrt"], default="none"
    )
    warmup = (
        IntPrompt.ask("Warm-up steps", default=0)
        if scaling != "none" or Confirm.ask("Warm up the learning rate?", default=False)
        else 0
    )
    return load_config(
        sections={
            "strategy": {"name": strategy},
            "precision": {"mode": precision},
            "batch": {"global_batch_size": global_bs or None, "micro_batch_size": micro_bs or None},
            "optim": {"lr_scaling": scaling, "warmup_steps": warmup},
        },
        context=LaunchContext(),
        cwd=Path("/nonexistent"),
    )


def _run_show(args: argparse.Namespace) -> int:
    config = load_config(args.config, overrides=args.overrides, context=LaunchContext())
    check_combination(config)  # an unknown strategy, or one refusing these settings, is an error here too
    flat, sources = _settings(config.model_dump()), config.sources
    if args.json:
        print(
            json.dumps(
                {key: {"value": value, "source": sources.get(key, "default")} for key, value in flat.items()}, indent=2
            )
        )
        return 0
    table = Table(title="phalanx config", show_lines=False)
    table.add_column("setting")
    table.add_column("value")
    table.add_column("source")
    for key, value in flat.items():
        source = sources.get(key, "default")
        style = None if source == "default" else "bold"
        table.add_row(key, scalar(value), source, style=style)
    console().print(table)
    return 0


def _settings(tree: dict, prefix: str = "") -> dict[str, object]:
    """Leaf values by dotted path, as ``Config.flat()`` gives them, and an empty mapping as a row of
    its own (``strategy.tp.plan: {}``), which ``flat()`` has no leaf for."""
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_settings(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
