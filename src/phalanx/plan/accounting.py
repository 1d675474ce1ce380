"""Model-state memory per device for each strategy: parameters, gradients, optimizer state.

Two accountings:
- ``zero-paper``: Rajbhandari et al., 2019 (ZeRO), mixed-precision Adam: 2 bytes of fp16
  parameters, 2 of fp16 gradients and K = 12 of fp32 master weights, momentum and variance per
  parameter, divided among N devices as each stage shards them.
- ``phalanx``: what phalanx really keeps. Autocast (bf16/fp16) leaves parameters, gradients and
  optimizer state in fp32, so 4 + 4 + K bytes with K = 0 (SGD), 4 (SGD with momentum), 8 (Adam).
"""

from __future__ import annotations

from dataclasses import dataclass

OPTIMIZER_BYTES = {"sgd": 0, "momentum": 4, "adam": 8}  # fp32 state bytes per parameter
PAPER_K = 12

# What each strategy shards: (parameters, gradients, optimizer state).
SHARDING = {
    "ddp": (False, False, False),
    "zero1": (False, False, True),
    "fsdp-zero2": (False, True, True),
    "fsdp-zero3": (True, True, True),
}


@dataclass(frozen=True)
class ModelState:
    parameters: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer


def model_state(strategy: str, n_params: int, devices: int, *, optimizer: str = "adam", accounting: str = "phalanx") -> ModelState:
    """Bytes per device of model state under ``strategy`` (a key of SHARDING)."""
    if accounting == "zero-paper":
        p_bytes, g_bytes, k = 2, 2, PAPER_K
    else:
        p_bytes, g_bytes, k = 4, 4, OPTIMIZER_BYTES[optimizer]
    shard_p, shard_g, shard_o = SHARDING[strategy]
    # fsdp-zero2 in the ZeRO paper keeps full fp16 parameters; FSDP2 without resharding keeps
    # the sharded fp32 ones at rest and gathers per unit, so phalanx's accounting shards them too.
    if strategy == "fsdp-zero2" and accounting == "phalanx":
        shard_p = True
    return ModelState(
        parameters=p_bytes * n_params / (devices if shard_p else 1),
        gradients=g_bytes * n_params / (devices if shard_g else 1),
        optimizer=k * n_params / (devices if shard_o else 1),
    )
