"""How many lines a port changes: each port of examples/word_lm/lm_single.py against the original,
counting code lines added plus lines removed (a changed line counts twice, as in `git diff
--numstat`). The module docstring, comments and blank lines are left out, so a port is not charged
for explaining itself, and lines are compared without their indentation (as `diff -w`), so a block
moved under a `with` counts its `with` line only. Prints a table; docs/porting.md quotes it.

    .venv/bin/python benchmarks/porting_lines.py
"""

from __future__ import annotations

import argparse
import ast
import difflib
import io
import tokenize
from pathlib import Path

FOLDER = Path(__file__).resolve().parents[1] / "examples" / "word_lm"
PORTS = {"phalanx": "lm_phalanx.py", "Accelerate": "lm_accelerate.py", "Lightning Fabric": "lm_fabric.py"}


def code_lines(path: Path) -> list[str]:
    """The file's lines without its module docstring, comments and blank lines (stripped)."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    skip: set[int] = set()
    first = tree.body[0] if tree.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        skip.update(range(first.lineno, first.end_lineno + 1))
    lines = source.splitlines()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, col = token.start
            lines[row - 1] = lines[row - 1][:col]
    return [line.strip() for n, line in enumerate(lines, 1) if n not in skip and line.strip()]


def changed(original: list[str], port: list[str]) -> tuple[int, int]:
    added = removed = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=original, b=port, autojunk=False).get_opcodes():
        if tag in ("replace", "delete"):
            removed += i2 - i1
        if tag in ("replace", "insert"):
            added += j2 - j1
    return added, removed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=FOLDER)
    args = parser.parse_args()
    original = code_lines(args.folder / "lm_single.py")
    print(f"{'port':18} {'added':>6} {'removed':>8} {'changed':>8}   ({len(original)} code lines in lm_single.py)")
    for name, file in PORTS.items():
        added, removed = changed(original, code_lines(args.folder / file))
        print(f"{name:18} {added:>6} {removed:>8} {added + removed:>8}")


if __name__ == "__main__":
    main()
