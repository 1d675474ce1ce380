"""Mixed precision: one object owning autocast, the fp16 GradScaler and the CUDA math settings."""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Any, Callable

import torch
from torch import nn

from phalanx import _torch_compat as compat
from phalanx.config.schema import PrecisionConfig
from phalanx.util.tree import map_tensors

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
# Measured: nanoGPT 1.75 s against 0.19 s per step; benchmarks/cpu_fp16.py 18-22x (AMD EPYC, 2 threads).
CPU_FP16_NOTE = (
    "phalanx: precision.mode fp16 on a CPU makes each training step about 9-22x slower than fp32 "
    "(measured on small GPT models); use fp32, or bf16 (no loss scaling; fast where the CPU has bf16 instructions)"
)


class Precision:
    def __init__(self, config: PrecisionConfig, device: torch.device):
        self.mode = config.mode
        self.dtype = _DTYPES[config.mode]
        self.device = device
        self.scaler = torch.amp.GradScaler(device.type) if config.mode == "fp16" else None
        self.notes: list[str] = []  # said once on rank 0 by the Session
        self._watched: set[int] = set()  # optimizers whose steps a post hook reports
        self._stepped: set[int] = set()
        if config.mode == "fp64":
            # Tensors the script makes after the Session (its data, noise) are float64 too, so a
            # float32 one never meets a float64 weight in a matmul. Process-wide, which only a mode
            # meant for verify's short runs may be.
            torch.set_default_dtype(torch.float64)
        if config.mode == "fp16" and device.type == "cpu":
            # Most CPUs have no fp16 matmul (bf16 they often have), so autocast's fp16 kernels
            # convert and run slowly, and nothing else would tell the user (benchmarks/cpu_fp16.py).
            self.notes.append(CPU_FP16_NOTE)
        if device.type == "cuda":
            # Process-wide switches, so they are set once here rather than per call. Off means
            # PyTorch's defaults (TF32 for cuDNN convolutions, not for matmuls), left untouched.
            if config.tf32:
                torch.backends.cuda.matmul.allow_tf32 = True
                torch.backends.cudnn.allow_tf32 = True
            if config.cudnn_benchmark:
                torch.backends.cudnn.benchmark = True

    def prepare_model(self, model: nn.Module) -> None:
        """fp64: the model's floating weights and buffers in float64, before any wrapper sees them."""
        if self.mode == "fp64":
            model.to(torch.float64)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.mode in ("fp32", "fp64"):
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def wrap_forward(self, forward: Callable, *, autocast: bool = True) -> Callable:
        """Run ``forward`` under autocast and hand back fp32 outputs, so the loss is computed in fp32.
        ``autocast=False`` where the strategy casts parameters itself (FSDP's mixed precision).
        fp64: the floating inputs go in as float64 (a batch read as float32), the outputs stay so."""
        if self.mode == "fp32":
            return forward
        return _AutocastForward(self, forward, autocast)

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to true scale before clipping (idempotent within one step)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizers: list[torch.optim.Optimizer]) -> bool:
        """Step every optimizer; returns False when fp16 overflow made the scaler skip the step.

        The scaler is updated once, after all optimizers: updating it between them would forget
        which ones were already unscaled."""
        if self.scaler is None:
            for optimizer in optimizers:
                optimizer.step()
            return True
        if not all(self._watch(optimizer) for optimizer in optimizers):
            scale_before = self.scaler.get_scale()  # a read of the device; only for optimizers without hooks
            for optimizer in optimizers:
                self.scaler.step(optimizer)
            self.scaler.update()
            return self.scaler.get_scale() >= scale_before
        # Whether each optimizer stepped, from its own post hook: asking the scaler (get_scale)
        # would read the scale from the device twice more per step.
        self._stepped.clear()
        for optimizer in optimizers:
            self.scaler.step(optimizer)
        self.scaler.update()
        return all(id(optimizer) in self._stepped for optimizer in optimizers)

    def _watch(self, optimizer: torch.optim.Optimizer) -> bool:
        if id(optimizer) not in self._watched:
            register = getattr(optimizer, "register_step_post_hook", None)
            # A fused optimizer is stepped on an overflow too (it skips on the device): only the
            # scale says whether it updated.
            if register is None or compat.steps_under_inf(optimizer):
                return False
            register(lambda opt, args, kwargs: self._stepped.add(id(opt)))
            self._watched.add(id(optimizer))
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


class _AutocastForward:
    """A model's forward under the Session's autocast, set on the model as its ``forward``.

    An object rather than a closure for what copying and pickling the model do with it.
    ``copy.deepcopy(model)`` (an EMA copy) keeps the autocast and runs the copy's own forward, where
    a closure would be shared and run the original's weights. ``torch.save(model)`` stores the
    model's own forward, so a model loaded outside the Session runs as written, in the dtype its
    new script chooses; a closure could not be pickled at all."""

    def __init__(self, precision: Precision, forward: Callable, autocast: bool):
        functools.update_wrapper(self, forward)  # first: it copies the forward's __dict__ onto this
        self.precision, self.forward, self.autocast = precision, forward, autocast

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.precision.mode == "fp64":
            args, kwargs = _to_fp64((args, kwargs))
            return self.forward(*args, **kwargs)
        with self.precision.autocast() if self.autocast else contextlib.nullcontext():
            out = self.forward(*args, **kwargs)
        return _to_fp32(out)

    def __deepcopy__(self, memo: dict[int, Any]) -> _AutocastForward:
        return _AutocastForward(self.precision, copy.deepcopy(self.forward, memo), self.autocast)

    def __reduce__(self) -> Any:
        owner = getattr(self.forward, "__self__", None)
        return (getattr, (owner, self.forward.__name__)) if owner is not None else (_same, (self.forward,))


def _same(value: Any) -> Any:
    return value


def _to_fp64(value: Any) -> Any:
    return map_tensors(value, lambda t: t.double() if t.is_floating_point() and t.dtype != torch.float64 else t)


def _to_fp32(value: Any) -> Any:
    return map_tensors(value, lambda t: t.float() if t.is_floating_point() and t.dtype != torch.float32 else t)
