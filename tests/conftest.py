"""Session-wide fixtures for every tier: no test may leave a process behind, and a test marked
``@pytest.mark.cuda(gpus=N)`` runs only where N CUDA devices are visible."""

from __future__ import annotations

import multiprocessing.forkserver
import os
import time
import uuid
from pathlib import Path

import pytest


def _processes_with(token: bytes) -> set[int]:
    """Processes whose environment carries ``token``: everything this test session started,
    including orphans that were re-parented away from us."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                # multiprocessing's resource tracker belongs to this pytest process and ends with it.
                if (
                    token in (entry / "environ").read_bytes()
                    and b"resource_tracker" not in (entry / "cmdline").read_bytes()
                ):
                    pids.add(int(entry.name))
            except OSError:
                continue
    return pids


@pytest.fixture(scope="session", autouse=True)
def no_leftover_processes():
    token = f"phalanx-test-{uuid.uuid4().hex}"
    os.environ["PHALANX_TEST_SESSION"] = token
    yield
    # phalanx.spawn's forkserver (it carries the token) belongs to this pytest process; what it
    # forked does not, and must be gone like everything else.
    multiprocessing.forkserver._forkserver._stop()
    deadline = time.monotonic() + 10
    left = _processes_with(token.encode())
    while left and time.monotonic() < deadline:  # give exiting processes a moment
        time.sleep(0.2)
        left = _processes_with(token.encode())
    assert not left, f"processes left behind: {sorted(left)}"


GPU_TIER = Path(__file__).parent / "gpu"


def gpus_needed(mark: pytest.Mark) -> int:
    """``@pytest.mark.cuda`` asks for one GPU, ``@pytest.mark.cuda(gpus=N)`` for N."""
    return int(mark.kwargs.get("gpus", 1))


def pytest_collection_modifyitems(config, items):
    for item in items:  # GPU tests share the machine's devices: never two at once
        if GPU_TIER in item.path.parents:
            item.add_marker(pytest.mark.serial)
    marked = [(item, item.get_closest_marker("cuda")) for item in items]
    marked = [(item, mark) for item, mark in marked if mark is not None]
    if not marked:
        return
    import torch  # only when a CUDA test is collected

    found = torch.cuda.device_count()
    for item, mark in marked:
        needed = gpus_needed(mark)
        if found < needed:
            reason = f"needs {needed} CUDA device{'s' if needed != 1 else ''}, found {found}"
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def gpus(request) -> int:
    """The number of GPUs the test's ``@pytest.mark.cuda(gpus=N)`` asked for; they are there (the
    test is skipped otherwise), numbered 0 to N-1."""
    mark = request.node.get_closest_marker("cuda")
    if mark is None:
        pytest.fail("the gpus fixture is for tests marked @pytest.mark.cuda(gpus=N)")
    return gpus_needed(mark)


# -- the assertion count ------------------------------------------------------------------------
# `pytest -o enable_assertion_pass_hook=true` counts every assert that passed, and the distinct
# assert statements among them (by file and line), so a faster suite can show it kept them all.
_ASSERTS_PASSED = pytest.StashKey[int]()
_ASSERTS_SEEN = pytest.StashKey[set]()


def pytest_assertion_pass(item, lineno, orig, expl):
    config = item.config
    config.stash[_ASSERTS_PASSED] = config.stash.get(_ASSERTS_PASSED, 0) + 1
    # Rewritten asserts live in test modules, nearly always the item's own; orig (the assert's
    # text) tells apart the rare one of another module that shares a line number.
    config.stash.setdefault(_ASSERTS_SEEN, set()).add((item.nodeid.partition("::")[0], lineno, orig))


def pytest_sessionfinish(session):
    config = session.config
    if hasattr(config, "workeroutput"):  # a pytest-xdist worker reports to the controller
        config.workeroutput["asserts_passed"] = config.stash.get(_ASSERTS_PASSED, 0)
        config.workeroutput["asserts_seen"] = sorted(config.stash.get(_ASSERTS_SEEN, set()))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    config, report = node.config, node.workeroutput
    config.stash[_ASSERTS_PASSED] = config.stash.get(_ASSERTS_PASSED, 0) + report.get("asserts_passed", 0)
    config.stash.setdefault(_ASSERTS_SEEN, set()).update(tuple(seen) for seen in report.get("asserts_seen", ()))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if config.getini("enable_assertion_pass_hook"):
        passed, seen = config.stash.get(_ASSERTS_PASSED, 0), config.stash.get(_ASSERTS_SEEN, set())
        terminalreporter.write_line(f"{passed} assertions passed, {len(seen)} distinct assert statements")
