"""Issue 14, friction 7: `phalanx plan` takes example inputs from the user, a function returning one
micro-batch's inputs, for a model whose forward takes a second argument (a carried hidden state) and
reads its tokens sequence-first; the activations it measures are the model's own, as a hand-written
batch-first wrapper around the same model measures them."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn

from phalanx.cli.main import main
from phalanx.errors import PhalanxError
from phalanx.plan import measure_activations

SEQ, VOCAB, WIDTH = 12, 50, 16


class SequenceFirstLM(nn.Module):
    """tokens [SEQ, B] and a hidden state [B, WIDTH], as a word-level language model's loop carries it."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(2 * WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens, hidden):
        steps = []
        for x in self.embed(tokens):  # time is the first dimension
            hidden = torch.tanh(self.mix(torch.cat([x, hidden], dim=1)))
            steps.append(hidden)
        return self.out(torch.stack(steps)), hidden


class BatchFirst(nn.Module):
    """The 9-line wrapper a user had to write before --inputs existed."""

    def __init__(self):
        super().__init__()
        self.lm = SequenceFirstLM()

    def forward(self, tokens):
        return self.lm(tokens.t(), torch.zeros(tokens.shape[0], WIDTH, device=tokens.device))


def example_batch(batch_size):
    return torch.zeros(SEQ, batch_size, dtype=torch.long), torch.zeros(batch_size, WIDTH)


def example_keywords(batch_size):
    return {"tokens": torch.zeros(SEQ, batch_size, dtype=torch.long), "hidden": torch.zeros(batch_size, WIDTH)}


def broken(batch_size):
    raise ValueError("no data here")


def not_inputs(batch_size):
    return "tokens"


@pytest.fixture
def importable(monkeypatch):
    # The CLI imports --model and --inputs by name, as it would a user's module.
    monkeypatch.setitem(sys.modules, "plan_inputs_example", sys.modules[__name__])


@pytest.mark.parametrize("function", [example_batch, example_keywords], ids=["tuple", "dict"])
def test_inputs_measure_what_a_batch_first_wrapper_measures(function):
    mine = measure_activations(SequenceFirstLM, {}, None, torch.long, "fp32", inputs=function, inputs_name="x:y")
    wrapped = measure_activations(BatchFirst, {}, (SEQ,), torch.long, "fp32")
    assert mine.per_sample > 0
    assert mine.per_sample == pytest.approx(wrapped.per_sample)
    assert mine.fixed == pytest.approx(wrapped.fixed)


def test_a_shape_alone_cannot_feed_a_second_argument_and_says_what_to_give():
    with pytest.raises(PhalanxError, match="give --inputs MODULE:FUNCTION"):
        measure_activations(SequenceFirstLM, {}, (SEQ,), torch.long, "fp32")


def test_cli_inputs_flag(importable, capsys):
    argv = ["plan", "--model", "plan_inputs_example:SequenceFirstLM", "--inputs", "plan_inputs_example:example_batch"]
    assert main([*argv, "--micro-batch", "8", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    expected = measure_activations(BatchFirst, {}, (SEQ,), torch.long, "fp32").at(8)
    (ddp,) = [row for row in document["rows"] if row["strategy"] == "ddp"]
    assert ddp["activations"] == pytest.approx(expected)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--inputs", "plan_inputs_example:broken"], "--inputs plan_inputs_example:broken failed for a micro-batch"),
        (["--inputs", "plan_inputs_example:not_inputs"], "returned a str; return one micro-batch's inputs"),
        (["--inputs", "plan_inputs_example:missing"], "has no callable 'missing'"),
        (["--inputs", "nocolon"], "--inputs expects package.module:function"),
        (["--inputs", "plan_inputs_example:example_batch", "--input-shape", "12"], "give --inputs or --input-shape"),
        ([], "--input-shape is needed with --model: one sample's shape without the batch, e.g. 3,224,224 (or --inputs"),
    ],
)
def test_bad_inputs_are_one_line(importable, capsys, extra, message):
    assert main(["plan", "--model", "plan_inputs_example:SequenceFirstLM", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
