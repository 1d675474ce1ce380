"""phalanx.spawn forks its processes from a forkserver that has imported torch once: each process
still sees the caller's environment, working directory, stdout and stderr as they are at the call,
and a killed caller still takes every process along."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import phalanx
from tests.helpers.processes import kill_tagged, new_tag, wait_gone

pytestmark = pytest.mark.multiprocess
REPO = Path(__file__).resolve().parents[2]


def where_am_i() -> tuple[str | None, str, int]:
    return os.environ.get("PHALANX_SPAWN_PROBE"), os.getcwd(), int(os.environ["RANK"])


@pytest.mark.parametrize("method", [None, "spawn"])
@pytest.mark.timeout(120)
def test_each_process_sees_the_caller_s_environment_and_directory_at_the_call(tmp_path, monkeypatch, method):
    phalanx.spawn(where_am_i, nprocs=2, cpu=True, timeout=60, start_method=method)  # a server started earlier
    monkeypatch.setenv("PHALANX_SPAWN_PROBE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    ranks = phalanx.spawn(where_am_i, nprocs=2, cpu=True, timeout=60, start_method=method)
    assert ranks == [
        ("set after the server started", str(tmp_path), 0),
        ("set after the server started", str(tmp_path), 1),
    ]


def say_hello() -> None:
    # One write per line: under PYTHONUNBUFFERED (as CI may set) print() writes the text and its
    # newline separately, and two ranks' halves then interleave on the shared descriptor.
    rank = os.environ["RANK"]
    for stream, word in ((sys.stdout, "hello"), (sys.stderr, "warning")):
        stream.write(f"{word} from rank {rank}\n")
        stream.flush()


@pytest.mark.timeout(120)
def test_what_the_ranks_print_goes_where_the_caller_s_output_goes_now(capfd):
    # The server was started before this test's capture began (by the test above), with other
    # descriptors: the ranks still write to the caller's.
    phalanx.spawn(say_hello, nprocs=2, cpu=True, timeout=60)
    printed = capfd.readouterr()
    assert sorted(printed.out.splitlines()) == ["hello from rank 0", "hello from rank 1"]
    assert sorted(line for line in printed.err.splitlines() if "from rank" in line) == [
        "warning from rank 0",
        "warning from rank 1",
    ]


CALLER = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, sys.argv[1])
    import phalanx
    from tests.integration.test_spawn_start import sleep_forever

    if __name__ == "__main__":
        phalanx.spawn(sleep_forever, nprocs=2, args=(sys.argv[2],), cpu=True, timeout=None)
    """
)


def sleep_forever(out: str) -> None:
    Path(out, f"ready{os.environ['RANK']}").write_text(str(os.getpid()))
    time.sleep(3600)


@pytest.mark.timeout(120)
@pytest.mark.serial  # a time limit
def test_a_killed_caller_takes_every_forked_process_along(tmp_path):
    script = tmp_path / "caller.py"
    script.write_text(CALLER)
    tag = new_tag()
    caller = subprocess.Popen(
        [sys.executable, str(script), str(REPO), str(tmp_path)], env={**os.environ, **tag}, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f"ready{rank}").exists() for rank in (0, 1)):
            assert caller.poll() is None and time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.1)
        caller.send_signal(signal.SIGKILL)
        caller.wait()
        took, alive = wait_gone(tag, within=15)
        assert not alive, f"still alive {took:.1f} s after the caller was killed: {alive}"
    finally:
        caller.kill()
        caller.wait()
        kill_tagged(tag)
