"""benchmarks/peers/turns.py: contenders launched at once run one at a time, in rotated rounds."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from tests.helpers.cli import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

from peers import turns  # noqa: E402


def _ranks(directory, name, nproc, blocks, log, lock, fail_at=None):
    """``nproc`` threads acting as one contender's ranks: ``blocks`` turns each, logged."""

    def rank(r):
        mine = turns.Turns(directory, name, r)
        for block in range(blocks):
            mine.wait()
            if fail_at == block:
                return  # the launch died in the middle: never says done
            with lock:
                log.append(("start", name, r, block))
            time.sleep(0.01)
            with lock:
                log.append(("end", name, r, block))
        mine.done()

    return [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(nproc)]


def _conduct(directory, contenders, order=None, fail=None, turn_timeout=10.0):
    log, lock = [], threading.Lock()
    threads = {
        name: _ranks(directory, name, nproc, blocks, log, lock, fail_at=(fail or {}).get(name))
        for name, (nproc, blocks) in contenders.items()
    }
    for group in threads.values():
        for t in group:
            t.start()
    conductor = turns.Conductor(directory, {name: nproc for name, (nproc, _) in contenders.items()})
    names = list(contenders)
    conductor.run(
        order or (lambda r: turns.rotation(names, r)),
        lambda name: any(t.is_alive() for t in threads[name]),
        turn_timeout=turn_timeout,
    )
    for group in threads.values():
        for t in group:
            t.join(timeout=5)
    conductor.close()
    return log


def test_one_contender_runs_at_a_time_with_all_its_ranks(tmp_path):
    log = _conduct(tmp_path, {"raw": (2, 3), "phalanx": (2, 3), "peer": (1, 3)})
    running: dict[str, int] = {}
    for event, name, _, _ in log:
        if event == "start":
            assert not [n for n, count in running.items() if count and n != name], log
            running[name] = running.get(name, 0) + 1
        else:
            running[name] -= 1
    # Every rank of every contender had every turn.
    starts = {(name, r, block) for event, name, r, block in log if event == "start"}
    assert len(starts) == 2 * 3 + 2 * 3 + 3


def test_rounds_follow_the_rotation(tmp_path):
    names = ["a", "b", "c"]
    log = _conduct(tmp_path, {n: (1, 4) for n in names})
    order = [name for event, name, _, _ in log if event == "start"]
    expected = [n for r in range(4) for n in turns.rotation(names, r)]
    assert order == expected
    assert turns.rotation(names, 1) == ["a", "c", "b"]  # rotated by one, then reversed


def test_a_contender_that_dies_is_dropped_and_the_rest_go_on(tmp_path):
    log = _conduct(tmp_path, {"a": (1, 4), "b": (2, 4)}, fail={"a": 1})
    assert {block for event, name, _, block in log if event == "end" and name == "b"} == {0, 1, 2, 3}
    assert {block for event, name, _, block in log if name == "a"} == {0}


def test_a_stuck_contender_is_dropped(tmp_path):
    conductor = turns.Conductor(tmp_path, {"stuck": 1})
    stuck = []
    started = time.monotonic()
    conductor.run(lambda r: ["stuck"], lambda name: True, turn_timeout=0.2, on_stuck=stuck.append)
    assert stuck == ["stuck"] and time.monotonic() - started < 5


@pytest.mark.parametrize(
    "asked, number",
    [(["1", "1"], 1), (["2", "1"], None), (["3", None], None), ([turns.DONE, "2"], None), (["7"], 7)],
)
def test_a_turn_is_granted_only_when_every_rank_asks_for_it(asked, number):
    assert turns.agreed_turn(asked) == number


def _worker(directory, script: str) -> subprocess.Popen:
    code = f"from peers import turns\nt = turns.Turns({str(directory)!r}, 'w', 0)\n{script}"
    env = {**os.environ, "PYTHONPATH": str(REPO / "benchmarks")}
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)


def test_a_waiting_rank_blocks_without_taking_cpu(tmp_path):
    """Waiting ranks share the cores with the one whose turn it is: they must not poll."""
    conductor = turns.Conductor(tmp_path, {"w": 1})
    script = "import time\nbefore = time.process_time()\nt.wait()\nprint(time.process_time() - before)\nt.done()"
    proc = _worker(tmp_path, script)
    try:
        deadline = time.monotonic() + 30
        while conductor.asks("w") != ["1"] and time.monotonic() < deadline:
            conductor.receive(0.1)
        time.sleep(1.0)  # the worker waits a second for its turn
        assert conductor.grant("w", 1)
        out, _ = proc.communicate(timeout=30)
        # Polling the grant every 5 ms took about 35 ms of CPU a second; a blocked read takes none.
        assert float(out) < 0.002, f"{out} s of CPU while waiting 1 s"
    finally:
        proc.kill()
        conductor.close()


def test_a_rank_that_dies_after_asking_is_dropped_at_its_grant(tmp_path):
    conductor = turns.Conductor(tmp_path, {"w": 1})
    # It asks for turn 1 from a thread, then the process ends without waiting for it.
    script = "import os, threading, time\nthreading.Thread(target=t.wait, daemon=True).start()\n"
    script += "time.sleep(0.5)\nos._exit(0)"
    proc = _worker(tmp_path, script)
    try:
        assert proc.wait(timeout=30) == 0
        started = time.monotonic()
        conductor.run(lambda r: ["w"], lambda name: True, turn_timeout=10)  # alive says yes: the pipe says no
        assert time.monotonic() - started < 5 and conductor.granted["w"] == 0
    finally:
        conductor.close()


def test_a_waiting_rank_ends_when_the_conductor_is_gone(tmp_path):
    conductor = turns.Conductor(tmp_path, {"w": 1})
    proc = _worker(tmp_path, "t.wait()")
    try:
        deadline = time.monotonic() + 30
        while conductor.asks("w") != ["1"] and time.monotonic() < deadline:
            conductor.receive(0.1)
        conductor.close()  # as a driver killed with SIGKILL would leave it
        assert proc.wait(timeout=10) == 1
    finally:
        proc.kill()
