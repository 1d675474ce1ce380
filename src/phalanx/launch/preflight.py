"""What ``phalanx launch`` checks on disk before any worker starts: that the script compiles, that
the run directory and the checkpoint directory can be written, and that a checkpoint the run would
resume belongs to it. Each problem is one line naming the path and the fix, where otherwise every
rank would print its own traceback.

The checks leave nothing behind: a directory they had to create is removed again, so a launch
refused later still leaves no trace."""

from __future__ import annotations

import os
import uuid
import warnings
from pathlib import Path

from phalanx.checkpoint import run_identity
from phalanx.config.schema import Config
from phalanx.config.sources import one_line
from phalanx.errors import PhalanxError


def check_script(script: str) -> None:
    """The script exists and compiles, as its workers will compile it (bytes, so that an encoding
    cookie is honoured)."""
    if not os.path.isfile(script):
        raise _refused(f"script '{script}' not found; give the path of a Python file to run")
    try:
        source = Path(script).read_bytes()
    except OSError as err:
        raise _refused(f"cannot read script '{script}': {err.strerror or err}") from None
    try:
        with warnings.catch_warnings():  # the workers show the script's own warnings, once
            warnings.simplefilter("ignore")
            compile(source, script, "exec", dont_inherit=True)
    except SyntaxError as err:
        where = ":".join(str(part) for part in (script, err.lineno, err.offset) if part)
        raise _refused(f"{where}: {type(err).__name__}: {err.msg}; fix the script (nothing was started)") from None
    except (ValueError, RecursionError, MemoryError) as err:  # NUL bytes; nesting past the compiler's limits
        raise _refused(f"{script}: cannot be compiled: {err or type(err).__name__}") from None


def check_writable(setting: str, path: str, fix: str) -> Path:
    """Directory ``path`` (the value of ``setting``) can be created and written; ``fix`` says how to
    choose another. Returns it absolute."""
    # Two launches started at once in one directory check the same path: one may create a parent
    # the other is about to create, or remove its own just after the other found it. That is a
    # lost race, not an unwritable path: it is checked again.
    for _ in range(_RACES):
        try:
            return _check_writable(setting, path, fix)
        except _Raced:
            continue
    return _check_writable(setting, path, fix, last=True)


_RACES = 5


class _Raced(Exception):
    """Another process created or removed a directory of the path while it was checked."""


def _check_writable(setting: str, path: str, fix: str, last: bool = False) -> Path:
    try:
        directory = Path(path).resolve()
        existing, missing = directory, []
        while not existing.exists() and existing != existing.parent:
            missing.append(existing)
            existing = existing.parent
    except (OSError, RuntimeError) as err:  # a symlink loop (RuntimeError before Python 3.13), EACCES
        raise _refused(f"{setting} '{path}' cannot be used: {getattr(err, 'strerror', None) or err}; {fix}") from None
    if not existing.is_dir():
        raise _refused(f"{setting} '{directory}' cannot be created: '{existing}' is a file, not a directory; {fix}")
    created: list[Path] = []
    try:
        for parent in reversed(missing):
            parent.mkdir()
            created.append(parent)
        probe = directory / f".phalanx-probe-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"")
        probe.unlink()
    except (FileExistsError, FileNotFoundError) as err:
        if not last:
            raise _Raced() from err
        raise _refused(f"{setting} '{directory}' is not writable: {err.strerror or err}; {fix}") from None
    except OSError as err:
        raise _refused(f"{setting} '{directory}' is not writable: {err.strerror or err}; {fix}") from None
    finally:
        for parent in reversed(created):
            try:
                parent.rmdir()
            except OSError:  # something else wrote into it meanwhile: it is not ours to remove
                break
    return directory


def check_output_dirs(run_dir: str, checkpoint_dir: str) -> Path:
    """``launch.run_dir`` and ``checkpoint.dir``, both as the workers resolve them: relative to the
    working directory they share with the launcher. Returns the run directories' parent, absolute."""
    check_writable(
        "checkpoint.dir",
        checkpoint_dir,
        "set checkpoint.dir (e.g. --set checkpoint.dir=DIR) to a directory you can write",
    )
    return check_writable("launch.run_dir", run_dir, "pass --run-dir DIR naming a directory you can write")


def check_checkpoint_owner(config: Config, run: dict) -> None:
    """Under ``checkpoint.resume: auto`` (without ``resume_any_run``), a latest checkpoint in
    ``checkpoint.dir`` (relative to the working directory the workers share) that the workers would
    refuse for certain as another run's (``run``, see checkpoint/run_identity.py): one line and exit
    2. What depends on the script's own settings is left to the workers."""
    try:
        run_identity.check_launch(Path(config.checkpoint.dir), config, run)
    except PhalanxError as err:
        raise _refused(str(err)) from None


def _refused(message: str) -> PhalanxError:
    return PhalanxError(one_line(message))  # a path may hold a line break
