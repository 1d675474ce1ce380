"""`phalanx verify` end to end on CPU processes: a plain MLP script trains like one process and
resumes exactly (exit 0); the same script with a per-process BatchNorm, or with a sum loss, does
not, and the output names the cause (exit 1). A script without phalanx gets what verify can say."""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers.cli import call_phalanx, run_phalanx

MLP = textwrap.dedent(
    """
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import phalanx

    session = phalanx.Session(train={"epochs": 4})
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 8, generator=g), torch.randn(256, 1, generator=g))
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer, loader = session.setup(model, optimizer, DataLoader(data, batch_size=32, shuffle=True))
    for _ in session.epochs():
        for x, y in loader:
            with session.accumulate(model):
                session.backward(nn.functional.mse_loss(model(x), y))
    session.save()
    """
)
VARIANTS = {
    "mlp": MLP,
    "batchnorm": MLP.replace("nn.Linear(8, 32), nn.ReLU()", "nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU()"),
    "sum": MLP.replace("nn.functional.mse_loss(model(x), y)", "((model(x) - y) ** 2).sum()"),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "variant, code, words",
    [
        ("mlp", 0, "2 processes train like 1 for 4 steps"),
        ("batchnorm", 1, "- BatchNorm without sync: 1 BatchNorm layer normalises"),
        ("sum", 1, "- a sum loss: the loss is a sum"),
    ],
)
def test_verify_tells_a_script_that_trains_like_one_from_one_that_does_not(tmp_path, variant, code, words):
    (tmp_path / "train.py").write_text(VARIANTS[variant])
    result = run_phalanx("verify", "--steps", "4", "--run-dir", "runs", "train.py", cwd=tmp_path, timeout=240)
    assert result.returncode == code, result.output
    assert words in result.stdout, result.output
    assert "Traceback" not in result.output
    if code:
        assert "do not train like 1: first at step 1" in result.stdout
    else:  # every step compared, the resume too, and the user's own checkpoint directory untouched
        assert "resumed at 2 vs not" in result.stdout and result.stdout.count("equal") == 5
        assert not (tmp_path / "checkpoints").exists()


def test_verify_says_what_it_can_do_for_a_script_without_phalanx(tmp_path):
    (tmp_path / "plain.py").write_text(
        "import torch\nimport torch.distributed as dist\ndist.init_process_group('gloo')\n"
        "model = torch.nn.Linear(2, 2).cuda()\n"
    )
    result = call_phalanx("verify", "plain.py", cwd=tmp_path)
    assert result.returncode == 2
    assert "does not use phalanx.Session" in result.stdout
    assert "plain.py:4: error cuda-without-index" in result.stdout
