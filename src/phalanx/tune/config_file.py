"""Writes tune's winning values into the user's config file without losing anything else in it.

The file is edited line by line: a key that is there gets its new value on its own line (indentation
and trailing comment kept); a missing key is added at the end of its section; a missing section at
the end of the file. The edit is then checked by reading both versions back: every value tune set
must read as set, and every other value as before. A YAML file this editor cannot handle (flow
style, multi-line values) is rewritten from its parsed contents instead, which keeps every value
but drops the comments (said so in the result). The previous version is kept next to it as
``<name>.bak``, and the new text is validated as a phalanx config before it replaces the old one.

A value may replace another key (``batch.max_micro_batch_size`` replaces ``batch.micro_batch_size``,
which would otherwise still pin the micro batch): the old key's line is renamed in place, keeping
its comment, or removed when the new key is there already.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

from phalanx.config.loader import load_config, read_file, tomllib
from phalanx.config.schema import flatten
from phalanx.config.template import scalar
from phalanx.errors import ConfigError, PhalanxError
from phalanx.topology import LaunchContext

_TOP_COMMENT = "# phalanx tune wrote the values it chose below; see docs/tune.md\n"


@dataclass(frozen=True)
class Written:
    path: Path
    backup: Path | None  # None: the file did not exist
    comments_kept: bool
    removed: tuple[str, ...] = ()  # keys the file held that a written value replaced


def write_values(path: Path, values: Mapping[str, Any], replaces: Mapping[str, str] | None = None) -> Written:
    """Set dotted ``values`` (``{"batch.micro_batch_size": 8}``) in the YAML or TOML file ``path``,
    creating it when absent. ``replaces`` maps a key of ``values`` to the key it supersedes, which
    leaves the file."""
    toml = path.suffix == ".toml"
    existed = path.is_file()
    old_text = path.read_text(encoding="utf-8") if existed else ""
    old = read_file(path) if existed else {}
    flat_old = flatten(old)
    replaces = {new: gone for new, gone in (replaces or {}).items() if new in values and gone in flat_old}
    new_text = (edit_toml if toml else edit_yaml)(old_text, values, replaces)
    kept = _reads_as(new_text, old, values, toml, tuple(replaces.values()))
    if not kept:
        if toml:
            listing = ", ".join(f"{k}={_toml_value(v)}" for k, v in values.items())
            raise PhalanxError(
                f"could not edit {path} safely (phalanx writes TOML only line by line); set these by hand: {listing}"
            )
        tree = copy.deepcopy(old)
        for gone in replaces.values():
            _drop(tree, gone)
        for key, value in values.items():
            _set(tree, key, value)
        new_text = yaml.safe_dump(tree, sort_keys=False)
    if not existed:
        new_text = _TOP_COMMENT + new_text
    # Same suffix, so it is read as the same format; replaced into place only once it validates.
    staging = path.with_name(f".{path.stem}.tune-tmp{path.suffix or '.yaml'}")
    staging.write_text(new_text, encoding="utf-8")
    try:
        load_config(staging, context=LaunchContext())
    except ConfigError as err:
        staging.unlink(missing_ok=True)
        raise PhalanxError(f"the values tune chose do not make a valid config with the rest of {path}: {err}") from None
    backup = None
    if existed:
        backup = path.with_name(path.name + ".bak")
        shutil.copy2(path, backup)
    os.replace(staging, path)
    return Written(path, backup, comments_kept=kept or not existed, removed=tuple(replaces.values()))


# -- YAML -----------------------------------------------------------------------------------------
_YAML_KEY = re.compile(r"^(?P<indent>[ ]*)(?P<key>[A-Za-z_][\w-]*)[ ]*:(?P<rest>.*)$")


def edit_yaml(text: str, values: Mapping[str, Any], replaces: Mapping[str, str] | None = None) -> str:
    lines = text.splitlines()
    for new, gone in (replaces or {}).items():
        at = _yaml_find(lines, gone.split("."))
        if at is not None:
            if _yaml_find(lines, new.split(".")) is not None:
                del lines[at]
            else:  # the old key's line takes the new key's name; its value is set below
                key = gone.split(".")[-1]
                lines[at] = lines[at].replace(key, new.split(".")[-1], 1)
    for dotted, value in values.items():
        lines = _yaml_set(lines, dotted.split("."), scalar(value))
    return "\n".join(lines) + "\n"


def _yaml_set(lines: list[str], parts: list[str], rendered: str) -> list[str]:
    start, end, indent = 0, len(lines), -1  # the block we look in: lines[start:end], its keys deeper than indent
    for depth, part in enumerate(parts):
        leaf = depth == len(parts) - 1
        child_indent = _child_indent(lines, start, end, indent)
        found = None
        for i in range(start, end):
            match = _YAML_KEY.match(lines[i])
            if match and len(match.group("indent")) == child_indent and match.group("key") == part:
                found = i
                break
        if found is None:
            pad = " " * (child_indent if child_indent > indent else indent + 2)
            new = [f"{pad}{name}:" for name in parts[depth:-1]]
            new = [f"{' ' * (len(pad) + 2 * k)}{line.strip()}" for k, line in enumerate(new)]
            new.append(f"{' ' * (len(pad) + 2 * (len(parts) - 1 - depth))}{parts[-1]}: {rendered}")
            at = _block_end(lines, start, end)
            if depth == 0 and at > 0 and lines[at - 1].strip():
                new.insert(0, "")  # a new top-level section gets a blank line before it
            return lines[:at] + new + lines[at:]
        match = _YAML_KEY.match(lines[found])
        if leaf:
            lines[found] = _keep_comment(lines[found], f"{match.group('indent')}{part}: {rendered}")
            return lines
        indent = len(match.group("indent"))
        start = found + 1
        end = next(
            (i for i in range(start, end) if _indent_of(lines[i]) is not None and _indent_of(lines[i]) <= indent), end
        )
    return lines


def _yaml_find(lines: list[str], parts: list[str]) -> int | None:
    """The line of the dotted key ``parts`` (a leaf on its own line), or None."""
    start, end, indent = 0, len(lines), -1
    for depth, part in enumerate(parts):
        child_indent = _child_indent(lines, start, end, indent)
        found = next(
            (
                i
                for i in range(start, end)
                if (match := _YAML_KEY.match(lines[i]))
                and len(match.group("indent")) == child_indent
                and match.group("key") == part
            ),
            None,
        )
        if found is None or depth == len(parts) - 1:
            return found
        indent, start = child_indent, found + 1
        end = next(
            (i for i in range(start, end) if _indent_of(lines[i]) is not None and _indent_of(lines[i]) <= indent), end
        )
    return None


def _keep_comment(line: str, new: str) -> str:
    """``new`` followed by ``line``'s trailing comment, in the same column when there is room."""
    comment = re.search(r"\s+(#.*)$", line)
    if not comment:
        return new
    column = comment.start(1)
    return f"{new:<{column}}{comment.group(1)}" if len(new) < column else f"{new} {comment.group(1)}"


