"""Short ``phalanx launch`` runs in a subprocess, for ``phalanx bench`` and ``phalanx tune``: the
options both take (:class:`TrialOptions`), and one launch run to its end or stopped after its steps.

Each run is a ``python -m phalanx launch`` subprocess rather than an in-process launch: its output
(progress, rank 0's prints, failure summaries) goes to its own ``launch.log`` instead of the
caller's table. A run of the user's script ends through phalanx itself: ``train.max_steps`` is set
to its steps, and the Session ends ``epochs()`` and the training loaders there, so the script
finishes the way it finishes training and none of its signal handlers run. Only a script that
trains past the limit (a loop phalanx does not see), or does not exit within a grace after it, is
stopped like Ctrl-C stops it. The launch stays in the caller's process group, so a Ctrl-C at the
terminal reaches both at once.
"""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from phalanx.config.schema import Config
from phalanx.errors import PhalanxError
from phalanx.harness.figures import steps_recorded
from phalanx.launch.launcher import LaunchRequest

_POLL_S = 0.25
_INTERRUPT_GRACE_S = 3  # a terminal Ctrl-C reached the launch too; give it this long to notice
_SHUTDOWN_S = 60  # torch elastic gives its workers 30 s after a signal before it kills them
# After its last step a script may still evaluate and save; past this, it is stopped from outside.
END_GRACE_S = 60.0


@dataclass(frozen=True)
class LaunchRun:
    returncode: int
    stopped: bool  # stopped from outside (SIGINT) after every rank had recorded `cap` steps (the fallback)
    steps: int  # optimizer steps every rank recorded
    seconds: float
    log: Path  # the launcher's own output
    run_dir: Path | None  # the directory the launcher made, None if it made none

    @property
    def complete(self) -> bool:
        """Ended by itself without error, or was stopped after its steps."""
        return self.returncode == 0 or self.stopped


@dataclass(frozen=True)
class TrialOptions:
    """What bench and tune both take: the script (or the demo), its config, and how many steps
    each launch runs and how many of them are warm-up."""

    script: str | None = None
    script_args: tuple[str, ...] = ()
    demo: bool = False
    config_file: str | None = None
    overrides: tuple[str, ...] = ()
    steps: int = 20
    warmup: int = 5
    cpu: bool = False
    run_dir: str | None = None

    def target(self, verb: str) -> tuple[str, tuple[str, ...], int | None]:
        """Script, its arguments, and the step count at which a launch ends (``train.max_steps``;
        None: the script stops itself); ``verb`` names the command in errors."""
        if self.demo and self.script:
            raise PhalanxError("give either a script or --demo, not both")
        if self.demo:
            from phalanx.demo import TRAIN_SCRIPT

            # The demo ends itself after --steps steps; a script of the user's is stopped from outside.
            return TRAIN_SCRIPT, ("--max-steps", str(self.steps)), None
        if not self.script:
            raise PhalanxError(f"give the training script to {verb}, or --demo for the built-in example")
        return self.script, tuple(self.script_args), self.steps

    def check_steps(self) -> None:
        if self.steps < 1 or self.warmup < 0 or self.warmup >= self.steps:
            raise PhalanxError(
                f"--steps must be at least 1 and above --warmup; got --steps {self.steps} --warmup {self.warmup}"
            )

    def request(
        self, script: str, script_args: Sequence[str], nproc: int | None, extra: Sequence[str] = ()
    ) -> LaunchRequest:
        """The launch of one trial, for ``prepare`` to check before any process starts."""
        return LaunchRequest(
            script=script,
            script_args=tuple(script_args),
            config_file=self.config_file,
            overrides=(*self.overrides, *extra),
            nproc=nproc,
            cpu=self.cpu,
            run_dir=self.run_dir,
        )

    def launch(
        self,
        script: str,
        script_args: Sequence[str],
        *,
        nproc: int,
        parent: Path,
        extra: Sequence[str] = (),
        cap: int | None,
        env: Mapping[str, str] | None = None,
    ) -> LaunchRun:
        """One trial launch under ``parent``, with the options' --set values, then ``extra``, then
        the step limit ``cap`` (which the Session ends training at)."""
        limit = (f"train.max_steps={cap}",) if cap is not None else ()
        command = launch_command(
            script,
            script_args,
            nproc=nproc,
            parent=parent,
            cpu=self.cpu,
            config_file=self.config_file,
            overrides=(*self.overrides, *extra, *limit),
        )
        return run_launch(command, parent, cap, env)

    def command_line(
        self, command: str, *, first: Sequence[str] = (), middle: Sequence[str] = (), last: Sequence[str] = ()
    ) -> str:
        """The command line that repeats this one: the command's own flags go ``first`` (before
        --steps), in the ``middle`` (after --warmup) or ``last`` (before --cpu)."""
        parts = ["phalanx", command, *first, "--steps", str(self.steps), "--warmup", str(self.warmup), *middle]
        for override in self.overrides:
            parts += ["--set", override]
        if self.config_file:
            parts += ["--config", self.config_file]
        if self.run_dir:
            parts += ["--run-dir", self.run_dir]
        parts += last
        if self.cpu:
            parts.append("--cpu")
        parts += ["--demo"] if self.demo else [self.script or "", *self.script_args]
        return shlex.join(parts)


