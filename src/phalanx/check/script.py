"""One parsed script and what every rule asks of it: import aliases, qualified call names, what a
name was built from, and whether the file runs as one process of several."""

from __future__ import annotations

import ast
import re
from functools import cached_property

# The objects whose methods stand for distributed work, by the library that made them.
_KIND_CONSTRUCTORS = {
    "phalanx.Session": "phalanx",
    "phalanx.session.Session": "phalanx",
    "accelerate.Accelerator": "accelerate",
    "lightning.Fabric": "fabric",
    "lightning.fabric.Fabric": "fabric",
    "lightning_fabric.Fabric": "fabric",
}
_KIND_NAMES = {"session": "phalanx", "accelerator": "accelerate", "fabric": "fabric"}
_PROCESS_GROUP_CALLS = re.compile(r"(^|\.)(init_process_group|DistributedDataParallel|DDP|fully_shard|FSDP|"
                                  r"FullyShardedDataParallel|init_device_mesh)$")  # fmt: skip
RANK_ENV = {"RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK", "SLURM_PROCID", "SLURM_LOCALID", "OMPI_COMM_WORLD_RANK"}


def last_name(expr: ast.AST) -> str | None:
    """``x`` of ``x``, ``a.b.x``; the callee's of a call (``x`` of ``a.x()``)."""
    if isinstance(expr, ast.Call):
        expr = expr.func
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        return expr.attr
    return None


def const_str(expr: ast.AST | None) -> str | None:
    return expr.value if isinstance(expr, ast.Constant) and isinstance(expr.value, str) else None


def keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def walk_local(node: ast.AST):
    """``ast.walk`` that stays out of nested function and class bodies (code that runs elsewhere)."""
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        for child in ast.iter_child_nodes(current):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                stack.append(child)


class Script:
    def __init__(self, tree: ast.Module, path: str):
        self.tree, self.path = tree, path
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
        self.aliases = self._aliases()
        self.built_from = self._built_from()  # name -> qualified names of the callables it was bound to

    def _aliases(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    out[a.asname or a.name] = f"{node.module}.{a.name}"
        return out

    def qualname(self, expr: ast.AST) -> str | None:
        """``torch.distributed.all_reduce`` for ``dist.all_reduce`` after ``import torch.distributed as dist``."""
        if isinstance(expr, ast.Call):
            expr = expr.func
        if isinstance(expr, ast.Name):
            return self.aliases.get(expr.id, expr.id)
        if isinstance(expr, ast.Attribute):
            base = self.qualname(expr.value)
            return None if base is None else f"{base}.{expr.attr}"
        return None

    def _built_from(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call):
                made = self.qualname(node.value)
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    name = last_name(target)
                    if made and name:
                        out.setdefault(name, set()).add(made)
        return out

    def kind(self, receiver: ast.AST) -> str | None:
        """'phalanx', 'accelerate' or 'fabric' for an object of theirs (``session``, ``self.accelerator``)."""
        name = last_name(receiver)
        if name is None or isinstance(receiver, ast.Call):
            return None
        for made in self.built_from.get(name, ()):
            for constructor, kind in _KIND_CONSTRUCTORS.items():
                if made == constructor or made.endswith("." + constructor):
                    return kind
        return _KIND_NAMES.get(name)

    def is_scheduler(self, receiver: ast.AST) -> bool:
        name = last_name(receiver)
        if name is None or isinstance(receiver, ast.Call):
            return False
        made = self.built_from.get(name, set())
        return "sched" in name.lower() or any(".lr_scheduler." in m or "schedule" in m.split(".")[-1] for m in made)

    def is_optimizer(self, receiver: ast.AST) -> bool:
        name = last_name(receiver)
        if name is None or isinstance(receiver, ast.Call):
            return False
        made = self.built_from.get(name, set())
        return "optim" in name.lower() or name == "opt" or any(m.startswith("torch.optim.") for m in made)

    def names(self) -> set[str]:
        """Every name and attribute name the file mentions."""
        return {n for n in map(last_name, ast.walk(self.tree)) if n}

    @cached_property
    def libraries(self) -> set[str]:
        """The libraries whose training object the file builds: 'phalanx', 'accelerate', 'fabric'."""
        out = set()
        for call in self.calls:
            made = self.qualname(call) or ""
            out |= {kind for c, kind in _KIND_CONSTRUCTORS.items() if made == c}
        return out

    @property
    def uses_phalanx(self) -> bool:
        return "phalanx" in self.libraries

    @cached_property
    def process_group(self) -> bool:
        """The file runs as one process of a group it joins itself (torchrun, mp.spawn)."""
        if any(_PROCESS_GROUP_CALLS.search(self.qualname(c) or "") for c in self.calls):
            return True
        return any(const_str(n) in RANK_ENV for n in ast.walk(self.tree) if isinstance(n, ast.Constant))

    @cached_property
    def data_parallel(self) -> bool:
        """Several processes each train on a share of the batch: their own group, or a library's."""
        return self.process_group or bool(self.libraries)

    @cached_property
    def sets_device(self) -> bool:
        for call in self.calls:
            if last_name(call) in {"set_device", "set_device_index"}:
                return True
            if last_name(call) == "init_process_group" and keyword(call, "device_id") is not None:
                return True
        return False

    @cached_property
    def uses_cuda(self) -> bool:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call) and last_name(node) == "cuda":
                return True
            text = const_str(node)
            if text is not None and text.startswith("cuda"):
                return True
        return False
