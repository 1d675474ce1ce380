"""Which run a checkpoint belongs to, so that ``checkpoint.resume: auto`` continues only that run.

A checkpoint records the run that wrote it under ``"run"`` in its manifest:

    settings    the settings that change what training computes (COUNTED), as the Session resolved
                them: file, code and --set alike
    script      the script's resolved path, the SHA-256 of its content and its arguments (null where
                there is no script file: a notebook, ``python -c``)
    launch      settings and script as ``phalanx launch`` resolved them before any worker started
                (null without it)
    script_set  the settings the script chose itself (in code, in a file of its own, by a preset),
                which a launcher cannot see

The Session decides, at setup, where the script's own settings are known: its checkpoint.dir, its
resume mode, its settings, its script and arguments (compared as options, script_args.py). The
launcher refuses earlier only what it can tell for certain: the checkpoint in its checkpoint.dir
was written by the same script with the same arguments, which does again what it did then, and a
setting differs whose value now the script does not choose (``script_set``).

What does not count, and why, is in docs/checkpoints.md (#which-settings-count).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import torch.distributed as dist

from phalanx.checkpoint import files, script_args
from phalanx.config.loader import DEFAULT_FILE
from phalanx.config.schema import Config
from phalanx.config.sources import one_line
from phalanx.errors import PhalanxError
from phalanx.topology import LaunchContext, Topology

# Settings that change the numbers training computes. Mechanics (how the global batch is split into
# micro-batches, the strategy, compilation, loader workers, activation checkpointing) are left out:
# they give the same weights (tests/integration/test_equivalence.py), and changing them on a resume
# is what a requeue onto other hardware needs. So are train.epochs and train.max_steps: raising
# them to train on is the most ordinary resume there is.
COUNTED = (
    "batch.global_batch_size",
    "batch.adaptive",
    "batch.adapt_every",
    "batch.adaptive_max_global_batch",
    "batch.adaptive_step_times",
    "batch.adaptive_loss_check",
    "batch.schedule",
    "optim.lr_scaling",
    "optim.reference_batch_size",
    "optim.warmup_steps",
    "optim.warmup_start_factor",
    "optim.max_grad_norm",
    "precision.mode",
    "precision.tf32",
    "data.drop_last",
    "train.seed",
)
# The noise scale is a measurement, except that batch.adaptive chooses batches from it.
WITH_ADAPTIVE = ("train.noise_scale", "train.noise_scale_every", "train.noise_scale_smoothing")

SHOWN = 3  # differences named in a refusal; the rest are counted


def counted_settings(config: Config, strategy_keys: Sequence[str] = ()) -> dict[str, Any]:
    """The counted settings of ``config``, with the strategy in use's own (``strategy_keys``: its
    ``counted_settings()``, flat keys such as ``strategy.ddp.comm_hook``; another strategy's section
    is unused), as JSON values: what a manifest holds and what a comparison with one sees."""
    flat = config.flat()
    keys = [*COUNTED, *strategy_keys]
    if flat.get("batch.adaptive") is not None:
        keys += WITH_ADAPTIVE
    return {key: json.loads(json.dumps(flat[key])) for key in keys if key in flat}


def script_identity(path: str | None, args: Sequence[str]) -> dict[str, Any] | None:
    """``{"path", "sha256", "args"}`` of the script at ``path``, or None when it is no readable file."""
    if not path:
        return None
    try:
        resolved = Path(path).resolve()
        if not resolved.is_file():
            return None
        digest = files.sha256(resolved)
    except (OSError, RuntimeError, ValueError):  # unreadable, a symlink loop, a NUL byte
        return None
    return {"path": str(resolved), "sha256": digest, "args": [str(a) for a in args]}


def of_launch(config: Config, strategy_keys: Sequence[str], script: str, args: Sequence[str]) -> dict[str, Any]:
    """What ``phalanx launch`` knows of the run: it passes this to the workers (LaunchContext.run),
    and its preflight compares it with a checkpoint's ``launch``."""
    return {"settings": counted_settings(config, strategy_keys), "script": script_identity(script, args)}


def differences(saved: dict[str, Any], now: dict[str, Any], ignored_args: Sequence[str] = ()) -> list[str]:
    """How run ``now`` differs from the run ``saved`` of a checkpoint, one phrase per difference
    (the script first). A side without a script, and a setting only one side records (a phalanx
    version that did not know it, another strategy's option), are not compared; nor are the script
    arguments that only lengthen or observe training (script_args.IGNORED, ``ignored_args``)."""
    out = []
    old, new = saved.get("script"), now.get("script")
    if old and new:
        if old["sha256"] != new["sha256"]:  # the same content elsewhere (a copied project) is the same script
            was, now_name = Path(old.get("path") or "").name, Path(new["path"]).name
            out.append(
                f"script: {was} saved it, this run is {now_name}"
                if was and was != now_name
                else f"script {now_name}: its content differs from the one that saved it"
            )
        out += script_args.differences(old["args"], new["args"], ignored_args)
    before, after = saved.get("settings") or {}, now.get("settings") or {}
    out += [f"{key}: {_show(before[key])} -> {_show(new)}" for key, new in after.items() if before.get(key, new) != new]
    return out


