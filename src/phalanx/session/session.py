"""The user-facing object of a bring-your-own-loop script.

    session = phalanx.Session()
    model, optimizer, loader, scheduler = session.setup(model, optimizer, loader, scheduler)
    for epoch in session.epochs():
        for batch in session.progress(loader):
            with session.accumulate(model):
                session.backward(loss_fn(model(batch[0]), batch[1]))

The Session steps the optimizer and scheduler and zeroes gradients once per global batch, at the
end of the ``accumulate`` block that completes it.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import json
import random
import time
import weakref
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
from torch.utils.data import DataLoader

from phalanx.checkpoint.manager import Checkpointer, TrainingObjects
from phalanx.config.batch import BatchPlan
from phalanx.config.loader import load_config, override_config
from phalanx.config.preset import fit_to_device
from phalanx.config.schema import Config
from phalanx.config.template import write_resolved
from phalanx.errors import PhalanxError
from phalanx.faults.lifeline import watch_launcher
from phalanx.faults.replicas import ReplicaCheck
from phalanx.metrics.recorder import create_recorder
from phalanx.runtime.compute import Compute
from phalanx.runtime.data import DeviceLoader, shard_loader
from phalanx.runtime.lr import LRScaling
from phalanx.runtime.memory_cap import MemoryCap
from phalanx.runtime.precision import Precision
from phalanx.runtime.presplit import given_global_batch
from phalanx.runtime.progress import Throughput, track
from phalanx.runtime.recompute import apply_activation_checkpointing
from phalanx.runtime.shares import shard_tensors
from phalanx.session import collectives
from phalanx.session.adaptive import AdaptiveBatch
from phalanx.session.batch_plan import BatchOwner
from phalanx.session.facts import describe_model_size, write_run_facts
from phalanx.session.gradients import GradientKeeping
from phalanx.session.guards import PortingGuards
from phalanx.session.items import ITEMS_CHECK_EVERY, ItemWeighting, weighted_mean
from phalanx.session.kept import Kept
from phalanx.session.limit import StepLimit
from phalanx.session.loader_roles import LoaderRoles
from phalanx.session.loop_checks import LoopChecks
from phalanx.session.noise import NoiseProbe
from phalanx.session.recovery import Recovery
from phalanx.session.schedulers import Schedulers
from phalanx.session.state import TrainState
from phalanx.session.trace import WeightsTrace
from phalanx.session.weights import Weights
from phalanx.strategies import create_strategy
from phalanx.strategies.construction import empty_parameters, materialized_bytes
from phalanx.strategies.parallel_layout import TENSOR
from phalanx.strategies.surface import expose
from phalanx.topology import LaunchContext, Topology


class Session:
    def __init__(self, config: Config | None = None, **sections: Any):
        """``config`` defaults to :meth:`Config.load` (phalanx.yaml or the launcher's config);
        keyword arguments override sections, e.g. ``Session(strategy="ddp", batch={"micro_batch_size": 8})``."""
        self._context = LaunchContext.from_env()
        given = config  # with ``sections``, the script's own settings (see layout.py)
        if config is None:
            config = load_config(sections=sections, context=self._context)
        elif sections or (self._context and self._context.overrides) or config.preset != "none":
            config = override_config(config, sections, self._context)  # (a preset is resolved there too)
        # launch.cpu forces the CPU from the script too (Session(launch={"cpu": True})), not only through the launcher.
        self.topology = Topology.from_env(force_cpu=True if config.launch.cpu else None)
        if self.topology.launched:  # under plain torchrun too: this rank ends with its agent
            watch_launcher(f"rank {self.topology.rank}")
        self.config = config = fit_to_device(config, self.topology.device)
        if self._context and self._context.run_dir and self.topology.is_main:
            # The launcher wrote what it knew; this is what the run really uses (code settings too).
            write_resolved(config, f"{self._context.run_dir}/config.yaml")
        _seed_everything(config.train.seed)
        self.strategy = create_strategy(config, self.topology)
        self.strategy.setup_environment()
        self.precision = Precision(config.precision, self.topology.device)
        self._compute = Compute(config.compute)
        run_dir = self._context and self._context.run_dir
        self.metrics = create_recorder(
            config, self.topology, run_dir, local_forward=self.strategy.local_forward, devices=self.strategy.devices
        )
        self._memory_cap = MemoryCap.create(config.train.memory_cap, self.topology.device, self.strategy.devices)
        if self._memory_cap is not None and self.device.type != "cuda":
            self.metrics.cpu_peak = self._memory_cap.used_bytes  # CUDA records the allocator's peak itself

        self.state = TrainState(self.strategy.devices)  # step, epoch, micro-step, data positions, RNG
        self._models: list[nn.Module] = []
        # Every change to the batch plan (config, training loaders, batch.adaptive) goes through its owner.
        self._batch = BatchOwner(
            config, self.strategy, self.topology, self.state, self._models, self.print, given, sections
        )
        self.metrics.noise_scale = lambda taken: self.noise.value_after(taken)  # read at each metrics flush
        self.sync_gradients = True  # False inside accumulate() on all but the last micro-step
        self.last_throughput: Throughput | None = None
        self._in_accumulate = False
        self._short_window = False  # a window of session.backward(loss) calls without the block
        self._short_form_said = False
        # A stray optimizer.step() or zero_grad().
        self._guards = PortingGuards(self._micro_steps_before, lambda: self._short_window)
        self._schedulers = Schedulers(self._mid_window, self.print)  # phalanx's to step, or the script's
        self._unscaled = False
        self._last_loss: torch.Tensor | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._weights = Weights(self.strategy, self.topology, self._models)  # load_weights, uninitialised modules
        self._forward_micro = 1  # the loader's micro-batches in the current forward (see accumulate)
        self._joined_batch = 1  # ... in the training batch handed out last, until a forward takes it
        # session.backward(loss, items=n): the window's items, and the step's rescaling by them.
        self._items = ItemWeighting(
            self.strategy.data_parallel_size, self.strategy.data_group, self.topology.comm_device
        )
        # Replicas' weights compared every faults.replica_check_every steps (None: no replica to compare).
        strategy, every = self.strategy, config.faults.replica_check_every
        optimizers = self._optimizers if strategy.replicates_optimizer_state else []  # zero1 shards their state
        self._replicas = ReplicaCheck.create(
            every, strategy.replica_group(), self.topology.comm_device, self._models, optimizers, strategy.unwrap
        )
        self.metrics.at_flush.append(self._batch.noise.settle)  # bounded, also without train.metrics
        self._gradients = GradientKeeping(config, self._models, self._optimizers, self.print)  # also with no optimizer
        self._loaders: list[DeviceLoader] = []
        self._roles = LoaderRoles(self.print)  # which loaders train, and the refusals of a wrong guess
        self._active_loader: DeviceLoader | None = None
        self._closed = False
        self._set_up = False
        self._seeded = False  # the per-rank re-seed waits for the first model (see setup())
        self._announced: tuple | None = None  # what the console line and session.json last said
        self._step_limit = StepLimit(config.train.max_steps, lambda: self.state.step, self.print)
        # The loop's own shape: backwards that bypass session.backward, a resumed count (loop_checks.py).
        self._loop = LoopChecks(self.state, self.print, limited=config.train.max_steps is not None)
        self._split_tensors = False  # session.shard() dealt the script's tensors: phalanx split its batches
        self._trace = (
            WeightsTrace(
                config.train.weights_trace,
                self.is_main,
                self._models,
                self.strategy.model_state_dict,
                self.strategy.unwrap,
                lambda: self._split_tensors or any(loader.train for loader in self._loaders),
            )
            if config.train.weights_trace
            else None
        )
        run_dir = self._context.run_dir if self._context else None
        job = self._context.job if self._context else None
        checkpointer = Checkpointer(
            self.strategy, self.topology, run_dir=run_dir, keep_last=config.checkpoint.keep_last, job=job
        )
        self._recovery = Recovery(
            config,
            self.topology,
            run_dir,
            self.topology.comm_device,
            checkpointer,
            self.state,
            self._checkpointed,
            self.print,
            self._after_load,
            job=job,
            describe_batch=lambda: "; ".join(self._batch.describe()),
        )
        # Tear the process group down even when the user's script raises.
        atexit.register(_close_ref, weakref.ref(self))

    # -- facts ------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.topology.device

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def is_main(self) -> bool:
        return self.topology.is_main

    @property
    def step_count(self) -> int:
        """Optimizer steps taken (restored by a resume: the checkpoint's once setup() returns)."""
        self._loop.follows_position()
        return self.state.step

    def keep(self, **values: Any) -> Kept:
        """Values the script keeps itself (``iter_num``, a best validation loss, an EMA), saved in
        every checkpoint and given back at resume: ``progress = session.keep(iter_num=0)``, then
        ``progress.iter_num += 1``. Called after a resumed setup(), it holds the checkpoint's values
        already (session/kept.py says what a value may be)."""
        self._loop.follows_position()
        return self.state.keep(values)

    @property
    def should_stop(self) -> bool:
        """True once ``train.max_steps`` optimizer steps are done (never without a limit): a loop
        that does not draw from a loader phalanx returned ends itself there."""
        self._loop.follows_count()
        return self._step_limit.reached()

    @property
    def epoch(self) -> int:
        return self.state.epoch

    @property
    def batch(self) -> BatchPlan | None:
        """The batch plan now in effect (None until a size is known); batch_plan.py changes it."""
        return self._batch.plan

    @property
    def accumulation_steps(self) -> int:
        return self._batch.accumulation_steps

    @property
    def lr_scaling(self) -> LRScaling | None:
        return self._batch.lr_scaling

    @property
    def lr_multiplier(self) -> float:
        return self._batch.lr_multiplier(self.state.step)

    @property
    def noise(self) -> NoiseProbe:
        """The gradient noise scale's probe: ``value``, ``estimate`` (None where this run has none)."""
        return self._batch.noise

    @property
    def adaptive(self) -> AdaptiveBatch | None:
        """batch.adaptive's choices (``k``, ``gain``, ``history``); None without it."""
        return self._batch.adaptive

    # -- setup ------------------------------------------------------------------------------
    def init_module(self, *, initialize: bool = True) -> contextlib.AbstractContextManager:
        """Build the model inside this block without memory for its parameters (``with
        session.init_module(): model = build()``): they go on the meta device, and ``setup()``
        materialises only what this rank holds, initialised by each module's ``reset_parameters()``
        and the model's own init, an HF ``_init_weights`` or a model-level ``init_weights()``
        (docs/session.md, "Models larger than one device"). Buffers are kept as built.
        ``initialize=False``: weights will be loaded (``load_weights``), so none is initialised."""
        return empty_parameters(None if initialize else self.strategy.skip_init)

    def load_weights(self, source: Any, model: nn.Module | None = None, *, strict: bool = True) -> None:
        """Put pretrained weights into a model ``setup()`` returned: ``source`` is a state dict, the path
        of a ``.safetensors`` or ``.pt`` file, a Hugging Face model directory (``model.safetensors``, or
        an index and its shards, or ``pytorch_model.bin``), an index file (``*.index.json``), or a list
        of weight files. Rank 0 reads it one tensor at a time, shard after shard, and broadcasts each;
        every rank keeps its share (its shards, its stage). ``strict=False`` skips missing and
        unexpected keys, as ``load_state_dict`` does; shapes must match either way."""
        self._recovery.flush()  # a save the last step asked for holds the weights before this load
        if self._recovery.resumed_from is not None:
            self._weights.filled()
            self.print(self._recovery.after_resume("session.load_weights(...)"))
            return
        self._weights.load(model, source, strict=strict)
        if self._memory_cap is not None:
            self._memory_cap.check("loading holds one tensor at a time on top of the model: raise the cap")
        self._trace_start()  # the weights training starts from are these

    def setup(self, *objects: Any) -> Any:
        """Prepare models, optimizers, DataLoaders and LR schedulers, returned in the order given.

        A shuffling DataLoader is a training loader: its ``batch_size`` is the global batch unless
        ``batch.global_batch_size`` says otherwise. Where a call holds an optimizer and no shuffling
        loader, and no training loader is set up yet, its first DataLoader trains too (ordered data),
        with a line that says so. Every other one is an evaluation loader: its ``batch_size`` is per
        process and ``gather_for_metrics`` makes its results exact; a backward on its batches is
        refused. ``setup_loader(loader, train=...)`` decides explicitly.
        """
        # Models first: a sharding strategy replaces parameters, and optimizers follow them.
        priority = {nn.Module: 0, torch.optim.Optimizer: 1}
        order = sorted(
            range(len(objects)), key=lambda i: next((p for t, p in priority.items() if isinstance(objects[i], t)), 2)
        )
        out: list[Any] = [None] * len(objects)
        roles = self._roles.classify(objects, self._loaders)
        caller = inspect.currentframe().f_back  # where the script may step its schedulers (schedulers.py)
        capped = self._memory_cap is not None and self.state.step == 0
        if capped:
            self._memory_cap.begin_setup()
        for i in order:
            out[i] = self._setup_one(objects[i], caller, *roles.get(i, (False, False)))
        self._batch.finish_setup()
        if not self._seeded and self._models:
            # Every rank built the same initial weights from the same seed; from here on ranks
            # should draw different dropout masks and augmentations. Waiting for the first model
            # lets a script set up its loaders first and build the model after.
            # Tensor peers keep one stream: their replicated activations must stay equal.
            _seed_everything(self.config.train.seed + self.strategy.layout.seed_rank(self.rank))
            self._seeded = True
        self._set_up = True
        self._announce()
        self.strategy.batch_norms.say(self._batch.plan, self.print)  # BatchNorm left per process
        if capped:
            kind, layout = type(self.strategy), self.strategy.layout
            shards = layout.divisor(kind.sharding(self.config.strategy).parameters) > 1
            shards = shards or kind.splits_layers
            self._memory_cap.check_setup(shards_model=shards)
            self._memory_cap.start()  # what training adds counts, not what the script loaded before
        # A resumed run is back at its checkpoint when setup() returns (once all it holds is set up).
        self._recovery.resume_if_set_up()
        self._trace_start()
        return out[0] if len(out) == 1 else tuple(out)

    def _setup_one(self, obj: Any, caller: Any, train: bool, implicit: bool = False) -> Any:
        if isinstance(obj, DataLoader):
            return self._setup_loader(obj, train=train, implicit=implicit)
        if isinstance(obj, nn.Module):
            return self._setup_model(obj)
        if isinstance(obj, torch.optim.Optimizer):
            return self._setup_optimizer(obj)
        if isinstance(obj, (LRScheduler, ReduceLROnPlateau)):
            self._schedulers.add(obj, caller, needs_metric=isinstance(obj, ReduceLROnPlateau))
            return obj
        raise PhalanxError(f"setup() takes models, optimizers, DataLoaders and LR schedulers, not {type(obj).__name__}")

    def set_tp_plan(self, plan: Mapping[str, Any]) -> None:
        """Tensor parallelism's plan in Python, before the model's ``setup()``: module-name glob
        patterns to style names or DTensor ``ParallelStyle`` objects (for what the config's names
        cannot say: input and output layouts). It wins over ``strategy.tp.plan``. Taken under every
        strategy, so the strategy stays one config line; one that splits no layers says so."""
        if self._models:
            raise PhalanxError("session.set_tp_plan() comes before setup() of the model: the plan splits it there")
        self.strategy.given_tp_plan = dict(plan)
        unused = self.strategy.unused_tp_plan_line()
        if unused:
            self.print(unused)

    def setup_loader(self, loader: DataLoader, *, train: bool, fixed_layout: bool = False) -> DeviceLoader:
        """Shard one DataLoader explicitly as a training (``train=True``) or evaluation loader, before
        or after ``setup()``: a training loader set up later completes the batch plan.
        ``fixed_layout``: the loader's batch sizes must not change (``batch.fixed_layout``, docs/data.md)."""
        if fixed_layout:
            if not train:
                raise PhalanxError(
                    "setup_loader(..., fixed_layout=True) is for a training loader: pass train=True, "
                    "or drop fixed_layout (an evaluation loader's batches never change the training)"
                )
            self._batch.fix_layout("setup_loader(..., fixed_layout=True)")
        wrapped = self._setup_loader(loader, train=train, explicit=True)
        if self._set_up:
            self._announce()  # the plan may be new: tune and bench read it from session.json
            self._recovery.resume_if_set_up()
            self._trace_start()
        return wrapped

    def _setup_loader(
        self, loader: DataLoader, *, train: bool, implicit: bool = False, explicit: bool = False
    ) -> DeviceLoader:
        self._roles.before_setup(train)
        dp = self.strategy.data_parallel_size
        if train:
            plan = self._batch.plan_loader(given_global_batch(loader, dp, self.print))
            batch_size, multiple_of = plan.micro_batch_size, plan.global_batch_size
        else:
            # Padding the order to a multiple of the process count gives every rank the same number
            # of batches, so collectives in the evaluation loop line up.
            batch_size, multiple_of = loader.batch_size or 1, dp
        wrapped = shard_loader(
            loader,
            train=train,
            rank=self.strategy.data_parallel_rank,
            world_size=dp,
            batch_size=batch_size,
            multiple_of=multiple_of,
            seed=self.config.train.seed,
            device=self.device,
            options=self.config.data,
            procs_per_node=self.topology.local_world_size,
        )
        wrapped.on_batch = self._on_batch
        wrapped.on_wait = self.metrics.add_wait if train else None
        if wrapped.stream is not None:
            wrapped.stream.say = self.print  # a stream's incomplete last global batch is dropped with a line
        if train and self._batch.joins_forwards and wrapped.stream is None:
            wrapped.group, wrapped.say = self._batch.micro_batches_per_forward, self.print
            # Each forward gathers parameters sharded over the data or pipeline axis (tensor peers
            # see the same batches anyway).
            layout = self.strategy.layout
            wrapped.join_strictly = layout.divisor(a for a in self.strategy.shards.parameters if a != TENSOR) > 1
        if train:
            wrapped.on_start = self._training_pass_starts
            wrapped.on_iterating = lambda _: self.state.restore_rng()
            self.state.add_loader(wrapped)
            if self._step_limit.max_steps is not None:  # asked before every batch: not at all without a limit
                wrapped.stop_when = self._step_limit.reached
        self._loaders.append(wrapped)
        self._roles.taken(wrapped, implicit=implicit, explicit=explicit)
        return wrapped

    def _setup_model(self, model: nn.Module) -> nn.Module:
        model, compiled = self._compute.take_compiled_apart(model)
        self.precision.prepare_model(model)
        if self._memory_cap is not None and self.device.type == "cpu":
            self._memory_cap.add_arrived(materialized_bytes(model))  # what a GPU run would copy onto its device
        model = self.strategy.place(model)
        self._compute.before_wrap(model)
        apply_activation_checkpointing(model, self.config.strategy.activation_checkpointing)
        self.strategy.batch_norms.prepare(model)  # SyncBatchNorm over the data group, on any device
        wrapped = self.strategy.wrap_model(model)
        self._batch.model_wrapped()
        if self.precision.mode != "fp32":
            wrapped.forward = self.precision.wrap_forward(wrapped.forward, autocast=not self.strategy.handles_precision)
        wrapped = self._compute.after_wrap(wrapped, compile_anyway=compiled)
        # The user's methods, attributes and state-dict keys on what they get back (same object).
        wrapped = expose(wrapped, model, self.strategy.direct_calls)
        self._weights.watch(wrapped, model)
        self._models.append(wrapped)
        self.metrics.watch_model(wrapped, self.strategy.unwrap(wrapped))
        return wrapped

    def _setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        optimizer = self._compute.setup_optimizer(optimizer, self.strategy.wrap_optimizer)
        self._guards.guard_optimizer(optimizer)
        self._optimizers.append(optimizer)
        return optimizer

    def _training_pass_starts(self, _: DeviceLoader) -> None:
        self._loop.follows_position()  # its pass goes on from the checkpoint's position
        self._recovery.ensure_resumed()

    def _after_load(self) -> None:
        self._schedulers.mark()
        self._weights.filled()  # a checkpoint fills every tensor, uninitialised ones too

    def _mid_window(self) -> bool:
        return 0 < self.state.micro < self._batch.accumulation_steps

    def _micro_steps_before(self) -> int:
        return self.state.micro - (self._forward_micro if self._in_accumulate else 0)

    def _announce(self) -> None:
        """The console line and session.json: at the first setup, and again whenever a later setup
        call changes the batch plan or the models, so they hold the whole set-up in any order."""
        if not self.is_main:
            return
        now = (self._batch.plan, len(self._models), self._batch.fixed_layout)
        if self._announced is not None:
            if now == self._announced:
                return
            self._announced = now
            update = [describe_model_size(self._models)] if self._models else []
            update += self._batch.describe()
            print("phalanx: set up " + " | ".join(update), flush=True)
            self._write_facts()
            return
        self._announced = now
        parts = [self.strategy.describe(), f"device {self.device.type}", f"precision {self.precision.mode}"]
        if self._models:
            parts.append(describe_model_size(self._models))
        parts += self._batch.describe()
        parts.extend(self._compute.describe())
        if self.config.preset != "none":
            parts.append(f"preset {self.config.preset}")
        print("phalanx: " + " | ".join(parts), flush=True)
        self._write_facts()
        for note in [*self.precision.notes, *self._compute.notes]:
            print(note, flush=True)

    def _write_facts(self) -> None:
        if self._context and self._context.run_dir:
            write_run_facts(
                self._context.run_dir,
                strategy=self.strategy.name,
                strategy_description=self.strategy.describe(),
                device=self.device,
                precision=self.precision.mode,
                batch=self._batch.plan,
                models=self._models,
                lr_scaling=self.lr_scaling.describe() if self.lr_scaling else None,
                config_sources=self.config.sources,
                fixed_layout=self._batch.fixed_layout,
            )

    # -- the loop ---------------------------------------------------------------------------
    def epochs(self, epochs: int | None = None) -> Iterator[int]:
        """Yield epoch numbers, reshuffling every training loader (``set_epoch``) for each."""
        total = self.config.train.epochs if epochs is None else epochs
        self._recovery.ensure_resumed()
        self._loop.follows_count()  # the loop's length is phalanx's
        self.state.epochs_driven = True
        if self.state.resumed and self.state.epoch >= total and not self._step_limit.reached():
            self.print(
                f"phalanx: the checkpoint's run had finished its {self.state.epoch} epoch(s): nothing to train; to "
                "train on, raise the epoch count (train.epochs, or the script's own argument), or start afresh with "
                "checkpoint.resume: never"
            )
        for epoch in range(self.state.epoch, total):
            if self._step_limit.reached():
                return  # the epoch stays where training stopped: a resume with a higher limit goes on from there
            self.state.epoch = epoch
            for loader in self._loaders:
                loader.set_epoch(epoch)
            self.state.restore_rng(at_epoch=True)  # a checkpoint of this epoch's start: its generators
            yield epoch
            self._recovery.flush()  # a save the epoch's last step asked for
            if self.state.micro:
                self._discard_partial_window()
            if self._step_limit.reached() and not self.state.ends_epoch():
                return  # stopped inside the epoch: a save after the loop resumes into its rest
        self.state.epoch = total

    def progress(self, loader: DeviceLoader | DataLoader, description: str | None = None) -> Iterator[Any]:
        """Iterate ``loader``; rank 0 draws a bar with loss and global samples/s."""
        per_rank = loader.batch_size or 1
        dp = self.strategy.data_parallel_size if isinstance(loader, DeviceLoader) else 1
        train = getattr(loader, "train", False)
        if description is None:
            description = f"epoch {self.epoch + 1}/{self.config.train.epochs}" if train else "eval"
        meter = Throughput()
        # Only a loader that joins batches (batch.adaptive) hands out more than one at a time.
        joins = isinstance(loader, DeviceLoader) and loader.group is not None
        try:
            total = len(loader)
        except TypeError:  # an IterableDataset without __len__
            total = None
        yield from track(
            loader,
            total=total,
            samples_per_batch=per_rank * dp,
            joined=(lambda: loader.last_group) if joins else None,
            description=description,
            show=self.is_main and self.config.train.progress,
            loss=self._loss_value if train else (lambda: None),
            meter=meter,
        )
        if train:
            self.last_throughput = meter

    def accumulate(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """One micro-step: gradients are synchronised and the optimizer stepped only on the last
        micro-step of each global batch."""
        return _MicroStep(self._micro_step_starts, self._micro_step_ends, model)

    def _micro_step_starts(self, model: nn.Module) -> contextlib.AbstractContextManager | None:
        """``accumulate()``'s entry; returns the strategy's no_sync context of a micro-step that does
        not synchronise (None on the one that does)."""
        recovery = self._recovery
        if not recovery.resume_checked:
            recovery.ensure_resumed()
        self._count_micro_step()
        self._in_accumulate = True
        return None if self.sync_gradients else self.strategy.no_sync(model)

    def _count_micro_step(self) -> None:
        self._recovery.flush()  # the save the last step asked for, now that its iteration is done
        self._recovery.beat()
        # A forward may hold several of the loader's micro-batches (batch.adaptive joins them):
        # micro-steps count micro-batches, so the window and the loss's share stay the plan's.
        self._forward_micro, self._joined_batch = self._joined_batch, 1
        self.state.micro += self._forward_micro
        self.sync_gradients = self.state.micro >= self._batch.accumulation_steps

    def _short_form_micro_step(self) -> contextlib.AbstractContextManager:
        """``session.backward(loss)`` without the ``accumulate()`` block while the plan accumulates:
        the backward is a micro-step, and ``session.step()`` steps at the window's last one. Its
        forward ran before phalanx knew, so where the forward decides whether gradients are
        synchronised (DDP's reducer) every micro-step synchronises: the same gradients, more traffic."""
        self._count_micro_step()
        self._short_window = True
        if self.sync_gradients:
            return contextlib.nullcontext()
        if not self._short_form_said and self.strategy.ddp_buckets and self.strategy.data_parallel_size > 1:
            self._short_form_said = True
            steps = self._batch.accumulation_steps
            self.print(
                f"phalanx: session.backward(loss) outside `with session.accumulate(model):` with {steps} micro-steps "
                f"per optimizer step: DDP synchronises the gradients of every micro-step ({steps}x the gradient "
                "traffic); the block synchronises only the last"
            )
        stack = contextlib.ExitStack()
        for model in self._models:  # where the backward decides (fsdp, tp), it skips the synchronisation
            stack.enter_context(self.strategy.no_sync(model))
        return stack

    def _micro_step_ends(self, failed: bool) -> None:
        self._in_accumulate = False
        if not failed and self.sync_gradients:
            self.step()  # the public method: every optimizer step goes through it, as a wrapper of it expects

    def backward(self, loss: torch.Tensor, *, items: Any = None) -> None:
        """``loss.backward()`` with the 1/accumulation_steps division (once) and fp16 loss scaling.

        ``items``: ``loss`` is a mean over this many items (tokens, say ``(labels != -100).sum()``);
        the optimizer step's gradient is then the mean over every item of the global batch, across
        micro-steps and processes, and the reported loss is that mean too (session/items.py)."""
        steps = self._batch.accumulation_steps
        if not self._recovery.resume_checked:
            self._recovery.refuse_late_resume("session.backward()")
        windowed = self._in_accumulate
        syncing: contextlib.AbstractContextManager = contextlib.nullcontext()
        if steps > 1 and not windowed:
            syncing, windowed = self._short_form_micro_step(), True
        elif not windowed:
            self._recovery.flush()
        joined = self._forward_micro if windowed else 1
        weighted = items is not None
        if weighted and not self.strategy.weighs_items:
            raise PhalanxError(
                f"strategy {self.strategy.name} cannot weight the loss by items: "
                + self.strategy.advice.get("items", "drop items= (each micro-batch's loss then counts alike)")
            )
        self._roles.check_backward()
        self._items.begin(weighted)
        self._loop.backward_called()
        if not self._loop.loss_checked:
            self._loop.check_loss(loss, steps * self.strategy.data_parallel_size)
        if self.sync_gradients:  # where a fast rank waits for the others (see metrics/straggler.py)
            self.metrics.sync_started()
        first = self.state.micro == joined
        self._gradients.before_backward(self.precision.scaler is not None, windowed and not first)
        where = (self.state.step, first, joined, steps, self.sync_gradients)
        noise = self._batch.noise
        # The probe's calls are skipped, not only empty, where it never measures; and where the short
        # form's micro-steps all synchronised (DDP), no gradient of the window is a rank's own.
        estimates = noise.estimates and not (self._short_window and self.strategy.ddp_buckets)
        if estimates:
            noise.before_backward(*where)
        if weighted:
            scaled = self._items.scaled_loss(loss, items, steps)
            if self.sync_gradients:
                self._items.start_reduce()  # overlaps the gradients' own reduction in the backward
            with syncing:
                self.strategy.backward(scaled, self.precision, 1)
            self._last_loss = self._items.finish(self._models) if self.sync_gradients else loss.detach()
        else:
            # The mean over `joined` micro-batches is `joined` of the step's 1/steps shares.
            with syncing:
                self._last_loss = self.strategy.backward(loss, self.precision, steps / joined if joined > 1 else steps)
        if estimates:
            noise.after_backward(*where, self.precision.scaler, self._items.mean_factor if weighted else None)
        self._gradients.after_backward(self.sync_gradients, self.clip_grad_norm_)
        if self._memory_cap is not None:
            self._memory_cap.check()

    def clip_grad_norm_(self, max_norm: float, model: nn.Module | None = None) -> torch.Tensor | None:
        """Clip the global gradient norm; returns it. Does nothing (returns None) on micro-steps
        whose gradients are not synchronised yet."""
        if not self.sync_gradients:
            return None
        model = model or self._only_model()
        if not self._unscaled:
            for opt in self._optimizers:
                self.precision.unscale(opt)
            self._unscaled = True
        norm = self.strategy.clip_grad_norm_(model, max_norm)
        self.metrics.note_grad_norm(norm)
        return norm

    def step(self) -> None:
        """Optimizer step (with lr scaling and warm-up), scheduler step and zero_grad, once."""
        if not self._recovery.resume_checked:
            self._recovery.refuse_late_resume("session.step()")
        if self._short_window and not self.sync_gradients:
            return  # a micro-step of the short form: the window's last one steps
        if self._in_accumulate:
            raise PhalanxError(
                "session.step() was called inside `with session.accumulate(model):`, whose end steps already "
                "(the optimizer would step twice per global batch); remove it, or call session.backward(loss) and "
                "session.step() without the block"
            )
        self._recovery.flush()
        # Every optimizer step runs what follows: collaborators with nothing to do in a run (no
        # scheduler, no noise probe) are not called at all.
        state, batch, guards, noise = self.state, self._batch, self._guards, self._batch.noise
        self._loop.before_step(batch.accumulation_steps, self._models)
        schedulers = self._schedulers if self._schedulers.stepped_by_phalanx else None
        if schedulers:
            schedulers.before_step()
        estimated = self.metrics.noise_estimated = noise.estimates and noise.measuring(state.step)
        max_norm = self.config.optim.max_grad_norm
        if max_norm is not None and self._gradients.clips_at_step():
            for model in self._models:  # each model's norm separately
                self.clip_grad_norm_(max_norm, model)
        multiplier = batch.step_multiplier(state.step)
        lr = self._optimizers[0].param_groups[0]["lr"] * multiplier if self._optimizers else None
        guards.in_step = True
        try:
            # The default multiplier (1) has no lr to set and restore.
            stepped = self.precision.step(self._optimizers) if multiplier == 1.0 else self._optimizer_step(multiplier)
            if stepped:
                self._loop.at_step()
                state.step += 1
                if self._trace:
                    self._trace.write(state.step)
                if schedulers:
                    schedulers.step(batch.schedule_steps)
            for opt in self._optimizers:
                opt.zero_grad(set_to_none=True)
            self._gradients.after_step()  # without an optimizer: the models' gradients, after the script's update
            self.metrics.noise_taken = noise.taken
            self.metrics.record(stepped, state.step, state.epoch, batch.global_batch_size, self._last_loss, lr)
        finally:
            self._guards.in_step = False
            self.state.micro = 0
            self._unscaled = False
            self._window_done()
        if self._memory_cap is not None:
            self._memory_cap.check()  # the optimizer's state appears at its first step
        if stepped and self.state.step % ITEMS_CHECK_EVERY == 0:
            self._items.check()  # at the same step on every rank: each refuses the run alike
        if stepped and self._replicas is not None:
            self._replicas.after_step(self.state.step)  # the same step on every rank, like the items' check
        if stepped:
            batch.after_step(self._last_loss, self.metrics.last_times, estimated, self._optimizers)
        self._recovery.after_step()

    def _optimizer_step(self, multiplier: float) -> bool:
        """Every optimizer's step at ``multiplier`` times its learning rate (the scaling rule's and
        batch.adaptive's); False when fp16's loss scaler skipped it."""
        base = [[group["lr"] for group in opt.param_groups] for opt in self._optimizers]
        for opt in self._optimizers:
            for group in opt.param_groups:
                group["lr"] = group["lr"] * multiplier
        try:
            return self.precision.step(self._optimizers)
        finally:
            # Restored before the scheduler steps, so it only ever sees its own values.
            for opt, lrs in zip(self._optimizers, base):
                for group, lr in zip(opt.param_groups, lrs):
                    group["lr"] = lr

    def _discard_partial_window(self) -> None:
        # Only reachable with unsharded (iterable) loaders: the last micro-steps were not
        # synchronised, so stepping on them would let ranks diverge.
        self.print(
            f"phalanx: dropping {self.state.micro} micro-step(s) that did not complete a global batch "
            "at the end of the epoch"
        )
        self.state.micro = 0  # first, so the zero_grad guard sees a deliberate reset
        self._window_done()
        for opt in self._optimizers:
            opt.zero_grad(set_to_none=True)
        self._gradients.after_step()

    def _window_done(self) -> None:
        """An accumulation window ended (a step, or one dropped): what each collaborator kept of it goes."""
        self._short_window = False
        self._items.reset()
        self._roles.window_done()
        self._loop.window_done()

    def _loss_value(self) -> float | None:
        return float(self._last_loss) if self._last_loss is not None else None

    def _only_model(self) -> nn.Module:
        if len(self._models) != 1:
            raise PhalanxError(
                "pass the model: session.clip_grad_norm_(max_norm, model) when several models are set up"
            )
        return self._models[0]

    # -- across processes ---------------------------------------------------------------------
    def _on_batch(self, loader: DeviceLoader) -> None:
        self._active_loader = loader
        self._roles.on_batch(loader)
        if loader.train:  # every rank draws its training batches in step (evaluation may be rank 0's alone)
            self._recovery.flush()
        if loader.group is not None:  # only a training loader's batches are joined; evaluation's never count
            self._joined_batch = loader.last_group
        self._recovery.beat()

    def reduce(self, value: Any, op: str = "mean", *, items: Any = None) -> Any:
        """All-reduce a tensor or number over the data-parallel processes: op is sum | mean | max | min.
        ``items``: ``value`` is a mean over this many items (tokens) on this process; the result is
        the mean over every process's items (op mean only)."""
        if items is not None:
            if op != "mean":
                raise PhalanxError(f"session.reduce(value, op={op!r}, items=n): items weight a mean; use op='mean'")
            return weighted_mean(value, items, **self._collective_args())
        return collectives.reduce(value, op, **self._collective_args())

    def gather_for_metrics(self, tensor: torch.Tensor | float | int | tuple | list) -> Any:
        """Call it on every evaluation batch: it gathers that batch's tensor from every process, in
        dataset order, without the samples the sampler padded in; so metrics over an evaluation loader
        equal single-process ones exactly. A Python number or 0-d tensor gives a 1-d tensor of every
        process's value, in rank order; a tuple or list, a tuple of each entry gathered."""
        return collectives.gather_in_order(tensor, loader=self._active_loader, **self._collective_args())

    def shard(self, *tensors: torch.Tensor, dim: int = 0, micro_steps: bool = False) -> Any:
        """This rank's share of tensors already in memory: along ``dim``, its slots of each global
        batch, micro-step after micro-step (docs/data.md#tensors-already-in-memory). ``micro_steps``: a
        tensor one global batch wide (a stream's columns) as a list of one piece per micro-step, in the
        order they run."""
        s = self.strategy
        self._split_tensors = True
        return shard_tensors(
            tensors,
            dim=dim,
            rank=s.data_parallel_rank,
            world_size=s.data_parallel_size,
            plan=self._batch.plan,
            micro_steps=micro_steps,
        )

    def _collective_args(self) -> dict[str, Any]:
        dp = self.strategy.data_parallel_size
        return {"data_parallel_size": dp, "group": self.strategy.data_group, "comm_device": self.topology.comm_device}

    def barrier(self) -> None:
        if not self.state.at_epoch_end():  # there, what the epoch's closing code does after it belongs in too
            self._recovery.flush()
        if self.world_size > 1 and dist.is_initialized():
            dist.barrier()
        self._recovery.beat()

    # -- output -----------------------------------------------------------------------------
    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only."""
        if self.is_main:
            print(*args, **kwargs, flush=True)

    def log(self, **metrics: Any) -> None:
        """Print metrics on rank 0 and append them to ``<run dir>/metrics.jsonl`` when launched."""
        if not self.is_main:
            return
        values = {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()}
        record = {"time": time.time(), "step": self.state.step, "epoch": self.epoch, **values}
        print("  ".join(f"{k} {_fmt(v)}" for k, v in values.items()), flush=True)
        if self._context and self._context.run_dir:
            with open(f"{self._context.run_dir}/metrics.jsonl", "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")

    # -- models out ---------------------------------------------------------------------------
    def unwrap(self, model: nn.Module) -> nn.Module:
        return self.strategy.unwrap(model)

    def model_state_dict(self, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """Full weights of the bare model (no ``module.`` prefix), loadable into a plain nn.Module."""
        return self.strategy.model_state_dict(model or self._only_model())

    # -- checkpoints ----------------------------------------------------------------------------
    def save(self) -> Path:
        """Write a full checkpoint (models, optimizers, schedulers, scaler, counters, data position,
        every rank's RNG) into ``checkpoint.dir``, atomically; every rank must call it. Returns its directory."""
        return self._recovery.save()

    def load(self, path: str | Path | None = None, *, weights_only: bool = False) -> Path:
        """Restore from checkpoint ``path`` (default: the latest in ``checkpoint.dir``); every rank
        must call it, after setup(). ``weights_only``: only the models' weights (e.g. to fine-tune)."""
        loaded = self._recovery.load(path, weights_only)
        self._trace_start()
        return loaded

    def _trace_start(self) -> None:
        """train.weights_trace: the weights training starts from, after anything that sets them."""
        if self._trace:
            self._trace.start(self.state.step)

    def _checkpointed(self) -> TrainingObjects:
        return TrainingObjects(
            models=self._models,
            optimizers=self._optimizers,
            schedulers=self._schedulers.all,
            state=self.state,
            precision=self.precision,
            internal_steps=self._guards.stepping,
            facts={"global_batch_size": self._batch.global_batch_size, "precision": self.precision.mode},
        )

    # -- teardown -----------------------------------------------------------------------------
    def close(self, *, sync: bool = True) -> None:
        """Leave the process group; ``sync`` waits for every rank first (see Strategy.teardown)."""
        if not self._closed:
            if sync:
                self._recovery.flush()  # the run's last step asked for a checkpoint
            else:
                dropped = self._recovery.dropped()
                if dropped:
                    self.print(dropped)
            self._closed = True
            problem = self._items.close()
            if problem:
                self.print(f"phalanx: {problem}")
            for loader in self._loaders:
                loader.close()
            self.metrics.close()
            self._recovery.close()
            self.strategy.teardown(sync=sync)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(sync=exc_type is None)


class _MicroStep:
    """``with session.accumulate(model):``, a class rather than a generator context manager: it is
    entered on every micro-step, and a generator's machinery costs microseconds each time."""

    __slots__ = ("starts", "ends", "model", "inner")

    def __init__(self, starts: Any, ends: Any, model: nn.Module):
        self.starts, self.ends, self.model, self.inner = starts, ends, model, None

    def __enter__(self) -> None:
        self.inner = self.starts(self.model)
        if self.inner is not None:
            try:
                self.inner.__enter__()
            except BaseException:
                self.ends(True)
                raise

    def __exit__(self, kind: Any, error: Any, trace: Any) -> bool:
        try:
            if self.inner is not None:
                self.inner.__exit__(kind, error, trace)
        except BaseException:
            self.ends(True)
            raise
        self.ends(kind is not None)
        return False


def _close_ref(ref: "weakref.ref[Session]") -> None:
    # At interpreter exit, perhaps after an error: other ranks may never reach a barrier.
    session = ref()
    if session is not None:
        session.close(sync=False)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
