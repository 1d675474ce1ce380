"""A model's own initialisation under deferred construction: what initialises each module when
construction.py materialises it, and which parameters each of those initialisers writes.

Three conventions, applied per module in this order (each module under its own seed, see
construction.py):

1. The module's own ``reset_parameters()`` (torch's), when the module's tensors were just given
   memory: what its ``__init__`` would have run in an eager build.
2. Hugging Face's: the nearest module, this one or an ancestor, that has a callable
   ``_init_weights(module)`` and a ``config`` (a ``PreTrainedModel``; duck-typed, as phalanx never
   imports transformers) applies it to the module, children before parents. That is what
   ``post_init()`` does in an eager build (``initialize_weights``: ``_init_weights`` over every
   module, a nested model dispatching its own, as transformers' ``smart_apply`` does), after the
   torch defaults of step 1; under ``init_module()`` it ran on meta tensors and did nothing.
3. The model's ``init_weights()`` taking no argument (torchtitan's convention), on a model that
   is not a Hugging Face one: once, over the whole model, after 1 and 2 for every module. Only
   where the whole model is materialised on each rank; construction.py refuses it elsewhere.

Under 2 and 3 a module need not have a ``reset_parameters()``: what counts is whether its tensors
were written (construction.py fills them with NaN first and looks), not which method it has.
"""

from __future__ import annotations

import functools
import inspect
from collections import defaultdict
from typing import Callable

import torch
from torch import nn

from phalanx._torch_compat import module_initializer, tensor_version
from phalanx.util.modules import post_order

Step = Callable[[], object]


def _takes(fn: Callable, *args: object) -> bool:
    try:
        inspect.signature(fn).bind(*args)
    except (TypeError, ValueError):
        return False
    return True


def per_module_init(module: nn.Module) -> Callable[[nn.Module], object] | None:
    """``module``'s Hugging Face per-module initialiser (``_init_weights``, bound), when ``module``
    looks like a ``PreTrainedModel``: the method is callable with one module and there is a config."""
    fn = getattr(module, "_init_weights", None)
    if callable(fn) and getattr(module, "config", None) is not None and _takes(fn, module):
        return fn
    return None


class ModelInit:
    """The initialisers of one model's modules (the conventions in the module docstring)."""

    def __init__(self, root: nn.Module):
        self.root = root
        self._owner: dict[int, Callable[[nn.Module], object]] = {}
        self._find_owners(root, None)
        whole = getattr(root, "init_weights", None)
        # A Hugging Face model has an init_weights() too; its _init_weights wins (it is what
        # init_weights applies, per module).
        self.whole: Step | None = whole if callable(whole) and id(root) not in self._owner and _takes(whole) else None

    def _find_owners(self, module: nn.Module, inherited: Callable[[nn.Module], object] | None) -> None:
        owner = per_module_init(module) or inherited
        if owner is not None:
            self._owner[id(module)] = owner
        for child in module.children():
            self._find_owners(child, owner)

    def steps(self, module: nn.Module, *, own_fresh: bool) -> list[Step]:
        """What initialises ``module``, in order; ``own_fresh``: its own tensors were just given memory
        (the torch default runs only then: a module holding only a weight tied to one initialised
        already would overwrite it with a default it never had in an eager build)."""
        found: list[Step] = []
        reset = module_initializer(module) if own_fresh else None
        if reset is not None:
            found.append(reset)
        owner = self._owner.get(id(module))
        if owner is not None:
            found.append(functools.partial(owner, module))
        return found

    def checks_values(self, module: nn.Module) -> bool:
        """Whether ``module``'s tensors count as initialised when written (a model-level convention
        covers it), rather than when the module has a ``reset_parameters()``."""
        return self.whole is not None or id(module) in self._owner

    def label(self) -> str:
        """The model-level initialiser, as messages name it."""
        return f"{type(self.root).__name__}.init_weights()"


def init_writes(model: nn.Module) -> dict[int, set[int]]:
    """For each parameter of the deferred ``model`` (by id), the modules (by id) whose initialisers
    (:meth:`ModelInit.steps`, as materialisation runs them) write it. Found by running them on meta
    stand-ins of every tensor that exists, so nothing real is written and no number drawn; an
    initialiser that fails there is taken to write its own parameters."""
    inits = ModelInit(model)
    modules = list({id(m): m for m in post_order(model)}.values())
    fresh = {id(m) for m in modules if any(t.is_meta for t in _own(m))}
    restore = _stand_ins(modules)
    original = {id(now): was for module, name, was, now in restore if isinstance(was, nn.Parameter)}
    writes: dict[int, set[int]] = defaultdict(set)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            for module in modules:
                steps = inits.steps(module, own_fresh=id(module) in fresh)
                if steps:
                    for param in _written(module, steps):
                        writes[id(original.get(id(param), param))].add(id(module))
    finally:
        for module, name, was, _ in restore:
            setattr(module, name, was)
    return dict(writes)


def _own(module: nn.Module) -> list[torch.Tensor]:
    return [t for _, t in _named_own(module)]


def _named_own(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    params = module.named_parameters(recurse=False, remove_duplicate=False)
    return [*params, *module.named_buffers(recurse=False, remove_duplicate=False)]


def _stand_ins(modules: list[nn.Module]) -> list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]]:
    """Put a meta tensor in place of every tensor that exists (one per tensor, so ties stay ties);
    returns (module, name, original, stand-in) to put the originals back."""
    made: dict[int, torch.Tensor] = {}
    swapped = []
    for module in modules:
        for name, tensor in _named_own(module):
            if tensor.is_meta:
                continue
            stand_in = made.get(id(tensor))
            if stand_in is None:
                stand_in = torch.empty_like(tensor, device="meta")
                if isinstance(tensor, nn.Parameter):
                    stand_in = nn.Parameter(stand_in, requires_grad=tensor.requires_grad)
                made[id(tensor)] = stand_in
            swapped.append((module, name, tensor, stand_in))
            setattr(module, name, stand_in)
    return swapped


def _written(module: nn.Module, steps: list[Step]) -> list[nn.Parameter]:
    """The parameters of ``module``'s subtree that ``steps`` write (all on meta)."""
    params = list(module.parameters())
    before = [tensor_version(p) for p in params]
    if any(v is None for v in before):
        return list(module.parameters(recurse=False))
    try:
        for step in steps:
            step()
    except Exception:  # user code on meta tensors (an .item(), a CPU-only kernel): assume the usual
        return list(module.parameters(recurse=False))
    return [p for p, v in zip(params, before) if tensor_version(p) != v]
