"""Two runs' weight traces (``train.weights_trace``) compared step by step.

A tensor's difference is relative, root-mean-square over the tensor:
``rms(a - b) / max(rms(a), rms(b), 1e-3)``. Two facts of fp32 training chose it:

- Adam amplifies rounding. An element whose gradient is a near-cancelling sum (|g| near eps) gets an
  update of ``lr * g / (|g| + eps)`` that rounding in g moves by up to 1e-3 of lr, so the largest
  element difference of a correct Adam run reaches 5e-5 of the weights while its rms stays at 4e-7
  (examples/train_phalanx.py at 2 processes). A wrong run (a per-process BatchNorm, a sum loss under
  SGD) moves every element, at 1e-2 of the weights and more.
- A tensor still near zero (a bias one Adam step from its zero init, 3e-4) would turn rounding into a
  large relative difference; below an rms of 1e-3 the difference is measured against 1e-3.

A step's difference is its largest tensor's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from phalanx.session.trace import trace_file

# float32's rounding, carried through a few optimizer steps, stays far below this; a wrong run's
# weights differ at 1e-3 and up from the first step on (docs/verify.md#the-tolerance).
TOLERANCE = 1e-5
_FLOOR = 1e-3


@dataclass(frozen=True)
class StepDiff:
    step: int
    difference: float  # the largest relative difference of any tensor (inf: missing or another shape)
    tensor: str | None  # the tensor that has it (None when every tensor is equal)
    note: str = ""  # why the two are not comparable, when they are not

    def holds(self, tolerance: float) -> bool:
        return self.difference <= tolerance


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    if not (a.is_floating_point() or a.is_complex()):
        return 0.0 if torch.equal(a, b) else math.inf  # counters (BatchNorm's num_batches_tracked)
    a, b = a.double(), b.double()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return 0.0 if torch.equal(a, b) else math.inf
    change = _rms(a - b)
    return 0.0 if change == 0 else change / max(_rms(a), _rms(b), _FLOOR)


def _rms(t: torch.Tensor) -> float:
    return t.square().mean().sqrt().item()


def compare_weights(step: int, ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> StepDiff:
    """The first tensor (in the model's order) with the largest difference wins the name."""
    missing = [name for name in theirs if name not in ours] + [name for name in ours if name not in theirs]
    if missing:
        return StepDiff(step, math.inf, missing[0], f"{missing[0]} is in one run's weights only")
    worst, name = 0.0, None
    for key, value in theirs.items():
        diff = relative_difference(ours[key], value)
        if diff > worst:
            worst, name = diff, key
    note = ""
    if name and ours[name].shape != theirs[name].shape:
        note = f"{name} has another shape"
    elif worst == math.inf and not ours[name].is_floating_point():
        note = f"{name} holds other counts"
    elif worst == math.inf:
        note = f"{name} is not finite (inf or nan) in one run"
    return StepDiff(step, worst, name, note)


def load_trace(directory: Path, step: int) -> dict | None:
    path = trace_file(directory, step)
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


def traced_steps(directory: Path) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(int(p.stem.removeprefix("step-")) for p in directory.glob("step-*.pt"))


def compare_traces(ours: Path, theirs: Path, steps: list[int]) -> list[StepDiff]:
    """One StepDiff per step in ``steps`` that both traces hold, in order."""
    out = []
    for step in steps:
        a, b = load_trace(ours, step), load_trace(theirs, step)
        if a is None or b is None:
            continue
        out.append(compare_weights(step, a["weights"], b["weights"]))
    return out


def first_failure(diffs: list[StepDiff], tolerance: float) -> StepDiff | None:
    return next((d for d in diffs if not d.holds(tolerance)), None)


def trace_facts(directory: Path) -> dict:
    """What the run's last traced file says about its models (session/trace.py): by then the loop has
    run, and what it called (session.shard) counts."""
    steps = traced_steps(directory)
    last = load_trace(directory, steps[-1]) if steps else None
    return dict(last["facts"]) if last else {}
