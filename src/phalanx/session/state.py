"""The training state: where a run is (optimizer steps, epoch, micro-steps into the current global
batch, each training loader's position) and every random generator of this rank. It is what a
resume must put back besides the models, optimizers and schedulers; the checkpoint manager saves
it through ``state_dict()`` like any other stateful object."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from phalanx.checkpoint import rng

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


class TrainState:
    def __init__(self, device: torch.device):
        self.device = device
        self.step = 0  # optimizer steps taken
        self.epoch = 0
        self.micro = 0  # micro-steps into the current global batch
        self.loaders: list[Resumable] = []  # training loaders, in set-up order
        self._pending_rng: dict[str, Any] | None = None  # restored when the next training pass starts
        # Set by the batch owner (batch_plan.py): the noise scale's moving averages and batch.adaptive's
        # choices resume with the run.
        self.noise: NoiseProbe | None = None
        self.adaptive: AdaptiveBatch | None = None

    def add_loader(self, loader: Resumable) -> None:
        self.loaders.append(loader)

    def positions(self) -> list[dict[str, Any]]:
        return [{"epoch": loader.epoch, "position": loader.position} for loader in self.loaders]

    def state_dict(self) -> dict[str, Any]:
        """This rank's state; ``rng`` differs between ranks, the rest is the same on every rank."""
        state = {"step": self.step, "epoch": self.epoch, "data": self.positions(), "rng": rng.capture(self.device)}
        if self.noise is not None:
            state["noise_scale"] = self.noise.state_dict()
        if self.adaptive is not None:
            state["adaptive_batch"] = self.adaptive.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``rng`` may be None (a checkpoint of another process count): the generators start fresh.
        Otherwise they are restored when the next training pass has drawn its loader seed, where the
        uninterrupted run's state was (at once when there is no training loader)."""
        self.step = state["step"]
        self.epoch = state["epoch"]
        self.micro = 0
        for loader, position in zip(self.loaders, state["data"]):
            loader.resume_at(position["epoch"], position["position"])
        self._pending_rng = state.get("rng")
        if self.noise is not None:
            self.noise.load_state_dict(state.get("noise_scale"))
        if self.adaptive is not None:
            self.adaptive.load_state_dict(state.get("adaptive_batch"))
        if not self.loaders:
            self.restore_rng()

    def restore_rng(self) -> None:
        if self._pending_rng is not None:
            state, self._pending_rng = self._pending_rng, None
            rng.restore(state, self.device)
