"""The layout of a global batch (docs/data.md): which samples of it each rank and micro-step gets
from a training loader (ordered or shuffled), an iterable dataset and ``session.shard``; and the
layout lock, which refuses config values, bench weak scaling and tune changes of the batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import phalanx
from phalanx.bench import runner as bench_runner
from phalanx.config.batch import BatchPlan, plan_batch
from phalanx.config.schema import Config, DataConfig
from phalanx.errors import ConfigError, PhalanxError
from phalanx.harness.figures import RunFigures
from phalanx.runtime.data import ShardedSampler, shard_loader
from phalanx.runtime.shares import StreamShare, shard_tensors
from phalanx.session.facts import read_run_facts, write_run_facts
from phalanx.topology import ENV_CONTEXT
from phalanx.tune import runner as tune_runner
from phalanx.tune.trials import OK, Announced, Trial

CPU = torch.device("cpu")


def _micro_batches(loader: DataLoader, rank: int, world: int, micro: int, accumulation: int) -> list[list[int]]:
    wrapped = shard_loader(
        loader,
        train=True,
        rank=rank,
        world_size=world,
        batch_size=micro,
        multiple_of=micro * accumulation * world,
        seed=0,
        device=CPU,
        options=DataConfig(),
    )
    return [(b[0] if isinstance(b, list) else b).tolist() for b in wrapped]


def _contract(step: int, rank: int, m: int, world: int, micro: int, accumulation: int) -> list[int]:
    """Global batch ``step``, micro-step ``m``: its block of world*micro positions, rank's share of it."""
    g = micro * accumulation * world
    start = step * g + (m * world + rank) * micro
    return list(range(start, start + micro))


# -- ordered training loaders --------------------------------------------------------------------------
@pytest.mark.parametrize("world, micro, accumulation", [(1, 8, 1), (1, 4, 2), (2, 4, 1), (2, 2, 2), (4, 1, 2)])
def test_an_ordered_training_loader_gives_each_rank_and_micro_step_its_share_of_the_micro_step_block(
    world, micro, accumulation
):
    data = TensorDataset(torch.arange(32))
    for rank in range(world):
        got = _micro_batches(DataLoader(data, batch_size=8), rank, world, micro, accumulation)
        steps = 32 // (micro * accumulation * world)
        want = [_contract(b, rank, m, world, micro, accumulation) for b in range(steps) for m in range(accumulation)]
        assert got == want, (rank, got)


def test_an_ordered_order_is_padded_and_resumed_by_whole_global_batches():
    # 20 samples, global batch 8 over 2 ranks: the third global batch is 16..19 then 0..3.
    ranks = [list(ShardedSampler(20, r, 2, shuffle=False, seed=0, multiple_of=8, chunk=4)) for r in range(2)]
    assert ranks == [[0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19], [4, 5, 6, 7, 12, 13, 14, 15, 0, 1, 2, 3]]
    resumed = ShardedSampler(20, 1, 2, shuffle=False, seed=0, multiple_of=8, chunk=4)
    resumed.start = 8  # one global batch done
    assert len(resumed) == 8 and list(resumed) == ranks[1][4:]


def test_shuffled_training_deals_micro_batches_and_evaluation_positions_one_by_one():
    # Micro batch 2 of global batch 8 over 2 ranks: rank 1 takes positions 2-3, 6-7, 10-11, ...
    shuffled = ShardedSampler(24, 1, 2, shuffle=True, seed=3, multiple_of=8, chunk=2)
    assert list(shuffled) == shuffled.global_order().view(-1, 2, 2)[:, 1].flatten().tolist()
    data = TensorDataset(torch.arange(10))
    evaluation = shard_loader(
        DataLoader(data, batch_size=2),
        train=False,
        rank=1,
        world_size=2,
        batch_size=2,
        multiple_of=2,
        seed=0,
        device=CPU,
        options=DataConfig(),
    )
    assert [b[0].tolist() for b in evaluation] == [[1, 3], [5, 7], [9]]


# -- iterable datasets -----------------------------------------------------------------------------------
class Numbers(IterableDataset):
    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self):
        return self.n


