"""The model ``setup()`` returns keeps the user's model's surface.

Strategies that wrap the user's module (``DistributedDataParallel``, ``DataParallel``, the
pipeline's stage runner) return an object whose own attributes are the wrapper's: the user's
``model.init_hidden(bsz)`` or ``model.encoder`` would be an AttributeError, and ``state_dict()``
would carry a ``module.`` prefix. :func:`expose` gives that object's class one more base,
:class:`ModelSurface`, in place (as ``fully_shard`` does with ``FSDPModule``), rather than putting
a second wrapper around it: the object stays the one the strategy built, so its forward (DDP's,
which prepares the gradient all-reduce), ``no_sync``, in-place ``compile``, the unused-parameter
watch and every check on its type keep working. Strategies whose returned model is the user's own
module (single, fsdp, model_parallel) need nothing.

What the wrapper itself does not have is looked up on the user's module; an attribute set on it
goes to the user's module unless the wrapper has it; ``state_dict()`` and ``load_state_dict()``
are the user's module's. A method of the user's module reached this way runs on the user's
module, outside the wrapper (only ``forward`` goes through it, as in Lightning Fabric). Where that
would silently go wrong (DDP: gradients that skip the all-reduce; pipeline: layers this process
does not train), the strategy's ``direct_calls`` capability makes such a method refuse to run the
model's layers, in one line naming the fix.
"""

from __future__ import annotations

import copy
import functools
import inspect
from typing import Any, Callable

import torch
from torch import nn

from phalanx.errors import PhalanxError

_USER = "_phalanx_user_module"  # instance-dict keys, so lookups of them never recurse
_RULE = "_phalanx_direct_calls"

# direct_calls capability -> for a layer of the user's module that runs outside the wrapper now:
# why that is wrong and the fix, or None. The check runs as each layer starts, so the autograd
# mode is the one that layer runs under.
_RULES: dict[str, Callable[[nn.Module], tuple[str, str] | None]] = {
    "any": lambda module: None,
    "no_grad": lambda module: (
        (
            "its gradients would skip the strategy's all-reduce and the processes' weights would drift apart",
            "compute the training forward with model(...) (only forward goes through the strategy), "
            "or call the method under torch.no_grad() if it needs no gradients",
        )
        if torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters(recurse=False))
        else None
    ),
    "none": lambda module: (
        "each process holds and trains only its own stage's layers",
        "compute it with model(...), which runs the stages in turn",
    ),
}


class ModelSurface(nn.Module):
    """The extra base of a strategy's wrapper: the user's module's attributes, methods and state dict."""

    # The class this surface was made from (None for classes that subclass ModelSurface themselves).
    _phalanx_base: type | None = None

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # the wrapper's parameters, buffers and submodules
        except AttributeError:
            user = self.__dict__.get(_USER)
            if user is None or (name.startswith("__") and name.endswith("__")):
                raise
        value = getattr(user, name)
        rule = self.__dict__.get(_RULE)
        if rule is not None and inspect.ismethod(value) and value.__self__ is user:
            return _watched(value, user, name, rule)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        user = self.__dict__.get(_USER)
        # A private name neither has is the wrapper's own (torch sets some lazily, after construction).
        if user is None or _wrapper_has(self, name) or (name.startswith("_") and not hasattr(user, name)):
            super().__setattr__(name, value)
        else:
            setattr(user, name, value)

    def __delattr__(self, name: str) -> None:
        user = self.__dict__.get(_USER)
        if user is not None and not _wrapper_has(self, name) and hasattr(user, name):
            delattr(user, name)
        else:
            super().__delattr__(name)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The user's module's state dict: its own keys, no wrapper prefix."""
        return self.__dict__[_USER].state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.__dict__[_USER].load_state_dict(state_dict, strict=strict, assign=assign)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickling (torch.save(model, f)). A wrapper that works with the run's other processes (DDP's
        # process group and all-reduce hooks, a pipeline stage) cannot be loaded without them, so it
        # is refused with the two saves that do load; others pickle, and their class, made at run
        # time, is rebuilt from its base.
        if self.__dict__.get(_RULE) is not None:
            raise PhalanxError(
                f"torch.save(model) cannot pickle the {type(self).__name__} that setup() returned: it works only "
                "together with this run's other processes; save the bare model with "
                "torch.save(session.unwrap(model), f), or its weights with torch.save(session.model_state_dict(), f)"
            )
        base = self._phalanx_base
        if base is None:
            return super().__reduce_ex__(protocol)
        return _rebuild, (base,), self.__getstate__()

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        # copy.deepcopy (an EMA copy) works for every wrapper, in this process: what pickle would do,
        # without the refusal above.
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        clone.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return clone


def expose(wrapped: nn.Module, user: nn.Module, direct_calls: str = "any") -> nn.Module:
    """Make ``wrapped`` (what the strategy returned for the user's module ``user``) show ``user``'s
    surface, in place; returns it. ``direct_calls``: the strategy's capability of that name."""
    if wrapped is user:
        return wrapped  # the strategy returned the user's own module (in place, as fsdp does)
    if not isinstance(wrapped, ModelSurface):
        wrapped.__class__ = surface_class(type(wrapped))
    vars(wrapped)[_USER] = user
    vars(wrapped)[_RULE] = None if direct_calls == "any" else _RULES[direct_calls]
    return wrapped


@functools.lru_cache(maxsize=None)
def surface_class(base: type) -> type:
    """``base`` with ModelSurface first in its MRO, under the same name (what type(model).__name__ shows)."""
    return type(base)(base.__name__, (ModelSurface, base), {"__module__": __name__, "_phalanx_base": base})


def _rebuild(base: type) -> nn.Module:
    cls = surface_class(base)
    return cls.__new__(cls)


def _wrapper_has(module: nn.Module, name: str) -> bool:
    found = vars(module)
    return (
        name in found
        or name in found.get("_parameters", ())
        or name in found.get("_buffers", ())
        or name in found.get("_modules", ())
        or hasattr(type(module), name)
    )


def _watched(method: Callable, user: nn.Module, name: str, rule: Callable[[nn.Module], Any]) -> Callable:
    """``method`` of the user's module, refusing to run any of its layers where ``rule`` says why not."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        def check(module: nn.Module, _args: Any) -> None:
            problem = rule(module)
            if problem:
                why, fix = problem
                raise PhalanxError(
                    f"model.{name}() runs the model's layers itself, outside the strategy's wrapper, where {why}; {fix}"
                )

        handles = [module.register_forward_pre_hook(check) for module in user.modules()]
        try:
            return method(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()

    return call
