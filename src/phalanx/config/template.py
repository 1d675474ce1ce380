"""Renders a config as commented YAML: the file ``phalanx config init`` writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from phalanx.config.schema import Config

HEADER = """\
# phalanx configuration. Every value here is optional: delete a line to use the default.
# Precedence: defaults < this file < keyword arguments in code < `--set key=value` on the command line.
# `phalanx config show` prints the resolved values and where each came from. Reference: docs/config.md
"""


RESOLVED_HEADER = """\
# The config this run used, each value followed by where it came from. Reusable: --config FILE.
"""


def render(config: Config, *, sources: bool = False) -> str:
    """Commented YAML: each value's description, or with ``sources`` where the value came from."""
    lines = [(RESOLVED_HEADER if sources else HEADER).rstrip("\n")]
    for name, info in type(config).model_fields.items():
        value = getattr(config, name)
        if not isinstance(value, BaseModel):  # a top-level value (preset)
            comment = config.sources.get(name, "default") if sources else info.description
            lines.extend(["", f"{f'{name}: {scalar(value)}':<40} # {comment}"])
            continue
        lines.append("")
        lines.extend(_section(name, value, 0, name, config.sources if sources else None))
    return "\n".join(lines) + "\n"


def write_resolved(config: Config, path: str | Path) -> None:
    Path(path).write_text(render(config, sources=True), encoding="utf-8")


def _section(name: str, model: BaseModel, indent: int, path: str, sources: dict[str, str] | None) -> list[str]:
    pad = "  " * indent
    out = [f"{pad}{name}:"]
    for field_name, info in type(model).model_fields.items():
        value = getattr(model, field_name)
        key = f"{path}.{field_name}"
        if isinstance(value, BaseModel):
            out.extend(_section(field_name, value, indent + 1, key, sources))
            continue
        text = f"{pad}  {field_name}: {scalar(value)}"
        comment = sources.get(key, "default") if sources is not None else info.description
        if comment:
            text = f"{text:<40} # {comment}"
        out.append(text)
    return out


def scalar(value: Any) -> str:
    """A value as YAML writes it: null, true, 0.5, text."""
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
