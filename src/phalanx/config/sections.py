"""The config's typed sections. Field descriptions double as the comments of `phalanx config init`."""

from __future__ import annotations

import math
import re
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from phalanx.config.batch import parse_schedule
from phalanx.util.sizes import size_bytes

# Every whole number ends up in a C integer somewhere (a seed, a tensor size, a timeout); beyond
# 64 bits it would overflow there, long after the config was accepted.
INT64 = (-(2**63), 2**63 - 1)
A_WEEK = 7 * 24 * 3600.0  # seconds: the longest timeout that still means something
MAX_NPROC = 1024  # processes on one machine: beyond any node's GPUs or cores
MAX_NNODES = 65536
CONTROL_CHARACTERS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")  # and str.splitlines()'s line breaks


class Section(BaseModel):
    # allow_inf_nan: inf, nan and 1e400 (inf once parsed) are refused by every float setting: no
    # setting means anything at infinity, and each would fail later where it becomes an int.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _representable(cls, value):
        # Beside the numbers, text: no setting means a control character, a NUL byte fits in no
        # path nor environment variable (the workers get the --set lines in one), and a line break
        # would split the one-line error that names the value.
        for item in value if isinstance(value, list) else (value,):
            if isinstance(item, int) and not isinstance(item, bool) and not INT64[0] <= item <= INT64[1]:
                raise ValueError(f"must be between {INT64[0]} and {INT64[1]} (a 64-bit integer)")
            if isinstance(item, str) and CONTROL_CHARACTERS.search(item):
                raise ValueError("must not contain control characters or line breaks")
        return value


class TPConfig(Section):
    """The tensor-parallel axis of the layout: read by every strategy, used by those that hold it
    (tp, and fsdp as its 2-D form); the others refuse a size above 1."""

    size: Optional[int] = Field(
        None,
        gt=0,
        description=(
            "tensor-parallel peers per model replica, within one node (null: 1, except under strategy tp: "
            "every process)"
        ),
    )
    plan: dict[str, Literal["colwise", "rowwise", "sequence_parallel", "replicate"]] = Field(
        default_factory=dict,
        description=(
            "module-name glob pattern -> colwise | rowwise | sequence_parallel | replicate, e.g. "
            "{'*.up': colwise, '*.down': rowwise} (empty: the model's own tp_plan, else the MLP pairs found)"
        ),
    )

    @field_validator("plan")
    @classmethod
    def _patterns(cls, value):
        for pattern in value:
            if not pattern.strip() or CONTROL_CHARACTERS.search(pattern):
                raise ValueError(f"pattern {pattern!r} must be a non-empty module-name glob on one line")
        return value


class StrategyConfig(Section):
    """What every strategy reads. Each strategy's own options section (``strategy.ddp``, ...) is
    declared next to the strategy and added here when the strategy registers (schema.py's
    ``register_strategy_options``): this layer sits below the strategies and cannot import them."""

    name: str = Field("auto", description="auto (the strategies add their names when they register)")
    activation_checkpointing: list[str] = Field(
        default_factory=list,
        description=(
            "module class names whose activations are recomputed in backward instead of stored, e.g. [TransformerBlock]"
        ),
    )

    tp: TPConfig = Field(default_factory=TPConfig)

    @model_validator(mode="before")
    @classmethod
    def _strategies_registered(cls, data):
        # With only the fields above no strategy has registered (phalanx.strategies not imported):
        # such a tree would lack strategy.ddp and the rest, and fail far from here, so none is built.
        if set(cls.model_fields) == EVERY_STRATEGY:
            named = sorted(set(data) - EVERY_STRATEGY) if isinstance(data, dict) else []
            what = f"strategy.{named[0]} is a strategy's own section, and the" if named else "The"
            raise ValueError(
                f"{what} strategies add their sections when phalanx.strategies is imported (phalanx.Config "
                "and phalanx.Session import it); import phalanx.strategies before building a Config from phalanx.config"
            )
        return data


# The fields of StrategyConfig that are no strategy's own.
EVERY_STRATEGY = frozenset(StrategyConfig.model_fields)