def quiet_overrides(config: Config, parent: Path) -> tuple[str, ...]:
    """Per-step metrics on (the caller reads them); no progress bar (it syncs to read the loss) and
    no profiler; no checkpoints read from or written to the user's checkpoint directory. Each only
    where the config has the key."""
    keys = config.flat()
    out = ["train.progress=false"]
    if "train.metrics" in keys:
        out.append("train.metrics=true")
    if "train.profile" in keys:
        out.append("train.profile=null")
    if "checkpoint.resume" in keys:
        out.append("checkpoint.resume=never")
    if "checkpoint.dir" in keys:
        out.append(f"checkpoint.dir={parent / 'checkpoints'}")
    if "checkpoint.save_every" in keys:
        out.append("checkpoint.save_every=null")
    return tuple(out)


def launch_command(
    script: str,
    script_args: Sequence[str],
    *,
    nproc: int,
    parent: Path,
    cpu: bool = False,
    config_file: str | None = None,
    overrides: Sequence[str] = (),
) -> list[str]:
    # The command that runs the trials checked the script already, or wants its runs whatever it finds.
    command = [sys.executable, "-m", "phalanx", "launch", "--nproc", str(nproc), "--run-dir", str(parent), "--no-check"]
    if cpu:
        command.append("--cpu")
    if config_file:
        command += ["--config", config_file]
    for override in overrides:
        command += ["--set", override]
    return [*command, script, *script_args]


def run_launch(
    command: list[str],
    parent: Path,
    cap: int | None,
    env: Mapping[str, str] | None = None,
    grace: float = END_GRACE_S,
) -> LaunchRun:
    """Run ``command`` (a :func:`launch_command` whose run dir is ``parent``) to its end. With
    ``cap`` (its ``train.max_steps``), a run that records more steps than that, or is still running
    ``grace`` seconds after every rank recorded them, is stopped with SIGINT: the fallback for a
    script whose loop the Session cannot end."""
    parent.mkdir(parents=True, exist_ok=True)
    log = parent / "launch.log"
    started = time.perf_counter()
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(env) if env is not None else None,
        )
        stopped = False
        reached_at = None  # when every rank had recorded `cap` steps
        try:
            while proc.poll() is None:
                if cap is not None and not stopped:
                    steps = steps_so_far(parent)
                    if steps >= cap and reached_at is None:
                        reached_at = time.perf_counter()
                    if steps > cap or (reached_at is not None and time.perf_counter() - reached_at > grace):
                        proc.send_signal(signal.SIGINT)  # what Ctrl-C does: the launcher stops its workers
                        stopped = True
                try:
                    proc.wait(timeout=_POLL_S)
                except subprocess.TimeoutExpired:
                    pass
        except KeyboardInterrupt:
            interrupt(proc)
            raise
    seconds = time.perf_counter() - started
    runs = run_dirs(parent)
    steps = steps_so_far(parent)
    return LaunchRun(
        proc.returncode, stopped and cap is not None and steps >= cap, steps, seconds, log, runs[0] if runs else None
    )


def run_dirs(parent: Path) -> list[Path]:
    # The launcher names the run directory itself (<stamp>-<script>); it writes config.yaml first.
    return sorted(d for d in parent.iterdir() if (d / "config.yaml").is_file())


def steps_so_far(parent: Path) -> int:
    runs = run_dirs(parent)
    return steps_recorded(runs[0] / "metrics") if runs else 0


def failure_reason(log: Path) -> str:
    """The launcher's own one-line summary of a failure when it wrote one; else the log's last
    line, which is where a traceback ends ("" for an empty log)."""
    every = log.read_text(encoding="utf-8", errors="replace").splitlines()
    lines = [line for line in every if line.startswith("phalanx: ")]
    for line in reversed(lines):
        if line.startswith("phalanx: error: "):
            return line.removeprefix("phalanx: error: ")
        if " failed first " in line or line.startswith("phalanx: stopped by signal"):
            return line.removeprefix("phalanx: ")
    return next((line.strip() for line in reversed(every) if line.strip()), "")


def stop_note(run: LaunchRun, name: str, cap: int | None) -> str | None:
    """The line to print when ``run`` had to be stopped with a signal (None when it ended by itself):
    its script did not end at ``train.max_steps``, and any error it then raised is shown too."""
    if not run.stopped:
        return None
    text = (
        f"phalanx: warning: {name} went on after train.max_steps={cap} (a loop phalanx cannot end, see "
        "docs/bench.md#what-it-runs) and was stopped like Ctrl-C"
    )
    if run.returncode != 0:
        # The launcher's own summary only says it was stopped; what the script raised is in the log.
        reason = last_error(run.log) or failure_reason(run.log)
        text += f"; it then exited with code {run.returncode}{': ' + reason if reason else ''} (log: {run.log})"
    return text


_ERROR_LINE = re.compile(r"^(?:\[rank \d+\] )?[A-Za-z_][\w.]*(?:Error|Exception)\b(?::.*)?$")


def last_error(log: Path) -> str:
    """The last exception line of a traceback in ``log`` ("" when there is none)."""
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    return next((line.strip() for line in reversed(lines) if _ERROR_LINE.match(line.strip())), "")


def interrupt(proc: subprocess.Popen) -> None:
    try:
        proc.wait(timeout=_INTERRUPT_GRACE_S)
        return
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the interrupt came to the caller alone
    try:
        proc.wait(timeout=_SHUTDOWN_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
