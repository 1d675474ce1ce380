"""One process, one device: the non-distributed path is a strategy like any other."""

from __future__ import annotations

from phalanx.strategies.base import Strategy


class SingleDevice(Strategy):
    name = "single"
    processes_per_node = 1
    local_forward = True
