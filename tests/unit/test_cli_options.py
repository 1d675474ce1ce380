"""--config, --set and --json are declared once (cli/options.py), and every command that takes one
shows its one help text: a command may add a clause of its own after it, never reword it."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from phalanx.cli import options
from phalanx.cli.main import build_parser

CLI = Path(options.__file__).parent
SHARED = {"--config": options.CONFIG_HELP, "--set": options.SET_HELP, "--json": options.JSON_HELP}


def _declared(path: Path) -> set[str]:
    """The shared flags a module passes to add_argument itself."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            found |= {arg.value for arg in node.args if isinstance(arg, ast.Constant) and arg.value in SHARED}
    return found


@pytest.mark.parametrize("path", sorted(p for p in CLI.glob("*.py") if p.name != "options.py"), ids=lambda p: p.name)
def test_no_command_declares_a_shared_option_of_its_own(path):
    assert _declared(path) == set()


def test_the_declaring_module_is_seen_by_the_walk():
    assert _declared(CLI / "options.py") == set(SHARED)  # the test above can fail


def _commands(parser: argparse.ArgumentParser, name: str = "phalanx"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                yield from _commands(subparser, f"{name} {sub}")


def test_every_command_shows_the_one_help_text():
    seen = {flag: [] for flag in SHARED}
    for name, parser in _commands(build_parser()):
        for flag, text in SHARED.items():
            action = parser._option_string_actions.get(flag)
            if action is not None:
                assert action.help == text or action.help.startswith(text + "; "), (name, flag, action.help)
                seen[flag].append(name)
    assert len(seen["--config"]) >= 5 and len(seen["--set"]) >= 5 and len(seen["--json"]) >= 5, seen
