"""rank-guarded-collective: a collective, or a call that synchronises every rank, that only some
ranks reach. The others never arrive and the run hangs until the NCCL watchdog's timeout."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from phalanx.check.catalog import found
from phalanx.check.findings import Finding
from phalanx.check.ranks import Guard, Ranks
from phalanx.check.script import Script

_DIST = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast", "reduce",
         "broadcast_object_list", "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list",
         "gather", "gather_object", "barrier", "monitored_barrier", "all_to_all", "all_to_all_single"}  # fmt: skip
_CHECKPOINT = {"save", "load", "async_save", "save_state_dict", "load_state_dict"}
# Methods that every rank must call, by the library of their object (session.model_state_dict
# gathers the shards of fsdp; session.save writes one checkpoint from all ranks).
_METHODS = {
    "phalanx": {"save", "load", "reduce", "gather_for_metrics", "barrier", "model_state_dict"},
    "accelerate": {"wait_for_everyone", "gather", "gather_for_metrics", "reduce", "pad_across_processes"},
    "fabric": {"barrier", "all_reduce", "all_gather", "broadcast", "save", "load"},
}


def collective(script: Script, call: ast.Call) -> str | None:
    """The call's name as written where every rank must make it, else None."""
    name = script.qualname(call) or ""
    module, _, function = name.rpartition(".")
    written = ast.unparse(call.func)
    if module == "torch.distributed" and function in _DIST:
        return written
    if module.startswith("torch.distributed.checkpoint") and function in _CHECKPOINT:
        return written
    if isinstance(call.func, ast.Attribute):
        kind = script.kind(call.func.value)
        if kind and call.func.attr in _METHODS[kind]:
            return written
    return None


def check(script: Script, ranks: Ranks) -> Iterator[Finding]:
    for call, guard in ranks.guards.items():
        name, inner = _synchronising(script, ranks, call)
        if name is None or name in _other_branch(script, ranks, guard) or _paired(script, ranks, call, guard, name):
            continue
        where = f"`{ast.unparse(guard.node.test)}`" if guard.node is not None else "the rank condition of an early exit"
        via = f" (it calls {name}() at line {inner.lineno})" if inner is not call else ""
        first = ast.unparse(call.func) if inner is not call else name
        yield found(
            script.path,
            call,
            "rank-guarded-collective",
            f"{first}(){via} runs only on the ranks where {where} holds; every rank must make this call or the "
            "others wait for it until the NCCL timeout (a hang); call it on every rank, outside the condition",
        )


def _synchronising(script: Script, ranks: Ranks, call: ast.Call) -> tuple[str | None, ast.Call]:
    name = collective(script, call)
    if name is not None:
        return name, call
    for function in ranks.callees(call):
        for inner in ranks.reached(function):
            # A collective guarded inside the function is a finding of its own, at its line.
            if inner not in ranks.guards and (name := collective(script, inner)) is not None:
                return name, inner
    return None, call


def _paired(script: Script, ranks: Ranks, call: ast.Call, guard: Guard, name: str) -> bool:
    """The same collective under another rank condition of the same function: the "rank 0 first"
    pair (``if local_rank not in [-1, 0]: barrier()`` ... ``if local_rank == 0: barrier()``), in
    which every rank makes the call once."""
    if guard.node is None:
        return False
    test = ast.unparse(guard.node.test)
    for other, other_guard in ranks.guards.items():
        if other is call or ranks.scope.get(other) is not ranks.scope.get(call) or other_guard.node is None:
            continue
        if ast.unparse(other_guard.node.test) != test and collective(script, other) == name:
            return True
    return False


def _other_branch(script: Script, ranks: Ranks, guard: Guard) -> set[str]:
    """The collectives of the other branch: ``if rank == 0: broadcast(x) else: broadcast(y)`` matches."""
    if guard.node is None:
        return set()
    other = guard.node.body if guard.orelse else guard.node.orelse
    names = set()
    for stmt in other:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call):
                names.add(_synchronising(script, ranks, node)[0])
    return names - {None}
