"""The hang summary names the hung rank: the one outside the collective the others wait in, read
off every rank's stack dump, whichever rank's watchdog fired first."""

from __future__ import annotations

import os
import runpy
import threading
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import phalanx
from phalanx.faults.watchdog import Watchdog, classify, parse_stack
from phalanx.launch.outcome import hang_summary, report_hang

# Library frames are told apart by module identity, so the stacks below name the real package
# directories of torch and phalanx and the real standard library.
TORCH = os.path.dirname(torch.__file__)
PHALANX = os.path.dirname(phalanx.__file__)
C10D = f"{TORCH}/distributed/distributed_c10d.py"
LOGGER = f"{TORCH}/distributed/c10d_logger.py"
WORKER = [
    (f"{PHALANX}/launch/worker.py", 120, "main", "runpy.run_path(script, run_name='__main__')"),
    ("<frozen runpy>", 291, "run_path", None),
    ("<frozen runpy>", 98, "_run_module_code", None),
]
IN_ALL_REDUCE = [
    ("/job/train.py", 30, "<module>", "session.reduce(loss)"),
    (f"{PHALANX}/session/session.py", 463, "reduce", "return collectives.reduce(value, op)"),
    (f"{PHALANX}/session/collectives.py", 25, "reduce", "dist.all_reduce(tensor)"),
    (LOGGER, 83, "wrapper", "return func(*args, **kwargs)"),
    (C10D, 2806, "all_reduce", "work.wait()"),
]
IN_BACKWARD = [
    ("/job/train.py", 21, "<module>", "session.backward(loss)"),
    (f"{PHALANX}/session/session.py", 380, "backward", "loss.backward()"),
    (f"{TORCH}/_tensor.py", 623, "backward", "torch.autograd.backward("),
    (f"{TORCH}/autograd/__init__.py", 347, "backward", "_engine_run_backward("),
    (f"{TORCH}/autograd/graph.py", 825, "_engine_run_backward", "return Variable._execution_engine.run_backward("),
]
ASLEEP = [("/job/train.py", 42, "<module>", "time.sleep(600)")]


def dump(rank: int, frames, headline: str | None = None) -> str:
    """A rank's dump as the watchdog writes it (see Watchdog._fire)."""
    stack = traceback.format_list(
        [traceback.FrameSummary(f, n, name, lookup_line=False, line=code) for f, n, name, code in WORKER + frames]
    )
    headline = headline or f"rank {rank}: no progress for 5.1 s (faults.hang_timeout is 5 s)"
    return f"phalanx: hang: {headline}; waiting in ...\nstack of rank {rank} (most recent call last):\n{''.join(stack)}"


def frames_of(frames) -> list[traceback.FrameSummary]:
    return parse_stack(dump(0, frames))


# -- where one rank waits ---------------------------------------------------------------------


def test_a_dump_parses_back_into_its_frames():
    frames = parse_stack(dump(0, IN_ALL_REDUCE))
    assert [(f.filename, f.lineno, f.name) for f in frames] == [
        (f, n, name) for f, n, name, _ in WORKER + IN_ALL_REDUCE
    ]
    assert frames[-1].line == "work.wait()" and not frames[1].line  # a frozen frame has no source


def test_a_real_stack_parses_back_into_its_frames():
    real = traceback.extract_stack()
    parsed = parse_stack("".join(traceback.format_list(real)))
    assert [(f.filename, f.lineno, f.name) for f in parsed] == [(f.filename, f.lineno, f.name) for f in real]


def test_ranks_inside_communication_are_waiting_and_a_rank_in_its_own_code_is_not():
    reduce, backward, asleep = (
        classify(frames_of(IN_ALL_REDUCE)),
        classify(frames_of(IN_BACKWARD)),
        classify(frames_of(ASLEEP)),
    )
    assert (reduce.kind, reduce.op, reduce.waiting) == ("collective", "all_reduce", True)
    assert reduce.describe() == "collective all_reduce (<module> at /job/train.py:30)"
    assert (backward.kind, backward.waiting) == ("backward", True)
    assert backward.describe() == "backward, where DDP/FSDP exchange gradients (<module> at /job/train.py:21)"
    assert (asleep.kind, asleep.waiting) == ("code", False)
    assert asleep.describe() == "<module> at /job/train.py:42" and asleep.frame.line == "time.sleep(600)"


def test_fsdp_and_ddp_forward_communication_count_as_waiting():
    fsdp = [
        ("/job/train.py", 20, "<module>", "loss = model(x)"),
        (f"{TORCH}/nn/modules/module.py", 1773, "_call_impl", "return forward_call(*args, **kwargs)"),
        (f"{TORCH}/distributed/fsdp/_fully_shard/_fsdp_state.py", 230, "_pre_forward", "self._lazy_init()"),
    ]
    ddp = [
        ("/job/train.py", 20, "<module>", "loss = model(x)"),
        (f"{TORCH}/nn/parallel/distributed.py", 1637, "forward", "inputs, kwargs = self._pre_forward(*inputs)"),
    ]
    assert classify(frames_of(fsdp)).describe() == "torch.distributed.fsdp communication (<module> at /job/train.py:20)"
    assert classify(frames_of(ddp)).op == "DistributedDataParallel" and classify(frames_of(ddp)).waiting


