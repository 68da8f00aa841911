"""Commit timestamps as integer nanoseconds since the Unix epoch.

Spanner timestamps carry nanoseconds; Python datetimes stop at microseconds. Integers keep every
digit, order correctly and make watermark arithmetic (``t - 1``) exact.
"""

from __future__ import annotations

import datetime as dt
import re

from google.api_core.datetime_helpers import DatetimeWithNanoseconds

Nanos = int
NANOS_PER_SECOND = 1_000_000_000
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_RFC3339 = re.compile(
    r"^(\d{1,4})-(\d{2})-(\d{2})[Tt ](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
    r"(Z|z|[+-]\d{2}:?\d{2}|[+-]\d{2})$"
)


def from_datetime(value: dt.datetime) -> Nanos:
    """Exact nanoseconds of a datetime (``DatetimeWithNanoseconds`` keeps its extra digits)."""
    if value.tzinfo is None:
        raise ValueError(f"timestamp without a time zone: {value!r}")
    whole = value.replace(microsecond=0)
    seconds = (whole - _EPOCH) // dt.timedelta(seconds=1)
    nanos = getattr(value, "nanosecond", 0) or value.microsecond * 1000
    return seconds * NANOS_PER_SECOND + nanos


def parse_rfc3339(text: str) -> Nanos:
    """Parse RFC 3339 text with up to nine fractional digits and any UTC offset.

    The year may have fewer than four digits: the emulator sends year 1 as ``1-01-01T...``.
    """
    match = _RFC3339.match(text.strip())
    if match is None:
        raise ValueError(f"not an RFC 3339 timestamp: {text!r}")
    year, month, day, hour, minute, second, fraction, zone = match.groups()
    base = dt.datetime(
        int(year), int(month), int(day), int(hour), int(minute), int(second), tzinfo=dt.UTC
    )
    seconds = (base - _EPOCH) // dt.timedelta(seconds=1)
    if zone not in ("Z", "z"):
        sign = -1 if zone[0] == "-" else 1
        digits = zone[1:].replace(":", "")
        offset = int(digits[:2]) * 3600 + int(digits[2:4] or 0) * 60
        seconds -= sign * offset
    nanos = int((fraction or "").ljust(9, "0"))
    return seconds * NANOS_PER_SECOND + nanos


def to_rfc3339(value: Nanos) -> str:
    """UTC RFC 3339 text with all nine fractional digits: lossless and sortable as text."""
    seconds, nanos = divmod(value, NANOS_PER_SECOND)
    base = _EPOCH + dt.timedelta(seconds=seconds)
    return f"{base.year:04d}-{base:%m-%dT%H:%M:%S}.{nanos:09d}Z"  # %Y writes year 1 as "1"


def to_datetime(value: Nanos) -> DatetimeWithNanoseconds:
    """A datetime the Spanner client binds as a TIMESTAMP parameter with full nanoseconds."""
    seconds, nanos = divmod(value, NANOS_PER_SECOND)
    base = _EPOCH + dt.timedelta(seconds=seconds)
    return DatetimeWithNanoseconds(  # type: ignore[no-untyped-call]
        base.year,
        base.month,
        base.day,
        base.hour,
        base.minute,
        base.second,
        nanosecond=nanos,
        tzinfo=dt.UTC,
    )


def coerce(value: object) -> Nanos:
    """A timestamp as a dialect delivers it: datetime (GoogleSQL) or RFC 3339 text (PostgreSQL)."""
    if isinstance(value, dt.datetime):
        return from_datetime(value)
    if isinstance(value, str):
        return parse_rfc3339(value)
    raise ValueError(f"not a timestamp: {value!r}")
