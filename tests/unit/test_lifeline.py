"""faults/lifeline.py without torch: a process watching its parent kills its own children and
itself once the parent is gone, however the parent died."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from phalanx.faults.lifeline import ENV_LAUNCHER_PID, descendants, watch_launcher

pytestmark = pytest.mark.serial  # the processes must be gone within seconds

# middle -> worker (watches middle) -> grandchild (a plain sleep, like a data-loader process)
MIDDLE = textwrap.dedent(
    """
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
    time.sleep(120)
    """
)
WORKER = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    from phalanx.faults.lifeline import Lifeline
    Lifeline(os.getppid(), who="test worker").start()
    child = subprocess.Popen(["sleep", "120"])
    with open(sys.argv[1] + ".tmp", "w") as fh:
        json.dump({"worker": os.getpid(), "grandchild": child.pid}, fh)
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    while True:
        sum(i * i for i in range(10_000))  # busy in Python: the watch still gets its turn
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(60)
def test_a_worker_ends_with_its_children_when_its_parent_is_killed(tmp_path):
    pids_file = tmp_path / "pids.json"
    middle = subprocess.Popen([sys.executable, "-c", MIDDLE, WORKER, str(pids_file)])
    pids = {}
    try:
        deadline = time.monotonic() + 30
        while not pids_file.exists():
            assert time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.05)
        pids = json.loads(pids_file.read_text())
        assert set(pids.values()) <= set(descendants(middle.pid))
        middle.send_signal(signal.SIGKILL)
        middle.wait()
        started = time.monotonic()
        while any(_alive(p) for p in pids.values()) and time.monotonic() - started < 2:
            time.sleep(0.02)
        assert not [name for name, p in pids.items() if _alive(p)], "outlived the parent by 2 s"
    finally:
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_descendants_lists_children_before_grandchildren():
    outer = subprocess.Popen([sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '30']); "
                              "time.sleep(30)"])  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while len(descendants(outer.pid)) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        found = descendants(os.getpid())
        assert found.index(outer.pid) < min(found.index(p) for p in descendants(outer.pid))
    finally:
        for pid in descendants(outer.pid):
            os.kill(pid, signal.SIGKILL)
        outer.kill()
        outer.wait()


def test_nothing_is_watched_outside_a_launch():
    assert watch_launcher("test", env={}) is None
    assert watch_launcher("test", env={ENV_LAUNCHER_PID: "not a pid"}) is None


def test_a_process_the_script_starts_does_not_watch_the_launcher_itself():
    # Its parent is a worker, not the launcher (alive: this test process stands in for it).
    assert watch_launcher("test", env={ENV_LAUNCHER_PID: str(os.getpid())}) is None
