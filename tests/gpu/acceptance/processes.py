"""Two processes sharing cuda:0 over gloo (which takes CUDA tensors; NCCL refuses two ranks on one
GPU): DDP and zero1 place the model on the GPU, communicate over gloo, prefetch on a side stream,
and end with the weights one process gets on the same global batch.

Through ``phalanx launch`` where its launcher can start two processes on one GPU with gloo, else
through ``phalanx.spawn(..., backend="gloo")``; a phalanx with neither records the part as not
available, with the reason.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

import phalanx
from tests.gpu.acceptance.report import Check
from tests.gpu.acceptance.workloads import (
    local,
    make_model,
    max_relative,
    quiet,
    session,
    teacher_data,
    train_losses,
    train_mlp,
)

STEPS, GLOBAL = 20, 256
TOLERANCE = 1e-4  # two halves of the batch summed by gloo then averaged, against one process's mean
STRATEGIES = ("ddp", "zero1")
TIMEOUT_S = 120


def worker(strategy: str, steps: int, precision: str = "fp32") -> dict:
    """One rank: the MLP on teacher data, as workloads.train_mlp trains it in one process."""
    with quiet():
        run = session(
            strategy, batch={"global_batch_size": GLOBAL}, data={"prefetch_to_device": True}, precision=precision
        )
        model = make_model()
        dtypes = []  # what the first layer computes in: autocast's dtype (ddp.py checks bf16 and fp16)
        model[0].register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model, optimizer = run.setup(model, optimizer)
        data = torch.utils.data.DataLoader(teacher_data(GLOBAL * steps), batch_size=GLOBAL, shuffle=False)
        loader = run.setup_loader(data, train=True)
        losses = train_losses(run, model, loader)
        facts = {
            "device": str(run.device),
            "parameters_on": sorted({str(local(p).device) for p in run.unwrap(model).parameters()}),
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "transfer": type(loader.transfer).__name__,
            "steps": run.step_count,
            "losses": losses,
            "dtype": str(dtypes[0]).removeprefix("torch.") if dtypes else None,
            "scaler": run.precision.scaler is not None,
            "weights": {k: v.detach().float().cpu() for k, v in run.model_state_dict().items()},
        }
        run.close()
    return facts


def spawn_takes_gloo() -> bool:
    spawn = getattr(phalanx, "spawn", None)
    return spawn is not None and "backend" in inspect.signature(spawn).parameters


def run() -> list[Check]:
    if not spawn_takes_gloo():
        reason = "not available in this phalanx: phalanx.spawn has no backend='gloo' and launch cannot share a GPU"
        return [Check(f"{s}, 2 processes on cuda:0", None, reason, "-") for s in STRATEGIES]
    alone = train_mlp(STEPS, GLOBAL, precision="fp32")
    checks = []
    for strategy in STRATEGIES:
        ranks = phalanx.spawn(worker, 2, (strategy, STEPS), cpu=False, backend="gloo", timeout=TIMEOUT_S)
        diff = max_relative(ranks[0]["weights"], alone.weights)
        placed = all(r["device"] == "cuda:0" and r["parameters_on"] == ["cuda:0"] for r in ranks)
        ok = placed and all(r["backend"] == "gloo" and r["steps"] == STEPS for r in ranks) and diff <= TOLERANCE
        ok = ok and all(r["transfer"] == "StreamTransfer" for r in ranks)
        facts = ", ".join(f"rank {i} on {r['device']} ({r['backend']}, {r['transfer']})" for i, r in enumerate(ranks))
        checks.append(
            Check(
                f"{strategy}, 2 processes on cuda:0 (phalanx.spawn)",
                ok,
                f"{facts}; weights after {STEPS} steps {diff:.1e} from one process's",
                f"both ranks on cuda:0 over gloo with the side stream; weights within {TOLERANCE:g} (relative)",
                {"ranks": [{k: v for k, v in r.items() if k != "weights"} for r in ranks], "max_relative_diff": diff},
            )
        )
    return checks
