"""The batch layout lock (``batch.fixed_layout``, or ``setup_loader(..., fixed_layout=True)``).

A script whose data layout depends on its batch sizes (a stream cut into as many columns as the
global batch, a hidden state carried per micro-step) declares the layout fixed; then a config file
or ``--set`` value that would give another global batch or micro batch than the script's own is
refused in one line, instead of silently mixing time steps within a batch. The script's own sizes
are those it gives in code (``phalanx.Session(batch=...)`` or a ``Config`` built in code) and its
training loader's ``batch_size``. ``phalanx bench`` and ``phalanx tune`` read the lock from
session.json and keep the global batch and the micro batch as they are (docs/data.md).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from phalanx.config.batch import BatchPlan
from phalanx.config.loader import override_config
from phalanx.config.schema import Config
from phalanx.config.sections import BatchConfig
from phalanx.errors import ConfigError

# The settings that make the plan; fixed_layout itself is not one of them.
SIZES = ("global_batch_size", "micro_batch_size", "max_micro_batch_size")

Planner = Callable[[int | None, BatchConfig], BatchPlan]


class LayoutLock:
    def __init__(self, config: Config, given: Config | None, sections: Mapping[str, Any]):
        """``config``: what the Session runs with; ``given`` and ``sections``: what the script passed
        to ``phalanx.Session`` (its code), from which the script's own sizes are told apart."""
        self.config = config
        self.declared_by = f"batch.fixed_layout, {_origin(config)}" if config.batch.fixed_layout else None
        self._given = given
        self._sections = sections
        self._script: BatchConfig | None = None

    @property
    def fixed(self) -> bool:
        return self.declared_by is not None

    def declare(self, by: str) -> None:
        if self.declared_by is None:
            self.declared_by = by

    def script_sizes(self) -> BatchConfig:
        """The batch section as the script's code alone gives it (no file, no ``--set``)."""
        if self._script is None:
            own = override_config(self._given if self._given is not None else Config(), self._sections)
            self._script = BatchConfig(
                **{key: getattr(own.batch, key) for key in SIZES if own.sources.get(f"batch.{key}") == "code"}
            )
        return self._script

    def check(self, plan: BatchPlan | None, loader_batch_size: int | None, planner: Planner) -> None:
        """Refuse a plan other than the one the script's own sizes give, when the layout is fixed."""
        if not self.fixed or plan is None:
            return
        script = self.script_sizes()
        global_bs = script.global_batch_size or loader_batch_size
        if global_bs is None and script.micro_batch_size is None and script.max_micro_batch_size is None:
            return  # the script gives no size: the config's are its layout
        own = planner(global_bs, script)
        if (own.global_batch_size, own.micro_batch_size) == (plan.global_batch_size, plan.micro_batch_size):
            return
        sources = self.config.sources
        blamed = [
            f"batch.{key} {getattr(self.config.batch, key)} (from {sources[f'batch.{key}']})"
            for key in SIZES
            if sources.get(f"batch.{key}") not in (None, "default", "code")
            and getattr(self.config.batch, key) != getattr(script, key)
        ]
        what = " and ".join(blamed) or "the config's batch section"
        raise ConfigError(
            f"{what} would change the batch layout, which is fixed ({self.declared_by}): "
            f"it would train on global batch {plan.global_batch_size} in micro batches of {plan.micro_batch_size}, "
            f"the script's data is laid out for global batch {own.global_batch_size} in micro batches of "
            f"{own.micro_batch_size}; remove {'them' if len(blamed) > 1 else 'it'}, or change the sizes in the script"
        )


def _origin(config: Config) -> str:
    source = config.sources.get("batch.fixed_layout", "code") if config.sources else "code"
    return {"code": "set in the script", "--set": "set with --set"}.get(source, f"set in {source}")
