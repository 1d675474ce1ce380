"""``phalanx doctor`` as one call: the checks, then the live all-reduce, as a :class:`DoctorReport`."""

from __future__ import annotations

from dataclasses import dataclass, field

from phalanx.diagnose import allreduce
from phalanx.diagnose.allreduce import SizeResult
from phalanx.diagnose.checks import OK, PROBLEM, SKIPPED, WARNING, Verdict, run_checks
from phalanx.diagnose.facts import Facts, gather_facts
from phalanx.diagnose.links import Expectation, expectation
from phalanx.errors import PhalanxError
from phalanx.launch.devices import plan_devices
from phalanx.topology import cpu_count
from phalanx.util.units import MIB, format_bytes, format_rate, format_seconds

LIVE_CHECK = "live all-reduce"
JUDGED_FROM_BYTES = 64 * MIB  # below this even a good link shows a fraction of its bandwidth
TOO_SLOW = 0.25  # of the link's expected bandwidth


@dataclass(frozen=True)
class DoctorOptions:
    live: bool = True
    nproc: int | None = None
    cpu: bool = False
    sizes: str | None = None
    iters: int | None = None
    timeout: float = 300.0


@dataclass(frozen=True)
class LivePlan:
    cuda: bool
    nproc: int
    sizes: list[int]
    iters: int

    @property
    def backend(self) -> str:
        return "nccl" if self.cuda else "gloo"

    def describe(self) -> str:
        return f"{self.nproc} GPUs on nccl" if self.cuda else f"{self.nproc} CPU processes on gloo"


@dataclass(frozen=True)
class LiveResult:
    plan: LivePlan
    expectation: Expectation
    results: list[SizeResult] = field(default_factory=list)

    @property
    def latency(self) -> float | None:
        return self.results[0].seconds if self.results else None


@dataclass(frozen=True)
class DoctorReport:
    verdicts: list[Verdict]
    live: LiveResult | None = None

    @property
    def exit_code(self) -> int:
        return 1 if any(v.status == PROBLEM for v in self.verdicts) else 0


def run_doctor(options: DoctorOptions, facts: Facts | None = None) -> DoctorReport:
    sizes = allreduce.parse_sizes(options.sizes) if options.sizes else None  # bad flags fail before any work
    if options.iters is not None and options.iters < 1:
        raise PhalanxError(f"--iters must be at least 1, got {options.iters}")
    if options.nproc is not None and options.nproc < 2:
        raise PhalanxError(f"--nproc must be at least 2 for an all-reduce, got {options.nproc}")
    facts = facts or gather_facts()
    verdicts = run_checks(facts)
    if not options.live:
        return DoctorReport([*verdicts, Verdict(LIVE_CHECK, SKIPPED, "--no-live: not run")])
    plan = plan_live(facts, options, sizes)
    if isinstance(plan, Verdict):
        return DoctorReport([*verdicts, plan])
    live, verdict = run_live(facts, plan, options.timeout)
    return DoctorReport([*verdicts, verdict], live)


def plan_live(facts: Facts, options: DoctorOptions, sizes: list[int] | None) -> LivePlan | Verdict:
    """What the live check runs: every GPU torch sees, or ``--nproc`` CPU processes (default 2)."""
    devices = plan_devices(
        gpus=None,
        nproc=options.nproc,
        cpu=options.cpu,
        processes_per_node=None,
        cuda_count=len(facts.cuda_gpus),
        visible=None,
        cores=cpu_count(),
    )
    cuda = devices.kind == "cuda"
    if devices.nproc < 2:  # --nproc below 2 was refused already: this is a one-GPU machine
        return Verdict(
            LIVE_CHECK,
            SKIPPED,
            (
                "one GPU: no all-reduce between GPUs to measure; "
                "`phalanx doctor --cpu` measures gloo between CPU processes"
            ),
        )
    iters = options.iters or (allreduce.GPU_ITERS if cuda else allreduce.CPU_ITERS)
    return LivePlan(
        cuda, devices.nproc, sizes or allreduce.parse_sizes(allreduce.GPU_SIZES if cuda else allreduce.CPU_SIZES), iters
    )


def run_live(facts: Facts, plan: LivePlan, timeout: float) -> tuple[LiveResult | None, Verdict]:
    expected = expectation(facts, plan.nproc, cpu=not plan.cuda)
    try:
        results = allreduce.measure(plan.sizes, plan.nproc, cuda=plan.cuda, iters=plan.iters, timeout=timeout)
    except TimeoutError:
        return None, Verdict(
            LIVE_CHECK,
            PROBLEM,
            f"{plan.describe()}: did not finish within {timeout:g}s, a collective hangs",
            _live_fix(plan),
        )
    except Exception as err:  # whatever a rank raised is the finding
        return None, Verdict(LIVE_CHECK, PROBLEM, f"{plan.describe()}: failed: {_last_line(err)}", _live_fix(plan))
    live = LiveResult(plan, expected, results)
    return live, judge(live)


def judge(live: LiveResult) -> Verdict:
    """Measured against the link where there is an expectation, and only at sizes large enough to tell."""
    largest = live.results[-1]
    found = (
        f"{live.plan.describe()}: latency {format_seconds(live.latency or 0)}, bus bandwidth "
        f"{format_rate(largest.bus_bandwidth)} at {format_bytes(largest.bytes)} over {live.expectation.link}"
    )
    expected = live.expectation.bytes_per_second
    if expected is None:
        return Verdict(LIVE_CHECK, OK, f"{found}; {live.expectation.note}")
    if largest.bytes < JUDGED_FROM_BYTES:
        return Verdict(
            LIVE_CHECK,
            OK,
            (
                f"{found}; sizes up to {format_bytes(largest.bytes)} are too small to compare "
                f"with the link's {format_rate(expected)}"
            ),
        )
    share = largest.bus_bandwidth / expected
    if share < TOO_SLOW:
        return Verdict(
            LIVE_CHECK,
            WARNING,
            f"{found}: {share:.0%} of the {format_rate(expected)} the link gives one way",
            (
                "see the warnings above (NCCL_P2P_DISABLE, topology, peer-to-peer, other processes); "
                "rerun with NCCL_DEBUG=INFO and look for 'via P2P' or 'via SHM' in NCCL's channel lines"
            ),
        )
    return Verdict(LIVE_CHECK, OK, f"{found}: {share:.0%} of the {format_rate(expected)} the link gives one way")


def _live_fix(plan: LivePlan) -> str:
    if plan.cuda:
        return (
            "rerun with NCCL_DEBUG=INFO to see which transport NCCL picks and where it stops; "
            "fix the problems and warnings above first"
        )
    return (
        "rerun with TORCH_CPP_LOG_LEVEL=INFO; check that GLOO_SOCKET_IFNAME (if set) names an interface here "
        "and that no firewall blocks 127.0.0.1"
    )


def _last_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__
