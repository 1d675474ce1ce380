"""The arguments ``phalanx bench`` and ``phalanx tune`` share: both run short ``phalanx launch``
trials of one script (harness/launching.py), so they take the script the same way. Each command adds
them in its own order among its own flags, with its own words ("run", "trial") in the help."""

from __future__ import annotations

import argparse
from typing import Any

from phalanx.cli import options

_EVERY_COMMAND = {"--config": options.add_config, "--set": options.add_set}
# flag -> add_argument keywords; {verb} and {unit} in a help text are the command's words.
_SHARED: dict[str, dict[str, Any]] = {
    "--demo": {"action": "store_true", "help": "{verb} the built-in digits demo instead of a script"},
    "--steps": {
        "type": int,
        "metavar": "N",
        "help": "optimizer steps per {unit}, warm-up included (default {default})",
    },
    "--warmup": {
        "type": int,
        "default": 5,
        "metavar": "N",
        "help": "first steps of each {unit} left out of its figures (default {default})",
    },
    "--run-dir": {"metavar": "DIR", "help": "parent of the {verb} directory (default: launch.run_dir, 'runs')"},
    "--cpu": {"action": "store_true", "help": "run CPU processes on gloo even when GPUs are present"},
}


class TrialArguments:
    """Adds the shared flags to one command's parser; ``verb`` names the command ("bench"),
    ``unit`` one of its launches ("run")."""

    def __init__(self, parser: argparse.ArgumentParser, *, verb: str, unit: str):
        self.parser, self.verb, self.unit = parser, verb, unit

    def add(self, flag: str, **changes: Any) -> None:
        """One shared flag; ``changes`` replace its keywords (a ``help`` given here is used as is).
        ``--config`` and ``--set`` are every command's (cli/options.py): ``also`` adds this
        command's clause to their one help text."""
        if flag in _EVERY_COMMAND:
            _EVERY_COMMAND[flag](self.parser, changes.get("also") or f"for every {self.unit}")
            return
        keywords = {**_SHARED[flag], **changes}
        if "help" not in changes:
            keywords["help"] = keywords["help"].format(verb=self.verb, unit=self.unit, default=keywords.get("default"))
        self.parser.add_argument(flag, **keywords)

    def add_script(self) -> None:
        """SCRIPT and everything after it: the last arguments."""
        self.parser.add_argument(
            "script", nargs="?", help="the Python training script (it must train through phalanx.Session)"
        )
        self.parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def trial_options(args: argparse.Namespace) -> dict[str, Any]:
    """The shared flags as keywords of BenchOptions and TuneOptions (harness/launching.TrialOptions)."""
    return {
        "script": args.script,
        "script_args": tuple(args.script_args),
        "demo": args.demo,
        "steps": args.steps,
        "warmup": args.warmup,
        "overrides": tuple(args.overrides),
        "config_file": args.config,
        "run_dir": args.run_dir,
        "cpu": args.cpu,
    }
