"""session.json: what the Session writes at setup for tune (and any other program) to read, read
back the same, absent as None, and corrupt as one clear line."""

from __future__ import annotations

import json

import pytest
import torch

from phalanx.config.batch import BatchPlan
from phalanx.errors import PhalanxError
from phalanx.session.facts import FILE_NAME, ModelFacts, read_run_facts, write_run_facts


def _write(run_dir, **changes):
    frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    keywords = dict(
        strategy="ddp",
        strategy_description="ddp over 2 processes (bucket 25 MiB)",
        device=torch.device("cpu"),
        precision="bf16",
        batch=BatchPlan(64, 16, 2, 2),
        models=[torch.nn.Linear(8, 16), torch.nn.Sequential(torch.nn.Linear(16, 2), frozen)],
        lr_scaling="lr x 1 (linear rule, reference batch 64)",
        config_sources={
            "batch.micro_batch_size": "code",
            "strategy.name": "--set",
            "train.seed": "default",
            "optim.lr_scaling": "code",
        },
    )
    return write_run_facts(run_dir, **{**keywords, **changes})


def test_round_trip(tmp_path):
    path = _write(tmp_path)
    assert path == tmp_path / FILE_NAME
    assert [p.name for p in tmp_path.iterdir()] == [FILE_NAME]  # the temporary file was renamed
    document = json.loads(path.read_text())
    assert (document["format"], document["version"]) == ("phalanx-session", 1)
    assert document["total"] == {"trainable_parameters": 144 + 34, "gradient_bytes": 4 * (144 + 34)}
    facts = read_run_facts(tmp_path)
    assert (facts.strategy, facts.strategy_description, facts.device, facts.precision) == (
        "ddp",
        "ddp over 2 processes (bucket 25 MiB)",
        "cpu",
        "bf16",
    )
    assert facts.batch == BatchPlan(64, 16, 2, 2)
    assert facts.models == (ModelFacts(144, 576), ModelFacts(34, 136))  # the frozen layer holds no gradients
    assert (facts.trainable_parameters, facts.gradient_bytes) == (178, 712)
    assert facts.lr_scaling == "lr x 1 (linear rule, reference batch 64)"
    assert facts.code_settings == {"batch.micro_batch_size", "optim.lr_scaling"}


def test_no_batch_plan_and_no_model(tmp_path):
    _write(tmp_path, batch=None, models=[], lr_scaling=None, config_sources={}, device="cuda")
    facts = read_run_facts(tmp_path)
    assert facts.batch is None and facts.models == () and facts.gradient_bytes == 0
    assert facts.lr_scaling is None and facts.code_settings == frozenset() and facts.device == "cuda"


def test_an_absent_file_is_none(tmp_path):
    assert read_run_facts(tmp_path) is None
    assert read_run_facts(tmp_path / "no such run") is None


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"format": "phalanx-session", "version": 1, "strat', "is not valid JSON"),
        ("[1, 2]", "is not a phalanx session file"),
        ('{"format": "other", "version": 1}', "is not a phalanx session file"),
        ('{"format": "phalanx-session", "version": 7}', "has version 7; this phalanx reads version 1"),
        (
            '{"format": "phalanx-session", "version": 1, "strategy": "ddp"}',
            "is not a valid phalanx session file (no 'batch')",
        ),
    ],
)
def test_a_corrupt_file_is_one_line(tmp_path, text, message):
    _write(tmp_path)
    (tmp_path / FILE_NAME).write_text(text)
    with pytest.raises(PhalanxError) as caught:
        read_run_facts(tmp_path)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert str(tmp_path / FILE_NAME) in str(caught.value)


def test_a_wrong_field_type_is_one_line(tmp_path):
    _write(tmp_path)
    document = json.loads((tmp_path / FILE_NAME).read_text())
    document["batch"] = {"global_batch_size": "many"}
    (tmp_path / FILE_NAME).write_text(json.dumps(document))
    with pytest.raises(PhalanxError, match="is not a valid phalanx session file") as caught:
        read_run_facts(tmp_path)
    assert "\n" not in str(caught.value)
