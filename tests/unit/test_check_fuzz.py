"""``check_source`` on any text: findings, or CheckInputError, and nothing else."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phalanx.check import CheckInputError, check_source

VALID = (Path(__file__).resolve().parents[1] / "data" / "check_planted" / "scheduler_per_micro_step.py").read_text()
LINES = VALID.splitlines(keepends=True)


def _checked(source: str) -> None:
    try:
        findings = check_source(source, "s.py")
    except CheckInputError as err:
        assert "\n" not in str(err)
        return
    assert findings == sorted(findings, key=lambda f: (f.path, f.line, f.rule, f.message))
    assert all(1 <= f.line <= max(1, source.count("\n") + 1) for f in findings)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text())
def test_any_text(source):
    _checked(source)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, len(LINES) - 1), st.sampled_from(["drop", "dedent", "indent", "dup", "cut"])),
        max_size=6,
    )
)
def test_mutations_of_a_valid_script(edits):
    lines = list(LINES)
    for index, edit in edits:
        index %= len(lines) or 1
        if not lines:
            break
        if edit == "drop":
            del lines[index]
        elif edit == "dedent":
            lines[index] = lines[index].lstrip()
        elif edit == "indent":
            lines[index] = "    " + lines[index]
        elif edit == "dup":
            lines.insert(index, lines[index])
        else:
            lines[index] = lines[index][: len(lines[index]) // 2] + "\n"
    _checked("".join(lines))
