"""How long an elastic job takes from a node's death to its first step on the smaller job.

Two "nodes" on loopback (two ``phalanx launch --nnodes 1:2`` of one CPU process each, the
harness of tests/integration/test_elastic.py): the second joins the running job, and a few steps
later its launcher group is killed with SIGKILL, and the survivor's records split the time to its next step into:

- rendezvous: from the kill until the survivor's rendezvous has re-formed the job. Mostly the
  wait for the dead node to miss ``launch.node_timeout`` seconds of heartbeats, then
  ``launch.late_node_wait`` for late nodes;
- start-up: from then until the new worker's Session is built (process start, imports, the
  process group);
- resume: ``session.setup()``, which loads the latest checkpoint;
- first step: from the resume to the end of the first step of the smaller job.

Run from the repository root: ``.venv/bin/python benchmarks/elastic_recovery.py [--reps 3]
[--node-timeout 3] [--late-node-wait 1]``. It prints each repetition and the medians with their
spread (min-max).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers import elastic  # noqa: E402

PARTS = ("rendezvous", "start-up", "resume", "first step", "total")


def one_run(tmp: Path, node_timeout: int, late_wait: int) -> dict[str, float]:
    elastic.write(tmp, "ddp")
    port = elastic.free_port()
    settings = {"node_timeout": node_timeout, "late_node_wait": late_wait}
    a = elastic.Node(tmp, port, "a", **settings)
    b = None
    try:
        # The second node joins the running job (so the first round need not wait for it), and is
        # killed a few steps into the larger job.
        elastic.wait_for_step(tmp, 3, 120)
        b = elastic.Node(tmp, port, "b", **settings)
        elastic.wait_for_step(tmp, 12, 120, world=2)
        killed = time.time()
        b.kill()
        if a.wait(300) != 0:
            raise SystemExit(f"the survivor failed:\n{a.output()}")
    finally:
        a.cleanup()
        if b is not None:
            b.cleanup()
    rounds = [json.loads(line) for line in next((tmp / "runs-a").glob("*/rendezvous.jsonl")).read_text().splitlines()]
    formed = next(r["formed"] for r in rounds if r["formed"] > killed)
    meta = next(m for m in elastic.records(tmp, meta=True) if m["began"] > killed)
    first = min(r["time"] for r in elastic.records(tmp) if r["start"] == meta["start"] and r["time"] > killed)
    return {
        "rendezvous": formed - killed,
        "start-up": meta["set_up"] - formed,
        "resume": meta["resumed"] - meta["set_up"],
        "first step": first - meta["resumed"],
        "total": first - killed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--node-timeout", type=int, default=3, help="launch.node_timeout for the run (default 3)")
    parser.add_argument("--late-node-wait", type=int, default=1, help="launch.late_node_wait once re-formed")
    args = parser.parse_args()
    runs = []
    for rep in range(args.reps):
        with tempfile.TemporaryDirectory() as tmp:
            run = one_run(Path(tmp), args.node_timeout, args.late_node_wait)
        runs.append(run)
        print(f"run {rep + 1}: " + ", ".join(f"{part} {run[part]:.3f} s" for part in PARTS), flush=True)
    print(f"\nnode_timeout {args.node_timeout} s, {args.reps} runs: median (min-max), seconds")
    for part in PARTS:
        values = [run[part] for run in runs]
        print(f"  {part:<11} {statistics.median(values):7.3f}  ({min(values):.3f}-{max(values):.3f})")


if __name__ == "__main__":
    main()
