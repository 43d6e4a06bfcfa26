"""Every CLI error is one line: ``jetrl: error: <what>``, exit code 2; the traceback only with ``--debug``.

What counts as a user's mistake, not a bug: a config that does not load (``ConfigError``: an unknown key
with its "did you mean", a wrong type, a missing or broken config file), what ``jetrl/preflight.py``
finds, a run directory without a run, a file that is not there. Anything else is a bug and keeps its
traceback."""

from __future__ import annotations

import sys
import tomllib
from collections.abc import Callable

from shared.config import ConfigError


class CliError(Exception):
    """A mistake the user can fix, said in one line (several lines: several mistakes, one each)."""


USER_ERRORS = (CliError, ConfigError, FileNotFoundError, NotADirectoryError, PermissionError,
               tomllib.TOMLDecodeError)


def run_cli(main: Callable[[list[str]], int], argv: list[str]) -> int:
    """``main(argv)`` with ``--debug`` taken out: a user's error becomes ``jetrl: error: ...`` lines."""
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    try:
        return main(argv)
    except USER_ERRORS as exc:
        if debug:
            raise
        for line in (message(exc).splitlines() or [type(exc).__name__]):
            print(f"jetrl: error: {line}", file=sys.stderr, flush=True)
        return 2


def message(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.strerror or exc}: {exc.filename}"
    return str(exc)
