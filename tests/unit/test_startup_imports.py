"""What a launch does not load at start-up (benchmarks/startup.py measures the time): `phalanx
launch` registers its own command only, rich waits for a table or a bar to draw, TensorBoard for
the first scalars. Each check runs in a fresh interpreter, where sys.modules says what was loaded."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from phalanx.cli.main import COMMANDS, build_parser


def _loaded_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return set(json.loads(out.splitlines()[-1]))


def _subcommands(parser) -> dict:
    (action,) = [a for a in parser._actions if a.dest == "command"]  # noqa: SLF001 - argparse keeps them here
    return action.choices


def test_every_command_has_its_module_and_one_command_parses_as_in_the_full_parser():
    full = _subcommands(build_parser())
    assert list(full) == list(COMMANDS)  # the order `phalanx --help` lists them in
    for command in COMMANDS:
        alone = _subcommands(build_parser(command))
        assert command in alone and alone[command].format_help() == full[command].format_help()


def test_a_launch_loads_neither_the_other_commands_nor_rich():
    loaded = _loaded_after("from phalanx.cli.main import build_parser\nbuild_parser('launch')")
    assert "phalanx.launch.launcher" in loaded
    for module in ("phalanx.bench.runner", "phalanx.tune.runner", "phalanx.diagnose.doctor", "phalanx.plan", "rich"):
        assert module not in loaded, module


def test_the_worker_s_session_import_loads_neither_rich_nor_tensorboard():
    loaded = _loaded_after("import phalanx.session")
    assert "rich" not in loaded and "torch.utils.tensorboard" not in loaded


def test_an_unknown_command_still_lists_every_command(capsys):
    from phalanx.cli.main import main

    with pytest.raises(SystemExit):
        main(["no-such-command"])
    err = capsys.readouterr().err
    assert err.startswith("phalanx: error: argument COMMAND: invalid choice: 'no-such-command'")
    assert all(f"'{command}'" in err for command in COMMANDS)


def test_no_command_prints_every_command(capsys):
    from phalanx.cli.main import main

    assert main([]) == 2
    out = capsys.readouterr().out
    assert all(command in out for command in COMMANDS)


def test_tensorboard_opens_at_the_first_write_and_a_board_never_written_still_leaves_its_file(tmp_path):
    pytest.importorskip("tensorboard")
    from phalanx.metrics.board import Board

    board = Board.open(tmp_path / "tb")
    assert board is not None and not (tmp_path / "tb").exists()  # nothing imported or written yet
    board.close()
    assert [p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir()] == [True]


def test_without_tensorboard_there_is_no_board(tmp_path, monkeypatch):
    import importlib.util

    from phalanx.metrics.board import Board

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    assert Board.open(tmp_path) is None
