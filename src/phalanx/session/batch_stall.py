"""batch.adaptive's check on itself: a larger batch is kept only while the training loss says it pays.

The noise scale predicts what a larger batch costs in samples, but on a loss plateau (the gradient
small against its noise) it reads high, and growing the batch there costs optimizer steps that the
escape from the plateau needed. So the run's own loss is watched, in windows of ``batch.adapt_every``
optimizer steps (the stretch between two choices), each window's mean training loss and its standard
error, and a window's progress is the fall of the mean from the window before, per optimizer step:

- **no growth on a plateau**: a larger batch is taken only when the last two windows, at the current
  multiple, show the loss falling by more than ``Z`` standard errors of that fall; before two windows
  are measured nothing grows either (what follows needs the progress before a growth);
- **a growth on trial**: after a growth from k0 to k1 the next ``TRIAL`` windows run at k1 with no other
  change; then the progress per sample of their last two (the fall per step / k1) is set against the
  progress per sample k0 would have made there times what the noise scale predicted for k1,
  efficiency(k1 G0) / efficiency(k0 G0). Below ``STALL`` of that, the batch goes back to k0. What k0
  would have made is its progress before the growth, slowed as it was slowing: a loss falls less
  with every window (the falls of the three windows before the growth give the rate, no lower than
  ``SLOWING_FLOOR`` a window), and the verdict's windows come ``TRIAL`` windows after it, so that a
  growth is not blamed for the slowing the smaller batch would have seen too;
- **cut short**: a growth whose first window's measured step times (step_times.py) already give less
  goodput than the multiple it grew from goes back then, with neither a verdict nor a hold;
- **hold**: after going back on the loss's verdict, no choice may exceed k0 for ``HOLD`` choices,
  doubled with every back-off in a row (a growth that passes its trial ends the row);
- **review**: ``TRIAL`` windows after going back on the loss's verdict, the fall per sample back at k0
  is weighed as the verdict weighed k0's (``STALL`` x the noise scale's promise) against k1's on
  trial. When k1's was the larger by more than ``Z`` standard errors, the slowing the verdict saw
  was the run's, not the batch's: k1 comes back at once, without a trial, and the hold and the row
  of back-offs end.

The losses are what the Session hands over at every optimizer step (``LossWindows.add``): tensors stay
on the device, added up there, and are read once a window, at the choice (no read per step). Rank 0
measures and decides, as it does for the rest of batch.adaptive; its decisions (the trial, the hold,
the windows' means) are sent to every rank with its choice, and are part of the checkpoint, together
with rank 0's running sums of the open window, so a resumed run decides as the uninterrupted one.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from phalanx.runtime.noise_scale import efficiency

STALL = 0.5  # a growth must keep this share of the progress per sample the noise scale predicted for it
Z = 2.0  # the loss must fall by this many standard errors for a larger batch to be tried
TRIAL = 2  # windows a growth runs before its verdict
HOLD = 4  # choices after a back-off that may not exceed the multiple gone back to (x2 per back-off in a row)
KEPT = 3  # windows remembered: the two a progress needs, and the one before them
SLOWING_FLOOR = 0.5  # the least a window's fall is taken to shrink to in the next (an estimate of three windows)


class LossWindows:
    """The mean training loss (and its standard error) of each window of steps between two choices."""

    def __init__(self) -> None:
        self._sums: torch.Tensor | None = None  # the open window's sums (see add), where the losses are
        self._count = 0
        self.seen = False  # any loss handed over at all: without the Session's losses, no check
        self.closed: list[list[Any]] = []  # [end step, k, mean or None, standard error or None], oldest first

    def add(self, loss: torch.Tensor | float | None) -> None:
        """One optimizer step's loss (a tensor stays on its device: no read here)."""
        if loss is None:
            return
        if isinstance(loss, torch.Tensor):
            if hasattr(loss, "to_local"):  # a DTensor: rank 0's piece, with no collective on rank 0 alone
                loss = loss.to_local()
            value = loss.detach().to(torch.float64).mean()
        else:
            value = torch.tensor(float(loss), dtype=torch.float64)
        # (sum of x - x0, sum of (x - x0)^2, x0), x0 the window's first loss: sums of squares of the
        # losses themselves lose the variance to cancellation when it is small against the mean.
        if self._sums is None:
            self._sums = torch.stack([torch.zeros_like(value), torch.zeros_like(value), value])
        else:
            sums = self._sums.to(value.device)  # restored from a checkpoint on the host: moved once
            d = value - sums[2]
            self._sums = sums + torch.stack([d, d * d, torch.zeros_like(d)])
        self._count += 1
        self.seen = True

    def close(self, step: int, k: int) -> None:
        """The window ends with optimizer step ``step``, trained at multiple ``k``: its losses read, once."""
        mean = error = None
        if self._count >= 2:
            total, squares, shift = self._sums.tolist()
            n = self._count
            var = max((squares - total * total / n) / (n - 1), 0.0)
            if math.isfinite(total) and math.isfinite(shift) and math.isfinite(var):
                mean, error = shift + total / n, math.sqrt(var / n)
        self.closed = [*self.closed, [step, k, mean, error]][-KEPT:]
        self._sums, self._count = None, 0

    def progress(self, every: int, back: int = 0) -> tuple[float, float] | None:
        """(fall of the mean loss per step, its standard error) from the last two windows (``back``: the
        two before those, that many windows earlier), when both are measured, adjacent and at one
        multiple; None otherwise."""
        if len(self.closed) < 2 + back:
            return None
        (end0, k0, mean0, err0), (end1, k1, mean1, err1) = self.closed[-2 - back], self.closed[-1 - back]
        if mean0 is None or mean1 is None or k0 != k1 or end1 - end0 != every:
            return None
        return (mean0 - mean1) / every, math.hypot(err0, err1) / every

    def slowing(self, every: int) -> float:
        """How much the loss's fall shrank from one window to the next, the last three windows at one
        multiple: the last fall over the one before it, within [SLOWING_FLOOR, 1]; 1 (none) where either
        fall is unmeasured or not a fall."""
        last, earlier = self.progress(every), self.progress(every, back=1)
        if last is None or earlier is None or last[0] <= 0 or earlier[0] <= 0:
            return 1.0
        return min(max(last[0] / earlier[0], SLOWING_FLOOR), 1.0)

    def state_dict(self) -> dict[str, Any]:
        sums = self._sums.tolist() if self._sums is not None else None
        return {"sums": sums, "count": self._count, "seen": self.seen, "closed": [list(w) for w in self.closed]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._sums = torch.tensor(state["sums"], dtype=torch.float64) if state["sums"] is not None else None
        self._count, self.seen = int(state["count"]), bool(state["seen"])
        self.closed = [list(w) for w in state["closed"]]


class StallCheck:
    """The trial of a growth and the hold after a back-off (see the module's docstring)."""

    def __init__(self, every: int):
        self.every = every
        self.losses = LossWindows()
        self.trial: dict[str, Any] | None = None  # {"at", "from", "to", "before", "expect"} of the growth on trial
        self.cap: int | None = None  # the largest multiple allowed during a hold
        self.hold_until = 0  # the optimizer step the hold ends at
        self.strikes = 0  # back-offs in a row
        self.why: str | None = None  # the last back-off's reason, for the line that announces it (rank 0)
        # {"at", "from", "to", "after", "error", "expect"} of the last back-off on the loss's verdict, until
        # the windows back at "from" say whether the verdict was right
        self.review: dict[str, Any] | None = None

    def ruling(self, step: int, k: int) -> tuple[str, int]:
        """At a choice, after the window ending at ``step`` closed: ("trial", k) while a growth is on
        trial, ("back", k0) when it failed, ("again", k1) when the windows back at k0 say it should not
        have, ("free", cap) when the choice is free up to ``cap`` (0: any multiple)."""
        if self.trial is not None:
            if step < self.trial["at"] + TRIAL * self.every:
                return "trial", k
            trial, self.trial = self.trial, None
            if self._failed(trial):
                after, error = self.losses.progress(self.every)
                self.why = _why(trial, after)
                self.strikes += 1
                self.cap = trial["from"]
                self.hold_until = step + HOLD * 2 ** (self.strikes - 1) * self.every
                self.review = {
                    "at": step,
                    "from": trial["from"],
                    "to": trial["to"],
                    "after": after,
                    "error": error,
                    "expect": trial["expect"],
                }
                return "back", trial["from"]
            self.strikes = 0
        if self.review is not None and step >= self.review["at"] + TRIAL * self.every:
            review, self.review = self.review, None
            if self._wrongly_backed(review):
                self.cap, self.hold_until, self.strikes = None, 0, 0
                return "again", review["to"]
        if self.cap is not None and step >= self.hold_until:
            self.cap = None
        return "free", self.cap or 0

    def withdraw(self, why: str) -> int:
        """The growth on trial goes back before its verdict, because its measured step times already say
        it cannot pay; the multiple it grew from. No strike, no hold: the measured times keep the choices
        that follow from it."""
        k0, self.trial, self.why = self.trial["from"], None, why
        return k0

    def may_grow(self) -> bool:
        """Whether a larger batch may be tried now: the loss is measurably falling (or no loss is handed over)."""
        if not self.losses.seen:
            return True  # without the Session's losses batch.adaptive chooses as the noise scale alone says
        measured = self.losses.progress(self.every)
        return measured is not None and measured[0] > Z * measured[1]

    def grew(self, step: int, k0: int, k1: int, global_batch: int, noise_scale: float) -> None:
        """A growth from ``k0`` to ``k1`` at ``step``: on trial, from the progress measured before it."""
        before = self.losses.progress(self.every) if self.losses.seen else None
        if before is None:
            return
        expect = efficiency(k1 * global_batch, noise_scale) / efficiency(k0 * global_batch, noise_scale)
        # The fall at k0 had slowed by this much a window; the verdict's windows are TRIAL later.
        before = before[0] * self.losses.slowing(self.every) ** TRIAL
        self.trial = {"at": step, "from": k0, "to": k1, "before": before, "expect": expect}

    def _failed(self, trial: dict[str, Any]) -> bool:
        after = self.losses.progress(self.every)
        if after is None:
            return False  # unmeasured (no losses, a non-finite loss): nothing says the growth hurt
        # Per sample: after / k1 against STALL x expect x before / k0.
        wanted = STALL * trial["expect"] * trial["to"] / trial["from"] * max(trial["before"], 0.0)
        return after[0] < wanted

    def _wrongly_backed(self, review: dict[str, Any]) -> bool:
        """Whether the windows back at k0 fell less per sample than k1's trial did, weighed as the verdict
        weighed them (STALL x the noise scale's promise) and by more than Z standard errors: then the
        verdict blamed k1 for a slowing k0 sees too, and k1 comes back. Sets the line that says so."""
        back = self.losses.progress(self.every)
        if back is None:
            return False
        k0, k1, weight = review["from"], review["to"], STALL * review["expect"]
        margin = review["after"] / k1 - weight * back[0] / k0
        error = math.hypot(review["error"] / k1, weight * back[1] / k0)
        if margin <= Z * error:
            return False
        if back[0] > 0:
            fell = f"fell {back[0] / k0 / (review['after'] / k1):.2f}x as much per sample as x{k1}'s on trial"
        else:
            fell = f"did not fall, where x{k1}'s on trial did"
        self.why = f"x{k1} again: back at x{k0} the loss {fell}: the slowing was the run's, not the batch's"
        return True

    def decisions(self) -> dict[str, Any]:
        """What every rank must hold alike (rank 0 sends it with its choice)."""
        return {
            "trial": self.trial,
            "review": self.review,
            "cap": self.cap,
            "hold_until": self.hold_until,
            "strikes": self.strikes,
            "closed": [list(w) for w in self.losses.closed],
        }

    def take(self, decisions: dict[str, Any]) -> None:
        self.trial = dict(decisions["trial"]) if decisions["trial"] is not None else None
        review = decisions.get("review")  # a checkpoint from before the review has none
        self.review = dict(review) if review is not None else None
        self.cap, self.hold_until = decisions["cap"], int(decisions["hold_until"])
        self.strikes = int(decisions["strikes"])
        self.losses.closed = [list(w) for w in decisions["closed"]]

    def state_dict(self) -> dict[str, Any]:
        return {**self.decisions(), "losses": self.losses.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses.load_state_dict(state["losses"])
        self.take(state)


def _why(trial: dict[str, Any], after: float) -> str:
    k0, k1 = trial["from"], trial["to"]
    before = trial["before"] / k0
    share = f"{after / k1 / before:.2f}x" if before > 0 else "none"
    return (
        f"back from x{k1}: the loss's fall per sample there was {share} of what x{k0}'s would have been, "
        f"where the noise scale predicted {trial['expect']:.2f}x"
    )
