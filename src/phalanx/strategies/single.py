"""One process, one device: the non-distributed path is a strategy like any other."""

from __future__ import annotations

from typing import ClassVar

from phalanx.strategies.base import Strategy


class SingleDevice(Strategy):
    name = "single"
    processes_per_node = 1
    advice: ClassVar[dict[str, str]] = {"launch.nproc": "or use strategy ddp"}
    local_forward = True
