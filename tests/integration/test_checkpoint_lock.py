"""One job per checkpoint directory: a second job pointed at a directory another job holds stops
before any worker starts, with one line naming the holder; restarts within a job keep the lock;
a Session started without the launcher takes it on rank 0."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from phalanx.checkpoint.lock import LOCK_FILE, read_owner
from tests.helpers.cli import run_phalanx
from tests.helpers.processes import kill_tagged, new_tag

pytestmark = pytest.mark.multiprocess

# Attempt 0 saves at step 2 and (with FAIL_FIRST) rank 1 then fails; the attempt that runs on
# says it is ready and trains until the test creates the stop file.
HOLDER = textwrap.dedent(
    """
    import os, time
    from pathlib import Path
    import torch
    import phalanx

    out = Path(os.environ["OUT"])
    session = phalanx.Session(
        batch={"global_batch_size": 4},
        train={"progress": False, "metrics": False},
        checkpoint={"resume": "never"},  # the directory comes from the launch: the launcher holds it
    )
    model = torch.nn.Linear(4, 4)
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(10_000):
        with session.accumulate(model):
            session.backward(model(torch.ones(2, 4)).sum())
        if step == 1:
            session.save()
            if os.environ.get("FAIL_FIRST") and session.topology.restart_count == 0 and session.rank == 1:
                raise RuntimeError("injected failure")
            (out / f"ready{session.topology.restart_count}").write_text("")
        if (out / "stop").exists():
            break
        time.sleep(0.05)
    session.close()
    """
)
INTRUDER = 'open(__import__("os").environ["OUT"] + "/intruder-ran", "w").close()\n'


def _start_holder(tmp_path: Path, *flags: str, env: dict[str, str] | None = None):
    (tmp_path / "holder.py").write_text(HOLDER)
    tag = new_tag()
    command = [sys.executable, "-m", "phalanx", "launch", "--cpu", "--nproc", "2", *flags]
    proc = subprocess.Popen(
        [*command, "--set", f"checkpoint.dir={tmp_path / 'ckpt'}", "holder.py"],
        cwd=tmp_path,
        env={**os.environ, **tag, "OUT": str(tmp_path), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    return proc, tag


def _wait_for(path: Path, proc: subprocess.Popen, within: float = 120) -> None:
    deadline = time.monotonic() + within
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"the holding job ended early:\n{proc.stdout.read()}")
        assert time.monotonic() < deadline, f"{path.name} did not appear within {within:g} s"
        time.sleep(0.1)


def _intrude(tmp_path: Path) -> str:
    """A second job on the same directory: refused in one line naming the holder, nothing started."""
    (tmp_path / "intruder.py").write_text(INTRUDER)
    result = run_phalanx(
        "launch", "--cpu", "--nproc", "2", "--run-dir", str(tmp_path / "intruder-runs"),
        "--set", f"checkpoint.dir={tmp_path / 'ckpt'}", "intruder.py",
        cwd=tmp_path, timeout=60, env={"OUT": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("phalanx: error: checkpoint directory"), result.stderr
    assert "in use by another job" in lines[0] and "--set checkpoint.dir=" in lines[0]
    assert "Traceback" not in result.output
    assert not (tmp_path / "intruder-ran").exists()
    assert not (tmp_path / "intruder-runs").exists()  # refused before its run directory was made
    return lines[0]


@pytest.mark.timeout(240)
def test_a_second_job_on_a_held_directory_is_refused_naming_the_holder(tmp_path):
    # save_every: the job will write checkpoints, so its launcher takes the directory at once.
    proc, tag = _start_holder(tmp_path, "--set", "checkpoint.save_every=1000")
    try:
        _wait_for(tmp_path / "ready0", proc)
        line = _intrude(tmp_path)
        assert f"pid {proc.pid} " in line and "phalanx launch holder.py" in line
        (tmp_path / "stop").write_text("")
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
    finally:
        kill_tagged(tag)
    # Released with the job: the same directory takes a new job at once.
    (tmp_path / "intruder.py").write_text("print('second job ran')\n")
    result = run_phalanx(
        "launch", "--cpu", "--nproc", "1", "--set", f"checkpoint.dir={tmp_path / 'ckpt'}", "intruder.py",
        cwd=tmp_path, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0 and "second job ran" in result.stdout, result.output


@pytest.mark.timeout(240)
def test_restarts_keep_the_lock(tmp_path):
    proc, tag = _start_holder(tmp_path, "--max-restarts", "1", env={"FAIL_FIRST": "1"})
    try:
        _wait_for(tmp_path / "ready1", proc)  # the restarted attempt is training
        assert read_owner(tmp_path / "ckpt" / LOCK_FILE)["pid"] == proc.pid  # still the launcher's
        line = _intrude(tmp_path)
        assert f"pid {proc.pid} " in line
        (tmp_path / "stop").write_text("")
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "checkpoint directory" not in out  # the restarted rank 0 did not refuse its own job
    finally:
        kill_tagged(tag)


@pytest.mark.timeout(240)
def test_a_directory_a_running_session_took_at_its_first_save_is_refused_too(tmp_path):
    proc, tag = _start_holder(tmp_path)  # no schedule, no restarts, no directory yet: rank 0 takes it
    try:
        _wait_for(tmp_path / "ready0", proc)
        owner = read_owner(tmp_path / "ckpt" / LOCK_FILE)
        assert owner["pid"] != proc.pid and owner["command"] == "holder.py"
        line = _intrude(tmp_path)
        assert f"pid {owner['pid']} " in line
        (tmp_path / "stop").write_text("")
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
    finally:
        kill_tagged(tag)


def test_a_job_that_never_checkpoints_claims_and_creates_nothing(tmp_path):
    (tmp_path / "plain.py").write_text("print('ran')\n")
    results = [run_phalanx("launch", "--cpu", "--nproc", "1", "plain.py", cwd=tmp_path, timeout=60) for _ in range(2)]
    assert all(r.returncode == 0 for r in results), [r.output for r in results]
    assert not (tmp_path / "checkpoints").exists()  # nothing claimed, nothing created


SESSION_ONLY = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import torch
    import phalanx

    session = phalanx.Session(
        batch={"global_batch_size": 2}, train={"progress": False, "metrics": False, "epochs": 1},
        checkpoint={"dir": sys.argv[1], "resume": "never"},
    )
    model = torch.nn.Linear(2, 2)
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with session.accumulate(model):
        session.backward(model(torch.ones(2, 2)).sum())
    session.save()
    Path(sys.argv[2]).write_text("")
    time.sleep(float(sys.argv[3]))
    """
)


@pytest.mark.timeout(120)
def test_a_session_without_the_launcher_takes_the_lock_on_rank_0(tmp_path):
    script = tmp_path / "session_only.py"
    script.write_text(SESSION_ONLY)
    ckpt, first_saved = tmp_path / "ckpt", tmp_path / "first-saved"
    first = subprocess.Popen([sys.executable, str(script), str(ckpt), str(first_saved), "60"], cwd=tmp_path)
    try:
        _wait_for(first_saved, first)
        second = subprocess.run(
            [sys.executable, str(script), str(ckpt), str(tmp_path / "second-saved"), "0"],
            cwd=tmp_path, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        first.kill()
        first.wait()
    assert second.returncode != 0
    assert f"is in use by another job: pid {first.pid} " in second.stderr
    assert not (tmp_path / "second-saved").exists()
