"""One record per optimizer step, kept by the Session: JSONL in ``<run dir>/metrics/rank<N>.jsonl``,
TensorBoard scalars on rank 0, the profiler window and the FLOPs count for MFU.

Loss and gradient norm stay tensors until a flush (every 500 steps or once a second, whichever
comes first), so recording never makes the host wait for the device in the middle of a step; the
flush hands the records to a thread that reads them all at once and writes the rows (rows.py).

On CUDA the host's times mix a rank's own work with its wait for the others (a collective returns to
the host at once; the host waits later, in a device sync), so each step also records two CUDA events,
where the step starts and where its synchronising part starts, and the row gets the device's time
between them (``device_work``): a wait for a peer's collective lies before the first in stream order.
"""

from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from phalanx.config.schema import Config
from phalanx.errors import ConfigError
from phalanx.metrics.board import Board
from phalanx.metrics.flops import count_on_first_forward, peak_flops_per_s
from phalanx.metrics.profile import ProfileWindow, StepProfiler
from phalanx.metrics.rows import NOISE, RowWriter
from phalanx.metrics.summary import FLOPS_FILE, summarize
from phalanx.topology import Topology

_FLUSH_S = 1.0
# A flush hands its records to the metrics thread, and the hand-over itself cost the training thread
# about 0.7 ms a flush on 2 busy cores (measured with nothing to write): once a second, or per 500
# steps where steps are fast, keeps it near 0.1% of a run of 1 ms steps, where every 50 steps cost 1.4%.
_FLUSH_STEPS = 500
_KEPT = 10_000  # records kept in memory (``records``), the most recent ones


class StepRecorder:
    def __init__(
        self,
        topology: Topology,
        *,
        enabled: bool = True,
        out_dir: Path | None = None,
        board: Board | None = None,
        profiler: StepProfiler | None = None,
        peak_flops_per_s: float | None = None,
        summary_at_close: bool = False,
        devices: Sequence[torch.device] | None = None,
        make_event: Callable[[], Any] | None = None,
    ):
        self.rank = topology.rank
        self.device = topology.device
        # Every device the strategy computes on (dp, model_parallel: several GPUs in one process).
        self.devices = list(devices or [topology.device])
        self._on_cuda = self.device.type == "cuda"
        self.enabled = enabled
        self._records: deque[dict[str, Any]] = deque(maxlen=_KEPT)
        self.flops_per_sample: float | None = None
        self.peak_flops_per_s = peak_flops_per_s
        self._out_dir = out_dir
        self._file = None
        if enabled and out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(out_dir / f"rank{self.rank}.jsonl", "a", encoding="utf-8")  # a restarted rank appends
        self._board = board
        self._rows = RowWriter(self._records, self._file, board, self.device)
        self._profiler = profiler
        self._summary_at_close = summary_at_close
        self._pending: list[tuple] = []
        self._created = self._flushed = time.perf_counter()
        self._step_start: float | None = None
        self._sync_start: float | None = None
        # Two events a step on CUDA only (a few microseconds of the training thread); read at the flush.
        self._make_event = (make_event or (_timing_event if self._on_cuda else None)) if enabled else None
        self._start_event: Any = None
        self._sync_event: Any = None
        self._wait = 0.0
        self._grad_norm: torch.Tensor | None = None
        # The noise scale once the first n estimates were in, asked at the flush (session/noise.py
        # keeps its estimates on the device until then); a record notes n, set by the Session.
        self.noise_scale: Callable[[int], float | None] | None = None
        self.noise_taken = 0
        # What else waits for the flush to read the device (session/items.py's checks), also
        # without train.metrics.
        self.at_flush: list[Callable[[], None]] = []
        self.noise_estimated = False  # this step estimated it (its time includes the estimate's)
        self.last_times: tuple[float, float] | None = None  # the last step's time and its synchronising part
        self._last_step = 0
        self._watching = False
        self._closed = False
        # Set by the Session under train.memory_cap on CPU: peak resident growth since it started.
        self.cpu_peak: Callable[[], int | None] | None = None

    @property
    def records(self) -> deque[dict[str, Any]]:
        """The most recent step records (up to 10,000), every flushed one in."""
        self._rows.drain()
        return self._records

    # -- fed by the Session and its loaders --------------------------------------------------
    def add_wait(self, seconds: float) -> None:
        """Time a training loader spent producing the next batch."""
        if self._step_start is None:  # the first batch was requested `seconds` ago
            self._step_start = time.perf_counter() - seconds
            if self._make_event is not None:
                self._start_event = self._event()
            if self._profiler is not None:
                self._profiler.step_end(0)
        self._wait += seconds

    def sync_started(self) -> None:
        """The step's synchronising part begins: backward of its last micro-batch."""
        if self._sync_start is None:
            self._sync_start = time.perf_counter()
            if self._make_event is not None:
                self._sync_event = self._event()

    def note_grad_norm(self, norm: torch.Tensor | None) -> None:
        if self._grad_norm is None:
            self._grad_norm = norm

    def watch_model(self, model: nn.Module, local: nn.Module) -> None:
        """Count FLOPs per sample on the model's first forward, where MFU can be shown."""
        if self.peak_flops_per_s is None:
            return
        if self._watching:  # several models: whose FLOPs would MFU divide by?
            self.peak_flops_per_s = None
            return
        self._watching = True
        count_on_first_forward(model, local, self._set_flops)

    def record(
        self, stepped: bool, step: int, epoch: int, samples: int | None, loss: torch.Tensor | None, lr: Any
    ) -> None:
        """At the end of every optimizer step. One the fp16 GradScaler skipped (``stepped`` False)
        makes no record; its time and data wait count in the next one."""
        now = time.perf_counter()
        sync_start, self._sync_start = self._sync_start, None
        sync_event, self._sync_event = self._sync_event, None
        grad_norm, self._grad_norm = self._grad_norm, None
        if not stepped:
            return
        step_time = now - (self._step_start if self._step_start is not None else self._created)
        self.last_times = (step_time, now - sync_start if sync_start is not None else 0.0)
        if self.enabled:
            # A tuple in rows.FIELDS' order: the dict, and reading the tensors, wait for the flush.
            self._pending.append(
                (
                    self.rank,
                    step,
                    epoch,
                    time.time(),
                    step_time,
                    self._wait,
                    now - sync_start if sync_start is not None else 0.0,
                    (self._start_event, sync_event) if sync_event is not None else None,  # read at the flush
                    samples,
                    samples / step_time if samples and step_time > 0 else None,
                    loss,
                    lr,
                    grad_norm,
                    self.noise_taken,  # the estimates in so far: its value is found at the flush
                    self.noise_estimated,
                    self.peak_memory() if self._on_cuda or self.cpu_peak is not None else None,
                )
            )
        if len(self._pending) >= _FLUSH_STEPS or now - self._flushed >= _FLUSH_S:
            self.flush()
        self._step_start, self._wait = now, 0.0
        if self._make_event is not None:
            self._start_event = self._event()
        self._last_step = step
        if self._profiler is not None and self._profiler.step_end(step):
            self._step_start = time.perf_counter()  # saving the trace is no part of the next step
            if self._make_event is not None:
                self._start_event = self._event()

    # -- out ------------------------------------------------------------------------------------
    def flush(self) -> None:
        self._flushed = time.perf_counter()
        for check in self.at_flush:
            check()
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        noise: dict[int, float | None] = {}  # per count of estimates: few distinct ones per flush
        if self.noise_scale is not None:  # read here: the probe's state is the training thread's
            for taken in {rec[NOISE] for rec in pending}:
                noise[taken] = self.noise_scale(taken)
        self._rows.submit(pending, noise)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._profiler is not None:
            self._profiler.close(self._last_step)
        try:
            self.flush()
            self._rows.close()
        finally:
            if self._file is not None:
                self._file.close()
            if self._board is not None:
                self._board.close()
        if self._summary_at_close:
            summary = summarize({self.rank: list(self.records)}, self._flops_facts())
            if summary is not None:
                from phalanx.metrics.summary_display import data_wait_hint, noise_line, one_line

                print(one_line(summary), flush=True)
                for hint in (data_wait_hint(summary), noise_line(summary)):
                    if hint:
                        print(hint, flush=True)

    def _event(self) -> Any:
        event = self._make_event()
        event.record()  # on the training thread's current stream, behind the work queued so far
        return event

    def _set_flops(self, value: float | None) -> None:
        self.flops_per_sample = value
        facts = self._flops_facts()
        if facts is not None and self._out_dir is not None:
            (self._out_dir / FLOPS_FILE).write_text(json.dumps(facts) + "\n")

    def _flops_facts(self) -> dict[str, Any] | None:
        if self.flops_per_sample is None or self.peak_flops_per_s is None:
            return None
        facts = {"flops_per_sample": self.flops_per_sample, "peak_flops_per_s": self.peak_flops_per_s}
        if self.device.type == "cuda":
            facts["device"] = torch.cuda.get_device_name(self.device)
        return facts

    def peak_memory(self) -> int | None:
        """The peak since the last call, only where there is one to read: CUDA's allocator (the
        fullest of the devices the strategy computes on), or train.memory_cap's ``cpu_peak``."""
        if not self._on_cuda:
            return self.cpu_peak()
        peak = max(torch.cuda.max_memory_allocated(d) for d in self.devices)
        for device in self.devices:
            torch.cuda.reset_peak_memory_stats(device)  # so the next record is that step's own peak
        return peak


