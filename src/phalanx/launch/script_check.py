"""``phalanx check`` in the launch path: the script's findings as one block before any worker
starts, and a launch refused on an error finding (``--no-check`` launches anyway). The check reads
the source only, in milliseconds, so it costs a launch nothing it would notice."""

from __future__ import annotations

import sys
from typing import TextIO

from phalanx.check import CheckInputError, check_file, format_finding
from phalanx.errors import PhalanxError
from phalanx.util.words import plural


def check_before_launch(script: str, out: TextIO | None = None) -> None:
    """Print the findings of ``script``; raise when one is an error."""
    out = out or sys.stderr
    try:
        findings = check_file(script)
    except CheckInputError as err:  # the script compiles (checked before): an encoding check cannot read
        print(f"phalanx: check skipped: {err}", file=out, flush=True)
        return
    if not findings:
        return
    errors = sum(f.severity == "error" for f in findings)
    counts = ", ".join(plural(n, word) for n, word in ((errors, "error"), (len(findings) - errors, "warning")) if n)
    lines = [f"phalanx: check: {counts} in {script} (docs/check.md):"]
    lines += [f"  {format_finding(f)}" for f in findings]
    print("\n".join(lines), file=out, flush=True)
    if errors:
        raise PhalanxError(
            f"{script} has {plural(errors, 'error')} that hang{'s' if errors == 1 else ''} or train wrongly "
            "across processes (above); fix them, silence a line with `# phalanx: ignore[rule-id]`, or launch "
            "with --no-check (launch.check: false) to run it anyway; nothing was started"
        )
