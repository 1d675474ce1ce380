"""The options several commands share, declared once with one help text: the config a command reads
(``--config``, ``--set``) and machine-readable output (``--json``). A command whose use of one
differs says how in a clause of its own after the shared text, never in a text of its own."""

from __future__ import annotations

import argparse

CONFIG_HELP = "YAML or TOML config file (default: ./phalanx.yaml when present)"
SET_HELP = "override one config value, e.g. --set precision.mode=bf16 (repeatable; beats the file)"
JSON_HELP = "print JSON instead of text, for scripts"


def add_config(parser: argparse.ArgumentParser, also: str | None = None) -> None:
    parser.add_argument("--config", metavar="FILE", help=_help(CONFIG_HELP, also))


def add_set(parser: argparse.ArgumentParser, also: str | None = None) -> None:
    """Values land in ``args.overrides``, in the order given."""
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=_help(SET_HELP, also)
    )


def add_json(parser: argparse.ArgumentParser, also: str | None = None) -> None:
    parser.add_argument("--json", action="store_true", help=_help(JSON_HELP, also))


def _help(text: str, also: str | None) -> str:
    return f"{text}; {also}" if also else text
