"""Small training scripts that tests write into tmp_path and run through `phalanx launch`."""

from __future__ import annotations

import textwrap


def tiny_training(samples: int, *, before_step: str = "pass", **session_kwargs) -> str:
    """A script that trains a two-layer MLP with a Session on ``samples`` random samples, 16 per
    global batch; ``before_step`` is a line run before every micro-step (``session`` in scope)."""
    return textwrap.dedent(
        f"""
        import time
        import torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset
        import phalanx

        session = phalanx.Session(train={{"progress": False}}, **{session_kwargs!r})
        data = TensorDataset(torch.randn({samples}, 8), torch.randn({samples}, 1))
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        model, optimizer, loader = session.setup(model, optimizer, DataLoader(data, batch_size=16, shuffle=True))
        for _ in session.epochs():
            for x, y in loader:
                {before_step}
                with session.accumulate(model):
                    session.backward(nn.functional.mse_loss(model(x), y))
        session.close()
        """
    )
