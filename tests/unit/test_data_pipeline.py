"""The input pipeline: the data section's loader settings, the side-stream prefetcher's ordering
(on CPU with the stream operations replaced by a recorder), and how data wait is shown in the
progress bar and the run summary."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.config.loader import load_config
from phalanx.config.schema import DataConfig
from phalanx.errors import ConfigError
from phalanx.faults.lifeline import descendants
from phalanx.metrics.summary_display import DATA_WAIT_HINT, data_wait_hint, report_run
from phalanx.runtime.data import MAX_AUTO_WORKERS, auto_workers, shard_loader
from phalanx.runtime.progress import Throughput, _status, track
from phalanx.runtime.transfer import PlainTransfer, staged
from tests.helpers.loaders import CPU, numbered, sharded
from tests.helpers.processes import living


class Recorder:
    """A Transfer that logs when each batch's copy starts and when it is made ready for use."""

    def __init__(self, log: list):
        self.log = log

    def start(self, batch):
        self.log.append(("start", int(batch[0][0])))
        return batch

    def ready(self, handle):
        self.log.append(("ready", int(handle[0][0])))
        return handle


def first_ids(batches) -> list[int]:
    return [int(b[0][0]) for b in batches]


# -- config -------------------------------------------------------------------------------------
def test_auto_workers_share_the_cores_between_a_nodes_ranks():
    assert auto_workers(16, 2) == 7  # 8 cores per rank, one kept for the training loop
    assert auto_workers(64, 1) == MAX_AUTO_WORKERS
    assert auto_workers(2, 2) == 0 and auto_workers(1, 4) == 0  # a core or less: load in the main process
    assert auto_workers(2, 1) == 1


def test_worker_options_are_validated_with_the_fix():
    assert load_config(overrides=["data.num_workers=auto"]).data.num_workers == "auto"
    with pytest.raises(ConfigError, match=r"'data.num_workers'.*whole number >= 0, auto, or null"):
        load_config(overrides=["data.num_workers=-1"])
    with pytest.raises(
        ConfigError,
        match=r"'data.prefetch_factor'.*num_workers is 0; raise data.num_workers or set data.prefetch_factor to null",
    ):
        load_config(overrides=["data.num_workers=0", "data.prefetch_factor=4"])
    with pytest.raises(ConfigError, match=r"'data.persistent_workers'.*num_workers is 0"):
        load_config(overrides=["data.num_workers=0", "data.persistent_workers=true"])
    assert (
        load_config(overrides=["data.num_workers=0", "data.persistent_workers=false"]).data.persistent_workers is False
    )


def test_loader_settings_reach_the_rebuilt_dataloader(monkeypatch):
    plain = sharded()
    assert plain.loader.num_workers == 0 and not plain.loader.pin_memory  # the DataLoader's own; no pinning on CPU
    assert plain.loader.prefetch_factor is None and not plain.loader.persistent_workers
    assert sharded(prefetch_factor=6).loader.prefetch_factor is None  # no workers: nothing to apply it to

    with_workers = sharded(workers=2)
    assert (
        with_workers.loader.persistent_workers and with_workers.loader.prefetch_factor == 2
    )  # phalanx's and torch's defaults
    chosen = sharded(workers=2, num_workers=1, persistent_workers=False, prefetch_factor=5, pin_memory=True)
    assert (
        chosen.loader.num_workers == 1 and not chosen.loader.persistent_workers and chosen.loader.prefetch_factor == 5
    )
    assert chosen.loader.pin_memory and chosen.non_blocking
    assert sharded(workers=2, num_workers=0).loader.num_workers == 0

    monkeypatch.setattr("phalanx.runtime.data.cpu_count", lambda: 10)
    loader = DataLoader(numbered(), batch_size=4, shuffle=True)
    auto = shard_loader(
        loader,
        train=True,
        rank=0,
        world_size=1,
        batch_size=4,
        multiple_of=4,
        seed=0,
        device=CPU,
        options=DataConfig(num_workers="auto"),
        procs_per_node=3,
    )
    assert auto.loader.num_workers == 2 and auto.loader.persistent_workers


def test_session_passes_the_data_section_and_the_node_size(monkeypatch):
    monkeypatch.setattr("phalanx.runtime.data.cpu_count", lambda: 10)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # what torchrun tells a rank about its node
    session = phalanx.Session(data={"num_workers": "auto", "pin_memory": False}, train={"progress": False})
    assert session.topology.local_world_size == 3
    loader = session.setup(DataLoader(numbered(), batch_size=4, shuffle=True))
    assert loader.loader.num_workers == 2  # 10 cores / 3 ranks, 1 kept for each rank's loop
    session.close()


