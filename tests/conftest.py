"""Session-wide fixtures for every tier: no test may leave a process behind."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest


def _processes_with(token: bytes) -> set[int]:
    """Processes whose environment carries ``token``: everything this test session started,
    including orphans that were re-parented away from us."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                # multiprocessing's resource tracker belongs to this pytest process and ends with it.
                if (
                    token in (entry / "environ").read_bytes()
                    and b"resource_tracker" not in (entry / "cmdline").read_bytes()
                ):
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
