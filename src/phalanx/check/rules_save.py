"""unguarded-torch-save: ``torch.save`` run by every process of a group, all writing the same file
(at best N times the I/O, at worst a torn file that a resume reads)."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from phalanx.check.catalog import found
from phalanx.check.findings import Finding
from phalanx.check.ranks import Ranks
from phalanx.check.script import Script, keyword, last_name


def check(script: Script, ranks: Ranks) -> Iterator[Finding]:
    if not script.data_parallel:
        return
    for call in script.calls:
        if script.qualname(call) != "torch.save" or ranks.guarded(call) or ranks.unused(call):
            continue
        path = call.args[1] if len(call.args) > 1 else keyword(call, "f")
        if path is not None and any(ranks.valued(n) for n in ast.walk(path)):
            continue  # a file per rank (f"shard-{rank}.pt"): each writes its own
        if path is not None and _in_memory(script, path):
            continue  # torch.save(obj, io.BytesIO()): serialised in memory, no file written
        yield found(
            script.path,
            call,
            "unguarded-torch-save",
            "torch.save() runs on every rank, and every rank writes the same file; save on one rank "
            "(`if rank == 0:`, or `if session.is_main:`), or call session.save() on every rank",
        )


def _in_memory(script: Script, path: ast.expr) -> bool:
    if isinstance(path, ast.Call):
        return last_name(path) == "BytesIO"
    if isinstance(path, ast.Name):
        return any(
            isinstance(n, ast.Assign)
            and isinstance(n.value, ast.Call)
            and last_name(n.value) == "BytesIO"
            and any(isinstance(t, ast.Name) and t.id == path.id for t in n.targets)
            for n in ast.walk(script.tree)
        )
    return False
