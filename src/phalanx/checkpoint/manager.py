"""What a checkpoint of a Session holds, and how every rank writes and restores its part.

    manifest.json   counters, layout, model shapes, every file's size and SHA-256 (written last)
    trainer.pt      step, epoch, data positions, schedulers, grad scaler       (rank 0)
    rng.pt          every rank's Python / NumPy / torch / CUDA generator states (gathered to rank 0)
    model.pt        plain layout: full model state dicts                       (rank 0)
    optimizer.pt    plain layout: full optimizer state dicts                   (rank 0)
    shards/         dcp layout: torch.distributed.checkpoint, each rank its own shards
    hf/model<i>/    a Hugging Face model's config.json and generation_config.json  (rank 0)

Everything is loaded with ``weights_only=True`` (model.pt and optimizer.pt memory-mapped, see
:meth:`Checkpointer._load_plain`) or phalanx's allow-listed DCP reader.
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import nn

from phalanx.checkpoint import contents, files, hf_model
from phalanx.errors import PhalanxError
from phalanx.topology import Topology
from phalanx.util.words import plural
from phalanx.version import __version__

TRAINER, RNG, MODEL, OPTIMIZER, SHARDS = "trainer.pt", "rng.pt", "model.pt", "optimizer.pt", "shards"


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TrainingObjects:
    """Everything a checkpoint holds, handed over explicitly by whoever trains (the Session).

    ``state``: the training state (step, epoch, data positions and, per rank, ``rng``: see
    session/state.py); ``internal_steps``: a context in which an optimizer.step() that torch's
    checkpoint helpers may call (once, with zero lr, to create the state they fill) is allowed.
    ``facts``: what the manifest records about the run besides (global batch size, precision)."""

    models: Sequence[nn.Module]
    optimizers: Sequence[torch.optim.Optimizer]
    schedulers: Sequence[Any]
    state: Stateful
    precision: Stateful
    internal_steps: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    facts: dict[str, Any] = field(default_factory=dict)


class Checkpointer:
    """Writes and restores checkpoints of :class:`TrainingObjects` through a strategy (which knows
    how its models and optimizers are laid out over the ranks). Every method is a collective."""

    def __init__(
        self,
        strategy: Any,
        topology: Topology,
        *,
        run_dir: str | None = None,
        keep_last: int | None = None,
        job: str | None = None,
    ):
        self.strategy = strategy
        self.topology = topology
        self.run_dir = run_dir
        self.job = job  # the launch's id, shared by every node of an elastic job across its rounds
        self.keep_last = keep_last

    def save(self, root: Path, objects: TrainingObjects, run: dict[str, Any] | None = None) -> Path:
        """Write a complete checkpoint of ``objects`` under ``root``; returns its directory. ``run``:
        the run it belongs to (checkpoint/run_identity.py), recorded in the manifest."""
        strategy, topo = self.strategy, self.topology
        train = dict(objects.state.state_dict())
        mine_rng = train.pop("rng")
        staging = files.staging_path(root, train["step"])
        if topo.is_main:
            shutil.rmtree(staging, ignore_errors=True)  # a save of this step that was killed earlier
            staging.mkdir(parents=True)
        self._barrier()
        with objects.internal_steps():
            if strategy.checkpoint_layout == "plain":
                models = [strategy.model_state_dict(m) for m in objects.models]
                optims = [strategy.optimizer_state_dict(_model_of(objects, o), o) for o in objects.optimizers]
                if topo.is_main:
                    _save(models, staging / MODEL)
                    _save(optims, staging / OPTIMIZER)
            else:
                import torch.distributed.checkpoint as dcp

                dcp.save(self._dcp_state(objects), storage_writer=dcp.FileSystemWriter(str(staging / SHARDS)))
        shapes = self._all_shapes(objects)
        sizes = [self._numel(m) for m in objects.models]
        tied = [
            [g for g in ([n for n in group if n in saved] for group in self._tied(m)) if len(g) > 1]
            for m, saved in zip(objects.models, shapes)
        ]
        rngs = self._gather_all(mine_rng)
        if topo.is_main:
            self._save_hf_files(objects, staging)
            trainer = {
                **train,
                "schedulers": [sched.state_dict() for sched in objects.schedulers],
                "precision": objects.precision.state_dict(),
            }
            _save(trainer, staging / TRAINER)
            _save({"world_size": topo.world_size, "ranks": rngs}, staging / RNG)
        self._barrier()
        # Each rank hashes a share of the files; rank 0 records them all in the manifest.
        names = files.data_files(staging)
        mine = {name: files.describe_file(staging / name) for name in names[topo.rank :: topo.world_size]}
        described: dict[str, Any] = {}
        for part in self._gather_all(mine):
            described.update(part or {})
        final = root / files.step_name(train["step"])
        if topo.is_main:
            manifest = self._manifest(objects, train, shapes, sizes, tied, described)
            final = files.commit(staging, {**manifest, "run": run})
            files.prune(root, self.keep_last)
        self._barrier()
        return final

    def load(
        self, path: Path, objects: TrainingObjects, *, weights_only: bool = False, say: Callable[[str], None] = print
    ) -> dict[str, Any]:
        """Restore ``objects`` from checkpoint ``path``. ``weights_only``: the models' weights and
        nothing else (a fine-tuning start). Returns the manifest."""
        # Imported here: torch.distributed.checkpoint takes a second to import, and most runs never load.
        from phalanx.checkpoint.safe import load_file

        manifest = self._agreed_manifest(path)
        directory = Path(manifest["path"])
        strategy = self.strategy
        layout = manifest["layout"]
        # Sharded checkpoints reshard (torch.distributed.checkpoint): fsdp, tp and fsdp x tp resume
        # one another's at any process count, and a whole-model strategy reads them whole. Whole
        # files hold integer-keyed optimizer state that no sharded layout can place.
        if layout == "plain" and strategy.checkpoint_layout == "dcp":
            raise PhalanxError(
                f"checkpoint '{directory}' was written by strategy {manifest['strategy']} "
                f"({files.describe_layout(layout)}); this run uses "
                f"{strategy.name} ({files.describe_layout(strategy.checkpoint_layout)}): "
                f"resume with a strategy that keeps whole files (single, ddp, zero1, ...), "
                f"or export its weights (`phalanx checkpoint export {directory} model.pt`) "
                "and load them with session.load_weights()"
            )
        self._check_models(objects, manifest, directory)
        _check_optimizers(objects, manifest, directory, weights_only)
        with objects.internal_steps():
            if layout == "plain":
                self._load_plain(objects, directory, weights_only)
            else:
                self._load_dcp(objects, directory / SHARDS, weights_only, whole=strategy.checkpoint_layout == "plain")
        if not weights_only:
            trainer = contents.trainer(load_file(directory / TRAINER), directory / TRAINER)
            saved = contents.rng(load_file(directory / RNG), directory / RNG)
            world, was = self.topology.world_size, saved["world_size"]
            # Rank r's streams are rank r's job only while the model-parallel groups stay the same:
            # a tensor peer must draw what its peers draw.
            split_then = was // max(1, manifest.get("data_parallel_size") or was)
            split_now = world // max(1, strategy.data_parallel_size)
            if split_then != split_now:
                say(
                    f"phalanx: the checkpoint's model-parallel groups had {split_then} processes, this run's have "
                    f"{split_now}: random generators start fresh (dropout masks differ from an uninterrupted run; "
                    "the data order does not)"
                )
                was = 0  # no rank restores its generators
            elif was != world:
                kept = "rank 0 keeps its" if min(was, world) == 1 else f"ranks 0-{min(was, world) - 1} keep their"
                new = f"rank {was}" if world == was + 1 else f"ranks {was}-{world - 1}"
                fresh = "" if world <= was else f", {new} start{'s' if world == was + 1 else ''} from train.seed"
                say(
                    f"phalanx: the checkpoint was written by {plural(was, 'process')}, this run has {world}: "
                    f"{kept} random generators{fresh} (dropout masks differ from an uninterrupted run; "
                    "the data order does not)"
                )
            _restore_schedulers(objects, trainer["schedulers"])
            objects.precision.load_state_dict(trainer["precision"])
            # A rank the checkpoint had continues its own streams; one it did not keeps its seed's.
            mine = saved["ranks"][self.topology.rank] if self.topology.rank < was else None
            objects.state.load_state_dict(
                {
                    "step": trainer["step"],
                    "epoch": trainer["epoch"],
                    "data": trainer["data"],
                    "rng": mine,
                    "noise_scale": _noise_state(trainer.get("noise_scale")),
                    "adaptive_batch": _adaptive_state(trainer.get("adaptive_batch"), directory / TRAINER),
                    "kept": trainer.get("kept"),  # session.keep()'s values
                    "epoch_start": trainer.get("epoch_start", False),
                }
            )
        return manifest

    # -- pieces of a checkpoint -------------------------------------------------------------------
    def _save_hf_files(self, objects: TrainingObjects, staging: Path) -> None:
        """A Hugging Face model's configs, for `phalanx checkpoint export --format hf` (rank 0 only:
        the bare model's config is the same object on every rank)."""
        for index, model in enumerate(objects.models):
            for name, text in hf_model.hf_files(self.strategy.unwrap(model)).items():
                path = staging / hf_model.stored_as(index, name)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text, encoding="utf-8")

    def _load_plain(self, objects: TrainingObjects, directory: Path, weights_only: bool) -> None:
        """Every rank maps the full files rather than reading them: the pages are shared through the
        page cache, so host memory does not grow with the processes on a node. The models copy the
        weights into their own parameters; the optimizer state a rank keeps (all of it, or its zero1
        shard) gets its own memory before the files are let go."""
        from phalanx.checkpoint.safe import load_mapped, own_memory

        strategy = self.strategy
        models, _ = load_mapped(directory / MODEL)
        models = contents.models(models, len(objects.models), directory / MODEL)
        for model, state in zip(objects.models, models):
            _load_model(strategy, model, state, directory / MODEL)
        models = state = None  # let go before the optimizer file is loaded (a plain read holds one at a time)
        if weights_only:
            return
        optims, mapped = load_mapped(directory / OPTIMIZER)
        optims = contents.optimizers(optims, len(objects.optimizers), directory / OPTIMIZER)
        for opt, state in zip(objects.optimizers, optims):
            _load_optimizer(strategy, _model_of(objects, opt), opt, state, directory / OPTIMIZER)
        own_memory([c for opt in objects.optimizers for c in (opt.state, strategy.optimizer_state(opt))], mapped)

    def _dcp_state(self, objects: TrainingObjects, whole: bool = False, weights_only: bool = False) -> dict[str, Any]:
        """What torch.distributed.checkpoint fills. ``whole``: for a strategy of the plain layout,
        which reads a sharded checkpoint into its whole tensors (the bare model's own, so the load
        lands in place) and its optimizer state keyed by parameter names."""
        strategy = self.strategy
        state: dict[str, Any] = {
            f"model{i}": strategy.unwrap(m).state_dict() if whole else strategy.sharded_model_state_dict(m)
            for i, m in enumerate(objects.models)
        }
        for j, opt in enumerate([] if weights_only else objects.optimizers):
            model = _model_of(objects, opt)
            state[f"optim{j}"] = (
                strategy.named_optimizer_state_dict(model, opt) if whole else strategy.optimizer_state_dict(model, opt)
            )
        return state

    def _load_dcp(self, objects: TrainingObjects, directory: Path, weights_only: bool, *, whole: bool) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        from phalanx.checkpoint.safe import SafeLoadPlanner, SafeReader

        strategy = self.strategy
        state = self._dcp_state(objects, whole, weights_only)
        SafeReader(str(directory)).read_metadata()  # a bad file fails here, before torch logs its fallbacks
        try:
            with warnings.catch_warnings():
                # One process without a group (single, dp) reads a sharded checkpoint whole: as meant.
                warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
                dcp.load(state, storage_reader=SafeReader(str(directory)), planner=SafeLoadPlanner())
        except CheckpointException as err:
            # torch wraps each rank's exception (phalanx's own say what is wrong with the files).
            inner = [f[0] if isinstance(f, tuple) else f for f in err.failures.values()]
            first = next((e for e in inner if isinstance(e, PhalanxError)), inner[0] if inner else err)
            text = str(first).strip().splitlines()[-1] if str(first).strip() else type(first).__name__
            raise PhalanxError(
                text if isinstance(first, PhalanxError) else f"cannot read the sharded checkpoint '{directory}': {text}"
            ) from None
        if not whole:  # whole tensors were filled in place
            for i, model in enumerate(objects.models):
                strategy.load_sharded_model_state_dict(model, state[f"model{i}"])
        if not weights_only:
            load = strategy.load_named_optimizer_state_dict if whole else strategy.load_optimizer_state_dict
            for j, opt in enumerate(objects.optimizers):
                with _same_group_dicts(opt):
                    load(_model_of(objects, opt), opt, state[f"optim{j}"])

    def _manifest(
        self,
        objects: TrainingObjects,
        train: dict[str, Any],
        shapes: list[dict[str, list[int]]],
        sizes: list[int],
        tied: list[list[list[str]]],
        described: dict[str, Any],
    ) -> dict[str, Any]:
        """Written by rank 0 alone: nothing in here may call a collective."""
        strategy = self.strategy
        return {
            "format": files.FORMAT,
            "version": files.VERSION,
            "created": files.timestamp(),
            "phalanx": __version__,
            "torch": torch.__version__,
            "step": train["step"],
            "epoch": train["epoch"],
            "strategy": strategy.name,
            "run_dir": self.run_dir,
            "job": self.job,
            "nodes": self.topology.nnodes,
            "layout": strategy.checkpoint_layout,
            "world_size": self.topology.world_size,
            "data_parallel_size": strategy.data_parallel_size,
            # Axes with more than one rank and their sizes ({"dp_shard": 2, "tp": 2}): what world_size alone hides.
            "axes": {axis: strategy.layout.size(axis) for axis in strategy.layout.used},
            "global_batch_size": objects.facts.get("global_batch_size"),
            "precision": objects.facts.get("precision"),
            "data": train["data"],
            # tied: the names of one tensor (an embedding the output layer shares), the one an export keeps first
            "models": [{"parameters": n, "shapes": s, "tied": t} for n, s, t in zip(sizes, shapes, tied)],
            "optimizers": optimizer_names(objects),
            # What a resume waits for before it restores the run (session/recovery.py).
            "schedulers": len(objects.schedulers),
            "files": described,
        }

    def _tied(self, model: nn.Module) -> list[list[str]]:
        return hf_model.tied_groups(self.strategy.unwrap(model), self.strategy.weight_slots(model))

    def _numel(self, model: nn.Module) -> int:
        local = sum(p.numel() for p in self.strategy.unwrap(model).parameters())
        # DTensor parameters (fsdp) report their global size; pipeline stages hold disjoint parts.
        return sum(self._gather_all(local)) if self.strategy.splits_layers else local

    def _all_shapes(self, objects: TrainingObjects) -> list[dict[str, list[int]]]:
        """Every model's parameter and buffer shapes under the bare model's names (all ranks' keys)."""
        out = []
        for model in objects.models:
            state = self.strategy.sharded_model_state_dict(model)
            own = {k: list(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
            merged: dict[str, list[int]] = {}
            for part in self._gather_all(own) if self.strategy.checkpoint_layout == "dcp" else [own]:
                merged.update(part or {})
            out.append(merged)
        return out

    def _check_models(self, objects: TrainingObjects, manifest: dict[str, Any], directory: Path) -> None:
        saved = manifest["models"]
        if len(saved) != len(objects.models):
            raise PhalanxError(
                f"checkpoint '{directory}' holds {len(saved)} model(s), this run set up {len(objects.models)}"
            )
        for index, (model_info, shapes) in enumerate(zip(saved, self._all_shapes(objects))):
            problem = shape_mismatch(model_info["shapes"], shapes)
            if problem:
                which = f"model {index}" if len(saved) > 1 else "the model"
                raise PhalanxError(
                    f"checkpoint '{directory}' does not fit {which}: {problem}; "
                    "load it into the architecture that saved it"
                )

    # -- agreement between ranks ------------------------------------------------------------------
    def _agreed_manifest(self, path: Path) -> dict[str, Any]:
        """Rank 0 reads the manifest, every rank verifies a share of the files; all raise the same error."""
        answer: Any = None
        if self.topology.is_main:
            try:
                answer = files.read_manifest(files.resolve(path))
            except PhalanxError as err:
                answer = str(err)
        answer = self._broadcast(answer)
        if isinstance(answer, str):
            raise PhalanxError(answer)
        manifest = answer
        directory = Path(manifest["path"])
        names = sorted(manifest["files"])
        mine = files.verify(directory, manifest, names[self.topology.rank :: self.topology.world_size])
        problems = [p for p in self._gather_all(mine) if p]
        if problems:
            raise PhalanxError(problems[0])
        return manifest

    def _distributed(self) -> bool:
        return self.topology.world_size > 1 and dist.is_initialized()

    def _barrier(self) -> None:
        if self._distributed():
            dist.barrier()

    def _broadcast(self, value: Any) -> Any:
        if not self._distributed():
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _gather_all(self, value: Any) -> list[Any]:
        if not self._distributed():
            return [value]
        out: list[Any] = [None] * self.topology.world_size
        dist.all_gather_object(out, value)
        return out


def _restore_schedulers(objects: TrainingObjects, saved: list[dict]) -> None:
    if len(saved) != len(objects.schedulers):
        raise PhalanxError(
            f"the checkpoint holds {len(saved)} LR scheduler(s), this run set up {len(objects.schedulers)}; "
            "set up the same schedulers as the run that saved it"
        )
    for sched, state in zip(objects.schedulers, saved):
        sched.load_state_dict(state)


@contextlib.contextmanager
def _same_group_dicts(optimizer) -> Iterator[None]:
    """torch's load_state_dict puts new dicts into param_groups. Sharding strategies rebuild the
    optimizer on the user's group dicts, which the user's LR scheduler keeps writing to; so the
    loaded values go into those dicts, and those dicts stay the ones in use."""
    before = list(optimizer.param_groups)
    yield
    for old, new in zip(before, optimizer.param_groups):
        if old is not new:
            old.update(new)
    optimizer.param_groups[:] = before


def _load_model(strategy, model: nn.Module, state: dict, path: Path) -> None:
    try:
        strategy.load_model_state_dict(model, state)
    except (ValueError, KeyError, RuntimeError) as err:  # keys or shapes the manifest did not describe
        raise PhalanxError(
            f"the weights in '{path}' do not fit the model ({str(err).strip().splitlines()[0]}); "
            "use an earlier checkpoint, or load it into the architecture that saved it"
        ) from None


def _load_optimizer(strategy, model: nn.Module, optimizer, state: dict, path: Path) -> None:
    try:
        with _same_group_dicts(optimizer):
            strategy.load_optimizer_state_dict(model, optimizer, state)
    except (ValueError, KeyError, RuntimeError) as err:
        raise PhalanxError(
            f"optimizer state in '{path}' does not fit this run's optimizer ({str(err).splitlines()[0]}); "
            "build the optimizer as the run that saved it did"
        ) from None


def shape_mismatch(saved: dict[str, list[int]], current: dict[str, list[int]]) -> str | None:
    """A one-line description of how two models' state shapes differ, or None."""
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    resized = [
        f"{k} {saved[k]} in the checkpoint, {current[k]} here" for k in current if k in saved and saved[k] != current[k]
    ]
    parts = []
    if missing:
        parts.append(f"{len(missing)} key(s) missing from the checkpoint ({_few(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected key(s) ({_few(unexpected)})")
    if resized:
        parts.append(f"{len(resized)} shape(s) differ ({_few(resized)})")
    return "; ".join(parts) or None


def _check_optimizers(objects: TrainingObjects, manifest: dict[str, Any], directory: Path, weights_only: bool) -> None:
    if weights_only:
        return
    here = optimizer_names(objects)
    if manifest["optimizers"] != here:
        raise PhalanxError(
            f"checkpoint '{directory}' holds optimizer(s) {manifest['optimizers'] or 'none'}, "
            f"this run set up {here or 'none'}; "
            "set up the same optimizers, or load only the weights: session.load(path, weights_only=True)"
        )


def optimizer_names(objects: TrainingObjects) -> list[str]:
    # ZeroRedundancyOptimizer wraps the user's class: the inner one is what must match.
    return [type(getattr(o, "optim", o)).__name__ for o in objects.optimizers]


def _few(items: list[str], n: int = 3) -> str:
    return ", ".join(items[:n]) + (", ..." if len(items) > n else "")


def _model_of(objects: TrainingObjects, optimizer) -> nn.Module:
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in objects.models:
        if any(id(p) in params for p in model.parameters()):
            return model
    return objects.models[0]


def _save(obj: Any, path: Path) -> None:
    with open(path, "wb") as fh:
        torch.save(obj, fh)


def _noise_state(value: Any) -> dict[str, Any] | None:
    """The noise-scale averages of a checkpoint, or None for one without them (or with a damaged
    entry: they are statistics, and an estimate that starts afresh costs nothing)."""
    keys = ("count", "g2", "trace")
    if isinstance(value, dict) and all(isinstance(value.get(k), (int, float)) for k in keys):
        return value
    return None


def _adaptive_state(value: Any, path: Path) -> dict[str, Any] | None:
    """batch.adaptive's choices in a checkpoint. Unlike the noise scale's statistics they decide
    the batches that follow, so a damaged entry is refused rather than started afresh."""
    if value is None:
        return None
    ok = (
        isinstance(value, dict)
        and isinstance(value.get("k"), int)
        and value["k"] > 0
        and isinstance(value.get("gain"), (int, float))
        and isinstance(value.get("history"), list)
        and (value.get("model") is None or isinstance(value.get("model"), (list, tuple)))
        and isinstance(value.get("measured", []), list)
        and all(
            isinstance(m, (list, tuple)) and len(m) == 2 and all(isinstance(x, (int, float)) for x in m)
            for m in value.get("measured", [])
        )
    )
    if not ok:
        raise PhalanxError(
            f"checkpoint file '{path}' holds a damaged batch.adaptive state ({type(value).__name__}); "
            "use an earlier checkpoint"
        )
    return value
