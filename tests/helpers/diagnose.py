"""The checks `phalanx doctor` runs, in the order it reports them."""

from __future__ import annotations

GPU_CHECKS = ["GPU visibility", "torch CUDA vs driver", "GPU topology", "peer-to-peer access", "other GPU processes"]
ALL_CHECKS = [*GPU_CHECKS, "/dev/shm", "open-file limit", "environment variables", "live all-reduce"]
