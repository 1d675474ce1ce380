"""Issue 15, bad launch inputs to `phalanx launch`: exit 2, one `phalanx: error:` line, no traceback,
no run directory, and the script never ran (it would leave a marker file). The syntax error goes
through a real process; the others call the command in this one, since none starts a process.
tests/unit/test_config_inputs.py has the same cases in-process, with their exact lines."""

from __future__ import annotations

import pytest

from tests.helpers.cli import call_phalanx, run_phalanx

pytestmark = pytest.mark.multiprocess

MARKER_SCRIPT = "from pathlib import Path\nPath('worker-ran').write_text('yes')\n"

CASES = {
    "case1 preempt_grace .inf": (
        ["--set", "faults.preempt_grace=.inf", "x.py"],
        "invalid value inf for 'faults.preempt_grace' (from --set): Input should be a finite number",
    ),
    "case1 nproc 10**30": (["--nproc", "1" + "0" * 30, "x.py"], "--nproc must be at most 1024"),
    "case3 gpus a,b": (["--gpus", "a,b", "x.py"], "--gpus expects comma-separated GPU indices such as 0,2, got 'a,b'"),
    "case3 gpus with cpu": (["--gpus", "0", "x.py"], "--cpu runs CPU processes only, but --gpus picks GPUs '0'"),
    "case3 nnodes 0": (["--nnodes", "0", "x.py"], "--nnodes must be at least 1, got 0"),
    "case3 nnodes -1": (["--nnodes", "-1", "x.py"], "--nnodes must be at least 1, got -1"),
    "case4 run-dir under a file": (["--run-dir", "afile/sub", "x.py"], "is a file, not a directory; pass --run-dir"),
    "case4 checkpoint.dir under a file": (
        ["--set", "checkpoint.dir=afile/ck", "x.py"],
        "/afile/ck' cannot be created: ",
    ),
    "case5 syntax error": (["bad.py"], "phalanx: error: bad.py:2:7: SyntaxError: invalid syntax"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, message", CASES.values(), ids=CASES.keys())
def test_refused_in_the_launcher(tmp_path, args, message):
    (tmp_path / "x.py").write_text(MARKER_SCRIPT)
    (tmp_path / "bad.py").write_text(MARKER_SCRIPT.replace("\n", "\ndef f(:\n", 1))
    (tmp_path / "afile").write_text("")
    real = args == CASES["case5 syntax error"][0]
    argv = ("launch", "--cpu", *args)
    result = run_phalanx(*argv, cwd=tmp_path, timeout=60) if real else call_phalanx(*argv, cwd=tmp_path)
    assert result.returncode == 2, result.output
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("phalanx: error: "), result.stderr
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.output
    assert not (tmp_path / "runs").exists() and not (tmp_path / "worker-ran").exists()
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.timeout(120)
def test_directories_that_do_not_exist_yet_are_fine(tmp_path):
    (tmp_path / "x.py").write_text(MARKER_SCRIPT)
    result = run_phalanx(
        "launch", "--cpu", "--nproc", "1", "--run-dir", "new/runs", "--set", "checkpoint.dir=new/ck", "x.py",
        cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.output
    assert (tmp_path / "worker-ran").exists() and len(list((tmp_path / "new/runs").iterdir())) == 1
