"""``batch.adaptive: goodput``: the global batch re-chosen during training for goodput (Pollux,
OSDI 2021), from the gradient noise scale and the run's own step times.

Every ``batch.adapt_every`` optimizer steps the ranks agree on a multiple k of the starting global
batch G0 (k = 1, 2, 4, ... up to ``batch.adaptive_max_global_batch``): the accumulation steps become
k times the starting ones, and a forward joins up to k of the loader's micro-batches as far as
``batch.max_micro_batch_size`` allows (without it the micro-batch stays, so does a step's memory). The
choice maximises throughput(k) x efficiency(k G0), with efficiency(B) = 1 / (1 + B / B_noise) and
throughput from the step time at k (step_times.py: a prior fitted to the first decision's steps,
then the time measured at each multiple the run has trained at, kept in the checkpoint: a resumed
run decides from the times measured before it and measures only the multiples not yet trained at).
The learning rate is multiplied by the
AdaScale gain (Johnson et al. 2020) for SGD-family optimizers, r = (1 + B_noise/G0) / (1 + B_noise/G),
and by its square root for Adam-family ones; the user's schedulers step k times per optimizer step,
so a schedule keeps its meaning in samples seen. The choices are part of the checkpoint.

A larger batch must also pay in the run's own training loss (batch_stall.py): no growth while the
loss is not measurably falling (a plateau, where the noise scale reads high but more steps are what
pays), and a growth is on trial for two choices' worth of steps, after which it goes back to the
previous multiple, held there for a while, when its progress per sample fell below half of what the
noise scale predicted; sooner, after its first window, when the measured step times there already
give less goodput than before. The Session hands over each optimizer step's loss (``observe_loss``); it stays
on the device until a choice reads a window's sum once.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from phalanx.config.batch import BatchPlan
from phalanx.config.schema import Config
from phalanx.errors import ConfigError
from phalanx.runtime.noise_scale import efficiency
from phalanx.session.batch_stall import StallCheck
from phalanx.session.step_times import StepTimes
from phalanx.topology import Topology

MIN_GAIN = 0.03  # a change must promise this much more goodput, or the batch stays


def goodput(k: int, base: BatchPlan, noise_scale: float, seconds: float) -> float:
    """Samples/s at multiple ``k`` of the starting plan, a step taking ``seconds``, times their efficiency."""
    return k * base.global_batch_size / seconds * efficiency(k * base.global_batch_size, noise_scale)


def choose(current: int, candidates: Iterable[int], base: BatchPlan, noise_scale: float, times: StepTimes) -> int:
    """The multiple of the highest predicted goodput; the current one unless another beats it by MIN_GAIN."""
    scored = {}
    for k in candidates:
        seconds = times.seconds(k, base.accumulation_steps)
        if seconds is not None:
            scored[k] = goodput(k, base, noise_scale, seconds)
    if not scored:
        return current
    best = max(scored, key=scored.get)
    return best if scored[best] > scored.get(current, 0.0) * (1 + MIN_GAIN) else current


def lr_gain(k: int, base: BatchPlan, noise_scale: float | None, adam: bool) -> float:
    """What the learning rate is multiplied by at ``k`` G0 (AdaScale's gain; its root for Adam)."""
    if k == 1 or noise_scale is None:
        return 1.0
    g0 = base.global_batch_size
    gain = (1 + noise_scale / g0) / (1 + noise_scale / (k * g0))
    return math.sqrt(gain) if adam else gain


class AdaptiveBatch:
    def __init__(self, config: Config, topology: Topology):
        self.settings = config.batch
        self.topology = topology
        self.base: BatchPlan | None = None  # the plan training started with
        self.k = 1
        self.gain = 1.0
        self.times = StepTimes(config.batch.adaptive_step_times)  # given, or fitted and measured (rank 0's)
        self.history: list[tuple[int, int]] = []  # (optimizer step, k) at every change
        self.on_change = None  # the Session's: apply the plan now in effect (also after a resume)
        self._times: deque[tuple[float, float, bool]] = deque(maxlen=config.batch.adapt_every)
        self.stall = StallCheck(config.batch.adapt_every)  # the loss's say on a larger batch

    def observe_loss(self, loss: torch.Tensor | float | None) -> None:
        """One optimizer step's training loss, at its end (a tensor is not read here). Rank 0 decides,
        so only its losses are kept."""
        if self.topology.rank == 0 and self.settings.adaptive_loss_check:
            self.stall.losses.add(loss)

    def note(self, step_time: float, sync_time: float, estimated: bool) -> None:
        """One optimizer step's time and its synchronising part (for the throughput model)."""
        self._times.append((step_time, sync_time, estimated))

    def plan(self, batch: BatchPlan) -> BatchPlan:
        """The starting plan is known; returns the plan in effect (a resumed run's own k)."""
        if self.base is None or self.base != batch:
            self.base = batch
        return self.current()

    def current(self) -> BatchPlan:
        b, k = self.base, self.k
        return replace(b, accumulation_steps=b.accumulation_steps * k, global_batch_size=b.global_batch_size * k)

    @property
    def merge(self) -> int:
        """Micro-batches a forward joins at the current k: as many of the k times more as
        ``batch.max_micro_batch_size`` (the memory a forward may use) allows; 1 without that limit.
        At k = 1 the script's own micro-batch, always."""
        limit, micro = self.settings.max_micro_batch_size, self.base.micro_batch_size if self.base else 0
        j = 1
        while limit is not None and self.k % (2 * j) == 0 and micro * 2 * j <= limit:
            j *= 2
        return j

    def candidates(self) -> list[int]:
        most = self.settings.adaptive_max_global_batch or 8 * self.base.global_batch_size
        out, k = [], 1
        while k * self.base.global_batch_size <= most:
            out.append(k)
            k *= 2
        return out

    def decide(self, step: int, noise_scale: float | None, adam: bool) -> bool:
        """At the end of optimizer step ``step``: re-choose k every adapt_every steps. Returns whether
        it changed. Rank 0 decides (its step times are its own), every rank takes its choice."""
        if step % self.settings.adapt_every:
            return False
        if self.topology.rank == 0:
            self.stall.losses.close(step, self.k)  # every window ends, measured or not
        if noise_scale is None:
            return False
        choice = self.k
        if self.topology.rank == 0:
            self.times.record(self.k, list(self._times), self.base.accumulation_steps * self.k)
            ruling, bound = self.stall.ruling(step, self.k)
            if ruling == "trial":
                slower = self._slower(noise_scale)
                if slower is not None:
                    ruling, bound = "back", self.stall.withdraw(slower)
            if ruling != "free":
                choice = bound  # a growth on trial stays; a failed one goes back; a wrongly failed one returns
            else:
                candidates = [c for c in self.candidates() if not bound or c <= bound]
                choice = choose(self.k, candidates, self.base, noise_scale, self.times)
                if choice > self.k and not self.stall.may_grow():
                    choice = self.k
                if choice > self.k:
                    self.stall.grew(step, self.k, choice, self.base.global_batch_size, noise_scale)
        if self.topology.world_size > 1:
            box = [choice, self.times.state_dict(), self.stall.decisions()]
            dist.broadcast_object_list(box, src=0)
            choice, times, decisions = box
            self.times.load_state_dict(times)
            self.stall.take(decisions)
        changed = choice != self.k
        self.k = choice
        self.gain = lr_gain(self.k, self.base, noise_scale, adam)
        if changed:
            self.history.append((step, self.k))
        return changed

    def _slower(self, noise_scale: float) -> str | None:
        """Why the growth on trial goes back at once: its measured steps give less goodput than the
        multiple it grew from (the noise scale's efficiency weighing both); None while it pays or is
        unmeasured."""
        k0, k1 = self.stall.trial["from"], self.stall.trial["to"]
        measured = self.times.measured
        if k1 != self.k or k0 not in measured or k1 not in measured:
            return None
        before = goodput(k0, self.base, noise_scale, measured[k0])
        after = goodput(k1, self.base, noise_scale, measured[k1])
        if after >= before:
            return None
        speed = k1 * measured[k0] / (k0 * measured[k1])
        return (
            f"back from x{k1}: its steps gave {speed:.2f}x the samples/s of x{k0}, less than the "
            f"{before / after * speed:.2f}x the noise scale says its samples' lesser progress needs"
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "gain": self.gain,
            **self.times.state_dict(),
            "history": [list(h) for h in self.history],
            "stall": self.stall.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        self.k, self.gain = int(state["k"]), float(state["gain"])
        self.times.load_state_dict(state)
        self.history = [tuple(h) for h in state["history"]]
        if state.get("stall") is not None:  # a checkpoint from before the loss check has none
            self.stall.load_state_dict(state["stall"])
        if self.on_change is not None and self.base is not None:
            self.on_change()


def check(config: Config) -> None:
    """Refuse adaptive settings that cannot work, before training."""
    b = config.batch
    if b.adaptive is None:
        return
    if b.fixed_layout:
        raise ConfigError(
            "batch.adaptive changes the global batch during training, which batch.fixed_layout forbids; "
            "set one of them off"
        )
    if not config.train.noise_scale:
        raise ConfigError("batch.adaptive needs the gradient noise scale: set train.noise_scale: true")


def is_adam(optimizers: list[torch.optim.Optimizer]) -> bool:
    """Adam-family optimizers keep moment estimates (``betas``); their steps do not scale with lr
    as SGD's do."""
    return any("betas" in group for opt in optimizers for group in opt.param_groups)
