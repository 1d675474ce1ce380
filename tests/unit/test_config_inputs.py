"""Issue 15, bad inputs of the config layer, the CLI flags and the launcher's pre-flight: each gets one
line before any worker starts. In-process: a launch refused in prepare() starts no process, and
run_workers is replaced by a failure, so a regression here cannot start one either."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from phalanx.cli.main import main
from phalanx.config.loader import load_config
from phalanx.errors import ConfigError, PhalanxError
from phalanx.launch import launcher
from phalanx.launch.launcher import LaunchRequest, prepare
from phalanx.launch.preflight import check_script
from phalanx.topology import LaunchContext

MARKER_SCRIPT = "from pathlib import Path\nPath('worker-ran').write_text('yes')\n"


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no phalanx.yaml of the repository's
    (tmp_path / "x.py").write_text(MARKER_SCRIPT)

    def no_workers(plan):
        raise AssertionError("a worker was about to start")

    monkeypatch.setattr(launcher, "run_workers", no_workers)
    return tmp_path


def refused(capsys, argv: list[str]) -> str:
    """``phalanx ARGV`` in this process: exit 2 and one ``phalanx: error:`` line, returned."""
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse
        code = stop.code
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert err.count("\n") == 1 and err.startswith("phalanx: error: "), err
    assert "Traceback" not in out + err
    return err.strip()


def launch_refused(capsys, workdir: Path, *args: str) -> str:
    line = refused(capsys, ["launch", "--cpu", *args])
    assert not (workdir / "runs").exists() and not (workdir / "worker-ran").exists()
    return line


def load(*overrides: str):
    return load_config(overrides=overrides, context=LaunchContext())


# -- case 1: non-finite floats and huge integers are refused by the schema ---------------------------


@pytest.mark.parametrize("text", [".inf", "-.inf", ".nan", "nan", "inf", "-inf", "1e400", "1.0e+400"])
@pytest.mark.parametrize(
    "key",
    [
        "faults.preempt_grace",
        "faults.hang_timeout",
        "faults.first_step_timeout",
        "strategy.ddp.bucket_cap_mb",
        "strategy.ddp.first_bucket_cap_mb",
        "optim.max_grad_norm",
        "optim.warmup_start_factor",
    ],
)
def test_case1_every_float_setting_refuses_non_finite_numbers(key, text):
    with pytest.raises(ConfigError) as err:
        load(f"{key}={text}")
    assert f"for '{key}' (from --set)" in str(err.value) and "\n" not in str(err.value)


def test_case1_non_finite_is_named_as_such():
    with pytest.raises(ConfigError, match=r"'faults.preempt_grace' \(from --set\): Input should be a finite number"):
        load("faults.preempt_grace=.inf")


def test_case1_a_file_gets_the_same_rule(tmp_path):
    (tmp_path / "c.yaml").write_text("faults:\n  hang_timeout: .nan\n")
    with pytest.raises(ConfigError, match=rf"'faults.hang_timeout' \(from file {tmp_path / 'c.yaml'}\)"):
        load_config(tmp_path / "c.yaml", context=LaunchContext())


@pytest.mark.parametrize(
    "line, message",
    [
        ("launch.nproc=1000000000000000000000000000000", "'launch.nproc' (from --set): Input should be less than"),
        ("launch.nnodes=1000000", "'launch.nnodes' (from --set): must be at most 65536"),
        ("launch.nnodes=1:1000000", "'launch.nnodes' (from --set): expects N or MIN:MAX"),
        ("launch.nnodes=3:2", "'launch.nnodes' (from --set): expects MIN:MAX with 1 <= MIN <= MAX"),
        ("faults.preempt_grace=1e300", "'faults.preempt_grace' (from --set): Input should be less than"),
        ("faults.hang_timeout=1e12", "'faults.hang_timeout' (from --set): Input should be less than"),
        ("strategy.ddp.bucket_cap_mb=1e300", "'strategy.ddp.bucket_cap_mb' (from --set): Input should be less"),
        ("train.seed=100000000000000000000000", "'train.seed' (from --set): must be between"),
        ("launch.max_restarts=100000000000000000000000", "'launch.max_restarts' (from --set): must be between"),
        ("train.profile_ranks=[0, 100000000000000000000000]", "'train.profile_ranks' (from --set): must be between"),
        ("train.memory_cap=100000000000000000000000", "'train.memory_cap' (from --set): must be between"),
        ("train.memory_cap=" + "9" * 400 + "GiB", "is not a size"),
        ("checkpoint.save_every=" + "9" * 400 + "h", "neither a number of steps nor a period"),
        ("launch.master=node01:99999999999999999999", "expects HOST:PORT with a port 1-65535"),
        ("launch.rdzv_endpoint=node01:0", "expects HOST:PORT with a port 1-65535"),
        ("checkpoint.dir='a\0b'", "must not contain control characters or line breaks"),
        ("train.profile=steps=1:3\x1e", "must not contain control characters or line breaks"),
        ('launch.rdzv_id="a\\nb"', "must not contain control characters or line breaks"),
    ],
)
def test_case1_huge_integers_are_refused_with_bounds(line, message):
    with pytest.raises(ConfigError) as err:
        load(line)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_case1_preempt_grace_inf_is_refused_by_the_launcher(capsys, workdir):
    line = launch_refused(capsys, workdir, "--set", "faults.preempt_grace=.inf", "x.py")
    assert "invalid value inf for 'faults.preempt_grace' (from --set): Input should be a finite number" in line


def test_case1_bounds_leave_room_for_real_values():
    config = load("faults.preempt_grace=3600", "faults.hang_timeout=0", "launch.nproc=64", "train.seed=-5")
    assert (config.faults.preempt_grace, config.launch.nproc, config.train.seed) == (3600, 64, -5)


# -- case 2: every numeric flag of `phalanx plan` ----------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--params", "nan"], "--params must be a positive count, at most 1e15, got nan"),
        (["--params", "inf"], "--params must be a positive count, at most 1e15, got inf"),
        (["--params", "1e400"], "--params must be a positive count, at most 1e15, got inf"),
        (["--params", "-5"], "--params must be a positive count"),
        (["--params", "1e300"], "--params must be a positive count, at most 1e15, got 1e+300"),
        (["--params", "1e9", "--device-memory", "nan"], "--device-memory must be a positive number of GiB"),
        (["--params", "1e9", "--device-memory", "inf"], "--device-memory must be a positive number of GiB"),
        (["--params", "1e9", "--device-memory", "-1"], "--device-memory must be a positive number of GiB"),
        (["--params", "1e9", "--micro-batch", "-3"], "--micro-batch must be at least 1"),
        (["--params", "1e9", "--micro-batch", "1" + "0" * 400], "--micro-batch must be at least 1"),
        (["--params", "1e9", "--devices", "0"], "--devices must be at least 1"),
        (["--params", "1e9", "--devices", "1" + "0" * 30], "--devices must be at least 1 (and at most 1048576)"),
        (["--params", "1e9", "--micro-batch", "1e3"], "argument --micro-batch: invalid int value: '1e3'"),
    ],
)
def test_case2_plan_numbers(capsys, args, message):
    assert message in refused(capsys, ["plan", *args])


def test_case2_a_good_plan_still_plans(capsys):
    assert main(["plan", "--params", "1e9", "--device-memory", "80", "--json"]) == 0
    assert '"n_params": 1000000000' in capsys.readouterr().out


def test_case2_model_arg_that_is_not_yaml_is_text(capsys):
    line = refused(capsys, ["plan", "--example", "gpt", "--model-arg", "vocab=" + "[" * 3000])
    assert "the model factory failed" in line


# -- case 3: launch flags are validated exactly like their launch.* keys -----------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nnodes", "0"], "phalanx: error: --nnodes must be at least 1, got 0"),
        (["--nnodes", "-1"], "phalanx: error: --nnodes must be at least 1, got -1"),
        (["--nproc", "0"], "phalanx: error: --nproc must be at least 1, got 0"),
        (["--nproc", "1" + "0" * 30], "phalanx: error: --nproc must be at most 1024, got 1" + "0" * 30),
        (["--max-restarts", "-1"], "phalanx: error: --max-restarts must be 0 or more, got -1"),
        (["--node-rank", "-2"], "phalanx: error: --node-rank must be 0 or more, got -2"),
        (["--gpus", "a,b"], "phalanx: error: --gpus expects comma-separated GPU indices such as 0,2, got 'a,b'"),
        (["--gpus", "1,1"], "phalanx: error: --gpus names a GPU twice, got '1,1'"),
        (["--gpus", "-1"], "phalanx: error: --gpus expects comma-separated GPU indices such as 0,2, got '-1'"),
        (
            ["--gpus", "0"],
            "phalanx: error: --cpu runs CPU processes only, but --gpus picks GPUs '0'; drop one of the two",
        ),
        (["--master", "node01"], "phalanx: error: --master expects HOST:PORT with a port 1-65535 (e.g. node01:29500)"),
        (["--rdzv-endpoint", "h:70000"], "phalanx: error: --rdzv-endpoint expects HOST:PORT with a port 1-65535"),
    ],
)
def test_case3_flags_by_their_keys_rules(capsys, workdir, args, message):
    assert launch_refused(capsys, workdir, *args, "x.py").startswith(message)


@pytest.mark.parametrize(
    "line, message",
    [
        ("launch.nnodes=0", "invalid value 0 for 'launch.nnodes' (from --set): must be at least 1"),
        ("launch.nnodes=0:2", "invalid value '0:2' for 'launch.nnodes' (from --set): expects MIN:MAX with 1 <="),
        ("launch.gpus=a,b", "invalid value 'a,b' for 'launch.gpus' (from --set): expects comma-separated GPU indices"),
        ("launch.gpus=0", "launch.cpu runs CPU processes only, but launch.gpus picks GPUs '0'; drop one of the two"),
    ],
)
def test_case3_the_same_rules_for_the_keys(capsys, workdir, line, message):
    assert message in launch_refused(capsys, workdir, "--set", line, "x.py")


def test_case3_cpu_and_gpus_in_a_file_is_the_same_contradiction(workdir):
    (workdir / "c.yaml").write_text("launch:\n  cpu: true\n  gpus: '0,1'\n")
    with pytest.raises(ConfigError, match="launch.cpu runs CPU processes only, but launch.gpus picks GPUs '0,1'"):
        prepare(LaunchRequest("x.py", config_file="c.yaml"))


def test_case3_one_rule_each(workdir):
    assert not hasattr(launcher, "_AT_LEAST")  # the flags' own copy of the bounds is gone
    plan = prepare(LaunchRequest("x.py", cpu=True, nnodes=1, node_rank=0, max_restarts=0))
    assert (plan.config.launch.nnodes, plan.config.launch.node_rank) == (1, 0)


# -- case 4: run-dir and checkpoint.dir can be created and written, before any worker -----------------


def test_case4_run_dir_under_a_file(capsys, workdir):
    (workdir / "afile").write_text("")
    line = launch_refused(capsys, workdir, "--run-dir", "afile/sub", "x.py")
    assert line == (
        f"phalanx: error: launch.run_dir '{workdir / 'afile/sub'}' cannot be created: '{workdir / 'afile'}' "
        "is a file, not a directory; pass --run-dir DIR naming a directory you can write"
    )


def test_case4_run_dir_that_is_a_file(capsys, workdir):
    (workdir / "afile").write_text("")
    assert "is a file, not a directory" in launch_refused(capsys, workdir, "--run-dir", "afile", "x.py")


def test_case4_checkpoint_dir_under_a_file(capsys, workdir):
    (workdir / "afile").write_text("")
    line = launch_refused(capsys, workdir, "--set", "checkpoint.dir=afile/ck", "x.py")
    assert line.startswith(f"phalanx: error: checkpoint.dir '{workdir / 'afile/ck'}' cannot be created")
    assert line.endswith("set checkpoint.dir (e.g. --set checkpoint.dir=DIR) to a directory you can write")


def _deny_under(monkeypatch, root: Path) -> None:
    """Writing below ``root`` fails as on a read-only directory (the tests may run as root, whom
    file modes do not stop)."""
    real_mkdir, real_write = Path.mkdir, Path.write_bytes

    def deny(path: Path) -> None:
        if path.is_relative_to(root) and path != root:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    def mkdir(self, *args, **kwargs):
        deny(self)
        return real_mkdir(self, *args, **kwargs)

    def write_bytes(self, data):
        deny(self)
        return real_write(self, data)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    monkeypatch.setattr(Path, "write_bytes", write_bytes)


def test_case4_run_dir_in_a_read_only_parent(capsys, workdir, monkeypatch):
    (workdir / "ro").mkdir()
    _deny_under(monkeypatch, workdir / "ro")
    line = launch_refused(capsys, workdir, "--run-dir", "ro/sub", "x.py")
    assert line == (
        f"phalanx: error: launch.run_dir '{workdir / 'ro/sub'}' is not writable: Permission denied; "
        "pass --run-dir DIR naming a directory you can write"
    )


def test_case4_unwritable_checkpoint_dir(capsys, workdir, monkeypatch):
    (workdir / "ro").mkdir()
    _deny_under(monkeypatch, workdir / "ro")
    line = launch_refused(capsys, workdir, "--set", "checkpoint.dir=ro", "x.py")
    assert line == (
        f"phalanx: error: checkpoint.dir '{workdir / 'ro'}' is not writable: Permission denied; "
        "set checkpoint.dir (e.g. --set checkpoint.dir=DIR) to a directory you can write"
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_case4_a_real_read_only_directory(capsys, workdir):
    (workdir / "ro").mkdir()
    (workdir / "ro").chmod(0o555)
    try:
        assert "is not writable: Permission denied" in launch_refused(capsys, workdir, "--run-dir", "ro/sub", "x.py")
    finally:
        (workdir / "ro").chmod(0o755)


def test_case4_the_checks_leave_nothing_behind(workdir):
    plan = prepare(LaunchRequest("x.py", cpu=True, run_dir="a/b/runs", overrides=["checkpoint.dir=c/d"]))
    assert plan.run_dir.parent == (workdir / "a/b/runs").resolve()
    assert sorted(p.name for p in workdir.iterdir()) == ["x.py"]


# -- case 5: the script compiles in the launcher ------------------------------------------------------


def test_case5_syntax_error_is_one_line(capsys, workdir):
    (workdir / "bad.py").write_text("import os\n\ndef f(:\n    pass\n")
    line = launch_refused(capsys, workdir, "bad.py")
    assert line == "phalanx: error: bad.py:3:7: SyntaxError: invalid syntax; fix the script (nothing was started)"


def test_case5_indentation_error_names_its_kind(capsys, workdir):
    (workdir / "bad.py").write_text("if True:\npass\n")
    assert "bad.py:2:1: IndentationError: expected an indented block" in launch_refused(capsys, workdir, "bad.py")


def test_case5_null_bytes_and_bad_encoding(workdir):
    (workdir / "nul.py").write_bytes(b"x = 1\0\n")
    (workdir / "enc.py").write_bytes(b"x = '\xff'\n")  # not UTF-8, and no cookie
    for script in ("nul.py", "enc.py"):
        with pytest.raises(PhalanxError) as err:
            check_script(script)
        assert str(err.value).startswith(f"{script}") and "\n" not in str(err.value)


def test_case5_the_encoding_cookie_is_honoured(workdir):
    (workdir / "latin.py").write_bytes(b"# -*- coding: latin-1 -*-\nname = 'caf\xe9'\n")
    check_script("latin.py")
    assert prepare(LaunchRequest("latin.py", cpu=True)).request.script == "latin.py"


def test_case5_warnings_of_the_script_are_left_to_its_workers(workdir, recwarn):
    (workdir / "warn.py").write_text("import re\npattern = '\\d'\nassert (1, 2)\n")
    check_script("warn.py")
    assert len(recwarn) == 0
