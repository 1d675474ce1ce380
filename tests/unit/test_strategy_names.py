"""No layer outside src/phalanx/strategies/ decides by comparing a strategy's name: they read the
strategies' capabilities (class attributes, strategies/base.py). Checked on the source's AST."""

from __future__ import annotations

import ast
from pathlib import Path

from phalanx.plan.accounting import variants
from phalanx.strategies import STRATEGIES

SRC = Path(__file__).resolve().parents[2] / "src" / "phalanx"
NAMES = frozenset(STRATEGIES) | frozenset(variants())  # the plan's rows: fsdp-zero2, fsdp-zero3, ...


def _names_in(node: ast.AST) -> list[str]:
    """The strategy names ``node`` is, or holds as a literal set/tuple/list (or frozenset/set of one)."""
    if isinstance(node, ast.Constant):
        return [node.value] if node.value in NAMES else []
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("set", "frozenset", "tuple", "list")
        and node.args
    ):
        return _names_in(node.args[0])
    if isinstance(node, (ast.Set, ast.Tuple, ast.List)):
        return [name for element in node.elts for name in _names_in(element)]
    return []


def _collections(tree: ast.AST) -> dict[str, list[str]]:
    """Names bound to a collection of strategy names (``_BUCKETS = ("ddp", "zero1")``)."""
    out = {}
    for node in ast.walk(tree):
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if value is None or isinstance(value, ast.Constant) or not _names_in(value):
            continue
        for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
            if isinstance(target, ast.Name):
                out[target.id] = _names_in(value)
    return out


def name_comparisons(source: str, collections: dict[str, list[str]] | None = None) -> list[tuple[int, str]]:
    """(line, what) for each comparison with a strategy name: ``==``/``!=``/``in``/``not in`` against a
    name or a literal collection of names, or a named collection of them; ``match`` cases on one."""
    tree = ast.parse(source)
    named = {**(collections or {}), **_collections(tree)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for op, left, right in zip(node.ops, operands, operands[1:]):
                if not isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)):
                    continue
                hits = _names_in(left) + _names_in(right)
                hits += [n for side in (left, right) if isinstance(side, ast.Name) for n in named.get(side.id, [])]
                if hits:
                    found.append((node.lineno, f"compares with {', '.join(sorted(set(hits)))}"))
        elif isinstance(node, ast.match_case):
            hits = [
                n for sub in ast.walk(node.pattern) if isinstance(sub, ast.MatchValue) for n in _names_in(sub.value)
            ]
            if hits:
                found.append((node.pattern.lineno, f"matches {', '.join(sorted(set(hits)))}"))
    return found


def test_no_strategy_name_comparison_outside_strategies():
    modules = {
        path: path.read_text(encoding="utf-8")
        for path in SRC.rglob("*.py")
        if "strategies" not in path.relative_to(SRC).parts
    }
    # A collection defined in one module and compared in another (``from x import _BUCKETS``) counts too.
    shared = {name: hits for source in modules.values() for name, hits in _collections(ast.parse(source)).items()}
    offending = [
        f"{path.relative_to(SRC.parent)}:{line}: {what}"
        for path, source in sorted(modules.items())
        for line, what in name_comparisons(
            source, {n: h for n, h in shared.items() if n.isupper() or n.startswith("_")}
        )
    ]
    assert offending == [], "read a capability of the strategy instead (strategies/base.py):\n" + "\n".join(offending)


def test_the_finder_finds_each_form():
    source = """
LOCAL = ("single", "ddp")
if name == "fsdp": pass
if "pipeline" != other: pass
if name in ("dp", "model_parallel"): pass
if name not in {"zero1"}: pass
if row in frozenset(["fsdp-zero2"]): pass
if name in LOCAL: pass
match name:
    case "ddp": pass
if kind == "cuda" or name in ("auto",): pass
ORDER = ["ddp", "zero1"]
for row in ORDER: pass
"""
    assert [line for line, _ in name_comparisons(source)] == [3, 4, 5, 6, 7, 8, 10]
