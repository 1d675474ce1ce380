"""Run the phalanx CLI as a real subprocess with a timeout, leaving no process behind; or, for what
ends before any process starts (a refusal, a report), call it in this process with the same view
of its exit code and output."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.processes import kill_tagged, new_tag

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def finish(proc: subprocess.Popen, tag: dict, timeout: float) -> tuple[str, str]:
    """The output of ``proc`` (started in a session of its own, its environment carrying ``tag``),
    after it ends or, at ``timeout``, is killed with its group (a failed test); then every process
    of the job, wherever it went, is killed too."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(map(str, proc.args))} did not finish in {timeout}s\n{out}\n{err}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of a finished job, if any
        except ProcessLookupError:
            pass
        kill_tagged(tag)


def run_phalanx(*args: str, cwd: Path, timeout: float = 180, env: dict | None = None) -> Result:
    """``phalanx ARGS`` in its own process group; on timeout the whole group is killed, and every
    process the job started (workers live in sessions of their own) whatever happened."""
    tag = new_tag()
    proc = subprocess.Popen(
        [sys.executable, "-m", "phalanx", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {}), **tag},
    )
    out, err = finish(proc, tag, timeout)
    return Result(proc.returncode, out, err)


def call_phalanx(*args: str, cwd: Path, env: dict | None = None) -> Result:
    """``phalanx ARGS`` as :func:`run_phalanx` sees it, called in this process: ``cli.main.main``
    with the working directory, environment, stdout and stderr of its own, restored after. An
    exception that escapes is printed as the interpreter would print it, exit code 1, so a test's
    "no traceback" still means something. For commands that end before they start a process: one
    that does start a job still works, it is only as slow as a subprocess."""
    from phalanx.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    os.environ.update(env or {})
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exit:  # argparse, and --help
                if isinstance(exit.code, str):
                    print(exit.code, file=sys.stderr)
                code = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
            except Exception:
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return Result(code, out.getvalue(), err.getvalue())
