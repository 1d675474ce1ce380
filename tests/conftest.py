"""Shared helpers: run the CLI as a real subprocess with a timeout and leave no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
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
    """``phalanx ARGS`` in its own process group; on timeout the whole group is killed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "phalanx", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {})},
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
    return Result(proc.returncode, out, err)


def _processes_with(token: bytes) -> set[int]:
    """Processes whose environment carries ``token``: everything this test session started,
    including orphans that were re-parented away from us."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                # multiprocessing's resource tracker belongs to this pytest process and ends with it.
                if token in (entry / "environ").read_bytes() and b"resource_tracker" not in (entry / "cmdline").read_bytes():
                    pids.add(int(entry.name))
            except OSError:
                continue
    return pids


@pytest.fixture(scope="session", autouse=True)
def no_leftover_processes():
    token = f"phalanx-test-{uuid.uuid4().hex}"
    os.environ["PHALANX_TEST_SESSION"] = token
    yield
    deadline = time.monotonic() + 10
    left = _processes_with(token.encode())
    while left and time.monotonic() < deadline:  # give exiting processes a moment
        time.sleep(0.2)
        left = _processes_with(token.encode())
    assert not left, f"processes left behind: {sorted(left)}"
