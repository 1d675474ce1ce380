"""phalanx: take a one-GPU PyTorch training loop to every GPU of the machine."""

from phalanx.config import Config
from phalanx.errors import ConfigError, PhalanxError
from phalanx.launch.spawn import spawn
from phalanx.session import Session
from phalanx.topology import Topology

__version__ = "0.1.0"

__all__ = ["Config", "ConfigError", "PhalanxError", "Session", "Topology", "spawn", "__version__"]
