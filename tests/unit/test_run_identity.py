"""Issue 23: a checkpoint resumes only the run it belongs to. The fingerprint's comparison over
config changes (hypothesis: a counted setting changed is refused and named, any other resumes), the
script and its arguments, the launcher's preflight on checkpoint files, and the Session's refusal
at setup in one process (the two-process paths are tests/integration/test_run_identity.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.checkpoint import files, run_identity
from phalanx.checkpoint.run_identity import RunIdentity
from phalanx.config.loader import load_config
from phalanx.config.schema import Config
from phalanx.errors import ConfigError, PhalanxError
from phalanx.launch.preflight import check_checkpoint_owner
from phalanx.strategies.registry import strategy_class
from phalanx.topology import LaunchContext

FAST = settings(derandomize=True, database=None, max_examples=200, deadline=None)

# Valid values other than the default for every setting. A setting added to the config must be
# added here: the tests below then say whether it counts as it should (run_identity.COUNTED).
ALTERNATIVES: dict[str, list[Any]] = {
    "preset": ["throughput"],
    "strategy.name": ["ddp", "fsdp", "zero1", "single"],
    "strategy.activation_checkpointing": [["Block"]],
    "strategy.ddp.bucket_cap_mb": [50.0, 1.0],
    "strategy.ddp.first_bucket_cap_mb": [1.0],
    "strategy.ddp.gradient_as_bucket_view": [False],
    "strategy.ddp.static_graph": [True],
    "strategy.ddp.find_unused_parameters": [True, False],
    "strategy.ddp.broadcast_buffers": [False],
    "strategy.ddp.comm_hook": ["fp16", "bf16", "powersgd"],
    "strategy.ddp.powersgd_rank": [2, 4],
    "strategy.ddp.powersgd_start_step": [0, 100],
    "strategy.ddp.powersgd_warm_start": [False],
    "strategy.fsdp.reshard_after_forward": [False],
    "strategy.fsdp.wrap": [["Block"]],
    "strategy.fsdp.min_params": [1000],
    "strategy.fsdp.reduce_dtype": ["bf16"],
    "strategy.fsdp.cpu_offload": [True],
    "strategy.tp.size": [2],
    "strategy.tp.plan": [{"*.up": "colwise"}],
    "strategy.pipeline.schedule": ["gpipe"],
    "strategy.pipeline.microbatches": [4],
    "strategy.pipeline.split_points": [["layers.2"]],
    "batch.global_batch_size": [32, 64],
    "batch.micro_batch_size": [4, 8],
    "batch.max_micro_batch_size": [16],
    "batch.fixed_layout": [True],
    "batch.adaptive": ["goodput"],
    "batch.adapt_every": [10],
    "batch.adaptive_max_global_batch": [256],
    "batch.adaptive_step_times": [[0.1, 0.01]],
    "batch.adaptive_loss_check": [False],
    "batch.schedule": ["x2@10"],
    "optim.lr_scaling": ["linear", "sqrt"],
    "optim.reference_batch_size": [16],
    "optim.warmup_steps": [100],
    "optim.warmup_start_factor": [0.1],
    "optim.max_grad_norm": [1.0, 0.5],
    "precision.mode": ["bf16", "fp16"],
    "precision.tf32": [True],
    "precision.cudnn_benchmark": [True],
    "compute.compile": [True],
    "compute.compile_mode": ["default"],  # another mode needs compile: true (its own example below)
    "compute.channels_last": [True],
    "compute.optimizer_impl": ["foreach", "loop"],
    "data.num_workers": [2, "auto"],
    "data.pin_memory": [False],
    "data.persistent_workers": [False],
    "data.prefetch_factor": [4],
    "data.prefetch_to_device": [False],
    "data.drop_last": [True],
    "train.epochs": [3, 10],
    "train.max_steps": [100, 5000],
    "train.seed": [1, 1234],
    "train.progress": [False],
    "train.metrics": [False],
    "train.tensorboard": [False],
    "train.profile": ["steps=5:8"],
    "train.weights_trace": ["trace"],
    "train.profile_ranks": [[0, 1]],
    "train.memory_cap": ["2GiB"],
    "train.noise_scale": [False, "hook"],
    "train.noise_scale_every": [5],
    "train.noise_scale_smoothing": [0.9],
    "checkpoint.dir": ["elsewhere"],
    "checkpoint.save_every": [100, "30m"],
    "checkpoint.keep_last": [1, None],
    "checkpoint.resume": ["never"],
    "checkpoint.resume_any_run": [True],
    "checkpoint.ignore_args": [["--eval-every"]],
    "faults.hang_timeout": [60.0],
    "faults.first_step_timeout": [600.0],
    "faults.preempt_grace": [30.0],
    "faults.replica_check_every": [1, 0],
    "launch.nproc": [4],
    "launch.gpus": ["0,1"],
    "launch.cpu": [True],
    "launch.ranks": ["all"],
    "launch.run_dir": ["elsewhere"],
    "launch.max_restarts": [3],
    "launch.nnodes": [2, "1:4"],
    "launch.rendezvous_timeout": [60],
    "launch.late_node_wait": [0],
    "launch.node_timeout": [5],
    "launch.node_rank": [1],
    "launch.master": ["node01:29500"],
    "launch.rdzv_endpoint": ["node01:29400"],
    "launch.rdzv_id": ["job7"],
    "launch.verbose": [True],
    "launch.check": [False],
}
STRATEGIES = ["single", "ddp", "zero1", "fsdp", "pipeline"]


def _config(changes: dict[str, Any]) -> Config:
    return Config.load(overrides=[f"{key}={json.dumps(value)}" for key, value in changes.items()])


# What counts, written out again here rather than read from run_identity: a change to either is a
# decision, and docs/checkpoints.md#which-settings-count says the same.
MUST_COUNT = {
    "batch.global_batch_size", "batch.adaptive", "batch.adapt_every", "batch.adaptive_max_global_batch",
    "batch.adaptive_step_times", "batch.adaptive_loss_check", "batch.schedule", "optim.lr_scaling",
    "optim.reference_batch_size", "optim.warmup_steps",
    "optim.warmup_start_factor", "optim.max_grad_norm", "precision.mode", "precision.tf32", "data.drop_last",
    "train.seed",
}  # fmt: skip
MUST_COUNT_FOR = {
    "ddp": {"comm_hook", "powersgd_rank", "powersgd_start_step", "powersgd_warm_start", "broadcast_buffers"},
    "fsdp": {"reduce_dtype"},
}
MUST_COUNT_WITH_ADAPTIVE = {"train.noise_scale", "train.noise_scale_every", "train.noise_scale_smoothing"}


def _keys(strategy: str) -> list[str]:
    return strategy_class(strategy).counted_settings()


def _counts(key: str, strategy: str, config: Config) -> bool:
    section, _, option = key.removeprefix("strategy.").partition(".")
    if key.startswith("strategy.") and option:
        # A strategy's own section: zero1 trains through DDP and reads strategy.ddp.
        own = strategy_class(strategy).options_key
        return section == own and option in MUST_COUNT_FOR.get(section, set())
    return key in MUST_COUNT or (key in MUST_COUNT_WITH_ADAPTIVE and config.batch.adaptive is not None)


def test_every_setting_is_classified():
    missing = sorted(set(Config().flat()) - set(ALTERNATIVES))
    assert not missing, f"add {missing} to ALTERNATIVES (and to run_identity.COUNTED if it changes what training does)"


@FAST
@given(
    st.lists(
        st.sampled_from(sorted(ALTERNATIVES)).flatmap(
            lambda k: st.tuples(st.just(k), st.sampled_from(ALTERNATIVES[k]))
        ),
        min_size=1,
        max_size=3,
        unique_by=lambda kv: kv[0],
    ),
    st.sampled_from(STRATEGIES),
)
def test_a_counted_change_is_named_and_any_other_resumes(changed, strategy):
    base = Config.load()
    try:
        now = _config(dict(changed))
    except ConfigError:
        assume(False)  # a combination the config refuses (e.g. launch.cpu with launch.gpus)
    saved = {"settings": run_identity.counted_settings(base, _keys(strategy)), "script": None}
    here = {"settings": run_identity.counted_settings(now, _keys(strategy)), "script": None}
    found = run_identity.differences(saved, here)
    old, new = base.flat(), now.flat()
    # What a preset turns on changes with it; a value equal to the default changes nothing.
    expected = {
        k for k in new if k in old and old[k] != new[k] and _counts(k, strategy, base) and _counts(k, strategy, now)
    }
    assert expected >= {k for k, v in changed if _counts(k, strategy, base) and old[k] != v}
    # A counted setting changed is named with both values; nothing else is.
    assert {line.partition(":")[0] for line in found} == expected
    for key in expected:
        assert f"{key}: {_shown(old[key])} -> {_shown(new[key])}" in found


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def test_noise_scale_counts_only_under_batch_adaptive():
    plain = run_identity.counted_settings(_config({"train.noise_scale_every": 5}), _keys("ddp"))
    adaptive = run_identity.counted_settings(_config({"batch.adaptive": "goodput"}), _keys("ddp"))
    assert "train.noise_scale_every" not in plain and adaptive["train.noise_scale_every"] == 10


def test_a_strategy_option_counts_for_the_strategy_in_use_only():
    hook = _config({"strategy.ddp.comm_hook": "fp16"})
    assert run_identity.counted_settings(hook, _keys("ddp"))["strategy.ddp.comm_hook"] == "fp16"
    assert not any(k.startswith("strategy.ddp.") for k in run_identity.counted_settings(hook, _keys("fsdp")))
    # zero1 trains through DDP: its comm hook changes the numbers as ddp's does.
    saved = {"settings": run_identity.counted_settings(Config.load(), _keys("ddp"))}
    found = run_identity.differences(saved, {"settings": run_identity.counted_settings(hook, _keys("zero1"))})
    assert found == ["strategy.ddp.comm_hook: none -> fp16"]
    # A resume under a strategy with another section (a plain checkpoint resumes under any) compares none.
    assert run_identity.differences(saved, {"settings": run_identity.counted_settings(hook, _keys("single"))}) == []


def test_refusal_shows_three_differences_and_counts_the_rest(tmp_path):
    found = [f"k{i}: {i} -> {i + 1}" for i in range(5)]
    manifest = {"step": 12, "created": "2026-12-01T10:00:00+0000"}
    line = run_identity.refusal(tmp_path / "step-00000012", manifest, found, command_line=True)
    assert "\n" not in line and f"checkpoint '{tmp_path / 'step-00000012'}' (step 12, saved 2026-12-01" in line
    assert "k0: 0 -> 1, k1: 1 -> 2, k2: 2 -> 3 (and 2 more)" in line and "k3" not in line
    assert "--set checkpoint.resume_any_run=true" in line and "--set checkpoint.dir=DIR" in line
    assert "--set checkpoint.resume=never" in line
    own = run_identity.refusal(tmp_path, manifest, found[:1], command_line=False)
    assert "checkpoint.resume_any_run: true" in own and "--set" not in own


# -- the script --------------------------------------------------------------------------------


def test_script_identity_hashes_content_and_keeps_arguments(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    first = run_identity.script_identity(str(script), ["--lr", "3e-4"])
    assert first == {"path": str(script.resolve()), "sha256": files.sha256(script), "args": ["--lr", "3e-4"]}
    assert run_identity.script_identity(str(tmp_path / "missing.py"), []) is None
    assert run_identity.script_identity("-c", []) is None and run_identity.script_identity("", []) is None
    # The same content elsewhere (a copied project, a symlink) is the same script.
    copy = tmp_path / "copy.py"
    copy.write_text("print(1)\n")
    moved = run_identity.script_identity(str(copy), ["--lr", "3e-4"])
    assert run_identity.differences({"script": first}, {"script": moved}) == []
    script.write_text("print(2)\n")
    edited = run_identity.script_identity(str(script), ["--lr", "1e-3", "--name", "a b"])
    found = run_identity.differences({"script": first}, {"script": edited})
    assert found == [
        "script train.py: its content differs from the one that saved it",
        "script argument --lr 3e-4 (checkpoint) vs --lr 1e-3 (now)",
        "script argument without --name (checkpoint) vs --name 'a b' (now)",
    ]
    assert run_identity.differences({"script": None}, {"script": edited}) == []  # nothing to compare


# -- checkpoints on disk -------------------------------------------------------------------------


def _session(ckpt: Path, **sections) -> tuple:
    torch.manual_seed(0)
    train = {"epochs": 1, "progress": False, "metrics": False, **sections.pop("train", {})}
    checkpoint = {"dir": str(ckpt), **sections.pop("checkpoint", {})}
    batch = {"global_batch_size": 8, **sections.pop("batch", {})}
    session = phalanx.Session(batch=batch, train=train, checkpoint=checkpoint, **sections)
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = session.setup(model, optimizer, DataLoader(data, batch_size=8))
    return session, model, loader


def _train(session, model, loader) -> None:
    for _ in session.epochs():
        for x, y in session.progress(loader):
            with session.accumulate(model):
                session.backward(nn.functional.mse_loss(model(x), y))


@pytest.fixture
def saved(tmp_path) -> Path:
    """A checkpoint of a one-process run with the defaults but these sizes; returns the directory."""
    session, model, loader = _session(tmp_path / "ck", checkpoint={"resume": "never"})
    _train(session, model, loader)
    session.save()
    session.close()
    return tmp_path / "ck"


def _resume(ckpt: Path, capsys, **sections) -> str:
    session, model, loader = _session(ckpt, **sections)
    try:
        _train(session, model, loader)
    finally:
        session.close()
    return capsys.readouterr().out


def test_manifest_records_the_run(saved):
    manifest = files.read_manifest(files.latest(saved))
    run = manifest["run"]
    assert run["settings"]["train.seed"] == 0 and run["settings"]["batch.global_batch_size"] == 8
    assert "train.epochs" not in run["settings"] and "checkpoint.dir" not in run["settings"]
    assert run["launch"] is None  # no phalanx launch


def test_the_same_run_resumes_and_an_uncounted_change_too(saved, capsys):
    capsys.readouterr()
    assert "resumed from" in _resume(saved, capsys)
    out = _resume(saved, capsys, train={"epochs": 3, "max_steps": 5}, batch={"micro_batch_size": 4})
    assert "resumed from" in out and "belongs to another run" not in out


def test_a_counted_change_is_refused_at_setup_naming_it(saved, capsys):
    with pytest.raises(PhalanxError) as err:  # at setup(), or at the first training action before it resumes
        _resume(saved, capsys, train={"seed": 7}, optim={"max_grad_norm": 1.0})
    line = str(err.value)
    assert "\n" not in line and f"checkpoint '{saved / 'step-00000002'}' (step 2, saved " in line
    assert "belongs to another run: optim.max_grad_norm: null -> 1.0, train.seed: 0 -> 7;" in line
    assert "checkpoint.resume_any_run: true" in line and "checkpoint.resume: never" in line


def test_resume_any_run_resumes_and_says_what_differs(saved, capsys):
    out = _resume(saved, capsys, train={"seed": 7}, checkpoint={"resume_any_run": True})
    assert "resuming" in out and "although it belongs to another run: train.seed: 0 -> 7" in out
    assert "resumed from" in out


def test_never_and_an_explicit_path_are_not_checked(saved, capsys):
    assert "resumed from" not in _resume(saved, capsys, train={"seed": 7}, checkpoint={"resume": "never"})
    explicit = str(saved / "step-00000002")
    assert "resumed from" in _resume(saved, capsys, train={"seed": 7}, checkpoint={"resume": explicit})


def test_a_checkpoint_from_before_the_fingerprint_resumes_with_a_note(saved, capsys):
    where = files.latest(saved)
    manifest = json.loads((where / files.MANIFEST).read_text())
    del manifest["run"]
    (where / files.MANIFEST).write_text(json.dumps(manifest))
    out = _resume(saved, capsys, train={"seed": 7})
    assert "before checkpoints recorded their run: resuming it without checking" in out
    assert "resumed from" in out


@pytest.mark.parametrize(
    "run, problem",
    [
        ([], '"run" is a list, not an object'),
        ({"script": None}, "run.settings is missing"),
        ({"settings": {}, "script": {"path": "x", "sha256": "zz", "args": []}}, "run.script.sha256"),
        ({"settings": {}, "script": {"path": "x", "sha256": "0" * 64, "args": [1]}}, "run.script.args[0]"),
        ({"settings": {}, "script": None, "launch": {"settings": []}}, "run.launch.settings"),
    ],
)
def test_a_damaged_run_record_is_named(saved, run, problem):
    where = files.latest(saved)
    manifest = json.loads((where / files.MANIFEST).read_text())
    manifest["run"] = run
    (where / files.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(PhalanxError, match="is damaged") as err:
        files.read_manifest(where)
    assert problem in str(err.value)


# -- phalanx launch's preflight ---------------------------------------------------------------------

# What the fixture's script sets in code (_session), as a Session under phalanx launch records it.
SET_IN_CODE = ["batch.global_batch_size", "train.epochs", "train.metrics", "train.progress"]


def _as_launched(saved: Path, config: Config, script: Path, args: list[str], chosen=SET_IN_CODE) -> dict:
    """Make the checkpoint one that phalanx launch started: its script, arguments and the launcher's
    view recorded, and ``chosen``, the settings its script set itself."""
    where = files.latest(saved)
    manifest = json.loads((where / files.MANIFEST).read_text())
    launched = run_identity.of_launch(config, _keys("single"), str(script), args)
    manifest["run"].update(launch=launched, script=launched["script"], script_set=chosen)
    (where / files.MANIFEST).write_text(json.dumps(manifest))
    return launched


def _check(changes: dict[str, Any], script: Path, args: list[str]) -> None:
    config = _config(changes)
    check_checkpoint_owner(config, run_identity.of_launch(config, _keys("single"), str(script), args))


def test_preflight_refuses_in_one_line_what_the_workers_would_refuse_for_certain(saved, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    base = Config.load(overrides=[f"checkpoint.dir={saved}"])
    _as_launched(saved, base, script, ["--x", "1"])
    _check({"checkpoint.dir": str(saved)}, script, ["--x", "1"])  # the same command passes
    _check({"checkpoint.dir": str(saved), "train.max_steps": 900, "launch.nproc": 4}, script, ["--x", "1"])
    # A counted setting on the command line wins over anything the script sets: certain.
    with pytest.raises(PhalanxError) as err:
        _check({"checkpoint.dir": str(saved), "precision.mode": "bf16"}, script, ["1", "--x"][::-1])
    line = str(err.value)
    assert "\n" not in line and "step-00000002' (step 2, saved " in line
    assert "precision.mode: fp32 -> bf16" in line and "--set checkpoint.resume_any_run=true" in line
    for way_out in ({"checkpoint.resume_any_run": True}, {"checkpoint.resume": "never"}):
        _check({"checkpoint.dir": str(saved), "precision.mode": "bf16", **way_out}, script, ["--x", "1"])


@pytest.mark.parametrize(
    "why, args, chosen, edit",
    [
        ("other arguments may choose another directory in code", ["--x", "2"], SET_IN_CODE, False),
        ("an added --resume PATH may be what the script resumes from", ["--x", "1", "--resume", "a"], [], False),
        ("an edited script may set its own checkpoint.dir", ["--x", "1"], SET_IN_CODE, True),
        ("the script chose its resume mode in code", ["--x", "1"], [*SET_IN_CODE, "checkpoint.resume"], False),
        ("the script chose its checkpoint.dir in code", ["--x", "1"], [*SET_IN_CODE, "checkpoint.dir"], False),
        ("the script chose the setting in code", ["--x", "1"], [*SET_IN_CODE, "precision.mode"], False),
        ("recorded before script_set", ["--x", "1"], None, False),
    ],
)
def test_preflight_leaves_to_the_workers_what_the_script_may_decide(saved, tmp_path, why, args, chosen, edit):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    config = Config.load(overrides=[f"checkpoint.dir={saved}"])
    _as_launched(saved, config, script, ["--x", "1"], chosen)
    if edit:
        script.write_text("pass  # edited\n")
    file = tmp_path / "phalanx.yaml"  # settings from the launcher's file, which code wins over
    file.write_text(f"precision: {{mode: bf16}}\ncheckpoint: {{dir: {json.dumps(str(saved))}}}\n")
    changed = load_config(str(file))
    check_checkpoint_owner(changed, run_identity.of_launch(changed, _keys("single"), str(script), args))


def test_preflight_counts_a_file_setting_the_script_leaves_to_the_launcher(saved, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    _as_launched(saved, Config.load(overrides=[f"checkpoint.dir={saved}"]), script, [])
    file = tmp_path / "phalanx.yaml"
    file.write_text("precision: {mode: bf16}\n")
    changed = load_config(str(file), overrides=[f"checkpoint.dir={saved}"])
    with pytest.raises(PhalanxError, match="precision.mode: fp32 -> bf16"):
        check_checkpoint_owner(changed, run_identity.of_launch(changed, _keys("single"), str(script), []))


def test_preflight_leaves_a_checkpoint_written_without_phalanx_launch_to_the_session(saved, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    where = files.latest(saved)
    manifest = json.loads((where / files.MANIFEST).read_text())
    manifest["run"]["script"] = run_identity.script_identity(str(script), [])
    (where / files.MANIFEST).write_text(json.dumps(manifest))
    script.write_text("pass  # edited\n")
    _check({"checkpoint.dir": str(saved), "train.seed": 3}, script, [])


def test_preflight_leaves_another_scripts_checkpoint_to_its_session(saved, tmp_path):
    # The launcher cannot tell whether evaluate.py resumes at all; its Session refuses if it does.
    train, evaluate = tmp_path / "train.py", tmp_path / "evaluate.py"
    train.write_text("pass\n")
    evaluate.write_text("print('evaluating')\n")
    _as_launched(saved, Config.load(overrides=[f"checkpoint.dir={saved}"]), train, [])
    _check({"checkpoint.dir": str(saved), "train.seed": 3}, evaluate, [])


def test_preflight_passes_an_empty_or_old_directory(tmp_path, saved):
    _check({"checkpoint.dir": str(tmp_path / "none")}, Path("x.py"), [])
    where = files.latest(saved)
    manifest = json.loads((where / files.MANIFEST).read_text())
    del manifest["run"]
    (where / files.MANIFEST).write_text(json.dumps(manifest))
    _check({"checkpoint.dir": str(saved), "train.seed": 3}, Path("x.py"), [])


def test_the_session_takes_the_launchers_script_and_records_its_view(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    launched = run_identity.of_launch(Config.load(), "ddp", str(script), ["a"])
    context = LaunchContext.from_env(LaunchContext(run=launched).to_env())
    identity = RunIdentity.of_session(Config.load(), "ddp", context)
    assert identity.record["script"] == launched["script"] and identity.record["launch"] == launched
    assert identity.record["settings"] == launched["settings"]


def test_another_script_is_named_as_another_script(tmp_path):
    train, plan = tmp_path / "train.py", tmp_path / "plan.py"
    train.write_text("print(1)\n")
    plan.write_text("print(2)\n")
    saved = {"script": run_identity.script_identity(str(train), [])}
    now = {"script": run_identity.script_identity(str(plan), [])}
    assert run_identity.differences(saved, now) == ["script: train.py saved it, this run is plan.py"]


# -- the script's arguments, at setup -----------------------------------------------------------------


def _run_as(script: Path, args: list[str], monkeypatch, ckpt: Path, capsys, **sections) -> str:
    monkeypatch.setattr("sys.argv", [str(script), *args])
    return _resume(ckpt, capsys, **sections)


def test_the_session_compares_arguments_as_options_and_ignores_the_lengthening_ones(tmp_path, monkeypatch, capsys):
    script, ckpt = tmp_path / "train.py", tmp_path / "ck"
    script.write_text("pass\n")
    _run_as(script, ["--lr", "0.1", "--epochs", "1"], monkeypatch, ckpt, capsys, checkpoint={"save_every": 1})
    longer = ["--epochs=2", "-p", "5", "--resume", str(ckpt), "--lr", "0.1"]
    assert "resumed from" in _run_as(script, longer, monkeypatch, ckpt, capsys)
    with pytest.raises(PhalanxError) as err:
        _run_as(script, ["--lr", "0.2", "--epochs", "2"], monkeypatch, ckpt, capsys)
    assert "belongs to another run: script argument --lr 0.1 (checkpoint) vs --lr 0.2 (now);" in str(err.value)
    # checkpoint.ignore_args adds the script's own: here --lr, as if it only observed training.
    own = _run_as(script, ["--lr", "0.2"], monkeypatch, ckpt, capsys, checkpoint={"ignore_args": ["--lr"]})
    assert "resumed from" in own


def _in_default_directory(**checkpoint) -> tuple:
    torch.manual_seed(0)
    session = phalanx.Session(
        batch={"global_batch_size": 8}, train={"epochs": 1, "progress": False, "metrics": False}, checkpoint=checkpoint
    )
    model = nn.Linear(4, 1)
    loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=8)
    return session, *session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)


def _saved_by_train_py(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """train.py's checkpoint in the default directory of ``tmp_path``; (train.py, evaluate.py)."""
    train, evaluate = tmp_path / "train.py", tmp_path / "evaluate.py"
    train.write_text("print(1)\n")
    evaluate.write_text("print(2)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", [str(train)])
    session, model, _, loader = _in_default_directory()
    _train(session, model, loader)
    session.save()
    session.close()
    return train, evaluate


