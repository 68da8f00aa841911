"""Which Spanner errors are transient, and the bounded backoff used to retry them."""

from __future__ import annotations

from dataclasses import dataclass

from google.api_core import exceptions as api_exceptions

_TRANSIENT = (
    api_exceptions.ServiceUnavailable,
    api_exceptions.Aborted,
    api_exceptions.DeadlineExceeded,
    api_exceptions.ResourceExhausted,
    api_exceptions.InternalServerError,
)


class StreamEndedEarly(RuntimeError):
    """A partition query closed without a child partitions record before its end timestamp."""


def is_transient(error: BaseException) -> bool:
    return isinstance(error, (*_TRANSIENT, StreamEndedEarly))


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with jitter; stops after ``max_failures`` failures without progress."""

    initial_backoff_s: float = 0.1
    max_backoff_s: float = 10.0
    max_failures: int = 8
