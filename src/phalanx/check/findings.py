"""A finding of ``phalanx check``, its one-line form, and the comments that silence one."""

from __future__ import annotations

import io
import re
import tokenize
from dataclasses import dataclass

from phalanx.errors import PhalanxError


class CheckInputError(PhalanxError):
    """A script that cannot be read or parsed: nothing can be said about it."""

    exit_code = 2


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    severity: str  # "error" (the run hangs or trains wrongly) | "warning"
    rule: str  # kebab-case rule id, as `phalanx check --list-rules` lists them
    message: str  # what is wrong; the fix


def format_finding(f: Finding) -> str:
    return f"{f.path}:{f.line}: {f.severity} {f.rule}: {f.message}"


_IGNORE = re.compile(r"#\s*phalanx:\s*ignore(?:\[([^\]]*)\])?")
ALL = None  # a bare `# phalanx: ignore`: every rule on its line


def ignore_comments(source: str) -> dict[int, frozenset[str] | None]:
    """Line -> the rule ids its ``# phalanx: ignore[...]`` comment silences (ALL for every rule)."""
    out: dict[int, frozenset[str] | None] = {}
    for line, text in _comments(source):
        match = _IGNORE.search(text)
        if match is None:
            continue
        if match.group(1) is None:
            out[line] = ALL
        elif out.get(line, frozenset()) is not ALL:
            rules = frozenset(r.strip() for r in match.group(1).split(",") if r.strip())
            out[line] = out.get(line, frozenset()) | rules
    return out


def _comments(source: str) -> list[tuple[int, str]]:
    # Tokens, not lines: a "# phalanx: ignore" inside a string literal is no comment.
    try:
        tokens = tokenize.generate_tokens(io.StringIO(source).readline)
        return [(t.start[0], t.string) for t in tokens if t.type == tokenize.COMMENT]
    except (tokenize.TokenError, SyntaxError):
        return [(n, text) for n, text in enumerate(source.splitlines(), 1) if "#" in text]


def silenced(finding: Finding, comments: dict[int, frozenset[str] | None]) -> bool:
    if finding.line not in comments:
        return False
    rules = comments[finding.line]
    return rules is ALL or finding.rule in rules
