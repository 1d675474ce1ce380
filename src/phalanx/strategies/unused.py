"""Parameters that get no gradient under DDP (``strategy.ddp.find_unused_parameters``).

DDP's reducer waits for a gradient of every parameter before it finishes the all-reduce; one
that gets none (a head the loss skips, a branch not taken) ends the run one step later with
"Expected to have finished reduction in the prior iteration". ``find_unused_parameters=True``
avoids that by walking the autograd graph after every forward, which costs time on every step.

``auto`` gets both: DDP starts with the search on, so the first step is right whatever the
model does; after the first synchronised backward the ranks agree (one all-reduce) on which
parameters got no gradient on some rank. None: the reducer is rebuilt without the search, in
place, so the module the user holds stays the same object (same parameters, same gradients,
bit for bit). Some: the search stays on and rank 0 names them once.

Why in place, through DDP's private construction path (phalanx._torch_compat), rather than a
second, public ``DistributedDataParallel`` around the same module: Session.setup returned the
first wrapper, which the user calls, whose ``no_sync`` the Session enters and which compute.compile
compiled in place. A second wrapper is another object, so the first would have to forward to it
while its reducer, autograd hooks and gradient buckets (one more copy of the gradients) stay
alive: DDP has no public way to release them. benchmarks/unused_switch.py measures both: the same
step time afterwards; the switch under 1 ms in place, 27-35 ms as a new wrapper (whose constructor
broadcasts every parameter again) on a 3.4M-parameter MLP.

After the switch, a step that leaves a parameter without gradient is caught right after that
backward and turned into one phalanx error naming the fix, instead of DDP's error a step later.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from phalanx import _torch_compat as compat
from phalanx.errors import PhalanxError
from phalanx.util.words import plural

# torch prints this from C++ (once per process) when the search finds every parameter used;
# under auto that is the expected outcome of the first step, which phalanx then acts on.
_TORCH_NOTICE = b"find_unused_parameters=True was specified in DDP constructor"
_SHOWN = 6  # parameter names in a message before "and N more"


class UnusedParameters:
    """Watches one DDP module: the first-step probe under ``auto``, and the clear error after."""

    def __init__(self, ddp: DistributedDataParallel, setting: bool | str, comm_device: torch.device, is_main: bool):
        self.ddp = ddp
        self.setting = setting
        self.comm_device = comm_device
        self.is_main = is_main
        params = compat.ddp_reducer_parameters(ddp)  # exactly the parameters the reducer waits for
        self.params = params
        names = {id(p): name for name, p in ddp.module.named_parameters()}
        self.names = [names.get(id(p), f"parameter {i}") for i, p in enumerate(params)]
        self.pending = setting == "auto" and not ddp.static_graph  # static_graph finds them itself
        # Checked after every synchronised backward when DDP does not search.
        self.checked = setting is False and not ddp.static_graph
        self.unused: list[str] = []
        self._armed = False  # a synchronised forward happened; its backward decides
        self._seen: set[int] = set()
        self._hooks: list[Any] = []
        if self.pending and not (
            compat.ddp_can_rebuild_reducer(ddp) and compat.ddp_intercept_post_forward(ddp, self._post_forward)
        ):
            self.pending = False  # this torch cannot switch the search off later: DDP keeps it, as with true
            if is_main:
                print(
                    f"phalanx: this torch ({torch.__version__}) cannot turn DDP's search for unused parameters "
                    "off after the first step, so it searches every step (slower); set "
                    "strategy.ddp.find_unused_parameters: false if every parameter gets a gradient, "
                    "or true to silence this.",
                    flush=True,
                )
        if self.pending:
            self._hooks = [p.register_post_accumulate_grad_hook(self._saw(i)) for i, p in enumerate(params)]

    # -- forward: arm the probe, keep torch's notice about the search quiet ---------------------
    def _post_forward(self, output: Any) -> Any:
        ddp = self.ddp
        if self.pending and torch.is_grad_enabled() and ddp.require_backward_grad_sync:
            self._armed, self._seen = True, set()
        return compat.ddp_post_forward(ddp, output, _without_notice)

    def _saw(self, index: int):
        def hook(_param: torch.Tensor) -> None:
            if self._armed:
                self._seen.add(index)

        return hook

    # -- after each backward (Strategy.backward) ------------------------------------------------
    def after_backward(self) -> None:
        if self.pending and self._armed:
            self._settle()
        elif self.checked:
            self._check()

    def _settle(self) -> None:
        # One collective, entered by every rank at the same backward (the arming forward is in
        # every rank's program). Slot 0 says whether this backward reached the module at all.
        used = torch.zeros(len(self.params) + 1, device=self.comm_device)
        used[0] = 1.0 if self._seen else 0.0
        if self._seen:
            used[torch.tensor(sorted(self._seen), device=self.comm_device) + 1] = 1.0
        dist.all_reduce(used, op=dist.ReduceOp.MIN, group=self.ddp.process_group)
        self._armed = False
        if used[0] == 0:
            return  # a backward of another model (or another loss) on some rank: keep waiting
        self.pending = False
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.unused = [name for name, flag in zip(self.names, used[1:].tolist()) if flag == 0]
        if self.unused:
            if self.is_main:
                print(
                    f"phalanx: {plural(len(self.unused), 'parameter')} got no gradient in the first step "
                    f"({_listed(self.unused)}); DDP will look for unused parameters every step (slower). "
                    "Remove them from the model, or set strategy.ddp.find_unused_parameters: true to silence this.",
                    flush=True,
                )
            return
        compat.ddp_restore_post_forward(self.ddp)  # back to DDP's own method
        compat.ddp_rebuild_reducer(self.ddp, find_unused_parameters=False)
        self.checked = True

    def _check(self) -> None:
        if compat.ddp_reducer_finalized(self.ddp) is not False:
            return  # finished, or a torch that cannot tell: DDP's own error then comes a step later
        missing = [name for name, p in zip(self.names, self.params) if p.grad is None]
        which = f" ({_listed(missing)})" if missing else ""
        if self.setting == "auto":
            raise PhalanxError(
                f"a parameter got no gradient in this step{which}, although every parameter had one in the first step, "
                "after which phalanx turned DDP's search for unused parameters off; "
                "set strategy.ddp.find_unused_parameters: true"
            )
        raise PhalanxError(
            f"a parameter got no gradient in this step{which}, and strategy.ddp.find_unused_parameters is false; "
            "set it to auto (or true), or make every parameter take part in the loss"
        )


@contextlib.contextmanager
def _without_notice() -> Iterator[None]:
    """Collect what C++ writes to file descriptor 2 during DDP's (short, collective-free) graph
    search, then write it back without torch's notice about finding nothing."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no usable stderr: nothing to keep quiet
        yield
        return
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = b"".join(line for line in caught.read().splitlines(keepends=True) if _TORCH_NOTICE not in line)
            if kept:
                os.write(2, kept)


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown if len(names) <= _SHOWN else f"{shown} and {len(names) - _SHOWN} more"
