"""Token-weighted losses and clipping under tensor parallelism, on CPU gloo processes:
``session.backward(loss, items=n)`` counts the items over the data-parallel ranks only (tensor
peers see the same tokens), and ``optim.max_grad_norm`` clips by the norm over the whole mesh."""

from __future__ import annotations

import pytest

import phalanx
from tests.helpers import token_loss as tl
from tests.helpers.training import rel_diff

pytestmark = pytest.mark.multiprocess
TIMEOUT = 150
CLIP = 0.05  # bites: the reference with it ends elsewhere than without (asserted below)


def _train(strategy: str, tp: int, micro: int, clip: float | None) -> dict:
    return tl.train(strategy, micro, True, clip=clip, tp=tp)


@pytest.mark.timeout(2 * TIMEOUT)
@pytest.mark.parametrize(
    "strategy, nprocs, micro, clip",
    [("tp", 2, 8, None), ("tp", 4, 2, None), ("fsdp", 4, 2, None), ("fsdp", 4, 2, CLIP)],
    ids=["tp 2", "tp 2 x dp 2, 2 micro-steps", "fsdp x tp 2 x 2, 2 micro-steps", "fsdp x tp, clipped"],
)
def test_items_and_clipping_train_like_one_process(strategy, nprocs, micro, clip):
    reference = tl.reference(clip=clip)
    if clip is not None:  # the clip bites: it ends elsewhere than the unclipped run
        assert rel_diff(reference["state"], tl.reference()["state"]) > 1e-3
    ranks = phalanx.spawn(_train, nprocs=nprocs, args=(strategy, 2, micro, clip), cpu=True, timeout=TIMEOUT)
    assert rel_diff(ranks[0]["state"], reference["state"]) < 1e-5
    for rank in ranks:
        assert rank["losses"] == pytest.approx(reference["losses"], rel=1e-5)
