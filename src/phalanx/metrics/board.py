"""TensorBoard scalars from the step records, when the ``tensorboard`` package is installed."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

# record field -> TensorBoard tag
_TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "noise_scale": "train/noise_scale",
    "samples_per_s": "perf/samples_per_s",
    "step_time": "perf/step_time_s",
    "data_wait": "perf/data_wait_s",
    "peak_mem_bytes": "perf/peak_mem_bytes",
}


class Board:
    """The writer is created at the first write (or at close): importing tensorboard takes a tenth of
    a second, seconds where it loads tensorflow, and training need not wait for it to start."""

    def __init__(self, writer: Any = None, *, log_dir: Path | None = None):
        self._writer = writer
        self._log_dir = log_dir

    @classmethod
    def open(cls, log_dir: Path) -> "Board | None":
        """None when tensorboard is not installed: the JSONL records are still written."""
        if importlib.util.find_spec("tensorboard") is None:
            return None
        return cls(log_dir=log_dir)

    def _open(self) -> Any:
        if self._writer is None and self._log_dir is not None:
            log_dir, self._log_dir = self._log_dir, None
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # installed but unusable (torch refuses an old version): JSONL only
                return None
            self._writer = SummaryWriter(log_dir=str(log_dir))
        return self._writer

    def write(self, records: list[dict[str, Any]]) -> None:
        """One point per call (a metrics flush: every 500 steps or once a second): each scalar's mean
        over the records (the peak memory's largest), at the last record's step. A point per step
        cost about 40 us per step in protobuf work on the training thread, 4% of a 1 ms step; the
        JSONL files keep every step."""
        writer = self._open()
        if writer is None or not records:
            return
        last = records[-1]
        for field, tag in _TAGS.items():
            values = [r[field] for r in records if r.get(field) is not None]
            if values:
                value = max(values) if field == "peak_mem_bytes" else sum(values) / len(values)
                writer.add_scalar(tag, value, global_step=last["step"], walltime=last["time"])
        writer.flush()

    def close(self) -> None:
        writer = self._open()  # a run that recorded nothing still leaves its event file, as before
        if writer is not None:
            writer.close()
