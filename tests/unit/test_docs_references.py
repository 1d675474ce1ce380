"""Docs that cannot go stale silently: every repository path, every ``phalanx`` command and every
flag of one that the pages cite exists. A renamed module or a removed flag fails here, with the
page and line of each citation, instead of surviving in the docs until a user tries it.

What is checked, on README.md, benchmarks/README.md, docs/*.md and docs/strategies/*.md:

- paths from the repository root (``src/...``, ``benchmarks/...``, ``tests/...``, ``docs/...``,
  ``examples/...``, ``scripts/...``, ``shared/...``) anywhere in the text; a path with a
  placeholder (``<name>``) or a glob (``*``) must match at least one file, unless ALLOWED says why
  it cannot;
- module paths inside the package (``session/state.py``, ``phalanx/_torch_compat.py``): under
  src/phalanx;
- in benchmarks/README.md, the scripts it names (``compare.py``, ``peers/common.py``): next to it,
  and every script there is named;
- markdown link targets that are files: relative to the page;
- in code (inline spans and fenced blocks), every command line that runs ``phalanx``: its command
  and sub-command, and each flag it gives up to the script (whose own flags are the script's), as
  the real parser declares them (``phalanx.cli.main.build_parser()``).
"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from phalanx.cli.main import build_parser

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "src" / "phalanx"
ROOTS = ("src", "benchmarks", "tests", "docs", "examples", "scripts", "shared")

# Cited on purpose though no file matches; each entry says why.
ALLOWED = {
    "docs/gpu-check-<date>.json": "where a GPU run's JSON is to be recorded (docs/gpu-status.md); none has run yet",
}


def pages() -> list[Path]:
    found = [*REPO.glob("docs/*.md"), *REPO.glob("docs/strategies/*.md"), REPO / "README.md"]
    return sorted({*found, REPO / "benchmarks" / "README.md"})


# ------------------------------------------------------------------------------------------ paths

# A path starts after a space, a quote, a bracket or a backquote, never inside a longer path or a
# URL (github.com/.../docs/x.md is not this repository's docs/).
_EDGE = r"(?<![\w./~:@-])"
_ROOT_PATH = re.compile(_EDGE + rf"((?:{'|'.join(ROOTS)})/[\w.*<>/-]*)")
_PACKAGES = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
_MODULE_PATH = re.compile(_EDGE + rf"((?:phalanx/)?(?:{'|'.join(_PACKAGES)})/[\w/]*\w\.py|phalanx/\w+\.py)\b")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _exists(path: str, base: Path) -> bool:
    if "<" in path or "*" in path:
        pattern = re.sub(r"<[^>/]*>", "*", path)
        return any(base.glob(pattern))
    return (base / path).exists()


def path_problems(page: str, text: str) -> list[str]:
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in _ROOT_PATH.finditer(line):
            path = match.group(1).rstrip(".")  # the end of a sentence
            if path.rstrip("/") in ROOTS or path in ALLOWED:
                continue
            if not _exists(path.rstrip("/"), REPO):
                out.append(f"{page}:{number}: {path} is not in the repository")
        for match in _MODULE_PATH.finditer(line):
            if not (PACKAGE / match.group(1).removeprefix("phalanx/")).is_file():
                out.append(f"{page}:{number}: {match.group(1)} is not in src/phalanx")
    return out


_BARE_FILE = re.compile(r"`([\w/-]+\.(?:py|sh|yaml))`")


def local_file_problems(page: Path, text: str) -> list[str]:
    """benchmarks/README.md names its scripts as `compare.py`, `peers/common.py`: next to it."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in _BARE_FILE.finditer(line):
            name = match.group(1)
            if _ROOT_PATH.match(name) or _MODULE_PATH.match(name):
                continue  # checked from the repository root or the package
            if not (page.parent / name).is_file():
                out.append(f"{_name(page)}:{number}: {name} is not in {_name(page.parent)}/")
    return out


