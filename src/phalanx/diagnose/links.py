"""What bandwidth the link between the devices should give, to compare the live all-reduce with.

A ring all-reduce's bus bandwidth approaches the one-way bandwidth of the slowest link in the ring
(that is why nccl-tests define bus bandwidth as they do), so the expectation is that figure. The
per-link numbers are the vendors' nominal ones; measured figures land somewhat below them.
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.diagnose import gpus as g
from phalanx.diagnose.facts import Facts
from phalanx.util.units import format_rate

NVLINK_PER_LINK = 25e9  # bytes/s one way per link: NVLink 2, 3 and 4 (V100, A100, H100/H200)
NVLINK5_PER_LINK = 50e9  # Blackwell (compute capability 10 and up)
PCIE_PER_LANE = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9}  # one way, after encoding


@dataclass(frozen=True)
class Expectation:
    link: str  # the link in words
    bytes_per_second: float | None  # one way; None where there is no honest figure
    note: str


def expectation(facts: Facts, nproc: int, cpu: bool) -> Expectation:
    if cpu:
        return Expectation(
            "loopback TCP between CPU processes (gloo)",
            None,
            "no expectation: on CPU this measures memory copies and the kernel's TCP stack, not a device link",
        )
    links = g.used_links(facts)
    pairs = {pair: code for pair, code in (links or {}).items() if pair[1] < nproc}
    if not pairs:
        return Expectation("unknown link", None, "no expectation: `nvidia-smi topo -m` gave no GPU matrix")
    kinds = {g.link_kind(code) for code in pairs.values()}
    if kinds == {"nvlink"}:
        return _nvlink(facts, min(int(code[2:]) for code in pairs.values()))
    if kinds <= {"pcie", "sockets", "nvlink"}:
        return _pcie(facts, nproc, "sockets" in kinds)
    return Expectation(
        "unknown link", None, f"no expectation: unrecognised link codes {', '.join(sorted(set(pairs.values())))}"
    )


def _nvlink(facts: Facts, links: int) -> Expectation:
    capability = facts.cuda_gpus[0].compute_capability if facts.cuda_gpus else None
    major = int(capability.split(".")[0]) if capability else 0
    per_link = NVLINK5_PER_LINK if major >= 10 else NVLINK_PER_LINK
    peak = links * per_link
    return Expectation(
        f"NVLink, {links} link{'s' if links != 1 else ''} per pair (NV{links})",
        peak,
        (
            f"bus bandwidth approaches {format_rate(peak)} ({links} x {format_rate(per_link)} one way) "
            "at the largest sizes"
        ),
    )


def _pcie(facts: Facts, nproc: int, sockets: bool) -> Expectation:
    used = g.used_gpus(facts)[:nproc]
    gens = [gpu.pcie_gen for gpu in used if gpu.pcie_gen]
    widths = [gpu.pcie_width for gpu in used if gpu.pcie_width]
    across = " across CPU sockets" if sockets else ""
    if not gens or not widths or min(gens) not in PCIE_PER_LANE:
        return Expectation(
            f"PCIe{across}", None, "no expectation: nvidia-smi does not report the PCIe generation and width"
        )
    gen, width = min(gens), min(widths)
    peak = PCIE_PER_LANE[gen] * width
    return Expectation(
        f"PCIe Gen{gen} x{width}{across}",
        peak,
        (
            f"bus bandwidth reaches 60-80% of {format_rate(peak)} one way at the largest sizes"
            f"{', less across sockets' if sockets else ''}"
        ),
    )
