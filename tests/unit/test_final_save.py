"""A final ``session.save()`` after the ``session.epochs()`` loop (docs/checkpoints.md's pattern)
records the epochs done, not one more; relaunching with a higher epoch count trains exactly the
added epochs, with a per-epoch scheduler the script steps itself; relaunching a finished run says
so in one line."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from phalanx import Config, Session
from phalanx.checkpoint.export import progress_words
from phalanx.checkpoint.files import read_manifest
from tests.helpers.models import make_data, make_model


def _script(directory, epochs: int, resume: str = "auto"):
    """A vision script's shape: StepLR stepped by the script at each epoch's end, a final save."""
    session = Session(
        Config(),
        train={"progress": False},
        batch={"global_batch_size": 8},
        checkpoint={"dir": str(directory), "resume": resume},
    )
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loader = DataLoader(make_data(32), batch_size=8, shuffle=True)
    model, optimizer, loader, scheduler = session.setup(model, optimizer, loader, scheduler)
    start = session.step_count
    for _ in session.epochs(epochs):
        for x, y in loader:
            with session.accumulate(model):
                session.backward(F.mse_loss(model(x), y))
        scheduler.step()
    saved = session.save()
    result = {
        "saved": saved,
        "trained": session.step_count - start,
        "state": {k: v.clone() for k, v in session.model_state_dict().items()},
        "lr": optimizer.param_groups[0]["lr"],
    }
    session.close()
    return result


def test_a_final_save_records_the_epochs_done_and_more_epochs_train_on(tmp_path, capsys):
    whole = _script(tmp_path / "whole", epochs=2, resume="never")
    one = _script(tmp_path / "run", epochs=1)
    assert one["trained"] == 4
    assert "after epoch 1" in progress_words(read_manifest(one["saved"]))
    capsys.readouterr()

    more = _script(tmp_path / "run", epochs=2)  # the script's --epochs raised from 1 to 2
    assert more["trained"] == 4  # exactly the added epoch
    assert more["lr"] == whole["lr"] == 0.1 * 0.5**2
    for key, value in whole["state"].items():
        assert torch.equal(value, more["state"][key]), key
    assert "had finished" not in capsys.readouterr().out

    again = _script(tmp_path / "run", epochs=2)  # a relaunch of the finished run
    assert again["trained"] == 0
    out = capsys.readouterr().out
    assert "the checkpoint's run had finished its 2 epoch(s): nothing to train" in out
