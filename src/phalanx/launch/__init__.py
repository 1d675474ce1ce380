"""Starting processes: ``phalanx launch`` (torch elastic) and ``phalanx.spawn`` (torch.multiprocessing)."""

from phalanx.launch.launcher import LaunchRequest, launch, prepare
from phalanx.launch.spawn import spawn

__all__ = ["LaunchRequest", "launch", "prepare", "spawn"]
