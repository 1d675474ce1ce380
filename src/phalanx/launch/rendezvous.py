"""How the nodes of a job find each other: torch elastic's rendezvous, chosen from flags, config,
or a SLURM allocation.

- one node: c10d on 127.0.0.1, port 0 (the store picks a free port: jobs never collide);
- ``--master HOST:PORT --node-rank I``: static rendezvous, node I of ``--nnodes``, node 0 hosts
  the store (torchrun's ``--master-addr/--master-port/--node-rank``);
- ``--rdzv-endpoint HOST:PORT``: c10d rendezvous, node ranks assigned as nodes arrive (torchrun's
  ``--rdzv-backend c10d --rdzv-endpoint``); every node passes the same ``--rdzv-id``;
- inside a multi-node SLURM allocation with none of the above: static, from SLURM_NNODES,
  SLURM_NODEID and the first host of SLURM_JOB_NODELIST;
- ``--nnodes MIN:MAX``: an elastic job, always c10d (a static rendezvous has a fixed node count),
  at ``--rdzv-endpoint`` or, inside SLURM, on the allocation's first host.
"""

from __future__ import annotations

import re
import socket
import uuid
from dataclasses import dataclass, field

from phalanx.errors import PhalanxError
from phalanx.topology import SlurmJob

DEFAULT_PORT = 29500
_LOOPBACK = ("127.", "localhost", "::1")


@dataclass(frozen=True)
class Rendezvous:
    backend: str  # "c10d" or "static"
    endpoint: str
    nnodes: int = 1
    node_rank: int | None = None
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    configs: dict = field(default_factory=dict)
    local_addr: str | None = "127.0.0.1"
    source: str = "single node"
    min_nodes: int | None = None  # an elastic job's MIN; None: nnodes, a fixed count

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    @property
    def elastic(self) -> bool:
        return self.min_nodes is not None and self.min_nodes < self.nnodes

    @property
    def node_counts(self) -> range:
        """Every number of nodes the job may run on."""
        return range(self.min_nodes or self.nnodes, self.nnodes + 1)

    def describe(self) -> str:
        if not self.multi_node:
            return ""
        if self.elastic:
            who = f"{self.min_nodes} to {self.nnodes} nodes"
        elif self.node_rank is not None:
            who = f"node {self.node_rank} of {self.nnodes}"
        else:
            who = f"one of {self.nnodes} nodes"
        return f"{who}, {self.backend} rendezvous at {self.endpoint} ({self.source})"


def plan_rendezvous(
    *,
    nnodes: int | tuple[int, int],
    node_rank: int | None,
    master: str | None,
    rdzv_endpoint: str | None,
    rdzv_id: str | None,
    slurm: SlurmJob | None,
) -> Rendezvous:
    low, nnodes = nnodes if isinstance(nnodes, tuple) else (nnodes, nnodes)
    if low < nnodes:
        return _elastic(low, nnodes, node_rank, master, rdzv_endpoint, rdzv_id, slurm)
    if master and rdzv_endpoint:
        raise PhalanxError("give either --master HOST:PORT (with --node-rank) or --rdzv-endpoint HOST:PORT, not both")
    # Every node must name the same job: the rendezvous keys live under it.
    job = rdzv_id or (slurm.job_id if slurm else None) or "phalanx"
    if master:
        host, port = _endpoint(master, "--master")
        if node_rank is None:
            raise PhalanxError(
                f"--master needs --node-rank: this machine's index, 0..{nnodes - 1} (node 0 runs on {host})"
            )
        _check_node_rank(node_rank, nnodes)
        return Rendezvous(
            "static",
            f"{host}:{port}",
            nnodes,
            node_rank,
            run_id=job,
            configs={"rank": node_rank},
            local_addr=_local_addr(host),
            source="--master",
        )
    if rdzv_endpoint:
        host, port = _endpoint(rdzv_endpoint, "--rdzv-endpoint")
        if node_rank is not None:
            raise PhalanxError(
                "--rdzv-endpoint assigns node ranks itself; drop --node-rank, or use --master HOST:PORT --node-rank I"
            )
        return Rendezvous(
            "c10d", f"{host}:{port}", nnodes, None, run_id=job, local_addr=_local_addr(host), source="--rdzv-endpoint"
        )
    if slurm is not None and slurm.nnodes > 1 and nnodes in (1, slurm.nnodes):
        host = first_host(slurm.nodelist)
        return Rendezvous(
            "static",
            f"{host}:{DEFAULT_PORT}",
            slurm.nnodes,
            slurm.node_id,
            run_id=job,
            configs={"rank": slurm.node_id},
            local_addr=None,
            source=f"SLURM job {slurm.job_id}",
        )
    if nnodes > 1:
        raise PhalanxError(
            f"--nnodes {nnodes} needs to know where node 0 is: "
            "add --master HOST:PORT --node-rank I, or --rdzv-endpoint HOST:PORT"
        )
    if node_rank not in (None, 0):
        raise PhalanxError(f"--node-rank {node_rank} with a single node; set --nnodes and --master too")
    # Port 0: the store picks a free port itself, so two jobs on one machine never collide.
    return Rendezvous("c10d", "127.0.0.1:0", configs={"is_host": True})


