"""A rank's error file, written so that the launcher never reads it half-written."""

from __future__ import annotations

import signal


def test_error_file_is_never_seen_half_written(tmp_path, monkeypatch):
    # The agent SIGTERMs the other ranks as soon as one fails and then parses every error file; a
    # rank killed while writing it must leave either no file or a whole one (an empty one crashed
    # the launcher with a JSONDecodeError).
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    handler = signal.getsignal(signal.SIGINT)
    from phalanx.launch import worker  # sets its own SIGINT handler on import

    signal.signal(signal.SIGINT, handler)
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        raise ValueError("bad batch size")
    except ValueError as err:
        worker._record(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["error.json"]
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(path))
    assert failure.message["message"] == "ValueError: bad batch size"
    assert "raise ValueError" in failure.error_file_data["message"]["extraInfo"]["py_callstack"]


def test_sigterm_watches_closed_out_of_order_give_the_signal_back(tmp_path):
    # Two Sessions in one process (a benchmark's contenders), closed oldest first: the newer watch
    # stays working, and when it closes SIGTERM and the wake-up fd are what they were before both.
    import signal

    from phalanx.faults.preempt import TermWatch

    before = signal.getsignal(signal.SIGTERM)
    older, newer = TermWatch(str(tmp_path), 1.0, 0), TermWatch(str(tmp_path), 1.0, 0)
    older.close()
    assert signal.getsignal(signal.SIGTERM) is not before  # the newer watch still holds it
    newer.close()
    assert signal.getsignal(signal.SIGTERM) is before
    assert signal.set_wakeup_fd(-1) == -1
