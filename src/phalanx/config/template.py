"""Renders a config as commented YAML: the file ``phalanx config init`` writes."""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel

from phalanx.config.schema import Config

HEADER = """\
# phalanx configuration. Every value here is optional: delete a line to use the default.
# Precedence: defaults < this file < keyword arguments in code < `--set key=value` on the command line.
# `phalanx config show` prints the resolved values and where each came from. Reference: docs/config.md
"""


def render(config: Config) -> str:
    lines = [HEADER.rstrip("\n")]
    for name in type(config).model_fields:
        lines.append("")
        lines.extend(_section(name, getattr(config, name), indent=0))
    return "\n".join(lines) + "\n"


def _section(name: str, model: BaseModel, indent: int) -> list[str]:
    pad = "  " * indent
    out = [f"{pad}{name}:"]
    for field_name, info in type(model).model_fields.items():
        value = getattr(model, field_name)
        if isinstance(value, BaseModel):
            out.extend(_section(field_name, value, indent + 1))
            continue
        text = f"{pad}  {field_name}: {scalar(value)}"
        if info.description:
            text = f"{text:<40} # {info.description}"
        out.append(text)
    return out


def scalar(value: Any) -> str:
    """A value as YAML writes it: null, true, 0.5, text."""
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
