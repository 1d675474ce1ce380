"""The likely causes of a difference that verify can see: what the runs' own warnings said, what
the trace's facts say about the models, where the first difference is, and what ``phalanx check``
finds in the script's source."""

from __future__ import annotations

import re
from pathlib import Path

from phalanx.errors import PhalanxError
from phalanx.verify.compare import StepDiff

# A phalanx line in a run's log -> the cause it names (the line itself follows as the detail).
_SAID = [
    (re.compile(r"BatchNorm layers? normalises? .* will not train like one"), "BatchNorm without sync"),
    (re.compile(r"the loss is a sum"), "a sum loss"),
    (
        re.compile(r"scheduler\.step\(\) is called between the micro-steps|the script called \S+\.step\(\) itself"),
        "a scheduler stepped by hand",
    ),
]
# A resume's own: what the resumed run said of a loop that restarts its count.
_RESUME_SAID = [
    (
        re.compile(r"this run resumed at step \d+, but (nothing in the loop follows|phalanx does not see where)"),
        "a loop that restarts",
    )
]
_RUNNING_STATS = re.compile(r"(^|\.)(running_mean|running_var|num_batches_tracked)$")


def from_logs(lines: list[str], said: list = _SAID) -> list[str]:
    """Causes the runs' own warnings name, each once, with the warning's text."""
    out: dict[str, str] = {}
    for line in lines:
        text = re.sub(r"^\[rank \d+\] ", "", line.strip())
        if not text.startswith("phalanx: "):
            continue
        for pattern, cause in said:
            if pattern.search(text) and cause not in out:
                out[cause] = f"{cause}: {text.removeprefix('phalanx: ').removeprefix('warning: ')}"
    return list(out.values())


def from_first_difference(first: StepDiff, facts: dict) -> list[str]:
    out = []
    if first.step == 0:
        out.append(
            "a model built differently at N processes: the weights differ before the first step (an init or a size "
            "that depends on the rank or the world size)"
        )
    if first.tensor and _RUNNING_STATS.search(first.tensor):
        out.append(f"BatchNorm without sync: {first.tensor} is a BatchNorm statistic, kept per process")
    if facts.get("split_batches") is False:
        out.append(
            "batches that phalanx does not split: neither a training DataLoader through session.setup() nor "
            "session.shard(), so if the script draws its own batches per rank (random positions, as nanoGPT's "
            "get_batch), N processes train on other samples than one and the weights cannot match, though each "
            "run is correct"
        )
    random = facts.get("random_modules") or []
    if random:
        shown = ", ".join(random[:3]) + (f" and {len(random) - 3} more" if len(random) > 3 else "")
        out.append(
            f"randomness that depends on the rank: dropout ({shown}) draws other masks at N processes than at "
            "one; verify with dropout off (p=0) to compare the rest"
        )
    return out


def from_source(script: str) -> list[str]:
    """``phalanx check``'s findings in the script, as causes."""
    from phalanx.check import check_file, format_finding

    try:
        findings = check_file(script)
    except PhalanxError:
        return []
    return [f"phalanx check: {format_finding(f)}" for f in findings]


def resume_causes(first: StepDiff, resumed_at: int, log_lines: list[str]) -> list[str]:
    """Why a resumed run parts from the uninterrupted one."""
    out = from_logs(log_lines, _RESUME_SAID)
    if first.step == resumed_at:
        out.append(
            f"a checkpoint that does not hold everything: the resumed run's weights differ from the saved step "
            f"{resumed_at}'s already, so something the script changes in the weights after setup() is not restored"
        )
    elif not out:  # the resumed run's own warning says it better, with its step
        out.append(
            "a loop that does not pick up where the checkpoint left off: a loop of the script's own over its "
            "data (range(...) over tensors, its own epoch counter) starts again at its first batch; iterate a "
            "loader phalanx set up inside session.epochs(), or keep the position with session.keep() "
            "(docs/session.md#keepvalues)"
        )
    return out


def likely_causes(first: StepDiff, facts: dict, log_lines: list[str], script: str | Path) -> list[str]:
    """Every cause seen of 1 and N processes parting, the most direct first: the runs' warnings, the
    difference itself, the source."""
    seen: list[str] = []
    for cause in [*from_logs(log_lines), *from_first_difference(first, facts), *from_source(str(script))]:
        label = cause.split(":", 1)[0]
        if cause not in seen and not any(s.split(":", 1)[0] == label != "phalanx check" for s in seen):
            seen.append(cause)
    return seen
