"""The batch plan's one owner: the sizes a run trains with (``BatchPlan``) and everything that
changes them or follows them.

The plan changes at three moments, all of them here: the Session is built (the config's sizes), a
training loader is set up (its ``batch_size`` is the global batch unless the config says
otherwise), and ``batch.adaptive`` or ``batch.schedule`` takes another multiple of the starting
batch (during training, or restored by a resume). Every change passes the layout lock (layout.py)
and re-plans where the noise-scale probe reads its small batch (noise.py); a plan made at setup also fixes the
learning-rate scaling (runtime/lr.py). A change during training is announced here, in one line; one
at setup, by the Session's set-up line, which reads ``describe()``.

The Session, the launcher (``config_plan``) and ``phalanx tune`` (session.json, which the Session
writes from this plan) ask this module; none derives a plan of its own, which
tests/unit/test_batch_owner.py checks by walking the source.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import nn

from phalanx.config.batch import BatchPlan
from phalanx.config.schema import BatchConfig, Config
from phalanx.errors import ConfigError
from phalanx.runtime.lr import LRScaling
from phalanx.session.adaptive import AdaptiveBatch, is_adam
from phalanx.session.adaptive import check as check_adaptive
from phalanx.session.batch_schedule import ScheduledBatch
from phalanx.session.batch_schedule import check as check_schedule
from phalanx.session.layout import LayoutLock
from phalanx.session.noise import NoiseProbe
from phalanx.session.state import TrainState
from phalanx.strategies import Strategy
from phalanx.topology import Topology


def config_plan(
    config: Config, strategy: type[Strategy], world_size: int, per_node: int | None = None
) -> BatchPlan | None:
    """The plan the config's sizes alone give on ``world_size`` processes (``per_node`` on each
    node, where known: a tensor-parallel group stays within one); None when it sets no
    size (a training loader's ``batch_size`` will). Sizes that cannot be met raise ConfigError: the
    launcher asks before any process starts, so that it refuses what the Session would."""
    if not _sets_a_size(config.batch):
        return None
    return strategy.plan_batch(config, world_size, config.batch.global_batch_size, per_node=per_node)


def _sets_a_size(batch: BatchConfig, loader_batch_size: int | None = None) -> bool:
    """Whether the config (or a training loader's ``batch_size``) gives a size to plan from."""
    return bool(loader_batch_size or batch.global_batch_size or batch.micro_batch_size or batch.max_micro_batch_size)


class BatchOwner:
    def __init__(
        self,
        config: Config,
        strategy: Strategy,
        topology: Topology,
        state: TrainState,
        models: list[nn.Module],
        say: Callable[[str], None],
        given: Config | None,
        sections: Mapping[str, Any],
    ):
        """``state``: where the step count is read and where the probe's and batch.adaptive's state
        is checkpointed; ``given`` and ``sections``: what the script passed in code (layout.py)."""
        self._config = config
        self._strategy = strategy
        self._world_size = topology.world_size
        self._state = state
        self._say = say
        self._layout = LayoutLock(config, given, sections)
        # Refuse an impossible batch when the Session is built rather than at setup(), which may refine it.
        self._per_node = topology.local_world_size
        self._plan = config_plan(config, type(strategy), self._world_size, self._per_node)
        self._layout.check(self._plan, None, self._sizes)
        self._lr_scaling: LRScaling | None = None  # at setup: the reference may be a loader's batch_size
        self._noise = NoiseProbe(config, strategy, topology, models)  # the Session feeds it gradients
        check_adaptive(config)
        check_schedule(config)
        # batch.schedule takes its multiples from the config, batch.adaptive chooses them: one machinery.
        self._adaptive: AdaptiveBatch | None = None
        if config.batch.adaptive:
            self._adaptive = AdaptiveBatch(config, topology)
        elif config.batch.schedule is not None:
            self._adaptive = ScheduledBatch(config, topology)
        if self._adaptive is not None:
            self._adaptive.on_change = self._adapted
        state.noise, state.adaptive = self._noise, self._adaptive
        self._said_no_noise_scale: str | None = None

    # -- what the others ask ----------------------------------------------------------------------
    @property
    def plan(self) -> BatchPlan | None:
        return self._plan

    @property
    def lr_scaling(self) -> LRScaling | None:
        return self._lr_scaling

    @property
    def noise(self) -> NoiseProbe:
        return self._noise

    @property
    def adaptive(self) -> AdaptiveBatch | None:
        """batch.adaptive's choices, or batch.schedule's multiples (a ScheduledBatch)."""
        return self._adaptive

    @property
    def fixed_layout(self) -> bool:
        return self._layout.fixed

    @property
    def accumulation_steps(self) -> int:
        return self._plan.accumulation_steps if self._plan else 1

    @property
    def global_batch_size(self) -> int | None:
        return self._plan.global_batch_size if self._plan else None

    @property
    def joins_forwards(self) -> bool:
        """Whether a training loader's forwards may join micro-batches (batch.adaptive, batch.schedule)."""
        return self._adaptive is not None

    @property
    def schedule_steps(self) -> int:
        """Scheduler steps per optimizer step: under batch.adaptive or batch.schedule a step of k times the starting
        batch is k of its steps, so a schedule keeps its meaning in samples seen."""
        return self._adaptive.k if self._adaptive is not None else 1

    def lr_multiplier(self, step: int) -> float:
        return self._lr_scaling.multiplier(step) if self._lr_scaling else 1.0

    def step_multiplier(self, step: int) -> float:
        """What optimizer step ``step`` multiplies the lr by: the scaling rule's, times batch.adaptive's (or
        batch.schedule's) gain."""
        lr = self.lr_multiplier(step)
        return lr * self._adaptive.gain if self._adaptive is not None else lr

    def micro_batches_per_forward(self) -> int:
        """batch.adaptive: the loader's micro-batches the next forward joins; never past the end of
        the optimizer step's window, so every step sums exactly its accumulation steps' samples."""
        if self._state.micro == 0 and self._noise.wants_one_micro_batch_first(self._state.step):
            return 1
        return min(self._adaptive.merge, self.accumulation_steps - self._state.micro)

    def describe(self) -> list[str]:
        """The set-up line's words for the plan (none before there is one)."""
        if self._plan is None:
            return []
        words = [self._plan.describe() + (" (layout fixed)" if self.fixed_layout else "")]
        return words + ([self._lr_scaling.describe()] if self._lr_scaling else [])

    # -- what changes the plan --------------------------------------------------------------------
    def fix_layout(self, by: str) -> None:
        self._layout.declare(by)

    def plan_loader(self, loader_batch_size: int | None) -> BatchPlan | None:
        """A training loader is set up (``None``: setup() ends without one): plan from its
        ``batch_size`` and the config's sizes; unchanged when neither gives a size."""
        cfg = self._config
        if not _sets_a_size(cfg.batch, loader_batch_size):
            return self._plan
        plan = self._sizes(cfg.batch.global_batch_size or loader_batch_size)
        self._plan = plan
        self._layout.check(plan, loader_batch_size, self._sizes)
        reference = cfg.optim.reference_batch_size or loader_batch_size
        if reference is None:
            if cfg.optim.lr_scaling != "none":
                raise ConfigError(
                    "optim.lr_scaling needs optim.reference_batch_size (the batch size your lr was tuned for)"
                )
            reference = plan.global_batch_size
        if self._adaptive is not None:
            self._plan = self._adaptive.plan(plan)  # a resumed run's own multiple
        self._noise.plan(self._plan)
        self._say_why_no_noise_scale()
        self._lr_scaling = LRScaling(
            cfg.optim.lr_scaling,
            self._plan.global_batch_size,
            reference,
            cfg.optim.warmup_steps,
            cfg.optim.warmup_start_factor,
        )
        return self._plan

    def finish_setup(self) -> None:
        """setup() ends: without a training loader so far, the config's sizes alone plan."""
        if self._lr_scaling is None:
            self.plan_loader(None)

    def model_wrapped(self) -> None:
        """A model was wrapped after the batch was planned: wrapping may have changed where the
        noise scale can be measured (fsdp finds its reduce-scatter there)."""
        if self._plan is not None and self._lr_scaling is not None:
            self._noise.plan(self._plan)
            self._say_why_no_noise_scale()

    def after_step(
        self,
        loss: torch.Tensor | float | None,
        times: tuple[float, float] | None,
        estimated: bool,
        optimizers: list[torch.optim.Optimizer],
    ) -> None:
        """An optimizer step was taken in ``times`` (step, synchronising part) with ``loss``: batch.adaptive
        may re-choose, batch.schedule may grow. batch.adaptive keeps a larger batch only while the loss says
        it pays (batch_stall.py); a tensor loss is not read here: it is added up on its device and read once
        per ``batch.adapt_every`` steps, at a choice."""
        if self._adaptive is None:
            return
        self._adaptive.observe_loss(loss)
        if isinstance(self._adaptive, ScheduledBatch):
            if self._adaptive.decide(self._state.step, None, is_adam(optimizers)):  # no noise scale asked
                self._adapted()
            return
        if times is None:
            return
        self._adaptive.note(*times, estimated)
        # The estimate is read from the device only at the steps where batch.adaptive decides.
        due = self._state.step % self._adaptive.settings.adapt_every == 0
        if self._adaptive.decide(self._state.step, self._noise.value if due else None, is_adam(optimizers)):
            self._adapted()

    def _adapted(self) -> None:
        """batch.adaptive chose another multiple of the starting batch, batch.schedule reached one (or a
        resume restored one)."""
        self._plan = self._adaptive.current()
        self._noise.resize(self._plan)
        joined = self._adaptive.merge
        forwards = f", forwards of {joined} micro-batches at once" if joined > 1 else ""
        mode = "batch.schedule" if isinstance(self._adaptive, ScheduledBatch) else "batch.adaptive"
        why, self._adaptive.stall.why = self._adaptive.stall.why, None
        because = f" ({why})" if why else ""
        self._say(f"phalanx: {mode}: {self._plan.describe()}{forwards} from step {self._state.step}{because}")

    def _sizes(self, global_batch_size: int | None, batch: BatchConfig | None = None) -> BatchPlan:
        """``batch``: other sizes than the config's (the layout lock plans the script's own)."""
        kind = type(self._strategy)
        return kind.plan_batch(self._config, self._world_size, global_batch_size, batch, per_node=self._per_node)

    def _say_why_no_noise_scale(self) -> None:
        why = self._noise.why_not
        if why is None:
            return
        if self._adaptive is not None and not isinstance(self._adaptive, ScheduledBatch):
            raise ConfigError(f"batch.adaptive needs the gradient noise scale, which this run cannot measure: {why}")
        asked = self._config.sources.get("train.noise_scale", "default") != "default"
        if asked and why != self._said_no_noise_scale:  # once per reason, not at every setup_loader
            self._said_no_noise_scale = why
            self._say(f"phalanx: train.noise_scale: no estimate in this run: {why}")
