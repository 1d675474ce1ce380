"""The shape of src/phalanx, checked rather than trusted: no import cycle between modules (late
imports and TYPE_CHECKING blocks count too) and imports that point down the layers of DESIGN.md."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "phalanx"

# Top-level package or module -> layer; a module may import its own layer or lower ones only.
LAYERS = {
    "__main__": 10, "cli": 10,
    "tune": 9,
    "bench": 8, "verify": 8,
    "harness": 7, "diagnose": 7, "demo": 7,
    "launch": 6,
    "session": 5, "plan": 5,
    "strategies": 4,
    "runtime": 3, "metrics": 3, "faults": 3,
    "checkpoint": 2, "config": 2, "check": 2,
    "util": 1, "topology": 1, "errors": 1, "version": 1, "_torch_compat": 1, "phalanx": 1,
}  # fmt: skip


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the phalanx modules it imports anywhere in its body."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    graph[name].add(target if target in modules else base)
        graph[name] = {m for m in graph[name] if m in modules and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_every_top_level_module_has_a_layer():
    assert {_top(m) for m in _modules()} <= set(LAYERS), "add the new package to LAYERS (and to DESIGN.md)"


def test_imports_point_down_the_layers():
    upward = [
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        for target in targets
        if LAYERS[_top(target)] > LAYERS[_top(module)]
    ]
    assert upward == []
