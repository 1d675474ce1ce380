"""What the benchmark scripts that each write one section of DIR/benchmarks.md share: the --out
option, a scratch working directory for their runs, the median (min-max) cell, what they print
kept as they print it, and the writer that puts their section into DIR/benchmarks.json and
DIR/benchmarks.md and leaves the others be.

Standard library only at import: a script imports this in its driver, never in its workers.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

METHOD = "\n## How it is measured"  # the last section of the page: a new one goes before it


def add_out_argument(parser) -> None:
    parser.add_argument(
        "--out", metavar="DIR", help="write the figures into DIR/benchmarks.json and DIR/benchmarks.md (e.g. docs)"
    )


def spread(values: list[float], fmt: str) -> str:
    """The median and the range of ``values``, each formatted with ``fmt``: ``1.23 (1.10-1.40)``."""
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


class Printed:
    """Prints each line it is given and keeps it, for the section ``write_section`` writes."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def say(self, text: str = "") -> None:
        print(text)
        self.lines.extend(text.split("\n"))


@contextlib.contextmanager
def scratch_directory(prefix: str) -> Iterator[Path]:
    """A temporary directory that is the working directory while it lasts, so that whatever the
    runs write there (a Session's run directory) goes with it."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        here = os.getcwd()
        os.chdir(tmp)
        try:
            yield Path(tmp)
        finally:
            os.chdir(here)


def write_section(
    out: Path,
    key: str,
    title: str,
    *,
    script: str,
    argv: list[str] | None,
    settings: str,
    lines: list[str],
    figures: dict | None = None,
    gpu: str | None = None,
) -> None:
    """Puts one benchmark's latest run into DIR/benchmarks.json under ``key`` and into
    DIR/benchmarks.md under ``title`` (the heading peers/report.py renders for ``key``).

    ``script`` is the benchmark's file (its ``__file__``), ``argv`` its arguments (None: sys.argv's),
    for the command recorded; ``lines`` what it printed; ``gpu`` replaces the machine's GPU entry.
    """
    import datetime
    import json
    import shlex

    from peers import report

    machine = report.machine()
    if gpu is not None:
        machine["gpu"] = gpu
    command = [".venv/bin/python", f"benchmarks/{Path(script).name}", *(sys.argv[1:] if argv is None else argv)]
    section = {
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "machine": machine,
        "command": shlex.join(command),
        "settings": settings,
    }
    if figures is not None:
        section["figures"] = figures
    section["lines"] = "\n".join(lines).strip("\n").split("\n")  # blank lines kept: markdown tables need them
    out.mkdir(parents=True, exist_ok=True)
    data_file = out / "benchmarks.json"
    data = json.loads(data_file.read_text(encoding="utf-8")) if data_file.is_file() else {}
    data[key] = section
    data_file.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    page = out / "benchmarks.md"
    block = "\n".join([title, "", *report.header(section), *section["lines"], ""]) + "\n"
    put_section(page, title, block, lambda: report.render(data))
    print(f"wrote {page}, {data_file}")


def put_section(page: Path, title: str, block: str, whole: Callable[[], str]) -> None:
    """Writes ``block`` (starting with ``title``) into ``page`` in place of the section of that
    title, before the method section if the page has none; ``whole()`` renders the page when there
    is none yet. Only this section changes: notes written by hand into the others stay."""
    text = page.read_text(encoding="utf-8") if page.is_file() else whole()
    if title in text:
        start = text.index(title)
        end = text.find("\n## ", start + len(title))
        text = text[:start] + block + (text[end + 1 :] if end >= 0 else "")
    elif METHOD in text:
        at = text.index(METHOD) + 1
        text = text[:at] + block + text[at:]
    else:
        text = text.rstrip("\n") + "\n\n" + block
    page.write_text(text, encoding="utf-8")