def test_another_scripts_checkpoint_in_the_default_directory_is_named_as_such(tmp_path, monkeypatch):
    _, evaluate = _saved_by_train_py(tmp_path, monkeypatch)
    monkeypatch.setattr("sys.argv", [str(evaluate)])
    with pytest.raises(PhalanxError) as err:
        _in_default_directory()
    line = str(err.value)
    assert "\n" not in line and line.startswith("the default checkpoint directory 'checkpoints' holds another script's")
    assert "script: train.py saved it, this run is evaluate.py" in line
    assert "give this run its own directory (checkpoint.dir)" in line and "checkpoint.resume: never" in line
    assert "to keep going from that checkpoint set checkpoint.resume_any_run: true" in line


def test_a_fresh_run_beside_another_scripts_checkpoints_in_the_default_directory_is_told(tmp_path, monkeypatch, capsys):
    train, evaluate = _saved_by_train_py(tmp_path, monkeypatch)
    capsys.readouterr()
    monkeypatch.setattr("sys.argv", [str(evaluate)])
    session, *_ = _in_default_directory(resume="never")
    session.close()
    out = capsys.readouterr().out
    assert "the default checkpoint directory 'checkpoints' holds another script's checkpoints (train.py" in out
    monkeypatch.setattr("sys.argv", [str(train)])  # the same script starting afresh: nothing to say
    session, *_ = _in_default_directory(resume="never")
    session.close()
    assert "another script's" not in capsys.readouterr().out
