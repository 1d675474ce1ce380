"""The GPU check's sync counter (tests/gpu/acceptance/syncs.py), on the CPU: torch's sync debug mode
needs CUDA, so its warning is given here by code compiled under phalanx's and torch's file names,
as the warning from a synchronising call arrives from C++ with its Python caller's frame."""

from __future__ import annotations

import threading
import warnings

from tests.gpu.acceptance.syncs import _TORCH, SYNC_WARNING, SyncLog, capturing
from tests.helpers.tensor_reads import SOURCE

WARN = f"import warnings\ndef sync():\n    warnings.warn({SYNC_WARNING!r})\n"


def _compiled(path: str, code: str) -> dict:
    space: dict = {}
    exec(compile(code, path, "exec"), space)
    return space


STRAY = _compiled(SOURCE + "session/session.py", WARN + "def step(sync=sync):\n    sync()\n")
AT_FLUSH = _compiled(
    SOURCE + "metrics/recorder.py", WARN + "class StepRecorder:\n    def flush(self):\n        sync()\n"
)
TORCH = _compiled(_TORCH + "optim/fake.py", WARN)  # torch's own Python code, synchronising
THROUGH_TORCH = _compiled(SOURCE + "session/gradients.py", "def clip(torch_call):\n    torch_call()\n")


def test_phalanx_syncs_are_stray_or_at_a_read_point_and_the_rest_is_the_loop_s():
    log = SyncLog(counting=True)
    with capturing(log):
        STRAY["step"]()
        STRAY["step"]()
        AT_FLUSH["StepRecorder"]().flush()
        warnings.warn(SYNC_WARNING)  # this file: the user's loop
    assert sum(log.stray.values()) == 2 and all("session/session.py" in where for where in log.stray)
    assert (log.allowed, log.other) == (1, 1)


def test_a_sync_torch_makes_for_phalanx_is_phalanx_s():
    log = SyncLog(counting=True)
    with capturing(log):
        THROUGH_TORCH["clip"](TORCH["sync"])
    assert list(log.stray) and "session/gradients.py" in next(iter(log.stray))


def test_every_sync_counts_from_any_thread_only_while_counting_and_other_warnings_pass():
    log = SyncLog()
    with warnings.catch_warnings(record=True) as shown, capturing(log):
        STRAY["step"]()  # not counting yet
        log.counting = True
        threads = [threading.Thread(target=STRAY["step"]) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for _ in range(4):
            STRAY["step"]()  # the same place again: "always", not once
        warnings.warn("something else")
    assert sum(log.stray.values()) == 7
    assert [str(w.message) for w in shown] == ["something else"]
