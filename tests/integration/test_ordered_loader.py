"""An ordered training loader on 2 gloo processes: given to setup() with an optimizer, it trains
with the batch plan the header announces (each rank draws micro-batches of the plan's size, and the
two ranks together cover each global batch of the loader once), not as an evaluation loader."""

from __future__ import annotations

import pytest

import phalanx
from tests.helpers.loaders import ordered_training

pytestmark = pytest.mark.multiprocess
TIMEOUT = 120


@pytest.mark.timeout(TIMEOUT)
def test_an_ordered_loader_trains_with_the_announced_plan():
    ranks = phalanx.spawn(ordered_training, nprocs=2, args=(8,), cpu=True, timeout=TIMEOUT)
    for out in ranks:
        assert out["plan"] == (32, 8, 2) and out["steps"] == 4
        assert [len(batch) for batch in out["drawn"]] == [8] * 8
    for step in range(4):  # each global batch is the loader's next 32 samples, split over ranks and micro-steps
        window = [s for out in ranks for batch in out["drawn"][2 * step : 2 * step + 2] for s in batch]
        assert sorted(window) == list(range(32 * step, 32 * (step + 1)))
