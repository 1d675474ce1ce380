"""``phalanx verify``: the equivalence proof on the user's own script. K optimizer steps at one
process and at N, with the same global batch and seed, weights compared after every step; then the
N-process run resumed from its step K/2 and compared with itself uninterrupted (docs/verify.md)."""

from __future__ import annotations

import ast
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from phalanx.errors import PhalanxError
from phalanx.harness.launching import TrialOptions
from phalanx.launch.launcher import new_run_dir
from phalanx.verify.causes import from_source, likely_causes, resume_causes
from phalanx.verify.compare import (
    TOLERANCE,
    StepDiff,
    compare_traces,
    compare_weights,
    first_failure,
    load_trace,
    trace_facts,
    traced_steps,
)
from phalanx.verify.runs import launch_all

# A run whose weights moved less than this many tolerances cannot show a difference of one.
MOVED_ENOUGH = 100

__all__ = ["TOLERANCE", "VerifyOptions", "VerifyResult", "parted_from_rounding", "run_verify", "uses_phalanx"]


@dataclass(frozen=True)
class VerifyOptions:
    script: str
    script_args: tuple[str, ...] = ()
    nproc: int = 2
    steps: int = 8
    tolerance: float = TOLERANCE
    config_file: str | None = None
    overrides: tuple[str, ...] = ()
    run_dir: str | None = None  # None: a temporary directory, removed at the end
    fp64: bool = False  # compare in float64, where rounding cannot hide nor fake a difference

    def check(self) -> None:
        if self.nproc < 2:
            raise PhalanxError(f"--nproc must be at least 2 (it compares N processes with one); got {self.nproc}")
        if self.steps < 2:
            raise PhalanxError(f"--steps must be at least 2 (the resume happens at step steps/2); got {self.steps}")
        if not self.tolerance > 0:
            raise PhalanxError(f"--tolerance must be a positive number, e.g. 1e-5; got {self.tolerance}")


@dataclass
class VerifyResult:
    nproc: int
    steps: int
    tolerance: float
    scaling: list[StepDiff]  # 1 process vs N, per traced step (0 = before the first step)
    resume: list[StepDiff]  # resumed vs uninterrupted, from the resume's step on
    resumed_at: int
    causes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    directory: Path | None = None
    inconclusive: str | None = None  # why the runs, though equal, cannot show a difference (exit 2)

    @property
    def scaling_failure(self) -> StepDiff | None:
        return first_failure(self.scaling, self.tolerance)

    @property
    def resume_failure(self) -> StepDiff | None:
        return first_failure(self.resume, self.tolerance)

    @property
    def holds(self) -> bool:
        return bool(self.scaling) and bool(self.resume) and not self.scaling_failure and not self.resume_failure

    @property
    def exit_code(self) -> int:
        if not self.scaling_failure and not self.resume_failure and (self.inconclusive or not self.holds):
            return 2  # nothing wrong seen, and nothing proven either
        return 0 if self.holds else 1


def uses_phalanx(script: str) -> bool:
    """Whether the script imports phalanx: only then do its steps and weights reach verify."""
    try:
        tree = ast.parse(Path(script).read_text(encoding="utf-8"), filename=script)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return True  # the launch's own checks name what is wrong with it
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "phalanx" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "phalanx":
            return True
    return False


def plain_script_lines(script: str) -> list[str]:
    """What verify says of a script that does not use phalanx."""
    lines = [
        f"phalanx: verify: {script} does not use phalanx.Session, so verify cannot see its optimizer steps or "
        "weights to compare. It can, once the script trains through a Session (docs/porting.md: a few changed "
        "lines). Until then, `phalanx check` reads its source for the known distributed mistakes:"
    ]
    findings = from_source(script)
    lines += [f"  {f.removeprefix('phalanx check: ')}" for f in findings] or ["  (no findings)"]
    return lines


def run_verify(options: VerifyOptions, say: Callable[[str], None] = print) -> VerifyResult:
    options.check()
    trial = TrialOptions(
        script=options.script,
        script_args=options.script_args,
        config_file=options.config_file,
        overrides=options.overrides,
        steps=options.steps,
        warmup=0,
        cpu=True,  # gloo on CPU: the same sums in the same order at 1 and at N, on any machine
        run_dir=options.run_dir,
    )
    if options.run_dir:
        root = new_run_dir(Path(options.run_dir).resolve(), "verify")
        root.mkdir(parents=True)
        return _verify(options, trial, root, say)
    with tempfile.TemporaryDirectory(prefix="phalanx-verify-") as tmp:
        return _verify(options, trial, Path(tmp), say)


