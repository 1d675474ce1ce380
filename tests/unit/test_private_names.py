"""No private name of torch (or of another module's object) outside phalanx/_torch_compat.py,
checked on the syntax tree of every module: a torch upgrade then breaks one module, which says
what it was checked on, instead of a training run."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "phalanx"
COMPAT = SRC / "_torch_compat.py"

# A string that is a dotted torch path, as importlib and sys.modules take them.
_TORCH_PATH = re.compile(r"torch(\.[A-Za-z_]\w*)+")
_REFLECTION = frozenset({"getattr", "hasattr", "setattr", "delattr"})

# Documented public API despite the underscore: os._exit, and namedtuple's methods on any object.
ALWAYS_ALLOWED = frozenset({"os._exit"})
NAMEDTUPLE_API = frozenset({"_fields", "_field_defaults", "_asdict", "_replace", "_make"})

# Cross-module private accesses that are not torch's, allowed for now, (file, expression) -> why.
# Shrink it: test_allowed_private_accesses_still_exist fails once an entry is gone from the source.
ALLOWED = {
    # CPython: another thread's frame has no public accessor (sys docs: implementation detail).
    ("faults/watchdog.py", "sys._current_frames"): "the hang watchdog prints the main thread's stack",
    # CPython, undocumented: the exit handlers, run by hand before os._exit (which skips them).
    ("launch/worker.py", "atexit._run_exitfuncs"): "the worker skips torch's finalization, not the exit handlers",
    # transformers (duck-typed, never imported): PreTrainedModel's per-module initialiser has no public name.
    ("strategies/model_init.py", "module._init_weights"): "deferred construction applies a model's own init",
}  # fmt: skip


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_torch_module(path: str) -> bool:
    parts = path.split(".")
    return parts[0] == "torch" and any(_private(p) for p in parts[1:])


def _on_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def findings(path: Path) -> list[tuple[int, str, str]]:
    """(line, what, expression) for each private access in one module."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            what = "import of a private torch module"
            found += [(node.lineno, what, a.name) for a in node.names if _private_torch_module(a.name)]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            if _private_torch_module(node.module):
                found.append((node.lineno, "import from a private torch module", node.module))
            what = "import of a private torch name"
            found += [(node.lineno, what, f"{node.module}.{a.name}") for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if _TORCH_PATH.fullmatch(node.value) and _private_torch_module(node.value):
                found.append((node.lineno, "string naming a private torch module", repr(node.value)))
        elif isinstance(node, ast.Attribute) and _private(node.attr) and not _on_self(node.value):
            found.append((node.lineno, "private attribute of another object", ast.unparse(node)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _REFLECTION:
            target, name = (node.args + [None, None])[:2]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value):
                if not _on_self(target):
                    expr = f"{ast.unparse(target)}.{name.value}"
                    found.append((node.lineno, f"{node.func.id} of a private attribute", expr))
    return sorted(found)


def _modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if p != COMPAT)


def test_no_private_torch_name_outside_the_compat_module():
    problems = []
    for path in _modules():
        rel = path.relative_to(SRC).as_posix()
        for line, what, expr in findings(path):
            public = expr in ALWAYS_ALLOWED or expr.rpartition(".")[2] in NAMEDTUPLE_API
            if not public and (rel, expr) not in ALLOWED:
                problems.append(f"src/phalanx/{rel}:{line}: {what}: {expr}")
    assert not problems, "use (or add) a function of phalanx/_torch_compat.py instead:\n" + "\n".join(problems)


def test_allowed_private_accesses_still_exist():
    present = {(path.relative_to(SRC).as_posix(), expr) for path in _modules() for _, _, expr in findings(path)}
    gone = sorted(f"{rel}: {expr}" for rel, expr in ALLOWED if (rel, expr) not in present)
    assert not gone, "no longer in the source; remove from ALLOWED:\n" + "\n".join(gone)


def test_the_walk_finds_each_kind(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch._dynamo\n"
        "from torch.distributed.checkpoint._traverse import set_element\n"
        "from torch.optim.optimizer import _get_fused_kernels_supported_devices\n"
        "import sys\n"
        "sys.modules.get('torch._dynamo.eval_frame')\n"
        "sampler._num_samples\n"
        "getattr(model, '_orig_mod', None)\n"
        "self._fine, cls._fine, _helper(), obj.__dict__, 'see torch._dynamo docs'\n"
    )
    assert [(line, expr) for line, _, expr in findings(sample)] == [
        (1, "torch._dynamo"),
        (2, "torch.distributed.checkpoint._traverse"),
        (3, "torch.optim.optimizer._get_fused_kernels_supported_devices"),
        (5, "'torch._dynamo.eval_frame'"),
        (6, "sampler._num_samples"),
        (7, "model._orig_mod"),
    ]
