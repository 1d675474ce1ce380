"""Every test that starts processes says on which device, so the suite means the same on a machine
with no GPU, one or eight: a CLI launch passes --cpu (or launch.cpu=true, or hides the GPUs with
CUDA_VISIBLE_DEVICES, or says where its device comes from in a ``# device: ...`` comment, e.g. a
config file that holds launch.cpu), phalanx.spawn passes cpu=, or the test is marked cuda. An AST
walk over the files that start processes; the findings name file:line."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

TESTS = Path(__file__).resolve().parents[1]
SCANNED = sorted([*TESTS.glob("integration/*.py"), *TESTS.glob("helpers/*.py"), *TESTS.glob("gpu/*.py")])
LAUNCHING = {"launch", "demo", "bench", "tune", "doctor"}  # the commands that start worker processes


def _text(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _marked_cuda(decorators: list[ast.expr]) -> bool:
    """``pytest.mark.cuda`` or ``pytest.mark.cuda(gpus=N)`` among decorators (or a pytestmark list)."""
    for mark in decorators:
        mark = mark.func if isinstance(mark, ast.Call) else mark
        if isinstance(mark, ast.Attribute) and mark.attr == "cuda":
            return True
    return False


def _module_marked_cuda(tree: ast.Module) -> bool:
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in stmt.targets):
            value = stmt.value
            return _marked_cuda(list(value.elts) if isinstance(value, (ast.List, ast.Tuple)) else [value])
    return False


def _scoped(tree: ast.Module) -> Iterator[tuple[ast.FunctionDef | None, ast.AST]]:
    """Every node with the top-level function (or method) it sits in, None at module level."""
    for stmt in tree.body:
        functions = [stmt] if isinstance(stmt, ast.FunctionDef) else []
        if isinstance(stmt, ast.ClassDef):
            functions = [s for s in stmt.body if isinstance(s, ast.FunctionDef)]
        if not functions:
            yield from ((None, node) for node in ast.walk(stmt))
        for function in functions:
            yield from ((function, node) for node in ast.walk(function))


def _command(node: ast.AST) -> tuple[list[ast.expr], str] | None:
    """The words of a phalanx command line and its subcommand, where ``node`` is one:
    ``run_phalanx("launch", ...)``, ``[python, "-m", "phalanx", "launch", ...]``, or an argument
    list such as a parametrize table's row ``["launch", "--cpu", ...]``."""
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "run_phalanx" and node.args:
        words = node.args
    elif isinstance(node, (ast.List, ast.Tuple)) and node.elts:
        words = node.elts
        texts = [_text(w) for w in words]
        if "phalanx" in texts and texts.index("phalanx") + 1 < len(words):
            words = words[texts.index("phalanx") + 1 :]
    else:
        return None
    subcommand = _text(words[0])
    return (words, subcommand) if subcommand in LAUNCHING else None


def _names_device(node: ast.AST, words: list[ast.expr], lines: list[str]) -> bool:
    texts = {_text(w) for w in words}
    if "--cpu" in texts or any(t and t.startswith("launch.cpu=") for t in texts):
        return True
    # The comment goes on the command's lines or on the line just above it.
    if any("# device:" in line for line in lines[max(0, node.lineno - 2) : node.end_lineno]):
        return True
    env = next((k.value for k in getattr(node, "keywords", ()) if k.arg == "env"), None)
    return isinstance(env, ast.Dict) and "CUDA_VISIBLE_DEVICES" in {_text(k) for k in env.keys if k is not None}


def _forwards_its_arguments(function: ast.FunctionDef | None, words: list[ast.expr]) -> bool:
    """A helper such as ``def tune_under_a_cap(tmp_path, *launch)`` that passes ``*launch`` on:
    its callers give the device."""
    if function is None or function.name.startswith("test") or function.args.vararg is None:
        return False
    forwarded = function.args.vararg.arg
    return any(isinstance(w, ast.Starred) and getattr(w.value, "id", None) == forwarded for w in words)


def _is_spawn(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    return getattr(func, "id", None) == "spawn" or (
        isinstance(func, ast.Attribute) and func.attr == "spawn" and getattr(func.value, "id", None) == "phalanx"
    )


def device_problems(source: str, name: str) -> list[str]:
    tree = ast.parse(source, filename=name)
    lines = source.splitlines()
    if _module_marked_cuda(tree):
        return []
    problems = []
    for function, node in _scoped(tree):
        if function is not None and _marked_cuda(function.decorator_list):
            continue
        if _is_spawn(node) and not any(k.arg == "cpu" for k in node.keywords):
            problems.append(f"{name}:{node.lineno}: phalanx.spawn without cpu=")
        command = _command(node)
        if command is None:
            continue
        words, subcommand = command
        if subcommand == "doctor" and "--no-live" in {_text(w) for w in words}:
            continue  # no live check: no process starts
        if not _names_device(node, words, lines) and not _forwards_its_arguments(function, words):
            problems.append(f"{name}:{node.lineno}: phalanx {subcommand} without --cpu")
    return problems


def test_every_process_start_in_the_tests_names_its_device():
    problems = [p for path in SCANNED for p in device_problems(path.read_text(), str(path.relative_to(TESTS.parent)))]
    assert not problems, "no --cpu / cpu= and no @pytest.mark.cuda:\n" + "\n".join(problems)


def test_the_scan_finds_each_kind_of_unnamed_device():
    source = """
import phalanx, pytest, subprocess, sys

ROWS = [(["launch", "x.py"], "message"), (["launch", "--cpu", "x.py"], "message")]

def test_cli():
    run_phalanx("launch", "--nproc", "2", "x.py", cwd=".")
    run_phalanx("demo", "--cpu", cwd=".")
    run_phalanx("doctor", "--no-live", cwd=".")
    run_phalanx("doctor", "--json", cwd=".")
    run_phalanx("launch", "--gpus", "0", "x.py", cwd=".", env={"CUDA_VISIBLE_DEVICES": ""})
    subprocess.Popen([sys.executable, "-m", "phalanx", "launch", "x.py"])
    run_phalanx("config", "show", cwd=".")
    run_phalanx("launch", "--config", "run/config.yaml", "x.py", cwd=".")  # device: launch.cpu in the file

def test_spawn():
    phalanx.spawn(fn, 2)
    phalanx.spawn(fn, 2, cpu=True)

@pytest.mark.cuda(gpus=2)
def test_on_gpus():
    run_phalanx("launch", "x.py", cwd=".")
    phalanx.spawn(fn, 2)

def helper(tmp_path, *launch):
    run_phalanx("tune", *launch, "x.py", cwd=tmp_path)
"""
    assert device_problems(source, "t.py") == [
        "t.py:4: phalanx launch without --cpu",
        "t.py:7: phalanx launch without --cpu",
        "t.py:10: phalanx doctor without --cpu",
        "t.py:12: phalanx launch without --cpu",
        "t.py:17: phalanx.spawn without cpu=",
    ]
    assert device_problems("import pytest\npytestmark = [pytest.mark.cuda]\nphalanx.spawn(fn, 2)\n", "g.py") == []