class BatchConfig(Section):
    global_batch_size: Optional[int] = Field(
        None,
        gt=0,
        description="samples per optimizer step over all devices (null: the training DataLoader's batch_size)",
    )
    micro_batch_size: Optional[int] = Field(
        None, gt=0, description="samples per device per forward (null: global_batch_size / data-parallel processes)"
    )
    max_micro_batch_size: Optional[int] = Field(
        None,
        gt=0,
        description=(
            "largest micro batch that fits one device; the micro batch is then the largest divisor of the "
            "per-process share up to it, for any process count (phalanx tune writes it; null: no limit)"
        ),
    )
    fixed_layout: bool = Field(
        False,
        description=(
            "the script's data layout depends on its own batch sizes: refuse config values, bench weak scaling "
            "and tune trials that would change its global batch or micro batch (see docs/data.md)"
        ),
    )
    adaptive: Optional[Literal["goodput"]] = Field(
        None,
        description=(
            "re-choose the global batch during training for goodput, from the gradient noise scale and the "
            "step times: goodput (accumulation steps change, the micro-batch stays; docs/goodput.md); null: off"
        ),
    )
    adapt_every: int = Field(50, gt=0, description="optimizer steps between two choices of batch.adaptive")
    adaptive_max_global_batch: Optional[int] = Field(
        None, gt=0, description="largest global batch batch.adaptive may choose (null: 8 times the starting one)"
    )
    adaptive_step_times: Optional[list[float]] = Field(
        None,
        description=(
            "[seconds per micro-step, fixed seconds per optimizer step]: batch.adaptive's throughput model, given "
            "instead of fitted to the run's step times and measured at each multiple, so its choices are "
            "reproducible (null: fitted, then measured)"
        ),
    )
    adaptive_loss_check: bool = Field(
        True,
        description=(
            "batch.adaptive grows the batch only while the training loss measurably falls, and goes back when a "
            "larger batch stalls it (docs/goodput.md); false: the noise scale alone decides (a loss too noisy "
            "to read progress from)"
        ),
    )
    schedule: Optional[Union[str, list[str]]] = Field(
        None,
        description=(
            "grow the global batch at given steps, a scheduled batch warm-up that needs no noise scale: "
            "x<multiple>@<step or percent of train.max_steps>, e.g. 'x2@30%,x4@60%' (docs/goodput.md); null: off"
        ),
    )

    @field_validator("adaptive_step_times")
    @classmethod
    def _two_times(cls, value):
        if value is not None and (len(value) != 2 or value[0] <= 0 or value[1] < 0):
            raise ValueError("adaptive_step_times must be [seconds per micro-step > 0, fixed seconds per step >= 0]")
        return value

    @field_validator("schedule")
    @classmethod
    def _schedule_entries(cls, value):
        if value is not None:
            parse_schedule(value)  # the one-line ValueError says what is wrong
        return value

    @model_validator(mode="after")
    def _one_batch_rule(self):
        if self.adaptive is not None and self.schedule is not None:
            raise ValueError(
                "batch.schedule grows the batch at fixed points and batch.adaptive chooses it from the noise scale; "
                "set one of them to null"
            )
        return self


class OptimConfig(Section):
    lr_scaling: Literal["none", "linear", "sqrt"] = Field(
        "none",
        description="scale the learning rate with global_batch_size / reference_batch_size: none | linear | sqrt",
    )
    reference_batch_size: Optional[int] = Field(
        None,
        gt=0,
        description="batch size the learning rate was tuned for (null: the training DataLoader's batch_size)",
    )
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warm-up of the scaled learning rate")
    warmup_start_factor: Optional[float] = Field(
        None,
        ge=0,
        le=1,
        description=(
            "warm-up starts at this fraction of the target lr "
            "(null: the unscaled lr when scaling, as in Goyal et al. 2017, else 0)"
        ),
    )
    max_grad_norm: Optional[float] = Field(
        None, gt=0, description="clip the global gradient norm before every optimizer step (null: no clipping)"
    )


