"""What the Session knows once it is set up, written for other programs as ``<run dir>/session.json``:
the strategy, device and precision, the batch plan, the trainable parameters and gradient size of
each model, and which settings the script gave in code. ``phalanx tune`` reads it to learn the
script's batch plan (even when the first step then runs out of memory) and whether the bucket size
can matter; the console line says the same to people.

Rank 0 writes the file at the end of the first ``session.setup()``, and again whenever a later
``setup()`` or ``setup_loader()`` call changes the batch plan or the models (a script may set up its
model first and its training loader after), each time atomically, so a reader sees a whole file or none.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping

from phalanx.config.batch import BatchPlan
from phalanx.errors import PhalanxError
from phalanx.util.units import format_bytes

if TYPE_CHECKING:
    import torch
    from torch import nn

FILE_NAME = "session.json"
FORMAT = "phalanx-session"
VERSION = 1


@dataclass(frozen=True)
class ModelFacts:
    """One model as this rank holds it: a sharding strategy holds a part of it."""

    trainable_parameters: int
    gradient_bytes: int


@dataclass(frozen=True)
class RunFacts:
    strategy: str  # the strategy's name
    strategy_description: str  # as the console line says it, e.g. "ddp over 2 processes (bucket 25 MiB)"
    device: str  # cpu, cuda, ...
    precision: str
    batch: BatchPlan | None  # None: no training loader and no batch size in the config
    models: tuple[ModelFacts, ...]
    lr_scaling: str | None  # the learning-rate rule in words
    code_settings: frozenset[str]  # config keys the script set in code (phalanx.Session(...))
    fixed_layout: bool = False  # the script fixed its batch layout: bench and tune keep the batch as it is

    @property
    def trainable_parameters(self) -> int:
        return sum(m.trainable_parameters for m in self.models)

    @property
    def gradient_bytes(self) -> int:
        return sum(m.gradient_bytes for m in self.models)


def model_facts(model: nn.Module) -> ModelFacts:
    params = [p for p in model.parameters() if p.requires_grad]
    return ModelFacts(sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params))


def describe_model_size(models: Iterable[nn.Module]) -> str:
    """Trainable parameters on this rank, and their gradients' size (what DDP all-reduces per step),
    for the Session's console line."""
    facts = [model_facts(m) for m in models]
    params, size = sum(f.trainable_parameters for f in facts), sum(f.gradient_bytes for f in facts)
    return f"{params:,} trainable parameters ({format_bytes(size, decimals=1)} of gradients)"


def write_run_facts(
    run_dir: str | Path,
    *,
    strategy: str,
    strategy_description: str,
    device: str | torch.device,
    precision: str,
    batch: BatchPlan | None,
    models: Iterable[nn.Module],
    lr_scaling: str | None,
    config_sources: Mapping[str, str],
    fixed_layout: bool = False,
) -> Path:
    """Write ``<run_dir>/session.json``; ``config_sources`` maps each config key to where its value
    came from (``Config.sources``)."""
    facts = [model_facts(m) for m in models]
    document = {
        "format": FORMAT,
        "version": VERSION,
        "strategy": strategy,
        "strategy_description": strategy_description,
        "device": getattr(device, "type", None) or str(device),
        "precision": precision,
        "batch": None
        if batch is None
        else {
            "global_batch_size": batch.global_batch_size,
            "micro_batch_size": batch.micro_batch_size,
            "accumulation_steps": batch.accumulation_steps,
            "data_parallel_size": batch.data_parallel_size,
            "fixed_layout": fixed_layout,
        },
        "models": [{"trainable_parameters": f.trainable_parameters, "gradient_bytes": f.gradient_bytes} for f in facts],
        "total": {
            "trainable_parameters": sum(f.trainable_parameters for f in facts),
            "gradient_bytes": sum(f.gradient_bytes for f in facts),
        },
        "lr_scaling": lr_scaling,
        "code_settings": sorted(key for key, source in config_sources.items() if source == "code"),
    }
    path = Path(run_dir) / FILE_NAME
    partial = path.with_name(f".{FILE_NAME}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    os.replace(partial, path)  # a reader (tune, polling a running trial) never sees half a file
    return path


def read_run_facts(run_dir: str | Path) -> RunFacts | None:
    """The facts a run's Session wrote; None when it wrote none (it never reached ``setup()``, or
    it is not a phalanx.Session script)."""
    path = Path(run_dir) / FILE_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as err:
        raise PhalanxError(f"cannot read {path}: {err.strerror or err}") from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as err:
        raise PhalanxError(
            f"{path} is not valid JSON ({err.msg} at line {err.lineno}); the run that wrote it may have been cut short"
        ) from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise PhalanxError(f'{path} is not a phalanx session file (no "format": "{FORMAT}")')
    if document.get("version") != VERSION:
        raise PhalanxError(
            f"{path} has version {document.get('version')!r}; this phalanx reads version {VERSION}: "
            "use the phalanx that wrote it"
        )
    try:
        batch = document["batch"]
        return RunFacts(
            strategy=str(document["strategy"]),
            strategy_description=str(document["strategy_description"]),
            device=str(document["device"]),
            precision=str(document["precision"]),
            batch=None
            if batch is None
            else BatchPlan(
                int(batch["global_batch_size"]),
                int(batch["micro_batch_size"]),
                int(batch["accumulation_steps"]),
                int(batch["data_parallel_size"]),
            ),
            models=tuple(
                ModelFacts(int(m["trainable_parameters"]), int(m["gradient_bytes"])) for m in document["models"]
            ),
            lr_scaling=None if document["lr_scaling"] is None else str(document["lr_scaling"]),
            code_settings=frozenset(str(key) for key in document["code_settings"]),
            fixed_layout=batch is not None and batch.get("fixed_layout") is True,  # absent before the lock existed
        )
    except (KeyError, TypeError, ValueError) as err:
        what = f"no {err.args[0]!r}" if isinstance(err, KeyError) else str(err)
        raise PhalanxError(f"{path} is not a valid phalanx session file ({what})") from None
