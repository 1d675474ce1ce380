"""The module strategy ``dp`` wraps the model in: torch's DataParallel, whose replicas compute in
the autocast dtype of the forward's caller.

torch's ``parallel_apply`` runs each replica in a thread of its own and re-enters autocast there
with the caller's on/off state but not its dtype. The dtype is per thread, float16 in a new one
(pytorch/pytorch#125186): ``precision.mode: bf16`` computed in fp16, without the loss scaler fp16
needs. Each replica here enters autocast again, inside torch's, with the caller's dtype.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn


class DataParallel(nn.DataParallel):
    """nn.DataParallel (same name, state dict and attributes) with the caller's autocast dtype in
    every replica."""

    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        device_type = self.src_device_obj.type
        if not torch.is_autocast_enabled(device_type):
            return super().parallel_apply(replicas, inputs, kwargs)
        dtype = torch.get_autocast_dtype(device_type)  # read on the caller's thread, where the Session set it
        return super().parallel_apply([_InDtype(r, device_type, dtype) for r in replicas], inputs, kwargs)


class _InDtype:
    """A replica called under autocast in ``dtype``, in the thread ``parallel_apply`` runs it in."""

    def __init__(self, replica: nn.Module, device_type: str, dtype: torch.dtype):
        self.replica, self.device_type, self.dtype = replica, device_type, dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.replica(*args, **kwargs)
