"""Structured JSON logs, one event per line, built per process and passed down (no global setup)."""

from __future__ import annotations

import logging
from typing import TextIO

import structlog

Logger = structlog.typing.FilteringBoundLogger
"""What every component logs through: built by ``make_logger`` and passed down."""


def make_logger(stream: TextIO, level: str = "info") -> Logger:
    """Each event one ``write`` of its whole line: ``print`` writes the line and its newline
    apart, and a process that ended between the two (its last ``error:`` line on stderr, the
    JVM's output relayed on a daemon thread) left a JSON line glued to the next one."""
    logger: Logger = structlog.wrap_logger(
        structlog.WriteLogger(file=stream),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(sort_keys=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        cache_logger_on_first_use=True,
    )
    return logger


def null_logger() -> Logger:
    """Drops every event: the default for components built without a logger (tests, tools)."""
    logger: Logger = structlog.wrap_logger(
        structlog.ReturnLogger(),
        wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL),
    )
    return logger
