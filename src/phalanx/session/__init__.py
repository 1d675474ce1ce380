"""The user-facing Session and its collaborators: the training state it counts in, the recovery
side (resume decisions, timed and pre-emption saves, the hang watchdog's heartbeat)."""

from phalanx.session.session import Session

__all__ = ["Session"]
