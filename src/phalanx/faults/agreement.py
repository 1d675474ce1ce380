"""Decisions every rank must take at the same optimizer step (stop for pre-emption, save because
the save timer ran out, save and hold because a node waits to join an elastic job), agreed with one
tiny all-reduce about once a second.

Ranks see a SIGTERM or a clock at slightly different moments; acting on their own they would call
different collectives at the same step (one saves, one trains) and hang. Checking every step would
add a collective to every step, so the check runs every K steps, K chosen from the slowest rank's
step time so that checks are about a second apart (the same K on every rank: it comes out of the
all-reduce).
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

_CHECK_EVERY_S = 1.0
_MAX_INTERVAL = 1000


class StepAgreement:
    def __init__(self, world_size: int, comm_device: torch.device, save_period_s: float | None):
        self.world_size = world_size
        self.comm_device = comm_device
        self.save_period_s = save_period_s
        self._last_save = time.monotonic()
        self._next_check = 1
        self._since = (0, time.monotonic())  # (step, time) of the last check
        self._next_look = time.monotonic()  # a lone process's next look for a joining node

    def saved(self) -> None:
        self._last_save = time.monotonic()

    def poll(
        self, step: int, stop_requested: bool, resize_requested: Callable[[], bool] = lambda: False
    ) -> tuple[bool, bool, bool]:
        """(stop, save, resize) for the step that just finished; the same answer on every rank.
        ``resize_requested`` is asked only at the steps where the ranks agree."""
        now = time.monotonic()
        save_due = self.save_period_s is not None and now - self._last_save >= self.save_period_s
        if self.world_size == 1 or not dist.is_initialized():
            # Alone, nobody to agree with: the join marker is looked at about once a second.
            resize = now >= self._next_look and resize_requested()
            if now >= self._next_look:
                self._next_look = now + _CHECK_EVERY_S
            return stop_requested, save_due, resize
        if step < self._next_check:
            return False, False, False
        last_step, last_time = self._since
        per_step = (now - last_time) / max(step - last_step, 1)
        flags = torch.tensor(
            [float(stop_requested), float(save_due), per_step, float(resize_requested())],
            dtype=torch.float64,
            device=self.comm_device,
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, save, slowest, resize = flags.tolist()
        self._next_check = step + max(1, min(_MAX_INTERVAL, int(_CHECK_EVERY_S / max(slowest, 1e-6))))
        self._since = (step, time.monotonic())
        return bool(stop), bool(save), bool(resize)
