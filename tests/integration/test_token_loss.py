"""Token-weighted losses on 2 gloo processes: ``session.backward(loss, items=n)`` gives the weights
of one process that takes each global batch in one micro-batch, under ddp, zero1 and fsdp, with
and without accumulation; the plain contract (a mean of each micro-batch's means) does not."""

from __future__ import annotations

import math
import statistics

import pytest

import phalanx
from tests.helpers import token_loss as tl
from tests.helpers.training import rel_diff

pytestmark = pytest.mark.multiprocess
TIMEOUT = 120


@pytest.fixture(scope="module")
def reference() -> dict:
    return tl.reference()


def _spawn(*args, **kwargs) -> list[dict]:
    return phalanx.spawn(tl.run, nprocs=2, args=(args, kwargs), cpu=True, timeout=TIMEOUT)


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp"])
@pytest.mark.parametrize("micro", [4, 2], ids=["2 processes", "2 processes x 2 micro-steps"])
def test_items_train_like_one_process_over_the_global_batchs_tokens(strategy, micro, reference):
    ranks = _spawn(strategy, micro, True)
    out = ranks[0]
    assert out["steps"] == tl.STEPS and out["accumulation"] == tl.GLOBAL_BATCH // (2 * micro)
    assert rel_diff(out["state"], reference["state"]) < 1e-5
    # What the bar and the metrics show is the one-process loss of each global batch, on every rank.
    for rank in ranks:
        assert rank["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    # session.reduce(loss, items=n) of the last micro-step weights each rank's mean by its tokens.
    if micro == 4:
        assert out["reduced"] == pytest.approx(reference["losses"], rel=1e-5)


@pytest.mark.timeout(TIMEOUT)
def test_the_plain_contract_is_a_mean_of_means(reference):
    # What this file guards against: without items, 2 processes average the two halves' means.
    out = _spawn("ddp", 4, False)[0]
    assert rel_diff(out["state"], reference["state"]) > 1e-3


@pytest.mark.timeout(2 * TIMEOUT)
@pytest.mark.parametrize("micro", [4, 2], ids=["comm hook", "first micro-step"])
def test_the_noise_scale_reads_item_weighted_gradients_as_means(micro):
    # Sequences of one length: weighting by tokens changes nothing, so the estimate must not change.
    weighted = _spawn("ddp", micro, True, uniform=True, noise=True)[0]
    plain = _spawn("ddp", micro, False, uniform=True, noise=True)[0]
    assert weighted["noise_scale"] is not None
    assert weighted["noise_scale"] == pytest.approx(plain["noise_scale"], rel=1e-4)
    assert rel_diff(weighted["state"], plain["state"]) < 1e-5


@pytest.mark.timeout(2 * TIMEOUT)
def test_gradients_in_flight_keep_the_size_of_the_plain_contract():
    # What fp16 loss scaling and a compressed all-reduce (strategy.ddp.comm_hook fp16) see: each
    # rank's gradient before it is averaged and rescaled. A micro-step's weight is its share of the
    # tokens, so one of 2 tokens is far below the plain size and one of 24 above; in the median the
    # two are within a factor 2 (a unit scaled by the process count halves it at 2 processes).
    weighted = _spawn("ddp", 2, True, sizes=True)
    plain = _spawn("ddp", 2, False, sizes=True)
    for w, p in zip(weighted, plain):
        ratios = [a / b for a, b in zip(w["sizes"], p["sizes"])]
        assert len(ratios) == tl.STEPS * 2 * 5  # 2 micro-steps of 5 parameters' gradients per step
        assert 0.5 <= statistics.median(ratios) <= 2, statistics.median(ratios)


@pytest.mark.timeout(2 * TIMEOUT)
@pytest.mark.parametrize(
    "variant, tolerance",
    [
        ({"clip": 0.05}, 1e-5),  # optim.max_grad_norm clips the token mean, as one process clips its loss's
        ({"manual": True}, 1e-5),  # no optimizer: the loop's own update reads rescaled gradients
        ({"comm_hook": "fp16"}, 2e-3),  # gradients travel in fp16: that rounding, and no more
        ({"empty": tl.GLOBAL_BATCH // 2}, 1e-5),  # rank 0's share of every global batch is all padding
    ],
    ids=["clipping", "no optimizer", "fp16 comm hook", "a rank without tokens"],
)
def test_items_under_clipping_manual_updates_compressed_gradients_and_empty_shares(variant, tolerance):
    reference = tl.reference(clip=variant.get("clip"), empty=variant.get("empty", 0))
    if "clip" in variant:  # the clipping bites
        assert rel_diff(tl.reference()["state"], reference["state"]) > 1e-2
    ranks = _spawn("ddp", 2, True, **variant)
    assert rel_diff(ranks[0]["state"], reference["state"]) < tolerance
    assert ranks[0]["losses"] == pytest.approx(reference["losses"], rel=10 * tolerance)
    assert all(math.isfinite(r) for r in ranks[0]["reduced"])
