"""A plain checkpoint whose files were swapped for others and whose manifest was rewritten to
match them (so every SHA-256 checks out) is refused by session.load() in one line naming the file,
not with a TypeError or KeyError from inside torch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from phalanx.checkpoint import files
from phalanx.errors import PhalanxError
from tests.helpers.checkpoints import checkpointed_session, saved_checkpoint


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    return saved_checkpoint(tmp_path_factory.mktemp("original"))


def _forge(original: Path, tmp_path: Path, name: str, transform) -> Path:
    """A copy of the checkpoint with ``name`` replaced by ``transform(its content)`` and the manifest
    re-hashed to fit."""
    target = tmp_path / "forged" / original.name
    shutil.copytree(original, target)
    content = torch.load(target / name, weights_only=True)
    torch.save(transform(content), target / name)
    manifest = json.loads((target / files.MANIFEST).read_text())
    manifest["files"][name] = files.describe_file(target / name)
    (target / files.MANIFEST).write_text(json.dumps(manifest))
    return target


def _drop(key):
    return lambda d: {k: v for k, v in d.items() if k != key}


CASES = {
    "model.pt holds a dict": ("model.pt", lambda models: models[0], "model.pt"),
    "model.pt maps a name to text": ("model.pt", lambda models: [{k: "x" for k in models[0]}], "not a tensor"),
    "model.pt misses a key": ("model.pt", lambda models: [_drop(next(iter(models[0])))(models[0])], "do not fit"),
    "optimizer.pt holds a number": ("optimizer.pt", lambda _: 3, "optimizer state dict"),
    "trainer.pt lacks schedulers": ("trainer.pt", _drop("schedulers"), "no 'schedulers'"),
    "trainer.pt step is text": ("trainer.pt", lambda t: {**t, "step": "ten"}, "'step' is a str"),
    "rng.pt holds a list": ("rng.pt", lambda _: [1, 2], "world_size"),
    "rng.pt has too few ranks": ("rng.pt", lambda r: {**r, "ranks": []}, "rank states"),
}


@pytest.mark.parametrize("case", CASES)
def test_forged_file_content_is_one_line_naming_the_file(original, tmp_path, case):
    name, transform, piece = CASES[case]
    forged = _forge(original, tmp_path, name, transform)
    session, _, _ = checkpointed_session(tmp_path / "fresh")
    try:
        with pytest.raises(PhalanxError) as refused:
            session.load(forged)
    finally:
        session.close()
    line = str(refused.value)
    assert "\n" not in line and name in line and piece in line, line
