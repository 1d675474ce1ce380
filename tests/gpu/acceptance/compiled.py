"""compute.compile (torch.compile after the strategy wraps the model) against eager: the same losses
and weights over the same batches, and the time of a step once compiled."""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from tests.gpu.acceptance.report import Check
from tests.gpu.acceptance.workloads import make_data, make_model, max_relative, quiet, session, sync

LOSS_TOLERANCE = 1e-4  # absolute, per step: inductor's fused kernels round differently from eager's
WEIGHT_TOLERANCE = 1e-3  # relative to each tensor's largest value
STEPS, MICRO = 40, 256
TIMED_FROM = 10  # steps before this one compile (and recompile) and are left out of the time


def compile_run(compiled: bool, steps: int, micro: int) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    with quiet():
        run = session(batch={"global_batch_size": micro}, compute={"compile": compiled})
        base = make_model()
        optimizer = torch.optim.SGD(base.parameters(), lr=0.05, momentum=0.9)
        model, optimizer = run.setup(base, optimizer)
        loader = run.setup_loader(DataLoader(make_data(micro * steps), batch_size=micro, shuffle=False), train=True)
        losses, times = [], []
        for x, y in loader:
            sync()
            started = time.perf_counter()
            with run.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                run.backward(loss)
            losses.append(loss.item())  # a sync: the step has finished
            times.append(time.perf_counter() - started)
        weights = {k: v.detach().cpu().clone() for k, v in base.state_dict().items()}
        run.close()
    return losses, weights, times


def run() -> list[Check]:
    steps, micro = STEPS, MICRO
    eager_losses, eager, eager_times = compile_run(False, steps, micro)
    started = time.perf_counter()
    compiled_losses, compiled, compiled_times = compile_run(True, steps, micro)
    took = time.perf_counter() - started
    loss_diff = max(abs(a - b) for a, b in zip(eager_losses, compiled_losses))
    weight_diff = max_relative(compiled, eager)
    eager_step = statistics.median(eager_times[TIMED_FROM:])
    compiled_step = statistics.median(compiled_times[TIMED_FROM:])
    ok = len(compiled_losses) == len(eager_losses) == steps and loss_diff <= LOSS_TOLERANCE
    ok = ok and weight_diff <= WEIGHT_TOLERANCE
    figure = (
        f"{steps} steps: loss differs by {loss_diff:.1e} at most, weights by {weight_diff:.1e}; "
        f"step {compiled_step * 1e3:.2f} ms compiled, {eager_step * 1e3:.2f} ms eager (median); "
        f"first step {compiled_times[0]:.1f}s, whole run {took:.0f}s"
    )
    return [
        Check(
            "MLP fp32 vs eager",
            ok,
            figure,
            f"loss within {LOSS_TOLERANCE:g} per step, weights within {WEIGHT_TOLERANCE:g} (relative)",
            {
                "max_loss_diff": loss_diff,
                "max_relative_weight_diff": weight_diff,
                "compiled_step_s": compiled_step,
                "eager_step_s": eager_step,
                "first_compiled_step_s": compiled_times[0],
                "compiled_run_s": took,
            },
        )
    ]
