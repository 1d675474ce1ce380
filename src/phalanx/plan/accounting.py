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

# What each strategy shards: (parameters, gradients, optimizer state). A pipeline stage holds
# about 1/N of the layers, so all three are divided (assuming balanced stages).
SHARDING = {
    "ddp": (False, False, False),
    "zero1": (False, False, True),
    "fsdp-zero2": (False, True, True),
    "fsdp-zero3": (True, True, True),
    "pipeline": (True, True, True),
}


@dataclass(frozen=True)
class ModelState:
    parameters: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer


def model_state(
    strategy: str,
    n_params: int,
    devices: int,
    *,
    optimizer: str = "adam",
    accounting: str = "phalanx",
    trainable: int | None = None,
    compute_bytes: int = 4,
) -> ModelState:
    """Peak bytes per device of model state under ``strategy`` (a key of SHARDING).

    ``trainable``: parameters that get gradients and optimizer state (default: all).
    ``compute_bytes``: bytes per parameter of the copy FSDP gathers for compute (2 under bf16).
    """
    trainable = n_params if trainable is None else trainable
    shard_p, shard_g, shard_o = SHARDING[strategy]
    if accounting == "zero-paper":
        return ModelState(
            parameters=2 * n_params / (devices if shard_p else 1),
            gradients=2 * trainable / (devices if shard_g else 1),
            optimizer=PAPER_K * trainable / (devices if shard_o else 1),
        )
    parameters = 4 * n_params / (devices if shard_p else 1)
    if strategy == "fsdp-zero2":
        # FSDP2 keeps its fp32 shards, and without resharding also the gathered compute copy of
        # every parameter from forward until backward: that copy is the peak.
        parameters = 4 * n_params / devices + compute_bytes * n_params
    return ModelState(
        parameters=parameters,
        gradients=4 * trainable / (devices if shard_g else 1),
        optimizer=OPTIMIZER_BYTES[optimizer] * trainable / (devices if shard_o else 1),
    )
