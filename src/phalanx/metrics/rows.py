"""The step records' rows: their fields, and the writer that turns a flush's records into rows on a
thread of its own.

A flush costs the host about 7 us a record on 2 CPU cores (reading the losses, a dict, a JSON line;
TensorBoard's protobufs where it is on), which on a 1 ms step is 0.7% of training time. On its own
thread the work runs while the training thread is inside torch (which releases the GIL), and the
read of the losses, and of the CUDA events that time each step's work on the device, never makes
the training thread wait for the device. Rows are written in the order of their flushes;
``drain()`` waits for every row handed over so far, and re-raises what writing them raised.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any

import torch

from phalanx.metrics.board import Board

FIELDS = (
    "rank",
    "step",
    "epoch",
    "time",
    "step_time",
    "data_wait",
    "sync_time",
    "device_work",
    "samples",
    "samples_per_s",
    "loss",
    "lr",
    "grad_norm",
    "noise_scale",
    "noise_estimated",
    "peak_mem_bytes",
)
LOSS, LR, GRAD_NORM = FIELDS.index("loss"), FIELDS.index("lr"), FIELDS.index("grad_norm")
NOISE = FIELDS.index("noise_scale")
DEVICE_WORK = FIELDS.index("device_work")
_TENSOR_FIELDS = (LOSS, LR, GRAD_NORM)  # a learning rate may be a tensor too
_MAYBE_NOT_FINITE = (LOSS, LR, GRAD_NORM, NOISE)


class RowWriter:
    def __init__(self, records: deque, file: IO[str] | None, board: Board | None, device: torch.device):
        self.records = records  # the recorder's: the most recent rows, in memory
        self._cuda = device if device.type == "cuda" else None
        self._file = file
        self._board = board
        self._pool: ThreadPoolExecutor | None = None  # started at the first flush with records
        self._writing: deque[Future] = deque()  # the flushes handed over and not yet checked, in order

    def submit(self, pending: list[tuple], noise: dict[int, float | None]) -> None:
        """A flush's records (tuples in FIELDS' order, tensors unread) and the noise scale per count of
        estimates; written in the background."""
        while self._writing and self._writing[0].done():
            self._writing.popleft().result()  # an error writing an earlier flush surfaces at this one
        if self._pool is None:
            # A new thread's current device is GPU 0: the stream switch in _write would make it current
            # there and put a CUDA context (~0.5 GiB) on GPU 0 for every rank of another GPU.
            device = _index(self._cuda) if self._cuda is not None else None
            self._pool = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="phalanx-metrics", initializer=_use_device, initargs=(device,)
            )
        # A thread starts on the default stream: the read must queue behind the training thread's
        # kernels, on the stream they ran on.
        stream = torch.cuda.current_stream(self._cuda) if self._cuda is not None else None
        try:
            self._writing.append(self._pool.submit(self._write, pending, noise, stream))
        except RuntimeError:
            # The interpreter is exiting (a script that never called session.close()): its thread
            # pools take no more work, and the last records are written here instead of lost.
            self.drain()
            self._write(pending, noise, stream)

    def drain(self) -> None:
        """Wait until every row handed over is in ``records`` and written."""
        while self._writing:
            self._writing.popleft().result()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def _write(self, pending: list[tuple], noise: dict[int, float | None], stream: Any = None) -> None:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            values = read_numbers([rec[i] for rec in pending for i in _TENSOR_FIELDS])
        filled = [_filled(rec, values, noise) for rec in pending]
        rows = [dict(zip(FIELDS, row)) for row in filled]
        self.records.extend(rows)
        if self._file is not None:
            self._file.write(json_lines(filled))
            self._file.flush()
        if self._board is not None:
            self._board.write(rows)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _use_device(index: int | None) -> None:
    if index is not None:
        torch.cuda.set_device(index)


def _filled(rec: tuple, values: dict[int, Any], noise: dict[int, float | None]) -> list[Any]:
    """A record's fields with its tensors read and its noise scale found; a number that is not
    finite becomes None (JSON's null: strict readers take no NaN)."""
    row = list(rec)
    row[NOISE] = noise.get(rec[NOISE])
    row[DEVICE_WORK] = _device_work(rec[DEVICE_WORK])
    for i in _MAYBE_NOT_FINITE:
        value = row[i]
        if isinstance(value, torch.Tensor):
            value = row[i] = values.get(id(value))
        if value is not None and not math.isfinite(value):
            row[i] = None
    return row


def _device_work(events: tuple[Any, Any] | None) -> float | None:
    """Seconds between a step's start event and its synchronising part's (CUDA events, recorded on the
    training thread without a sync): the wait here is this thread's, never the training thread's."""
    start, sync = events or (None, None)
    if start is None:  # off CUDA, no synchronising part, or a first step that no loader started
        return None
    try:
        sync.synchronize()
        return start.elapsed_time(sync) / 1000
    except RuntimeError:  # an event never recorded, or recorded on another device: no figure
        return None


_LINE = "{" + ", ".join(f"{json.dumps(name)}: %s" for name in FIELDS) + "}"


def json_lines(rows: list[list[Any]]) -> str:
    """One JSON line per row (values in FIELDS' order), the very text ``json.dumps`` gives the row's
    dict. The values are encoded in one call and put into a line template: per row, json.dumps
    costs microseconds of Python around its C encoder, on a thread that shares the GIL with
    training. A value is a number, a boolean or None, so ", " and "], [" stand only between values
    and rows; should a row hold anything else, the rows are encoded one by one."""
    if not rows:
        return ""
    values = [part.split(", ") for part in json.dumps(rows)[2:-2].split("], [")]
    if len(values) != len(rows) or any(len(row) != len(FIELDS) for row in values):
        return "".join(json.dumps(dict(zip(FIELDS, row))) + "\n" for row in rows)
    return "\n".join([_LINE % tuple(row) for row in values]) + "\n"


def read_numbers(values: list[Any]) -> dict[int, Any]:
    """The tensors among ``values`` as numbers, by id: one read of the device for all the
    one-element tensors of a device and dtype (the host waits once per flush)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    out: dict[int, Any] = {}
    for value in values:
        if not isinstance(value, torch.Tensor) or id(value) in out:
            continue
        if hasattr(value, "to_local"):  # a DTensor: reading it whole would be a collective
            value_local = value.to_local()
            out[id(value)] = value_local.item() if value_local.numel() == 1 else None
        elif value.numel() != 1:
            out[id(value)] = None
        else:
            out[id(value)] = None  # until read below
            groups.setdefault((value.device, value.dtype, value.dim()), []).append(value)
    with torch.no_grad():
        for group in groups.values():
            try:
                stacked = torch.stack(group if group[0].dim() == 0 else [t.reshape(()) for t in group])
                numbers = stacked.tolist()
            except RuntimeError:  # a tensor that cannot be stacked (another layout): left as None
                continue
            for tensor, number in zip(group, numbers):
                out[id(tensor)] = number
    return out
