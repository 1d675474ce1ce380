"""The README's first screen states the GPU status and links docs/gpu-status.md, and says what that
page's headline says: both "not yet" while nothing has run on a GPU, both the same date after."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")


def readme_status() -> str:
    """The paragraph of the README's first 30 lines that starts with "GPU status:", on one line."""
    first = (REPO / "README.md").read_text().splitlines()[:30]
    assert any("(docs/gpu-status.md)" in line for line in first), "README's first 30 lines link docs/gpu-status.md"
    starts = [i for i, line in enumerate(first) if line.startswith("GPU status:")]
    assert starts, 'no line of the README\'s first 30 starts with "GPU status:"'
    paragraph = []
    for line in first[starts[0] :]:
        if not line.strip():
            break
        paragraph.append(line.strip())
    return " ".join(paragraph)


def headline() -> str:
    """The bold sentence that opens docs/gpu-status.md, e.g. "Nothing yet."."""
    match = re.search(r"\*\*(.+?)\*\*", (REPO / "docs" / "gpu-status.md").read_text())
    assert match, "docs/gpu-status.md opens with a bold headline"
    return match.group(1)


def test_the_readme_gpu_status_agrees_with_docs_gpu_status():
    status, said = readme_status(), headline()
    if said.startswith("Nothing yet"):
        assert "not yet run on a GPU" in status and not DATE.search(status), status
    else:  # after a GPU run the headline names its date, and so must the README
        dates = DATE.findall(said)
        assert dates, f"docs/gpu-status.md's headline {said!r} names neither 'Nothing yet' nor a date"
        assert dates[0] in status and "not yet" not in status, status