def _elastic(
    low: int,
    high: int,
    node_rank: int | None,
    master: str | None,
    rdzv_endpoint: str | None,
    rdzv_id: str | None,
    slurm: SlurmJob | None,
) -> Rendezvous:
    """``--nnodes MIN:MAX``: node ranks are handed out at each rendezvous, so the fixed ones of
    ``--master``/``--node-rank`` cannot serve it."""
    span = f"--nnodes {low}:{high}"
    if master or node_rank is not None:
        raise PhalanxError(
            f"{span} lets nodes leave and join, so node ranks are assigned at each rendezvous: "
            "give every node --rdzv-endpoint HOST:PORT instead of --master/--node-rank"
        )
    job = rdzv_id or (slurm.job_id if slurm else None) or "phalanx"
    if rdzv_endpoint:
        host, port = _endpoint(rdzv_endpoint, "--rdzv-endpoint")
        source = "--rdzv-endpoint"
    elif slurm is not None:
        host, port, source = first_host(slurm.nodelist), DEFAULT_PORT, f"SLURM job {slurm.job_id}"
    else:
        raise PhalanxError(
            f"{span} needs to know where the nodes meet: add --rdzv-endpoint HOST:PORT, one of the machines "
            "(the same on every node; its launcher hosts the rendezvous and must stay for the whole job)"
        )
    return Rendezvous(
        "c10d",
        f"{host}:{port}",
        high,
        None,
        run_id=job,
        local_addr=_local_addr(host),
        source=source,
        min_nodes=low,
    )


def hosts_store(endpoint: str) -> bool:
    """Whether this launcher should host the c10d rendezvous store at ``endpoint``: the address is
    this machine's and nobody listens on the port yet. torch decides by host name alone, so two
    launchers on the endpoint's machine (loopback tests, or two jobs' nodes there) could each host a
    store on the same port and form two jobs that share one checkpoint directory."""
    address = _endpoint(endpoint, "--rdzv-endpoint")
    try:
        with socket.create_connection(address, timeout=1.0):
            return False  # a store is there already: join it
    except OSError:
        pass
    try:
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind(address)
        return True
    except OSError:
        return False  # not an address of this machine (or taken): another machine hosts


def _endpoint(text: str, flag: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise PhalanxError(f"{flag} expects HOST:PORT (e.g. node01:{DEFAULT_PORT}), got '{text}'")
    return host.strip("[]"), int(port)


def _check_node_rank(node_rank: int, nnodes: int) -> None:
    if not 0 <= node_rank < nnodes:
        raise PhalanxError(f"--node-rank {node_rank} is outside 0..{nnodes - 1} for --nnodes {nnodes}")


def _local_addr(master_host: str) -> str | None:
    # Nodes that reach node 0 over loopback are on node 0's machine: advertise loopback too, rather
    # than a host name that may not resolve. Otherwise torch uses this machine's host name.
    return "127.0.0.1" if master_host.startswith(_LOOPBACK) else None


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[07-09,12],cpu1' -> 'gpu07'."""
    head = re.match(r"([^,\[]*)(\[([^\]]*)\])?([^,]*)", nodelist.strip())
    if not head or not (head.group(1) or head.group(3)):
        raise PhalanxError(
            f"cannot read SLURM_JOB_NODELIST '{nodelist}'; pass --master HOST:PORT --node-rank I instead"
        )
    prefix, ranges, suffix = head.group(1), head.group(3), head.group(4)
    if ranges is None:
        return prefix + suffix
    first = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{first}{suffix}"
