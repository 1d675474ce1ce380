"""The one paragraph under the bench table: what the figures say and what to try, computed from them."""

from __future__ import annotations

from phalanx.bench.report import ms
from phalanx.bench.scaling import Scaling

GOOD_EFFICIENCY = 0.9
SUPERLINEAR = 1.1  # beyond noise: the baseline itself is suspect
NOTABLE_SHARE = 0.10  # a part of the step worth naming


def reading(
    rows: list[Scaling], *, cpu: bool, cores: int | None = None, threads: int | None = None, fixed_layout: bool = False
) -> str:
    """``fixed_layout``: the script's batch sizes may not change, so they are not among the advice."""
    if len(rows) < 2:
        return (
            "Only the 1-device run was measured, so there is no scaling to read; give --nproc-list 1,2,... to compare."
        )
    base, top = rows[0], rows[-1]
    units = "processes" if cpu else "devices"
    n = top.nproc
    step = top.run.step_time
    data_share = top.run.data_wait / step if step else 0.0
    comm_share = top.comm_wait / step if step else 0.0
    parts = [
        f"{n} {units} give {top.run.samples_per_s:,.0f} samples/s against {base.run.samples_per_s:,.0f} on one: "
        f"{top.speedup:.2f}x, {top.efficiency:.0%} scaling efficiency."
    ]
    if top.efficiency > SUPERLINEAR:
        parts.append(
            "Above 100% means the 1-device run was slow for reasons of its own (other work on the machine, "
            "threads contending, a cold cache), so it is a poor baseline: repeat the bench on an idle machine, "
            "with more --steps."
        )
    elif top.efficiency >= GOOD_EFFICIENCY:
        parts.append("Scales well: there is little to gain from tuning the launch.")
        if data_share >= NOTABLE_SHARE:
            parts.append(
                f"Still, {data_share:.0%} of each step is spent waiting for the loader; "
                "data.num_workers may win it back."
            )
    elif data_share >= NOTABLE_SHARE and data_share >= comm_share:
        parts.append(
            f"Data-bound: at {n} each step waits {ms(top.run.data_wait)} ({data_share:.0%} of it) for the loader. "
            "Raise data.num_workers (loader processes per rank), keep data.pin_memory on with GPUs, "
            "and move decoding or augmentation out of the training process."
        )
    elif comm_share >= NOTABLE_SHARE:
        parts.append(
            f"Communication-bound: at {n} each {ms(step)} step spends {ms(top.comm_wait)} ({comm_share:.0%}) "
            "beyond the 1-device compute and the data wait. "
            + (
                ""
                if fixed_layout
                else "Larger micro-batches per device (batch.global_batch_size, batch.micro_batch_size) put more "
                "compute behind each gradient all-reduce; "
            )
            + "strategy.ddp.bucket_cap_mb sets how gradients are grouped into all-reduces; "
            "`phalanx doctor` measures the all-reduce bandwidth between the devices."
        )
    else:
        parts.append(
            f"Neither communication nor data wait stands out ({comm_share:.0%} and {data_share:.0%} "
            f"of the {ms(step)} step); "
            "the loss is spread thin, so measure again with more --steps before tuning."
        )
    if cpu and top.efficiency < GOOD_EFFICIENCY:
        each = f"{threads} thread{'s' if threads != 1 else ''} each" if threads else "their threads"
        machine = f"one machine's {cores} cores" if cores else "one machine's cores"
        parts.append(
            f"These are CPU processes ({each}) sharing {machine}, its memory bandwidth and caches: "
            "the communication share also holds that contention, not only gloo's all-reduce."
        )
    return " ".join(parts)
