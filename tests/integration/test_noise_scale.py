"""The gradient noise scale against its closed form (linear least squares on Gaussian data, see
tests/helpers/noise.py): within 10% at 1 process (accumulation's micro-steps give the small batch)
and at 2 (DDP's comm hook measures each rank's gradient before the all-reduce; and micro-steps)."""

from __future__ import annotations

import pytest

import phalanx
from tests.helpers import noise

pytestmark = pytest.mark.multiprocess
TIMEOUT = 240


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize(
    "nprocs, strategy, micro, small",
    [
        (1, "single", 8, 8),
        (2, "ddp", 32, 32),
        (2, "ddp", 8, 8),
        (2, "zero1", 32, 32),
        (2, "fsdp", 32, 32),
        (2, "fsdp", 8, 32),
    ],
    ids=[
        "single, accumulation",
        "ddp, comm hook",
        "ddp, accumulation",
        "zero1, comm hook",
        "fsdp",
        "fsdp, accumulation",
    ],
)
def test_the_noise_scale_matches_its_closed_form(nprocs, strategy, micro, small):
    ranks = phalanx.spawn(noise.estimate, nprocs=nprocs, args=(64, micro, 600, strategy), cpu=True, timeout=TIMEOUT)
    truth = noise.truth()
    for out in ranks:
        assert (out["small"], out["big"]) == (small, 64)
        print(f"\n{strategy} x{nprocs}, small batch {small}: B_noise {out['noise_scale']:.2f}, truth {truth:.2f}")
        assert abs(out["noise_scale"] - truth) / truth < 0.10, out
