"""``phalanx check``: the known distributed mistakes of a training script, found in its source.

Pure ``ast``: the script is parsed, never run or imported, and nothing here imports torch.
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterable
from pathlib import Path

from phalanx.check import rules_accumulate, rules_collectives, rules_devices, rules_sampler, rules_save, rules_warnings
from phalanx.check.catalog import RULES
from phalanx.check.findings import CheckInputError, Finding, format_finding, ignore_comments, silenced
from phalanx.check.ranks import Ranks
from phalanx.check.script import Script

__all__ = ["RULES", "CheckInputError", "Finding", "check_file", "check_paths", "check_source", "format_finding"]

_FAMILIES = (rules_collectives, rules_sampler, rules_accumulate, rules_save, rules_devices, rules_warnings)


def check_source(source: str, path: str = "<string>", ignore: Collection[str] = ()) -> list[Finding]:
    """The findings of one script's source, sorted by line; ``ignore``: rule ids left out."""
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as err:
        raise CheckInputError(f"{path}:{err.lineno or 0}: cannot parse: {err.msg}") from None
    except (ValueError, RecursionError, MemoryError) as err:  # null bytes; nesting deeper than the parser goes
        raise CheckInputError(f"{path}:0: cannot parse: {type(err).__name__}: {err}") from None
    script = Script(tree, path)
    try:
        ranks = Ranks(script)
        found = {f for family in _FAMILIES for f in family.check(script, ranks)}
    except RecursionError:  # deep expressions that parsed but are deeper than the checks recurse
        raise CheckInputError(f"{path}:0: too deeply nested to check") from None
    comments = ignore_comments(source)
    kept = [f for f in found if f.rule not in ignore and not silenced(f, comments)]
    return sorted(kept, key=lambda f: (f.path, f.line, f.rule, f.message))


def check_file(path: str | Path, ignore: Collection[str] = ()) -> list[Finding]:
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise CheckInputError(f"{path}: cannot read: {err.strerror or err}") from None
    try:
        source = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CheckInputError(f"{path}: not UTF-8 text (byte {err.start}): {err.reason}") from None
    return check_source(source, str(path), ignore)


def check_paths(paths: Iterable[str | Path], ignore: Collection[str] = ()) -> list[Finding]:
    """The findings of every script, sorted by path, then line."""
    found = [f for p in paths for f in check_file(p, ignore)]
    return sorted(found, key=lambda f: (f.path, f.line, f.rule, f.message))
