"""docs/benchmarks.md is written one section at a time: a benchmark that refreshes its own section
leaves the other sections, and the notes written by hand into them, as they were."""

from __future__ import annotations

import sys

from tests.helpers.cli import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

from sections import METHOD, put_section  # noqa: E402

PAGE = f"""# Benchmarks

## Throughput

old throughput table

A note written by hand about throughput.

## Time to target

old time table

A note about the old run.
{METHOD.strip()}

how it is measured
"""


def test_a_section_is_replaced_and_the_others_keep_their_notes(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text(PAGE, encoding="utf-8")
    put_section(page, "## Time to target", "## Time to target\n\nnew time table\n", lambda: "unused")
    text = page.read_text(encoding="utf-8")
    assert "new time table" in text and "old time table" not in text and "A note about the old run" not in text
    assert "A note written by hand about throughput." in text and text.endswith("how it is measured\n")
    assert text.index("## Throughput") < text.index("## Time to target") < text.index(METHOD.strip())


def test_a_new_section_goes_before_the_method_and_a_missing_page_is_rendered_whole(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text(PAGE, encoding="utf-8")
    put_section(page, "## Start-up", "## Start-up\n\nphases\n", lambda: "unused")
    text = page.read_text(encoding="utf-8")
    assert text.index("## Time to target") < text.index("## Start-up") < text.index(METHOD.strip())
    fresh = tmp_path / "fresh.md"
    put_section(fresh, "## Start-up", "## Start-up\n\nphases\n", lambda: PAGE)
    assert "phases" in fresh.read_text(encoding="utf-8") and "old throughput table" in fresh.read_text(encoding="utf-8")
