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


class TrainState:
    def __init__(self, device: torch.device):
        self.device = device
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

    def state_dict(self, *, kept: bool = True) -> dict[str, Any]:
        """This rank's state; ``rng`` differs between ranks, the rest is the same on every rank.
        Taken on the last step of an epoch (every training loader's pass is done), it is the state
        at the start of the next one: a resume goes on there, not into an empty pass."""
        data, epoch = self.positions(), self.epoch
        if self.loaders and all(loader.epoch_done() for loader in self.loaders):
            data = [{"epoch": loader.epoch + 1, "position": 0} for loader in self.loaders]
            epoch += 1
        state = {"step": self.step, "epoch": epoch, "data": data, "rng": rng.capture(self.device)}
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
        # The saved generators come after the saved pass drew its loader seed; a pass yet to start (a
        # checkpoint at an epoch's end, or none at all) draws after them, so they are restored now.
        if not state["data"] or all(position["position"] == 0 for position in state["data"]):
            self.restore_rng()

    def restore_rng(self) -> None:
        if self._pending_rng is not None:
            state, self._pending_rng = self._pending_rng, None
            rng.restore(state, self.device)
