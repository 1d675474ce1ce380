"""Counting the tensor reads phalanx's own code makes while a loop trains (issue 26).

A read (``.item()``, ``float(t)``, ``int(t)``, ``bool(t)``, ``.tolist()``, ``.cpu()``) makes the
host wait for the device on a GPU. phalanx may read only at its documented read points, each at
an interval and never per step: the metrics flush (every 50 steps or once a second; its rows are
read on the metrics thread, which the training thread never waits for), a redraw of
the progress bar (4 a second), the ranks' agreement poll (about once a second), a batch.adaptive
decision (every ``batch.adapt_every`` steps) and the check of token counts (every 50 steps).
``counting()`` wraps the read methods of ``torch.Tensor``; a read whose caller is a phalanx source
file counts as *stray* unless one of those points is on the stack, and as *allowed* when one is.
Reads by torch itself (GradScaler's own overflow check, say) are torch's and not counted."""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx

SOURCE = str(Path(phalanx.__file__).parent) + "/"
READS = ("item", "tolist", "cpu", "__float__", "__int__", "__bool__")
# (file under src/phalanx, function): where phalanx reads on purpose; docs/performance.md lists them.
READ_POINTS = {
    ("metrics/recorder.py", "StepRecorder.flush"),
    ("metrics/rows.py", "RowWriter._write"),  # the flush's rows, on the metrics thread
    ("runtime/progress.py", "_redraw"),
    ("faults/agreement.py", "StepAgreement.poll"),
    ("session/batch_plan.py", "BatchOwner.after_step"),
    ("session/items.py", "ItemWeighting.check"),  # every ITEMS_CHECK_EVERY steps, at one step on every rank
}


@dataclass
class Reads:
    counting: bool = False  # off until the loop is past its first steps (set-up reads are set-up's)
    stray: Counter = field(default_factory=Counter)  # (file, line, function, method) -> calls
    allowed: Counter = field(default_factory=Counter)

    def describe(self) -> str:
        return "; ".join(
            f"{n}x {method} at {path}:{line} in {fn}" for (path, line, fn, method), n in self.stray.items()
        )


def at_read_point(frame: Any) -> bool:
    """Whether one of READ_POINTS is on the stack at ``frame`` (also tests/gpu/acceptance/syncs.py's rule)."""
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(SOURCE) and (name[len(SOURCE) :], frame.f_code.co_qualname) in READ_POINTS:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def counting() -> Iterator[Reads]:
    reads = Reads()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name: str, original: Any) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            path = caller.f_code.co_filename
            if reads.counting and path.startswith(SOURCE):
                key = (path[len(SOURCE) :], caller.f_lineno, caller.f_code.co_qualname, name)
                (reads.allowed if at_read_point(caller) else reads.stray)[key] += 1
            return original(self, *args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def train_and_count(sections: dict[str, Any], steps: int = 120, items: bool = False) -> dict[str, Any]:
    """Train a small MLP for ``steps`` optimizer steps under ``sections`` (the Session's keyword
    config), counting reads from the third step on; returns the counts (picklable: spawn's)."""
    sections = {**sections, "train": {"progress": True, **sections.get("train", {})}}
    session = phalanx.Session(**sections)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batch = session.config.batch.global_batch_size or 32
    data = TensorDataset(torch.randn(batch * steps, 16), torch.randint(0, 4, (batch * steps,)))
    model, optimizer, loader = session.setup(model, optimizer, DataLoader(data, batch_size=batch, shuffle=True))
    with counting() as reads:
        for _ in session.epochs(1):
            for x, y in session.progress(loader):
                reads.counting = session.step_count >= 2
                with session.accumulate(model):
                    out = model(x)
                    if items:  # a loss that is a mean over its rows' items, as a token loss is
                        n = (y != 0).sum()
                        loss = (F.cross_entropy(out, y, reduction="none") * (y != 0)).sum() / n.clamp(min=1)
                        session.backward(loss, items=n)
                    else:
                        session.backward(F.cross_entropy(out, y))
        reads.counting = False
        stepped = session.step_count
        session.close()
    return {"stepped": stepped, "stray": reads.describe(), "allowed": sum(reads.allowed.values())}
