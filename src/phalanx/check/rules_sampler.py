"""set-epoch-missing: a shuffling DistributedSampler that is never told the epoch deals the same
order every epoch; shuffled-eval-loader: an evaluation loader that shuffles."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from phalanx.check.catalog import found
from phalanx.check.findings import Finding
from phalanx.check.ranks import Ranks
from phalanx.check.script import Script, keyword, last_name

_EVAL = re.compile(r"^(val|valid|validation|eval|evaluation|test|dev)(loader|sampler|dl|data|dataset|set|ds)?$")


def check(script: Script, ranks: Ranks) -> Iterator[Finding]:
    # Any mention counts, not only a call: a script may hand `sampler.set_epoch` to the code that loops.
    sets_epoch = any(isinstance(n, ast.Attribute) and n.attr == "set_epoch" for n in ast.walk(script.tree))
    for call in script.calls:
        name = last_name(call)
        if name == "DistributedSampler" and _shuffles(call, default=True):
            bound = _bound_name(script, call)
            if bound is not None and _evaluation(bound):
                yield _shuffled_eval(script, call, bound)
            elif bound is not None and not sets_epoch and not script.uses_phalanx:
                # phalanx's session.epochs() tells the sampler that replaces a DistributedSampler its epoch.
                yield found(
                    script.path,
                    call,
                    "set-epoch-missing",
                    "this DistributedSampler shuffles, but nothing in the file calls set_epoch(): it deals the same "
                    "order every epoch; call sampler.set_epoch(epoch) at the start of each epoch",
                )
        elif name == "DataLoader" and _shuffles(call, default=False):
            bound = _bound_name(script, call)
            if bound is not None and _evaluation(bound):
                yield _shuffled_eval(script, call, bound)


def _shuffles(call: ast.Call, *, default: bool) -> bool:
    """Shuffling for certain: ``shuffle=True``, or left at a default that shuffles."""
    value = keyword(call, "shuffle")
    if value is None and last_name(call) == "DistributedSampler" and len(call.args) >= 4:
        value = call.args[3]
    if value is None:
        return default
    return isinstance(value, ast.Constant) and value.value is True


def _bound_name(script: Script, call: ast.Call) -> str | None:
    """The name the sampler or loader is bound to, or the loader's it is passed into (``sampler=``)."""
    parent = script.parents.get(call)
    if isinstance(parent, ast.keyword) and parent.arg == "sampler":
        parent = script.parents.get(script.parents[parent])
        while isinstance(parent, ast.Call):
            parent = script.parents.get(parent)
    if isinstance(parent, ast.Return):
        function = parent
        while function in script.parents and not isinstance(function, ast.FunctionDef):
            function = script.parents[function]
        return getattr(function, "name", None)
    if isinstance(parent, (ast.Assign, ast.AnnAssign)):
        targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
        return last_name(targets[0])
    return None


def _evaluation(name: str) -> bool:
    words = re.split(r"_|(?<=[a-z])(?=[A-Z])", name)
    return any(_EVAL.match(w.lower()) for w in words)


def _shuffled_eval(script: Script, call: ast.Call, bound: str) -> Finding:
    return found(
        script.path,
        call,
        "shuffled-eval-loader",
        f"{bound} looks like an evaluation loader, and it shuffles: evaluation needs no shuffling, and a fixed "
        "order makes runs comparable; pass shuffle=False",
    )