def link_problems(page: Path, text: str) -> list[str]:
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in _LINK.finditer(line):
            target = match.group(1).split("#", 1)[0]
            if not target or re.match(r"[a-z]+:", target):  # an anchor on the page, or a URL
                continue
            if not (page.parent / target).exists():
                out.append(f"{_name(page)}:{number}: the link to {target} leads nowhere")
    return out


# --------------------------------------------------------------------------------------- commands

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE = re.compile(r"(`+)(.+?)\1")
_PLACEHOLDER = re.compile(r"^(\.\.\.|…|<[^>]*>|\[[^\]]*\]|[A-Z][A-Z_]*)$")  # `...`, `<script>`, `[flags]`, COMMAND
_LAUNCHERS = {"$", "sudo", "exec", "time", "nice", "-m", "python", "python3", "torchrun", "env"}


@dataclass(frozen=True)
class Code:
    line: int
    text: str


def code_lines(text: str) -> list[Code]:
    """Each fenced line (continuation lines joined) and each inline code span, with its line number."""
    out: list[Code] = []
    fenced = False
    pending: Code | None = None
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            if pending is not None:
                pending = Code(pending.line, pending.text + " " + line.strip())
            else:
                pending = Code(number, line)
            if pending.text.endswith("\\"):
                pending = Code(pending.line, pending.text[:-1])
                continue
            out.append(pending)
            pending = None
        else:
            out += [Code(number, m.group(2)) for m in _INLINE.finditer(line)]
    return out


def _commands(code: str) -> list[list[str]]:
    """The argument lists after ``phalanx`` of each command on one line of code. Not split at ``;``:
    in the pages that is a sentence's (a quoted message, a row of output), not a shell's."""
    out = []
    for segment in re.split(r"&&|\|\||\s\|\s", code):
        try:
            tokens = shlex.split(segment, comments=True)
        except ValueError:  # an unclosed quote: a fragment of a longer line
            tokens = segment.split()
        while tokens and (tokens[0] in _LAUNCHERS or re.match(r"^[A-Z_]+=", tokens[0]) or "python" in tokens[0]):
            tokens = tokens[1:]
        if not tokens or not (tokens[0] == "phalanx" or tokens[0].endswith("/phalanx")):
            continue
        args = tokens[1:]
        # Output (`phalanx bench: ...`, a table row `phalanx  15  9`) and quoted prose (a token
        # ending a clause) name no command.
        if args and not re.match(r"^(-|[a-z][a-z-]*$)", args[0]) and not _PLACEHOLDER.match(args[0]):
            continue
        if any(re.search(r"([,;:]|[^.]\.)$", a) for a in args):
            continue
        out.append(args)
    return out


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _takes_script(parser: argparse.ArgumentParser) -> bool:
    """The command runs a script whose own arguments follow it (launch, bench, tune)."""
    return any(a.nargs == argparse.REMAINDER for a in parser._actions if not a.option_strings)


def _flag_problems(parser: argparse.ArgumentParser, args: list[str], where: str, said: str) -> list[str]:
    out = []
    options = parser._option_string_actions
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        if _PLACEHOLDER.match(arg):
            continue
        if not arg.startswith("-") or re.match(r"^-\d", arg):
            if _takes_script(parser):
                break  # the script: what follows are its flags, not phalanx's
            continue
        name = arg.split("=", 1)[0]
        action = options.get(name)
        if action is None:
            out.append(f"{where}: `{said}` has no flag {name} (`{said}`: {' '.join(sorted(options))})")
        elif action.nargs != 0 and "=" not in arg:
            skip = True  # its value
    return out


