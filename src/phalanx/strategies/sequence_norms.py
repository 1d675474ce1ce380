"""Which modules tensor parallelism's ``sequence_parallel`` style can hold: norms over the last
dimension, torch's or a model's own (Meta's Llama brings its own ``RMSNorm`` class)."""

from __future__ import annotations

from torch import nn

_NORMS = (nn.LayerNorm, nn.RMSNorm)
# Norms whose statistics span the batch or the channels: a slice of the sequence changes them.
_NOT_LAST_DIM = ("batch", "group", "instance")
_TORCH_NOT_LAST_DIM = (
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.GroupNorm,
)  # fmt: skip


def is_norm(module: nn.Module) -> bool:
    """A norm over the last dimension: each position normalised on its own, so a peer can take a
    slice of the sequence. torch's LayerNorm and RMSNorm; or a class named ``...Norm`` (Llama's
    own ``RMSNorm``, ``T5LayerNorm``) whose parameters are 1-d (a weight, a bias over the last
    dimension) and held by itself, not a batch, group or instance norm."""
    if isinstance(module, _NORMS):
        return True
    name = type(module).__name__.lower()
    if not name.endswith("norm") or any(word in name for word in _NOT_LAST_DIM):
        return False
    if isinstance(module, _TORCH_NOT_LAST_DIM):
        return False
    own = dict(module.named_parameters(recurse=False))
    return len(own) == len(list(module.parameters())) and all(p.dim() == 1 for p in own.values())