class PrecisionConfig(Section):
    mode: Literal["fp32", "bf16", "fp16", "fp64"] = Field(
        "fp32",
        description=(
            "fp32 | bf16 | fp16 (autocast; fp16 adds a GradScaler) | fp64 (float64 weights and inputs: "
            "for phalanx verify --fp64's comparisons, not for training)"
        ),
    )
    tf32: bool = Field(
        False,
        description=(
            "allow TF32 matmuls and convolutions on CUDA (faster on Ampere and newer, ~1e-3 relative error); "
            "false keeps PyTorch's defaults"
        ),
    )
    cudnn_benchmark: bool = Field(
        False, description="let cuDNN pick the fastest convolution algorithms for fixed input shapes"
    )


class DataConfig(Section):
    num_workers: Optional[Union[int, Literal["auto"]]] = Field(
        None,
        description=(
            "loader worker processes per rank, or auto (this node's cores / its ranks - 1, at most 8) "
            "(null: keep the DataLoader's own)"
        ),
    )
    pin_memory: Optional[bool] = Field(
        None,
        description=(
            "page-locked host memory for faster copies (null: on with CUDA when the batches come out of the "
            "loader on the CPU; true with batches already on the GPU is refused)"
        ),
    )
    persistent_workers: Optional[bool] = Field(
        None, description="keep loader workers alive between epochs (null: on when the loader has workers)"
    )
    prefetch_factor: Optional[int] = Field(
        None,
        gt=0,
        description=(
            "batches each worker loads ahead; only for loaders with workers (null: the DataLoader's own, 2 by default)"
        ),
    )
    prefetch_to_device: bool = Field(
        True, description="CUDA: copy the next batch to the GPU on a side stream while the current one computes"
    )
    drop_last: bool = Field(
        False,
        description=(
            "drop the last incomplete global batch of each epoch instead of filling it with samples from the start"
        ),
    )

    @field_validator("num_workers", mode="before")
    @classmethod
    def _worker_count(cls, value):
        if value is None or value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            return value
        raise ValueError("num_workers must be a whole number >= 0, auto, or null")

    @field_validator("persistent_workers", "prefetch_factor")
    @classmethod
    def _needs_workers(cls, value, info: ValidationInfo):
        # Only where the file says 0 itself: with null or auto the count is known at setup().
        if value and info.data.get("num_workers") == 0:
            raise ValueError(
                f"{info.field_name} applies to loader worker processes, but data.num_workers is 0; "
                f"raise data.num_workers or set data.{info.field_name} to null"
            )
        return value


class ComputeConfig(Section):
    compile: bool = Field(
        False,
        description=(
            "torch.compile the model after the strategy wraps it "
            "(the first steps are slow while it compiles; strategies auto, single, ddp, zero1, fsdp)"
        ),
    )
    compile_mode: Literal["default", "reduce-overhead", "max-autotune"] = Field(
        "default",
        description=(
            "torch.compile mode: default | reduce-overhead (CUDA graphs) | "
            "max-autotune (longer compile, faster kernels)"
        ),
    )
    channels_last: bool = Field(
        False,
        description=(
            "convolution weights and 4-D input batches in channels-last memory format "
            "(faster convolutions on tensor-core GPUs)"
        ),
    )
    optimizer_impl: Optional[Literal["auto", "foreach", "fused", "loop"]] = Field(
        None,
        description=(
            "optimizer kernels: auto (fused where the optimizer and device have them, else foreach on CUDA) | "
            "foreach | fused | loop (null: as the optimizer was built)"
        ),
    )


