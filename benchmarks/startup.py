"""Where a launch spends its time before the first optimizer step: phalanx against torchrun.

    .venv/bin/python benchmarks/startup.py                          # 5 rounds, 1 and 2 processes
    .venv/bin/python benchmarks/startup.py --rounds 3 --nproc-list 1
    mkdir -p /tmp/before && git archive HEAD src | tar -x -C /tmp/before     # a version to compare with
    .venv/bin/python benchmarks/startup.py --phalanx before=/tmp/before/src --phalanx after=src

Each round launches, in turn (the order rotates every round), the same short workload (a 2-layer
MLP, a few optimizer steps, OMP_NUM_THREADS = cores / processes for both):

- ``torchrun``: ``python -m torch.distributed.run --standalone --nproc-per-node N`` and a
  hand-written loop (DistributedDataParallel over gloo and a DistributedSampler; a plain loop with
  one process, as a user writes it);
- ``phalanx`` (one per ``--phalanx NAME=SRC``, its source put first on PYTHONPATH, so one run can
  measure two versions side by side): ``phalanx launch --cpu --nproc N`` and a Session loop.

Every process appends time.time() marks to one file: the launcher (through a thin wrapper that
imports what ``python -m phalanx`` / ``python -m torch.distributed.run`` import, and marks when
the config is resolved and the elastic agent is called), and rank 0 of the workers (its process
start time from /proc, then its script's steps), each with its process's CPU time. Two tables
per process count: each phase's wall-clock seconds (median over the rounds, min-max), from the
moment the driver started the launcher, and the CPU seconds of the phases that run inside one
process, with the CPU of the whole job (launcher and every worker, from wait4). On a shared machine
the CPU figures move much less than the wall-clock ones: they say what is phalanx's own cost.
About 2.5 minutes at the defaults on 2 cores (20 launches; 3.5 with two phalanx versions).
"""

from __future__ import annotations

import os
import sys
import time

MARKS_ENV = "STARTUP_MARKS"
TITLE = "## Start-up before the first step: phalanx launch against torchrun, phase by phase"  # as peers/report.py
STEPS = 5
BATCH = 32


# -- the probes (run inside the launched processes) -------------------------------------------


def _mark(name: str, role: str = "launcher", rank: int = 0, at: float | None = None) -> None:
    """Wall-clock time and this process's CPU time so far (every thread, since the process began)."""
    path = os.environ.get(MARKS_ENV)
    if path:
        wall, cpu = (time.time(), time.process_time()) if at is None else (at, 0.0)
        line = f"{role} {rank} {name} {wall:.6f} {cpu:.6f}\n"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())  # one write of one short line: the ranks do not interleave
        finally:
            os.close(fd)


