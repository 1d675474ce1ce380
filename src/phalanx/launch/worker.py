"""Entry point of every process ``phalanx launch`` starts: routes output, runs the user's script as
``__main__``, reports failures to the launcher and tears the process group down whatever happens.

Run as ``python -m phalanx.launch.worker script.py [args...]`` by torch's elastic agent.
"""

from __future__ import annotations

import os
import signal
import sys

# Ctrl-C while torch is still loading would print an import traceback from every rank; until the
# user's script runs, an interrupt just ends this process (the launcher reports the signal).
signal.signal(signal.SIGINT, lambda *_: os._exit(130))

import json  # noqa: E402
import runpy  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

from phalanx.errors import PhalanxError  # noqa: E402
from phalanx.faults import markers  # noqa: E402
from phalanx.faults.lifeline import watch_launcher  # noqa: E402
from phalanx.launch.outcome import CONSEQUENCES  # noqa: E402
from phalanx.launch.output import log_path, route_output  # noqa: E402


def main(argv: list[str]) -> int:
    # First, before torch loads: from here on this worker cannot outlive its launcher.
    watch_launcher(f"rank {os.environ.get('RANK', '?')}")
    from phalanx.topology import LaunchContext, Topology  # loads torch

    script, *script_args = argv
    context = LaunchContext.from_env() or LaunchContext()
    topology = Topology.from_env(force_cpu=context.force_cpu)
    if context.log_dir is not None:
        # The first rank of each node: on node 0 that is rank 0; other nodes show their own errors.
        show = context.show_ranks == "all" or topology.local_rank == 0
        prefix = f"[rank {topology.rank}] " if context.show_ranks == "all" else ""
        route_output(log_path(context.log_dir, topology.rank, topology.restart_count), show=show, prefix=prefix)

    fatal = markers.path(context.run_dir, markers.FATAL)
    if topology.restart_count and fatal is not None and fatal.is_file():
        # A user error ended the previous attempt; running again would only repeat it.
        _record(PhalanxError(fatal.read_text(encoding="utf-8").strip()))
        return 2
    sys.argv = [script, *script_args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the script gets KeyboardInterrupt as usual
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as exit_:
        code = exit_.code
        if code is None or isinstance(code, int):
            if code not in (None, 0, markers.PREEMPTED_EXIT, markers.TERMINATED_EXIT):
                _record_crash(context.run_dir, topology, code)
            return code or 0
        print(code, file=sys.stderr)
        _record_crash(context.run_dir, topology, 1)
        return 1
    except PhalanxError as err:
        # The launcher prints this once for the whole job; here it only goes to this rank's log.
        _record(err)
        if fatal is not None:
            try:
                fatal.write_text(str(err), encoding="utf-8")
            except OSError:
                pass
        print(f"phalanx: error: {err}", file=getattr(sys.stderr, "log", sys.stderr), flush=True)
        _record_crash(context.run_dir, topology, err.exit_code)
        return err.exit_code
    except KeyboardInterrupt as err:  # Ctrl-C: the launcher says so once for the whole job
        _record(err)
        return 130
    except BaseException as err:  # noqa: BLE001 - reported, then the process exits non-zero
        lost_peer = any(text in str(err) for text in CONSEQUENCES)
        if lost_peer and topology.elastic:
            # An elastic job: a node left or died under this collective; the job re-forms without it.
            what = next(text for text in CONSEQUENCES if text in str(err))
            print(f"phalanx: rank {topology.rank}: lost a peer ({what}); the job re-forms", file=sys.stderr)
        elif not _hang_dumped(context, topology.rank, topology.restart_count):
            traceback.print_exc()  # after this rank's hang dump, an error is only the hang's echo
        _record(err)
        if not lost_peer:
            _record_crash(context.run_dir, topology, 1)
        return 1
    finally:
        _teardown()
        for stream in (sys.stdout, sys.stderr):
            getattr(stream, "finish", stream.flush)()


def _hang_dumped(context, rank: int, attempt: int) -> bool:
    dump = markers.hang_dump(context.run_dir, attempt, rank)
    return dump is not None and dump.is_file()


def _record_crash(run_dir: str | None, topology, code: int) -> None:
    """This rank's own failure (not a lost peer's echo, not a pre-emption): an elastic job's
    launcher charges it to launch.max_restarts, and reports it when none are left."""
    record = markers.crash_record(run_dir, topology.restart_count, topology.rank)
    if record is None:
        return
    data = {
        "rank": topology.rank,
        "local_rank": topology.local_rank,
        "pid": os.getpid(),
        "exitcode": code,
        "error_file": os.environ.get("TORCHELASTIC_ERROR_FILE", ""),
    }
    from phalanx.checkpoint.files import write_json_atomic

    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(record, data)
    except OSError:
        pass


def _record(err: BaseException) -> None:
    """Write torch elastic's error file, which the agent turns into the launcher's failure summary.

    Written to a temporary name and renamed: when one rank fails the agent SIGTERMs the others at
    once and then parses their error files, so a peer killed in the middle of torch's own
    (truncate-then-write) ``record_exception`` left an empty file that crashed the launcher.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:  # not under torch elastic
        return
    data = {
        "message": {
            "message": f"{type(err).__name__}: {err}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(err)),
                "timestamp": str(int(time.time())),
            },
        }
    }
    staging = f"{path}.{os.getpid()}.tmp"
    try:
        with open(staging, "w", encoding="utf-8") as fp:
            json.dump(data, fp)
        os.replace(staging, path)
    except OSError:
        pass  # the launcher then reports the exit code and the log instead


def _teardown() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _exit(code: int) -> None:
    """Leave without the interpreter's final teardown. Exit handlers still run; but destroying
    torch's C++ objects (gloo threads, stores) in an arbitrary order at finalization now and then
    aborts a worker that had finished cleanly ("terminate called without an active exception")."""
    import atexit

    atexit._run_exitfuncs()  # noqa: SLF001 - os._exit skips atexit; these handlers flush logs
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)


if __name__ == "__main__":
    _exit(main(sys.argv[1:]))
