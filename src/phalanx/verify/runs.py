"""The three short launches ``phalanx verify`` compares, on CPU processes:

1. one process, the whole global batch in one forward: the run a one-GPU script is;
2. N processes with the script's own batch settings, saving a checkpoint at step K/2;
3. N processes resumed from that checkpoint, to step K.

Each runs through ``phalanx launch`` in a subprocess (harness/launching.py) with
``train.max_steps=K`` and ``train.weights_trace`` set, in fp32, with its own checkpoint directory,
so nothing of the user's checkpoints is read or written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from phalanx.checkpoint.files import MANIFEST, step_name
from phalanx.errors import PhalanxError
from phalanx.harness.figures import read_metrics
from phalanx.harness.launching import LaunchRun, TrialOptions, failure_reason, quiet_overrides
from phalanx.launch.launcher import LaunchPlan, prepare


class ReplicasDiffer(PhalanxError):
    """The N-process ranks' own weights parted: they do not train like one process (exit 1)."""

    exit_code = 1


@dataclass(frozen=True)
class VerifyRun:
    name: str  # "1 process", "2 processes", "resumed"
    directory: Path  # its launch directory: launch.log, the run dir, checkpoints, trace
    launch: LaunchRun

    @property
    def trace(self) -> Path:
        return self.directory / "trace"

    @property
    def checkpoints(self) -> Path:
        return self.directory / "checkpoints"

    def global_batches(self) -> set[int]:
        """The global batch of every step rank 0 recorded (its metrics)."""
        if self.launch.run_dir is None or not (self.launch.run_dir / "metrics").is_dir():
            return set()
        records = read_metrics(self.launch.run_dir / "metrics").get(0, [])
        return {int(r["samples"]) for r in records if r.get("samples")}

    def log_lines(self) -> list[str]:
        return self.launch.log.read_text(encoding="utf-8", errors="replace").splitlines()


def checked_plan(options: TrialOptions, script: str, args: tuple[str, ...], nproc: int) -> LaunchPlan:
    """The launch's own checks (config, flags, script), before any process starts."""
    return prepare(options.request(script, args, nproc))


def run_overrides(plan: LaunchPlan, directory: Path, *, whole_batch: bool, precision: str) -> tuple[str, ...]:
    """``whole_batch``: the 1-process reference takes the global batch in one forward (no
    accumulation), as a one-GPU script does; the N-process runs keep the script's settings."""
    out = [
        *quiet_overrides(plan.config, directory),
        f"precision.mode={precision}",
        f"train.weights_trace={directory / 'trace'}",
        "checkpoint.keep_last=null",
    ]
    if whole_batch:
        out += ["batch.micro_batch_size=null", "batch.max_micro_batch_size=null"]
    else:
        # The trace holds rank 0's weights: a rank that drifts from it must stop the run, at once.
        out.append("faults.replica_check_every=1")
    return tuple(out)


def launch_all(
    options: TrialOptions,
    script: str,
    args: tuple[str, ...],
    nproc: int,
    steps: int,
    root: Path,
    say: Callable[[str], None],
    precision: str = "fp32",
) -> list[VerifyRun]:
    """The three runs, in order; a run that fails stops verify with its reason."""
    half = steps // 2
    plans = {n: checked_plan(options, script, args, n) for n in (1, nproc)}
    plural = f"{nproc} processes"
    specs = [
        ("1 process", 1, run_overrides(plans[1], root / "n1", whole_batch=True, precision=precision), root / "n1"),
        (
            plural,
            nproc,
            (
                *run_overrides(plans[nproc], root / f"n{nproc}", whole_batch=False, precision=precision),
                f"checkpoint.save_every={half}",
            ),
            root / f"n{nproc}",
        ),
    ]
    runs: list[VerifyRun] = []
    for name, n, overrides, directory in specs:
        say(f"phalanx: verify: {steps} steps at {name} ...")
        runs.append(_run(options, script, args, n, overrides, directory, steps, name))
    saved = _checkpoint_at(runs[1].checkpoints, half)
    if saved is None:
        raise PhalanxError(
            f"the {plural} run wrote no checkpoint at step {half} (checkpoint.save_every={half}) in "
            f"{runs[1].checkpoints}, so the resume cannot be checked; see its log: {runs[1].launch.log}"
        )
    directory = root / "resumed"
    overrides = (
        *run_overrides(plans[nproc], directory, whole_batch=False, precision=precision),
        f"checkpoint.resume={saved}",
    )
    say(f"phalanx: verify: resuming the {plural} run at step {half} ...")
    runs.append(_run(options, script, args, nproc, overrides, directory, steps, "resumed"))
    return runs


def _run(
    options: TrialOptions,
    script: str,
    args: tuple[str, ...],
    nproc: int,
    overrides: tuple[str, ...],
    directory: Path,
    steps: int,
    name: str,
) -> VerifyRun:
    launch = options.launch(script, args, nproc=nproc, parent=directory, extra=overrides, cap=steps)
    reason = failure_reason(launch.log) if not launch.complete else ""
    if "replicas drifted apart" in reason:
        raise ReplicasDiffer(f"the {name} run stopped, its ranks' own weights apart: {reason}")
    if not launch.complete:
        raise PhalanxError(
            f"the {name} run failed (exit code {launch.returncode}): {failure_reason(launch.log)}; log: {launch.log}"
        )
    return VerifyRun(name, directory, launch)


def _checkpoint_at(directory: Path, step: int) -> Path | None:
    path = directory / step_name(step)
    return path if (path / MANIFEST).is_file() else None