def test_writing_a_checkpoint_or_reading_a_batch_is_a_rank_s_own_work():
    dcp = [
        ("/job/train.py", 50, "<module>", "session.save()"),
        (f"{TORCH}/distributed/checkpoint/filesystem.py", 300, "_write_files_from_queue", "stream.write(data)"),
    ]
    loader = [
        ("/job/train.py", 18, "<module>", "for x, y in session.progress(loader):"),
        (f"{TORCH}/utils/data/dataloader.py", 1320, "_get_data", "success, data = self._try_get_data()"),
        (threading.__file__, 331, "wait", "gotit = waiter.acquire(True, timeout)"),
    ]
    assert not classify(frames_of(dcp)).waiting and not classify(frames_of(loader)).waiting


def test_a_real_collective_frame_is_a_collective():
    # Without a process group all_reduce raises from inside torch.distributed: the traceback holds
    # the very frames a rank blocked in it shows.
    with pytest.raises(ValueError) as raised:
        dist.all_reduce(torch.ones(1))
    frames = traceback.extract_stack() + traceback.extract_tb(raised.value.__traceback__)
    wait = classify(frames)
    assert (wait.kind, wait.op, wait.frame.name) == (
        "collective",
        "all_reduce",
        "test_a_real_collective_frame_is_a_collective",
    )


@pytest.mark.parametrize("folder", ["phalanx", "torch", "phalanx/src/phalanx", "torch/distributed"])
def test_user_code_in_a_folder_named_like_a_library_is_the_user_s(tmp_path, folder):
    # A clone named `phalanx` (what `git clone` gives it) or a user's ~/torch/train.py: the frames
    # are real, from a script run out of such a folder, stuck in a real collective.
    script = tmp_path / folder / "train.py"
    script.parent.mkdir(parents=True)
    script.write_text(
        "import torch\nimport torch.distributed as dist\n\n\ndef step():\n    dist.all_reduce(torch.ones(1))\n"
    )
    step = runpy.run_path(str(script))["step"]
    with pytest.raises(ValueError) as raised:
        step()
    frames = traceback.extract_stack() + traceback.extract_tb(raised.value.__traceback__)
    wait = classify(frames)
    assert (wait.kind, wait.op, wait.frame.name, wait.frame.filename) == (
        "collective",
        "all_reduce",
        "step",
        str(script),
    )
    inside = next(i for i, frame in enumerate(frames) if frame.filename == str(script))
    busy = classify(frames[: inside + 1])  # the same rank, stuck in its own code instead
    assert (busy.kind, busy.frame.filename) == ("code", str(script))


