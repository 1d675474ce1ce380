"""An elastic job (``--nnodes MIN:MAX``): torch elastic's c10d rendezvous, wrapped so that a change
of nodes changes the world size and nothing else about the training.

torch's agent already re-forms the job when a node is lost (its peers' collectives fail, their
workers exit, the agent restarts them) or when one waits to join (the agent polls
``num_nodes_waiting()`` and restarts the workers). This wrapper, registered as the rendezvous
backend ``phalanx-c10d``, adds what keeps the trajectory:

- a join costs no step: when a node waits, the workers are first asked to checkpoint (the
  ``resize-requested`` marker; every rank agrees on the step, saves, then holds), and only once
  they have saved (``resize-saved``) does the agent see the waiting node and restart them;
- a restart after a lost or departed peer is free, a restart after this node's own failure
  (a worker that recorded a crash) is charged to ``launch.max_restarts``;
- the job's identity (one id for every node, across rounds), the attempt number and the members
  of each round, so that a job that cannot re-form names the nodes that did not come back.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Callable

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
    rendezvous_handler_registry,
)

from phalanx.checkpoint.files import write_json_atomic
from phalanx.faults import markers
from phalanx.topology import ENV_ATTEMPT, LaunchContext

BACKEND = "phalanx-c10d"
# The agent's own restart limit under a node range: this wrapper decides which restarts count.
UNLIMITED_RESTARTS = 1_000_000
_MEMBERS_WAIT_S = 30.0
# Attempts that fail within this many seconds, this many times in a row, count as this node's own
# failure even without a record: a crash loop, not nodes coming and going.
_QUICK_S, _QUICK_LIMIT = 60.0, 3
# torch's shared-store path publishes rank 0's address only when rank 0 changes, so a node that
# joins a running job waits for it forever: every round publishes its own under this setting.
NO_SHARED_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


class JobFailed(Exception):
    """This node's workers failed on their own, and ``launch.max_restarts`` is spent."""

    def __init__(self, failure: ChildFailedError):
        super().__init__(str(failure))
        self.failure = failure


class JobStopped(Exception):
    """This node's attempts keep failing without a recorded error, and ``launch.max_restarts`` is spent."""


class NodesLost(Exception):
    """The rendezvous could not gather MIN nodes in time; the message names who is missing."""


