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


def sigterm_drill(script: str) -> str:
    """A script that runs ``script`` unchanged (its folder first on sys.path, as ``python script``
    puts it), each optimizer step paced by $STEP_PAUSE seconds and, at step $SIGTERM_AT, rank 0
    signalling the launcher (its parent) as a scheduler would. The pace matters: phalanx agrees on
    a stop about once a second of steps, and small examples take milliseconds a step."""
    return textwrap.dedent(
        f"""
        import os, runpy, signal, sys, time
        import phalanx

        at, pause = int(os.environ.get("SIGTERM_AT", "0")), float(os.environ.get("STEP_PAUSE", "0"))
        step = phalanx.Session.step


        def paced_step(self):
            step(self)
            time.sleep(pause)
            if self.is_main and self.step_count == at:
                os.kill(os.getppid(), signal.SIGTERM)


        phalanx.Session.step = paced_step
        sys.argv[0] = {script!r}
        sys.path.insert(0, os.path.dirname(sys.argv[0]))
        runpy.run_path(sys.argv[0], run_name="__main__")
        """
    )
