"""What the launcher tells the user when a job did not simply succeed: which rank failed and why,
where every rank was stuck in a hang, or where a pre-empted job left its checkpoint."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping

from phalanx.faults import markers

if TYPE_CHECKING:
    from phalanx.faults.watchdog import Wait

_LOG_TAIL_LINES = 15
_STACK_LINES = 6
# Errors a rank raises because another rank died first (its sockets closed under it).
CONSEQUENCES = (
    "Connection closed by peer",
    "remote worker crashing",
    "Connection reset by peer",
    "Broken pipe",
    "ncclRemoteError",  # NCCL: a peer's communicator failed or its process is gone
    "NCCL communicator was aborted",
)


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
    texts = {int(d.stem[4:]): d.read_text(encoding="utf-8", errors="replace") for d in dumps if d.stem[4:].isdigit()}
    attempt = hang_dir.name[7:] if hang_dir.name.startswith("attempt") else "0"
    _err(hang_summary(texts, _ranks_with_logs(run_dir, int(attempt or 0)) - texts.keys()))
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


def hang_summary(dumps: Mapping[int, str], silent: Iterable[int] = ()) -> str:
    """The hang's one-line verdict from every rank's dump (rank -> text): the ranks outside any
    collective are the hung ones, the ranks inside one were waiting for them. Which rank's watchdog
    fired first says nothing: every rank stops making progress at about the same moment. ``silent``:
    ranks that left no dump (their watchdog could not run, or they were already gone)."""
    from phalanx.faults.watchdog import classify, parse_stack  # only a hang needs it: not at start-up

    waits = {rank: classify(parse_stack(text)) for rank, text in sorted(dumps.items())}
    hung = [rank for rank, wait in waits.items() if not wait.waiting]
    waiting = [rank for rank, wait in waits.items() if wait.waiting]
    silent = sorted(silent)
    its = "its watchdog" if len(silent) == 1 else "their watchdogs"
    no_stack = (
        f"{_ranks(silent)} left no stack ({its} could not run: stuck in native code that holds the "
        "interpreter lock, or already gone)"
    )
    if not waits:
        return "phalanx: hang: the watchdog stopped the job, but no rank left its stack" + (
            f"; {no_stack}" if silent else ""
        )
    if hung:
        if len(hung) == 1:
            line = f"{_ranks(hung)} stopped making progress ({_where(waits[hung[0]])})"
        else:
            places = "; ".join(f"rank {rank} {_where(waits[rank])}" for rank in hung)
            everyone = "every rank" if not waiting and not silent else _ranks(hung)
            line = f"{everyone} stopped making progress outside any collective ({places})"
        if waiting:
            them = "it" if len(hung) == 1 else "them"
            line += f"; {_waiting_groups(waits, waiting, them)}"
        return f"phalanx: hang: {line}" + (f"; {no_stack}" if silent else "")
    if silent:
        them, likely = (
            ("it", "it is the likely hung rank") if len(silent) == 1 else ("them", "they are the likely hung ranks")
        )
        return f"phalanx: hang: {no_stack}, so {likely}; {_waiting_groups(waits, waiting, them)}"
    places = {
        (w.kind, w.op, w.frame.filename if w.frame else "", w.frame.lineno if w.frame else 0) for w in waits.values()
    }
    if len(places) == 1:
        wait = next(iter(waits.values()))
        return (
            f"phalanx: hang: every rank was waiting in {_what(wait)} ({_where(wait)}) and none elsewhere: "
            "the communication itself did not complete (check the network and NCCL with phalanx doctor), "
            "or the ranks are in different calls of it (for example different numbers of batches)"
        )
    each = ", ".join(f"rank {rank} in {_what(wait)} {_where(wait)}" for rank, wait in waits.items())
    return (
        f"phalanx: hang: every rank was waiting in a collective, but not in the same one ({each}): "
        "the ranks took different paths through the code"
    )


def _waiting_groups(waits: Mapping[int, Wait], waiting: list[int], them: str) -> str:
    groups: dict[str, list[int]] = {}
    for rank in waiting:
        groups.setdefault(_what(waits[rank]), []).append(rank)
    # "rank 0 was waiting for it in all_reduce, ranks 2, 3 in backward (...)"
    parts: list[str] = []
    for what, ranks in groups.items():
        verb = "" if parts else (" was" if len(ranks) == 1 else " were") + f" waiting for {them}"
        parts.append(f"{_ranks(ranks)}{verb} in {what}")
    return ", ".join(parts)


def _what(wait: Wait) -> str:
    return "backward (where DDP/FSDP exchange gradients)" if wait.kind == "backward" else wait.op


def _where(wait: Wait) -> str:
    frame = wait.frame
    if frame is None:
        return "with an empty stack"
    function = "" if frame.name == "<module>" else f"in {frame.name} "
    source = f": {frame.line}" if frame.line else ""
    return f"{function}at {os.path.basename(frame.filename)}:{frame.lineno}{source}"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _ranks_with_logs(run_dir: Path, attempt: int) -> set[int]:
    """The ranks of this node that ran in ``attempt``: each writes its log (see launch/output.py)."""
    suffix = f".attempt{attempt}.log" if attempt else ".log"
    ranks = set()
    for log in (run_dir / "logs").glob(f"rank*{suffix}"):
        number = log.name[4 : -len(suffix)]
        if number.isdigit():
            ranks.add(int(number))
    return ranks


def report_preemption(run_dir: Path, leaving: bool = False) -> int:
    """``leaving``: one node of an elastic job got the SIGTERM; the others go on without it."""
    record = run_dir / markers.PREEMPTED
    if record.is_file():
        saved = json.loads(record.read_text(encoding="utf-8"))
        if leaving:
            _err(
                f"phalanx: this node left the job: every rank checkpointed at step {saved['step']} "
                f"({saved['checkpoint']}); nodes that did not get the SIGTERM go on from there, and a relaunch "
                "resumes from it"
            )
            return markers.PREEMPTED_EXIT
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
        if not any(text in _message(info) for text in CONSEQUENCES):
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
