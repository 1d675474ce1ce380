"""``phalanx`` command line: parses arguments and calls into the layers below; no logic of its own."""

from __future__ import annotations

import argparse
import importlib
import sys

from phalanx.errors import PhalanxError
from phalanx.version import __version__

# The module that registers each command, in the order `phalanx --help` lists them. A command
# named on the command line loads its own module only: `phalanx launch` has no use for the bench,
# tune, doctor and plan machinery, and importing it cost every launch about 0.2 s.
COMMANDS = {
    "launch": "launch_cmd",
    "demo": "launch_cmd",
    "config": "config_cmd",
    "plan": "plan_cmd",
    "env": "diagnose_cmd",
    "doctor": "diagnose_cmd",
    "bench": "bench_cmd",
    "tune": "tune_cmd",
    "checkpoint": "checkpoint_cmd",
    "check": "check_cmd",
    "verify": "verify_cmd",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, like every other user error
        self.exit(2, f"phalanx: error: {message} (see `{self.prog} --help`)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of ``command`` alone (with any other name: every command)."""
    parser = _Parser(prog="phalanx", description="Run a PyTorch training loop on every GPU of the machine.")
    parser.add_argument("--version", action="version", version=f"phalanx {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    modules = [COMMANDS[command]] if command in COMMANDS else list(dict.fromkeys(COMMANDS.values()))
    for name in modules:
        importlib.import_module(f"phalanx.cli.{name}").register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        build_parser().print_help()  # every command, as `phalanx --help` shows them
        return 2
    try:
        return args.run(args) or 0
    except PhalanxError as err:
        print(f"phalanx: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("phalanx: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `phalanx ... | head`: the reader left, nothing more to say
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
