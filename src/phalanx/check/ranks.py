"""Which code runs on some ranks only: rank-dependent values (a rank, ``is_main``, what is computed
from them), the conditions and early exits built on them, and the functions of the file that are
only ever called under one."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cached_property

from phalanx.check.script import RANK_ENV, Script, const_str, last_name

RANK_NAMES = {"rank", "local_rank", "global_rank", "ddp_rank", "ddp_local_rank", "gpu_id", "node_rank", "world_rank",
              "process_index", "local_process_index", "node_local_rank", "rank_id"}  # fmt: skip
MAIN_FLAGS = {"is_main", "is_master", "master_process", "is_main_process", "is_local_main_process", "is_global_zero",
              "is_rank_zero", "is_rank0", "rank0", "rank_zero", "main_process", "is_chief"}  # fmt: skip
_RANK_CALLS = {"get_rank", "get_local_rank", "get_node_local_rank", "get_global_rank", "is_world_process_zero"}
_EXITS = {"exit", "_exit", "quit"}
MAX_DEPTH = 3  # how deep calls into the file's own functions are followed


@dataclass(frozen=True)
class Guard:
    """The rank-dependent ``if`` a call runs under (None: an early exit), and in which branch."""

    node: ast.If | ast.While | None
    orelse: bool


def _presence(expr: ast.AST) -> bool:
    """``rank is None``, ``rank != -1``: whether a rank is set at all, the same on every rank."""
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.USub) and isinstance(expr.operand, ast.Constant):
        return True
    return isinstance(expr, ast.Constant) and (expr.value is None or (isinstance(expr.value, int) and expr.value < 0))


class Ranks:
    def __init__(self, script: Script):
        self.script = script
        self.tainted: set[str] = set()
        self.rank_functions: set[str] = set()  # the file's own `def is_main_process(): return get_rank() == 0`
        for _ in range(3):  # a name computed from a name computed from a rank
            for node in ast.walk(script.tree):
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for target, value in self._pairs(targets, node.value):
                        name = last_name(target)
                        if name and self.valued(value):
                            self.tainted.add(name)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                    isinstance(r, ast.Return) and r.value is not None and self.valued(r.value) for r in ast.walk(node)
                ):
                    self.rank_functions.add(node.name)
        self.guards: dict[ast.Call, Guard] = {}
        self.scope: dict[ast.Call, ast.AST] = {}
        self._block(script.tree.body, None, script.tree)
        self.functions: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        for node in ast.walk(script.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions.setdefault(node.name, []).append(node)
        self._callers: dict[ast.AST, list[ast.Call]] = {}
        for call in script.calls:
            for function in self.callees(call):
                self._callers.setdefault(function, []).append(call)

    @staticmethod
    def _pairs(targets: list[ast.expr], value: ast.expr):
        for target in targets:
            if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
                yield from zip(target.elts, value.elts)
            elif not isinstance(target, ast.Tuple):
                yield target, value

    def valued(self, expr: ast.AST) -> bool:
        """The expression's value differs from rank to rank."""
        if isinstance(expr, (ast.Name, ast.Attribute)):
            name = last_name(expr)
            return name in RANK_NAMES or name in MAIN_FLAGS or name in self.tainted
        if isinstance(expr, ast.Call):
            name = last_name(expr)
            if name in _RANK_CALLS or name in MAIN_FLAGS or name in self.rank_functions:
                return True
            if name in {"int", "bool", "float"} and expr.args:
                return self.valued(expr.args[0])
            env = self.script.qualname(expr.func) in {"os.environ.get", "os.getenv"}
            return env and bool(expr.args) and const_str(expr.args[0]) in RANK_ENV
        if isinstance(expr, ast.Subscript):
            return self.script.qualname(expr.value) == "os.environ" and const_str(expr.slice) in RANK_ENV
        if isinstance(expr, ast.BinOp):
            return self.valued(expr.left) or self.valued(expr.right)
        if isinstance(expr, ast.UnaryOp):
            return self.valued(expr.operand)
        if isinstance(expr, ast.BoolOp):
            return any(self.valued(v) for v in expr.values)
        if isinstance(expr, ast.Compare):
            operands = [expr.left, *expr.comparators]
            return not any(map(_presence, operands)) and any(map(self.valued, operands))
        if isinstance(expr, ast.IfExp):
            return any(map(self.valued, (expr.test, expr.body, expr.orelse)))
        if isinstance(expr, ast.NamedExpr):
            return self.valued(expr.value)
        return False

    # -- where each call runs ---------------------------------------------------------------
    def _block(self, body: list[ast.stmt], guard: Guard | None, scope: ast.AST) -> None:
        for stmt in body:
            self._stmt(stmt, guard, scope)
            if guard is None and isinstance(stmt, ast.If) and self.valued(stmt.test):
                if (_exits(stmt.body) and not stmt.orelse) or (stmt.orelse and _exits(stmt.orelse)):
                    guard = Guard(None, False)  # `if not is_main: return`: what follows runs on some ranks

    def _stmt(self, stmt: ast.stmt, guard: Guard | None, scope: ast.AST) -> None:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self._block(stmt.body, None, stmt)
            return
        if isinstance(stmt, ast.ClassDef):
            self._block(stmt.body, guard, scope)
            return
        if isinstance(stmt, (ast.If, ast.While)):
            self._expr(stmt.test, guard, scope)
            rank = guard is None and self.valued(stmt.test)
            self._block(stmt.body, Guard(stmt, False) if rank else guard, scope)
            self._block(stmt.orelse, Guard(stmt, True) if rank else guard, scope)
            return
        for field, value in ast.iter_fields(stmt):
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                self._block(value, guard, scope)
            elif isinstance(value, list) and value and isinstance(value[0], ast.excepthandler):
                for handler in value:
                    self._block(handler.body, guard, scope)
            elif isinstance(value, list) and value and isinstance(value[0], ast.match_case):
                for case in value:
                    self._block(case.body, guard, scope)
            elif isinstance(value, list):
                for item in value:
                    if isinstance(item, ast.AST):  # not the names of `global a, b`
                        self._expr(item, guard, scope)
            elif isinstance(value, ast.AST):
                self._expr(value, guard, scope)

    def _expr(self, node: ast.AST, guard: Guard | None, scope: ast.AST) -> None:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call):
                self.scope[sub] = scope
                if guard is not None:
                    self.guards[sub] = guard

    # -- the file's own functions -----------------------------------------------------------
    def callees(self, call: ast.Call) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
        """The functions of this file a call runs: ``f()`` a function, ``self.f()`` a method of its class."""
        func = call.func
        if isinstance(func, ast.Name):
            return [f for f in self.functions.get(func.id, []) if not isinstance(self.script.parents[f], ast.ClassDef)]
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in {"self", "cls"}:
            owner = self._class_of(call)
            return [f for f in self.functions.get(func.attr, []) if self.script.parents[f] is owner]
        return []

    def _class_of(self, node: ast.AST) -> ast.ClassDef | None:
        while node in self.script.parents:
            node = self.script.parents[node]
            if isinstance(node, ast.ClassDef):
                return node
        return None

    def guarded(self, call: ast.Call, depth: int = 0, seen: frozenset = frozenset()) -> bool:
        """The call runs on some ranks only: under a rank condition, or in a function that every
        caller in the file calls under one."""
        if call in self.guards:
            return True
        scope = self.scope.get(call)
        if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) or depth >= MAX_DEPTH or scope in seen:
            return False
        callers = self._callers.get(scope, [])
        return bool(callers) and all(self.guarded(c, depth + 1, seen | {scope}) for c in callers)

    def unused(self, call: ast.Call) -> bool:
        """The call is in a function that nothing in the file calls or names (left-over code)."""
        scope = self.scope.get(call)
        if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) or self._callers.get(scope):
            return False
        return scope.name not in self._referenced

    @cached_property
    def _referenced(self) -> set[str]:
        return {
            last_name(n)
            for n in ast.walk(self.script.tree)
            if isinstance(n, (ast.Name, ast.Attribute)) and isinstance(n.ctx, ast.Load)
        }

    def reached(self, function: ast.AST, depth: int = 1, seen: frozenset = frozenset()):
        """(call, depth) for each call that running ``function`` makes, through the file's functions."""
        for node in ast.walk(function):
            if isinstance(node, ast.Call) and self.scope.get(node) is function:
                yield node
                if depth < MAX_DEPTH:
                    for inner in self.callees(node):
                        if inner not in seen:
                            yield from self.reached(inner, depth + 1, seen | {function})


def _exits(body: list[ast.stmt]) -> bool:
    last = body[-1]
    if isinstance(last, (ast.Return, ast.Raise, ast.Continue, ast.Break)):
        return True
    return isinstance(last, ast.Expr) and isinstance(last.value, ast.Call) and last_name(last.value) in _EXITS
