"""checkpoint/lock.py: an exclusive, kernel-released lock per checkpoint directory, shared only
with the holder's own job or process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from phalanx.checkpoint.lock import LOCK_FILE, DirectoryLock, read_owner
from phalanx.errors import PhalanxError

HOLD = (
    "import sys, time; from phalanx.checkpoint.lock import DirectoryLock; "
    "DirectoryLock(sys.argv[1], sys.argv[2], holder='phalanx launch other.py').acquire(); "
    "print('held', flush=True); time.sleep(60)"
)


def _holder(directory, job="other-job"):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(directory), job], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.timeout(60)
def test_a_lock_held_elsewhere_is_refused_naming_the_holder_then_free_once_it_is_killed(tmp_path):
    holder = _holder(tmp_path / "ckpt")
    try:
        with pytest.raises(PhalanxError) as refused:
            DirectoryLock(tmp_path / "ckpt", "my-job").acquire()
        line = str(refused.value)
        assert "\n" not in line and f"pid {holder.pid} on " in line and "phalanx launch other.py" in line
        assert "--set checkpoint.dir=DIR" in line
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    time.sleep(0.05)
    with DirectoryLock(tmp_path / "ckpt", "my-job") as lock:  # no stale lock after SIGKILL
        assert lock.held
        assert read_owner(tmp_path / "ckpt" / LOCK_FILE)["pid"] == os.getpid()


@pytest.mark.timeout(60)
def test_the_holders_own_job_shares_it(tmp_path):
    holder = _holder(tmp_path / "ckpt", job="runs/20261201-train")
    try:
        lock = DirectoryLock(tmp_path / "ckpt", "runs/20261201-train").acquire()
        assert lock.held and lock.shared_with_job
        lock.release()
    finally:
        holder.kill()
        holder.wait()


def test_a_second_lock_in_the_same_process_is_shared_and_release_frees_it(tmp_path):
    first = DirectoryLock(tmp_path, None).acquire()
    second = DirectoryLock(tmp_path, None).acquire()
    assert first.held and second.shared_with_job
    second.release()
    first.release()
    assert not first.held


def test_an_unusable_directory_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(PhalanxError, match=r"cannot use checkpoint directory .*file/ckpt.*checkpoint\.dir"):
        DirectoryLock(blocker / "ckpt", None).acquire()


@pytest.mark.parametrize("content", [b"", b"\xff\xfe", b"[1, 2]", b"{", b"null", b'{"pid": "x"}'])
def test_an_unreadable_owner_record_is_empty_or_as_written(tmp_path, content):
    (tmp_path / LOCK_FILE).write_bytes(content)
    owner = read_owner(tmp_path / LOCK_FILE)
    assert isinstance(owner, dict)


@pytest.mark.timeout(60)
def test_two_launches_with_the_same_run_directory_name_never_share_a_lock(tmp_path, monkeypatch):
    # Two launches of one script in the same second picked the same run directory name; the lock's
    # job token is the launch's own, so the second is refused and then makes its own directory.
    from phalanx.launch.launcher import LaunchRequest, _make_run_dir, checkpoint_lock, prepare

    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("print('ran')\n")
    request = LaunchRequest("x.py", overrides=["checkpoint.save_every=10"], cpu=True, nproc=1)
    first, second = prepare(request), prepare(request)
    assert first.run_dir == second.run_dir and first.context.job != second.context.job
    holder = _holder((tmp_path / "checkpoints").resolve(), job=first.context.job)  # the first launcher
    try:
        with pytest.raises(PhalanxError, match="in use by another job"):
            checkpoint_lock(second).acquire()
    finally:
        holder.kill()
        holder.wait()
    first = _make_run_dir(first)
    taken = _make_run_dir(second)
    assert taken.run_dir != first.run_dir and taken.context.run_dir == str(taken.run_dir)