def test_iterable_datasets_are_used_as_built():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(6))

    loader = DataLoader(Stream(), batch_size=2)
    wrapped = shard_loader(
        loader,
        train=True,
        rank=0,
        world_size=1,
        batch_size=2,
        multiple_of=2,
        seed=0,
        device=CPU,
        options=DataConfig(num_workers=4),
    )
    assert wrapped.loader is loader and not wrapped.non_blocking
    assert [b.tolist() for b in wrapped] == [[0, 1], [2, 3], [4, 5]]


# -- prefetch ordering, with the stream operations abstracted ---------------------------------------
def test_staged_without_ahead_copies_each_batch_when_asked():
    log: list = []
    for handle in staged(iter([(torch.tensor([i]),) for i in range(3)]), Recorder(log), ahead=False):
        log.append(("use", int(handle[0][0])))
    assert log == [("start", 0), ("use", 0), ("start", 1), ("use", 1), ("start", 2), ("use", 2)]


def test_staged_ahead_starts_the_next_copy_before_handing_out_the_current_batch():
    log: list = []

    def source():
        for i in range(3):
            log.append(("fetch", i))
            yield (torch.tensor([i]),)

    got = []
    for handle in staged(source(), Recorder(log), ahead=True):
        log.append(("use", int(handle[0][0])))
        got.append(int(handle[0][0]))
    assert got == [0, 1, 2]
    assert log == [
        ("fetch", 0), ("start", 0), ("fetch", 1), ("start", 1), ("use", 0),
        ("fetch", 2), ("start", 2), ("use", 1),
        ("use", 2),
    ]  # fmt: skip
    assert list(staged(iter([]), Recorder([]), ahead=True)) == []


def test_staged_hands_a_cpu_batch_through_untouched():
    batches = iter([(torch.tensor([0]),)])
    assert staged(batches, PlainTransfer(CPU, non_blocking=False), ahead=False) is batches


def test_cpu_loader_copies_in_line_as_before():
    loader = sharded(workers=2)
    assert isinstance(loader.transfer, PlainTransfer) and not loader.fetch_ahead
    assert not sharded(device=torch.device("meta"), prefetch_to_device=True).fetch_ahead  # only CUDA has side streams


def ahead(loader):
    """The CUDA prefetcher's ordering on CPU: fetch ahead, with a recording transfer."""
    log: list = []
    loader.transfer, loader.fetch_ahead = Recorder(log), True
    return loader, log


def test_fetch_ahead_keeps_order_positions_and_callbacks():
    seen = {}
    for name, loader in (("plain", sharded()), ("ahead", ahead(sharded())[0])):
        events, waits = [], []
        loader.on_wait = waits.append
        loader.on_batch = lambda dl: events.append(("on_batch", dl.position))  # before the batch is counted
        for epoch in range(2):
            loader.set_epoch(epoch)
            for batch in loader:
                events.append((int(batch[0][0]), loader.position))
        assert len(waits) == 20
        seen[name] = events
    assert seen["ahead"] == seen["plain"]
    positions = [pos for what, pos in seen["ahead"] if what != "on_batch"]
    assert positions == [4 * i for i in range(1, 11)] * 2


def test_each_batch_is_made_ready_just_before_it_is_handed_out():
    loader, log = ahead(sharded())
    order = []
    for batch in loader:
        assert log[-1] == ("ready", int(batch[0][0]))
        order.append(int(batch[0][0]))
    starts = [i for kind, i in log if kind == "start"]
    readies = [i for kind, i in log if kind == "ready"]
    assert starts == readies == order
    # The next batch's copy was already under way when each batch was handed out.
    assert all(log.index(("start", order[k + 1])) < log.index(("ready", order[k])) for k in range(len(order) - 1))


def test_break_and_resume_count_batches_handed_out_not_fetched():
    full = first_ids(sharded())
    loader, log = ahead(sharded())
    taken = []
    for batch in loader:
        taken.append(int(batch[0][0]))
        if len(taken) == 3:
            break
    assert len([1 for kind, _ in log if kind == "start"]) == 4  # one batch fetched beyond the user
    assert loader.position == 3 * 4
    resumed, _ = ahead(sharded())
    resumed.resume_at(0, loader.position)
    assert taken + first_ids(resumed) == full
    assert resumed.position == 40


def test_worker_loader_with_fetch_ahead_matches_the_in_process_loader_over_epochs():
    plain = sharded()
    fast, _ = ahead(sharded(workers=2))
    assert fast.loader.persistent_workers
    for epoch in range(2):
        plain.set_epoch(epoch)
        fast.set_epoch(epoch)
        a, b = list(plain), list(fast)
        assert len(a) == len(b) == 10
        assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))
        assert fast.position == plain.position == 40


