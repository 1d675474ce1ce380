"""Checkpoint and resume on the GPU: a run stopped mid-epoch and resumed from its last checkpoint
(checkpoint.resume auto, in a new Session) ends with the weights of the run that never stopped, bit
for bit, as the CPU tests require (tests/unit/test_checkpoint.py). What has to come back from the
checkpoint: CUDA tensors of the model and the optimizer, the GradScaler's scale (fp16), the CUDA RNG
that dropout draws from, the sampler's shuffle and position.

Cases: ddp alone (the default path's wrapper, one-rank NCCL group) in fp16 and bf16, and fsdp alone in
bf16 (its sharded checkpoint through torch.distributed.checkpoint, from CUDA shards)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import phalanx
from tests.gpu.acceptance.report import Check, one_line
from tests.gpu.acceptance.workloads import IN, OUT, quiet, teacher_data

CASES = [("ddp", "fp16"), ("ddp", "bf16"), ("fsdp", "bf16")]
SAMPLES, MICRO, EPOCHS = 512, 32, 2  # 16 steps an epoch
SAVE_EVERY, STOP_AT = 5, 27  # stopped in epoch 2, two steps after the checkpoint of step 25


def train(strategy: str, precision: str, ckpt: Path, stop_at: int | None = None, resume: str = "never") -> tuple:
    """The run to its end (or to step ``stop_at``); returns (weights on the CPU, the step it started
    from, the steps at the end, the GradScaler's scale)."""
    with quiet():
        run = phalanx.Session(
            phalanx.Config(),
            strategy=strategy,
            precision=precision,
            batch={"global_batch_size": MICRO},
            train={"epochs": EPOCHS, "progress": False, "metrics": False},
            checkpoint={"dir": str(ckpt), "save_every": SAVE_EVERY, "resume": resume},
        )
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(IN, 512), nn.ReLU(), nn.Dropout(0.2), nn.Linear(512, OUT))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = DataLoader(teacher_data(SAMPLES), batch_size=MICRO, shuffle=True)
        model, optimizer, loader = run.setup(model, optimizer, loader)
        started = run.step_count  # a resume has loaded the checkpoint in setup()
        for _ in run.epochs():
            for x, y in loader:
                with run.accumulate(model):
                    run.backward(F.cross_entropy(model(x), y))
                if run.step_count == stop_at:
                    break
            if run.step_count == stop_at:
                break
        weights = {k: v.detach().float().cpu() for k, v in run.model_state_dict().items()}
        scale = run.precision.scaler.get_scale() if run.precision.scaler is not None else None
        run.close()
    return weights, started, run.step_count, scale


def check(strategy: str, precision: str, root: Path) -> Check:
    whole, _, steps, scale = train(strategy, precision, root / "whole")
    train(strategy, precision, root / "stopped", stop_at=STOP_AT)
    resumed, started, resumed_steps, resumed_scale = train(strategy, precision, root / "stopped", resume="auto")
    diff = max((resumed[k] - whole[k]).abs().max().item() for k in whole)
    saved = STOP_AT // SAVE_EVERY * SAVE_EVERY
    ok = resumed.keys() == whole.keys() and diff == 0 and started == saved
    ok = ok and resumed_steps == steps and resumed_scale == scale
    scaler = f", GradScaler scale {resumed_scale:g} (uninterrupted {scale:g})" if scale is not None else ""
    return Check(
        f"{strategy} alone {precision}: stop at step {STOP_AT}, resume",
        ok,
        f"resumed at step {started}, ended at {resumed_steps} (uninterrupted {steps}), "
        f"weights differ by {diff:.1e} at most{scaler}",
        f"resumed at step {saved}; the uninterrupted run's weights bit for bit, its step count and scale",
        {"max_abs_diff": diff, "started": started, "steps": resumed_steps, "uninterrupted_steps": steps},
    )


def run() -> list[Check]:
    checks = []
    with tempfile.TemporaryDirectory(prefix="phalanx-gpu-resume-") as root:
        for strategy, precision in CASES:
            try:  # a case that crashes fails alone; the others still run
                checks.append(check(strategy, precision, Path(root) / f"{strategy}-{precision}"))
            except Exception as err:  # noqa: BLE001
                checks.append(Check(f"{strategy} alone {precision}: resumed", False, one_line(err), "runs to the end"))
    return checks
