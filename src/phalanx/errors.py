"""Errors that are the user's to fix: the CLI prints them as one line, without a traceback."""


class PhalanxError(Exception):
    """A problem with the user's input (config, flags, files) that names the fix.

    Raised anywhere in phalanx; the CLI and the worker bootstrap print ``str(err)`` alone and exit
    with :attr:`exit_code`.
    """

    exit_code = 2


class ConfigError(PhalanxError):
    """An invalid or contradictory configuration value."""
