"""What the Session checks about the script's loop itself, beyond each call.

- The gradients of an accumulation window came through ``session.backward(loss)``: a
  ``loss.backward()`` left in bypasses the division by the micro-steps, and a ``session.step()``
  after each micro-batch would step on every one of them (refused at the step).
- A resumed run's loop follows phalanx's count: it reads ``session.step_count``, keeps values with
  ``session.keep()``, stops at ``train.max_steps``, runs ``session.epochs()`` or a training
  loader's pass (which goes on from the checkpoint's position). A loop that does none of these
  counts its own steps from 0 again, trains the steps done before the stop a second time and
  schedules its own LR from the wrong step: one warning at its first step.
- The loss is a mean, as phalanx's averaging over micro-steps and processes assumes: a loss whose
  last operation is a sum over the batch (``output.sum()``) trains with 1/(processes x micro-steps)
  of the gradient one process computes on the whole global batch. One line at the first backward.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from phalanx.errors import PhalanxError
from phalanx.session.state import TrainState


class LoopChecks:
    def __init__(self, state: TrainState, print_main: Callable[..., None], *, limited: bool):
        self.state = state
        self.print_main = print_main
        self.counted = limited  # train.max_steps ends the loop at phalanx's count
        # Where the loop's data stands comes back with a resume: a training loader phalanx set up
        # goes on from the checkpoint's position; a count or kept values the loop starts from.
        self.positioned = False
        self.backwards = 0  # session.backward() calls in the current window
        self.loss_checked = False

    def follows_count(self) -> None:
        self.counted = True

    def follows_position(self) -> None:
        self.counted = self.positioned = True

    def backward_called(self) -> None:
        self.backwards += 1

    def window_done(self) -> None:
        self.backwards = 0

    def before_step(self, accumulation_steps: int, models: list[nn.Module]) -> None:
        if (
            accumulation_steps > 1
            and not self.backwards
            and any(p.grad is not None for m in models for p in m.parameters())
        ):
            raise PhalanxError(
                f"the plan has {accumulation_steps} micro-steps per optimizer step, but this step's gradients did not "
                "come through session.backward(loss): loss.backward() bypasses the accumulation (each session.step() "
                "would step on one micro-batch); call session.backward(loss) inside `with session.accumulate(model):`"
            )

    def at_step(self) -> None:
        """A step is taken (before it is counted): the resumed run's warning, once."""
        if self.state.resumed and not self.counted:
            self.counted = True
            self.print_main(
                f"phalanx: warning: this run resumed at step {self.state.step}, but nothing in the loop follows "
                "phalanx's count (session.step_count, session.keep(), train.max_steps or session.epochs()); a loop "
                "that counts its own steps starts again from 0: start it from session.step_count, or keep it with "
                "progress = session.keep(iter_num=0)"
            )
        elif self.state.resumed and not self.positioned:
            self.positioned = True
            self.print_main(
                f"phalanx: warning: this run resumed at step {self.state.step}, but phalanx does not see where the "
                "loop's data stands: no training loader phalanx set up is iterated, and neither session.step_count "
                "nor session.keep() is read; a loop over its own data (range(...) over tensors, its own epoch "
                "counter) starts again at its first batch: keep its position with session.keep(batch=0, epoch=0) "
                "and start from it"
            )

    def check_loss(self, loss: torch.Tensor, shares: int) -> None:
        """The first backward's loss, averaged over ``shares`` (processes x micro-steps)."""
        self.loss_checked = True
        if type(loss) is not torch.Tensor:
            return  # a pipeline's deferred output (no graph yet), a DTensor: not looked into
        grad_fn = loss.grad_fn
        if shares > 1 and grad_fn is not None and grad_fn.name() == "SumBackward0":
            self.print_main(
                f"phalanx: warning: the loss is a sum (its last operation is .sum()), but phalanx averages gradients "
                f"over {shares} shares of the global batch (processes x micro-steps) as for a mean, so this run steps "
                f"with 1/{shares} of the gradient one process computes on the whole batch; use a mean (loss.mean(), "
                "reduction='mean'), or scale the loss yourself if the sum is meant (a sum of mean losses is fine)"
            )
