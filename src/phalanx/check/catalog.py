"""Every rule of ``phalanx check``: its id, severity and one-line summary (``--list-rules``).

Errors are the mistakes that hang a run or train it wrongly; warnings cost speed or are worth a
look. docs/check.md has a section per rule, anchored by its id."""

from __future__ import annotations

import ast

from phalanx.check.findings import Finding

ERROR, WARNING = "error", "warning"

RULES: dict[str, tuple[str, str]] = {
    "rank-guarded-collective": (ERROR, "a collective reached on some ranks only hangs the others"),
    "set-epoch-missing": (ERROR, "a shuffling DistributedSampler without set_epoch() repeats one order every epoch"),
    "loss-divided-in-accumulate": (ERROR, "the loss divided by the accumulation steps inside accumulate()"),
    "scheduler-in-accumulate": (ERROR, "an LR scheduler stepped inside session.accumulate(): once per micro-step"),
    "step-in-accumulate": (ERROR, "optimizer.step() / zero_grad() inside session.accumulate(), which steps itself"),
    "scheduler-per-micro-step": (ERROR, "with gradient accumulation, the scheduler steps on every micro-step"),
    "unguarded-torch-save": (ERROR, "torch.save() on every rank of a process group: every rank writes one file"),
    "cuda-without-index": (ERROR, "'cuda' without an index and no set_device(): every rank on cuda:0"),
    "data-parallel": (WARNING, "nn.DataParallel: one process drives every GPU"),
    "batchnorm-unsynced": (WARNING, "BatchNorm under data parallelism without SyncBatchNorm"),
    "unreduced-loss-print": (WARNING, "a rank's own loss printed as a global one"),
    "shuffled-eval-loader": (WARNING, "an evaluation loader or sampler that shuffles"),
    "untimed-cuda-sync": (WARNING, "wall-clock timing of CUDA work without a synchronize"),
    "sum-loss": (WARNING, "a summed loss: its gradient scale changes with the number of processes"),
    "rank-dependent-seed": (WARNING, "a seed that depends on the rank before the model is built"),
}


def found(path: str, node: ast.AST, rule: str, message: str) -> Finding:
    """The finding of ``rule`` at ``node``'s first line, with the rule's severity."""
    return Finding(path, getattr(node, "lineno", 1), RULES[rule][0], rule, message)
