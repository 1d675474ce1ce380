"""The surface every strategy offers the Session; a new strategy is one small subclass.

A strategy also declares what it can do, as class attributes (the capabilities block below).
Every other layer reads those instead of comparing strategy names: the launcher's and the
Session's checks (checks.py), the planner, tune, the metrics. A subclass sets only what differs.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from phalanx._torch_compat import set_group_timeout
from phalanx.config.batch import BatchPlan, plan_batch
from phalanx.config.schema import Config
from phalanx.config.sections import BatchConfig, Section, StrategyConfig
from phalanx.errors import ConfigError
from phalanx.runtime.noise_scale import squared_norm
from phalanx.strategies import dtensor_state
from phalanx.strategies.collective_timeout import collective_timeout
from phalanx.strategies.construction import Materializer, is_deferred
from phalanx.strategies.parallel_layout import AXES, DATA_AXES, TENSOR, ParallelLayout
from phalanx.strategies.plan_rows import PlanRow
from phalanx.strategies.sync_batchnorm import BatchNorms
from phalanx.topology import Topology

PRECISIONS = ("fp32", "bf16", "fp16", "fp64")  # precision.mode values, in the order messages list them


@dataclass(frozen=True)
class Sharding:
    """What a strategy divides among its processes, at the peak of a training step: for each kind
    of state, the layout axes (parallel_layout.AXES) it is divided over; empty: every rank holds
    it whole. Divided over ``tp``, only the layers the tensor-parallel plan splits are divided."""

    parameters: tuple[str, ...] = ()
    gradients: tuple[str, ...] = ()
    optimizer: tuple[str, ...] = ()
    # Parameters are stored sharded, but the gathered compute copy of every one stays from forward
    # until backward (FSDP without resharding): at the peak they are whole, shards besides.
    keeps_gathered: bool = False


class Strategy:
    name: ClassVar[str]

    # -- capabilities ---------------------------------------------------------------------
    # How many processes per node the launcher starts: None means one per device.
    processes_per_node: ClassVar[int | None] = None
    # True when its one process computes on every visible GPU (dp, model_parallel): see devices.
    drives_every_gpu: ClassVar[bool] = False
    # True when the strategy casts parameters itself, so the Session does not add autocast.
    handles_precision: ClassVar[bool] = False
    # True when the strategy calls collectives even in a single process (DDP, ZeRO, FSDP).
    needs_process_group: ClassVar[bool] = False
    # How checkpoints hold model and optimizer state: "plain" (full state dicts, written by rank 0)
    # or "dcp" (each rank writes its own shards with torch.distributed.checkpoint).
    checkpoint_layout: ClassVar[str] = "plain"
    # precision.mode values it trains under.
    precisions: ClassVar[frozenset[str]] = frozenset(PRECISIONS)
    # compute.compile / compute.channels_last apply to its wrapped model.
    supports_compile: ClassVar[bool] = True
    supports_channels_last: ClassVar[bool] = True
    # What it shards (see sharding(), for strategies whose settings change it).
    shards: ClassVar[Sharding] = Sharding()
    # Gradients go through DDP's bucketed all-reduce: strategy.ddp's buckets and comm_hook apply.
    ddp_buckets: ClassVar[bool] = False
    # The unwrapped model is this process's whole model on its one device, and a forward of it
    # alone starts no collective (so it may run on one rank only, e.g. to count FLOPs).
    local_forward: ClassVar[bool] = False
    # The model must be an nn.Sequential (its forward applies its children in order).
    needs_sequential: ClassVar[bool] = False
    # Each process holds its own run of the model's layers (pipeline stages): parameters and
    # stored activations are disjoint across ranks, and a model's size is their sum.
    splits_layers: ClassVar[bool] = False
    # What a method of the user's model, reached through the model setup() returns, may do when it
    # runs the model's layers itself (self(...), self.encoder(...)) and so bypasses the wrapper
    # (strategies/surface.py): "any" (nothing is lost, or there is no wrapper), "no_grad" (the
    # wrapper synchronises gradients: refused while autograd records a trainable layer), "none"
    # (the layers are split over processes: always refused).
    direct_calls: ClassVar[str] = "any"
    # In the no-sync micro-steps of accumulation, each parameter's .grad holds this rank's own
    # gradient (what the gradient noise scale takes as its small batch; runtime/noise_scale.py).
    # False where gradients accumulate elsewhere (fsdp: unsharded, inside FSDP) or are a stage's.
    local_micro_step_gradients: ClassVar[bool] = True
    # session.backward(loss, items=n) works: the loss the script computes is what is back-propagated
    # (not replayed per chunk), so it can be weighted by its items.
    weighs_items: ClassVar[bool] = True
    # What a refusal for a missing capability adds after naming it: why, and the fix; keyed by
    # the setting refused ("precision.mode", "compute.channels_last", ...). checks.py writes a
    # generic fix where a strategy gives none.
    advice: ClassVar[dict[str, str]] = {}

    # The layout axes it uses (parallel_layout.AXES): its data axis (dp_replicate or dp_shard, or
    # none where every rank sees the same batch), and tp / pp where it splits the model.
    axes: ClassVar[tuple[str, ...]] = ("dp_replicate",)
    # strategy.tp.size null means every process of a node (tp), rather than 1.
    tp_by_default: ClassVar[bool] = False

    # -- what the strategy owns besides its code --------------------------------------------
    # Its options section, ``strategy.<options_key>`` in the config (the registry adds it to the
    # tree). A subclass inherits its parent's (zero1 reads strategy.ddp).
    options_key: ClassVar[str | None] = None
    options: ClassVar[type[Section] | None] = None
    # Settings of that section that do something only under a capability: setting -> (the
    # capability, what the setting does). checks.py refuses them, set, under a strategy without it.
    options_apply: ClassVar[dict[str, tuple[str, str]]] = {}
    # Its rows in `phalanx plan` (none: the plan leaves it out). A subclass that inherits rows
    # declares its own (zero1 does): the registry refuses a row label twice.
    plan_rows: ClassVar[tuple[PlanRow, ...]] = ()
    # Options of its section that change the numbers trained (lossy gradient compression, the dtype
    # gradients are reduced in): a checkpoint resumes only a run with the same values
    # (checkpoint/run_identity.py). A subclass inherits its parent's with the section (zero1: ddp's).
    resume_counted: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def counted_settings(cls) -> list[str]:
        """The flat config keys of ``resume_counted`` (``strategy.ddp.comm_hook``, ...)."""
        return [f"strategy.{cls.options_key}.{option}" for option in cls.resume_counted if cls.options_key]

    @classmethod
    def sharding(cls, settings: StrategyConfig) -> Sharding:
        """What this strategy shards under ``settings`` (the config's ``strategy`` section)."""
        return cls.shards

    @classmethod
    def micro_batch_multiple(cls, config: Config, world_size: int) -> int:
        """The micro-batch size on ``world_size`` processes must be a multiple of this (pipeline:
        its pipeline micro-batches)."""
        return 1

    @classmethod
    def plan_batch(
        cls,
        config: Config,
        world_size: int,
        global_batch_size: int | None,
        batch: BatchConfig | None = None,
        per_node: int | None = None,
    ) -> BatchPlan:
        """The batch plan on ``world_size`` processes (``per_node`` on each node, where known) from
        ``batch``'s sizes (default: the config's) and ``global_batch_size``: what the Session trains
        with, and what the launcher checks before any worker starts."""
        b = batch or config.batch
        return plan_batch(
            cls.layout_for(config, world_size, per_node).dp_size,
            global_batch_size,
            b.micro_batch_size,
            b.max_micro_batch_size,
            multiple_of=cls.micro_batch_multiple(config, world_size),
        )

    @classmethod
    def check_settings(cls, config: Config, world_size: int | None, device: str | None) -> None:
        """Refuse this strategy's own settings that cannot work (checks.py calls it, with the
        process count and "cuda"/"cpu" where they are known). Nothing by default."""

    def __init__(self, config: Config, topology: Topology):
        self.config = config
        self.topology = topology
        self.layout = type(self).layout_for(config, topology.world_size, topology.local_world_size)
        self._mesh: Any = None
        # Tensor parallelism's plan given in Python (session.set_tp_plan), which wins over the config's.
        self.given_tp_plan: dict[str, Any] | None = None
        self._owns_process_group = False
        self._materializers: list[Materializer] = []  # one per deferred model (see construction.py)
        # Modules built under init_module(initialize=False): materialised, never initialised.
        self.skip_init: weakref.WeakSet = weakref.WeakSet()
        # SyncBatchNorm layers made to work on this device over the data group, before each wrap.
        self.batch_norms = BatchNorms(
            topology.device, self.layout.dp_size, lambda: self.data_group, topology.comm_device
        )

    @property
    def splits_by_tp_plan(self) -> bool:
        """Whether setup() splits the model with the tensor-parallel plan (tp; fsdp in 2-D)."""
        return False

    def unused_tp_plan_line(self) -> str | None:
        """The line that says a plan given in Python does nothing here, or None where it splits the
        model: set_tp_plan() is taken under every strategy, so one script runs under each of them."""
        if self.splits_by_tp_plan:
            return None
        size = f" with strategy.tp.size {self.layout.tp}" if TENSOR in self.axes else ""
        return (
            f"phalanx: strategy {self.name}{size} splits no layers over tensor-parallel peers; "
            "session.set_tp_plan() is kept for strategy tp, or fsdp with strategy.tp.size > 1"
        )

    # -- launcher side --------------------------------------------------------------------
    @classmethod
    def check_world(cls, world_size: int) -> None:
        """Refuse a process count this strategy cannot use, before anything starts."""
        if cls.processes_per_node is not None and world_size != cls.processes_per_node:
            other = cls.advice.get("launch.nproc")  # the strategy's own way out, e.g. another strategy
            raise ConfigError(
                f"strategy '{cls.name}' runs in {cls.processes_per_node} process, not {world_size}; "
                f"launch with --set strategy.name={cls.name} (so the launcher starts one process) "
                f"or --nproc {cls.processes_per_node}" + (f", {other}" if other else "")
            )

    @classmethod
    def layout_for(cls, config: Config, world_size: int, per_node: int | None = None) -> ParallelLayout:
        """How ``world_size`` processes (``per_node`` on each node, where known) split into this
        strategy's axes under ``config``; refuses, in one line, sizes that cannot split."""
        tp = config.strategy.tp.size
        if tp is None:
            tp = (per_node or world_size) if cls.tp_by_default else 1
        if tp > 1 and TENSOR not in cls.axes:  # checks.py names the strategies that do
            raise ConfigError(f"strategy {cls.name} has no tensor-parallel axis; set strategy.tp.size: 1")
        pp = world_size if "pp" in cls.axes else 1  # pipeline: every rank a stage, seeing the same batch
        data = next((a for a in cls.axes if a in DATA_AXES), DATA_AXES[0])
        return ParallelLayout.of(world_size, data_axis=data, tp=tp, pp=pp, per_node=per_node)

    # -- worker side ----------------------------------------------------------------------
    @property
    def data_parallel_size(self) -> int:
        return self.layout.dp_size

    @property
    def data_parallel_rank(self) -> int:
        return self.layout.dp_rank(self.topology.rank)

    @property
    def data_group(self) -> Any:
        """The process group of this rank's data-parallel peers (None: every process, the default
        group): what the Session's reduce, gather and item counts go over."""
        if self.layout.dp_size in (1, self.topology.world_size):
            return None
        return self.mesh.get_group(next(a for a in DATA_AXES if self.layout.size(a) > 1))

    def replica_group(self) -> Any:
        """The process group of the ranks that each hold a copy of this rank's local parameters (and
        tensor slices), which must stay equal bit for bit (faults/replicas.py compares them); None
        where no other rank holds one. The replicate axis: ddp's and zero1's ranks, tp's replicas.
        fsdp's data axis shards parameters, and pipeline stages hold different layers: none there."""
        if self.layout.dp_replicate == 1:
            return None
        return self.data_group or dist.group.WORLD

    @property
    def replicates_optimizer_state(self) -> bool:
        """Whether the optimizer state this rank holds is copied on the rest of replica_group()
        (zero1 shards it over them instead)."""
        return "dp_replicate" not in self.sharding(self.config.strategy).optimizer

    @property
    def mesh(self) -> Any:
        """The DeviceMesh over the layout's used axes (made once, after the process group)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            names = tuple(a for a in AXES if self.layout.size(a) > 1 or a in self.axes)
            self._mesh = init_device_mesh(
                self.topology.device.type, tuple(self.layout.size(a) for a in names), mesh_dim_names=names
            )
            if self._owns_process_group:  # a group the script made keeps the script's timeouts
                for name in names:
                    set_group_timeout(self._mesh.get_group(name), collective_timeout(self.config.faults))
        return self._mesh

    @property
    def devices(self) -> list[torch.device]:
        """Every device this process computes on (its own; every visible GPU where one process drives
        them all): what memory is measured and capped on, and whose random generators a checkpoint keeps."""
        if self.drives_every_gpu and self.topology.device.type == "cuda":
            return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        return [self.topology.device]

    def setup_environment(self) -> None:
        """Join (or create) the process group when there is more than one process, or when the
        strategy needs one even alone."""
        self.check_world(self.topology.world_size)
        if self.topology.device.type == "cuda":
            # Also where the script made the process group itself, or runs alone: torch's bare
            # "cuda" (and every library kernel) means the current device, which is cuda:0 otherwise.
            torch.cuda.set_device(self.topology.device)
        alone = self.topology.world_size == 1
        if dist.is_initialized() or (alone and not self.needs_process_group):
            return
        nccl = self.topology.backend == "nccl"
        backend = "cpu:gloo,cuda:nccl" if nccl else "gloo"  # gloo takes CUDA tensors too (gloo_on_cuda)
        kwargs: dict[str, Any] = {"timeout": collective_timeout(self.config.faults)}
        if nccl:  # binds NCCL's communicator to this GPU; gloo has none to bind
            kwargs["device_id"] = self.topology.device
        if alone:
            kwargs["store"] = dist.HashStore()  # in memory: no launcher variables, no network port
        elif self.topology.agent_store is not None:
            kwargs["store"] = _attempt_store(*self.topology.agent_store, self.topology)
        dist.init_process_group(backend, rank=self.topology.rank, world_size=self.topology.world_size, **kwargs)
        self._owns_process_group = True
        if "tp" in self.layout.used or len(self.layout.used) > 1:
            self.mesh  # made by every rank at the same point: its groups are collectives of the world

    def place(self, model: nn.Module) -> nn.Module:
        """Put the model on this process's device (before wrapping); a deferred one is materialised
        there directly, whole (strategies that hold a part of it override this)."""
        if is_deferred(model):
            self.materializer(model).materialize(model, self.topology.device)
            return model
        return model.to(self.topology.device)

    def materializer(self, model: nn.Module, *, in_place: bool = True) -> Materializer:
        """The materializer of ``model`` (the user's whole model): made once, kept for uninitialised()."""
        for existing in self._materializers:
            if existing.root is model:
                return existing
        self._materializers.append(
            Materializer(model, self.config.train.seed, in_place=in_place, skip_init=self.skip_init, strategy=self.name)
        )
        return self._materializers[-1]

    def uninitialised(self, model: nn.Module) -> dict[str, list[str]]:
        """Modules of the deferred ``model`` (the user's, as given to setup()) left without initial
        weights (nothing initialised them): module name -> its tensors' names. load_weights fills them."""
        return next((dict(m.uninitialised) for m in self._materializers if m.root is model), {})

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def backward(self, loss: torch.Tensor, precision, accumulation_steps: int) -> torch.Tensor:
        """Backward of one micro-step (loss divided once by the accumulation steps); returns the
        loss to report."""
        precision.backward(loss / accumulation_steps if accumulation_steps > 1 else loss)
        return loss.detach()

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Context in which backward does not synchronise gradients (all but the last micro-step)."""
        return contextlib.nullcontext()

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        params = [p for p in model.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def gradient_sq(self, models: list[nn.Module]) -> torch.Tensor:
        """The squared norm of the models' synchronised gradients (float64), the same on every rank."""
        grads = [p.grad for m in models for p in m.parameters() if p.grad is not None]
        return squared_norm([dtensor_state.local(g) for g in grads])

    # Where the synchronising backward measures this rank's own gradient before it is averaged
    # (runtime/noise_scale.LocalNorms, armed by the Session); None where the strategy cannot (then
    # only accumulation's micro-steps give the noise scale its small batch).
    local_norms: Any = None

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full state dict of the bare model: loadable into a plain ``nn.Module``, no ``module.`` prefix."""
        return self.unwrap(model).state_dict()

    def sharded_model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """What torch.distributed.checkpoint saves: each rank's own shards (the full dict when unsharded)."""
        return self.model_state_dict(model)

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        self.unwrap(model).load_state_dict(state)

    def load_sharded_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load what torch.distributed.checkpoint filled into ``sharded_model_state_dict``'s layout."""
        self.load_model_state_dict(model, state)

    def weight_slots(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Every tensor of the whole model's state dict under its name, as this rank holds it: the
        tensor itself (a shard for sharding strategies, with the full shape), or an empty meta tensor
        of its shape where another rank holds it. session.load_weights() fills them."""
        return self.unwrap(model).state_dict(keep_vars=True)

    def put_weight(self, slot: torch.Tensor, value: torch.Tensor) -> None:
        """Copy the full tensor ``value`` into ``slot`` (this rank's share of it), casting its dtype."""
        with torch.no_grad():
            slot.copy_(value)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """For checkpoints. Plain layout: the full state (rank 0's is written); dcp layout: this
        rank's part keyed by parameter names, so it reshards. Called on every rank."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        optimizer.load_state_dict(state)

    def named_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer's state keyed by parameter names, as sharded checkpoints hold it: what a
        strategy of the plain layout fills from one (an fsdp or tp run's checkpoint, resumed here)."""
        return dtensor_state.optimizer_state_dict(self.unwrap(model), optimizer)

    def load_named_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        dtensor_state.load_optimizer_state_dict(self.unwrap(model), optimizer, state)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer state this rank holds (its shard, for sharding strategies)."""
        return optimizer.state

    def held_bytes(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state that this rank holds itself."""
        params = list(model.parameters())
        state = self.optimizer_state(optimizer) if optimizer is not None else {}
        return {
            "parameters": sum(_nbytes(p) for p in params),
            "gradients": sum(_nbytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(
                _nbytes(v)
                for per_param in state.values()
                for v in per_param.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0
            ),
        }

    def teardown(self, *, sync: bool = True) -> None:
        """Leave the process group. ``sync``: first wait for every rank, so no rank tears its
        connections down while another still uses them (only on a clean exit: after an error the
        other ranks may never arrive)."""
        self.batch_norms.close()
        if self._owns_process_group and dist.is_initialized():
            if sync:
                # Alone too: the barrier waits for the group's queued work (a DDP bucket's last
                # all-reduce), whose release in a gloo thread needs the GIL; a model collected
                # later, while that thread still held it, deadlocked tearing the group down.
                dist.barrier()
            dist.destroy_process_group()
        self._owns_process_group = False

    def describe(self) -> str:
        return self.name


def _attempt_store(host: str, port: int, topology: Topology) -> dist.Store:
    """The agent's store, under a prefix per restart: torch elastic keeps one store for the whole
    job, and after a restart the new workers would otherwise read the dead workers' addresses."""
    store = dist.TCPStore(host, port, topology.world_size, is_master=False)
    return dist.PrefixStore(f"phalanx/attempt{topology.restart_count}", store)


def _nbytes(tensor: torch.Tensor) -> int:
    local = dtensor_state.local(tensor)
    return local.numel() * local.element_size()
