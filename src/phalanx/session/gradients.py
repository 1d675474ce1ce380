"""Loops without an optimizer: the script updates the parameters itself (``p.add_(p.grad,
alpha=-lr)``), as the classic word-language-model example does, after ``session.backward(loss)``
on the micro-step where ``session.sync_gradients`` is True, inside the ``accumulate`` block.

The Session then does for the gradients what it does after an optimizer step: at the end of that
block it zeroes the models' gradients and counts the step (so the next global batch starts from
none, ``session.step_count`` and checkpoints advance, and a saved checkpoint holds the updated
weights). ``optim.max_grad_norm`` clips right after that backward, before the script's update
reads the gradients. What cannot work is refused in one line: fp16 (the loss is scaled, and only
an optimizer's gradients can be unscaled). The guard against gradients cleared in the middle of a
window (a one-GPU loop's ``model.zero_grad()`` at the top of each batch) holds with or without
an optimizer: it would drop the earlier micro-steps' gradients.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from phalanx.config.schema import Config
from phalanx.errors import PhalanxError


class GradientKeeping:
    """The gradients of the set-up models across micro-steps, and what stands in for an optimizer."""

    def __init__(self, config: Config, models: list[nn.Module], optimizers: list, print_main: Callable[..., None]):
        self.config = config
        self.models = models  # the Session's own lists: set-up calls later extend them
        self.optimizers = optimizers
        self.print_main = print_main
        self.held: list[bool] | None = None  # per model, after a backward that did not end the window
        self.noted = False

    @property
    def manual(self) -> bool:
        """No optimizer is set up: the script updates the parameters itself."""
        return bool(self.models) and not self.optimizers

    def before_backward(self, scaled: bool, later_micro_step: bool) -> None:
        """``scaled``: fp16 loss scaling is on; ``later_micro_step``: a micro-step after the first of its window."""
        if scaled and self.manual:
            raise PhalanxError(
                "precision.mode fp16 scales the loss, and without an optimizer set up phalanx cannot unscale the "
                "gradients your update reads; set precision.mode bf16 or fp32, or build an optimizer "
                "(e.g. torch.optim.SGD(model.parameters(), lr=lr)) and pass it to session.setup()"
            )
        if later_micro_step and self.held:
            for model, had in zip(self.models, self.held):
                if had and not _has_gradients(model):
                    raise PhalanxError(
                        "the model's gradients were cleared in the middle of an accumulation window (a "
                        "model.zero_grad() before each batch?), which drops the earlier micro-steps' gradients; "
                        "remove it: phalanx zeroes gradients once per global batch, after the step"
                    )
        self.held = None

    def after_backward(self, window_ends: bool, clip: Callable[[float, nn.Module], object]) -> None:
        if not window_ends:
            self.held = [_has_gradients(model) for model in self.models]
        elif self.config.optim.max_grad_norm is not None and self.manual:
            for model in self.models:  # before the script's update reads them
                clip(self.config.optim.max_grad_norm, model)

    def clips_at_step(self) -> bool:
        """Whether optim.max_grad_norm clips at the step (with an optimizer) rather than after backward."""
        return not self.manual

    def after_step(self) -> None:
        """Where an optimizer's zero_grad would run: the script's update has read the gradients."""
        self.held = None
        if not self.manual:
            return
        for model in self.models:
            model.zero_grad(set_to_none=True)
        optim = self.config.optim
        if not self.noted and (optim.lr_scaling != "none" or optim.warmup_steps):
            self.noted = True
            self.print_main(
                "phalanx: no optimizer is set up, so optim.lr_scaling and optim.warmup_steps reach your update only "
                "through session.lr_multiplier; multiply your learning rate by it"
            )


def _has_gradients(model: nn.Module) -> bool:
    return any(p.grad is not None for p in model.parameters())
