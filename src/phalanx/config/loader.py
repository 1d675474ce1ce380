"""Loading phalanx's own Config: defaults < file < keyword arguments < ``--set`` (docs/config.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

from phalanx.config.schema import Config
from phalanx.config.sources import DEFAULT_FILE, override, read_file, resolve, tomllib
from phalanx.topology import LaunchContext


def load_config(
    path: str | Path | None = None,
    *,
    overrides: Iterable[str] = (),
    sections: Mapping[str, Any] | None = None,
    context: LaunchContext | None = None,
    cwd: Path | None = None,
) -> Config:
    """Resolve the config. Under ``phalanx launch`` the launcher's ``--config`` beats ``path`` and its
    ``--set`` lines are applied last, so the command line always has the final word."""
    return resolve(Config, path, overrides=overrides, sections=sections, context=context, cwd=cwd)


def override_config(config: Config, sections: Mapping[str, Any], context: LaunchContext | None = None) -> Config:
    """A copy of ``config`` with keyword-argument sections from code merged on top, and the
    launcher's ``--set`` lines (from ``context``) on top of those."""
    return override(config, sections, context)


__all__ = ["DEFAULT_FILE", "load_config", "override_config", "read_file", "tomllib"]