def refusal(
    where: Path, manifest: dict[str, Any], found: list[str], *, command_line: bool, shared_default: bool = False
) -> str:
    """The one line that stops a resume of ``where`` (whose manifest is ``manifest``). ``shared_default``:
    another script's checkpoint in checkpoint.dir's default, which every script run in the working
    directory shares unless it names its own."""
    if command_line:
        anyway, elsewhere, never = (
            "add --set checkpoint.resume_any_run=true",
            "with --set checkpoint.dir=DIR",
            "--set checkpoint.resume=never",
        )
    else:
        anyway, elsewhere, never = (
            "set checkpoint.resume_any_run: true",
            "(checkpoint.dir)",
            "set checkpoint.resume: never",
        )
    saved = f"checkpoint '{where}' (step {manifest['step']}, saved {manifest['created']})"
    if shared_default:
        return one_line(
            f"the default checkpoint directory '{where.parent}' holds another script's checkpoints ({_few(found)}): "
            f"{saved} is not this run's; to start afresh give this run its own directory {elsewhere} "
            f"(or {never} to start afresh in this one); to keep going from that checkpoint {anyway}"
        )
    return one_line(
        f"{saved} belongs to another run: {_few(found)}; to resume it anyway {anyway}; to start afresh give this "
        f"run its own directory {elsewhere} (or {never} to start afresh in this one)"
    )


def check_launch(root: Path, config: Config, launched: dict[str, Any]) -> None:
    """``phalanx launch``'s preflight, under ``checkpoint.resume: auto`` (and not ``resume_any_run``):
    refuse (PhalanxError) what the workers would refuse for certain, and leave the rest to them. It is
    certain when the latest checkpoint in ``root`` was written under phalanx launch by the same script
    (path and content) with the same arguments (``launched``, see :func:`of_launch`): that script
    chose ``root`` then and does again, and a counted setting differs that it does not choose itself
    (given on the command line, which wins over code, or one it left to the launcher's config). A
    changed script or argument may choose another directory or resume mode in code: the Session's."""
    if config.checkpoint.resume != "auto" or config.checkpoint.resume_any_run:
        return
    where = files.latest(root)
    if where is None:
        return
    manifest = files.read_manifest(where)
    run = manifest.get("run") or {}
    chosen = run.get("script_set")
    old, new = run.get("script"), launched.get("script")
    if run.get("launch") is None or not (old and new) or not _names(chosen):
        return  # not launched, or recorded before script_set: the Session checks it
    # Every argument, ignored ones too: a --resume PATH may be what the script resumes from.
    same_args = script_args.parse(old["args"]) == script_args.parse(new["args"])
    if (old["path"], old["sha256"]) != (new["path"], new["sha256"]) or not same_args:
        return
    on_command_line = {key for key, source in config.sources.items() if source == "--set"}
    unknown = set(chosen) - on_command_line
    if unknown & {"checkpoint.dir", "checkpoint.resume", "checkpoint.resume_any_run"}:
        return
    known = {key: value for key, value in launched["settings"].items() if key not in unknown}
    found = differences({"settings": run.get("settings") or {}}, {"settings": known})
    if found:
        raise PhalanxError(refusal(where, manifest, found, command_line=True))


def set_by_script(config: Config, context: LaunchContext | None) -> list[str]:
    """The settings the script chose itself, which its launcher could not see: every one but a
    default, the launcher's config file and its --set lines (a preset, a file of the script's own,
    code, Config.load(overrides=...) in code)."""
    if context is None:
        return sorted(config.flat())
    launcher_file = f"file {context.config_file or DEFAULT_FILE}"
    launcher_set = {line.partition("=")[0].strip() for line in context.overrides}
    return sorted(
        key
        for key in config.flat()
        if not (
            (source := config.sources.get(key, "default")) in ("default", launcher_file)
            or (source == "--set" and key in launcher_set)
        )
    )


