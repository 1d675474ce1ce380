"""phalanx: take a one-GPU PyTorch training loop to every GPU of the machine."""

from __future__ import annotations

import importlib
from typing import Any

from phalanx.version import __version__

# Imported on first use: `import phalanx` stays cheap (no torch) for the worker bootstrap, which
# must be able to leave quietly when interrupted while torch is still loading.
_EXPORTS = {
    "Config": "phalanx.config",
    "ConfigError": "phalanx.errors",
    "PhalanxError": "phalanx.errors",
    "Session": "phalanx.session",
    "Topology": "phalanx.topology",
    "spawn": "phalanx.launch.spawn",
}

# A Config knows strategy.ddp, strategy.fsdp, ... once the strategies have registered them (the
# config layer sits below the strategies and cannot import them), so phalanx.Config loads them first.
_FIRST = {"Config": "phalanx.strategies"}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        if name in _FIRST:
            importlib.import_module(_FIRST[name])
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'phalanx' has no attribute '{name}'")
