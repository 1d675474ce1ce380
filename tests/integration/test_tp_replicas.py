"""strategy tp's data-parallel replicas and tensor peers train one model, as DDP's do: a parameter
one rank's data leaves without a gradient is averaged with zeros (not packed out of place), and a
weight the script changed on one rank only is rank 0's everywhere before training."""

from __future__ import annotations

import pytest
import torch

import phalanx
from tests.helpers import tp_replicas
from tests.helpers.training import rel_diff

pytestmark = pytest.mark.multiprocess
TIMEOUT = 120


@pytest.mark.timeout(2 * TIMEOUT)
@pytest.mark.parametrize(
    "tp, changed",
    [(1, False), (2, True), (1, True)],
    ids=["experts, 2 replicas", "changed, 2 peers", "changed, 2 replicas"],
)
def test_replicas_and_peers_train_the_one_process_model(tp, changed):
    expected = tp_replicas.reference()
    if changed:  # rank 0 keeps the built weights; rank 1's changed ones must not train
        ranks = phalanx.spawn(tp_replicas.train, nprocs=2, args=(tp, True), cpu=True, timeout=TIMEOUT)
    else:
        ranks = phalanx.spawn(tp_replicas.train, nprocs=2, args=(tp,), cpu=True, timeout=TIMEOUT)
    assert rel_diff(ranks[0]["state"], expected) < 1e-5
    assert all(torch.equal(ranks[0]["held"][k], ranks[1]["held"][k]) for k in ranks[0]["held"])
