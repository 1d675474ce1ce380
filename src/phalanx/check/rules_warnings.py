"""Warnings: slow or questionable rather than wrong for certain. DataParallel, unsynchronised
BatchNorm, a rank's loss printed as a global one, a summed loss, a seed that depends on the rank."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from phalanx.check.catalog import found
from phalanx.check.findings import Finding
from phalanx.check.ranks import Ranks
from phalanx.check.script import Script, const_str, keyword, last_name

_BATCHNORM = re.compile(r"^BatchNorm[123]d$")
# torchvision's constructors of models that hold BatchNorm layers.
_BN_MODELS = re.compile(r"^(resnet\d+|resnext\w+|wide_resnet\w+|densenet\d+|mobilenet_v[23]\w*|efficientnet\w*|"
                        r"vgg\d+_bn|regnet\w+|inception_v3|googlenet|shufflenet\w*|mnasnet\w*)$")  # fmt: skip
_GLOBAL = re.compile(r"\b(global|all ranks|all processes|all gpus|across (ranks|processes|gpus|devices)|world)\b", re.I)
_REDUCTIONS = {"all_reduce", "reduce", "all_gather", "all_gather_object", "gather", "gather_for_metrics",
               "reduce_scatter", "all_gather_into_tensor"}  # fmt: skip
_PRINTS = {"print", "info", "warning", "debug", "write", "log"}
_LOSS_FUNCTIONS = re.compile(r"(Loss$|_loss$|^cross_entropy$|^binary_cross_entropy\w*$)")


def check(script: Script, ranks: Ranks) -> Iterator[Finding]:
    yield from _data_parallel(script)
    yield from _batchnorm(script)
    yield from _loss_prints(script)
    yield from _sum_loss(script)
    yield from _seed(script, ranks)


def _data_parallel(script: Script) -> Iterator[Finding]:
    for call in script.calls:
        if last_name(call) == "DataParallel":
            yield found(
                script.path,
                call,
                "data-parallel",
                "nn.DataParallel drives every GPU from one Python process (GIL-bound, the model copied to each GPU "
                "every step): slow; run one process per GPU with `phalanx launch` and DDP",
            )


def _batchnorm(script: Script) -> Iterator[Finding]:
    if not script.data_parallel or {"convert_sync_batchnorm", "SyncBatchNorm"} & script.names():
        return
    for call in script.calls:
        name = last_name(call) or ""
        from_torchvision = (script.qualname(call) or "").startswith("torchvision.models.")
        if _BATCHNORM.match(name) or (from_torchvision and _BN_MODELS.match(name)):
            yield found(
                script.path,
                call,
                "batchnorm-unsynced",
                "BatchNorm under data parallelism normalises over each process's share of the batch only, so N "
                "processes do not train like one; torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) before "
                "setup (or the DDP wrap)",
            )
            return  # one finding says it for the file


def _loss_prints(script: Script) -> Iterator[Finding]:
    if not script.data_parallel or any(last_name(c) in _REDUCTIONS for c in script.calls):
        return
    for call in script.calls:
        if last_name(call) not in _PRINTS:
            continue
        parts = [*call.args, *(k.value for k in call.keywords)]
        text = " ".join(s for p in parts for n in ast.walk(p) if (s := const_str(n)))
        loss = any("loss" in (last_name(n) or "").lower() for p in parts for n in ast.walk(p) if not _is_str(n))
        if loss and _GLOBAL.search(text):
            yield found(
                script.path,
                call,
                "unreduced-loss-print",
                "this prints one rank's loss as if it were the loss over all ranks, and nothing in the file "
                "reduces it; reduce it first (session.reduce(loss), or dist.all_reduce and divide by world_size)",
            )


def _is_str(node: ast.AST) -> bool:
    return const_str(node) is not None


def _sum_loss(script: Script) -> Iterator[Finding]:
    if not script.data_parallel:
        return
    message = (
        "a summed loss: phalanx and DDP average the gradients over processes, so the gradient's scale, and the "
        "effective learning rate, change with the number of processes; use a mean, or a mean over tokens with "
        "session.backward(loss, items=n)"
    )
    backed = {last_name(a) for c in script.calls if last_name(c) == "backward" for a in c.args} | {
        last_name(c.func.value)
        for c in script.calls
        if last_name(c) == "backward" and isinstance(c.func, ast.Attribute)
    }
    for call in script.calls:
        name = last_name(call) or ""
        if const_str(keyword(call, "reduction")) == "sum" and _LOSS_FUNCTIONS.search(name):
            parent = script.parents.get(call)
            if not (isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.Div)):
                yield found(script.path, call, "sum-loss", message)
        elif name == "sum" and not call.args and isinstance(call.func, ast.Attribute):
            parent = script.parents.get(call)
            direct = isinstance(parent, ast.Attribute) and parent.attr == "backward"
            assigned = isinstance(parent, ast.Assign) and any(last_name(t) in backed for t in parent.targets)
            if direct or (assigned and "loss" in " ".join(last_name(t) or "" for t in parent.targets)):
                yield found(script.path, call, "sum-loss", message)


def _seed(script: Script, ranks: Ranks) -> Iterator[Finding]:
    """Replicas built from rank-dependent seeds start apart; DDP (and the libraries built on it)
    broadcasts rank 0's weights at the wrap, so only scripts without one are told."""
    if not script.process_group or {"DistributedDataParallel", "DDP"} & script.names() or script.uses_phalanx:
        return
    for call in script.calls:
        if last_name(call) == "manual_seed" and call.args and ranks.valued(call.args[0]):
            later = [n for n in ast.walk(script.tree) if getattr(n, "lineno", 0) > call.lineno]
            if any(isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and "model" in n.id for n in later):
                yield found(
                    script.path,
                    call,
                    "rank-dependent-seed",
                    "the seed depends on the rank and the model is built after it: each process initialises "
                    "different weights, and nothing here broadcasts rank 0's; seed the model's initialisation "
                    "alike on every rank (add the rank to the seed after the model is built)",
                )
