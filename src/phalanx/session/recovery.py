"""The Session's side of checkpoints and faults: when to resume and from where, when to save, what
a SIGTERM or a hang does to this rank. The Session owns one and calls it at its hooks; what goes
into a checkpoint is session_checkpoint's business."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from phalanx.checkpoint import manager as checkpoint_manager
from phalanx.checkpoint import files as checkpoint_files
from phalanx.config.schema import parse_period
from phalanx.errors import PhalanxError
from phalanx.faults import markers
from phalanx.faults.control import StepAgreement
from phalanx.faults.preempt import TermWatch
from phalanx.faults.watchdog import Watchdog

if TYPE_CHECKING:
    from phalanx.session import Session


class Recovery:
    def __init__(self, session: "Session", comm_device):
        self.session = session
        config, topology = session.config, session.topology
        self.run_dir = session.context.run_dir if session.context else None
        self.resume_checked = False
        self.pending_rng: dict | None = None  # restored when the next training pass starts
        faults = config.faults
        launched = topology.launched
        self.watchdog = Watchdog(faults.hang_timeout, topology.rank, self.run_dir, topology.restart_count) if launched and faults.hang_timeout > 0 else None
        self.term = TermWatch(self.run_dir, faults.preempt_grace, topology.rank) if launched else None
        every = config.checkpoint.save_every
        self.agreement = StepAgreement(topology.world_size, comm_device, parse_period(every) if isinstance(every, str) else None)

    @property
    def root(self) -> Path:
        return Path(self.session.config.checkpoint.dir)

    def beat(self) -> None:
        if self.watchdog is not None:
            self.watchdog.beat()

    # -- saving and loading -------------------------------------------------------------------------
    def save(self) -> Path:
        session = self.session
        if session._micro:
            raise PhalanxError("session.save() was called inside an accumulation window; call it after the `with session.accumulate(model):` block")
        if not session._models:
            raise PhalanxError("session.save() needs a model: call session.setup(model, optimizer, ...) first")
        self.resume_checked = True  # a run that saved has started; never resume over it later
        with self._io():
            path = checkpoint_manager.save(session, self.root)
        self.agreement.saved()
        session.print(f"phalanx: saved checkpoint {path} (step {session.step_count})")
        return path

    def load(self, path: str | Path | None, weights_only: bool) -> Path:
        session = self.session
        if not session._models:
            raise PhalanxError("session.load() needs the model set up first: call session.setup(model, optimizer, ...) before it")
        if path is None:
            path = self.latest()
            if path is None:
                raise PhalanxError(f"no checkpoint in '{self.root}' to load; pass a path, or save one first")
        self.resume_checked = True
        with self._io():
            manifest = checkpoint_manager.load(session, Path(path), weights_only=weights_only)
        where = Path(manifest["path"])
        if weights_only:
            session.print(f"phalanx: loaded the weights of {where}")
        else:
            session.print(f"phalanx: resumed from {where}: {_position_words(manifest)}")
        return where

    def latest(self, *, this_run: bool = False) -> Path | None:
        """The newest complete checkpoint (``this_run``: only one this launch wrote); rank 0 decides,
        so no rank sees a different 'latest'."""
        session = self.session
        found = checkpoint_files.latest(self.root) if session.is_main else None
        if found is not None and this_run:
            if self.run_dir is None or checkpoint_files.read_manifest(found).get("run_dir") != self.run_dir:
                found = None
        if session.world_size > 1 and dist.is_initialized():
            box = [found]
            dist.broadcast_object_list(box, src=0)
            found = box[0]
        return found

    def restore_rng(self) -> None:
        if self.pending_rng is not None:
            state, self.pending_rng = self.pending_rng, None
            checkpoint_manager.rng.restore(state, self.session.device)

    def ensure_resumed(self) -> None:
        """Before training starts: continue from a checkpoint when checkpoint.resume says so (and
        always after torch elastic restarted the job)."""
        session = self.session
        if self.resume_checked or not session._models:
            return
        self.resume_checked = True
        spec, restart = session.config.checkpoint.resume, session.topology.restart_count
        if spec == "never" and not restart:
            return
        if spec == "auto" or restart:
            # After a restart, resume.never still means "not from an earlier launch".
            path = self.latest(this_run=spec != "auto")
            if path is None and spec not in ("auto", "never"):
                path = Path(spec)  # restarted before this launch saved: back to the given checkpoint
            if path is None:
                if restart:
                    session.print(f"phalanx: restart {restart}: no checkpoint in '{self.root}' yet; starting from the beginning")
                return
        else:
            path = Path(spec)
        if restart:
            session.print(f"phalanx: restart {restart} after a failure")
        self.load(path, weights_only=False)

    # -- at every optimizer step ----------------------------------------------------------------------
    def after_step(self) -> None:
        session = self.session
        self.beat()
        every = session.config.checkpoint.save_every
        stop, timed = self.agreement.poll(session.step_count, bool(self.term and self.term.requested))
        if stop:
            self._stop_for_preemption()
        if timed or (isinstance(every, int) and session.step_count % every == 0):
            self.save()

    def _stop_for_preemption(self) -> None:
        session = self.session
        path = self.save()
        record = markers.path(self.run_dir, markers.PREEMPTED)
        if session.topology.local_rank == 0 and record is not None:  # every node's launcher reports it
            checkpoint_files.write_json_atomic(record, {"step": session.step_count, "checkpoint": str(path.resolve())})
        if record is None:  # under phalanx launch, the launcher says it once for the job
            session.print(f"phalanx: pre-empted: checkpoint {path} written at step {session.step_count}; launch again to resume")
        raise SystemExit(markers.PREEMPTED_EXIT)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
        if self.term is not None:
            self.term.close()

    def _io(self) -> contextlib.AbstractContextManager:
        return self.watchdog.paused() if self.watchdog is not None else contextlib.nullcontext()


def _position_words(manifest: dict) -> str:
    words = f"step {manifest['step']}, epoch {manifest['epoch'] + 1}"
    data = manifest.get("data") or []
    if data and data[0].get("position"):
        words += f", {data[0]['position']} samples into the epoch"
    return words
