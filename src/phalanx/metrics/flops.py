"""Model FLOPs utilisation: the model's training FLOPs per sample, counted by torch, against the
device's peak dense throughput from NVIDIA's datasheets."""

from __future__ import annotations

import re
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from phalanx.util.tree import map_tensors

# Dense (no structured sparsity) peak TFLOP/s per precision; SXM boards where a GPU comes in
# several forms, unless the name says otherwise. First match wins, so narrower names come first.
# None: the GPU has no tensor cores for that type, and MFU would measure nothing meaningful.
_PEAK_TFLOPS: list[tuple[str, dict[str, float | None]]] = [
    (r"H100.*PCIe", {"bf16": 756, "fp16": 756, "tf32": 378, "fp32": 51.2}),
    (r"H100.*NVL", {"bf16": 835, "fp16": 835, "tf32": 418, "fp32": 60}),
    (r"H100|H200|GH200", {"bf16": 989, "fp16": 989, "tf32": 494, "fp32": 67}),
    (r"A100", {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5}),
    (r"\bA10\b", {"bf16": 125, "fp16": 125, "tf32": 62.5, "fp32": 31.2}),
    (r"\bL40S\b", {"bf16": 362, "fp16": 362, "tf32": 183, "fp32": 91.6}),
    (r"\bL4\b", {"bf16": 121, "fp16": 121, "tf32": 60, "fp32": 30.3}),
    (r"V100", {"bf16": None, "fp16": 125, "tf32": None, "fp32": 15.7}),
    (r"\bT4\b", {"bf16": None, "fp16": 65, "tf32": None, "fp32": 8.1}),
]


def peak_flops_per_s(device_name: str, precision: str, tf32: bool = False) -> float | None:
    """Peak dense FLOP/s of one device for the precision mode, or None for an unknown device."""
    kind = "tf32" if precision == "fp32" and tf32 else precision
    for pattern, peaks in _PEAK_TFLOPS:
        if re.search(pattern, device_name):
            peak = peaks.get(kind)
            return peak * 1e12 if peak else None
    return None


def flops_per_sample(model: nn.Module, example_inputs: Any, kwargs: dict | None = None) -> float:
    """Training FLOPs per sample: one forward counted by ``FlopCounterMode``, times 3 (the
    backward costs about twice the forward). ``example_inputs``: the forward's argument, or a tuple
    of them; the batch size is the first dimension of the first tensor."""
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    kwargs = kwargs or {}
    sizes: list[int] = []
    map_tensors((args, kwargs), lambda t: sizes.append(t.shape[0]) if t.dim() else None)
    if not sizes or sizes[0] == 0:
        raise ValueError("the inputs hold no batched tensor to count samples by")
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(*args, **kwargs)
    return 3 * counter.get_total_flops() / sizes[0]


def count_on_first_forward(model: nn.Module, local: nn.Module, done: Callable[[float | None], None]) -> None:
    """Count FLOPs per sample once, on the inputs of ``model``'s first call, with an extra forward of
    ``local`` (the bare model) that changes nothing: eval mode (no BatchNorm statistics updated),
    no autograd, the random state restored. Any failure reports None, so MFU is left out."""

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        handle.remove()
        modes = [(m, m.training) for m in local.modules()]
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        flops = None
        try:
            with torch.random.fork_rng(devices=devices):
                local.eval()
                flops = flops_per_sample(local, args, kwargs)
        except Exception:  # noqa: BLE001 - MFU is a nicety; the run must not fail for it
            pass
        finally:
            for module, training in modes:
                module.training = training
        done(flops)

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
