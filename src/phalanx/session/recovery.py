"""The Session's side of checkpoints and faults: when to resume and from where, when to save, what
a SIGTERM or a hang does to this rank. The Session owns one and calls it at its hooks, handing over
what a checkpoint holds explicitly (``objects``); what goes into the files is checkpoint/manager's
business."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from phalanx.checkpoint import files as checkpoint_files
from phalanx.checkpoint.export import progress_words
from phalanx.checkpoint.lock import DirectoryLock
from phalanx.checkpoint.manager import Checkpointer, TrainingObjects, optimizer_names
from phalanx.checkpoint.run_identity import RunIdentity
from phalanx.config.schema import Config, parse_period
from phalanx.errors import PhalanxError
from phalanx.faults import markers
from phalanx.faults.agreement import StepAgreement
from phalanx.faults.device_progress import DeviceProgress
from phalanx.faults.preempt import TermWatch
from phalanx.faults.watchdog import Watchdog
from phalanx.session.state import TrainState
from phalanx.topology import Topology
from phalanx.util.words import plural

# How much longer than faults.preempt_grace ranks that saved for a join wait for their agent: the
# launcher reveals the waiting node once they saved, or after preempt_grace at the latest.
_HOLD_SLACK_S = 10.0
# How long a rank that agreed to save for a join waits for its own launcher's request: the launchers
# of the nodes poll the rendezvous about 0.1 s apart.
_REQUEST_LAG_S = 5.0


class Recovery:
    """``objects``: what a checkpoint of the run holds now (models appear at setup());
    ``say``: print on rank 0; ``on_loaded``: called after every successful load."""

    def __init__(
        self,
        config: Config,
        topology: Topology,
        run_dir: str | None,
        comm_device: torch.device,
        checkpointer: Checkpointer,
        state: TrainState,
        objects: Callable[[], TrainingObjects],
        say: Callable[[str], None],
        on_loaded: Callable[[], None] = lambda: None,
        job: str | None = None,
        describe_batch: Callable[[], str] = lambda: "",
    ):
        self.config, self.topology, self.run_dir = config, topology, run_dir
        self.checkpointer, self.state, self.objects, self.say, self.on_loaded = (
            checkpointer,
            state,
            objects,
            say,
            on_loaded,
        )
        self.describe_batch = describe_batch  # the batch split now, for the line of a resize
        self._restart: int | None = None
        # After a save that stops the run ('stop') or holds it for a joining node ('resize'): what to do
        # at the next call into the Session, and the checkpoint.
        self._then: tuple[str, Path] | None = None
        self.job = job
        self.resume_checked = False
        self.resumed_from: Path | None = None  # the checkpoint this run continues
        # The run its checkpoints record; resume: auto continues only that run (checkpoint/run_identity.py).
        self.identity = RunIdentity.of_session(config, type(checkpointer.strategy).counted_settings())
        # A save the last optimizer step asked for: (its training state, whether it stops the run).
        self._pending: tuple[dict, list, str | None] | None = None  # then: 'stop', 'resize' or None
        faults = config.faults
        launched = topology.launched
        self.watchdog = (
            Watchdog(
                faults.hang_timeout,
                topology.rank,
                self.run_dir,
                topology.restart_count,
                first_step_timeout=faults.first_step_timeout,
                progress=DeviceProgress.of(topology.device),
            )
            if launched and faults.hang_timeout > 0
            else None
        )
        self.term = TermWatch(self.run_dir, faults.preempt_grace, topology.rank) if launched else None
        # Under phalanx launch the launcher may hold it already; the launch's job token says so.
        self.lock = DirectoryLock(self.root, job)
        self._claimed = False
        every = config.checkpoint.save_every
        self.agreement = StepAgreement(
            topology.world_size, comm_device, parse_period(every) if isinstance(every, str) else None
        )

    @property
    def root(self) -> Path:
        return Path(self.config.checkpoint.dir)

    def beat(self) -> None:
        if self.watchdog is not None:
            self.watchdog.beat()

    # -- saving and loading -------------------------------------------------------------------------
    def save(self) -> Path:
        if self.state.micro:
            raise PhalanxError(
                "session.save() was called inside an accumulation window; "
                "call it after the `with session.accumulate(model):` block"
            )
        if self._pending is not None:
            return self.flush()  # the save the last step asked for: this is its moment
        return self._save(None)

    def _save(self, at_step: dict | None, buffers: list | None = None) -> Path:
        objects = self.objects()
        if not objects.models:
            raise PhalanxError("session.save() needs a model: call session.setup(model, optimizer, ...) first")
        if at_step is not None:
            objects = dataclasses.replace(objects, state=_AtStep(self.state, at_step))
        self.resume_checked = True  # a run that saved has started; never resume over it later
        self.claim(create=True)
        with self._io(), _buffers_as_at_step(buffers or []):
            path = self.checkpointer.save(self.root, objects, run=self.identity.record)
        self.agreement.saved()
        self.say(f"phalanx: saved checkpoint {path} (step {self.state.step})")
        return path

    def flush(self) -> Path | None:
        """Write the checkpoint the last optimizer step asked for (checkpoint.save_every, a timed
        save, a pre-emption) where the script keeps values with session.keep(), or where that step
        ended the epoch's passes: at its next call into the Session after that step, when it has
        finished the iteration, so that what it keeps (an iter_num counted after session.step()) is
        the step's, and an epoch's closing code has run (the checkpoint is then the next epoch's
        start). The training state (RNG, data positions) and the models' buffers (a BatchNorm's
        statistics, which the next forward may have moved) are the ones the step left, taken then.
        Every rank calls it at the same place."""
        if self._pending is None:
            if self._then is not None:  # tested here: flush() runs several times per step
                self._act_on_save()
            return None
        at_step, buffers, then = self._pending
        self._pending = None
        if self.state.at_epoch_end():
            # The epoch's passes have ended since the step, and the code after them has run: the
            # state now is the next epoch's start (state.py), generators and buffers included.
            at_step, buffers = self.state.state_dict(kept=False), None
        path = self._save(at_step, buffers)
        self._after_save(path, then)
        self._act_on_save()
        return path

    def dropped(self) -> str | None:
        """The line for a save the last step asked for that never came (a script that ended
        without session.close(), where writing it could wait for ranks that are gone)."""
        if self._pending is None:
            return None
        self._pending = None
        return (
            f"phalanx: the checkpoint step {self.state.step} asked for was not written: the script ended without "
            "session.close() (or `with phalanx.Session() as session:`); a resume goes on from the one before"
        )

    def load(self, path: str | Path | None, weights_only: bool) -> Path:
        objects = self.objects()
        if not objects.models:
            raise PhalanxError(
                "session.load() needs the model set up first: call session.setup(model, optimizer, ...) before it"
            )
        if path is None:
            path = self.latest()
            if path is None:
                raise PhalanxError(f"no checkpoint in '{self.root}' to load; pass a path, or save one first")
        self.flush()  # a save the last step asked for belongs to the state before this load
        if weights_only and self.resumed_from is not None:
            self.say(self.after_resume(f"session.load({str(path)!r}, weights_only=True)"))
            return self.resumed_from
        if not weights_only:
            self.resume_checked = True  # starting weights do not cancel a resume that comes later
        with self._io():
            manifest = self.checkpointer.load(Path(path), objects, weights_only=weights_only, say=self.say)
        self.on_loaded()
        where = Path(manifest["path"])
        if weights_only:
            self.say(f"phalanx: loaded the weights of {where}")
        else:
            self.resumed_from = where
            self.say(self._resumed_line(where, manifest))
        return where

    def _resumed_line(self, where: Path, manifest: dict) -> str:
        """The resume's line; after a change of size (an elastic job that lost or gained nodes), the
        one line that says what changed: nodes and processes before and after, the step, the split."""
        before = manifest.get("world_size") or self.topology.world_size
        nodes_before = manifest.get("nodes")  # not recorded before elastic jobs: then processes only
        now, nodes_now = self.topology.world_size, self.topology.nnodes
        if before == now and nodes_before in (None, nodes_now):
            return f"phalanx: resumed from {where}: {progress_words(manifest)}"
        split = self.describe_batch()
        then = _sized(nodes_before, before) if nodes_before else plural(before, "process")
        return (
            f"phalanx: resumed from {where} on {_sized(nodes_now, now)}, written on {then}: "
            f"{progress_words(manifest)}" + (f"; {split}" if split else "")
        )

    def after_resume(self, what: str) -> str:
        """The line for starting weights (pretrained, a fine-tuning start) given after the run resumed:
        the checkpoint's weights are the run's, so they are not replaced."""
        return (
            f"phalanx: {what} skipped: this run resumed from {self.resumed_from}, whose weights are the run's "
            "(loading the starting weights now would undo its training); set checkpoint.resume: never to start over"
        )

    def claim(self, *, create: bool) -> None:
        """Make sure this job owns the checkpoint directory (see checkpoint/lock.py); a collective.
        ``create``: take it even where the directory does not exist yet (a save is coming)."""
        if self._claimed:
            return
        refusal = None
        if self.topology.is_main and (create or self.root.is_dir()):
            try:
                self.lock.acquire()
            except PhalanxError as err:
                refusal = str(err)
        refusal, held = self._rank0s((refusal, self.lock.held))
        if refusal is not None:
            raise PhalanxError(refusal)
        self._claimed = held  # not yet (no directory to resume from): the first save takes it

    def latest(self, *, this_run: bool = False) -> Path | None:
        """The newest complete checkpoint (``this_run``: only one this launch wrote); rank 0 decides,
        so no rank sees a different 'latest'."""
        found, refusal = None, None
        if self.topology.is_main:
            try:
                found = checkpoint_files.latest(self.root)
                if found is not None and this_run:
                    if not _this_run(checkpoint_files.read_manifest(found), self.run_dir, self.job):
                        found = None
            except PhalanxError as err:  # a damaged manifest: every rank raises it, none waits
                refusal = str(err)
        found, refusal = self._rank0s((found, refusal))
        if refusal is not None:
            raise PhalanxError(refusal)
        return found

    def ensure_resumed(self) -> None:
        """Before training starts: continue from a checkpoint when checkpoint.resume says so (and
        always after torch elastic restarted the job)."""
        if self.watchdog is not None:
            self.watchdog.expect_first_step()  # training begins here; the first step gets its own limit
        if self.resume_checked or not self.objects().models:
            return
        self.resume_checked = True
        path = self._resume_target()
        if path is not None:
            self._resume(path)

    def resume_if_set_up(self) -> None:
        """At the end of each setup() call: resume now when what is set up is what the checkpoint
        holds (its models, optimizers and schedulers), so the counters a script reads right after
        setup() are the checkpoint's. Otherwise the resume waits for the first training action
        (ensure_resumed), when the rest may be set up."""
        if self.resume_checked or not self.objects().models:
            return
        path = self._resume_target()
        if path is None:
            self.resume_checked = True  # nothing to resume: the run starts fresh
            return
        held = self._holds(path)
        objects = self.objects()
        here = (len(objects.models), optimizer_names(objects), len(objects.schedulers))
        # A checkpoint that does not say how many schedulers it holds waits for the first training
        # action, as before the count was recorded: one may still be set up.
        if held is not None and held == here:
            self.resume_checked = True
            self._resume(path)

    def refuse_late_resume(self, where: str) -> None:
        """At a backward or step before any resume point: a forward has run on weights the resume
        would replace, so resuming now would train one step wrong; say so instead."""
        if self.resume_checked or not self.objects().models:
            return
        path = self._resume_target()
        self.resume_checked = path is None
        if path is not None:
            objects = self.objects()
            raise PhalanxError(
                f"this run resumes from checkpoint {path}, but {where} came first, after a forward on the weights "
                f"the resume replaces; set up what the checkpoint holds ({len(objects.models)} model(s), their "
                "optimizers and LR schedulers) in session.setup(), which then resumes, or drive the loop with "
                "session.epochs() or `with session.accumulate(model):`, or set checkpoint.resume: never"
            )

    def _resume(self, path: Path) -> None:
        restart, saved = self._job_restart(), self._saved_world(path)
        if restart and self.topology.world_size == saved:
            self.say(f"phalanx: restart {restart} after a failure")
        self.load(path, weights_only=False)

    def _job_restart(self) -> int:
        """The job's restart count, the highest of its ranks' (a collective): in an elastic job a node
        that just joined is on its first attempt while the others restart."""
        if self._restart is None:
            count = self.topology.restart_count
            if self.topology.world_size > 1 and dist.is_initialized():
                counts = [None] * self.topology.world_size
                dist.all_gather_object(counts, count)
                count = max(counts)
            self._restart = count
        return self._restart

    def _saved_world(self, path: Path) -> int | None:
        """The process count of the checkpoint at ``path``, as rank 0 reads it (a collective)."""
        world = None
        if self.topology.is_main:
            try:
                world = checkpoint_files.read_manifest(checkpoint_files.resolve(path)).get("world_size")
            except PhalanxError:
                world = None
        return self._rank0s(world)

    def _resume_target(self) -> Path | None:
        """The checkpoint this run continues from, or None. A collective."""
        self.claim(create=False)
        spec, restart = self.config.checkpoint.resume, self._job_restart()
        if spec == "never" and not restart:
            self._note_shared_default()
            return None
        if spec == "auto" or restart:
            # After a restart, resume.never still means "not from an earlier launch".
            path = self.latest(this_run=spec != "auto")
            if path is None and spec not in ("auto", "never"):
                path = Path(spec)  # restarted before this launch saved: back to the given checkpoint
            if path is None:
                if restart:
                    self.say(
                        f"phalanx: restart {restart}: no checkpoint in '{self.root}' yet; starting from the beginning"
                    )
                return None
            if spec == "auto":
                self.identity.check_resume(path, self.topology, self.run_dir, self.say, job=self.job)
        else:
            path = Path(spec)
        return path

    def _note_shared_default(self) -> None:
        """A fresh run in the default directory that another script's checkpoints hold: one note
        (rank 0 reads; a damaged manifest there is the other run's business)."""
        if not self.topology.is_main:
            return
        try:
            newest = checkpoint_files.latest(self.root)
            note = newest and self.identity.beside_another_script(newest, checkpoint_files.read_manifest(newest))
        except PhalanxError:
            return
        if note:
            self.say(note)

    def _holds(self, path: Path) -> tuple | None:
        """What the checkpoint at ``path`` was saved with: (models, optimizer classes, schedulers),
        as rank 0 reads it from the manifest; None where it cannot tell (then the resume waits,
        and load() reports any problem)."""
        held = None
        if self.topology.is_main:
            try:
                manifest = checkpoint_files.read_manifest(checkpoint_files.resolve(path))
                # Checkpoints before the count was recorded: its models and optimizers must do.
                held = (len(manifest["models"]), manifest["optimizers"], manifest.get("schedulers"))
            except PhalanxError:
                held = None
        return self._rank0s(held)

    def _rank0s(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (a collective): what rank 0 decided, so none differs."""
        if self.topology.world_size > 1 and dist.is_initialized():
            box = [value]
            dist.broadcast_object_list(box, src=0)
            return box[0]
        return value

    # -- at every optimizer step ----------------------------------------------------------------------
    def after_step(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stepped()
        every = self.config.checkpoint.save_every
        stop, timed, resize = self.agreement.poll(
            self.state.step, bool(self.term and self.term.requested), self._resize_requested
        )
        if not (stop or timed or resize or (isinstance(every, int) and self.state.step % every == 0)):
            return
        then = "stop" if stop else "resize" if resize else None
        if not (self.state.kept or self.state.ends_epoch()):
            path = self._save(None)  # nothing the script keeps can change after the step: write it now
            self._after_save(path, then)
            return
        buffers = [(b, b.detach().clone()) for m in self.objects().models for b in m.buffers()]
        self._pending = (self.state.state_dict(kept=False), buffers, then)  # written at flush()

    def _after_save(self, path: Path, then: str | None) -> None:
        if then == "stop":
            self._record_preemption(path)
        if then is not None:
            # At the next call into the Session: the step's iteration (the script's logging of it,
            # its own counters) finishes first, as it would in an uninterrupted run.
            self._then = (then, path)

    def _act_on_save(self) -> None:
        if self._then is not None:
            (then, path), self._then = self._then, None
            if then == "stop":
                raise SystemExit(markers.PREEMPTED_EXIT)
            self._hold_for_resize(path)

    def _resize_requested(self) -> bool:
        request = markers.path(self.run_dir, markers.RESIZE_REQUEST)
        return request is not None and request.exists()

    def _hold_for_resize(self, path: Path) -> None:
        """A node waits to join (launch/elastic.py): with the checkpoint written, tell this node's
        launcher, and wait for its agent to stop this process and start the larger job from that
        checkpoint. Should the join fall through (the node gave up), training goes on."""
        if self.run_dir is None:
            return
        self.say(f"phalanx: a node is joining: checkpoint {path} (step {self.state.step}); the job re-forms with it")
        started = time.monotonic()
        deadline = started + self.config.faults.preempt_grace + _HOLD_SLACK_S
        with self._io():
            # Another node's launcher may have seen the joining node first: this one's request follows.
            while markers.resize_nonce(self.run_dir, markers.RESIZE_REQUEST) is None:
                if time.monotonic() - started > _REQUEST_LAG_S:
                    self.say(f"phalanx: the node that was joining did not; training goes on at step {self.state.step}")
                    return
                time.sleep(0.05)
            nonce = markers.resize_nonce(self.run_dir, markers.RESIZE_REQUEST)
            if self.topology.local_rank == 0:
                saved = markers.path(self.run_dir, markers.RESIZE_SAVED)
                answer = {"step": self.state.step, "checkpoint": str(path.resolve()), "nonce": nonce}
                checkpoint_files.write_json_atomic(saved, answer)
            while markers.resize_nonce(self.run_dir, markers.RESIZE_REQUEST) == nonce and time.monotonic() < deadline:
                time.sleep(0.05)
        self.say(f"phalanx: the node that was joining did not; training goes on at step {self.state.step}")

    def _record_preemption(self, path: Path) -> None:
        record = markers.path(self.run_dir, markers.PREEMPTED)
        here = self.term is not None and self.term.requested  # this node got the SIGTERM
        if here:
            self.term.checkpointed()
        # Every node's launcher reports it; in an elastic job, only the nodes that leave.
        if self.topology.local_rank == 0 and record is not None and (here or not self.topology.elastic):
            checkpoint_files.write_json_atomic(record, {"step": self.state.step, "checkpoint": str(path.resolve())})
        if self.topology.elastic and not here:
            # The SIGTERM reached another node: in an elastic job, this one goes on without it.
            self.say(f"phalanx: a node is leaving the job: checkpoint {path} written at step {self.state.step}")
        if record is None:  # under phalanx launch, the launcher says it once for the job
            self.say(
                f"phalanx: pre-empted: checkpoint {path} written at step {self.state.step}; launch again to resume"
            )

    def close(self) -> None:
        self.lock.release()
        if self.watchdog is not None:
            self.watchdog.close()
        if self.term is not None:
            self.term.close()

    def _io(self) -> contextlib.AbstractContextManager:
        return self.watchdog.paused() if self.watchdog is not None else contextlib.nullcontext()


def _this_run(manifest: dict, run_dir: str | None, job: str | None) -> bool:
    """Whether this launch wrote the checkpoint: its run directory, or (an elastic job, whose rank 0
    may be on another node after a change) its job id."""
    return (run_dir is not None and manifest.get("run_dir") == run_dir) or (
        job is not None and manifest.get("job") == job
    )


def _sized(nodes: int, processes: int) -> str:
    return f"{plural(nodes, 'node')} ({plural(processes, 'process')})"


@contextlib.contextmanager
def _buffers_as_at_step(buffers: list) -> Iterator[None]:
    """The models' buffers as the step left them, for the save, and back after it. Their storage is
    swapped, not written: a forward's graph may hold them (a BatchNorm's running statistics) until
    the backward that comes after this save, and must find them untouched."""
    now = [(b, b.data) for b, _ in buffers]
    for b, then in buffers:
        b.data = then
    try:
        yield
    finally:
        for b, current in now:
            b.data = current


class _AtStep:
    """The training state of a checkpoint written after its step: as the step left it, with the
    values the script keeps (session.keep) as they are now."""

    def __init__(self, state: TrainState, at_step: dict):
        self.state, self.at_step = state, at_step

    def state_dict(self) -> dict:
        return {**self.at_step, **self.state.kept_state()}

    def load_state_dict(self, state: dict) -> None:
        self.state.load_state_dict(state)
