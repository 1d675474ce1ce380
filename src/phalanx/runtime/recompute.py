"""Activation checkpointing: chosen blocks keep only their inputs and recompute their activations
during backward, trading compute for memory. Applied from outside, to any strategy's model.

A chosen block's class gets one more base, :class:`Recomputed`, in place (as ``fully_shard`` does
with ``FSDPModule``), under the same name; its forward checkpoints the class's own forward on the
module it is called on. A ``forward`` set on the instance instead would stay bound to that one
module: ``nn.DataParallel`` copies a module's ``__dict__`` into each replica, and every replica
then ran the original's forward, with the first GPU's weights on another GPU's inputs. Module and
parameter names, state-dict keys and ``type(block).__name__`` stay the user's.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from phalanx.util.modules import submodules_of


def apply_activation_checkpointing(
    model: nn.Module, class_names: list[str], setting: str = "strategy.activation_checkpointing"
) -> int:
    """Recompute the forward of every submodule whose class name is listed; returns how many.
    ``setting`` names where the list came from, for the error message."""
    if not class_names:
        return 0
    found = submodules_of(model, class_names, setting)
    for module in found:
        if isinstance(module, Recomputed):
            continue  # set up twice (a model given to setup() again)
        if "forward" in vars(module):
            # Someone's forward on the instance would hide the class's: it is wrapped where it is.
            module.forward = _checkpointed(module.forward)
        else:
            module.__class__ = recomputed_class(type(module))
    return len(found)


class Recomputed(nn.Module):
    """The extra base of a checkpointed block's class."""

    _phalanx_base: type  # the user's class

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickled (torch.save(model)) as the user's class: it loads without phalanx and runs as
        # written; checkpointing is a setting of the run, applied again at its setup().
        return _plain, (self._phalanx_base,), self.__getstate__()

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        # A copy in this process (an EMA copy) keeps checkpointing, as the other setups' wrappers do.
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        clone.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return clone


@functools.lru_cache(maxsize=None)
def recomputed_class(base: type) -> type:
    """``base`` with Recomputed first in its MRO, under the same name, its forward checkpointed."""

    @functools.wraps(base.forward)  # inspect.signature(block.forward) stays the user's
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # Non-reentrant checkpointing works with keyword arguments, DDP and FSDP.
        return checkpoint(base.forward.__get__(self), *args, use_reentrant=False, **kwargs)

    namespace = {"__module__": __name__, "_phalanx_base": base, "forward": forward}
    return type(base)(base.__name__, (Recomputed, base), namespace)


def _plain(base: type) -> nn.Module:
    return base.__new__(base)


def _checkpointed(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