def command_problems(page: str, text: str, parser: argparse.ArgumentParser) -> list[str]:
    out = []
    commands = _subcommands(parser)
    every_flag = {flag for sub in commands.values() for flag in sub._option_string_actions}
    for code in code_lines(text):
        where = f"{page}:{code.line}"
        for args in _commands(code.text):
            if not args or args[0].startswith("-"):
                out += _flag_problems(parser, args, where, "phalanx")
                continue
            if _PLACEHOLDER.match(args[0]):  # `phalanx ... --flag`: the flag of some command
                unknown = [
                    a.split("=")[0] for a in args[1:] if a.startswith("--") and a.split("=")[0] not in every_flag
                ]
                out += [f"{where}: no phalanx command has a flag {flag}" for flag in unknown]
                continue
            if args[0] not in commands:
                out.append(f"{where}: phalanx has no command {args[0]!r} (it has {', '.join(commands)})")
                continue
            said, sub, rest = f"phalanx {args[0]}", commands[args[0]], args[1:]
            nested = _subcommands(sub)
            if nested and rest and not rest[0].startswith("-") and not _PLACEHOLDER.match(rest[0]):
                if rest[0] not in nested:
                    out.append(f"{where}: `{said}` has no sub-command {rest[0]!r} (it has {', '.join(nested)})")
                    continue
                said, sub, rest = f"{said} {rest[0]}", nested[rest[0]], rest[1:]
            out += _flag_problems(sub, rest, where, said)
    return out


def _name(page: Path) -> str:
    return str(page.relative_to(REPO))


# ------------------------------------------------------------------------------------------ tests


def test_every_cited_path_command_and_flag_exists():
    parser = build_parser()
    problems = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        problems += path_problems(_name(page), text)
        problems += link_problems(page, text)
        problems += command_problems(_name(page), text, parser)
    assert not problems, "stale citations in the docs:\n" + "\n".join(problems)


def test_benchmarks_readme_names_every_script():
    readme = REPO / "benchmarks" / "README.md"
    text = readme.read_text(encoding="utf-8")
    assert local_file_problems(readme, text) == []
    scripts = [p.name for p in (REPO / "benchmarks").iterdir() if p.suffix in (".py", ".sh")]
    assert [name for name in sorted(scripts) if f"`{name}`" not in text] == [], "say in benchmarks/README.md what it is"


def test_the_checks_find_what_is_stale():
    parser = build_parser()
    page = "\n".join(
        [
            "The launcher is `src/phalanx/launch/launcher.py`; `src/phalanx/launch/gone.py` was removed.",  # 1
            "See session/state.py, session/nothing.py, phalanx/gone.py and tests/unit/test_*.py.",  # 2
            "```bash",  # 3
            "phalanx bench --nproc-list 1,2 --demo",  # 4
            "phalanx bench --no-such-flag --demo",  # 5
            "PYTHONPATH=x .venv/bin/phalanx frobnicate",  # 6
            "phalanx launch --gpus 0,1 train.py --lr 3e-4 \\",  # 7
            "    --epochs 3",  # 8
            "```",  # 9
            "`phalanx config shwo`, `phalanx checkpoint info --json x`, `phalanx ... --nproc-list`, `phalanx -h`",  # 10
            "![chart](images/none.png), [home](#top), [torch](https://pytorch.org/docs/x.md)",  # 11
        ]
    )
    found = path_problems("page.md", page) + command_problems("page.md", page, parser)
    found += link_problems(REPO / "docs" / "page.md", page)
    assert found == [
        "page.md:1: src/phalanx/launch/gone.py is not in the repository",
        "page.md:2: session/nothing.py is not in src/phalanx",
        "page.md:2: phalanx/gone.py is not in src/phalanx",
        "page.md:5: `phalanx bench` has no flag --no-such-flag (`phalanx bench`: " + _flags(parser, "bench") + ")",
        "page.md:6: phalanx has no command 'frobnicate' (it has " + ", ".join(_subcommands(parser)) + ")",
        "page.md:10: `phalanx config` has no sub-command 'shwo' (it has init, show)",
        "docs/page.md:11: the link to images/none.png leads nowhere",
    ]


def _flags(parser: argparse.ArgumentParser, command: str) -> str:
    return " ".join(sorted(_subcommands(parser)[command]._option_string_actions))
