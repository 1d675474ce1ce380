"""The checks of ``phalanx doctor``: pure functions from :class:`Facts` to a :class:`Verdict` each,
with what was found and, when something is off, the concrete fix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from phalanx.diagnose import gpus as g
from phalanx.diagnose.facts import UNLIMITED, Facts
from phalanx.util.units import GIB, format_bytes

OK, WARNING, PROBLEM, SKIPPED = "ok", "warning", "problem", "skipped"
STATUSES = (OK, WARNING, PROBLEM, SKIPPED)

SHM_MIN_BYTES = GIB  # Docker's default is 64 MiB, a known cause of "bus error" in DataLoader workers
NOFILE_MIN = 4096  # each batch a worker hands over holds file descriptors until it is consumed
BUSY_GPU_BYTES = GIB  # memory in use beyond what any listed process explains


@dataclass(frozen=True)
class Verdict:
    check: str
    status: str  # one of STATUSES
    detail: str  # what was found, or why the check was skipped
    fix: str = ""


def run_checks(facts: Facts) -> list[Verdict]:
    return [
        gpu_visibility(facts),
        cuda_driver(facts),
        gpu_topology(facts),
        peer_to_peer(facts),
        gpu_processes(facts),
        shared_memory(facts),
        open_files(facts),
        *environment(facts),
    ]


def _no_gpu_reason(facts: Facts) -> str:
    build = (
        f"torch {facts.torch} is a CPU build"
        if facts.torch_cuda is None
        else f"torch finds no CUDA device{f' ({facts.cuda_error})' if facts.cuda_error else ''}"
    )
    if facts.driver.answered:
        return f"torch uses no GPU: {build}"
    return f"no NVIDIA GPU: {facts.driver.notes.get('nvidia-smi', 'nvidia-smi gave no answer')}, and {build}"


def gpu_visibility(facts: Facts) -> Verdict:
    name, driver, seen = "GPU visibility", facts.driver, len(facts.cuda_gpus)
    on_machine = len(driver.gpus)
    tokens = g.visible_tokens(facts)
    setting = f"CUDA_VISIBLE_DEVICES={facts.env.get('CUDA_VISIBLE_DEVICES', '')!r}"
    if not driver.installed and not seen:
        return Verdict(name, SKIPPED, f"{_no_gpu_reason(facts)}; phalanx runs CPU processes on gloo")
    if not driver.answered and not seen:
        # With a CPU build of torch, GPUs may not be wanted at all: then the tool is merely stray.
        return Verdict(
            name,
            PROBLEM if facts.torch_cuda else WARNING,
            f"nvidia-smi is installed but gives no answer: {driver.notes.get('nvidia-smi', '')}",
            (
                "the NVIDIA driver is not loaded or does not match its tools: "
                "reboot after a driver upgrade (or reload the nvidia kernel modules); "
                "in a container, start it with --gpus all (NVIDIA Container Toolkit)"
            ),
        )
    if facts.torch_cuda is None and on_machine:
        wanted = (
            f"CUDA {driver.driver_cuda} or older"
            if driver.driver_cuda
            else "the CUDA version the driver supports or older"
        )
        return Verdict(
            name,
            PROBLEM,
            f"the driver lists {on_machine} GPU(s) but torch {facts.torch} is a CPU build",
            f"install a CUDA build of torch for {wanted} (index URLs at https://pytorch.org/get-started/locally/)",
        )
    if tokens is not None and on_machine and not seen and (not tokens or tokens[0] in ("-1", "none", "NoDevFiles")):
        return Verdict(
            name,
            PROBLEM,
            f"{setting} hides every GPU from torch ({on_machine} on the machine)",
            "unset CUDA_VISIBLE_DEVICES, or list the GPUs to use, e.g. CUDA_VISIBLE_DEVICES=0,1",
        )
    if tokens is not None and seen < len(tokens):
        return Verdict(
            name,
            PROBLEM,
            (
                f"{setting} names {len(tokens)} GPU(s) but torch sees {seen}: "
                "CUDA ignores everything from the first entry that is not a GPU here"
            ),
            f"list GPUs that exist: indices 0-{on_machine - 1} or UUIDs from `nvidia-smi -L`"
            if on_machine
            else "list GPUs that exist (`nvidia-smi -L`)",
        )
    if on_machine and not seen:
        return Verdict(
            name,
            PROBLEM,
            (
                f"the driver lists {on_machine} GPU(s) but torch sees none: "
                f"{facts.cuda_error or 'torch.cuda.device_count() is 0'}"
            ),
            "see the 'torch CUDA vs driver' check; in a container, start it with --gpus all",
        )
    if tokens is None and seen < on_machine:
        return Verdict(
            name,
            WARNING,
            f"torch sees {seen} of the {on_machine} GPUs the driver lists",
            "`nvidia-smi -L` and `nvidia-smi -q -d ECC,PAGE_RETIREMENT` show GPUs in MIG mode or in an error state",
        )
    one = "; one GPU: multi-process strategies need 2 or more" if seen == 1 else ""
    if tokens is not None:
        return Verdict(
            name,
            OK,
            (
                f"torch sees {seen} GPU(s) as {setting} asks ({on_machine} on the machine): "
                f"{g.describe_gpus(facts.cuda_gpus)}{one}"
            ),
        )
    return Verdict(name, OK, f"torch sees every GPU: {g.describe_gpus(facts.cuda_gpus)}{one}")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:2] if part.isdigit())


def cuda_driver(facts: Facts) -> Verdict:
    name, built, supported = "torch CUDA vs driver", facts.torch_cuda, facts.driver.driver_cuda
    if built is None:
        return Verdict(name, SKIPPED, f"torch {facts.torch} is a CPU build: no CUDA runtime to compare with a driver")
    if supported is None:
        why = (
            facts.driver.notes.get("nvidia-smi")
            or facts.driver.notes.get("driver cuda")
            or "nvidia-smi does not print a CUDA version"
        )
        return Verdict(name, SKIPPED, f"the driver's CUDA version is unknown: {why}")
    found = (
        f"torch {facts.torch} is built for CUDA {built}; driver {facts.driver.driver or '?'} supports CUDA {supported}"
    )
    upgrade = (
        f"upgrade the NVIDIA driver to one that supports CUDA {built}, "
        f"or install a torch build for CUDA {supported} or older (https://pytorch.org/get-started/locally/)"
    )
    if _version(built)[:1] > _version(supported)[:1]:
        return Verdict(name, PROBLEM, f"{found} at most: CUDA cannot start on this driver", upgrade)
    if _version(built) > _version(supported):
        return Verdict(
            name,
            WARNING,
            (
                f"{found} at most: it runs through CUDA minor-version compatibility, "
                "but code compiled at run time (torch.compile, Triton, PTX) can fail with 'unsupported PTX version'"
            ),
            upgrade,
        )
    return Verdict(name, OK, f"{found} (at least the build's version)")


def gpu_topology(facts: Facts) -> Verdict:
    name, used = "GPU topology", g.used_gpus(facts)
    if not facts.driver.answered:
        return Verdict(
            name,
            SKIPPED,
            _no_gpu_reason(facts)
            if not facts.driver.installed
            else f"nvidia-smi gives no answer: {facts.driver.notes.get('nvidia-smi', '')}",
        )
    if len(used) < 2:
        return Verdict(name, SKIPPED, f"{'one GPU' if used else 'no GPU'} in use: no link between GPUs to check")
    links = g.used_links(facts)
    if not links:
        return Verdict(
            name,
            SKIPPED,
            (
                "`nvidia-smi topo -m` gives no GPU matrix: "
                f"{facts.driver.notes.get('topology', 'no GPU rows in its output')}"
            ),
        )
    kinds = {pair: g.link_kind(code) for pair, code in links.items()}
    by_kind = {
        kind: [pair for pair, k in kinds.items() if k == kind] for kind in ("nvlink", "pcie", "sockets", "unknown")
    }
    codes = ", ".join(sorted(set(links.values())))
    if by_kind["sockets"]:
        same_socket = g.groups(len(used), [pair for pair, kind in kinds.items() if kind != "sockets"])[0]
        return Verdict(
            name,
            WARNING,
            (
                f"GPU pairs {g.pair_names(by_kind['sockets'], links)} cross CPU sockets: "
                "their traffic goes through the CPU interconnect (QPI/UPI), the slowest path, "
                "and all-reduce runs at its speed"
            ),
            _subset_fix(same_socket, "on one CPU socket"),
        )
    if by_kind["nvlink"] and (by_kind["pcie"] or by_kind["unknown"]):
        linked = g.groups(len(used), by_kind["nvlink"])[0]
        return Verdict(
            name,
            WARNING,
            (
                "NVLink between some GPUs, PCIe only between others "
                f"(pairs {g.pair_names(by_kind['pcie'] + by_kind['unknown'], links)}): "
                "a ring all-reduce runs at the speed of its slowest link"
            ),
            _subset_fix(linked, "joined by NVLink"),
        )
    if by_kind["nvlink"]:
        return Verdict(name, OK, f"NVLink between every pair of the {len(used)} GPUs ({codes})")
    if by_kind["pcie"]:
        return Verdict(
            name,
            OK,
            f"PCIe only between the {len(used)} GPUs ({codes}), no NVLink: all-reduce bandwidth is bounded by PCIe",
        )
    return Verdict(name, SKIPPED, f"unrecognised link codes in `nvidia-smi topo -m`: {codes}")


def _subset_fix(subset: list[int], how: str) -> str:
    if len(subset) < 2:
        return "nothing to change when you need every GPU; expect lower all-reduce bandwidth"
    return (
        f"when fewer GPUs will do, take GPUs {how}: phalanx launch --gpus {','.join(map(str, subset))} ...; "
        "with every GPU, expect lower all-reduce bandwidth"
    )


def peer_to_peer(facts: Facts) -> Verdict:
    name = "peer-to-peer access"
    if facts.peer_access is None:
        reason = (
            _no_gpu_reason(facts)
            if not facts.cuda_gpus
            else f"{len(facts.cuda_gpus)} GPU visible to torch: no pair to test"
        )
        return Verdict(name, SKIPPED, reason)
    blocked = [(i, j) for i, j, ok in facts.peer_access if not ok]
    if not blocked:
        return Verdict(name, OK, f"every pair of the {len(facts.cuda_gpus)} GPUs can read the other's memory directly")
    return Verdict(
        name,
        WARNING,
        (
            f"no peer-to-peer access between GPU pairs {g.pair_names(blocked)}: "
            "NCCL copies through host memory instead, usually several times slower "
            "(many consumer GPUs have it off in the driver; nothing to fix then)"
        ),
        (
            "on bare metal, turn on IOMMU pass-through (iommu=pt on the kernel command line) "
            "or turn off PCIe ACS in the BIOS; in a VM the hypervisor must expose peer-to-peer; "
            "`nvidia-smi topo -p2p r` shows the driver's view"
        ),
    )


def gpu_processes(facts: Facts) -> Verdict:
    name, driver = "other GPU processes", facts.driver
    if not driver.answered:
        return Verdict(
            name,
            SKIPPED,
            _no_gpu_reason(facts)
            if not driver.installed
            else f"nvidia-smi gives no answer: {driver.notes.get('nvidia-smi', '')}",
        )
    if driver.processes is None:
        return Verdict(name, SKIPPED, f"cannot list GPU processes: {driver.notes.get('gpu processes', 'no answer')}")
    used = g.used_gpus(facts)
    uuids = {gpu.uuid for gpu in used if gpu.uuid}
    relevant = [p for p in driver.processes if not uuids or p.gpu in uuids]
    others = [p for p in relevant if p.pid != facts.pid]
    index = {gpu.uuid: k for k, gpu in enumerate(used)}
    listed = {gpu.uuid: sum(p.used_bytes or 0 for p in relevant if p.gpu == gpu.uuid) for gpu in used}
    busy = [
        (k, gpu)
        for k, gpu in enumerate(used)
        if (gpu.memory_used_bytes or 0) - listed.get(gpu.uuid, 0) > BUSY_GPU_BYTES
    ]
    found, fixes = [], []
    if others:
        more = f"; {len(others) - 5} more" if len(others) > 5 else ""
        found.append(
            "; ".join(
                f"pid {p.pid} ({p.name}) holds {format_bytes(p.used_bytes)} on GPU {index.get(p.gpu, p.gpu)}"
                for p in others[:5]
            )
            + more
        )
        fixes.append(
            f"stop them (kill {' '.join(str(p.pid) for p in others[:5])}) or use other GPUs (phalanx launch --gpus ...)"
        )
    if busy:
        found.append(
            "; ".join(
                (
                    f"GPU {k} has {format_bytes(gpu.memory_used_bytes)} in use "
                    "that no process listed here explains (another container?)"
                )
                for k, gpu in busy
            )
        )
        fixes.append("find the owner with `nvidia-smi` on the host (or `fuser -v /dev/nvidia*`) and stop it")
    if found:
        return Verdict(
            name, WARNING, f"{'; '.join(found)}: they take memory and compute from your job", "; ".join(fixes)
        )
    return Verdict(
        name, OK, f"no other process holds memory on the {len(used)} GPU(s) (listed by {driver.process_source})"
    )


def shared_memory(facts: Facts) -> Verdict:
    name, size, free = "/dev/shm", facts.shm_bytes, facts.shm_free_bytes
    if size is None:
        return Verdict(
            name, SKIPPED, "/dev/shm does not exist here (not Linux): DataLoader workers share memory another way"
        )
    fix = (
        "give the container more: docker run --shm-size=8g (or --ipc=host); "
        "on Kubernetes mount an emptyDir with medium: Memory at /dev/shm; or use DataLoader(num_workers=0)"
    )
    if size < SHM_MIN_BYTES:
        return Verdict(
            name,
            WARNING,
            (
                f"/dev/shm is {format_bytes(size)}: "
                "DataLoader workers hand batches over through it and die with 'bus error' when it fills"
            ),
            fix,
        )
    if free is not None and free < SHM_MIN_BYTES:
        return Verdict(
            name,
            WARNING,
            (
                f"/dev/shm has {format_bytes(free)} free of {format_bytes(size)}: "
                "DataLoader workers die with 'bus error' when it fills"
            ),
            "remove what crashed jobs left there (ls -la /dev/shm) or give it more room (docker run --shm-size=8g)",
        )
    return Verdict(name, OK, f"/dev/shm is {format_bytes(size)} ({format_bytes(free)} free)")


def open_files(facts: Facts) -> Verdict:
    name, soft, hard = "open-file limit", facts.nofile_soft, facts.nofile_hard
    if soft is None:
        return Verdict(name, SKIPPED, "RLIMIT_NOFILE cannot be read on this system")
    if soft == UNLIMITED or soft >= NOFILE_MIN:
        return Verdict(name, OK, f"{'unlimited' if soft == UNLIMITED else soft} open files per process")
    target = 65536
    if hard == UNLIMITED or (hard is not None and hard >= target):
        fix = f"run `ulimit -n {target}` in the shell that starts training (the hard limit allows it)"
    else:
        fix = (
            f"raise the hard limit ({hard}): `* - nofile {target}` in /etc/security/limits.conf, "
            f"LimitNOFILE={target} for a systemd service, or docker run --ulimit nofile={target}:{target}; "
            f"then `ulimit -n {target}`"
        )
    return Verdict(
        name,
        WARNING,
        (
            f"{soft} open files per process (below {NOFILE_MIN}): "
            "DataLoader workers hold a file descriptor per shared tensor "
            "and fail with 'Too many open files' or 'received 0 items of ancdata'"
        ),
        fix,
    )


def _on(value: str) -> bool:
    return value.strip() not in ("", "0")  # NCCL reads these as integers: anything else switches them on


@dataclass(frozen=True)
class _EnvRule:
    name: str
    applies: Callable[[str], bool]
    why: str
    fix: str


_ENV_RULES = (
    _EnvRule(
        "NCCL_P2P_DISABLE",
        _on,
        (
            "turns off NVLink and PCIe peer-to-peer: "
            "NCCL routes GPU-to-GPU traffic through host memory, often several times slower"
        ),
        "unset NCCL_P2P_DISABLE; it only works around broken peer-to-peer, which the peer-to-peer check tests",
    ),
    _EnvRule(
        "NCCL_P2P_LEVEL",
        lambda v: v.strip().upper() in ("LOC", "0"),
        "LOC turns off peer-to-peer between GPUs, as NCCL_P2P_DISABLE=1 does",
        "unset NCCL_P2P_LEVEL: NCCL chooses from the topology",
    ),
    _EnvRule(
        "NCCL_SHM_DISABLE",
        _on,
        "turns off NCCL's shared-memory transport: where peer-to-peer is not possible, traffic falls back to sockets",
        "unset NCCL_SHM_DISABLE",
    ),
    _EnvRule(
        "NCCL_IB_DISABLE",
        _on,
        "turns off InfiniBand/RoCE: traffic between machines goes over TCP sockets (no effect inside one machine)",
        "unset NCCL_IB_DISABLE unless this machine's InfiniBand is broken",
    ),
    _EnvRule(
        "NCCL_DEBUG",
        lambda v: v.strip().upper() in ("INFO", "TRACE"),
        "makes every rank log NCCL's set-up (TRACE: every call, which slows it)",
        "unset NCCL_DEBUG, or NCCL_DEBUG=WARN to keep the errors",
    ),
    _EnvRule(
        "NCCL_ALGO",
        bool,
        "forces one all-reduce algorithm for every message size; NCCL's own choice is usually faster",
        "unset NCCL_ALGO unless you measured it faster (the live check of `phalanx doctor` measures)",
    ),
    _EnvRule(
        "NCCL_PROTO",
        bool,
        "forces one protocol for every message size; NCCL's own choice is usually faster",
        "unset NCCL_PROTO unless you measured it faster (the live check of `phalanx doctor` measures)",
    ),
    _EnvRule(
        "TORCH_NCCL_BLOCKING_WAIT",
        _on,
        "makes the host wait for every collective: computation and communication stop overlapping",
        "unset TORCH_NCCL_BLOCKING_WAIT",
    ),
    _EnvRule(
        "NCCL_BLOCKING_WAIT",
        _on,
        "(old name of TORCH_NCCL_BLOCKING_WAIT) makes the host wait for every collective",
        "unset NCCL_BLOCKING_WAIT",
    ),
    _EnvRule(
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        lambda v: v.strip() == "0",
        "0 turns off the watchdog: when one rank fails the others hang instead of stopping",
        "unset TORCH_NCCL_ASYNC_ERROR_HANDLING",
    ),
    _EnvRule(
        "TORCH_DISTRIBUTED_DEBUG",
        lambda v: v.strip().upper() == "DETAIL",
        "checks every collective's arguments across ranks and logs them, which slows training",
        "unset TORCH_DISTRIBUTED_DEBUG outside debugging",
    ),
    _EnvRule(
        "CUDA_LAUNCH_BLOCKING",
        _on,
        "makes every CUDA kernel launch wait for the kernel: a debugging switch that slows training a lot",
        "unset CUDA_LAUNCH_BLOCKING",
    ),
)


def environment(facts: Facts) -> list[Verdict]:
    found = [
        Verdict(f"env {rule.name}", WARNING, f"{rule.name}={facts.env[rule.name]} {rule.why}", rule.fix)
        for rule in _ENV_RULES
        if rule.name in facts.env and rule.applies(facts.env[rule.name])
    ]
    found += [v for v in (_nccl_interface(facts), _gloo_interface(facts)) if v is not None]
    if found:
        return found
    return [
        Verdict(
            "environment variables",
            OK,
            "no NCCL, gloo or torch.distributed variable known to slow or break jobs is set",
        )
    ]


def _nccl_interface(facts: Facts) -> Verdict | None:
    """NCCL_SOCKET_IFNAME: '^eth' excludes, '=eth0' is an exact name, 'eth' a prefix (eth0, eth1...)."""
    raw = facts.env.get("NCCL_SOCKET_IFNAME")
    if not raw or not facts.interfaces or raw.startswith("^"):
        return None
    exact = raw.startswith("=")
    wanted = [part.strip() for part in raw.lstrip("=").split(",") if part.strip()]
    matches = [w for w in wanted if any(i == w if exact else i.startswith(w) for i in facts.interfaces)]
    if matches:
        return None
    return Verdict(
        "env NCCL_SOCKET_IFNAME",
        PROBLEM,
        (
            f"NCCL_SOCKET_IFNAME={raw} matches no network interface here ({', '.join(facts.interfaces)}): "
            "NCCL cannot start"
        ),
        f"unset it, or name an interface that exists, e.g. NCCL_SOCKET_IFNAME={_suggest(facts.interfaces)}",
    )


def _gloo_interface(facts: Facts) -> Verdict | None:
    raw = facts.env.get("GLOO_SOCKET_IFNAME")
    if not raw or not facts.interfaces:
        return None
    missing = [part.strip() for part in raw.split(",") if part.strip() and part.strip() not in facts.interfaces]
    if not missing:
        return None
    return Verdict(
        "env GLOO_SOCKET_IFNAME",
        PROBLEM,
        (
            f"GLOO_SOCKET_IFNAME={raw} names {', '.join(missing)}, "
            f"which this machine does not have ({', '.join(facts.interfaces)}): gloo cannot start"
        ),
        f"unset it, or name an interface that exists, e.g. GLOO_SOCKET_IFNAME={_suggest(facts.interfaces)}",
    )


def _suggest(interfaces: tuple[str, ...]) -> str:
    """One machine needs only loopback; across machines, the first real interface."""
    return "lo" if "lo" in interfaces else interfaces[0]
