"""A checkpoint taken on the last step of an epoch resumes at the start of the next epoch: the loop
yields that epoch with a full loader (not the finished one with an empty pass), the resume line and
session.epoch agree, and the weights equal an uninterrupted run's (the model has dropout, so the
random generators must come back where that run had them)."""

from __future__ import annotations

import torch

from tests.helpers.checkpoints import checkpointed_session, train_through


def test_a_checkpoint_at_an_epochs_end_resumes_into_the_next_epoch(tmp_path, capsys):
    session, model, loader = checkpointed_session(tmp_path / "whole", save_every=5)  # 5 steps an epoch
    whole = train_through(session, model, loader)
    session.close()
    end_of_first = tmp_path / "whole" / "step-00000005"

    session, model, loader = checkpointed_session(tmp_path / "again", resume=str(end_of_first))
    assert (session.step_count, session.epoch) == (5, 1)  # back at setup(): epoch 2 of 2 comes next
    assert "step 5, after epoch 1" in capsys.readouterr().out
    epochs, batches = [], 0
    for epoch in session.epochs():
        epochs.append(epoch)
        for x, y in session.progress(loader):
            batches += 1
            with session.accumulate(model):
                session.backward(torch.nn.functional.mse_loss(model(x), y))
    assert (epochs, batches, session.step_count) == ([1], 5, 10)
    resumed = {k: v.clone() for k, v in session.model_state_dict().items()}
    session.close()
    for key, value in whole.items():
        assert torch.equal(value, resumed[key]), key
