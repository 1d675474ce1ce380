"""Issue 14, friction 8 (what the terminal shows): a failed bench or tune run names its error even
when the launcher wrote no summary, and a run that had to be stopped with a signal says so, with
what the script raised on its way out."""

from __future__ import annotations

from phalanx.harness.launching import LaunchRun, failure_reason, last_error, stop_note

TRACEBACK = (
    "phalanx: single | device cpu\n"
    "Traceback (most recent call last):\n"
    '  File "train.py", line 9, in <module>\n'
    "    loop()\n"
    "KeyboardInterrupt\n"
    "\n"
    "During handling of the above exception, another exception occurred:\n"
    "\n"
    "Traceback (most recent call last):\n"
    '  File "train.py", line 11, in <module>\n'
    "FileNotFoundError: [Errno 2] No such file or directory: 'model.pt'\n"
    "phalanx: stopped by signal SIGINT; logs in runs/x/logs\n"
)


def _run(tmp_path, text: str, *, code: int, stopped: bool) -> LaunchRun:
    log = tmp_path / "launch.log"
    log.write_text(text)
    return LaunchRun(code, stopped, 4, 1.0, log, None)


def test_without_a_launcher_summary_the_reason_is_the_last_line(tmp_path):
    run = _run(tmp_path, "phalanx: single\nTraceback ...\nValueError: bad data at row 7\n\n", code=1, stopped=False)
    assert failure_reason(run.log) == "ValueError: bad data at row 7"
    summary = "phalanx: rank 1 failed first (exit code 1): RuntimeError: broken\nphalanx: more\n"
    assert failure_reason(_run(tmp_path, summary, code=1, stopped=False).log).startswith("rank 1 failed first")


def test_a_run_that_ended_by_itself_gets_no_note(tmp_path):
    assert stop_note(_run(tmp_path, "phalanx: train.max_steps=4 reached\n", code=0, stopped=False), "r", 4) is None


def test_a_stopped_run_names_what_its_handler_raised(tmp_path):
    run = _run(tmp_path, TRACEBACK, code=130, stopped=True)
    assert last_error(run.log) == "FileNotFoundError: [Errno 2] No such file or directory: 'model.pt'"
    note = stop_note(run, "the 1-process run", 4)
    assert note.startswith("phalanx: warning: the 1-process run went on after train.max_steps=4")
    assert "exited with code 130: FileNotFoundError: [Errno 2] No such file or directory: 'model.pt'" in note
    assert "\n" not in note and str(run.log) in note
    clean = stop_note(_run(tmp_path, "phalanx: stopped by signal SIGINT\n", code=0, stopped=True), "the run", 4)
    assert clean.endswith("was stopped like Ctrl-C")
