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
    from phalanx.faults.device_progress import DeviceFacts
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
        begins = next((i for i, line in enumerate(lines) if line.startswith("stack of rank")), 1)
        for line in lines[1:begins]:  # what the rank's device had done, on a GPU
            _err(f"    {line}")
        stack = [line for line in lines[begins + 1 :] if line.strip()]
        for line in stack[-_STACK_LINES:]:
            _err(f"    | {line}")
    _err(f"phalanx: full stacks in {hang_dir}; see docs/faults.md for what to look for")
    return markers.HANG_EXIT


def hang_summary(dumps: Mapping[int, str], silent: Iterable[int] = ()) -> str:
    """The hang's one-line verdict from every rank's dump (rank -> text): the ranks outside any
    collective are the hung ones, the ranks inside one were waiting for them. Which rank's watchdog
    fired first says nothing: every rank stops making progress at about the same moment. ``silent``:
    ranks that left no dump (their watchdog could not run, or they were already gone). On a GPU the
    dumps also say what each device had done, which decides where the stacks cannot (see
    :func:`_device_verdict`)."""
    # Only a hang needs them: not at start-up.
    from phalanx.faults.device_progress import parse_device_line
    from phalanx.faults.watchdog import classify, parse_stack

    waits = {rank: classify(parse_stack(text)) for rank, text in sorted(dumps.items())}
    devices = {rank: parse_device_line(text) for rank, text in dumps.items()}
    verdict = _device_verdict(waits, devices, sorted(silent))
    if verdict is not None:
        return verdict
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


def _device_verdict(
    waits: Mapping[int, Wait], devices: Mapping[int, DeviceFacts | None], silent: list[int]
) -> str | None:
    """The verdict from what each rank's GPU had done, or None where it decides nothing (no device
    facts, one process, every device idle at the same step): then the stacks decide.

    Under NCCL a rank waiting for a stuck peer is outside any collective on the host, blocked in a
    device sync, while the collective it queued waits on its GPU: its device has work pending. The
    stuck rank's device ran out of work. So a rank in its own code with an idle device, while other
    devices hold pending work, is the culprit."""
    facts = {rank: devices.get(rank) for rank in waits}
    if not facts or any(f is None or f.pending is None for f in facts.values()):
        return None
    if len(facts) == 1 and not silent:
        return None
    pending = [rank for rank, f in facts.items() if f.pending]
    # An idle device whose host waits in communication waits for someone on the host's side.
    behind = [rank for rank, f in facts.items() if not f.pending and not waits[rank].waiting]
    no_stack = f"; {_ranks(silent)} left no stack (stuck in native code, or already gone)" if silent else ""
    on_device = "on the device (collectives queued on their GPUs do not complete)"
    if pending and behind:
        them = "it" if len(behind) == 1 else "them"
        if len(behind) == 1:
            rank = behind[0]
            line = (
                f"rank {rank} stopped making progress after step {facts[rank].host_steps} "
                f"({_where(waits[rank])}) with nothing left to run on its device"
            )
        else:
            places = "; ".join(f"rank {rank} {_where(waits[rank])}" for rank in behind)
            line = f"{_ranks(behind)} stopped making progress with nothing left to run on their devices ({places})"
        were = "was" if len(pending) == 1 else "were"
        line += f"; {_ranks(pending)} {were} waiting for {them} {on_device}"
        elsewhere = [rank for rank in waits if rank not in behind and rank not in pending]
        if elsewhere:
            line += ", " + ", ".join(f"rank {rank} in {_what(waits[rank])}" for rank in elsewhere)
        return f"phalanx: hang: {line}{no_stack}"
    if pending and silent:
        them, likely = ("it", "it is") if len(silent) == 1 else ("them", "they are")
        return (
            f"phalanx: hang: {_ranks(silent)} left no stack (stuck in native code, or already gone), so {likely} "
            f"the likely hung {'rank' if len(silent) == 1 else 'ranks'}; {_ranks(pending)} "
            f"{'was' if len(pending) == 1 else 'were'} waiting for {them} {on_device}"
        )
    if len(pending) == len(facts):
        done = {rank: f.device_steps for rank, f in facts.items()}
        known = [d for d in done.values() if d is not None]
        if len(known) == len(done) and len(set(known)) > 1:
            late = [rank for rank, d in done.items() if d == min(known)]
            return (
                f"phalanx: hang: every device holds work that does not complete; {_ranks(late)} "
                f"{'is' if len(late) == 1 else 'are'} behind (its device finished {min(known)} steps, the "
                f"others {max(known)}): stuck in a kernel of its own, or in communication the others did not start"
            )
        each = ", ".join(f"rank {rank} {_where(wait)}" for rank, wait in waits.items())
        return (
            "phalanx: hang: every device holds work that does not complete and none is behind: a kernel that never "
            "finishes, communication that does not complete (check the network and NCCL with phalanx doctor), or "
            f"ranks that queued different collectives (their hosts: {each})"
        )
    if pending or any(wait.waiting for wait in waits.values()):
        return None
    steps = {rank: f.host_steps for rank, f in facts.items()}
    fewest = min(steps.values())
    if len(set(steps.values())) == 1:
        return None
    late = [rank for rank, n in steps.items() if n == fewest]
    places = "; ".join(f"rank {rank} {_where(waits[rank])}" for rank in late)
    others = "; ".join(f"rank {rank} {_where(wait)}" for rank, wait in waits.items() if rank not in late)
    return (
        f"phalanx: hang: {_ranks(late)} {'is' if len(late) == 1 else 'are'} behind: {fewest} steps ended on "
        f"{'its host' if len(late) == 1 else 'their hosts'}, {max(steps.values())} on the others' ({places}); "
        f"every device is idle and no rank is in a collective (the others: {others}){no_stack}"
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
