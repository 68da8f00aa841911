"""The scaffold both command lines share: a parser whose mistakes are errors, and one place
that turns an error into its ``error:`` line and exit code."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn, TextIO

from runtime.errors import BadInput, ReportedError


class UsageError(BadInput):
    """A command line that cannot be valid."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def one_line(error: object) -> str:
    """An error's text on one line; a Google API error's own message, without its code."""
    text = getattr(error, "message", None) or str(error)
    return " ".join(str(text).split())


def run_command(
    command: Callable[[], int],
    err: TextIO,
    translate: Callable[[Exception], ReportedError | None] = lambda _: None,
) -> int:
    """The command's exit code; a ``ReportedError`` (or what ``translate`` makes of a library's
    error) becomes one ``error:`` line and its exit code. Anything else is a bug and raises."""
    try:
        return command()
    except ReportedError as error:
        return _report(error, err)
    except Exception as error:
        reported = translate(error)
        if reported is None:
            raise
        return _report(reported, err)


def _report(error: ReportedError, err: TextIO) -> int:
    print(f"error: {one_line(error)}", file=err)
    return error.exit_code
