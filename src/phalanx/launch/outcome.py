"""What the launcher tells the user when a job did not simply succeed: which rank failed and why,
where every rank was stuck in a hang, or where a pre-empted job left its checkpoint."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from phalanx.faults import markers

_LOG_TAIL_LINES = 15
_STACK_LINES = 6
# Errors a rank raises because another rank died first (its sockets closed under it).
_CONSEQUENCES = ("Connection closed by peer", "remote worker crashing", "Connection reset by peer", "Broken pipe")


def report_failure(run_dir: Path, failure) -> int:
    """The failure summary; returns the exit code for the CLI."""
    if (run_dir / markers.HANG_DIR).is_dir():
        return report_hang(run_dir)
    rank, first = _first_cause(failure)
    message = _message(first)
    exit_code = first.exitcode if first.exitcode and first.exitcode > 0 else 1
    for prefix in ("PhalanxError: ", "ConfigError: "):
        if message.startswith(prefix):
            _err(f"phalanx: error: {message[len(prefix) :]}")
            return exit_code
    failed = sorted(failure.failures)
    how = f"exit code {first.exitcode}" if first.exitcode >= 0 else f"signal {-first.exitcode}"
    summary = (
        message.splitlines()[-1]
        if message and not message.startswith("To enable traceback")
        else "no exception recorded"
    )
    _err(f"phalanx: rank {rank} failed first ({how}): {summary}")
    if len(failed) > 1:
        _err(
            f"phalanx: ranks that exited with an error (the others may have failed because rank {rank} did): "
            f"{', '.join(map(str, failed))}"
        )
    log = _latest_log(run_dir, rank)
    tail = log.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:] if log.is_file() else []
    if not tail:
        _err(f"phalanx: rank {rank} wrote nothing to {log}")
    else:
        _err(f"phalanx: last lines of {log}:")
        for line in tail:
            _err(f"  | {line}")
    return exit_code if exit_code < 128 else 1


def report_hang(run_dir: Path) -> int:
    """Every rank's stack dump, shortened to where it waits (full dumps in the run directory)."""
    attempts = sorted((run_dir / markers.HANG_DIR).glob("attempt*"), key=lambda p: int(p.name[7:] or 0))
    hang_dir = attempts[-1] if attempts else run_dir / markers.HANG_DIR
    dumps = sorted(hang_dir.glob("rank*.txt"), key=lambda p: int(p.stem[4:]) if p.stem[4:].isdigit() else 0)
    # Which limit fired (hang_timeout, or first_step_timeout before the first step) is in each
    # rank's own headline below.
    _err(f"phalanx: hang: the watchdog stopped the job; where each rank was ({len(dumps)} dumped):")
    for dump in dumps:
        lines = dump.read_text(encoding="utf-8", errors="replace").splitlines()
        _err(f"  {lines[0].removeprefix('phalanx: hang: ') if lines else dump.stem}")
        stack = [line for line in lines[2:] if line.strip()]
        for line in stack[-_STACK_LINES:]:
            _err(f"    | {line}")
    _err(f"phalanx: full stacks in {hang_dir}; see docs/faults.md for what to look for")
    return markers.HANG_EXIT


def report_preemption(run_dir: Path) -> int:
    record = run_dir / markers.PREEMPTED
    if record.is_file():
        saved = json.loads(record.read_text(encoding="utf-8"))
        _err(
            f"phalanx: pre-empted: checkpoint {saved['checkpoint']} (step {saved['step']}); "
            "run the same command again to resume"
        )
        return markers.PREEMPTED_EXIT
    _err(
        "phalanx: stopped by SIGTERM before a checkpoint was written "
        f"(no rank reached the end of a training step in time); logs in {run_dir / 'logs'}"
    )
    return markers.TERMINATED_EXIT


def _first_cause(failure):
    """The earliest failure that is not another rank's death seen through a closed connection."""
    ordered = sorted(failure.failures.items(), key=lambda item: item[1].timestamp)
    for rank, info in ordered:
        if not any(text in _message(info) for text in _CONSEQUENCES):
            return rank, info
    return failure.get_first_failure()


def _message(info) -> str:
    message = info.message
    if isinstance(message, dict):
        message = message.get("message", "")
    return str(message or "")


def _latest_log(run_dir: Path, rank: int) -> Path:
    logs = run_dir / "logs"
    attempts = sorted(logs.glob(f"rank{rank}.attempt*.log"), key=lambda p: int(p.stem.rpartition("attempt")[2] or 0))
    return attempts[-1] if attempts else logs / f"rank{rank}.log"


def _err(line: str) -> None:
    print(line, file=sys.stderr)