@pytest.mark.parametrize("world, micro, accumulation", [(1, 4, 2), (2, 4, 1), (2, 2, 2)])
def test_an_iterable_training_loader_is_cut_into_global_batches_and_shared_out(world, micro, accumulation):
    # The user's batches of 3 are re-cut into global batches of 8; of 19 samples, 16, 17, 18 are dropped.
    for rank in range(world):
        got = _micro_batches(DataLoader(Numbers(19), batch_size=3), rank, world, micro, accumulation)
        want = [_contract(b, rank, m, world, micro, accumulation) for b in range(2) for m in range(accumulation)]
        assert got == want


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_stream_share_drops_a_short_last_global_batch_and_knows_its_length(drop_last):
    share = StreamShare(0, 2, 8, 2, drop_last=drop_last)
    said: list[str] = []
    share.say = said.append
    got = list(share.micro_batches(torch.arange(i, min(i + 5, 19)) for i in range(0, 19, 5)))
    assert [b.tolist() for b in got] == [[0, 1], [4, 5], [8, 9], [12, 13]] and share.length(19) == 4
    message = (
        "phalanx: dropping 2 micro-step(s) that did not complete a global batch at the end of the epoch "
        "(the last 3 samples of the stream)"
    )
    assert said == ([] if drop_last else [message])


def test_a_stream_share_cuts_dicts_named_tuples_and_lists_of_values():
    batches = [{"x": torch.arange(i, i + 3), "name": [f"s{j}" for j in range(i, i + 3)]} for i in (0, 3)]
    got = list(StreamShare(1, 2, 4, 2, drop_last=False).micro_batches(batches))
    # Rows 0..3 make the global batch, rank 1's share is 2, 3; rows 4, 5 do not complete another.
    assert [(b["x"].tolist(), b["name"]) for b in got] == [([2, 3], ["s2", "s3"])]


def test_an_iterable_evaluation_loader_is_used_as_built():
    loader = DataLoader(Numbers(5), batch_size=2)
    wrapped = shard_loader(
        loader, train=False, rank=1, world_size=2, batch_size=2, multiple_of=2, seed=0, device=CPU, options=DataConfig()
    )
    assert wrapped.stream is None and [b.tolist() for b in wrapped] == [[0, 1], [2, 3], [4]]


# -- tensors already in memory -----------------------------------------------------------------------------
def test_shard_takes_each_rank_s_share_of_every_global_batch():
    plan = plan_batch(2, 8, 2)  # 2 accumulation steps
    x = torch.arange(32)
    mine = shard_tensors([x, x * 10], dim=0, rank=1, world_size=2, plan=plan, micro_steps=False)
    # Micro-step 0 of each global batch of 8 is its first 4 positions, rank 1 taking 2, 3; micro-step 1: 6, 7.
    assert mine[0].tolist() == [2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31]
    assert torch.equal(mine[1], mine[0] * 10)
    # Without a plan the whole tensor is one block.
    assert shard_tensors([x], dim=0, rank=0, world_size=4, plan=None, micro_steps=False).tolist() == list(range(8))


def test_shard_of_a_stream_gives_one_piece_per_micro_step():
    plan = plan_batch(2, 8, 2)
    columns = torch.arange(24).view(3, 8)  # [time, global batch]
    pieces = shard_tensors([columns], dim=1, rank=1, world_size=2, plan=plan, micro_steps=True)
    assert [p.tolist() for p in pieces] == [[[2, 3], [10, 11], [18, 19]], [[6, 7], [14, 15], [22, 23]]]
    pairs = shard_tensors([columns, -columns], dim=-1, rank=0, world_size=2, plan=plan, micro_steps=True)
    assert len(pairs) == 2 and torch.equal(pairs[1][1], -pairs[1][0]) and pairs[1][0][0].tolist() == [4, 5]


@pytest.mark.parametrize(
    "tensor, dim, plan, micro_steps, message",
    [
        (
            torch.arange(20),
            0,
            BatchPlan(8, 4, 1, 2),
            False,
            "not a whole number of global batches of 8; drop the last 4",
        ),
        (torch.arange(7), 0, None, False, "which 2 processes cannot share equally"),
        (torch.zeros(3, 16), 1, BatchPlan(8, 4, 1, 2), True, "has 16 entries but the global batch is 8"),
        (torch.zeros(3), 1, None, False, "dim 1 is out of range"),
        ([1, 2], 0, None, False, "takes tensors; argument 1 is a list"),
    ],
)
def test_shard_refuses_what_it_cannot_split_in_one_line(tensor, dim, plan, micro_steps, message):
    with pytest.raises(PhalanxError, match=message) as err:
        shard_tensors([tensor], dim=dim, rank=0, world_size=2, plan=plan, micro_steps=micro_steps)
    assert "\n" not in str(err.value)


def test_session_shard_uses_the_session_s_plan():
    session = phalanx.Session(
        Config(), batch={"global_batch_size": 4, "micro_batch_size": 2}, train={"progress": False}
    )
    pieces = session.shard(torch.arange(8).view(2, 4), dim=1, micro_steps=True)
    assert [p.tolist() for p in pieces] == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert session.shard(torch.arange(8)).tolist() == list(range(8))
    session.close()


