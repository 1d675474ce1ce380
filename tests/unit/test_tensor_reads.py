"""phalanx reads no tensor back to the host in the middle of a step (issue 26): only at its
documented read points (tests/helpers/tensor_reads.py), one process here, several in
tests/integration/test_tensor_reads.py."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.tensor_reads import counting, train_and_count

CASES = {
    "defaults": {},
    "accumulation, noise scale, clipping": {
        "batch": {"global_batch_size": 32, "micro_batch_size": 8},
        "optim": {"max_grad_norm": 1.0},
    },
    "noise scale every step": {
        "batch": {"global_batch_size": 32, "micro_batch_size": 16},
        "train": {"noise_scale_every": 1},
    },
    "batch.adaptive": {
        "batch": {"global_batch_size": 32, "micro_batch_size": 8, "adaptive": "goodput", "adapt_every": 10},
    },
    "fp16 loss scaling": {"precision": {"mode": "fp16"}},
    "no metrics, no bar": {"train": {"metrics": False, "progress": False}},
}


@pytest.mark.parametrize("sections", CASES.values(), ids=CASES.keys())
def test_no_read_of_the_device_outside_a_read_point(sections, capsys):
    out = train_and_count(sections, steps=60)
    assert out["stepped"] >= 30  # batch.adaptive may have grown the batch
    assert out["stray"] == "", out["stray"]


def test_a_token_weighted_loss_reads_nothing_per_step(capsys):
    out = train_and_count({"batch": {"global_batch_size": 32, "micro_batch_size": 16}}, steps=40, items=True)
    assert out["stray"] == "", out["stray"]


def test_the_counter_sees_a_read_in_phalanx_and_not_one_in_the_test():
    """The counter itself: a read in this file is not phalanx's; one made by phalanx code is."""
    from phalanx.util.tree import map_tensors  # phalanx code that calls what it is given

    with counting() as reads:
        reads.counting = True
        float(torch.ones(()))  # the test's own read
        map_tensors([torch.ones(())], lambda t: t.item())  # the lambda is this file's: not counted
        assert not reads.stray
        from phalanx.metrics import rows

        rows.read_numbers([torch.ones(())])  # phalanx's read, outside a flush
    assert any(fn == "read_numbers" for (_, _, fn, _) in reads.stray), reads.stray