class ElasticRendezvous(RendezvousHandler):
    def __init__(
        self,
        inner: RendezvousHandler,
        run_dir: Path,
        *,
        min_nodes: int,
        max_nodes: int,
        restarts: int,
        grace: float,
        timeout: float,
        announce: Callable[[int, int], None],
    ):
        self.inner, self.run_dir = inner, run_dir
        self.min_nodes, self.max_nodes, self.timeout = min_nodes, max_nodes, timeout
        self.restarts_left, self.grace, self.announce = restarts, grace, announce
        self.attempt = -1
        self.info: RendezvousInfo | None = None
        self.members: dict[int, str] = {}
        self._asked: float | None = None  # when the workers were asked to save for a join
        self._nonce = ""  # names that request: the workers' answer carries it
        self._job: str | None = None
        self._started = time.monotonic()  # when this node's current attempt began
        self._quick_in_a_row = 0  # failed attempts in a row that ended soon after they began
        self._revealed = False  # the agent was shown the waiting node: the restart is a join

    # -- torch's interface -------------------------------------------------------------------------
    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return self.inner.use_agent_store

    def next_rendezvous(self) -> RendezvousInfo:
        if self.info is not None:
            self._before_rejoin()
        try:
            info = self.inner.next_rendezvous()
        except RendezvousTimeoutError:
            raise NodesLost(self._lost()) from None
        self.attempt += 1
        self._formed(info)
        return info

    def is_closed(self) -> bool:
        return self.inner.is_closed()

    def set_closed(self) -> None:
        self.inner.set_closed()

    def num_nodes_waiting(self) -> int:
        waiting = self.inner.num_nodes_waiting()
        if waiting == 0:
            if self._asked is not None and not self._revealed:
                self._asked = None
                self._clear()  # the node gave up before the workers held: they train on
            return 0
        if self._asked is None:
            self._asked = time.monotonic()
            self._nonce = uuid.uuid4().hex
            request = {"waiting": waiting, "time": time.time(), "nonce": self._nonce}
            write_json_atomic(self.run_dir / markers.RESIZE_REQUEST, request)
            return 0
        if markers.resize_held(self.run_dir) or time.monotonic() - self._asked > self.grace:
            self._revealed = True
            return waiting
        return 0

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    def shutdown(self) -> bool:
        return self.inner.shutdown()

    # -- what the wrapper adds ---------------------------------------------------------------------
    def _formed(self, info: RendezvousInfo) -> None:
        first = self.info is None
        self.info = info
        self._asked, self._revealed = None, False
        self._clear()
        job = self._job_id(info)
        context = LaunchContext.from_env()
        if context is not None:  # the workers the agent starts next inherit this environment
            os.environ.update(replace(context, job=job).to_env())
        os.environ[ENV_ATTEMPT] = str(self.attempt)
        self.members = self._members(info)
        self._started = time.monotonic()
        line = {"attempt": self.attempt, "nodes": info.world_size, "node": info.rank, "formed": time.time()}
        try:
            with (self.run_dir / markers.RENDEZVOUS_LOG).open("a", encoding="utf-8") as log:
                log.write(json.dumps(line) + "\n")
        except OSError:
            pass  # a record for the benchmark and for reading afterwards; the job does not need it
        if first:
            self.announce(info.world_size, info.rank)

    def _job_id(self, info: RendezvousInfo) -> str:
        """One id for the whole job, across rounds and nodes: the first node to form it picks it."""
        key = f"phalanx.{self.get_run_id()}.job"
        try:
            self._job = info.store.underlying_store.compare_set(key, "", uuid.uuid4().hex).decode()
        except Exception:  # noqa: BLE001 - the store went with its host: the next round says so
            self._job = self._job or uuid.uuid4().hex
        return self._job

    def _members(self, info: RendezvousInfo) -> dict[int, str]:
        """Who is in this round, node index to a description (host and launcher pid)."""
        me = f"{os.uname().nodename} (launcher pid {os.getpid()})"
        info.store.set(f"phalanx.node{info.rank}", me)
        keys = [f"phalanx.node{r}" for r in range(info.world_size)]
        # Polled, not store.wait(): a blocking wait holds the store client the heartbeats share.
        deadline = time.monotonic() + _MEMBERS_WAIT_S
        try:
            while not info.store.check(keys):
                if time.monotonic() > deadline:
                    return {info.rank: me}  # a node lost right away: the next round says so
                time.sleep(0.02)
            return {r: v.decode() for r, v in enumerate(info.store.multi_get(keys))}
        except Exception:  # noqa: BLE001 - the store is gone: so is the job, as the next call says
            return {info.rank: me}

    def _before_rejoin(self) -> None:
        """Between two rounds on this node: say in the old round that this node is coming back, and
        decide whether the restart is free (a join, a peer lost or leaving) or this node's failure."""
        assert self.info is not None
        try:
            self.info.store.set(f"phalanx.back{self.info.rank}", "1")
        except Exception:  # noqa: BLE001 - the store's host is gone: the rendezvous will say so
            pass
        if self._revealed:
            return  # a join: the ranks saved, and the agent restarted them for it
        crashes = markers.crashes(self.run_dir, self.attempt)
        hung = markers.hang_dump(self.run_dir, self.attempt, 0).parent.is_dir()
        quick = time.monotonic() - self._started < _QUICK_S
        self._quick_in_a_row = self._quick_in_a_row + 1 if quick else 0
        # A peer lost or leaving leaves no record here. A worker that died by a signal (a segfault,
        # the OOM killer) leaves none either: a node whose attempts keep ending quickly counts them.
        if not (crashes or hung or self._quick_in_a_row >= _QUICK_LIMIT):
            return
        if self.restarts_left > 0:
            self.restarts_left -= 1
            return
        if not crashes:
            why = "it hung" if hung else f"{self._quick_in_a_row} attempts in a row ended within {_QUICK_S:g} s"
            raise JobStopped(
                f"phalanx: the job keeps failing on this node ({why}) and launch.max_restarts is spent; "
                f"logs in {self.run_dir / 'logs'}"
            )
        failures = {}
        for record in crashes:
            failure = ProcessFailure(record["local_rank"], record["pid"], record["exitcode"], record["error_file"])
            failures[record["rank"]] = failure
        raise JobFailed(ChildFailedError("worker", failures))

    def _lost(self) -> str:
        span = f"--nnodes {self.min_nodes}:{self.max_nodes}"
        if self.info is None:
            return (
                f"phalanx: fewer than {self.min_nodes} nodes joined within launch.rendezvous_timeout "
                f"({self.timeout:g} s; {span}): start the others with the same command, or lower MIN"
            )
        missing = []
        for rank, who in sorted(self.members.items()):
            if rank == self.info.rank:
                continue
            try:
                back = self.info.store.check([f"phalanx.back{rank}"])
            except Exception:  # noqa: BLE001
                back = False
            if not back:
                missing.append(f"node {rank} {who}")
        lost = "; ".join(missing) if missing else "none of the others came back"
        return (
            f"phalanx: the job needs at least {self.min_nodes} nodes ({span}) and could not re-form within "
            f"launch.rendezvous_timeout ({self.timeout:g} s); lost: {lost}"
        )

    def _clear(self) -> None:
        for name in (markers.RESIZE_REQUEST, markers.RESIZE_SAVED):
            (self.run_dir / name).unlink(missing_ok=True)


# The launch in progress in this process (one at a time): what the registered creator builds.
_launch: dict = {}


def _create(params: RendezvousParameters) -> RendezvousHandler:
    inner = rendezvous_handler_registry.create_handler(
        RendezvousParameters(
            "c10d",
            params.endpoint,
            params.run_id,
            params.min_nodes,
            params.max_nodes,
            params.local_addr,
            **params.config,
        )
    )
    return ElasticRendezvous(inner, **_launch)


def register(run_dir: Path, **options) -> None:
    """Make ``phalanx-c10d`` a rendezvous backend of this process, for this launch."""
    _launch.clear()
    _launch.update(options, run_dir=run_dir)
    rendezvous_handler_registry.register(BACKEND, _create)  # the same creator again: accepted
