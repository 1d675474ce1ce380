"""Which of a script's arguments make it another run, for ``checkpoint.resume: auto``.

The launcher cannot know the script's parser, so arguments are read the way argparse reads most
command lines: ``--name value``, ``--name=value``, ``-x value``, ``-xVALUE`` and ``-x=value`` are an
option with its value; an option followed by another option (or nothing) is a flag; a token that
looks like a number (``-3``, ``-1e-4``) is a value; everything after ``--`` and every other token is
a positional. Options are compared as a multiset of (name, value) pairs, so their order does not
count; positionals keep their order among themselves (``cp a b`` is not ``cp b a``).

Options that only lengthen or observe training (``IGNORED``, plus ``checkpoint.ignore_args``) are
dropped with their values before the comparison: raising ``--epochs`` is the most ordinary resume,
and a print frequency or a resume path changes no number training computes.
"""

from __future__ import annotations

import re
import shlex
from collections import Counter
from typing import Iterable, NamedTuple, Sequence

# The spellings of the pytorch/examples, timm, Hugging Face and nanoGPT scripts. Each either
# lengthens training (as train.epochs and train.max_steps do, which do not count either) or only
# observes it: how often to print, log or save, and where from to resume.
IGNORED = frozenset(
    {
        "--epochs", "--num-epochs", "--num_epochs", "--num_train_epochs",
        "--max-steps", "--max_steps", "--max-iters", "--max_iters",
        "-p", "--print-freq", "--print_freq", "--log-interval", "--log_interval", "--log-every", "--log_every",
        "--logging_steps", "--save-every", "--save_every", "--save-freq", "--save_freq", "--save-interval",
        "--save_interval", "--save_steps", "--resume", "--resume-from", "--resume_from",
        "--resume-from-checkpoint", "--resume_from_checkpoint",
    }
)  # fmt: skip

_NUMBER = re.compile(r"-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


class Parsed(NamedTuple):
    options: Counter  # (name, value or None) -> how often it was given
    positionals: tuple[str, ...]


def parse(args: Sequence[str], skip: Iterable[str] = ()) -> Parsed:
    """``args`` as options and positionals, without the options named in ``skip``."""
    skip = set(skip)
    options: Counter = Counter()
    positionals: list[str] = []
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        if token == "--":
            positionals += args[i:]
            break
        if not _is_option(token):
            positionals.append(token)
            continue
        name, value = _split(token)
        if value is None and i < len(args) and not _is_option(args[i]) and args[i] != "--":
            value = args[i]
            i += 1
        if name not in skip:
            options[(name, value)] += 1
    return Parsed(options, tuple(positionals))


def differences(saved: Sequence[str], now: Sequence[str], ignored: Iterable[str] = ()) -> list[str]:
    """One phrase per counted option whose values differ (``--lr 0.1 (checkpoint) vs --lr 0.2 (now)``),
    in the order the options first appear, then the positionals when they differ; ``ignored`` adds to
    ``IGNORED``. Nothing is cut short: the phrase names exactly what differs."""
    skip = IGNORED | set(ignored)
    old, new = parse(saved, skip), parse(now, skip)
    names = dict.fromkeys(name for name, _ in [*old.options, *new.options])
    out = []
    for name in names:
        was, is_ = _values(old.options, name), _values(new.options, name)
        if Counter(was) != Counter(is_):
            out.append(f"script argument {_show(name, was)} (checkpoint) vs {_show(name, is_)} (now)")
    if old.positionals != new.positionals:
        was, is_ = _join(old.positionals), _join(new.positionals)
        out.append(f"script positional arguments {was} (checkpoint) vs {is_} (now)")
    return out


def _is_option(token: str) -> bool:
    return token.startswith("-") and token != "-" and not _NUMBER.fullmatch(token)


def _split(token: str) -> tuple[str, str | None]:
    if not token.startswith("--") and len(token) > 2:  # -p5, -p=5: a short option and its value, as argparse
        return token[:2], token[3:] if token[2] == "=" else token[2:]
    name, equals, value = token.partition("=")
    return (name, value) if equals else (token, None)


def _values(options: Counter, name: str) -> list[str | None]:
    return sorted((value for (n, value), count in options.items() if n == name for _ in range(count)), key=str)


def _show(name: str, values: list[str | None]) -> str:
    if not values:
        return f"without {name}"
    return " ".join(name if value is None else f"{name} {shlex.quote(value)}" for value in values)


def _join(tokens: Sequence[str]) -> str:
    return shlex.join(tokens) if tokens else "(none)"
