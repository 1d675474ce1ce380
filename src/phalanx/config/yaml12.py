"""YAML as configs mean it: PyYAML follows YAML 1.1, where ``1:30`` is the base-60 number 90. A node
range (``launch.nnodes: 1:4``) would silently become 64 nodes; YAML 1.2 reads such text as text."""

from __future__ import annotations

import re
from typing import Any

import yaml

_INT = re.compile(
    r"""^(?:[-+]?0b[0-1_]+
    |[-+]?0[0-7_]+
    |[-+]?(?:0|[1-9][0-9_]*)
    |[-+]?0x[0-9a-fA-F_]+)$""",
    re.X,
)
_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?
    |\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
_NUMBERS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")


class Loader(yaml.SafeLoader):
    """SafeLoader without the base-60 numbers."""


Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _NUMBERS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
Loader.add_implicit_resolver("tag:yaml.org,2002:int", _INT, list("-+0123456789"))
Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def load(text: str) -> Any:
    return yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader subclass
