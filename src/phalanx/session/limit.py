"""``train.max_steps``: training ends after that many optimizer steps, the way it ends at its last
epoch, so the script's own end-of-training code runs (and no signal handler of it does).
``phalanx bench`` and ``phalanx tune`` end their runs with it rather than with a signal.

The Session honours it in two places, which between them cover both ways a loop is written:

- ``session.epochs()`` yields no further epoch once the limit is reached;
- every training loader the Session returned ends its pass there (its ``stop_when`` hook): asking
  for the batch after the one whose optimizer step reached the limit ends the loop, as the end of
  an epoch does. So ``for batch in loader`` and ``for batch in session.progress(loader)`` both end,
  and a pass started after the limit yields nothing.
"""

from __future__ import annotations

from typing import Callable


class StepLimit:
    def __init__(self, max_steps: int | None, steps: Callable[[], int], say: Callable[[str], None]):
        """``steps`` returns the optimizer steps taken so far; ``say`` prints on rank 0."""
        self.max_steps = max_steps
        self._steps = steps
        self._say = say
        self._said = False

    def reached(self) -> bool:
        if self.max_steps is None or self._steps() < self.max_steps:
            return False
        if not self._said:
            self._said = True
            self._say(f"phalanx: train.max_steps={self.max_steps} reached: training ends here")
        return True