def _verify(options: VerifyOptions, trial: TrialOptions, root: Path, say: Callable[[str], None]) -> VerifyResult:
    precision = "fp64" if options.fp64 else "fp32"
    runs = launch_all(trial, options.script, options.script_args, options.nproc, options.steps, root, say, precision)
    single, multi, resumed = runs
    if not traced_steps(multi.trace):
        raise PhalanxError(
            f"the {multi.name} run took no optimizer step through phalanx (no weights traced): verify compares "
            f"the steps session.step() or session.accumulate() take; see its log: {multi.launch.log}"
        )
    half = options.steps // 2
    resumed_steps = traced_steps(resumed.trace)
    if resumed_steps and resumed_steps[0] != half:
        raise PhalanxError(
            f"the resumed run did not start from the checkpoint of step {half} (its first weights are step "
            f"{resumed_steps[0]}'s), so the resume cannot be compared; see its log: {resumed.launch.log}"
        )
    steps = list(range(options.steps + 1))
    result = VerifyResult(
        nproc=options.nproc,
        steps=options.steps,
        tolerance=options.tolerance,
        scaling=compare_traces(multi.trace, single.trace, steps),
        resume=compare_traces(resumed.trace, multi.trace, [s for s in steps if s >= half]),
        resumed_at=half,
        directory=root if options.run_dir else None,
    )
    taken = len(traced_steps(multi.trace)) - 1
    if taken < options.steps:
        result.notes.append(
            f"the script ended after {taken} optimizer step(s), before --steps {options.steps}: only those are compared"
        )
    batches = (single.global_batches(), multi.global_batches())
    if batches[0] and batches[1] and batches[0] != batches[1]:
        result.notes.append(
            f"the runs trained on different global batches ({_sizes(batches[0])} at 1 process, {_sizes(batches[1])} "
            f"at {options.nproc}): set batch.global_batch_size so that both take the same"
        )
    moved = movement(single.trace)
    if result.holds and moved is not None and moved < MOVED_ENOUGH * options.tolerance:
        result.inconclusive = (
            f"the weights moved by at most {moved:.1e} (relative rms) over the run, too little for a difference "
            f"above the tolerance {options.tolerance:.0e} to show: raise --steps, or look at the learning rate "
            "(a warm-up from 0)"
        )
    if not result.scaling or not result.resume:
        result.inconclusive = "the runs traced no step in common, so nothing could be compared"
    if result.scaling_failure is not None and not options.fp64 and parted_from_rounding(result):
        result.notes.append(
            "the runs agree to rounding at first and part later: fp32 rounding that a deep network amplifies (a "
            "max-pool or ReLU that decides the other way) can do that; --fp64 compares in float64, whose rounding "
            "is 1e-16, to tell it from a real difference"
        )
    if result.scaling_failure is not None:
        lines = [*single.log_lines(), *multi.log_lines()]
        result.causes = likely_causes(result.scaling_failure, trace_facts(multi.trace), lines, options.script)
    if result.resume_failure is not None:
        result.causes += resume_causes(result.resume_failure, half, resumed.log_lines())
    return result


def movement(trace: Path) -> float | None:
    """How far the weights moved from the first traced step to the last: the most moved tensor's."""
    steps = traced_steps(trace)
    if len(steps) < 2:
        return None
    first, last = load_trace(trace, steps[0]), load_trace(trace, steps[-1])
    return compare_weights(steps[-1], last["weights"], first["weights"]).difference


def parted_from_rounding(result: VerifyResult) -> bool:
    """The first steps (the first one at least) agree to well under the tolerance, then they part."""
    first = result.scaling_failure
    before = [d for d in result.scaling if 0 < d.step < first.step]
    return bool(before) and before[0].difference < result.tolerance / 10


def _sizes(values: set[int]) -> str:
    return "/".join(str(v) for v in sorted(values))