def test_a_real_backward_is_a_gradient_exchange_but_a_user_autograd_function_is_user_code():
    seen: dict[str, list[traceback.FrameSummary]] = {}

    def hook(grad):
        seen["engine"] = traceback.extract_stack()[:-1]  # the hook is ours; the engine's frames are torch's
        return grad

    class Stuck(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            seen["function"] = traceback.extract_stack()  # where a user's backward would block
            return grad * 2

    x = torch.ones(2, requires_grad=True)
    y = Stuck.apply(x)
    y.register_hook(hook)
    y.sum().backward()
    assert classify(seen["engine"]).kind == "backward"
    assert classify(seen["function"]).kind == "code" and classify(seen["function"]).frame.name == "backward"


# -- the verdict over every rank --------------------------------------------------------------


def test_the_rank_outside_the_collective_is_named_though_another_rank_fired_first():
    dumps = {
        0: dump(0, IN_ALL_REDUCE, "rank 0: no progress for 3.1 s (faults.hang_timeout is 3 s)"),
        1: dump(1, ASLEEP, "rank 1: stopping because rank 0's watchdog fired first; this rank had been idle for 3.2 s"),
        2: dump(2, IN_ALL_REDUCE),
        3: dump(3, IN_ALL_REDUCE),
    }
    assert hang_summary(dumps) == (
        "phalanx: hang: rank 1 stopped making progress (at train.py:42: time.sleep(600)); "
        "ranks 0, 2, 3 were waiting for it in all_reduce"
    )


def test_waiting_ranks_are_grouped_by_where_they_wait():
    dumps = {0: dump(0, IN_ALL_REDUCE), 1: dump(1, ASLEEP), 2: dump(2, IN_BACKWARD), 3: dump(3, IN_BACKWARD)}
    assert hang_summary(dumps) == (
        "phalanx: hang: rank 1 stopped making progress (at train.py:42: time.sleep(600)); "
        "rank 0 was waiting for it in all_reduce, ranks 2, 3 in backward (where DDP/FSDP exchange gradients)"
    )


def test_several_hung_ranks_are_all_named():
    loop = [("/job/train.py", 7, "spin", "while True: pass")]
    dumps = {0: dump(0, IN_BACKWARD), 1: dump(1, ASLEEP), 2: dump(2, loop)}
    assert hang_summary(dumps) == (
        "phalanx: hang: ranks 1, 2 stopped making progress outside any collective "
        "(rank 1 at train.py:42: time.sleep(600); rank 2 in spin at train.py:7: while True: pass); "
        "rank 0 was waiting for them in backward (where DDP/FSDP exchange gradients)"
    )


def test_one_process_names_its_own_place_and_every_rank_in_its_own_code_says_so():
    assert (
        hang_summary({0: dump(0, ASLEEP)})
        == "phalanx: hang: rank 0 stopped making progress (at train.py:42: time.sleep(600))"
    )
    other = [("/job/train.py", 9, "<module>", "input()")]
    assert hang_summary({0: dump(0, ASLEEP), 1: dump(1, other)}).startswith(
        "phalanx: hang: every rank stopped making progress outside any collective (rank 0 at train.py:42"
    )


def test_every_rank_in_the_same_collective_is_said_honestly():
    line = hang_summary({0: dump(0, IN_ALL_REDUCE), 1: dump(1, IN_ALL_REDUCE)})
    assert line.startswith(
        "phalanx: hang: every rank was waiting in all_reduce (at train.py:30: session.reduce(loss)) and none elsewhere"
    )
    assert "stopped making progress" not in line


def test_mismatched_collectives_are_said_honestly():
    barrier = [
        ("/job/train.py", 35, "<module>", "session.barrier()"),
        (f"{PHALANX}/session/session.py", 476, "barrier", "dist.barrier()"),
        (LOGGER, 83, "wrapper", "return func(*args, **kwargs)"),
        (C10D, 4150, "barrier", "work.wait()"),
    ]
    line = hang_summary({0: dump(0, IN_ALL_REDUCE), 1: dump(1, barrier)})
    assert line == (
        "phalanx: hang: every rank was waiting in a collective, but not in the same one "
        "(rank 0 in all_reduce at train.py:30: session.reduce(loss), "
        "rank 1 in barrier at train.py:35: session.barrier()): "
        "the ranks took different paths through the code"
    )


def test_a_rank_that_left_no_stack_is_the_suspect_when_every_other_waits():
    line = hang_summary({0: dump(0, IN_ALL_REDUCE), 1: dump(1, IN_ALL_REDUCE)}, silent=[2])
    assert line.startswith("phalanx: hang: rank 2 left no stack (its watchdog could not run")
    assert line.endswith("so it is the likely hung rank; ranks 0, 1 were waiting for it in all_reduce")
    assert hang_summary({}) == "phalanx: hang: the watchdog stopped the job, but no rank left its stack"


def test_report_hang_prints_the_verdict_first(tmp_path, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    hang = run_dir / "hang" / "attempt1"
    hang.mkdir(parents=True)
    for rank in range(3):
        (run_dir / "logs" / f"rank{rank}.log").write_text("attempt 0\n")
        (run_dir / "logs" / f"rank{rank}.attempt1.log").write_text("attempt 1\n")
    (hang / "rank0.txt").write_text(
        dump(0, IN_ALL_REDUCE, "rank 0: no progress for 3.1 s (faults.hang_timeout is 3 s)")
    )
    (hang / "rank1.txt").write_text(dump(1, IN_ALL_REDUCE, "rank 1: stopping because rank 0's watchdog fired first"))
    assert report_hang(run_dir) == 124
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("phalanx: hang: rank 2 left no stack")  # attempt 1 had 3 ranks, 2 dumped
    assert lines[1] == "phalanx: hang: the watchdog stopped the job; where each rank was (2 dumped):"
    assert lines[2] == "  rank 0: no progress for 3.1 s (faults.hang_timeout is 3 s); waiting in ..."


def test_a_rank_stopping_for_a_peer_does_not_call_the_peer_hung(tmp_path):
    exits: list[int] = []
    dog = Watchdog(0.5, 0, str(tmp_path), exit=exits.append)
    try:
        dog.beat()
        dog.dump_dir.mkdir(parents=True)
        (dog.dump_dir / "rank1.txt").write_text("phalanx: hang: rank 1: no progress\n")
        deadline = time.monotonic() + 10
        while not exits and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        dog.close()
    assert exits == [124]
    headline = dog.fired.splitlines()[0]
    assert headline.startswith(
        "phalanx: hang: rank 0: stopping because rank 1's watchdog fired first; this rank had been idle"
    )
    assert "hung" not in headline.removeprefix("phalanx: hang:").partition("; waiting in")[0]
    assert Path(dog.dump_dir / "rank0.txt").read_text().startswith(headline)
