"""Which modules strategy fsdp shards together, one ``fully_shard`` call per group, innermost first.

A group manages the parameters of its modules' subtrees that no group inside claimed, and FSDP
shards each parameter in one group only. So a group must hold every use of its parameters:

- a tied weight (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) is held by modules
  in different places; the group of the first holder takes the others in with it
  (``fully_shard([wte, lm_head])``, as torch advises for shared parameters);
- under deferred construction a parameter is also written by every initialiser that reaches it
  (GPT-2's attention re-initialises its output projection), which runs when its own module is
  materialised: a group must not hold a parameter an initialiser outside it writes, since that
  one runs after the group is sharded (model_init.init_writes finds who writes what).

Where that cannot be (a weight held by a module that contains the group, a writer outside it),
automatic wrapping leaves the candidate to an enclosing one (the model itself takes the rest),
and a class listed in ``strategy.fsdp.wrap`` is refused in one line.
"""

from __future__ import annotations

from torch import nn

from phalanx.errors import ConfigError
from phalanx.strategies.construction import is_deferred
from phalanx.strategies.model_init import init_writes
from phalanx.util.modules import parameter_holders, post_order, submodules_of


class _Tree:
    """The model's modules in post-order, each one's subtree, and their names."""

    def __init__(self, model: nn.Module):
        self.order = list({id(m): m for m in post_order(model)}.values())
        self.index = {id(m): i for i, m in enumerate(self.order)}
        self.names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        self.inside: dict[int, set[int]] = {}
        for module in self.order:  # children come first, so theirs are known
            self.inside[id(module)] = {id(module)}.union(*(self.inside[id(c)] for c in module.children()))
        self.by_id = {id(m): m for m in self.order}

    def name(self, module: nn.Module) -> str:
        return self.names.get(id(module)) or "the model"


def shard_groups(model: nn.Module, wrap: list[str], min_params: int, setting: str) -> list[list[nn.Module]]:
    """The groups, in the order to shard them (each before any group containing it): the modules
    of the ``wrap`` classes, else automatically (deepest first, a group whose not-yet-claimed
    parameters reach ``min_params``), each with the modules sharing its weights. The model itself,
    sharded last, is not among them. ``setting`` names ``wrap`` in errors."""
    tree = _Tree(model)
    grower = _Grower(tree, parameter_holders(model), init_writes(model) if is_deferred(model) else {})
    # A container without a forward of its own (nn.ModuleList, nn.ModuleDict) is never a unit:
    # fully_shard hooks the forward, and refuses such a module.
    automatic = [m for m in tree.order if m is not model and type(m).forward is not nn.Module.forward]
    candidates = submodules_of(model, wrap, setting) if wrap else automatic
    groups: list[list[nn.Module]] = []
    for module in candidates:
        if id(module) in grower.taken:  # in a group already, with a weight it shares
            continue
        grown = grower.grow(module)
        if isinstance(grown, str):
            if wrap:
                raise ConfigError(f"{setting} makes {grown}")
            continue
        group, own = grown
        if wrap or sum(p.numel() for p in own.values()) >= min_params:
            grower.accept(group, own)
            groups.append(group)
    return groups


class _Grower:
    def __init__(self, tree: _Tree, holders: dict[int, list[tuple[nn.Module, str]]], writers: dict[int, set[int]]):
        self.tree = tree
        self.holders = holders
        self.writers = writers
        self.claimed: set[int] = set()  # parameters of accepted groups
        self.taken: set[int] = set()  # modules in accepted groups' subtrees

    def grow(self, module: nn.Module) -> tuple[list[nn.Module], dict[int, nn.Parameter]] | str:
        """``module`` with the modules sharing its weights, and the parameters they would claim; or
        why it cannot be a group, as the end of a sentence starting with its setting's name."""
        group, inside = [module], set(self.tree.inside[id(module)])
        own = self._unclaimed(module, {})
        queue = list(own)
        while queue:
            pid = queue.pop()
            for holder, attr in self.holders.get(pid, ()):
                if id(holder) in inside:
                    continue
                if any(id(g) in self.tree.inside[id(holder)] for g in group):
                    return self._held(module, pid, holder, attr)
                group.append(holder)
                inside |= self.tree.inside[id(holder)]
                added = self._unclaimed(holder, own)
                own.update(added)
                queue.extend(added)
            outside = [w for w in self.writers.get(pid, ()) if w not in inside]
            if outside:
                return self._written(module, pid, self.tree.by_id[min(outside, key=self.tree.index.get)])
        group.sort(key=lambda m: self.tree.index[id(m)])
        return group, own

    def accept(self, group: list[nn.Module], own: dict[int, nn.Parameter]) -> None:
        self.claimed.update(own)
        for module in group:
            self.taken |= self.tree.inside[id(module)]

    def _unclaimed(self, module: nn.Module, known: dict[int, nn.Parameter]) -> dict[int, nn.Parameter]:
        return {id(p): p for p in module.parameters() if id(p) not in self.claimed and id(p) not in known}

    def _param(self, pid: int, unit: nn.Module) -> str:
        """The parameter's name as the unit holds it."""
        inside = self.tree.inside[id(unit)]
        module, attr = next((h for h in self.holders[pid] if id(h[0]) in inside), self.holders[pid][0])
        prefix = self.tree.names.get(id(module), "")
        return f"{prefix}.{attr}" if prefix else attr

    def _unit(self, module: nn.Module) -> str:
        return f"{self.tree.name(module)} ({type(module).__name__}) a shard unit"

    def _held(self, module: nn.Module, pid: int, holder: nn.Module, attr: str) -> str:
        where = f"{self.tree.names[id(holder)]}.{attr}" if self.tree.names.get(id(holder)) else attr
        owner = f"{self.tree.name(holder)} ({type(holder).__name__})"
        return (
            f"{self._unit(module)}, but its {self._param(pid, module)} is also {where}, held by {owner}, "
            "which contains the unit, and FSDP shards a tied weight in one unit only; "
            f"take {type(module).__name__} out of the list, or list a class that holds every use of the weight"
        )

    def _written(self, module: nn.Module, pid: int, writer: nn.Module) -> str:
        return (
            f"{self._unit(module)}, but its {self._param(pid, module)} is initialised by {self.tree.name(writer)} "
            f"({type(writer).__name__}), outside it, which under session.init_module() runs after the unit is "
            f"sharded; list {type(writer).__name__} (or a class that holds it) instead of {type(module).__name__}"
        )
