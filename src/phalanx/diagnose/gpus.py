"""Which of the driver's GPUs torch uses, and how they are linked: shared by the checks and the live
check's expectation. The driver numbers GPUs in PCI order over the whole machine; torch numbers the
visible ones, in CUDA's order, so the two are matched by UUID where torch reports it."""

from __future__ import annotations

import re
from collections import Counter
from typing import Iterable

from phalanx.diagnose.facts import Facts
from phalanx.diagnose.nvidia import Gpu
from phalanx.util.units import format_bytes


def used_gpus(facts: Facts) -> list[Gpu]:
    """The driver's entries for the GPUs torch uses, in torch's order (index i is cuda:i)."""
    by_uuid = {gpu.uuid: gpu for gpu in facts.driver.gpus if gpu.uuid}
    matched = [by_uuid.get(gpu.uuid) for gpu in facts.cuda_gpus]
    if facts.cuda_gpus and all(matched):
        return matched  # type: ignore[return-value]
    tokens = visible_tokens(facts)
    if tokens is None:
        return list(facts.driver.gpus)
    picked = []
    for token in tokens:
        gpu = next(
            (
                g
                for g in facts.driver.gpus
                if (str(g.index) == token if token.isdigit() else (g.uuid or "").startswith(token))
            ),
            None,
        )
        if gpu is None:
            break  # CUDA ignores everything from the first entry it cannot resolve
        picked.append(gpu)
    return picked


def visible_tokens(facts: Facts) -> list[str] | None:
    raw = facts.env.get("CUDA_VISIBLE_DEVICES")
    return None if raw is None else [t.strip() for t in raw.split(",") if t.strip()]


def link_kind(code: str) -> str:
    """A code of ``nvidia-smi topo -m`` -> nvlink, pcie, sockets (crosses the CPU interconnect) or unknown."""
    if re.fullmatch(r"NV\d+", code):
        return "nvlink"
    if code in ("PIX", "PXB", "PHB", "NODE"):
        return "pcie"
    if code in ("SYS", "SOC"):  # SOC: older drivers' name for SYS
        return "sockets"
    return "unknown"


def used_links(facts: Facts) -> dict[tuple[int, int], str] | None:
    """Links between the used GPUs, keyed by torch index pairs (i < j); None without a topology."""
    if facts.driver.links is None:
        return None
    position = {gpu.index: k for k, gpu in enumerate(used_gpus(facts))}
    links = {}
    for a, b, code in facts.driver.links:
        if a in position and b in position:
            i, j = sorted((position[a], position[b]))
            links[(i, j)] = code
    return links


def groups(count: int, joined: Iterable[tuple[int, int]]) -> list[list[int]]:
    """Connected groups of GPUs 0..count-1 under ``joined`` pairs, largest first."""
    parent = list(range(count))

    def root(k: int) -> int:
        while parent[k] != k:
            k = parent[k]
        return k

    for i, j in joined:
        parent[root(i)] = root(j)
    found: dict[int, list[int]] = {}
    for k in range(count):
        found.setdefault(root(k), []).append(k)
    return sorted(found.values(), key=len, reverse=True)


def describe_gpus(gpus: Iterable[Gpu]) -> str:
    counts = Counter((gpu.name, format_bytes(gpu.memory_bytes) if gpu.memory_bytes else None) for gpu in gpus)
    return ", ".join(f"{n} x {name}" + (f" ({memory})" if memory else "") for (name, memory), n in counts.items())


def pair_names(
    pairs: Iterable[tuple[int, int]], codes: dict[tuple[int, int], str] | None = None, limit: int = 4
) -> str:
    pairs = list(pairs)
    shown = [f"{i}-{j}" + (f" ({codes[(i, j)]})" if codes else "") for i, j in pairs[:limit]]
    more = f" and {len(pairs) - limit} more" if len(pairs) > limit else ""
    return ", ".join(shown) + more
