"""Errors a command reports to its user: one ``error:`` line and the command's exit code."""

from __future__ import annotations

EXIT_RUNTIME_ERROR = 1
EXIT_BAD_INPUT = 2


class ReportedError(Exception):
    """A failure while running (a permanent error, retries exhausted, a fenced writer): what
    had landed stays as it was."""

    exit_code = EXIT_RUNTIME_ERROR


class BadInput(ReportedError):
    """Input that can never be valid (a flag, a configuration value, a refused request or
    schema change), found before anything was written."""

    exit_code = EXIT_BAD_INPUT