# -- the layout lock -------------------------------------------------------------------------------------------
def _session(monkeypatch, tmp_path, *, file: str | None = None, sets: tuple[str, ...] = (), **sections):
    monkeypatch.chdir(tmp_path)
    if file is not None:
        (tmp_path / "phalanx.yaml").write_text(file)
    if sets:
        monkeypatch.setenv(ENV_CONTEXT, json.dumps({"overrides": list(sets)}))
    return phalanx.Session(train={"progress": False}, **sections)


def _loader(batch_size: int = 20) -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(40.0)), batch_size=batch_size)


def test_a_file_s_global_batch_is_refused_against_a_fixed_loader(monkeypatch, tmp_path):
    session = _session(monkeypatch, tmp_path, file="batch:\n  global_batch_size: 40\n")
    with pytest.raises(ConfigError) as err:
        session.setup_loader(_loader(20), train=True, fixed_layout=True)
    text = str(err.value)
    assert text.startswith("batch.global_batch_size 40 (from file phalanx.yaml) would change the batch layout")
    assert "setup_loader(..., fixed_layout=True)" in text and "global batch 20" in text and "\n" not in text
    session.close()


def test_a_set_global_batch_is_refused_against_the_script_s_own(monkeypatch, tmp_path):
    sets = ("batch.global_batch_size=40",)
    with pytest.raises(
        ConfigError, match=r"batch.global_batch_size 40 \(from --set\) would change .*batch.fixed_layout"
    ):
        _session(monkeypatch, tmp_path, sets=sets, batch={"global_batch_size": 20, "fixed_layout": True})


def test_a_micro_batch_that_changes_the_layout_is_refused(monkeypatch, tmp_path):
    sets = ("batch.micro_batch_size=10",)
    with pytest.raises(ConfigError, match=r"batch.micro_batch_size 10 \(from --set\).*micro batches of 10.*of 20;"):
        _session(monkeypatch, tmp_path, sets=sets, batch={"global_batch_size": 20, "fixed_layout": True})
    # Against a loader's batch_size too, once the loader says what the script's global batch is.
    session = _session(monkeypatch, tmp_path, sets=("batch.max_micro_batch_size=5",), batch={"fixed_layout": True})
    with pytest.raises(ConfigError, match=r"batch.max_micro_batch_size 5 \(from --set\)"):
        session.setup_loader(_loader(), train=True)
    session.close()


def test_values_that_leave_the_layout_as_it_is_pass(monkeypatch, tmp_path):
    # What tune passes to every trial: the sizes the script itself gives.
    sets = ("batch.global_batch_size=20", "batch.micro_batch_size=20")
    session = _session(monkeypatch, tmp_path, sets=sets, batch={"fixed_layout": True})
    loader = session.setup_loader(_loader(20), train=True)
    assert session.batch == BatchPlan(20, 20, 1, 1) and len(loader) == 2 and session._batch.fixed_layout
    session.close()


def test_without_the_lock_the_config_changes_the_batch_as_before(monkeypatch, tmp_path):
    session = _session(monkeypatch, tmp_path, file="batch:\n  global_batch_size: 40\n")
    session.setup_loader(_loader(20), train=True)
    assert session.batch.global_batch_size == 40 and not session._batch.fixed_layout
    session.close()


def test_set_can_lift_a_lock_set_in_code(monkeypatch, tmp_path):
    sets = ("batch.fixed_layout=false", "batch.global_batch_size=40")
    session = _session(monkeypatch, tmp_path, sets=sets, batch={"global_batch_size": 20, "fixed_layout": True})
    assert session.batch.global_batch_size == 40
    session.close()


def test_only_a_training_loader_can_fix_its_layout(monkeypatch, tmp_path):
    session = _session(monkeypatch, tmp_path)
    with pytest.raises(PhalanxError, match=r"fixed_layout=True\) is for a training loader"):
        session.setup_loader(_loader(), train=False, fixed_layout=True)
    session.close()


def test_session_json_carries_the_lock(tmp_path):
    write_run_facts(
        tmp_path,
        strategy="single",
        strategy_description="single",
        device="cpu",
        precision="fp32",
        batch=BatchPlan(20, 10, 2, 1),
        models=[],
        lr_scaling=None,
        config_sources={},
        fixed_layout=True,
    )
    assert read_run_facts(tmp_path).fixed_layout
    document = json.loads((tmp_path / "session.json").read_text())
    del document["batch"]["fixed_layout"]  # a file from before the lock
    (tmp_path / "session.json").write_text(json.dumps(document))
    assert not read_run_facts(tmp_path).fixed_layout


