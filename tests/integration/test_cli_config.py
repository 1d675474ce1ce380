"""`phalanx config init` and `phalanx config show`: the first call through a real process, the rest
called in this one (neither command starts a process)."""

from __future__ import annotations

import json

from tests.helpers.cli import call_phalanx, run_phalanx


def test_init_defaults_then_show(tmp_path):
    result = run_phalanx("config", "init", "--defaults", cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.output
    text = (tmp_path / "phalanx.yaml").read_text()
    assert text.startswith("# phalanx configuration")
    assert "global_batch_size: null" in text
    again = call_phalanx("config", "init", "--defaults", cwd=tmp_path)
    assert again.returncode == 2 and "already exists; pass --force" in again.stderr

    shown = call_phalanx("config", "show", "--json", "--set", "train.epochs=3", cwd=tmp_path)
    data = json.loads(shown.stdout)
    assert data["train.epochs"] == {"value": 3, "source": "--set"}
    assert data["precision.mode"]["source"].startswith("file ")


def test_init_without_a_terminal_writes_defaults(tmp_path):
    result = call_phalanx("config", "init", "-o", "x.yaml", cwd=tmp_path)
    assert result.returncode == 0
    assert "stdin is not a terminal" in result.stdout
    assert (tmp_path / "x.yaml").is_file()


def test_show_table_names_sources(tmp_path):
    (tmp_path / "phalanx.yaml").write_text("precision:\n  mode: bf16\n")
    result = call_phalanx("config", "show", cwd=tmp_path)
    assert result.returncode == 0
    line = next(ln for ln in result.stdout.splitlines() if "precision.mode" in ln)
    assert "bf16" in line and "file phalanx.yaml" in line


def test_show_bad_value(tmp_path):
    result = call_phalanx("config", "show", "--set", "train.epochs=0", cwd=tmp_path)
    assert result.returncode == 2
    assert "invalid value 0 for 'train.epochs'" in result.stderr


def test_show_lists_the_tensor_parallel_plan_empty_or_by_pattern(tmp_path):
    # An empty mapping has no leaf in Config.flat(); config show still gives strategy.tp.plan a row.
    empty = json.loads(call_phalanx("config", "show", "--json", "--set", "strategy.name=tp", cwd=tmp_path).stdout)
    assert empty["strategy.tp.plan"] == {"value": {}, "source": "default"}
    assert empty["strategy.tp.size"] == {"value": None, "source": "default"}
    plan = "strategy.tp.plan={'blocks.*.mlp.0': colwise}"
    args = ("config", "show", "--json", "--set", "strategy.name=fsdp", "--set", "strategy.tp.size=2", "--set", plan)
    shown = json.loads(call_phalanx(*args, cwd=tmp_path).stdout)
    assert "strategy.tp.plan" not in shown
    assert shown["strategy.tp.plan.blocks.*.mlp.0"] == {"value": "colwise", "source": "--set"}
    assert shown["strategy.tp.size"] == {"value": 2, "source": "--set"}
