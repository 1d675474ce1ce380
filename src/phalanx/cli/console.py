"""The rich console the commands print tables on."""

from __future__ import annotations

from rich.console import Console


def console(width: int = 120) -> Console:
    """The terminal's own width; pipes and logs get ``width`` columns, not rich's narrow 80."""
    terminal = Console()
    return terminal if terminal.is_terminal else Console(width=width)
