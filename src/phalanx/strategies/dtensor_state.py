"""State dicts of a model whose parameters are DTensors (fsdp's shards, tensor parallelism's
splits): what both strategies hand to ``torch.distributed.checkpoint`` and take from plain files."""

from __future__ import annotations

import torch
from torch import nn

from phalanx.errors import ConfigError
from phalanx.util.optim import rebuild_arguments


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's own piece of ``tensor``: a DTensor's local shard or split, a plain tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class ReplacedParameters:
    """fully_shard and parallelize_module replace the parameters they split with new ones: an
    optimizer built on the user's model is rebuilt on them, through the names they share."""

    def __init__(self, strategy: str):
        self.strategy = strategy
        self._new: dict[int, nn.Parameter] = {}

    def before(self, model: nn.Module) -> dict[str, nn.Parameter]:
        return dict(model.named_parameters())

    def after(self, model: nn.Module, before: dict[str, nn.Parameter]) -> None:
        now = dict(model.named_parameters())
        self._new.update({id(p): now[name] for name, p in before.items()})

    def rebuild(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if not self._new:
            raise ConfigError(
                f"strategy {self.strategy}: pass the model to setup() together with (or before) its optimizer"
            )
        for group in optimizer.param_groups:
            if any(id(p) not in self._new for p in group["params"]):
                raise ConfigError(
                    f"strategy {self.strategy}: the optimizer holds parameters that are not in the model "
                    "given to setup()"
                )
            group["params"] = [self._new[id(p)] for p in group["params"]]
        # Same group dicts, so a scheduler built on the user's optimizer still steers this one.
        return type(optimizer)(optimizer.param_groups, **rebuild_arguments(optimizer))


def put_full_tensor(slot: torch.Tensor, value: torch.Tensor) -> bool:
    """Copy this rank's share of the full tensor ``value`` into the DTensor ``slot``; False when
    ``slot`` is no DTensor (the caller copies it whole). Every rank has ``value``, so its share is cut
    locally with the sharding's own rule, and cast as it is copied (no second full copy)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(slot, DTensor):
        return False
    value = value.to(device=slot.device)
    share = distribute_tensor(value, slot.device_mesh, slot.placements, src_data_rank=None).to_local()
    with torch.no_grad():
        slot.to_local().copy_(share)
    return True


def shard_full_tensors(module: nn.Module, state: dict, prefix: str, *_: object) -> None:
    """A load_state_dict pre-hook: a plain (full) tensor given for a DTensor parameter becomes this
    rank's share of it, cut locally. load_state_dict of a plain dict means every rank holds the whole
    tensor, so no collective is needed (and calling it on one rank alone cannot hang)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, param in module.named_parameters():
        value = state.get(prefix + name)
        if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            local = value.detach().to(param.device)
            state[prefix + name] = distribute_tensor(local, param.device_mesh, param.placements, src_data_rank=None)


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full weights on CPU, on rank 0 (other ranks get an empty dict, as torch does)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def sharded_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)


def load_sharded_model_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state)


def load_full_model_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's part keyed by parameter names, so that it reshards."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer)


def load_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state)
