"""What a checkpoint of a Session holds, and how every rank writes and restores its part.

    manifest.json   counters, layout, model shapes, every file's size and SHA-256 (written last)
    trainer.pt      step, epoch, data positions, schedulers, grad scaler       (rank 0)
    rng.pt          every rank's Python / NumPy / torch / CUDA generator states (gathered to rank 0)
    model.pt        plain layout: full model state dicts                       (rank 0)
    optimizer.pt    plain layout: full optimizer state dicts                   (rank 0)
    shards/         dcp layout: torch.distributed.checkpoint, each rank its own shards

Everything is loaded with ``weights_only=True`` or phalanx's allow-listed DCP reader.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from phalanx.version import __version__
from phalanx.checkpoint import files, rng
from phalanx.errors import PhalanxError

if TYPE_CHECKING:
    from phalanx.session import Session

TRAINER, RNG, MODEL, OPTIMIZER, SHARDS = "trainer.pt", "rng.pt", "model.pt", "optimizer.pt", "shards"


def save(session: "Session", root: Path) -> Path:
    """Write a complete checkpoint of ``session`` under ``root`` (a collective: every rank calls it)."""
    strategy, topo = session.strategy, session.topology
    step = session.step_count
    staging = files.staging_path(root, step)
    if topo.is_main:
        shutil.rmtree(staging, ignore_errors=True)  # a save of this step that was killed earlier
        staging.mkdir(parents=True)
    _barrier(session)
    with _internal_steps(session):
        if strategy.checkpoint_layout == "plain":
            models = [strategy.model_state_dict(m) for m in session._models]
            optims = [strategy.optimizer_state_dict(_model_of(session, o), o) for o in session._optimizers]
            if topo.is_main:
                _save(models, staging / MODEL)
                _save(optims, staging / OPTIMIZER)
        else:
            import torch.distributed.checkpoint as dcp

            dcp.save(_dcp_state(session), storage_writer=dcp.FileSystemWriter(str(staging / SHARDS)))
    shapes = _all_shapes(session)
    sizes = [_numel(session, m) for m in session._models]
    rngs = _gather_all(session, rng.capture(session.device))
    if topo.is_main:
        _save(_trainer_state(session), staging / TRAINER)
        _save({"world_size": topo.world_size, "ranks": rngs}, staging / RNG)
    _barrier(session)
    # Each rank hashes a share of the files; rank 0 records them all in the manifest.
    names = files.data_files(staging)
    mine = {name: files.describe_file(staging / name) for name in names[topo.rank :: topo.world_size]}
    described: dict[str, Any] = {}
    for part in _gather_all(session, mine):
        described.update(part or {})
    final = root / files.step_name(step)
    if topo.is_main:
        final = files.commit(staging, _manifest(session, shapes, sizes, described))
        files.prune(root, session.config.checkpoint.keep_last)
    _barrier(session)
    return final


def load(session: "Session", path: Path, *, weights_only: bool = False) -> dict[str, Any]:
    """Restore ``session`` from checkpoint ``path`` (a collective). ``weights_only``: the models'
    weights and nothing else (a fine-tuning start). Returns the manifest."""
    # Imported here: torch.distributed.checkpoint takes a second to import, and most runs never load.
    from phalanx.checkpoint.safe import load_file

    manifest = _agreed_manifest(session, path)
    directory = Path(manifest["path"])
    strategy = session.strategy
    layout = manifest["layout"]
    if layout != strategy.checkpoint_layout or (layout == "dcp" and manifest["strategy"] != strategy.name):
        raise PhalanxError(
            f"checkpoint '{directory}' was written by strategy {manifest['strategy']} ({files.describe_layout(layout)}); this run uses "
            f"{strategy.name} ({files.describe_layout(strategy.checkpoint_layout)}): resume with strategy {manifest['strategy']}, "
            f"or export its weights (`phalanx checkpoint export {directory} model.pt`) and load them into the bare model"
        )
    _check_models(session, manifest, directory)
    _check_optimizers(session, manifest, directory, weights_only)
    with _internal_steps(session):
        if layout == "plain":
            for model, state in zip(session._models, load_file(directory / MODEL)):
                strategy.load_model_state_dict(model, state)
            if not weights_only:
                for opt, state in zip(session._optimizers, load_file(directory / OPTIMIZER)):
                    _load_optimizer(strategy, _model_of(session, opt), opt, state, directory / OPTIMIZER)
        else:
            _load_dcp(session, directory / SHARDS, weights_only)
    if not weights_only:
        _restore_trainer(session, load_file(directory / TRAINER))
        saved = load_file(directory / RNG)
        if saved["world_size"] == session.world_size:
            session.recovery.pending_rng = saved["ranks"][session.rank]
            if not session._train_loaders():
                session.recovery.restore_rng()  # no training pass to wait for
        else:
            session.print(
                f"phalanx: the checkpoint was written by {saved['world_size']} processes, this run has {session.world_size}: "
                "random generators start fresh (dropout masks differ from an uninterrupted run; the data order does not)"
            )
    return manifest


# -- pieces of a checkpoint -------------------------------------------------------------------
def _trainer_state(session: "Session") -> dict[str, Any]:
    return {
        "step": session.step_count,
        "epoch": session.epoch,
        "data": _positions(session),
        "schedulers": [sched.state_dict() for sched, _ in session._schedulers],
        "precision": session.precision.state_dict(),
    }


def _restore_trainer(session: "Session", state: dict[str, Any]) -> None:
    session.step_count = state["step"]
    session.epoch = state["epoch"]
    schedulers = session._schedulers
    if len(state["schedulers"]) != len(schedulers):
        raise PhalanxError(f"the checkpoint holds {len(state['schedulers'])} LR scheduler(s), this run set up {len(schedulers)}; set up the same schedulers as the run that saved it")
    for (sched, _), saved in zip(schedulers, state["schedulers"]):
        sched.load_state_dict(saved)
    session._schedulers = [(sched, sched.last_epoch) for sched, _ in schedulers]
    session.precision.load_state_dict(state["precision"])
    loaders = session._train_loaders()
    for loader, position in zip(loaders, state["data"]):
        loader.resume_at(position["epoch"], position["position"])


def _dcp_state(session: "Session") -> dict[str, Any]:
    strategy = session.strategy
    state: dict[str, Any] = {f"model{i}": strategy.sharded_model_state_dict(m) for i, m in enumerate(session._models)}
    for j, opt in enumerate(session._optimizers):
        state[f"optim{j}"] = strategy.optimizer_state_dict(_model_of(session, opt), opt)
    return state


def _load_dcp(session: "Session", directory: Path, weights_only: bool) -> None:
    import torch.distributed.checkpoint as dcp

    strategy = session.strategy
    state = _dcp_state(session)
    if weights_only:
        state = {k: v for k, v in state.items() if k.startswith("model")}
    from torch.distributed.checkpoint.api import CheckpointException

    from phalanx.checkpoint.safe import SafeLoadPlanner, SafeReader

    SafeReader(str(directory)).read_metadata()  # a bad file fails here, before torch logs its fallbacks
    try:
        dcp.load(state, storage_reader=SafeReader(str(directory)), planner=SafeLoadPlanner())
    except CheckpointException as err:
        # torch wraps each rank's exception (phalanx's own say what is wrong with the files).
        inner = [f[0] if isinstance(f, tuple) else f for f in err.failures.values()]
        first = next((e for e in inner if isinstance(e, PhalanxError)), inner[0] if inner else err)
        text = str(first).strip().splitlines()[-1] if str(first).strip() else type(first).__name__
        raise PhalanxError(text if isinstance(first, PhalanxError) else f"cannot read the sharded checkpoint '{directory}': {text}") from None
    for i, model in enumerate(session._models):
        strategy.load_sharded_model_state_dict(model, state[f"model{i}"])
    if not weights_only:
        for j, opt in enumerate(session._optimizers):
            with _same_group_dicts(opt):
                strategy.load_optimizer_state_dict(_model_of(session, opt), opt, state[f"optim{j}"])


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


def _load_optimizer(strategy, model: nn.Module, optimizer, state: dict, path: Path) -> None:
    try:
        with _same_group_dicts(optimizer):
            strategy.load_optimizer_state_dict(model, optimizer, state)
    except (ValueError, KeyError, RuntimeError) as err:
        raise PhalanxError(f"optimizer state in '{path}' does not fit this run's optimizer ({str(err).splitlines()[0]}); build the optimizer as the run that saved it did") from None


def _manifest(session: "Session", shapes: list[dict[str, list[int]]], sizes: list[int], described: dict[str, Any]) -> dict[str, Any]:
    """Written by rank 0 alone: nothing in here may call a collective."""
    batch = session.batch
    return {
        "format": files.FORMAT,
        "version": files.VERSION,
        "created": files.timestamp(),
        "phalanx": __version__,
        "torch": torch.__version__,
        "step": session.step_count,
        "epoch": session.epoch,
        "strategy": session.strategy.name,
        "run_dir": session.context.run_dir if session.context else None,
        "layout": session.strategy.checkpoint_layout,
        "world_size": session.world_size,
        "data_parallel_size": session.strategy.data_parallel_size,
        "global_batch_size": batch.global_batch_size if batch else None,
        "precision": session.precision.mode,
        "data": _positions(session),
        "models": [{"parameters": n, "shapes": s} for n, s in zip(sizes, shapes)],
        "optimizers": _optimizer_names(session),
        "files": described,
    }


def _numel(session: "Session", model: nn.Module) -> int:
    local = sum(p.numel() for p in session.strategy.unwrap(model).parameters())
    # DTensor parameters (fsdp) report their global size; pipeline stages hold disjoint parts.
    return _sum_over_ranks(session, local) if session.strategy.name == "pipeline" else local


def _all_shapes(session: "Session") -> list[dict[str, list[int]]]:
    """Every model's parameter and buffer shapes under the bare model's names (all ranks' keys)."""
    out = []
    for model in session._models:
        state = session.strategy.sharded_model_state_dict(model)
        own = {k: list(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
        merged: dict[str, list[int]] = {}
        for part in _gather_all(session, own) if session.strategy.checkpoint_layout == "dcp" else [own]:
            merged.update(part or {})
        out.append(merged)
    return out


def _check_models(session: "Session", manifest: dict[str, Any], directory: Path) -> None:
    saved = manifest["models"]
    if len(saved) != len(session._models):
        raise PhalanxError(f"checkpoint '{directory}' holds {len(saved)} model(s), this run set up {len(session._models)}")
    for index, (model_info, shapes) in enumerate(zip(saved, _all_shapes(session))):
        problem = shape_mismatch(model_info["shapes"], shapes)
        if problem:
            which = f"model {index}" if len(saved) > 1 else "the model"
            raise PhalanxError(f"checkpoint '{directory}' does not fit {which}: {problem}; load it into the architecture that saved it")


def shape_mismatch(saved: dict[str, list[int]], current: dict[str, list[int]]) -> str | None:
    """A one-line description of how two models' state shapes differ, or None."""
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    resized = [f"{k} {saved[k]} in the checkpoint, {current[k]} here" for k in current if k in saved and saved[k] != current[k]]
    parts = []
    if missing:
        parts.append(f"{len(missing)} key(s) missing from the checkpoint ({_few(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected key(s) ({_few(unexpected)})")
    if resized:
        parts.append(f"{len(resized)} shape(s) differ ({_few(resized)})")
    return "; ".join(parts) or None


def _check_optimizers(session: "Session", manifest: dict[str, Any], directory: Path, weights_only: bool) -> None:
    if weights_only:
        return
    here = _optimizer_names(session)
    if manifest["optimizers"] != here:
        raise PhalanxError(
            f"checkpoint '{directory}' holds optimizer(s) {manifest['optimizers'] or 'none'}, this run set up {here or 'none'}; "
            "set up the same optimizers, or load only the weights: session.load(path, weights_only=True)"
        )


def _positions(session: "Session") -> list[dict[str, Any]]:
    return [{"epoch": loader.epoch, "position": loader.position} for loader in session._train_loaders()]


def _optimizer_names(session: "Session") -> list[str]:
    # ZeroRedundancyOptimizer wraps the user's class: the inner one is what must match.
    return [type(getattr(o, "optim", o)).__name__ for o in session._optimizers]


def _few(items: list[str], n: int = 3) -> str:
    return ", ".join(items[:n]) + (", ..." if len(items) > n else "")


# -- agreement between ranks ----------------------------------------------------------------------
def _agreed_manifest(session: "Session", path: Path) -> dict[str, Any]:
    """Rank 0 reads the manifest, every rank verifies a share of the files; all raise the same error."""
    answer: list[Any] = [None]
    if session.is_main:
        try:
            answer[0] = files.read_manifest(files.resolve(path))
        except PhalanxError as err:
            answer[0] = str(err)
    answer[0] = _broadcast(session, answer[0])
    if isinstance(answer[0], str):
        raise PhalanxError(answer[0])
    manifest = answer[0]
    directory = Path(manifest["path"])
    names = sorted(manifest["files"])
    mine = files.verify(directory, manifest, names[session.rank :: session.world_size])
    problems = [p for p in _gather_all(session, mine) if p]
    if problems:
        raise PhalanxError(problems[0])
    return manifest


def _distributed(session: "Session") -> bool:
    return session.world_size > 1 and dist.is_initialized()


def _barrier(session: "Session") -> None:
    if _distributed(session):
        dist.barrier()


def _broadcast(session: "Session", value: Any) -> Any:
    if not _distributed(session):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather_all(session: "Session", value: Any) -> list[Any]:
    if not _distributed(session):
        return [value]
    out: list[Any] = [None] * session.world_size
    dist.all_gather_object(out, value)
    return out


def _sum_over_ranks(session: "Session", value: int) -> int:
    return sum(_gather_all(session, value))


def _model_of(session: "Session", optimizer) -> nn.Module:
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in session._models:
        if any(id(p) in params for p in model.parameters()):
            return model
    return session._models[0]


@contextlib.contextmanager
def _internal_steps(session: "Session") -> Iterator[None]:
    # torch's checkpoint helpers may call optimizer.step() once with zero lr to create the
    # optimizer state they fill; the Session's guard against stray steps must let that through.
    previous = session._in_step
    session._in_step = True
    try:
        yield
    finally:
        session._in_step = previous


def _save(obj: Any, path: Path) -> None:
    with open(path, "wb") as fh:
        torch.save(obj, fh)
