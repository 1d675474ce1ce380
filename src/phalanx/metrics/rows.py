"""The step records' rows: their fields, and the writer that turns a flush's records into rows on a
thread of its own.

A flush of 50 records costs the host about 10 us a record (reading the losses, a dict, a JSON line,
TensorBoard's protobufs), which on a 1 ms step is 1% of training time. On its own thread the work
runs while the training thread is inside torch (which releases the GIL), and the read of the
losses never makes the training thread wait for the device. Rows are written in the order of their
flushes; ``drain()`` waits for every row handed over so far, and re-raises what writing them raised.
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
_TENSOR_FIELDS = (LOSS, LR, GRAD_NORM)  # a learning rate may be a tensor too
_MAYBE_NOT_FINITE = ("loss", "lr", "grad_norm", "noise_scale")


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
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="phalanx-metrics")
        # A thread starts on the default stream: the read must queue behind the training thread's
        # kernels, on the stream they ran on.
        stream = torch.cuda.current_stream(self._cuda) if self._cuda is not None else None
        self._writing.append(self._pool.submit(self._write, pending, noise, stream))

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
        rows = []
        for rec in pending:
            row = dict(zip(FIELDS, rec))
            row["loss"] = values.get(id(rec[LOSS]), rec[LOSS])
            row["lr"] = values.get(id(rec[LR]), rec[LR])
            row["grad_norm"] = values.get(id(rec[GRAD_NORM]), rec[GRAD_NORM])
            row["noise_scale"] = noise.get(rec[NOISE])
            for key in _MAYBE_NOT_FINITE:
                value = row[key]
                if value is not None and not math.isfinite(value):
                    row[key] = None  # JSON's null: strict readers take no NaN
            rows.append(row)
        self.records.extend(rows)
        if self._file is not None:
            self._file.write("".join(json.dumps(row) + "\n" for row in rows))
            self._file.flush()
        if self._board is not None:
            self._board.write(rows)


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
