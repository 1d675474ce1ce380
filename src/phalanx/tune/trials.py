"""One ``phalanx tune`` trial: a short ``phalanx launch`` with a few settings changed, and how it
ended: ran its steps (with figures), ran out of memory (on which ranks), or failed otherwise."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from phalanx.errors import PhalanxError
from phalanx.harness.figures import RunFigures, measure
from phalanx.harness.launching import LaunchRun, failure_reason
from phalanx.session.facts import read_run_facts
from phalanx.util.units import MIB

OK, OOM, FAILED = "ok", "out of memory", "failed"

# What torch (and the phalanx memory cap) print when an allocation fails. In a rank's log, the
# exception must be the traceback's last line (torch.cuda.OutOfMemoryError is the same class), not
# a source line quoted in a traceback; the launcher's one-line summary is "Type: message".
_MESSAGES = r"CUDA out of memory|CUDA error: out of memory|CUBLAS_STATUS_ALLOC_FAILED"
_OOM_IN_LOG = re.compile(rf"^(?:\[rank \d+\] )?(?:torch\.)?(?:cuda\.)?OutOfMemoryError\b|{_MESSAGES}", re.MULTILINE)
_OOM_IN_SUMMARY = re.compile(rf"\bOutOfMemoryError\b|{_MESSAGES}")


@dataclass(frozen=True)
class Settings:
    """What a trial sets. ``workers`` None: the script's own loader workers; ``bucket_mb`` None:
    not set (a strategy without DDP buckets)."""

    micro: int
    global_batch: int
    workers: int | str | None = None
    bucket_mb: float | None = None

    def overrides(self) -> tuple[str, ...]:
        # Exact sizes: a limit of the user's (batch.max_micro_batch_size) would refuse larger ones.
        out = [
            f"batch.micro_batch_size={self.micro}",
            f"batch.global_batch_size={self.global_batch}",
            "batch.max_micro_batch_size=null",
        ]
        if self.workers is not None:
            out.append(f"data.num_workers={self.workers}")
        if self.bucket_mb is not None:
            out.append(f"strategy.ddp.bucket_cap_mb={self.bucket_mb:g}")
        return tuple(out)


@dataclass
class Trial:
    number: int
    stage: str  # start | micro-batch | workers | bucket
    settings: Settings
    label: str  # what this trial varies, for the table
    outcome: str = FAILED
    detail: str = ""  # ranks out of memory, or why it failed
    figures: RunFigures | None = None
    seconds: float = 0.0
    log: Path | None = None
    run_dir: Path | None = None
    chosen: bool = False

    @property
    def samples_per_s(self) -> float | None:
        return self.figures.samples_per_s if self.outcome == OK and self.figures else None

    @property
    def data_wait_share(self) -> float | None:
        f = self.figures
        return f.data_wait / f.step_time if self.outcome == OK and f and f.step_time > 0 else None

    def describe_outcome(self) -> str:
        if self.outcome == OK:
            return OK
        return f"{self.outcome} ({self.detail})" if self.detail else self.outcome

    def as_json(self) -> dict:
        return {
            "number": self.number,
            "stage": self.stage,
            "setting": self.label,
            "micro_batch_size": self.settings.micro,
            "global_batch_size": self.settings.global_batch,
            "num_workers": self.settings.workers,
            "bucket_cap_mb": self.settings.bucket_mb,
            "outcome": self.outcome,
            "detail": self.detail,
            "samples_per_s": self.samples_per_s,
            "data_wait_share": self.data_wait_share,
            "peak_mem_bytes": self.figures.peak_mem_bytes if self.figures else None,
            "noise_scale": self.figures.noise_scale if self.figures else None,
            "seconds": round(self.seconds, 2),
            "chosen": self.chosen,
            "run_dir": str(self.run_dir) if self.run_dir else None,
            "log": str(self.log) if self.log else None,
        }


def conclude(
    trial: Trial, run: LaunchRun, *, nproc: int, warmup: int, steps: int, min_steps: int | None = None
) -> Trial:
    """Fill in how ``run`` ended. Out of memory on any rank is the trial's outcome even when the
    launcher blamed another rank first (a peer's closed connection, say). ``min_steps``: a run that
    ended after fewer than ``steps`` but at least these counts, measured over the steps it has (the
    noise-scale trial, longer than a short script may be)."""
    trial.seconds, trial.log, trial.run_dir = run.seconds, run.log, run.run_dir
    oom_ranks = out_of_memory_ranks(run.run_dir) if run.run_dir else []
    reason = failure_reason(run.log)
    if oom_ranks or (not run.complete and _OOM_IN_SUMMARY.search(reason)):
        trial.outcome = OOM
        trial.detail = (
            f"{'rank' if len(oom_ranks) == 1 else 'ranks'} {', '.join(map(str, oom_ranks))}" if oom_ranks else ""
        )
        return trial
    if not run.complete:
        trial.outcome, trial.detail = FAILED, _short(reason) or f"exit code {run.returncode}"
        return trial
    if run.steps == 0:
        trial.outcome, trial.detail = (
            FAILED,
            "no optimizer step recorded: tune reads the per-step metrics of phalanx.Session",
        )
        return trial
    if min_steps is not None and min_steps <= run.steps < steps:
        steps = run.steps
    if run.steps < steps:
        trial.outcome, trial.detail = (
            FAILED,
            f"the script ended after {run.steps} of the {steps} steps a trial needs: "
            "raise train.epochs or lower --steps",
        )
        return trial
    try:
        trial.figures = measure(run.run_dir, nproc, warmup, f"trial {trial.number}", steps)
    except (PhalanxError, OSError) as err:
        trial.outcome, trial.detail = FAILED, _short(str(err))
        return trial
    trial.outcome = OK
    return trial


def out_of_memory_ranks(run_dir: Path) -> list[int]:
    """Ranks whose log shows an out-of-memory error."""
    ranks = set()
    for log in (run_dir / "logs").glob("rank*.log"):
        digits = re.match(r"rank(\d+)", log.name)
        if digits and _OOM_IN_LOG.search(log.read_text(encoding="utf-8", errors="replace")):
            ranks.add(int(digits.group(1)))
    return sorted(ranks)


@dataclass(frozen=True)
class Announced:
    """What the Session's rank 0 wrote at setup, before any step (session/facts.py): known even
    when the first step runs out of memory."""

    global_batch: int
    micro: int
    processes: int  # data-parallel
    gradient_mib: float | None  # trainable parameters' gradients on rank 0
    fixed_layout: bool = False  # the script fixed its batch layout: tune changes neither size


def announced(run_dir: Path | None) -> Announced | None:
    """The batch plan and gradient size the run's Session wrote; None when it wrote no batch plan."""
    facts = read_run_facts(run_dir) if run_dir else None
    if facts is None or facts.batch is None:
        return None
    plan = facts.batch
    gradients = facts.gradient_bytes / MIB if facts.models else None
    return Announced(
        plan.global_batch_size, plan.micro_batch_size, plan.data_parallel_size, gradients, facts.fixed_layout
    )


def code_settings(run_dir: Path | None) -> set[str]:
    """Settings the script gave in code (``phalanx.Session(batch=...)``), as the run's Session
    wrote them. Code beats the config file, so tune cannot change these through the file."""
    facts = read_run_facts(run_dir) if run_dir else None
    return set(facts.code_settings) if facts else set()


def _short(text: str, most: int = 120) -> str:
    """A reason fit for a table cell; the whole of it is in the trial's launch.log."""
    text = " ".join(text.split())
    return text if len(text) <= most else text[: most - 3] + "..."
