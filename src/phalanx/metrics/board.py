"""TensorBoard scalars from the step records, when the ``tensorboard`` package is installed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# record field -> TensorBoard tag
_TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "samples_per_s": "perf/samples_per_s",
    "step_time": "perf/step_time_s",
    "data_wait": "perf/data_wait_s",
    "peak_mem_bytes": "perf/peak_mem_bytes",
}


class Board:
    def __init__(self, writer: Any):
        self._writer = writer

    @classmethod
    def open(cls, log_dir: Path) -> "Board | None":
        """None when tensorboard is not installed: the JSONL records are still written."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return None
        return cls(SummaryWriter(log_dir=str(log_dir)))

    def write(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            for field, tag in _TAGS.items():
                if record.get(field) is not None:
                    self._writer.add_scalar(tag, record[field], global_step=record["step"], walltime=record["time"])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
