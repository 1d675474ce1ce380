"""Files in the run directory through which the launcher and the workers tell each other why a
job is stopping (a signal number alone cannot say whether SIGTERM means pre-emption or "a peer
died, stop now")."""

from __future__ import annotations

import json
from pathlib import Path

PREEMPT_REQUEST = "preempt-requested"  # the launcher got SIGTERM: ranks should checkpoint and stop
PREEMPTED = "preempted.json"  # rank 0 saved after a pre-emption request: where and at which step
HANG_DIR = "hang"  # one file per rank that dumped its stack because the job hung
FATAL = "fatal.txt"  # a user error: restarting cannot help, so restarts re-report it at once

# Exit codes the launcher and docs/faults.md name.
PREEMPTED_EXIT = 75  # EX_TEMPFAIL: a checkpoint was written, launch again to resume
HANG_EXIT = 124  # the watchdog stopped a hung job (as timeout(1) does)
TERMINATED_EXIT = 143  # 128 + SIGTERM: stopped without a checkpoint


def path(run_dir: str | Path | None, name: str) -> Path | None:
    return Path(run_dir) / name if run_dir else None


def hang_dump(run_dir: str | Path | None, attempt: int, rank: int) -> Path | None:
    """Where ``rank`` writes its stack when restart attempt ``attempt`` hangs: one directory per
    attempt, so a restarted job never reads the last attempt's dumps."""
    return Path(run_dir) / HANG_DIR / f"attempt{attempt}" / f"rank{rank}.txt" if run_dir else None


# An elastic job (launch/elastic.py): a node waits to join, so the ranks checkpoint and hold until
# their agent restarts them with it; and the log of the rounds this node took part in.
RESIZE_REQUEST = "resize-requested"
RESIZE_SAVED = "resize-saved"
RENDEZVOUS_LOG = "rendezvous.jsonl"
CRASHED_DIR = "crashed"  # one file per rank whose own error (not a lost peer) ended an attempt


def resize_nonce(run_dir: str | Path | None, name: str) -> str | None:
    """The nonce of the resize marker ``name`` (RESIZE_REQUEST or RESIZE_SAVED), None without one:
    a saved marker counts only for the request it answers, never for an earlier join's."""
    if not run_dir:
        return None
    try:
        return json.loads((Path(run_dir) / name).read_text(encoding="utf-8")).get("nonce")
    except (OSError, ValueError, AttributeError):
        return None


def resize_held(run_dir: str | Path | None) -> bool:
    """This node's ranks saved for the join now asked for, and hold until their agent restarts them."""
    asked = resize_nonce(run_dir, RESIZE_REQUEST)
    return asked is not None and resize_nonce(run_dir, RESIZE_SAVED) == asked


def crash_record(run_dir: str | Path | None, attempt: int, rank: int) -> Path | None:
    return Path(run_dir) / CRASHED_DIR / f"attempt{attempt}" / f"rank{rank}.json" if run_dir else None


def crashes(run_dir: str | Path, attempt: int) -> list[dict]:
    """The crash records of ``attempt`` on this node (see launch/worker.py)."""
    found = []
    for record in sorted((Path(run_dir) / CRASHED_DIR / f"attempt{attempt}").glob("rank*.json")):
        try:
            found.append(json.loads(record.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return found