class TrainConfig(Section):
    epochs: int = Field(1, gt=0, description="epochs that session.epochs() yields")
    max_steps: Optional[int] = Field(
        None,
        gt=0,
        description=(
            "end training after this many optimizer steps: epochs() and the training loaders end there "
            "(phalanx bench and tune set it for their runs; null: no limit)"
        ),
    )
    seed: int = Field(
        0, description="seed for model init, shuffling and every rank's RNG (rank-offset where it must differ)"
    )
    weights_trace: Optional[str] = Field(
        None,
        description=(
            "directory into which rank 0 writes every model's full weights after each optimizer step, for "
            "phalanx verify to compare (it sets this; a full gather per step: for checks, not for training)"
        ),
    )
    progress: bool = Field(True, description="rank-0 progress bar with loss and samples/s")
    metrics: bool = Field(True, description="per-step metrics JSONL in the run dir and the end-of-run summary")
    tensorboard: bool = Field(True, description="also write TensorBoard scalars when tensorboard is installed")
    profile: Optional[str] = Field(
        None, description="torch.profiler trace of optimizer steps A to B-1, e.g. 'steps=5:8' (null: no profiling)"
    )
    profile_ranks: list[int] = Field(default_factory=lambda: [0], description="ranks that write a profile trace")
    memory_cap: Optional[Union[int, str]] = Field(
        None,
        description=(
            "largest memory each rank may use, e.g. '2GiB' "
            "(CUDA: the allocator's limit; CPU: growth of peak resident memory since session.setup()); "
            "over it, torch.OutOfMemoryError (null: no cap)"
        ),
    )
    noise_scale: Union[bool, Literal["hook"]] = Field(
        True,
        description=(
            "estimate the gradient noise scale (the batch size beyond which more samples per step buy little) "
            "from the gradients each step has, into the metrics and the run summary (docs/goodput.md); "
            "hook: also under ddp/zero1 without accumulation, through a Python comm hook in place of DDP's "
            "built-in all-reduce (it costs step time)"
        ),
    )
    noise_scale_every: int = Field(10, gt=0, description="optimizer steps between two noise-scale estimates")
    noise_scale_smoothing: float = Field(
        0.95,
        gt=0,
        lt=1,
        description="moving-average factor per estimate of the noise scale's two parts (0.95: about 20 estimates)",
    )

    @field_validator("memory_cap")
    @classmethod
    def _size(cls, value):
        if isinstance(value, bool) or (isinstance(value, int) and value <= 0):
            raise ValueError("memory_cap must be a positive size such as '2GiB', '512MiB' or a number of bytes")
        if isinstance(value, str) and not _size_in_int64(value):
            raise ValueError(f"memory_cap '{value}' is not a size; write e.g. '2GiB', '512MiB' or a number of bytes")
        return value


def _size_in_int64(text: str) -> bool:
    try:
        return 0 < (size_bytes(text) or 0) <= INT64[1]
    except OverflowError:  # hundreds of digits read as a float: inf
        return False


class CheckpointConfig(Section):
    dir: str = Field(
        "checkpoints",
        description="where checkpoints go (one directory per save, plus a 'latest' pointer); shared by every node",
    )
    save_every: Optional[Union[int, str]] = Field(
        None,
        description=(
            "save automatically every N optimizer steps (e.g. 500) or every period of time ('30m', '2h'); "
            "null: only when session.save() is called"
        ),
    )
    keep_last: Optional[int] = Field(
        3, gt=0, description="complete checkpoints to keep; older ones are deleted after each save (null: keep all)"
    )
    resume: str = Field(
        "auto",
        description=(
            "auto: continue from the latest complete checkpoint in dir when there is one and this run wrote it "
            "(the same settings that count and the same script: docs/checkpoints.md) | never | the path of a checkpoint"
        ),
    )
    resume_any_run: bool = Field(
        False,
        description=(
            "resume: auto continues from the latest checkpoint even when another run wrote it (other settings "
            "that count, another script or its arguments); false: such a checkpoint stops the launch"
        ),
    )
    ignore_args: list[str] = Field(
        default_factory=list,
        description=(
            "script options (e.g. ['--eval-every', '-v']) that, like --epochs, --print-freq or --resume, only "
            "lengthen or observe training: resume: auto ignores them and their values when it compares the "
            "script's arguments with a checkpoint's (added to the built-in list in docs/checkpoints.md)"
        ),
    )

    @field_validator("ignore_args")
    @classmethod
    def _options(cls, value):
        for name in value:
            if not name.startswith("-") or "=" in name or name.strip("-") == "":
                raise ValueError(f"ignore_args holds option names like '--eval-every' or '-v', not '{name}'")
        return value

    @field_validator("save_every")
    @classmethod
    def _period(cls, value):
        if isinstance(value, bool) or (isinstance(value, int) and value <= 0):
            raise ValueError("save_every must be a positive number of steps or a period like '30m'")
        if isinstance(value, str) and parse_period(value) is None:
            raise ValueError(f"save_every '{value}' is neither a number of steps nor a period like '45s', '30m', '2h'")
        return value