def test_the_session_announces_the_lock(monkeypatch, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setenv(ENV_CONTEXT, json.dumps({"run_dir": str(run_dir)}))
    session = phalanx.Session(Config(), train={"progress": False})
    model = torch.nn.Linear(1, 1)
    session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    session.setup_loader(_loader(), train=True, fixed_layout=True)
    assert read_run_facts(run_dir).fixed_layout
    assert "(layout fixed)" in capsys.readouterr().out
    session.close()


# -- bench and tune ------------------------------------------------------------------------------------------------
def _fake_bench_run(tmp_path: Path, calls: list, fixed: bool):
    def run_one(options, script, script_args, cap, n, overrides, parent, name, threads, *rest):
        calls.append((n, overrides))
        run_dir = parent / "run"
        (run_dir / "metrics").mkdir(parents=True)
        batch = next((int(o.split("=")[1]) for o in overrides if o.startswith("batch.global_batch_size=")), 16)
        for rank in range(n):
            lines = [
                {"rank": rank, "step": s, "step_time": 0.1, "data_wait": 0.0, "samples": batch} for s in range(1, 6)
            ]
            (run_dir / "metrics" / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        write_run_facts(
            run_dir,
            strategy="ddp",
            strategy_description="ddp",
            device="cpu",
            precision="fp32",
            batch=BatchPlan(batch, batch // n, 1, n),
            models=[],
            lr_scaling=None,
            config_sources={},
            fixed_layout=fixed,
        )
        return run_dir, 1.0

    return run_one


@pytest.mark.parametrize("fixed", [True, False])
def test_bench_keeps_the_global_batch_of_a_fixed_layout(fixed, tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text("pass\n")
    monkeypatch.chdir(tmp_path)
    calls: list = []
    monkeypatch.setattr(bench_runner, "_run_one", _fake_bench_run(tmp_path, calls, fixed))
    monkeypatch.setattr(bench_runner, "have_matplotlib", lambda: False)
    said: list[str] = []
    options = bench_runner.BenchOptions(script="train.py", nproc_list="1,2", steps=5, warmup=1, cpu=True)
    result = bench_runner.run_bench(options, say=said.append)
    weak = [o for o in calls[1][1] if o.startswith("batch.global_batch_size=")]
    document = json.loads((result.directory / "bench.json").read_text())
    if fixed:
        assert weak == [] and any("keeps its global batch (strong scaling)" in line for line in said)
        assert document["settings"]["scaling"].startswith("strong")
        assert result.rows[1].compute == pytest.approx(0.05)  # half the 1-process compute per process
    else:
        assert weak == ["batch.global_batch_size=32"] and document["settings"]["scaling"].startswith("weak")


def _tuner(tmp_path, monkeypatch, fixed: bool, **options) -> tuple[tune_runner._Tuner, list]:
    (tmp_path / "train.py").write_text("pass\n")
    monkeypatch.chdir(tmp_path)
    trials: list = []

    def trial(self, stage, settings, label, *, again=False):
        number = len(trials) + 1
        figures = RunFigures(2, 16, 4, 100.0, 0.16, 0.0, None)
        made = Trial(number, stage, settings or tune_runner.Settings(0, 0), label, outcome=OK, figures=figures)
        trials.append(made)
        return made

    monkeypatch.setattr(tune_runner._Tuner, "trial", trial)
    monkeypatch.setattr(tune_runner, "announced", lambda run_dir: Announced(16, 4, 2, 0.01, fixed))
    opts = tune_runner.TuneOptions(script="train.py", cpu=True, nproc=2, steps=4, warmup=1, dry_run=True, **options)
    return tune_runner._Tuner(opts, lambda line: None), trials


def test_tune_keeps_a_fixed_layout_and_says_so(tmp_path, monkeypatch):
    tuner, trials = _tuner(tmp_path, monkeypatch, True, search=("micro-batch",))
    result = tuner.run()
    (stage,) = result.stages
    assert stage.summary.startswith("micro-batch: kept micro-batch 4 x 2 accumulation steps x 2 processes = global 16")
    assert "fixes its batch layout" in stage.summary and "\n" not in stage.summary
    assert result.values == {} and len(trials) == 1  # only the start trial ran


def test_tune_searches_micro_batches_without_the_lock(tmp_path, monkeypatch):
    tuner, trials = _tuner(tmp_path, monkeypatch, False, search=("micro-batch",))
    result = tuner.run()
    assert len(trials) > 1 and "fixes its batch layout" not in result.stages[0].summary


def test_tune_refuses_allow_global_batch_with_a_fixed_layout(tmp_path, monkeypatch):
    tuner, trials = _tuner(tmp_path, monkeypatch, True, allow_global_batch=True)
    with pytest.raises(PhalanxError, match=r"^--allow-global-batch: the script fixes its batch layout"):
        tuner.run()
    with pytest.raises(PhalanxError, match=r"^--allow-global-batch: batch.fixed_layout is true in the config"):
        _tuner(tmp_path, monkeypatch, False, allow_global_batch=True, overrides=("batch.fixed_layout=true",))
