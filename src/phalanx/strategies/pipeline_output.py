"""The pipeline's stand-in for a model output that exists only on the last stage.

``model(x)`` under the pipeline strategy returns a :class:`DeferredOutput`. The user's loss code
(``loss_fn(model(x), y)``, also ``out.view(-1, V)`` first) is recorded, not run; the pipeline
schedule replays it on each micro-batch's real output on the last stage during
``session.backward(loss)``, and the loss's value is filled in afterwards for logging.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from phalanx._torch_compat import make_subclass
from phalanx.errors import PhalanxError


class DeferredOutput(torch.Tensor):
    @staticmethod
    def __new__(cls, inputs: tuple, chain: tuple = ()):
        out = make_subclass(cls, torch.empty(0, device="meta"))
        out.inputs = inputs  # the model's arguments: stage 0 feeds them to the pipeline
        out.chain = chain  # ((func, args after the first, kwargs), ...)
        out.value = None  # the loss, once session.backward() has run the pipeline
        return out

    @classmethod
    def __torch_function__(cls, func: Callable, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if isinstance(first, DeferredOutput) and first.value is not None:
            return func(first.value, *args[1:], **kwargs)  # after backward: the real loss
        if isinstance(first, DeferredOutput) and not _is_accessor(func):
            return DeferredOutput(first.inputs, first.chain + ((func, args[1:], kwargs),))
        raise PhalanxError(
            "with strategy pipeline the model's output exists only on the last stage, inside session.backward(); "
            f"compute the loss straight from it, as loss_fn(model(x), y) (got {getattr(func, '__name__', func)})"
        )

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        return f"DeferredOutput({'value=' + str(self.value.item()) if self.value is not None else 'pending'})"

    def target(self, batch: int) -> torch.Tensor | None:
        """The tensor of the loss code that holds one entry per sample (or a fixed number of them,
        as ``y.view(-1)`` does for tokens): the target, cut into pipeline micro-batches with the
        output. One with exactly ``batch`` rows wins over multiples; two of a kind are ambiguous."""
        found: dict[int, torch.Tensor] = {}
        for _, args, kwargs in self.chain:
            for arg in (*args, *kwargs.values()):
                if isinstance(arg, torch.Tensor) and arg.dim() and arg.shape[0] >= batch and arg.shape[0] % batch == 0:
                    found[id(arg)] = arg
        for candidates in ([t for t in found.values() if t.shape[0] == batch], list(found.values())):
            if len(candidates) == 1:
                return candidates[0]
            if len(candidates) > 1:
                raise PhalanxError(
                    "strategy pipeline: the loss code uses several tensors with one row per sample; "
                    "it can take the model's output and one target"
                )
        return None

    def replay(
        self, output: torch.Tensor, target: torch.Tensor | None, target_chunk: torch.Tensor | None
    ) -> torch.Tensor:
        """Run the recorded loss code on one micro-batch: ``output`` for the model's output, the
        target's chunk for the target."""
        value = output
        for func, args, kwargs in self.chain:
            swap = lambda a: target_chunk if a is target else a  # noqa: E731
            value = func(value, *map(swap, args), **{k: swap(v) for k, v in kwargs.items()})
        return value


def _is_accessor(func: Callable) -> bool:
    # Properties (shape, dtype, device) and printing would need the real tensor.
    return getattr(func, "__name__", "") in _ACCESSORS


# Reading the output (its size, its values) needs the real tensor, which only the last stage has.
_ACCESSORS = frozenset(
    (
        "__get__",
        "__format__",
        "__bool__",
        "__len__",
        "__iter__",
        "__getitem__",
        "item",
        "tolist",
        "numpy",
        "size",
        "dim",
        "numel",
        "argmax",
        "argmin",
        "eq",
        "__eq__",
        "__ne__",
        "ne",
        "cpu",
        "to",
    )
)
