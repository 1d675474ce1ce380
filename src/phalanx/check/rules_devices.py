"""cuda-without-index: every process of a group on cuda:0; untimed-cuda-sync: a wall clock read
around CUDA work that was only queued, not done."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from phalanx.check.catalog import found
from phalanx.check.findings import Finding
from phalanx.check.ranks import Ranks
from phalanx.check.script import Script, const_str, keyword, last_name, walk_local

_UNINDEXED = {"cuda", "cuda:0"}
_CLOCKS = {"time.time", "time.perf_counter", "time.monotonic"}
_SYNCS = {"item", "cpu", "tolist", "synchronize", "numpy", "elapsed_time"}


def check(script: Script, ranks: Ranks) -> Iterator[Finding]:
    yield from _unindexed(script)
    yield from _untimed(script)


def _unindexed(script: Script) -> Iterator[Finding]:
    # phalanx, Accelerate and Fabric set each process's device themselves; set_device() anywhere makes
    # "cuda" this rank's.
    if not script.process_group or script.libraries or script.sets_device:
        return
    message = (
        "every rank uses cuda:0 here: no torch.cuda.set_device() in the file, so 'cuda' is device 0 on every "
        "process (out of memory, or all of them on one GPU); call torch.cuda.set_device(local_rank) before any "
        "CUDA work, or use f'cuda:{local_rank}'"
    )
    for node in ast.walk(script.tree):
        if isinstance(node, ast.Call):
            name = last_name(node)
            values = [keyword(node, "device")]
            if name in {"to", "device"} and node.args:
                values.append(node.args[0])
            if name == "device" and len(node.args) > 1:
                continue  # torch.device("cuda", local_rank)
            if name == "cuda" and isinstance(node.func, ast.Attribute) and not node.args and not node.keywords:
                yield found(script.path, node, "cuda-without-index", f".cuda() without a device: {message}")
            elif any(const_str(v) in _UNINDEXED for v in values):
                yield found(script.path, node, "cuda-without-index", message)
        elif isinstance(node, ast.Assign) and const_str(node.value) in _UNINDEXED:
            names = [t.id for t in node.targets if isinstance(t, ast.Name) and "device" in t.id]
            if names and not _reassigned(script, names[0], node):
                yield found(script.path, node, "cuda-without-index", message)


def _reassigned(script: Script, name: str, first: ast.Assign) -> bool:
    """``device = "cuda"`` as a default that a later ``device = f"cuda:{local_rank}"`` replaces."""
    for node in ast.walk(script.tree):
        if isinstance(node, ast.Assign) and node is not first:
            if any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return True
    return False


def _untimed(script: Script) -> Iterator[Finding]:
    if not script.uses_cuda:
        return
    for scope in [script.tree, *(n for n in ast.walk(script.tree) if isinstance(n, ast.FunctionDef))]:
        if any(_syncs(n) or _timing_event(n) for n in walk_local(scope)):
            continue
        for node in walk_local(scope):
            for field in ("body", "orelse", "finalbody"):
                block = getattr(node, field, None)
                if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                    yield from _timed_regions(script, block)


def _timed_regions(script: Script, block: list[ast.stmt]) -> Iterator[Finding]:
    """``t0 = time.time()``, CUDA work, ``time.time() - t0``: as statements of one block."""
    for i, start in enumerate(block):
        if not (isinstance(start, ast.Assign) and _is_clock(script, start.value)):
            continue
        names = {t.id for t in start.targets if isinstance(t, ast.Name)}
        ends: set[str] = set()  # `t1 = time.time()`, then `t1 - t0`
        for j in range(i + 1, len(block)):
            if isinstance(block[j], ast.Assign) and _is_clock(script, block[j].value):
                ends |= {t.id for t in block[j].targets if isinstance(t, ast.Name)}
            if not any(_is_difference(script, n, names, ends) for n in walk_local(block[j])):
                continue
            region = [n for stmt in block[i + 1 : j + 1] for n in walk_local(stmt)]
            if any(_cuda_work(script, n) for n in region) and not any(_syncs(n) for n in region):
                yield found(
                    script.path,
                    block[j],
                    "untimed-cuda-sync",
                    "this time difference measures when the CUDA work was queued, not when it ran (CUDA is "
                    "asynchronous); call torch.cuda.synchronize() before reading the clock, or time with "
                    "torch.cuda.Event(enable_timing=True)",
                )
            break


def _is_clock(script: Script, expr: ast.AST) -> bool:
    return isinstance(expr, ast.Call) and script.qualname(expr) in _CLOCKS


def _is_difference(script: Script, node: ast.AST, starts: set[str], ends: set[str]) -> bool:
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub)):
        return False
    if not (isinstance(node.right, ast.Name) and node.right.id in starts):
        return False
    return _is_clock(script, node.left) or (isinstance(node.left, ast.Name) and node.left.id in ends)


def _cuda_work(script: Script, node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    name = last_name(node)
    if name == "backward" or "model" in (name or "").lower():
        return True
    return name == "step" and isinstance(node.func, ast.Attribute) and script.is_optimizer(node.func.value)


def _syncs(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and last_name(node) in _SYNCS


def _timing_event(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and last_name(node) == "Event" and keyword(node, "enable_timing") is not None
