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

from phalanx.config import yaml12
from phalanx.config.preset import apply_preset, device_kind
from phalanx.config.sections import CONTROL_CHARACTERS, SHORTHAND, flatten
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
    try:
        found = path.is_file()
    except (OSError, ValueError) as err:  # a name too long, a NUL byte
        raise ConfigError(f"config file '{path}' cannot be opened: {err}; fix the path") from None
    if not found:
        raise ConfigError(f"config file '{path}' not found; create one with `phalanx config init` or fix the path")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read config file '{path}': {err}") from None
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            data = yaml12.load(text)
    except RecursionError:
        raise ConfigError(
            f"config file '{path}' nests too deeply to be a config; sections are two levels deep"
        ) from None
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
        raise ConfigError(one_line(f"--set expects section.key=value (e.g. precision.mode=bf16), got '{line}'"))
    try:
        value = yaml12.load(raw) if raw.strip() else None
    except (yaml.YAMLError, RecursionError):  # not YAML (or nested past any setting): the text itself
        value = raw
    return key, value


def check_overrides(schema: type[BaseModel], lines: Iterable[str], names: Mapping[str, str]) -> None:
    """Validate ``--set`` lines on their own (every other setting at its default) by the schema's
    rules, naming a bad value by ``names[key]`` (the flag that stands for the key)."""
    tree = schema().model_dump()
    sources = {k: "default" for k in flatten(tree)}
    _merge(tree, _nest(dict(parse_override(line, schema) for line in lines)), "--set", sources, schema)
    try:
        schema.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(describe_validation_error(err, sources, schema, names)) from None


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


def _merge(
    base: dict, layer: Mapping, source: str, sources: dict[str, str], schema: Any = None, prefix: str = ""
) -> None:
    """Lay ``layer`` over ``base``: a section (a part of ``schema`` that is itself a model) merges key
    by key; a setting takes the later layer's value whole, a map too (``strategy.tp.plan={}`` from
    --set empties the file's plan, as docs/config.md says a later layer wins). Where ``schema``
    does not know a key, its mappings merge: validation names it after."""
    for key, value in layer.items():
        path = f"{prefix}{key}"
        field = schema.model_fields.get(key) if schema is not None else None
        section = _section(field)
        if isinstance(value, Mapping) and isinstance(base.get(key), dict) and (field is None or section):
            _merge(base[key], value, source, sources, section, path + ".")
        else:
            base[key] = copy.deepcopy(value)
            for leaf in [k for k in sources if k.startswith(path + ".")]:  # the entries of the map it replaces
                del sources[leaf]
            for leaf in flatten({key: value}, prefix).keys() if isinstance(value, Mapping) else [path]:
                sources[leaf] = source


def _section(field: Any) -> type[BaseModel] | None:
    """The model class of a field that is a section of the tree, else None."""
    annotation = getattr(field, "annotation", None)
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _code_sections(sections: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in sections.items():
        if name in SHORTHAND and not isinstance(value, Mapping):
            value = {SHORTHAND[name]: value}
        out[name] = value
    return out


def one_line(text: str) -> str:
    """``text`` with its control characters and line breaks escaped (a key or a value from a file
    may hold them), so that an error stays the one line it is meant to be."""
    return CONTROL_CHARACTERS.sub(lambda match: repr(match.group())[1:-1], text)


def describe_validation_error(
    err: ValidationError, sources: Mapping[str, str], schema: type[BaseModel], names: Mapping[str, str] | None = None
) -> str:
    """The first problem as one line: field path, what is wrong, what is allowed, where it came from.
    ``names``: keys to call by another name (a flag), e.g. ``{"launch.nnodes": "--nnodes"}``."""
    return one_line(_describe(err.errors()[0], sources, schema, names))


def _describe(
    first: Mapping[str, Any], sources: Mapping[str, str], schema: type[BaseModel], names: Mapping[str, str] | None
) -> str:
    path = _setting_path(first["loc"], sources)
    origin = sources.get(path)
    if origin in (None, "default"):  # a section, or a value given where a section goes: its leaves say
        origin = next((src for key, src in sources.items() if key.startswith(path + ".") and src != "default"), origin)
    suffix = f" (from {origin})" if origin and origin != "default" else ""
    message = str(first["msg"]).removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        section = ".".join(str(part) for part in first["loc"][:-1])  # a key of a file may hold a dot
        known = _known_keys(schema, first["loc"][:-1])
        where = f"in '{section}'" if section else "at the top level"
        return f"unknown setting '{path}'{suffix}; known settings {where}: {', '.join(known)}"
    if not path or (first["type"] == "value_error" and path not in sources):
        # A rule across settings (of the tree, or of one section): its message names them itself.
        for key in sorted(names or {}, key=len, reverse=True):
            message = message.replace(key, names[key])
        return message
    value = first.get("input")
    if names and path in names:
        return f"{names[path]} {_as_rule(first, message)}, got {value!r}"
    return f"invalid value {value!r} for '{path}'{suffix}: {message}"


def _setting_path(loc: tuple, sources: Mapping[str, str]) -> str:
    """The dotted setting of an error's location, without what pydantic adds below it (the union
    member tried, a list index)."""
    parts = [str(p) for p in loc]
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in sources:
            return ".".join(parts[:end])
    return ".".join(parts)


def _as_rule(error: Mapping[str, Any], message: str) -> str:
    """A pydantic error as what a flag's value must be: 'must be at least 1', 'must be 0 or more'."""
    bound = error.get("ctx", {})
    whole = isinstance(error.get("input"), int)
    if error["type"] == "greater_than" and whole:
        return f"must be at least {bound['gt'] + 1}"
    if error["type"] == "greater_than_equal":
        return "must be 0 or more" if bound["ge"] == 0 else f"must be at least {bound['ge']}"
    if error["type"] == "less_than" and whole:
        return f"must be at most {bound['lt'] - 1}"
    if error["type"] == "less_than_equal":
        return f"must be at most {bound['le']}"
    return message.replace("Input should be", "must be")


def _known_keys(schema: type[BaseModel], section: tuple) -> list[str]:
    model: Any = schema
    for part in section:
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
        _merge(tree, read_file(file), f"file {file}", sources, schema)
    if sections:
        _merge(tree, _code_sections(sections), "code", sources, schema)
    lines = list(overrides) + list(context.overrides if context else ())
    if lines:
        _merge(tree, _nest(dict(parse_override(line, schema) for line in lines)), "--set", sources, schema)

    return _validated(schema, tree, sources, context)


def override(config: T, sections: Mapping[str, Any], context: LaunchContext | None = None) -> T:
    """A copy of ``config`` with keyword-argument sections from code merged on top, and the
    launcher's ``--set`` lines (from ``context``) on top of those."""
    sources = dict(config.sources) or _set_in_code(config)
    tree = config.model_dump()
    if sections:
        _merge(tree, _code_sections(sections), "code", sources, type(config))
    if context and context.overrides:
        lines = context.overrides
        _merge(tree, _nest(dict(parse_override(line, type(config)) for line in lines)), "--set", sources, type(config))
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