def parse_period(text: str) -> float | None:
    """'90s' / '30m' / '2h' (also 'min') -> seconds; a bare number is steps, not a period."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h)\s*", text, re.ASCII)
    if not match or not 0 < float(match.group(1)) < math.inf:  # 400 nines read as inf
        return None
    return float(match.group(1)) * {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}[match.group(2)]


class FaultsConfig(Section):
    hang_timeout: float = Field(
        300.0,
        ge=0,
        le=A_WEEK,
        description=(
            "seconds without progress (no step, batch or collective finishing) "
            "after which every rank's stack is printed and the job stopped (the first optimizer step has "
            "first_step_timeout); 0 turns the watchdog off"
        ),
    )
    first_step_timeout: float = Field(
        1800.0,
        ge=0,
        le=A_WEEK,
        description=(
            "the watchdog's limit from the start of training until the first optimizer step finishes "
            "(compilation, autotuning, the first collectives), at least hang_timeout; 0: no limit before the first step"
        ),
    )
    preempt_grace: float = Field(
        60.0,
        gt=0,
        le=A_WEEK,
        description="seconds a SIGTERM'd job gets to finish its step and write a checkpoint before it is killed",
    )
    replica_check_every: int = Field(
        100,
        ge=0,
        description=(
            "optimizer steps between two comparisons of the data-parallel replicas' weights, which must stay "
            "equal; a replica that drifts apart stops the job in one line; 0 turns the check off"
        ),
    )


class LaunchConfig(Section):
    """What ``phalanx launch`` starts; each flag of it is a shorthand for one of these (--nproc 4 is
    --set launch.nproc=4), so a run's config.yaml holds them too."""

    nproc: Optional[int] = Field(
        None,
        gt=0,
        le=MAX_NPROC,
        description="processes per node (null: one per visible GPU, or 2 on a CPU-only machine)",
    )
    gpus: Optional[str] = Field(None, description="comma-separated GPU indices to use, e.g. '0,2' (null: all visible)")
    cpu: bool = Field(
        False, description="run CPU processes on gloo even when GPUs are present (gpus must then be null)"
    )
    ranks: Literal["0", "all"] = Field(
        "0", description="whose output the terminal shows: 0 (rank 0 only) or all (each line prefixed [rank N])"
    )
    run_dir: str = Field("runs", description="where each run's directory (logs, resolved config) is created")
    max_restarts: int = Field(
        0,
        ge=0,
        description=(
            "restart the whole job this many times after a failure; each restart resumes from the latest checkpoint "
            "(under a node range, a node that is lost, leaves or joins costs none)"
        ),
    )
    nnodes: Union[int, str] = Field(
        1,
        description=(
            "machines in the job: N, or MIN:MAX for an elastic job that goes on while nodes leave and join "
            "(multi-node: also node_rank and master, or rdzv_endpoint)"
        ),
    )
    rendezvous_timeout: int = Field(
        600,
        gt=0,
        le=int(A_WEEK),
        description="under a node range: seconds the rendezvous waits for MIN nodes to join, at the start and "
        "after a node is lost; a job that cannot form in time ends with exit code 1",
    )
    late_node_wait: int = Field(
        10,
        ge=1,
        le=int(A_WEEK),
        description="under a node range: seconds the rendezvous waits for more nodes (up to MAX) once MIN are there",
    )
    node_timeout: int = Field(
        15,
        ge=3,
        le=3600,
        description="under a node range: seconds without a heartbeat after which a node counts as lost",
    )
    node_rank: Optional[int] = Field(
        None, ge=0, lt=MAX_NNODES, description="this machine's index, 0..nnodes-1, with master (static rendezvous)"
    )
    master: Optional[str] = Field(
        None, description="host:port of node 0, where the rendezvous store listens (static rendezvous, with node_rank)"
    )
    rdzv_endpoint: Optional[str] = Field(
        None, description="host:port of torch elastic's c10d rendezvous (dynamic: node ranks are assigned on arrival)"
    )
    rdzv_id: Optional[str] = Field(
        None, description="job id that every node passes to the c10d rendezvous (null: SLURM_JOB_ID, else 'phalanx')"
    )
    verbose: bool = Field(False, description="also show torch elastic's own log lines, and the run time at the end")
    check: bool = Field(
        True,
        description=(
            "run phalanx check on the script before any worker starts: its findings are shown, and an error "
            "stops the launch (false, or --no-check: launch anyway)"
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _numbers_as_text(cls, data):
        # YAML reads `ranks: 0` and `gpus: 1` as ints; accept them.
        if isinstance(data, dict):
            data = {
                **data,
                **{
                    k: str(data[k])
                    for k in ("ranks", "gpus")
                    if isinstance(data.get(k), int) and not isinstance(data.get(k), bool)
                },
            }
        return data

    @field_validator("gpus")
    @classmethod
    def _gpu_list(cls, value):
        if value is not None:
            gpu_indices(value)
        return value

    @field_validator("nnodes", mode="before")
    @classmethod
    def _node_count(cls, value):
        if isinstance(value, str) and ":" in value:
            low, _, high = value.partition(":")
            if not (re.fullmatch(r" *[0-9]{1,5} *", low) and re.fullmatch(r" *[0-9]{1,5} *", high)):
                raise ValueError("expects N or MIN:MAX (e.g. 1:4)")
            low_n, high_n = int(low), int(high)
            if not 1 <= low_n <= high_n <= MAX_NNODES:
                raise ValueError(f"expects MIN:MAX with 1 <= MIN <= MAX <= {MAX_NNODES} (e.g. 1:4)")
            return low_n if low_n == high_n else f"{low_n}:{high_n}"
        if isinstance(value, str) and re.fullmatch(r" *[-+]?[0-9]+ *", value):
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError("expects N or MIN:MAX (e.g. 1:4)")
        if value < 1:
            raise ValueError("must be at least 1")
        if value > MAX_NNODES:
            raise ValueError(f"must be at most {MAX_NNODES}")
        return value

    def node_range(self) -> tuple[int, int]:
        """(MIN, MAX) nodes: the same number twice for a fixed count."""
        if isinstance(self.nnodes, str):
            low, _, high = self.nnodes.partition(":")
            return int(low), int(high)
        return self.nnodes, self.nnodes

    @field_validator("master", "rdzv_endpoint")
    @classmethod
    def _host_port(cls, value):
        if value is not None:
            host, sep, port = value.rpartition(":")
            if not sep or not host.strip("[]") or not re.fullmatch(r"[0-9]{1,5}", port) or not 0 < int(port) < 65536:
                raise ValueError("expects HOST:PORT with a port 1-65535 (e.g. node01:29500)")
        return value

    @model_validator(mode="after")
    def _cpu_or_gpus(self):
        if self.cpu and self.gpus is not None:
            raise ValueError(
                f"launch.cpu runs CPU processes only, but launch.gpus picks GPUs '{self.gpus}'; drop one of the two"
            )
        return self


def gpu_indices(text: str) -> list[int]:
    """``'0,2'`` -> ``[0, 2]``; ValueError (a phrase that follows the setting's name) otherwise."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts or not all(re.fullmatch(r"[0-9]{1,9}", part) for part in parts):
        raise ValueError("expects comma-separated GPU indices such as 0,2")
    ids = [int(part) for part in parts]
    if len(set(ids)) != len(ids):
        raise ValueError("names a GPU twice")
    return ids


# Sections that accept a bare value in code as shorthand for one field: Session(strategy="ddp").
SHORTHAND = {"strategy": "name", "precision": "mode"}


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out
