"""Run the phalanx CLI as a real subprocess with a timeout, leaving no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
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
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"phalanx {' '.join(args)} did not finish in {timeout}s\n{out}\n{err}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of a finished job, if any
        except ProcessLookupError:
            pass
        kill_tagged(tag)
    return Result(proc.returncode, out, err)
