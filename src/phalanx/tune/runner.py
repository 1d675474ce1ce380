"""``phalanx tune``: short trial runs of a script on this machine, in three stages, each starting
from the previous stage's winner:

1. micro-batch: the largest that fits in device memory (doubling, then bisection; see search.py),
   and the fastest of those that fit, written as ``batch.max_micro_batch_size``: a per-device limit
   from which the Session plans the micro-batch for any process count, where an exact
   ``batch.micro_batch_size`` would divide the global batch for this count only;
2. loader workers: 0, 1, 2, ... until the step no longer waits for data;
3. DDP bucket size (ddp and zero1 with several processes).

Every trial is a ``phalanx launch`` subprocess (harness/launching.py) under
``<run dir>/<stamp>-tune/tNN/``, with checkpoints, progress bar, profiler and restarts off. A trial
that runs out of memory on any rank ends like any failed job (the launcher stops the other ranks),
and is read as "out of memory" from the ranks' logs.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from phalanx.errors import PhalanxError
from phalanx.harness.launching import TrialOptions, quiet_overrides, stop_note
from phalanx.launch.launcher import LaunchPlan, new_run_dir, prepare
from phalanx.strategies import strategy_class
from phalanx.topology import cpu_count
from phalanx.tune import search
from phalanx.tune.config_file import Written, write_values
from phalanx.tune.trials import OK, OOM, Announced, Settings, Trial, announced, code_settings, conclude
from phalanx.util.sizes import size_bytes
from phalanx.util.units import MIB, format_bytes
from phalanx.util.words import plural

STAGES = ("micro-batch", "workers", "bucket")
NOISE = "noise scale"  # the stage name of the --objective time trial that measures it
LIMIT, EXACT = "batch.max_micro_batch_size", "batch.micro_batch_size"


class TuneFailed(PhalanxError):
    """A trial that had to work did not: not bad input, so not exit code 2."""

    exit_code = 1


@dataclass(frozen=True)
class TuneOptions(TrialOptions):
    nproc: int | None = None
    memory_cap: str | None = None
    max_micro_batch: int | None = None
    allow_global_batch: bool = False
    search: tuple[str, ...] = STAGES
    dry_run: bool = False
    objective: str = "throughput"  # or "time": throughput x statistical efficiency (docs/goodput.md)

    def command(self) -> str:
        first = ["--nproc", str(self.nproc)] if self.nproc else []
        if self.memory_cap:
            first += ["--memory-cap", self.memory_cap]
        middle = ["--max-micro-batch", str(self.max_micro_batch)] if self.max_micro_batch else []
        if self.allow_global_batch:
            middle.append("--allow-global-batch")
        if tuple(self.search) != STAGES:
            middle += ["--search", ",".join(self.search)]
        if self.objective != "throughput":
            middle += ["--objective", self.objective]
        return self.command_line("tune", first=first, middle=middle, last=["--dry-run"] if self.dry_run else [])


@dataclass
class StageResult:
    stage: str
    summary: str  # one line for the terminal
    values: dict[str, object] = field(default_factory=dict)  # config values it chose


@dataclass
class TuneResult:
    directory: Path
    trials: list[Trial]
    stages: list[StageResult]
    values: dict[str, object]  # everything to write
    config_path: Path
    written: Written | None
    warnings: list[str]
    failure: str | None = None  # set when tune could not finish: nothing was written


def parse_search(text: str | None) -> tuple[str, ...]:
    if text is None:
        return STAGES
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [n for n in names if n not in STAGES]
    if not names or unknown:
        raise PhalanxError(f"--search takes a comma-separated list of {', '.join(STAGES)}; got '{text}'")
    return tuple(n for n in STAGES if n in names)


class _Tuner:
    def __init__(self, options: TuneOptions, say: Callable[[str], None]):
        self.options = options
        self.say = say
        self.script, self.script_args, self.cap = options.target("tune")
        _check_options(options)
        extra = (f"train.memory_cap={options.memory_cap}",) if options.memory_cap else ()
        self.creates = _absent_config(options)  # --config FILE that tune will create, if absent
        self.launching = options  # what the trials launch with (an empty stand-in for an absent FILE)
        if self.creates is None:
            self.base: LaunchPlan = prepare(options.request(self.script, self.script_args, options.nproc, extra))
        else:
            with tempfile.TemporaryDirectory() as empty:
                stand_in = Path(empty) / self.creates.name  # same suffix, so read as the same format
                stand_in.touch()
                request = replace(options, config_file=str(stand_in)).request
                self.base = prepare(request(self.script, self.script_args, options.nproc, extra))
        if self.base.config.batch.fixed_layout:
            _refuse_global_batch(options, "batch.fixed_layout is true in the config")
        if self.base.rendezvous.nnodes > 1:
            raise PhalanxError("phalanx tune runs on one machine; tune on one node, then use the values on every node")
        self.nproc = self.base.devices.nproc
        self.directory = new_run_dir(Path(options.run_dir or self.base.config.launch.run_dir).resolve(), "tune")
        self.common = (  # after the options' own --set values
            *extra,
            *quiet_overrides(self.base.config, self.directory),
            "train.tensorboard=false",
            "launch.max_restarts=0",  # an out-of-memory trial must end, not resume
        )
        # --objective time: the noise scale comes from one longer trial whose first half is weighted
        # out (search.noise_trial); the others measure samples/s alone, as for throughput.
        self.noise_steps, self.noise_overrides = search.noise_trial(options.steps)
        self.trials: list[Trial] = []
        self._by_settings: dict[Settings, Trial] = {}
        self.plan: Announced | None = None  # the script's batch plan, from the first trial

    @property
    def dp(self) -> int:
        """Data-parallel processes, as the first trial's Session planned them (tune plans no batch itself)."""
        return self.plan.processes

    # -- trials -----------------------------------------------------------------------------------
    def trial(self, stage: str, settings: Settings | None, label: str, *, again: bool = False) -> Trial:
        """Run one trial (or return the earlier one with the same settings, unless ``again``)."""
        if settings is not None and settings in self._by_settings and not again:
            return self._by_settings[settings]
        number = len(self.trials) + 1
        parent = self.directory / f"t{number:02d}"
        noise = stage == NOISE
        own = self.noise_overrides if noise else ()
        overrides = (*self.common, *own, *(settings.overrides() if settings else ()))
        steps = self.noise_steps if noise else self.options.steps
        script, args, cap = (
            replace(self.options, steps=steps).target("tune") if noise else (self.script, self.script_args, self.cap)
        )
        run = self.launching.launch(script, args, nproc=self.nproc, parent=parent, extra=overrides, cap=cap)
        trial = conclude(
            Trial(number, stage, settings or Settings(0, 0), label),
            run,
            nproc=self.nproc,
            warmup=self.options.warmup,
            steps=steps,
            # A script shorter than the noise trial still gives it the estimates after its warm-up.
            min_steps=search.noise_trial_minimum(steps) if noise else None,
        )
        self.trials.append(trial)
        if settings is not None and not again and not noise:
            self._by_settings[settings] = trial
        self.say(_progress_line(trial))
        note = stop_note(run, f"tune trial {number}", self.cap)
        if note:
            self.say(note)
        return trial

    def _noise_scale(self, trials) -> float | None:
        """The gradient noise scale the trials measured (their median: each estimates the same
        quantity, at its own batch)."""
        values = [t.figures.noise_scale for t in trials if t.outcome == OK and t.figures and t.figures.noise_scale]
        return statistics.median(values) if values else None

    def measure_noise(self, settings: Settings) -> float | None:
        """--objective time: the noise scale from the noise trial at ``settings`` (search.noise_trial:
        longer than the others, its first half weighted out)."""
        weighted = f"{search.NOISE_WARMUP:.0%}"
        label = f"{self.label(settings)}, {self.noise_steps} steps, the first {weighted} weighted out"
        return self._noise_scale([self.trial(NOISE, settings, label, again=True)])

    def _smaller_global_trials(
        self, current: Settings, start: Trial, multiple: int, noise: float | None
    ) -> dict[int, Trial]:
        """--objective time with --allow-global-batch: trials at a half and a quarter of the
        script's global batch (micro-batch and global batch both divided, the accumulation kept).
        Below the noise scale a smaller batch needs fewer samples for the same progress, which can
        more than pay for its lower samples/s; the choice weighs both."""
        out: dict[int, Trial] = {}
        if start.outcome != OK or noise is None:
            return out  # without a noise scale the choice is by throughput, which a smaller batch never wins
        for factor in (2, 4):
            micro = current.micro // factor
            if current.micro % factor or current.global_batch % factor or micro % multiple:
                break
            settings = replace(current, micro=micro, global_batch=current.global_batch // factor)
            out[micro] = self.trial("micro-batch", settings, f"{self.label(settings)} (a smaller global batch)")
        return out

    def _time_words(self, measured: list[search.Measured], noise: float | None, current: Settings | None) -> str:
        if noise is None:
            return (
                "no trial measured the gradient noise scale (docs/goodput.md says where it can be), "
                "so the choice is by throughput"
            )
        ref = next((m for m in measured if current is not None and m.value == current.micro and m.ok), None)
        parts = []
        for m in measured:
            if m.ok:
                time = f", time x{search.predicted_time_ratio(m, ref, noise):.2f}" if ref is not None else ""
                smaller = current is not None and m.global_batch < current.global_batch
                parts.append(
                    f"{m.value}{f' (global {m.global_batch})' if smaller else ''}: "
                    f"{m.samples_per_s:,.0f} samples/s x efficiency "
                    f"{search.efficiency(m.global_batch, noise):.2f}{time}"
                )
        return f"gradient noise scale ≈{noise:,.0f}; " + "; ".join(parts)

    def confirmed(self, stage: str, current: Trial, winner: Trial, noise: float | None = None) -> bool:
        """A change from the value in use must win a second, independent pair of trials too:
        between trials minutes apart, a shared machine's load alone moves samples/s by more
        than the gain a setting brings."""
        again_current = self.trial(
            stage, current.settings, f"{self.stage_label(stage, current.settings)} (again)", again=True
        )
        again_winner = self.trial(
            stage, winner.settings, f"{self.stage_label(stage, winner.settings)} (again)", again=True
        )
        if noise is None:
            return search.confirmed(again_current.samples_per_s, again_winner.samples_per_s)
        rates = [
            search.Measured(0, t.samples_per_s, global_batch=t.settings.global_batch).goodput(noise)
            for t in (again_current, again_winner)
        ]
        return search.confirmed(*rates)

    def stage_label(self, stage: str, s: Settings) -> str:
        """What a trial varies, in the words of its stage."""
        if stage == "bucket":
            return f"{s.bucket_mb:g} MiB buckets"
        if stage == "workers":
            return plural(int(s.workers or 0), "loader worker")
        return self.label(s)

    def label(self, s: Settings) -> str:
        accumulation = s.global_batch // (s.micro * self.dp)
        return (
            f"micro-batch {s.micro} x {plural(accumulation, 'accumulation step')} x {plural(self.dp, 'process')} "
            f"= global {s.global_batch}"
        )

    # -- stages -------------------------------------------------------------------------------------
    def run(self) -> TuneResult:
        o = self.options
        self.directory.mkdir(parents=True)
        if self.creates is not None:
            stand_in = self.directory / f"empty-config{self.creates.suffix or '.yaml'}"
            stand_in.touch()
            self.launching = replace(o, config_file=str(stand_in))
        device = self.base.devices.kind
        cap = f", memory cap {o.memory_cap} per rank" if o.memory_cap else ""
        self.say(
            f"phalanx: tune of {'the demo' if o.demo else self.script} on "
            f"{plural(self.nproc, 'process' if device == 'cpu' else 'device')} "
            f"({device}, strategy {self.base.strategy}{cap}), {o.steps} steps per trial; trials in {self.directory}"
        )
        stages: list[StageResult] = []
        warnings: list[str] = []
        start = self.trial("start", None, "as configured")
        if start.outcome not in (OK, OOM):
            raise TuneFailed(
                f"the first trial, with the script's own settings, failed: {start.detail}; its output is in {start.log}"
            )
        plan = announced(start.run_dir)
        if plan is None:
            raise TuneFailed(
                f"the first trial ({start.describe_outcome()}) announced no batch plan; tune needs a script that "
                "trains through phalanx.Session with a training DataLoader (or batch.global_batch_size); "
                f"its output is in {start.log}"
            )
        self.plan = plan
        if plan.fixed_layout:
            _refuse_global_batch(o, "the script fixes its batch layout (batch.fixed_layout)")
        global_batch, micro = plan.global_batch, plan.micro
        config = self.base.config
        bucket = config.strategy.ddp.bucket_cap_mb if self._bucket_applies() else None
        current = Settings(micro, global_batch, config.data.num_workers, bucket)
        start.settings, start.label = current, f"as configured: {self.label(current)}"
        self._by_settings[current] = start

        failure = None
        try:
            if "micro-batch" in o.search:
                current, stage = self.micro_stage(current, start)
                stages.append(stage)
            elif start.outcome == OOM:
                raise TuneFailed(
                    f"the script's own micro-batch {micro} runs out of memory ({start.detail}); "
                    "search micro-batches with --search micro-batch"
                )
            if "workers" in o.search:
                current, stage = self.workers_stage(current)
                stages.append(stage)
            if "bucket" in o.search:
                current, stage = self.bucket_stage(current)
                stages.append(stage)
        except TuneFailed as err:
            failure = str(err)

        values: dict[str, object] = {}
        for stage in stages:
            values.update(stage.values)
        code = code_settings(start.run_dir)
        for key in values:
            if key in code:
                warnings.append(
                    f"the script sets {key} in code (phalanx.Session(...)), which beats the config file: "
                    f"change it there, or pass --set {key}={values[key]} to launch"
                )
        if LIMIT in values and EXACT in code:
            warnings.append(
                f"the script sets {EXACT} in code (phalanx.Session(...)), which is used exactly and beats "
                f"{LIMIT}: remove it there"
            )
        config_path = Path(o.config_file) if o.config_file else Path("phalanx.yaml")
        written = None
        if values and not o.dry_run and failure is None:
            written = write_values(config_path, values, replaces={LIMIT: EXACT})
        result = TuneResult(self.directory, self.trials, stages, values, config_path, written, warnings, failure)
        (self.directory / "tune.json").write_text(
            json.dumps(_document(result, o, device, self.nproc), indent=2) + "\n", encoding="utf-8"
        )
        return result

    def micro_stage(self, current: Settings, start: Trial) -> tuple[Settings, StageResult]:
        o = self.options
        if self.plan.fixed_layout:
            return current, _fixed_layout_stage(self.label(current), start)
        per_process = current.global_batch // self.dp
        keep = not o.allow_global_batch
        most = o.max_micro_batch or (per_process if keep else 8 * per_process)
        if most < current.micro:
            raise TuneFailed(f"--max-micro-batch {most} is below the script's own micro-batch {current.micro}")
        multiple = strategy_class(self.base.strategy).micro_batch_multiple(self.base.config, self.nproc)
        candidates = search.micro_candidates(
            per_process, current.micro, keep_global=keep, most=most, multiple_of=multiple
        )
        tried: dict[int, Trial] = {current.micro: start}

        def fits(size: int) -> bool:
            if size not in tried:
                settings = replace(
                    current, micro=size, global_batch=search.global_batch_for(size, current.global_batch, self.dp)
                )
                tried[size] = self.trial("micro-batch", settings, self.label(settings))
            return tried[size].outcome == OK

        largest = search.largest_fitting(candidates, current.micro, fits)
        if largest is None:
            raise TuneFailed(
                f"no micro-batch fits, not even {candidates[0]}: {tried[candidates[0]].describe_outcome()}; "
                f"its output is in {tried[candidates[0]].log}"
            )
        over = min((s for s, t in tried.items() if s > largest and t.outcome != OK), default=None)
        pool = dict(tried)
        noise = None
        if o.objective == "time":
            noise = self.measure_noise(current if start.outcome == OK else tried[largest].settings)
        if o.objective == "time" and not keep:
            for size, trial in self._smaller_global_trials(current, start, multiple, noise).items():
                pool.setdefault(size, trial)
        measured = [search.Measured(s, t.samples_per_s, global_batch=t.settings.global_batch) for s, t in pool.items()]
        measured.sort(key=lambda m: m.value)
        now = current.micro if start.outcome == OK else None
        winner = search.fastest_to_target(measured, now, noise) if noise else search.fastest(measured, now)
        chosen = pool[int(winner.value)]
        unconfirmed = None
        if chosen is not start and start.outcome == OK and not self.confirmed("micro-batch", start, chosen, noise):
            unconfirmed, chosen = chosen, start
        chosen.chosen = True
        text = f"micro-batch: the largest that fits is {largest}"
        if over is not None:
            text += f" ({over}: {tried[over].describe_outcome()})"
        elif keep and largest == per_process:
            text += (
                f", the whole per-process share of global batch {current.global_batch} "
                "(--allow-global-batch tries larger ones)"
            )
        else:
            text += f", the largest tried (--max-micro-batch {most})"
            if self.base.devices.kind == "cpu" and self.base.config.train.memory_cap is None:
                text += "; on CPU without --memory-cap only the machine's RAM limits memory"
        if o.objective == "time":
            text += "; " + self._time_words(measured, noise, current if start.outcome == OK else None)
        if chosen.settings.micro != current.micro:
            text += f"; chosen {chosen.settings.micro}, " + (
                "the shortest predicted time to the same quality" if noise else "the fastest that fits"
            )
        elif unconfirmed is not None:
            text += (
                f"; kept the script's own {current.micro}: {unconfirmed.settings.micro} was faster at first, "
                "not when both ran again"
            )
        elif len(tried) > 1:
            text += f"; kept the script's own {current.micro}: " + (
                f"no other has a predicted time to the same quality {search.MIN_GAIN:.0%} shorter"
                if noise
                else f"no other measured {search.MIN_GAIN:.0%} faster"
            )
        # A limit, not the size: at another process count the Session divides the global batch anew.
        values: dict[str, object] = {LIMIT: chosen.settings.micro}
        if chosen.settings.global_batch != current.global_batch:
            lr = search.lr_settings(
                current.global_batch,
                chosen.settings.global_batch,
                rule=self.base.config.optim.lr_scaling,
                reference=self.base.config.optim.reference_batch_size,
                warmup_steps=self.base.config.optim.warmup_steps,
            )
            values.update(lr)
            text += (
                f"; global batch {current.global_batch} -> {chosen.settings.global_batch}, "
                f"so the learning rate is scaled by {search.lr_multiplier(lr):.3g} "
                f"({lr['optim.lr_scaling']} rule, reference {lr['optim.reference_batch_size']}"
                + (f", warm-up {lr['optim.warmup_steps']} steps)" if "optim.warmup_steps" in lr else ")")
            )
        return chosen.settings, StageResult("micro-batch", text, values)

    def workers_stage(self, current: Settings) -> tuple[Settings, StageResult]:
        per_rank = max(1, cpu_count() // self.nproc)
        measured: list[search.Measured] = []
        trials: dict[int, Trial] = {}
        for count in search.worker_counts(per_rank):
            settings = replace(current, workers=count)
            trial = self.trial("workers", settings, self.stage_label("workers", settings))
            trials[count] = trial
            measured.append(search.Measured(count, trial.samples_per_s, trial.data_wait_share))
            if search.stop_adding_workers(measured[-1]):
                break
        winner = search.choose_workers(measured)
        if winner is None:
            return current, StageResult(
                "workers", "loader workers: no trial ran its steps; data.num_workers left as it was"
            )
        chosen = trials[int(winner.value)]
        chosen.chosen = True
        share = chosen.data_wait_share or 0.0
        text = (
            f"loader workers: {int(winner.value)} (data wait {share:.0%} of the step; "
            f"tried {', '.join(map(str, trials))} of up to {per_rank} per rank)"
        )
        return chosen.settings, StageResult("workers", text, {"data.num_workers": int(winner.value)})

    def bucket_stage(self, current: Settings) -> tuple[Settings, StageResult]:
        if not self._bucket_applies():
            why = (
                f"strategy {self.base.strategy} has no DDP gradient buckets"
                if self.nproc > 1
                else "one process has nothing to all-reduce"
            )
            return current, StageResult("bucket", f"bucket size: skipped ({why})")
        gradients = self.plan.gradient_mib
        sizes = search.bucket_sizes(current.bucket_mb, gradients)
        if len(sizes) < 2:
            total = format_bytes(gradients * MIB, decimals=1)  # as the Session's own line says it
            return current, StageResult(
                "bucket",
                f"bucket size: skipped (all {total} of gradients fit in one bucket of every size tried, "
                "so the size cannot matter)",
            )
        measured, trials = [], {}
        for size in sizes:
            settings = replace(current, bucket_mb=size)
            trials[size] = self.trial("bucket", settings, self.stage_label("bucket", settings))
            measured.append(search.Measured(size, trials[size].samples_per_s))
        winner = search.fastest(measured, current.bucket_mb)
        if winner is None:
            return current, StageResult(
                "bucket", "bucket size: no trial ran its steps; strategy.ddp.bucket_cap_mb left as it was"
            )
        chosen, now = trials[winner.value], trials[current.bucket_mb]
        kept = f" (no other size measured {search.MIN_GAIN:.0%} faster)"
        if chosen is not now and now.outcome == OK and not self.confirmed("bucket", now, chosen):
            kept = f" ({chosen.settings.bucket_mb:g} MiB was faster at first, not when both ran again)"
            chosen = now
        chosen.chosen = True
        size = chosen.settings.bucket_mb
        text = f"bucket size: {size:g} MiB{kept if size == current.bucket_mb else ''}"
        return chosen.settings, StageResult("bucket", text, {"strategy.ddp.bucket_cap_mb": float(size)})

    def _bucket_applies(self) -> bool:
        return strategy_class(self.base.strategy).ddp_buckets and self.nproc > 1


def run_tune(options: TuneOptions, say: Callable[[str], None] = print) -> TuneResult:
    return _Tuner(options, say).run()


def _absent_config(options: TuneOptions) -> Path | None:
    """``--config FILE`` when FILE does not exist yet: tune creates it with the winners (docs/tune.md).
    Until then the trials read an empty file in its place, so they run on the defaults, which is
    what FILE will add the winners to; with no --config at all, launch would read ./phalanx.yaml,
    another file."""
    if not options.config_file:
        return None
    path = Path(options.config_file)
    try:
        if path.exists():
            return None
    except (OSError, ValueError):  # a path that cannot be one: launch says so in its own words
        return None
    if not path.parent.is_dir():
        raise PhalanxError(
            f"--config {path}: the directory {path.parent} does not exist, so tune cannot create the file there; "
            "create the directory first or give a path in an existing one"
        )
    return path


def _refuse_global_batch(options: TuneOptions, why: str) -> None:
    if options.allow_global_batch:
        raise PhalanxError(
            f"--allow-global-batch: {why}, so tune keeps the script's global batch; drop --allow-global-batch"
        )


def _fixed_layout_stage(kept: str, start: Trial) -> StageResult:
    """The micro-batch stage of a script whose batch layout is fixed: nothing to search."""
    if start.outcome == OOM:
        raise TuneFailed(
            f"the script's own batch ({kept}) runs out of memory ({start.detail}), and the script fixes its batch "
            "layout (batch.fixed_layout), so tune may not lower the micro-batch; lower the batch sizes in the script"
        )
    return StageResult(
        "micro-batch",
        f"micro-batch: kept {kept}: the script fixes its batch layout (batch.fixed_layout), so tune changes "
        "neither its global batch nor its micro-batch and tunes only what leaves them as they are",
    )


def _check_options(options: TuneOptions) -> None:
    options.check_steps()
    if options.memory_cap is not None and not size_bytes(options.memory_cap):
        raise PhalanxError(
            f"--memory-cap '{options.memory_cap}' is not a size; write e.g. 2GiB, 512MiB or a number of bytes"
        )
    if options.max_micro_batch is not None and options.max_micro_batch < 1:
        raise PhalanxError(f"--max-micro-batch must be at least 1, got {options.max_micro_batch}")
    for name in options.search:
        if name not in STAGES:
            raise PhalanxError(f"unknown tune stage '{name}'; the stages are {', '.join(STAGES)}")


def _progress_line(trial: Trial) -> str:
    text = f"phalanx: tune trial {trial.number} ({trial.stage}, {trial.label}): "
    if trial.outcome == OK:
        share = trial.data_wait_share
        text += (
            f"{trial.samples_per_s:,.0f} samples/s, data wait {share:.0%}"
            if share is not None
            else f"{trial.samples_per_s:,.0f} samples/s"
        )
    else:
        text += trial.describe_outcome()
    return text + f", {trial.seconds:.0f}s"


def _document(result: TuneResult, options: TuneOptions, device: str, nproc: int) -> dict:
    return {
        "command": options.command(),
        "device": device,
        "nproc": nproc,
        "objective": options.objective,
        "trials": [t.as_json() for t in result.trials],
        "stages": [{"stage": s.stage, "summary": s.summary, "values": s.values} for s in result.stages],
        "values": result.values,
        "config_file": str(result.config_path),
        "written": result.written is not None,
        "warnings": result.warnings,
        "failure": result.failure,
    }
