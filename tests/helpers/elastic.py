"""Elastic jobs on loopback: two "nodes" as two ``phalanx launch`` invocations of one CPU process
each, meeting at one c10d rendezvous; the script records every sample it trains on, so a test can
check each epoch saw each sample once, and writes its final weights."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.processes import kill_tagged, new_tag, wait_gone

SAMPLES, GLOBAL_BATCH, EPOCHS = 96, 16, 4  # 6 steps an epoch, 24 in all

SCRIPT = """
import json, os, sys, time
began = time.time()
import torch
import phalanx
from phalanx.faults.markers import RESIZE_REQUEST
from phalanx.topology import LaunchContext

records = sys.argv[1]
session = phalanx.Session()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 1, generator=g)
data = torch.utils.data.TensorDataset(torch.arange(SAMPLES), x, y)
loader = torch.utils.data.DataLoader(data, batch_size=GLOBAL_BATCH, shuffle=True)
set_up = time.time()
model, optimizer, loader = session.setup(model, optimizer, loader)
start = session.step_count  # the step this attempt resumed at
pause = float(os.environ.get("ELASTIC_STEP_PAUSE", "0"))
hold = int(os.environ.get("ELASTIC_HOLD_AT", "0"))
context = LaunchContext.from_env()
request = os.path.join(context.run_dir, RESIZE_REQUEST) if context and context.run_dir else ""
log = open(os.path.join(records, f"rank{session.rank}-pid{os.getpid()}.jsonl"), "a")
log.write(json.dumps({"meta": True, "began": began, "set_up": set_up, "resumed": time.time(), "start": start,
                      "world": session.world_size}) + "\\n")
for epoch in session.epochs():
    for index, xb, yb in loader:
        step = session.step_count + 1
        with session.accumulate(model):
            session.backward(torch.nn.functional.mse_loss(model(xb), yb))
            # Written once this rank's gradients are all-reduced, before the step that a peer may
            # checkpoint at: a kill between the two must not lose the samples of a saved step.
            log.write(json.dumps({"step": step, "epoch": epoch, "world": session.world_size, "start": start,
                                  "samples": index.tolist(), "time": time.time()}) + "\\n")
            log.flush()
        if session.sync_gradients:
            time.sleep(pause)
            # Alone at the hold step: wait for the other node to be waiting to join, so that a slow
            # start of that node cannot let this one finish the job first.
            deadline = time.monotonic() + 120
            while step == hold and session.world_size == 1 and not os.path.exists(request):
                if time.monotonic() > deadline:
                    break  # the test then fails on what it checks, instead of hanging
                time.sleep(0.05)
state = {k: v.detach().cpu() for k, v in session.model_state_dict().items()}
if session.is_main:
    torch.save(state, os.path.join(records, "final.pt"))
session.print(f"finished at step {session.step_count} on {session.world_size} processes")
session.close()
""".replace("SAMPLES", str(SAMPLES)).replace("GLOBAL_BATCH", str(GLOBAL_BATCH))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write(tmp: Path, strategy: str) -> Path:
    (tmp / "train.py").write_text(SCRIPT)
    (tmp / "records").mkdir(exist_ok=True)
    (tmp / "phalanx.yaml").write_text(
        f"strategy:\n  name: {strategy}\n"
        f"train:\n  epochs: {EPOCHS}\n  progress: false\n  metrics: false\n  seed: 0\n"
        "checkpoint:\n  dir: checkpoints\n  save_every: 4\n  keep_last: 100\n"
        "faults:\n  preempt_grace: 20\n"
    )
    return tmp


class Node:
    """One ``phalanx launch`` of an elastic job (``span``: MIN:MAX), in its own process group and
    tagged, so that every process it starts can be found. ``hold``: the step at which this node's
    process, while it trains alone, waits for another node to ask to join."""

    def __init__(
        self, tmp: Path, port: int, name: str, *, span: str = "1:2", pause: float = 0.08, hold: int = 0, **settings
    ):
        launch = {"node_timeout": 3, "late_node_wait": 1, "rendezvous_timeout": 30, **settings}
        sets = [arg for key, value in launch.items() for arg in ("--set", f"launch.{key}={value}")]
        endpoint = ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test"]
        self.tag, self.name, self.tmp = new_tag(), name, tmp
        self.out = open(tmp / f"{name}.out", "w")  # noqa: SIM115 - closed in wait()
        command = ["launch", "--cpu", "--nproc", "1", "--nnodes", span, *endpoint, "--run-dir", f"runs-{name}"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "phalanx", *command, *sets, "train.py", "records"],
            cwd=tmp,
            stdout=self.out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**os.environ, **self.tag, "ELASTIC_STEP_PAUSE": str(pause), "ELASTIC_HOLD_AT": str(hold)},
        )

    def output(self) -> str:
        if not self.out.closed:
            self.out.flush()
        return (self.tmp / f"{self.name}.out").read_text()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_tagged(self.tag)
            raise
        finally:
            self.out.close()

    def gone_within(self, seconds: float) -> list[int]:
        return wait_gone(self.tag, seconds)[1]

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        kill_tagged(self.tag)


def records(tmp: Path, *, meta: bool = False) -> list[dict]:
    """Every step record of every rank (``meta``: the records each process writes once at start)."""
    rows = []
    for path in sorted((tmp / "records").glob("rank*.jsonl")):
        rank = int(path.name[4:].split("-")[0])
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                if bool(row.get("meta")) == meta:
                    rows.append({**row, "rank": rank})
    return rows


def wait_for_step(tmp: Path, step: int, timeout: float, *, world: int | None = None, nodes=()) -> None:
    """Until some rank has recorded ``step`` (at ``world`` processes, when given); an error at once
    when one of ``nodes`` ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r["step"] >= step and (world is None or r["world"] == world) for r in records(tmp)):
            return
        ended = [node for node in nodes if node.proc.poll() is not None]
        if ended:
            raise AssertionError(f"node {ended[0].name} ended before step {step}:\n{ended[0].output()}")
        time.sleep(0.05)
    raise AssertionError(f"no rank reached step {step} within {timeout} s")


def wait_listening(port: int, timeout: float) -> None:
    """Until the rendezvous store accepts connections: the first node hosts it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on port {port} after {timeout} s")


def counted(rows: list[dict]) -> dict[int, list[dict]]:
    """Step -> the records of the computation of it that the final weights contain: a step computed
    again after a resume replaces the earlier computation, and the later attempt started later."""
    by_step: dict[int, list[dict]] = {}
    for row in rows:
        by_step.setdefault(row["step"], []).append(row)
    return {step: [r for r in group if r["start"] == max(g["start"] for g in group)] for step, group in by_step.items()}


def recomputed(rows: list[dict]) -> list[int]:
    """Steps that more than one attempt computed."""
    starts: dict[int, set[int]] = {}
    for row in rows:
        starts.setdefault(row["step"], set()).add(row["start"])
    return sorted(step for step, seen in starts.items() if len(seen) > 1)


def samples_per_epoch(rows: list[dict]) -> dict[int, list[int]]:
    """Epoch -> every sample the counted steps of that epoch trained on, sorted."""
    seen: dict[int, list[int]] = {}
    for group in counted(rows).values():
        for row in group:
            seen.setdefault(row["epoch"], []).extend(row["samples"])
    return {epoch: sorted(samples) for epoch, samples in seen.items()}
