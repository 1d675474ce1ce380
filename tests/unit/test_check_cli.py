"""``phalanx check`` on the command line (in process): output, exit codes, silencing, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from phalanx.check import CheckInputError, check_file, check_source
from phalanx.cli.main import main

PLANTED = Path(__file__).resolve().parents[1] / "data" / "check_planted"
BAD = "import torch.distributed as dist\nif rank == 0:\n    dist.barrier(){}\n"
WARN = "import torch.nn as nn\nmodel = nn.DataParallel(model)\n"


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("script", sorted(PLANTED.glob("*.py")), ids=lambda p: p.stem)
def test_each_planted_mistake_exits_1_naming_its_line(script, capsys):
    planted = [n for n, line in enumerate(script.read_text().splitlines(), 1) if "# planted" in line]
    assert main(["check", "--json", str(script)]) == 1
    findings = json.loads(capsys.readouterr().out)
    assert [(f["line"], f["rule"]) for f in findings] == [(planted[0], script.stem.replace("_", "-"))]


def test_lines_and_summary(tmp_path, capsys):
    bad, warn = _write(tmp_path, "a.py", BAD.format("")), _write(tmp_path, "b.py", WARN)
    assert main(["check", bad, warn]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{bad}:3: error rank-guarded-collective: dist.barrier() runs only")
    assert lines[1].startswith(f"{warn}:2: warning data-parallel: ")
    assert lines[2] == "1 error, 1 warning in 2 files"


def test_warnings_alone_exit_0_and_clean_files_say_so(tmp_path, capsys):
    assert main(["check", _write(tmp_path, "w.py", WARN)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "1 warning in 1 file"
    clean = [_write(tmp_path, f"{n}.py", "x = 1\n") for n in "cde"]
    assert main(["check", *clean]) == 0
    assert capsys.readouterr().out == "no findings in 3 files\n"


@pytest.mark.parametrize(
    "comment,silenced",
    [
        ("  # phalanx: ignore[rank-guarded-collective]", True),
        ("  # phalanx: ignore[data-parallel, rank-guarded-collective]", True),
        ("  # phalanx: ignore", True),
        ("  # phalanx: ignore[data-parallel]", False),
    ],
)
def test_ignore_comments(comment, silenced):
    assert (check_source(BAD.format(comment)) == []) is silenced


def test_an_ignore_comment_in_a_string_is_no_comment():
    assert len(check_source(BAD.format("; s = '# phalanx: ignore'"))) == 1


def test_ignore_flag(tmp_path, capsys):
    path = _write(tmp_path, "a.py", BAD.format(""))
    assert main(["check", "--ignore", "data-parallel,rank-guarded-collective", path]) == 0
    assert capsys.readouterr().out == "no findings in 1 file\n"


def test_unknown_rule_in_ignore_exits_2_listing_the_known(tmp_path, capsys):
    assert main(["check", "--ignore", "no-such-rule", _write(tmp_path, "a.py", "x = 1\n")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no-such-rule" in err and "rank-guarded-collective" in err


def test_json_is_the_only_output(tmp_path, capsys):
    path = _write(tmp_path, "a.py", BAD.format(""))
    assert main(["check", "--json", path]) == 1
    (finding,) = json.loads(capsys.readouterr().out)
    assert set(finding) == {"path", "line", "severity", "rule", "message"}
    assert (finding["line"], finding["severity"]) == (3, "error")


def test_list_rules(capsys):
    assert main(["check", "--list-rules"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 15 and lines[0].split()[:2] == ["rank-guarded-collective", "error"]


@pytest.mark.parametrize(
    "content,says",
    [
        (None, "cannot read"),
        (b"def f(:\n", ":1: cannot parse"),
        (b"x = '\xff\xfe'\n", "not UTF-8"),
        (b"x = 1\x00\n", "cannot parse"),
    ],
)
def test_unreadable_or_unparsable_files_exit_2_in_one_line(tmp_path, capsys, content, says):
    path = tmp_path / "bad.py"
    if content is not None:
        path.write_bytes(content)
    assert main(["check", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("phalanx: error: ") and says in captured.err
    with pytest.raises(CheckInputError):
        check_file(path)