def _process_start() -> float:
    """This process's start, from /proc (10 ms resolution): before the interpreter loaded anything."""
    with open("/proc/self/stat") as f:
        started_ticks = int(f.read().rpartition(")")[2].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - (uptime - started_ticks / os.sysconf("SC_CLK_TCK"))


def _probe_launcher(kind: str, argv: list[str]) -> int:
    _mark("launcher_start")
    if kind == "phalanx":
        # What `python -m phalanx launch` imports before it parses the arguments.
        import phalanx.launch.launcher as launcher
        from phalanx.cli.main import main

        _mark("launcher_imported")

        run_workers = launcher.run_workers

        def marked_run_workers(plan):
            _mark("agent_start")
            return run_workers(plan)

        launcher.run_workers = marked_run_workers
        return main(["launch", *argv])
    import torch.distributed.run as run

    _mark("launcher_imported")
    elastic_launch = run.elastic_launch

    def marked_elastic_launch(*args, **kwargs):
        _mark("agent_start")
        return elastic_launch(*args, **kwargs)

    run.elastic_launch = marked_elastic_launch
    run.main(argv)
    return 0


def _probe_worker(kind: str) -> None:
    rank = int(os.environ.get("RANK", "0"))

    def mark(name: str, at: float | None = None) -> None:
        if rank == 0:
            _mark(name, "worker", rank, at)

    mark("process_start", _process_start())
    mark("script_start")
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    mark("imported_torch")
    init_process_group = dist.init_process_group

    def marked_init_process_group(*args, **kwargs):
        mark("pg_start")
        init_process_group(*args, **kwargs)
        mark("pg_done")

    dist.init_process_group = marked_init_process_group
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(STEPS * BATCH, 32, generator=g), torch.randn(STEPS * BATCH, 1, generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)  # torch imports torch._dynamo here
    mark("built")
    if kind == "phalanx":
        from phalanx import Session

        mark("imported_phalanx")
        mark("session_start")
        session = Session(batch={"global_batch_size": BATCH}, train={"epochs": 1})
        mark("session_done")
        loader = DataLoader(data, batch_size=BATCH)
        model, optimizer, loader = session.setup(model, optimizer, loader)
        mark("setup_done")
        for _ in session.epochs():
            for x, y in session.progress(loader):
                with session.accumulate(model):
                    session.backward(nn.functional.mse_loss(model(x), y))
                if session.step_count == 1:
                    mark("first_step")
        mark("last_step")
        session.close()
    else:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        mark("imported_phalanx")
        mark("session_start")
        if world > 1:
            dist.init_process_group("gloo")
        mark("session_done")
        per_rank = BATCH // world
        sampler = torch.utils.data.DistributedSampler(data, shuffle=False) if world > 1 else None
        loader = DataLoader(data, batch_size=per_rank, sampler=sampler)
        if world > 1:
            model = nn.parallel.DistributedDataParallel(model)
        mark("setup_done")
        for step, (x, y) in enumerate(loader, 1):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            if step == 1:
                mark("first_step")
        mark("last_step")
        if world > 1:
            dist.destroy_process_group()
    mark("end")
    # Leave without the interpreter's teardown, as phalanx's worker does: destroying DDP's reducer
    # at finalization now and then deadlocks with gloo's thread (seen here: torch 2.13, 2 ranks).
    sys.stdout.flush()
    os._exit(0)


# -- the driver ---------------------------------------------------------------------------------

# (name, from mark, to mark); a mark a contender does not reach (no process group with one
# process) takes the time of the mark before it, so its phase reads 0. CPU seconds are given for
# the phases inside one process (the launcher's, or rank 0's).
PHASES = [
    ("launcher: interpreter + imports", "t0", "launcher_imported"),
    ("launcher: config, checks, run dir", "launcher_imported", "agent_start"),
    ("agent + rendezvous + worker spawn", "agent_start", "process_start"),
    ("worker: bootstrap before the script", "process_start", "script_start"),
    ("worker: import torch", "script_start", "imported_torch"),
    ("worker: data, model, optimizer", "imported_torch", "built"),
    ("worker: import phalanx (Session)", "built", "imported_phalanx"),
    ("Session(): before the process group", "session_start", "pg_start"),
    ("process group (init_process_group)", "pg_start", "pg_done"),
    ("Session(): after the process group", "pg_done", "session_done"),
    ("setup() / DDP, sampler, loader", "session_done", "setup_done"),
    ("first optimizer step", "setup_done", "first_step"),
    (f"steps 2..{STEPS}", "first_step", "last_step"),
    ("close, exit and the launcher's end", "last_step", "launcher_end"),
]
ORDER = [
    "t0",
    "launcher_start",
    "launcher_imported",
    "agent_start",
    "process_start",
    "script_start",
    "imported_torch",
    "built",
    "imported_phalanx",
    "session_start",
    "pg_start",
    "pg_done",
    "session_done",
    "setup_done",
    "first_step",
    "last_step",
    "end",
    "launcher_end",
]
LAUNCHER_MARKS = {"t0", "launcher_start", "launcher_imported", "agent_start"}
WORKER_MARKS = set(ORDER[ORDER.index("process_start") : ORDER.index("end") + 1])
TOTALS = ["to the first step", "launch to exit"]
JOB_CPU = "CPU of the whole job (launcher + workers)"


def _one_launch(contender: str, src: str | None, nproc: int, workdir, timeout: float) -> dict | None:
    """One launch: {"wall": {mark: s since t0}, "cpu": {mark: the process's CPU s}, "job_cpu": s}."""
    import subprocess
    import threading

    workdir.mkdir(parents=True)
    marks_file = workdir / "marks.txt"
    env = {**os.environ, MARKS_ENV: str(marks_file), "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    env.pop("PYTHONPATH", None)
    me = os.path.abspath(__file__)
    if src is None:
        args = ["--standalone", f"--nproc-per-node={nproc}", me, "probe-worker", "raw"]
        kind = "torchrun"
    else:
        env["PYTHONPATH"] = os.path.abspath(src)
        args = ["--cpu", "--nproc", str(nproc), me, "probe-worker", "phalanx"]
        kind = "phalanx"
    tag = f"{MARKS_ENV}={marks_file}"
    with open(workdir / "output.txt", "w") as output:
        t0 = time.time()
        proc = subprocess.Popen(
            [sys.executable, me, "probe-launcher", kind, *args], cwd=workdir, env=env, stdout=output, stderr=output
        )
        timer = threading.Timer(timeout, _kill_tagged, (tag,))
        timer.start()
        # wait4: the launcher's CPU time, with that of the workers it reaped.
        _, status, usage = os.wait4(proc.pid, 0)
        t_end = time.time()
        timed_out = not timer.is_alive()
        timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
    _kill_tagged(tag)  # a worker that outlived its launcher
    if proc.returncode != 0:
        how = f"timed out after {timeout:g} s" if timed_out else f"exited {proc.returncode}"
        print(f"{contender} with {nproc} process(es) {how}; left out (see {workdir}/output.txt)", flush=True)
        return None
    wall, cpu = {"t0": t0, "launcher_end": t_end}, {"t0": 0.0}
    for line in marks_file.read_text().splitlines():
        _role, _rank, name, at, used = line.split()
        wall.setdefault(name, float(at))
        cpu.setdefault(name, float(used))
    for i, name in enumerate(ORDER):  # a mark not reached takes the time of the one before it
        if name not in wall:
            wall[name] = wall[ORDER[i - 1]]
            cpu[name] = cpu.get(ORDER[i - 1], 0.0)
    return {
        "wall": {name: wall[name] - t0 for name in ORDER},
        "cpu": cpu,
        "job_cpu": usage.ru_utime + usage.ru_stime,
    }


def _kill_tagged(tag: str) -> None:
    """Every process whose environment holds ``tag``: torch elastic starts each worker in a session
    of its own, so a worker can outlive its launcher."""
    import signal

    needle = tag.encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        os.kill(int(entry), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass


def _phases(launch: dict) -> tuple[dict[str, float], dict[str, float]]:
    """(wall seconds, CPU seconds) per phase; CPU only for the phases inside one process."""
    wall, cpu = launch["wall"], launch["cpu"]
    walls = {name: wall[b] - wall[a] for name, a, b in PHASES}
    walls["to the first step"] = wall["first_step"]
    walls["launch to exit"] = wall["launcher_end"]
    cpus = {}
    for name, a, b in PHASES:
        if {a, b} <= LAUNCHER_MARKS or {a, b} <= WORKER_MARKS:
            cpus[name] = cpu[b] - (0.0 if a == "process_start" else cpu[a])
    cpus[JOB_CPU] = launch["job_cpu"]
    return walls, cpus


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import shutil
    import statistics
    import tempfile
    from pathlib import Path

    import sections

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="launches per contender and process count (default 5)")
    parser.add_argument("--nproc-list", default="1,2", help="process counts (default 1,2)")
    parser.add_argument(
        "--phalanx",
        action="append",
        metavar="NAME=SRC",
        help="a phalanx version to measure: NAME and the directory that holds its `phalanx` package "
        "(repeat for several; default phalanx=<this checkout>/src)",
    )
    parser.add_argument("--timeout", type=float, default=120, help="seconds one launch may take")
    parser.add_argument("--json", metavar="FILE", help="also write every launch's marks and the medians here")
    parser.add_argument("--keep", metavar="DIR", help="keep each launch's directory (output, marks, run dir)")
    sections.add_out_argument(parser)
    args = parser.parse_args(argv)

    repo_src = Path(__file__).resolve().parents[1] / "src"
    versions = dict(v.split("=", 1) for v in (args.phalanx or [f"phalanx={repo_src}"]))
    contenders: list[tuple[str, str | None]] = [("torchrun", None), *versions.items()]
    nprocs = [int(n) for n in args.nproc_list.split(",")]
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="phalanx-startup-"))
    runs: dict[tuple[str, int], list[dict[str, float]]] = {(c, n): [] for c, _ in contenders for n in nprocs}
    started = time.monotonic()
    failed = False
    for r in range(args.rounds):
        for nproc in nprocs:
            turn = contenders[r % len(contenders) :] + contenders[: r % len(contenders)]  # rotate the order
            for name, src in turn:
                workdir = root / f"round{r}-{name}-n{nproc}"
                marks = _one_launch(name, src, nproc, workdir, args.timeout)
                if marks is None:
                    failed = True
                    continue
                runs[(name, nproc)].append(marks)
                print(
                    f"round {r + 1}/{args.rounds}, {nproc} process(es), {name}: "
                    f"first step at {marks['wall']['first_step']:.2f} s, exit at {marks['wall']['launcher_end']:.2f} s",
                    flush=True,
                )
    if not args.keep and not failed:  # a failed launch's directory is kept for its output
        shutil.rmtree(root, ignore_errors=True)

    import platform

    printed = sections.Printed()  # what is printed from here on, for --out
    say = printed.say

    say(
        f"\nstart-up, {args.rounds} rounds, {time.monotonic() - started:.0f} s in all; {platform.node()}, "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the end"
    )
    summary: dict[str, dict] = {}
    for nproc in nprocs:
        names = [name for name, _ in contenders if runs[(name, nproc)]]
        if not names:
            say(f"\n{nproc} process(es): no launch succeeded")
            continue
        measured = {name: [_phases(m) for m in runs[(name, nproc)]] for name in names}
        others = [name for name in names if name != "torchrun"] if "torchrun" in names else []
        summary[str(nproc)] = {}
        for title, which, rows in (
            ("wall-clock seconds", 0, [p for p, _, _ in PHASES] + TOTALS),
            (
                "CPU seconds of the process the phase runs in",
                1,
                [p for p, a, b in PHASES if p in measured[names[0]][0][1]] + [JOB_CPU],
            ),
        ):
            medians = {n: {r: statistics.median(m[which][r] for m in measured[n]) for r in rows} for n in names}
            lows = {n: {r: min(m[which][r] for m in measured[n]) for r in rows} for n in names}
            highs = {n: {r: max(m[which][r] for m in measured[n]) for r in rows} for n in names}
            summary[str(nproc)][title] = {"median": medians, "min": lows, "max": highs}
            say(f"\n{nproc} process(es), {title}: median (min-max) over the launches; rank 0's clock\n")
            header = ["phase"] + [f"{n} ({len(measured[n])})" for n in names] + [f"{o} - torchrun" for o in others]
            say("| " + " | ".join(header) + " |")
            say("| " + " | ".join(["---"] + ["---:"] * (len(header) - 1)) + " |")
            for r in rows:
                cells = [f"{medians[n][r]:.2f} ({lows[n][r]:.2f}-{highs[n][r]:.2f})" for n in names]
                cells += [f"{medians[o][r] - medians['torchrun'][r]:+.2f}" for o in others]
                bold = "**" if r in (*TOTALS, JOB_CPU) else ""
                say(f"| {bold}{r}{bold} | " + " | ".join(cells) + " |")
        versions_here = [n for n in names if n != "torchrun"]
        pairs = [(o, "torchrun") for o in others] + [(v, versions_here[0]) for v in versions_here[1:]]
        wall = summary[str(nproc)]["wall-clock seconds"]["median"]
        cpu = summary[str(nproc)]["CPU seconds of the process the phase runs in"]["median"]
        for mine, base in pairs:
            f_mine, f_base = wall[mine]["to the first step"], wall[base]["to the first step"]
            t_mine, t_base = wall[mine]["launch to exit"], wall[base]["launch to exit"]
            c_mine, c_base = cpu[mine][JOB_CPU], cpu[base][JOB_CPU]
            say(
                f"{mine} against {base}, {nproc} process(es): first step {f_mine - f_base:+.2f} s "
                f"(x{f_mine / f_base:.2f}), launch to exit {t_mine - t_base:+.2f} s (x{t_mine / t_base:.2f}), "
                f"job CPU {c_mine - c_base:+.2f} s (x{c_mine / c_base:.2f})"
            )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"runs": {f"{c} n{n}": v for (c, n), v in runs.items()}, "summary": summary}, indent=1)
        )
    if args.out:
        settings = (
            f"{args.rounds} interleaved rounds; 5 optimizer steps of a tiny MLP per launch, CPU processes on gloo"
        )
        sections.write_section(
            Path(args.out), "startup", TITLE, script=__file__, argv=argv, settings=settings, lines=printed.lines
        )
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["probe-launcher"]:
        sys.exit(_probe_launcher(sys.argv[2], sys.argv[3:]))
    elif sys.argv[1:2] == ["probe-worker"]:
        _probe_worker(sys.argv[2])
    else:
        sys.exit(main())