def _indent_of(line: str) -> int | None:
    """Indentation of a line that holds content (None for blank and comment-only lines)."""
    stripped = line.strip()
    if not stripped or stripped.startswith("#"):
        return None
    return len(line) - len(line.lstrip(" "))


def _child_indent(lines: list[str], start: int, end: int, parent: int) -> int:
    for i in range(start, end):
        indent = _indent_of(lines[i])
        if indent is not None and indent > parent:
            return indent
    return parent + 2 if parent >= 0 else 0


def _block_end(lines: list[str], start: int, end: int) -> int:
    """Just after the last content line of lines[start:end] (trailing blanks and comments stay below)."""
    last = start
    for i in range(start, end):
        if _indent_of(lines[i]) is not None:
            last = i + 1
    return last if last > start or start > 0 else end


# -- TOML -----------------------------------------------------------------------------------------
def edit_toml(text: str, values: Mapping[str, Any], replaces: Mapping[str, str] | None = None) -> str:
    lines = text.splitlines()
    for new, gone in (replaces or {}).items():
        at = _toml_find(lines, gone)
        if at is not None:
            if _toml_find(lines, new) is not None:
                del lines[at]
            else:
                lines[at] = lines[at].replace(gone.split(".")[-1], new.split(".")[-1], 1)
    for dotted, value in values.items():
        *sections, key = dotted.split(".")
        header = "[" + ".".join(sections) + "]"
        start = next((i + 1 for i, line in enumerate(lines) if line.split("#")[0].strip() == header), None)
        if start is None:
            lines += ([""] if lines and lines[-1].strip() else []) + [header, f"{key} = {_toml_value(value)}"]
            continue
        end = next((i for i in range(start, len(lines)) if lines[i].lstrip().startswith("[")), len(lines))
        at = next((i for i in range(start, end) if re.match(rf"^\s*{re.escape(key)}\s*=", lines[i])), None)
        if at is None:
            at = _block_end(lines, start, end) if end > start else start
            lines.insert(at, f"{key} = {_toml_value(value)}")
        else:
            lines[at] = _keep_comment(lines[at], f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_find(lines: list[str], dotted: str) -> int | None:
    *sections, key = dotted.split(".")
    header = "[" + ".".join(sections) + "]"
    start = next((i + 1 for i, line in enumerate(lines) if line.split("#")[0].strip() == header), None)
    if start is None:
        return None
    end = next((i for i in range(start, len(lines)) if lines[i].lstrip().startswith("[")), len(lines))
    return next((i for i in range(start, end) if re.match(rf"^\s*{re.escape(key)}\s*=", lines[i])), None)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))


# -- checks ---------------------------------------------------------------------------------------
def _reads_as(text: str, old: dict, values: Mapping[str, Any], toml: bool, removed: tuple[str, ...] = ()) -> bool:
    """``text`` holds every old value unchanged (but the ``removed`` keys) and every new one as set."""
    try:
        data = tomllib.loads(text) if toml else (yaml.safe_load(text) or {})
    except Exception:  # noqa: BLE001 - any parse failure means the edit went wrong
        return False
    if not isinstance(data, dict):
        return False
    expected = flatten(old)
    for key in removed:
        expected.pop(key, None)
    expected.update(values)
    return flatten(data) == expected


def _drop(tree: dict, dotted: str) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree.get(part) or {}
    tree.pop(leaf, None)


def _set(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value
