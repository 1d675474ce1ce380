"""Gradient accumulation done twice or at the wrong time: inside ``with session.accumulate(...)``
(phalanx divides the loss and steps at the block's end) and in a hand-written accumulation loop."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from phalanx.check.catalog import found
from phalanx.check.findings import Finding
from phalanx.check.ranks import Ranks
from phalanx.check.script import Script, last_name, walk_local

# Statements holding others, which may run on some iterations only (their bodies are looked at apart).
_COMPOUND = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try, ast.Match,
             ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)  # fmt: skip


def check(script: Script, ranks: Ranks) -> Iterator[Finding]:
    handed_to_setup = {
        last_name(arg) for c in script.calls if last_name(c) == "setup" for arg in c.args if last_name(arg)
    }
    for node in ast.walk(script.tree):
        if isinstance(node, (ast.With, ast.AsyncWith)):
            kind = _accumulating(script, node)
            if kind is not None:
                yield from _in_block(script, node, kind, handed_to_setup)
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            yield from _micro_step_scheduler(script, node)


def _accumulating(script: Script, node: ast.With | ast.AsyncWith) -> str | None:
    """'phalanx', 'accelerate' or '' (another library's) for ``with X.accumulate(...)``; None otherwise."""
    for item in node.items:
        call = item.context_expr
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "accumulate":
            if isinstance(call.func.value, (ast.Name, ast.Attribute)):
                return script.kind(call.func.value) or ""
    return None


def _in_block(script: Script, block: ast.With | ast.AsyncWith, kind: str, handed: set) -> Iterator[Finding]:
    for stmt in block.body:
        for node in walk_local(stmt):
            divided = _divided_loss(node)
            if divided is not None:
                yield found(
                    script.path,
                    node,
                    "loss-divided-in-accumulate",
                    f"the loss is divided by {divided} inside accumulate(), which averages the micro-steps "
                    "already: the gradients come out that many times too small; remove the division",
                )
            if kind != "phalanx" or not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            receiver, method = node.func.value, node.func.attr
            if method == "step" and script.is_scheduler(receiver) and last_name(receiver) not in handed:
                yield found(
                    script.path,
                    node,
                    "scheduler-in-accumulate",
                    f"{ast.unparse(node.func)}() inside session.accumulate() steps once per micro-step wherever "
                    "the plan accumulates; step it after the block when session.sync_gradients is True, or pass "
                    "it to session.setup() and let phalanx step it",
                )
            elif (method == "step" and script.is_optimizer(receiver)) or method == "zero_grad":
                yield found(
                    script.path,
                    node,
                    "step-in-accumulate",
                    f"{ast.unparse(node.func)}() inside session.accumulate(): the block steps the optimizer and "
                    "zeroes the gradients at the last micro-step of each global batch itself; remove this call",
                )


def _divided_loss(node: ast.AST) -> str | None:
    """The accumulation count a loss is divided by: ``loss / accum_steps``, ``loss /= grad_accum``."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        loss, count = node.left, node.right
    elif isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Div):
        loss, count = node.target, node.value
    else:
        return None
    if not any("loss" in (last_name(n) or "").lower() for n in ast.walk(loss)):
        return None
    names = [last_name(n) or "" for n in ast.walk(count)]
    return ast.unparse(count) if any(_counts_accumulation(n) for n in names) else None


def _counts_accumulation(name: str) -> bool:
    name = name.lower()
    return "accum" in name or "grad_acc" in name


def _micro_step_scheduler(script: Script, loop: ast.For | ast.AsyncFor | ast.While) -> Iterator[Finding]:
    """``loss.backward()`` every iteration, ``optimizer.step()`` under ``if (i + 1) % accum == 0:``, and
    the scheduler stepped outside that condition: once per micro-step."""
    plain = list(_unconditional(loop.body))
    if any(isinstance(n, (ast.With, ast.AsyncWith)) and _accumulating(script, n) is not None for n in plain):
        return
    simple = [stmt for stmt in plain if not isinstance(stmt, _COMPOUND)]
    calls = [n for stmt in simple for n in walk_local(stmt) if isinstance(n, ast.Call)]
    if not any(last_name(c) == "backward" for c in calls):
        return
    windows = [s for s in plain if isinstance(s, ast.If) and _modulo(s.test) and _steps_optimizer(script, s)]
    if not windows:
        return
    for call in calls:
        if last_name(call) == "step" and isinstance(call.func, ast.Attribute) and script.is_scheduler(call.func.value):
            yield found(
                script.path,
                call,
                "scheduler-per-micro-step",
                f"{ast.unparse(call.func)}() runs on every micro-step, but the optimizer steps only under "
                f"`{ast.unparse(windows[0].test)}`: the schedule runs that many times too fast; move it under the "
                "same condition, after optimizer.step()",
            )


def _unconditional(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements of a loop body that run every iteration, through with and try blocks."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            yield from _unconditional(stmt.body)
        elif isinstance(stmt, ast.Try):
            yield from _unconditional(stmt.body)


def _modulo(test: ast.expr) -> bool:
    return any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) for n in ast.walk(test))


def _steps_optimizer(script: Script, branch: ast.If) -> bool:
    for node in ast.walk(branch):
        if isinstance(node, ast.Call) and last_name(node) == "step" and isinstance(node.func, ast.Attribute):
            receiver = node.func.value
            if script.is_optimizer(receiver) or "scaler" in (last_name(receiver) or "").lower():
                return True
    return False