def run(
    tmp_path,
    name: str,
    *,
    stop_at: int | None = None,
    workers: int = 0,
    persistent: bool | None = None,
    fetch_ahead: bool = False,
    **checkpoint,
) -> dict:
    torch.manual_seed(0)
    session = phalanx.Session(
        batch={"global_batch_size": 8},
        data={"num_workers": workers, "persistent_workers": persistent},
        train={"epochs": 2, "progress": False},
        checkpoint={"dir": str(tmp_path / name), "resume": "never", **checkpoint},
    )
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(40, 4, generator=g), torch.randn(40, 1, generator=g))
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.2), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer, loader = session.setup(model, optimizer, DataLoader(data, batch_size=8, shuffle=True))
    assert loader.loader.persistent_workers == (workers > 0 and persistent is not False)
    if fetch_ahead:
        loader.fetch_ahead = True
    for _ in session.epochs():
        for x, y in session.progress(loader):
            with session.accumulate(model):
                session.backward(nn.functional.mse_loss(model(x), y))
            if session.step_count == stop_at:
                session.close()
                return {}
    session.close()
    return {k: v.clone() for k, v in session.model_state_dict().items()}


def test_worker_settings_do_not_change_training(tmp_path):
    # Dropout draws from the same generator the DataLoader seeds its workers from, at every pass.
    reference = run(tmp_path, "plain")
    assert_same(run(tmp_path, "persistent", workers=2), reference)
    assert_same(run(tmp_path, "respawned", workers=1, persistent=False, fetch_ahead=True), reference)


def test_close_ends_the_persistent_workers_of_a_loop_left_early(tmp_path):
    # Left to garbage collection, two workers' shutdown stalled whatever ran next by 10 s.
    before = set(descendants(os.getpid()))
    assert run(tmp_path, "left", stop_at=3, workers=2, persistent=True) == {}
    assert [pid for pid in set(descendants(os.getpid())) - before if living(pid)] == []


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_resume_with_persistent_workers_and_fetch_ahead_is_exact(tmp_path):
    reference = run(tmp_path, "plain")
    assert run(tmp_path, "stopped", stop_at=7, workers=2, fetch_ahead=True, save_every=3) == {}  # last save at step 6
    resumed = run(tmp_path, "stopped", workers=2, fetch_ahead=True, save_every=3, resume="auto")
    assert_same(resumed, reference)


# -- data wait, shown --------------------------------------------------------------------------------
def test_status_line_shows_the_data_share():
    assert _status(0.5, 1234.4) == "loss 0.5000  1,234 samples/s"
    assert _status(None, 10, 0.123) == "10 samples/s  data 12%"
    assert _status(1.0, 10, 0.0) == "loss 1.0000  10 samples/s  data 0%"


def test_data_share_leaves_the_first_batch_out():
    meter = Throughput()
    meter.waited(30.0)  # worker start-up
    assert meter.data_share is None
    meter.waited(1.0)
    meter.waited(1.0)
    meter.stop()
    meter.first_batch = meter.end - 8.0
    assert meter.data_share == pytest.approx(0.25)


def test_track_times_each_batch_it_waits_for():
    meter = Throughput()
    out = list(
        track(iter(range(5)), total=5, samples_per_batch=2, description="x", show=False, loss=lambda: None, meter=meter)
    )
    assert out == list(range(5)) and meter.samples == 10 and meter.batches == 5
    assert meter.data_share is not None and 0 <= meter.data_share <= 1


def summary_with(*shares: float) -> dict:
    return {"world_size": len(shares), "ranks": [{"rank": r, "data_wait_share": s} for r, s in enumerate(shares)]}


def test_data_wait_hint_only_when_the_pipeline_holds_training_back():
    assert data_wait_hint(summary_with(DATA_WAIT_HINT)) is None
    assert data_wait_hint(summary_with(0.02, 0.05)) is None
    one = data_wait_hint(summary_with(0.23))
    assert one == (
        "phalanx: the input pipeline holds training back: the run spent 23% of its step time waiting for data; "
        "raise data.num_workers or run `phalanx tune`"
    )
    assert "rank 1 spent 40%" in data_wait_hint(summary_with(0.05, 0.4, 0.12))


def test_run_summary_prints_the_hint(tmp_path, capsys):
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    for rank, wait in ((0, 0.01), (1, 0.03)):
        rows = [
            {"rank": rank, "step": s, "epoch": 0, "time": 1e9 + s, "step_time": 0.1, "data_wait": wait,
             "sync_time": 0.05, "samples": 64, "samples_per_s": 640.0, "loss": 1.0, "lr": 0.1, "grad_norm": None,
             "peak_mem_bytes": None}
            for s in range(1, 11)
        ]  # fmt: skip
        (metrics / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = report_run(tmp_path)
    out = capsys.readouterr().out
    assert summary["ranks"][1]["data_wait_share"] == pytest.approx(0.3)
    assert "the input pipeline holds training back: rank 1 spent 30%" in out
