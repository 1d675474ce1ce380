"""``phalanx check``: the known distributed mistakes of training scripts, found in their source."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from phalanx.check import RULES, CheckInputError, check_paths, format_finding
from phalanx.cli import options


def register(commands) -> None:
    p = commands.add_parser(
        "check",
        help="the known distributed mistakes, found in the source before a run",
        description=(
            "Reads training scripts (never runs them) for the mistakes that hang a multi-GPU run or train it "
            "wrongly. Exit code 1 on an error finding, 2 on a script that cannot be read."
        ),
    )
    p.add_argument("scripts", nargs="*", metavar="SCRIPT", help="the training scripts to check")
    options.add_json(p, "the findings as a list, and nothing else")
    p.add_argument("--ignore", action="append", default=[], metavar="RULE[,RULE...]", help="rule ids to leave out")
    p.add_argument("--list-rules", action="store_true", help="list each rule id, its severity and what it finds")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.list_rules:
        width = max(map(len, RULES))
        for rule, (severity, summary) in RULES.items():
            print(f"{rule:<{width}}  {severity:<7}  {summary}")
        return 0
    if not args.scripts:
        raise CheckInputError("phalanx check needs at least one SCRIPT (or --list-rules)")
    ignore = {r.strip() for value in args.ignore for r in value.split(",") if r.strip()}
    unknown = sorted(ignore - set(RULES))
    if unknown:
        raise CheckInputError(f"unknown rule id(s) in --ignore: {', '.join(unknown)}; known: {', '.join(RULES)}")
    findings = check_paths(args.scripts, ignore)
    if args.json:
        print(json.dumps([asdict(f) for f in findings], indent=2))
    else:
        for f in findings:
            print(format_finding(f))
        print(_summary(findings, len(args.scripts)))
    return 1 if any(f.severity == "error" for f in findings) else 0


def _summary(findings: list, files: int) -> str:
    where = f"{files} file" + ("s" if files != 1 else "")
    if not findings:
        return f"no findings in {where}"
    errors = sum(f.severity == "error" for f in findings)
    warnings = len(findings) - errors
    parts = [f"{n} {word}{'s' if n != 1 else ''}" for n, word in ((errors, "error"), (warnings, "warning")) if n]
    return f"{', '.join(parts)} in {where}"
