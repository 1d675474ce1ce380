"""How long a collective may wait before torch.distributed aborts it: longer than every limit phalanx
sets itself, so that a long first step or a slow checkpoint write is either allowed or stopped by
phalanx's watchdog, with its report of where each rank was, and never first by the process group's
own timeout (torch's default is 30 minutes, the same as the first-step limit and the checkpoint I/O
bound), whose error names no rank and no line."""

from __future__ import annotations

from datetime import timedelta

from phalanx.config.sections import A_WEEK, FaultsConfig
from phalanx.faults.watchdog import IO_TIMEOUT_S

# Past the longest limit: time for the watchdog to notice (it polls every second), for every rank
# to dump its stacks, and for the job to stop, before a collective is aborted underneath it.
MARGIN_S = 300.0


def collective_timeout(faults: FaultsConfig) -> timedelta:
    """The process group's timeout under ``faults``. A first step without a limit (first_step_timeout
    0, with the watchdog on) gets a week: the user asked for none, and the watchdog still catches a
    hang after it. With the watchdog off (hang_timeout 0), this is what ends a hang: the first-step
    limit, the checkpoint I/O bound and the pre-emption grace still hold, plus the margin."""
    if faults.hang_timeout > 0 and not faults.first_step_timeout:
        longest = A_WEEK
    else:
        longest = max(faults.hang_timeout, faults.first_step_timeout, IO_TIMEOUT_S, faults.preempt_grace)
    return timedelta(seconds=longest + MARGIN_S)
