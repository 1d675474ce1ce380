"""What ``phalanx verify`` prints: one table (step, the two differences, verdict), then the
verdict in a line, and where the runs differ, the first step and tensor and the likely causes."""

from __future__ import annotations

from phalanx.verify import VerifyResult
from phalanx.verify.compare import StepDiff


def _cell(diff: StepDiff | None) -> str:
    if diff is None:
        return ""
    return f"{diff.difference:.1e}" if diff.difference != float("inf") else "inf"


def table(result: VerifyResult) -> list[str]:
    scaling = {d.step: d for d in result.scaling}
    resume = {d.step: d for d in result.resume}
    header = ("step", f"1 vs {result.nproc} processes", f"resumed at {result.resumed_at} vs not", "verdict")
    rows = []
    for step in sorted(set(scaling) | set(resume)):
        diffs = [d for d in (scaling.get(step), resume.get(step)) if d is not None]
        verdict = "equal" if all(d.holds(result.tolerance) for d in diffs) else "DIFFERS"
        label = "0 (start)" if step == 0 else str(step)
        rows.append((label, _cell(scaling.get(step)), _cell(resume.get(step)), verdict))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]


def summary(result: VerifyResult) -> list[str]:
    tol = f"{result.tolerance:.0e}"
    lines = [
        f"the most different weight tensor's relative rms difference; tolerance {tol} (docs/verify.md#the-tolerance)"
    ]
    lines += [f"note: {n}" for n in result.notes]
    if result.holds and not result.inconclusive:
        worst = max(d.difference for d in result.scaling)
        lines.append(
            f"phalanx: verify: {result.nproc} processes train like 1 for {len(result.scaling) - 1} steps "
            f"(largest difference {worst:.1e}), and a resume at step {result.resumed_at} matches the uninterrupted "
            "run"
        )
        return lines
    if result.inconclusive:
        lines.append(f"phalanx: verify: cannot tell: {result.inconclusive}")
        return lines
    for failure, what in (
        (result.scaling_failure, f"{result.nproc} processes do not train like 1"),
        (result.resume_failure, f"the run resumed at step {result.resumed_at} does not match the uninterrupted one"),
    ):
        if failure is not None:
            where = "before the first step" if failure.step == 0 else f"at step {failure.step}"
            size = "" if failure.difference == float("inf") else f" ({failure.difference:.1e} > {tol})"
            detail = f"; {failure.note}" if failure.note else ""
            lines.append(f"phalanx: verify: {what}: first {where}, in {failure.tensor}{size}{detail}")
    if result.causes:
        lines.append("likely causes:")
        lines += [f"  - {c}" for c in result.causes]
    else:
        lines.append(
            "likely causes: none that phalanx can see; look for code that reads the rank or the world size "
            "between setup() and the step (docs/verify.md#when-it-differs)"
        )
    return lines
