"""The training state: where a run is (optimizer steps, epoch, micro-steps into the current global
batch, each training loader's position) and every random generator of this rank. It is what a
resume must put back besides the models, optimizers and schedulers; the checkpoint manager saves
it through ``state_dict()`` like any other stateful object."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from phalanx.checkpoint import rng
from phalanx.errors import PhalanxError
from phalanx.session.kept import Kept

if TYPE_CHECKING:
    from phalanx.session.adaptive import AdaptiveBatch
    from phalanx.session.noise import NoiseProbe


class Resumable(Protocol):
    """A training loader as the state sees it (runtime.data.DeviceLoader)."""

    @property
    def epoch(self) -> int: ...

    @property
    def position(self) -> int | None: ...

    def resume_at(self, epoch: int, position: int | None) -> None: ...

    def epoch_done(self) -> bool: ...

    @property
    def passing(self) -> int: ...


class TrainState:
    def __init__(self, devices: torch.device | list[torch.device]):
        self.devices = devices  # whose random generators a checkpoint keeps (Strategy.devices)
        self.step = 0  # optimizer steps taken
        self.epoch = 0
        self.micro = 0  # micro-steps into the current global batch
        self.loaders: list[Resumable] = []  # training loaders, in set-up order
        self._pending_rng: dict[str, Any] | None = None  # restored when the next training pass starts
        # Positions of training loaders a resume found not set up yet: theirs when they are.
        self._pending_data: list[dict[str, Any]] = []
        self.kept: list[Kept] = []  # session.keep(): the script's own values (session/kept.py)
        self._pending_kept: dict[str, Any] = {}  # a checkpoint's kept values, for keep() calls to come
        self.resumed = False
        self.epochs_driven = False  # session.epochs() runs the loop (so a finished pass means the next epoch)
        self._rng_at_epoch = False  # the pending generators wait for the next epoch's start, not a pass's
        # Set by the batch owner (batch_plan.py): the noise scale's moving averages and batch.adaptive's
        # choices resume with the run.
        self.noise: NoiseProbe | None = None
        self.adaptive: AdaptiveBatch | None = None

    def keep(self, values: dict[str, Any]) -> Kept:
        taken = {name for kept in self.kept for name in kept.names()}
        twice = sorted(set(values) & taken)
        if twice:
            raise PhalanxError(f"session.keep() holds {', '.join(twice)} already; keep each value once")
        kept = Kept(values)
        kept.load_state_dict({k: v for k, v in self._pending_kept.items() if k in values})
        self.kept.append(kept)
        return kept

    def add_loader(self, loader: Resumable) -> None:
        self.loaders.append(loader)
        if self._pending_data:
            position = self._pending_data.pop(0)
            loader.resume_at(position["epoch"], position["position"])

    def positions(self) -> list[dict[str, Any]]:
        return [{"epoch": loader.epoch, "position": loader.position} for loader in self.loaders]

    def at_epoch_end(self) -> bool:
        """session.epochs() runs the loop and every training loader's pass is over: what remains of
        the epoch is the script's code after its inner loop, and then the next epoch."""
        return self.ends_epoch() and not any(loader.passing for loader in self.loaders)

    def ends_epoch(self) -> bool:
        """Under session.epochs(), every training loader has handed out its epoch's last batch (the
        pass may still be running: the step of that batch)."""
        return self.epochs_driven and bool(self.loaders) and all(loader.epoch_done() for loader in self.loaders)

    def state_dict(self, *, kept: bool = True) -> dict[str, Any]:
        """This rank's state; ``rng`` differs between ranks, the rest is the same on every rank.
        Taken after an epoch's passes ended (at_epoch_end), it is the state at the start of the next
        epoch: a resume goes on there, not into an empty pass of the finished one. Taken inside the
        last pass (a save in the loop body), the resume replays that empty pass and the code after it."""
        data, epoch = self.positions(), self.epoch
        ended = self.at_epoch_end()
        if ended:
            data = [{"epoch": loader.epoch + 1, "position": 0} for loader in self.loaders]
            # The loaders' epoch, not the counter: after session.epochs() has ended, the counter is
            # past the last epoch already (a final save after the loop is one epoch on, not two).
            epoch = max(epoch, max(loader.epoch for loader in self.loaders) + 1)
        state = {"step": self.step, "epoch": epoch, "data": data, "rng": rng.capture(self.devices)}
        if ended:
            state["epoch_start"] = True
        if kept:
            state.update(self.kept_state())
        if self.noise is not None:
            state["noise_scale"] = self.noise.state_dict()
        if self.adaptive is not None:
            state["adaptive_batch"] = self.adaptive.state_dict()
        return state

    def kept_state(self) -> dict[str, Any]:
        """session.keep()'s values as they are now (none kept: nothing)."""
        if not self.kept:
            return {}
        return {"kept": {k: v for kept in self.kept for k, v in kept.state_dict().items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``rng`` may be None (a checkpoint of another process count): the generators start fresh.
        Otherwise they are restored when the next training pass has drawn its loader seed, where the
        uninterrupted run's state was (at once when there is no training loader)."""
        self.step = state["step"]
        self.epoch = state["epoch"]
        self.micro = 0
        for loader, position in zip(self.loaders, state["data"]):
            loader.resume_at(position["epoch"], position["position"])
        self._pending_data = list(state["data"][len(self.loaders) :])
        self._pending_kept = dict(state.get("kept") or {})
        for kept in self.kept:
            kept.load_state_dict(self._pending_kept)
        self.resumed = True
        self._pending_rng = state.get("rng")
        if self.noise is not None:
            self.noise.load_state_dict(state.get("noise_scale"))
        if self.adaptive is not None:
            self.adaptive.load_state_dict(state.get("adaptive_batch"))
        # The saved generators come after the saved pass drew its loader seed (restored when the next
        # pass has drawn it, as on_iterating calls restore_rng); at an epoch's start they come before
        # the next epoch, restored when session.epochs() begins it; with no loader at all, now.
        self._rng_at_epoch = bool(state.get("epoch_start"))
        if not state["data"]:
            self.restore_rng()

    def restore_rng(self, *, at_epoch: bool = False) -> None:
        """``at_epoch``: session.epochs() starts an epoch (a pass start otherwise): generators saved at
        an epoch's start wait for that, those saved inside a pass for a pass."""
        if at_epoch != self._rng_at_epoch:
            return
        if self._pending_rng is not None:
            state, self._pending_rng = self._pending_rng, None
            rng.restore(state, self.devices)
