"""`phalanx plan --input-shape` feeds the forward one tensor; a forward that takes more inputs (a
nanoGPT-style `forward(idx, targets=None)`, which without targets returns only the last position's
logits) is refused in one line pointing at --inputs, instead of measuring another path quietly."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from tests.helpers.cli import REPO, call_phalanx

VOCAB, WIDTH, CONTEXT = 32, 8, 16
HERE = __name__  # the CLI imports --model and --inputs from this module by name


class NanoGPTLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx, targets=None):
        logits = self.head(self.embed(idx))
        if targets is None:
            return logits[:, [-1], :]  # inference: the last position only
        return nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


class KeywordOnly(NanoGPTLike):
    def forward(self, idx, *, targets=None):
        return super().forward(idx, targets)


class OneInput(NanoGPTLike):
    def forward(self, idx, *args, **kwargs):  # variadic parameters are not inputs --input-shape misses
        return super().forward(idx, idx)


def training_batch(batch_size):
    idx = torch.zeros(batch_size, CONTEXT, dtype=torch.long)
    return idx, idx


def _plan(*args):
    return call_phalanx("plan", "--micro-batch", "4", "--devices", "2", *args, cwd=REPO)


@pytest.mark.parametrize("model, shown", [("NanoGPTLike", "(idx, targets=...)"), ("KeywordOnly", "(idx, targets=...)")])
def test_a_forward_with_more_inputs_than_the_shape_gives_is_refused_in_one_line(model, shown):
    result = _plan("--model", f"{HERE}:{model}", "--input-shape", str(CONTEXT), "--input-dtype", "long")
    assert result.returncode == 2, result.output
    assert "Traceback" not in result.output and result.stderr.count("\n") == 1, result.stderr
    assert f"{model}.forward takes 2 inputs {shown}" in result.stderr
    assert "give --inputs MODULE:FUNCTION" in result.stderr


def test_the_inputs_it_points_to_measure_the_training_path():
    result = _plan("--model", f"{HERE}:NanoGPTLike", "--inputs", f"{HERE}:training_batch", "--json")
    assert result.returncode == 0, result.output
    assert json.loads(result.stdout)["activations_measured_on"] in ("meta", "cpu")


def test_a_forward_of_one_input_still_takes_a_shape():
    result = _plan("--model", f"{HERE}:OneInput", "--input-shape", str(CONTEXT), "--input-dtype", "long", "--json")
    assert result.returncode == 0, result.output
    assert json.loads(result.stdout)["rows"]
