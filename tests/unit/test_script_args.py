"""Issue 41: a resume compares the script's arguments as options, not as one string. Hypothesis
over argument lists: their order does not count, exactly the options outside the ignored ones do,
and a difference names the option with both values, uncut."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.checkpoint import script_args
from phalanx.checkpoint.script_args import IGNORED

FAST = settings(derandomize=True, database=None, max_examples=300, deadline=None)

NAMES = ["--lr", "--batch-size", "-b", "--arch", "--amp", "--epochs", "--epochs", "-p", "--resume", "--seed", "-j"]
EXTRA = ["--seed"]  # what a user adds with checkpoint.ignore_args
VALUES = st.one_of(
    st.none(),  # a flag
    st.sampled_from(["0.1", "0.2", "-3", "-1e-4", "resnet18", "a b", "x=y", "", "checkpoints"]),
    st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=8).filter(
        lambda v: not v.startswith("-")
    ),
)
UNITS = st.lists(st.tuples(st.sampled_from(NAMES), VALUES, st.booleans()), max_size=6)
POSITIONALS = st.lists(st.sampled_from(["data/", "train.txt", "3"]), max_size=2)


def _render(positionals: list[str], units: list[tuple[str, str | None, bool]]) -> list[str]:
    """Positionals first (where a parser cannot mistake one for a flag's value), then the options,
    each as ``--name value`` or, when ``joined``, ``--name=value`` / ``-bVALUE``."""
    out = list(positionals)
    for name, value, joined in units:
        if value is None:
            out.append(name)
        elif joined and len(name) == 2 and value and not value.startswith("="):
            out.append(f"{name}{value}")
        elif joined:
            out.append(f"{name}={value}")
        else:
            out += [name, value]
    return out


def _counted(units) -> Counter:
    return Counter((name, value) for name, value, _ in units if name not in IGNORED and name not in EXTRA)


@FAST
@given(POSITIONALS, UNITS, st.randoms(use_true_random=False))
def test_the_order_of_options_and_how_they_are_written_do_not_count(positionals, units, rnd: random.Random):
    shuffled = [(name, value, not joined) for name, value, joined in units]
    rnd.shuffle(shuffled)
    assert script_args.differences(_render(positionals, units), _render(positionals, shuffled)) == []


@FAST
@given(POSITIONALS, UNITS, UNITS)
def test_exactly_the_options_not_ignored_count(positionals, saved, now):
    found = script_args.differences(_render(positionals, saved), _render(positionals, now), EXTRA)
    old, new = _counted(saved), _counted(now)
    differing = {name for name in {n for n, _ in old | new} if _of(old, name) != _of(new, name)}
    named = {_named(phrase) for phrase in found}
    assert named == differing
    for phrase in found:
        assert phrase.startswith("script argument ") and " (checkpoint) vs " in phrase and phrase.endswith(" (now)")


def _of(options: Counter, name: str) -> Counter:
    return Counter({value: n for (option, value), n in options.items() if option == name})


def _named(phrase: str) -> str:
    words = phrase.removeprefix("script argument ").split()
    return words[1] if words[0] == "without" else words[0]


def test_a_difference_shows_the_option_with_both_values_uncut():
    long = "x" * 200
    saved = ["--data", long, "--lr", "0.1", "--epochs", "1"]
    now = ["--epochs=2", "--resume", "checkpoints", "--lr=0.2", "--data", long, "-p", "5", "--amp"]
    assert script_args.differences(saved, now) == [
        "script argument --lr 0.1 (checkpoint) vs --lr 0.2 (now)",
        "script argument without --amp (checkpoint) vs --amp (now)",
    ]
    assert script_args.differences(["a", "b"], ["b", "a"]) == [
        "script positional arguments a b (checkpoint) vs b a (now)"
    ]
    assert script_args.differences(["--name", "a b"], ["--name", "c"]) == [
        "script argument --name 'a b' (checkpoint) vs --name c (now)"
    ]


def test_parsing_reads_values_flags_numbers_and_the_end_of_options():
    parsed = script_args.parse(["-b64", "--lr", "-1e-4", "--amp", "-j", "4", "data", "--", "--lr", "9"])
    assert parsed.options == Counter({("-b", "64"): 1, ("--lr", "-1e-4"): 1, ("--amp", None): 1, ("-j", "4"): 1})
    assert parsed.positionals == ("data", "--lr", "9")
    assert script_args.parse(["-p5", "--print-freq=10", "--keep"], skip=IGNORED).options == Counter(
        {("--keep", None): 1}
    )
