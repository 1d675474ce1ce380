"""Guards against the usual porting mistakes of a one-GPU loop: a stray ``optimizer.step()`` or
``optimizer.zero_grad()`` that would step twice or drop the gradients of earlier micro-steps.
phalanx steps and zeroes itself at the end of each global batch (schedulers: schedulers.py)."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from phalanx.errors import PhalanxError


class PortingGuards:
    """``micro_steps_before``: micro-steps of the current global batch that came before the one
    running now (their gradients are what a zero_grad would drop); ``short_form``: the window is one
    of ``session.backward(loss)`` calls without the ``accumulate()`` block."""

    def __init__(self, micro_steps_before: Callable[[], int], short_form: Callable[[], bool]):
        self.micro_steps_before = micro_steps_before
        self.short_form = short_form
        self.in_step = False  # True while phalanx itself steps (or torch's checkpoint helpers do)

    def guard_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.register_step_pre_hook(self._refuse_stray_step)
        user_zero_grad = optimizer.zero_grad

        def zero_grad(set_to_none: bool = True) -> None:
            # Harmless at a global-batch boundary (gradients are already cleared); fatal when it
            # would drop the gradients of earlier micro-steps of this global batch.
            if not self.in_step and self.micro_steps_before() > 0:
                if self.short_form():
                    # A one-GPU loop's zero_grad() before each batch: under the short form each of its
                    # iterations is a micro-step, and the gradients are phalanx's until the window steps.
                    return
                raise PhalanxError(
                    "optimizer.zero_grad() was called in the middle of an accumulation window and would drop "
                    "gradients; remove it: phalanx zeroes gradients after each optimizer step"
                )
            user_zero_grad(set_to_none=set_to_none)

        optimizer.zero_grad = zero_grad

    def _refuse_stray_step(self, optimizer, args, kwargs) -> None:
        if not self.in_step:
            raise PhalanxError(
                "optimizer.step() was called directly; remove it: phalanx steps the optimizer at the end of "
                "`with session.accumulate(model):`, or call session.step() in its place"
            )

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """phalanx's own optimizer step, or torch's checkpoint helpers, which may call
        optimizer.step() once with zero lr to create the optimizer state they fill."""
        previous, self.in_step = self.in_step, True
        try:
            yield
        finally:
            self.in_step = previous
