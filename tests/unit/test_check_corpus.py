"""``phalanx check`` on real, correct training scripts: public ones (tests/data/check_corpus) and
phalanx's own examples. An error here is a false alarm; the warnings are the ones looked at and
kept (each is true of its script)."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.check import check_file

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(
    [
        *(REPO / "tests" / "data" / "check_corpus").glob("*.py"),
        *(REPO / "examples").rglob("*.py"),
        REPO / "src" / "phalanx" / "demo" / "train.py",
    ]
)
WARNINGS = {  # script -> the warnings it is known to give (rule, line)
    "tests/data/check_corpus/fsdp2_example.py": [("sum-loss", 101)],  # loss = model(x).sum()
    "tests/data/check_corpus/imagenet_main.py": [("data-parallel", 191), ("data-parallel", 194)],
    "examples/imagenet/main_original.py": [("data-parallel", 212), ("data-parallel", 215)],
}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_real_scripts_give_no_error(script):
    findings = check_file(script)
    name = str(script.relative_to(REPO))
    assert [f for f in findings if f.severity == "error"] == []
    assert [(f.rule, f.line) for f in findings] == WARNINGS.get(name, [])


def test_the_corpus_is_there():
    names = {p.name for p in SCRIPTS}
    assert {"nanogpt_train.py", "ddp_tutorial_multigpu.py", "imagenet_main.py", "fsdp2_example.py"} <= names
