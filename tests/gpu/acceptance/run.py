"""Every CUDA path of phalanx that one GPU can run, each a measured figure against a stated tolerance.

Parts (tests/gpu/acceptance/, one module each), with what each is designed to take on one H200:

  ddp         45s  the default path, strategy ddp, in bf16 and fp16: alone (one-rank NCCL group) against
                   fp32, and 2 processes sharing cuda:0 over gloo against one process
  resume      25s  checkpoint and resume mid-epoch (ddp alone fp16 and bf16, fsdp alone bf16): the
                   uninterrupted run's weights bit for bit
  precision   40s  bf16 and fp16 (autocast, GradScaler) against fp32: demo CNN accuracy, MLP loss
                   curve (Adam), MLP weight update (SGD + clipping)
  fsdp        30s  FSDP2 alone (strategy fsdp, one process): fp32 = single, the bf16
                   MixedPrecisionPolicy against fp32, cpu_offload
  processes   60s  two processes sharing cuda:0 over gloo, ddp and zero1, against one process
  prefetch    60s  the side-stream prefetcher: same batches, same weights, its speed
  compile     75s  compute.compile against eager: losses, weights, step time
  plan        35s  `phalanx plan`'s bytes against the allocator's peak of a real step, per strategy
  tune        90s  `phalanx tune`'s micro-batch search hitting a CUDA out-of-memory under train.memory_cap
  speed       60s  samples/s and MFU of phalanx against a hand-written loop, interleaved, medians
  syncs       30s  host-device syncs per step in phalanx's own code (sync debug mode) and the device's
                   idle steps and step time (CUDA events), against a hand-written loop

About 9 minutes in all. The parts run in the order --parts names them. The JSON (--out) is written
again after every part, so a run stopped by a timeout keeps what it finished; --time-limit S starts
no part whose budget would end past S seconds, and lists it as not run. Prints a table; exits 1 when
any check failed, 3 when none failed but a part was not run, 0 otherwise. Without CUDA it prints one
line and exits 1. --cpu-smoke runs the parts on the CPU at toy sizes to try the script itself
(figures meaningless, verdicts ignored; exit 0 when no part crashed).

    python -m tests.gpu.acceptance.run [--parts ddp,resume] [--time-limit 120] [--out runs/gpu-check.json]

(benchmarks/gpu_check.sh 1 and 2 run these parts between them, with the CUDA tests.)
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

# The repository root, so that `python tests/gpu/acceptance/run.py` finds its parts as -m does.
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402


def parts(args: argparse.Namespace) -> list:
    from tests.gpu.acceptance import (
        compiled,
        ddp,
        fsdp,
        memory,
        precision,
        prefetch,
        processes,
        resume,
        speed,
        syncs,
        tuning,
    )
    from tests.gpu.acceptance.report import Part

    return [
        Part("ddp", 45, ddp.run, "ddp bf16, fp16: alone (one-rank NCCL) and 2 processes on one GPU over gloo"),
        Part("resume", 25, resume.run, "checkpoint and resume: ddp alone fp16, bf16; fsdp alone bf16"),
        Part("precision", 40, lambda: precision.run(args.epochs), "precision bf16, fp16 (GradScaler) on single"),
        Part("fsdp", 30, fsdp.run, "fsdp alone: fp32, bf16 MixedPrecisionPolicy, cpu_offload"),
        Part("processes", 60, processes.run, "ddp, zero1 with 2 processes on one GPU over gloo, side stream"),
        Part("prefetch", 60, lambda: prefetch.run(args.repeats), "data.prefetch_to_device (side-stream copy)"),
        Part("compile", 75, compiled.run, "compute.compile on single"),
        Part("plan", 35, memory.run, "phalanx plan vs real step memory: single, ddp, zero1, fsdp alone"),
        Part("tune", 90, tuning.run, "phalanx tune micro-batch search, CUDA OOM under train.memory_cap"),
        Part("speed", 60, lambda: speed.run(args.repeats), "phalanx single vs hand-written loop: samples/s, MFU"),
        Part("syncs", 30, lambda: syncs.run(args.repeats), "host-device syncs per step, device idle (CUDA events)"),
    ]


def smoke_sizes() -> None:
    """Toy sizes on the CPU: enough to run every line of every part, nothing to measure."""
    from tests.gpu.acceptance import (
        compiled,
        ddp,
        fsdp,
        memory,
        precision,
        prefetch,
        processes,
        speed,
        syncs,
        tuning,
        workloads,
    )

    workloads.DEVICE = torch.device("cpu")
    fsdp.OFFLOAD = False
    memory.WIDTH, memory.DEPTH, memory.MICRO = 64, 4, 8
    memory.CASES = memory.CASES[:1] + memory.CASES[3:4]
    speed.WIDTH, speed.DEPTH, speed.MICRO, speed.STEPS = 64, 2, 32, {"bf16": 3, "fp32": 3}
    syncs.FEATURES, syncs.WIDTH, syncs.MICRO, syncs.STEPS, syncs.WARMUP = 32, 64, 32, 6, 2
    precision.CURVE_STEPS, precision.UPDATE_STEPS, precision.MICRO = 10, 5, 32
    prefetch.SPEED_STEPS = 2
    compiled.STEPS, compiled.MICRO = 12, 32
    processes.STEPS = 3
    ddp.STEPS = 10
    tuning.CAP, tuning.WIDTH, tuning.GLOBAL_BATCH = "48MiB", 512, 8192  # CPU: the cap is on resident memory


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1], formatter_class=Raw
    )
    parser.add_argument("--parts", help="comma-separated, run in this order (default all, in the order of parts())")
    parser.add_argument("--out", type=Path, help="the JSON to write (default runs/gpu-check-<date>-<time>.json)")
    parser.add_argument("--time-limit", type=float, help="seconds: start no part whose budget would end past them")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of each timed contender, medians (default 3)")
    parser.add_argument("--epochs", type=int, default=8, help="epochs of the demo CNN per precision (default 8)")
    parser.add_argument("--cpu-smoke", action="store_true", help="try the script on the CPU at toy sizes (no check)")
    args = parser.parse_args()
    by_name = {p.name: p for p in parts(args)}
    asked = args.parts.split(",") if args.parts is not None else by_name
    chosen = list(dict.fromkeys(p.strip() for p in asked if p.strip()))
    unknown = sorted(set(chosen) - set(by_name))
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(by_name)}")
    if not torch.cuda.is_available() and not args.cpu_smoke:
        sys.exit(
            f"gpu_check: no CUDA device visible (torch {torch.__version__}, built for CUDA "
            f"{torch.version.cuda or 'none'}); run it on a machine with a GPU"
        )
    if args.cpu_smoke:
        smoke_sizes()

    import phalanx
    from tests.gpu.acceptance.report import print_table, run_part, skipped_part, write_json
    from tests.gpu.acceptance.workloads import device_name

    name = device_name()
    out = args.out or Path("runs") / f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}.json"
    facts = {
        "gpu": name if not args.cpu_smoke else "none (cpu smoke run: not a GPU check)",
        "smoke": args.cpu_smoke,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "phalanx": phalanx.__version__,
        "python": platform.python_version(),
        "command": " ".join(sys.argv),
        "parts_asked": chosen,
        "time_limit_s": args.time_limit,
    }
    started = time.perf_counter()
    results = []
    for part in (by_name[n] for n in chosen):
        elapsed = time.perf_counter() - started
        if args.time_limit is not None and elapsed + part.budget_s > args.time_limit:
            print(f"gpu_check: {part.name} not run: {elapsed:.0f}s + its budget {part.budget_s:.0f}s > --time-limit")
            results.append(skipped_part(part, f"not run: {elapsed:.0f}s gone of --time-limit {args.time_limit:g}s"))
        else:
            print(f"gpu_check: {part.name} (budget {part.budget_s:.0f}s) ...", flush=True)
            results.append(run_part(part))
            late = "  OVER BUDGET" if results[-1].over_budget else ""
            print(f"gpu_check: {part.name} done in {results[-1].seconds:.0f}s{late}", flush=True)
        # Written after every part: a run stopped by a timeout keeps every part it finished.
        done = len(results) == len(chosen)
        write_json(out, facts | {"complete": done, "seconds": round(time.perf_counter() - started, 1)}, results)
    total = time.perf_counter() - started

    print_table(f"phalanx GPU check on {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}", results)
    failed = [f"{r.name}: {c.name}" for r in results for c in r.checks if c.passed is False]
    crashed = [r.name for r in results if any(c.name in ("crashed", "clean-up after the part") for c in r.checks)]
    not_run = [r.name for r in results if r.not_run]
    print(f"{', '.join(chosen)} in {total:.0f}s; {out}")
    if args.cpu_smoke:
        outcome = f"crashed: {', '.join(crashed)}" if crashed else "no part crashed"
        print(f"gpu_check: cpu smoke run, verdicts ignored; {outcome}")
        sys.exit(1 if crashed else 0)
    statuses = [c.status for r in results if not r.not_run for c in r.checks]
    counts = ", ".join(f"{statuses.count(s)} {s}" for s in ("pass", "FAIL", "n/a"))
    if failed:
        print(f"gpu_check: {len(failed)} check(s) failed: {'; '.join(failed)}")
    print(f"gpu_check: {counts}; not run: {', '.join(not_run) or 'none'}")  # the figure gpu_check.sh shows
    if failed:
        sys.exit(1)
    sys.exit(3 if not_run else 0)


class Raw(argparse.RawDescriptionHelpFormatter):
    pass


if __name__ == "__main__":
    main()
