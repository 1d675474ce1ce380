"""Resolves a config tree from defaults, a YAML/TOML file, keyword arguments and ``--set`` lines,
remembering where each value came from, and turns validation failures into one readable line.

The tree's class is handed in (``schema``), so this module does not import the schema that calls it."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from phalanx.config.preset import apply_preset, device_kind
from phalanx.config.sections import SHORTHAND, flatten
from phalanx.errors import ConfigError
from phalanx.topology import LaunchContext

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_FILE = "phalanx.yaml"
T = TypeVar("T", bound=BaseModel)


def read_file(path: str | Path) -> dict[str, Any]:
    """Parse a YAML or TOML config file into a dict; errors name the file and the fix."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' not found; create one with `phalanx config init` or fix the path")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read config file '{path}': {err}") from None
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            data = yaml.safe_load(text)
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as err:
        where = ""
        mark = getattr(err, "problem_mark", None)
        if mark is not None:
            where = f" line {mark.line + 1}"
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(
            f"config file '{path}'{where} is not valid {'TOML' if path.suffix == '.toml' else 'YAML'}: {problem}"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file '{path}' must hold a mapping of sections (strategy:, batch:, ...), "
            f"not a {type(data).__name__}"
        )
    return data


def parse_override(line: str, schema: type[BaseModel]) -> tuple[str, Any]:
    """``"precision.mode=bf16"`` -> ``("precision.mode", "bf16")``; values are read as YAML scalars."""
    key, sep, raw = line.partition("=")
    key = key.strip()
    if not sep or not key or ("." not in key and key not in _top_level_values(schema)):
        raise ConfigError(f"--set expects section.key=value (e.g. precision.mode=bf16), got '{line}'")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key, value


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for dotted, value in flat.items():
        node = tree
        *parents, leaf = dotted.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"'{dotted}' goes inside '{part}', which is a value, not a section")
            node = child
        node[leaf] = value
    return tree


def _merge(base: dict, layer: Mapping, source: str, sources: dict[str, str], prefix: str = "") -> None:
    for key, value in layer.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value, source, sources, path + ".")
        else:
            base[key] = copy.deepcopy(value)
            for leaf in flatten({key: value}, prefix).keys() if isinstance(value, Mapping) else [path]:
                sources[leaf] = source


def _code_sections(sections: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in sections.items():
        if name in SHORTHAND and not isinstance(value, Mapping):
            value = {SHORTHAND[name]: value}
        out[name] = value
    return out


def describe_validation_error(err: ValidationError, sources: Mapping[str, str], schema: type[BaseModel]) -> str:
    """The first problem as one line: field path, what is wrong, what is allowed, where it came from."""
    first = err.errors()[0]
    path = ".".join(str(p) for p in first["loc"])
    origin = sources.get(path) or next((src for key, src in sources.items() if key.startswith(path + ".")), None)
    suffix = f" (from {origin})" if origin and origin != "default" else ""
    if first["type"] == "extra_forbidden":
        section, _, leaf = path.rpartition(".")
        known = _known_keys(schema, section)
        where = f"in '{section}'" if section else "at the top level"
        return f"unknown setting '{path}'{suffix}; known settings {where}: {', '.join(known)}"
    if not path:  # a rule across sections: its message names the settings itself
        return str(first["msg"]).removeprefix("Value error, ")
    value = first.get("input")
    return f"invalid value {value!r} for '{path}'{suffix}: {first['msg']}"


def _known_keys(schema: type[BaseModel], section: str) -> list[str]:
    model: Any = schema
    for part in filter(None, section.split(".")):
        model = model.model_fields[part].annotation
    return list(model.model_fields)


def resolve(
    schema: type[T],
    path: str | Path | None = None,
    *,
    overrides: Iterable[str] = (),
    sections: Mapping[str, Any] | None = None,
    context: LaunchContext | None = None,
    cwd: Path | None = None,
) -> T:
    """Resolve the config. Under ``phalanx launch`` the launcher's ``--config`` beats ``path`` and its
    ``--set`` lines are applied last, so the command line always has the final word."""
    if context is None:
        context = LaunchContext.from_env()
    sources: dict[str, str] = {}
    tree = schema().model_dump()
    sources.update({k: "default" for k in flatten(tree)})

    file = context.config_file if context and context.config_file else path
    if file is None:
        candidate = cwd / DEFAULT_FILE if cwd else Path(DEFAULT_FILE)
        file = candidate if candidate.is_file() else None
    if file is not None:
        _merge(tree, read_file(file), f"file {file}", sources)
    if sections:
        _merge(tree, _code_sections(sections), "code", sources)
    lines = list(overrides) + list(context.overrides if context else ())
    if lines:
        _merge(tree, _nest(dict(parse_override(line, schema) for line in lines)), "--set", sources)

    return _validated(schema, tree, sources, context)


def override(config: T, sections: Mapping[str, Any], context: LaunchContext | None = None) -> T:
    """A copy of ``config`` with keyword-argument sections from code merged on top, and the
    launcher's ``--set`` lines (from ``context``) on top of those."""
    sources = dict(config.sources) or _set_in_code(config)
    tree = config.model_dump()
    if sections:
        _merge(tree, _code_sections(sections), "code", sources)
    if context and context.overrides:
        _merge(tree, _nest(dict(parse_override(line, type(config)) for line in context.overrides)), "--set", sources)
    return _validated(type(config), tree, sources, context)


def _validated(
    schema: type[T], tree: dict[str, Any], sources: dict[str, str], context: LaunchContext | None = None
) -> T:
    apply_preset(tree, sources, flatten(schema().model_dump()), device_kind(context))
    try:
        config = schema.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(describe_validation_error(err, sources, schema)) from None
    config.record_sources({k: sources.get(k, "default") for k in config.flat()})
    return config


def _top_level_values(schema: type[BaseModel]) -> list[str]:
    """Top-level settings that are values, not sections (``preset``)."""
    return [
        name
        for name, info in schema.model_fields.items()
        if not (isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel))
    ]


def _set_in_code(config: BaseModel) -> dict[str, str]:
    """Sources of a Config built directly (``Config(precision={"mode": "bf16"})``): what was passed
    is "code", the rest "default"; so a preset it names stays below what it sets."""
    explicit: set[str] = set()

    def walk(model: Any, prefix: str) -> None:
        for name in model.model_fields_set:
            value = getattr(model, name)
            if hasattr(type(value), "model_fields"):
                walk(value, f"{prefix}{name}.")
            else:
                explicit.add(f"{prefix}{name}")

    walk(config, "")
    return {key: "code" if key in explicit else "default" for key in config.flat()}