class RunIdentity:
    """The Session's run: ``record`` is what its checkpoints hold under ``"run"``;
    :meth:`check_resume` stops a resume of another run's checkpoint."""

    def __init__(
        self, record: dict[str, Any], any_run: bool = False, ignored_args: Sequence[str] = (), default_dir: bool = False
    ):
        self.record, self.any_run, self.ignored_args = record, any_run, tuple(ignored_args)
        self.default_dir = default_dir  # checkpoint.dir is the default, which every script here shares
        self._checked: set[str] = set()  # every rank checks the same paths in the same order

    @classmethod
    def of_session(
        cls, config: Config, strategy_keys: Sequence[str], context: LaunchContext | None = None
    ) -> "RunIdentity":
        """The script is the launcher's view under phalanx launch (hashed once, before any worker
        ran), else this process's own ``sys.argv``: what torchrun and ``python train.py`` run."""
        if context is None:
            context = LaunchContext.from_env()
        launch = context.run if context is not None else None
        argv = sys.argv
        script = launch.get("script") if launch else script_identity(argv[0] if argv else None, argv[1:])
        record = {"settings": counted_settings(config, strategy_keys), "script": script, "launch": launch}
        if launch:
            record["script_set"] = set_by_script(config, context)
        return cls(
            record,
            config.checkpoint.resume_any_run,
            config.checkpoint.ignore_args,
            config.sources.get("checkpoint.dir", "default") == "default",
        )

    def check_resume(
        self,
        where: Path,
        topology: Topology,
        run_dir: str | None,
        say: Callable[[str], None],
        job: str | None = None,
    ) -> None:
        """Before ``checkpoint.resume: auto`` resumes ``where``; a collective. Rank 0 decides and every
        rank raises the same PhalanxError, so none waits for a rank that stopped. Once per path."""
        if str(where) in self._checked:
            return
        answer: tuple[str | None, str | None] = (None, None)
        if topology.is_main:
            try:
                answer = self.verdict(where, run_dir, job)
            except PhalanxError as err:  # a damaged manifest: the same line everywhere
                answer = (str(err), None)
        if topology.world_size > 1 and dist.is_initialized():
            box = [answer]
            dist.broadcast_object_list(box, src=0)
            answer = box[0]
        problem, note = answer
        if problem is not None:
            raise PhalanxError(problem)
        self._checked.add(str(where))
        if note is not None:
            say(note)

    def verdict(self, where: Path, run_dir: str | None, job: str | None = None) -> tuple[str | None, str | None]:
        """(refusal, note) for the Session's resume of ``where``: a refusal when it belongs to another run
        (unless ``any_run``), a note when that could not be checked or ``any_run`` let it through."""
        manifest = files.read_manifest(where)
        if (run_dir is not None and manifest.get("run_dir") == run_dir) or (
            job is not None and manifest.get("job") == job
        ):
            return None, None  # this launch wrote it (an elastic job: on any of its nodes): a restart resumes it
        run = manifest.get("run")
        if run is None:
            return None, (
                f"phalanx: checkpoint '{where}' was written by phalanx {manifest['phalanx']}, before checkpoints "
                "recorded their run: resuming it without checking that this run's settings and script are its own"
            )
        found = differences(run, self.record, self.ignored_args)
        if not found:
            return None, None
        if self.any_run:
            return None, one_line(
                f"phalanx: checkpoint.resume_any_run: resuming '{where}' although it belongs to another run: "
                f"{_few(found)}"
            )
        old, new = run.get("script"), self.record.get("script")
        another_script = bool(old and new) and Path(old.get("path") or "").name != Path(new["path"]).name
        # Under phalanx launch the way on is a --set away; under plain torchrun it is a setting.
        line = refusal(
            where,
            manifest,
            found,
            command_line=self.record.get("launch") is not None,
            shared_default=self.default_dir and another_script and old["sha256"] != new["sha256"],
        )
        return line, None

    def beside_another_script(self, where: Path, manifest: dict[str, Any]) -> str | None:
        """The note for a run that starts afresh (resume: never) in the default directory, whose newest
        checkpoint ``where`` another script wrote: its saves will go beside that script's."""
        old, new = (manifest.get("run") or {}).get("script"), self.record.get("script")
        if not (self.default_dir and old and new) or Path(old.get("path") or "").name == Path(new["path"]).name:
            return None
        return one_line(
            f"phalanx: note: the default checkpoint directory '{where.parent}' holds another script's checkpoints "
            f"({Path(old['path']).name}, newest step {manifest['step']}); this run's saves go beside them, and a "
            "later resume takes the newest of either: give this run its own directory (checkpoint.dir)"
        )


def _names(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _few(found: list[str]) -> str:
    return ", ".join(found[:SHOWN]) + (f" (and {len(found) - SHOWN} more)" if len(found) > SHOWN else "")


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)