def _timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def create_recorder(
    config: Config,
    topology: Topology,
    run_dir: str | None,
    *,
    local_forward: bool,
    devices: Sequence[torch.device] | None = None,
) -> StepRecorder:
    """The Session's recorder, from ``train.metrics``, ``train.tensorboard`` and ``train.profile``.
    ``local_forward``: the strategy's unwrapped model runs a forward alone, without collectives
    (``Strategy.local_forward``), so rank 0 may count its FLOPs for MFU. ``devices``: those the
    strategy computes on (``Strategy.devices``; default: the topology's one), whose peak memory is recorded."""
    train = config.train
    root = Path(run_dir) if run_dir else None
    window = ProfileWindow.parse(train.profile) if train.profile else None  # every rank refuses a bad spec
    absent = [r for r in train.profile_ranks if r >= topology.world_size]
    if window is not None and absent:
        raise ConfigError(
            f"train.profile_ranks names rank {absent[0]}, but this run has ranks 0-{topology.world_size - 1}"
        )
    profiler = None
    if window is not None and topology.rank in train.profile_ranks:
        profiler = StepProfiler(window, topology.rank, topology.device, (root or Path.cwd()) / "profile")
    board = None
    if train.metrics and train.tensorboard and root is not None and topology.is_main:
        board = Board.open(root / "tensorboard")
    peak = None
    if train.metrics and topology.is_main and topology.device.type == "cuda" and local_forward:
        peak = peak_flops_per_s(
            torch.cuda.get_device_name(topology.device), config.precision.mode, config.precision.tf32
        )
    return StepRecorder(
        topology,
        enabled=train.metrics,
        out_dir=root / "metrics" if root is not None else None,
        board=board,
        profiler=profiler,
        peak_flops_per_s=peak,
        summary_at_close=train.metrics and root is None and topology.world_size == 1,
        devices=devices,
    )
