"""``phalanx`` command line: parses arguments and calls into the layers below; no logic of its own."""

from __future__ import annotations

import argparse
import sys

from phalanx.cli import bench_cmd, checkpoint_cmd, config_cmd, diagnose_cmd, launch_cmd, plan_cmd, tune_cmd
from phalanx.errors import PhalanxError
from phalanx.version import __version__


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, like every other user error
        self.exit(2, f"phalanx: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="phalanx", description="Run a PyTorch training loop on every GPU of the machine.")
    parser.add_argument("--version", action="version", version=f"phalanx {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    launch_cmd.register(commands)
    config_cmd.register(commands)
    plan_cmd.register(commands)
    diagnose_cmd.register(commands)
    bench_cmd.register(commands)
    tune_cmd.register(commands)
    checkpoint_cmd.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
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
