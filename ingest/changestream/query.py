"""The change stream DAO: the TVF statement, the single-use strong read, stream metadata.

Only the exact query shape the change stream TVF accepts is issued, with every value bound as a
parameter; the stream name is the one identifier interpolated, so it is validated first.
"""

from __future__ import annotations

import enum
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from google.api_core import exceptions as api_exceptions
from google.cloud.spanner_v1 import param_types
from google.cloud.spanner_v1.database import Database

from ingest.changestream import mapper, proto_mapper, raw_mapper
from ingest.model.records import ChangeRecord
from ingest.model.timestamps import (
    NANOS_PER_SECOND,
    Nanos,
    parse_rfc3339,
    to_datetime,
    to_rfc3339,
)
from runtime.errors import BadInput

MIN_HEARTBEAT_MS = 1_000
MAX_HEARTBEAT_MS = 300_000
"""Spanner's range for ``heartbeat_milliseconds`` (seed 003): one second to five minutes. The
emulator takes lower values; Cloud Spanner refuses them, so a job configured below would fail at
every start."""
DEFAULT_RETENTION_NANOS = 24 * 3600 * NANOS_PER_SECOND
_STREAM_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,127}$")
_RETENTION = re.compile(r"^(\d+)([smhd])$")
_RETENTION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_TOO_FAR_IN_THE_PAST = "too far in the past"
_EARLIEST = re.compile(r"earliest read timestamp: (\S+?)\.? ")
_PARTITION_LIFETIME = re.compile(
    r"start_timestamp is invalid for the partition\. Please specify a start_timestamp within "
    r"(\S+) and (\S+?)\. Received start_timestamp: (\S+?)\.?,? "
)


class Dialect(enum.Enum):
    GOOGLE_STANDARD_SQL = "googlesql"
    POSTGRESQL = "postgresql"


class ChangeStreamRequestError(BadInput, ValueError):
    """A read request Spanner would refuse; the message is meant for the operator as is."""


@dataclass(frozen=True, slots=True)
class ChangeStreamInfo:
    name: str
    retention_nanos: Nanos
    mutable_key_range: bool = False
    """Created with ``partition_mode = 'MUTABLE_KEY_RANGE'``: rows are PROTO records."""


def validate_stream_name(stream: str) -> str:
    if not _STREAM_NAME.match(stream):
        raise ChangeStreamRequestError(
            f"change stream name {stream!r} is not a valid identifier (letters, digits, _)"
        )
    return stream


def validate_heartbeat(heartbeat_ms: int) -> int:
    if not MIN_HEARTBEAT_MS <= heartbeat_ms <= MAX_HEARTBEAT_MS:
        raise ChangeStreamRequestError(
            f"heartbeat must be between {MIN_HEARTBEAT_MS} and {MAX_HEARTBEAT_MS} ms, "
            f"got {heartbeat_ms}"
        )
    return heartbeat_ms


MAX_QUERY_WINDOW_S = 1800.0
"""Spanner's limit for MUTABLE_KEY_RANGE queries: end at most 30 minutes after max(now, start)."""


def validate_query_window(window_s: float, heartbeat_ms: int) -> float:
    """A window must hold heartbeats: one closing with no record counts as a failed query."""
    low = max(1.0, 2 * heartbeat_ms / 1000)
    if not low <= window_s <= MAX_QUERY_WINDOW_S:
        raise ChangeStreamRequestError(
            f"query window must be between {low:g} s (at least 1 s and two heartbeats) and "
            f"{MAX_QUERY_WINDOW_S:g} s, got {window_s:g}"
        )
    return window_s


def validate_start(start: Nanos, now: Nanos, info: ChangeStreamInfo) -> Nanos:
    if start > now:
        raise ChangeStreamRequestError(
            f"start timestamp {to_rfc3339(start)} is in the future (now {to_rfc3339(now)})"
        )
    earliest = now - info.retention_nanos
    if start < earliest:
        raise ChangeStreamRequestError(
            f"start timestamp {to_rfc3339(start)} is outside the retention period of change "
            f"stream {info.name} (earliest readable {to_rfc3339(earliest)})"
        )
    return start


def parse_retention(text: str) -> Nanos:
    match = _RETENTION.match(text.strip())
    if match is None:
        raise ValueError(f"unrecognised retention period {text!r}")
    return int(match.group(1)) * _RETENTION_UNITS[match.group(2)] * NANOS_PER_SECOND


def detect_dialect(database: Database) -> Dialect:
    """The database's dialect from its information schema: needs read access only, no admin API."""
    sql = (
        "SELECT option_value FROM information_schema.database_options "
        "WHERE option_name = 'database_dialect'"
    )
    with database.snapshot() as snapshot:
        rows = list(snapshot.execute_sql(sql))
    value = rows[0][0] if rows else "GOOGLE_STANDARD_SQL"
    return Dialect.POSTGRESQL if value == "POSTGRESQL" else Dialect.GOOGLE_STANDARD_SQL


DEFAULT_VERSION_RETENTION_NANOS = 3600 * NANOS_PER_SECOND


def version_retention(database: Database) -> Nanos:
    """How far back the database serves stale reads (``version_retention_period``, 1 hour unless
    set): the limit of a snapshot's read timestamp."""
    sql = (
        "SELECT option_value FROM information_schema.database_options "
        "WHERE option_name = 'version_retention_period'"
    )
    with database.snapshot() as snapshot:
        rows = list(snapshot.execute_sql(sql))
    return parse_retention(rows[0][0]) if rows and rows[0][0] else DEFAULT_VERSION_RETENTION_NANOS


def describe_stream(database: Database, stream: str) -> ChangeStreamInfo:
    """Look the stream up; an unknown stream is a ``ChangeStreamRequestError``."""
    validate_stream_name(stream)
    sql = (
        "SELECT s.change_stream_name, o.option_name, o.option_value "
        "FROM information_schema.change_streams s "
        "LEFT JOIN information_schema.change_stream_options o "
        "ON o.change_stream_name = s.change_stream_name"
    )
    with database.snapshot() as snapshot:
        rows = list(snapshot.execute_sql(sql))
    return stream_info(stream, database.database_id, rows)


def stream_info(
    stream: str, database_id: str, rows: list[tuple[str, str | None, str | None]]
) -> ChangeStreamInfo:
    """The stream's retention and partition mode from its ``information_schema`` options; an
    unknown stream, or an unknown partition mode, is a ``ChangeStreamRequestError``."""
    options: dict[str, dict[str, str]] = {}
    for name, option, value in rows:
        known = options.setdefault(name, {})
        if option is not None and value is not None:
            known[option.lower()] = value
    if stream not in options:
        known_streams = ", ".join(sorted(options)) or "none"
        raise ChangeStreamRequestError(
            f"change stream {stream!r} does not exist in database {database_id} "
            f"(streams: {known_streams})"
        )
    mode = options[stream].get("partition_mode", "IMMUTABLE_KEY_RANGE").upper()
    if mode not in ("IMMUTABLE_KEY_RANGE", "MUTABLE_KEY_RANGE"):
        raise ChangeStreamRequestError(
            f"change stream {stream!r} uses partition_mode {mode}, which this version does not "
            "read (IMMUTABLE_KEY_RANGE and MUTABLE_KEY_RANGE are)"
        )
    retention = options[stream].get("retention_period")
    return ChangeStreamInfo(
        stream,
        parse_retention(retention) if retention else DEFAULT_RETENTION_NANOS,
        mode == "MUTABLE_KEY_RANGE",
    )


def statement(
    stream: str,
    dialect: Dialect,
    partition_token: str | None,
    start: Nanos,
    end: Nanos | None,
    heartbeat_ms: int,
    mutable_key_range: bool = False,
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """SQL text, parameters and parameter types of one change stream query. GoogleSQL reads
    both partition modes with one statement (the column's type tells them apart); PostgreSQL
    reads ``MUTABLE_KEY_RANGE`` streams through ``read_proto_bytes_<stream>``."""
    validate_stream_name(stream)
    values = [
        to_datetime(start),
        None if end is None else to_datetime(end),
        partition_token,
        heartbeat_ms,
    ]
    types = [param_types.TIMESTAMP, param_types.TIMESTAMP, param_types.STRING, param_types.INT64]
    if dialect is Dialect.POSTGRESQL:
        function = "read_proto_bytes" if mutable_key_range else "read_json"
        sql = f"SELECT * FROM spanner.{function}_{stream}($1, $2, $3, $4, null)"
        names = ["p1", "p2", "p3", "p4"]
    else:
        sql = (
            f"SELECT ChangeRecord FROM READ_{stream}(start_timestamp => @start_timestamp, "
            "end_timestamp => @end_timestamp, partition_token => @partition_token, "
            "heartbeat_milliseconds => @heartbeat_milliseconds)"
        )
        names = ["start_timestamp", "end_timestamp", "partition_token", "heartbeat_milliseconds"]
    return sql, dict(zip(names, values, strict=True)), dict(zip(names, types, strict=True))


def partition_ended_before(message: str, start: Nanos) -> Nanos | None:
    """The end of a partition's lifetime when Spanner refused ``start`` for being after it."""
    found = _PARTITION_LIFETIME.search(message + " ")
    if found is None:
        return None
    ended = parse_rfc3339(found.group(2))
    return ended if start > ended else None


def row_mapper(
    dialect: Dialect, fields: Any, mutable_key_range: bool
) -> Callable[[list[Any]], list[ChangeRecord]]:
    """The mapper of raw (``lazy_decode``) rows of the dialect's change stream query."""
    if dialect is Dialect.POSTGRESQL:
        if mutable_key_range:
            return proto_mapper.proto_row_mapper(fields)
        return mapper.postgresql_raw_row_mapper(fields)
    if fields and proto_mapper.is_change_stream_record(fields[0].type_):
        return proto_mapper.proto_row_mapper(fields)
    return raw_mapper.googlesql_raw_row_mapper(fields)


@dataclass(frozen=True, slots=True)
class ChangeStreamQuery:
    """Runs change stream queries for one stream of one database."""

    database: Database
    stream: str
    dialect: Dialect
    heartbeat_ms: int
    mutable_key_range: bool = False
    deadline_slack_s: float = 60.0
    """A query's gRPC deadline is its end plus this: a stream Spanner leaves hanging is
    cancelled and its thread ends, even after the watchdog has moved on. Time for a catching-up
    query's backlog and for pauses under backpressure; one that needs longer is retried from
    where it got to (``DeadlineExceeded`` is transient)."""
    wall_clock: Callable[[], Nanos] = time.time_ns

    def deadline_s(self, end: Nanos | None) -> float | None:
        if end is None:
            return None
        return max(0.0, (end - self.wall_clock()) / NANOS_PER_SECOND) + self.deadline_slack_s

    def check_readable_from(self, start: Nanos) -> None:
        """Refuse a start the stream cannot be read from (before the stream was created):
        Spanner says so only when a query runs, so one is run over the empty window at ``start``
        before anything is recorded, rather than the job failing once it reads."""
        try:
            for _ in self.read(None, start, start):
                pass
        except (api_exceptions.OutOfRange, api_exceptions.InvalidArgument) as error:
            if _TOO_FAR_IN_THE_PAST not in str(error):
                raise
            earliest = _EARLIEST.search(str(error))
            raise ChangeStreamRequestError(
                f"start timestamp {to_rfc3339(start)} is before change stream {self.stream} can "
                "be read (it did not exist yet)"
                + (f": earliest readable {earliest.group(1)}" if earliest else "")
            ) from None

    def read(
        self, partition_token: str | None, start: Nanos, end: Nanos | None
    ) -> Iterator[ChangeRecord]:
        """The partition's records from ``start``. A partition resumed just after it ended (the
        job stopped at a low watermark equal to the partition's end) is read again from its end,
        which returns its child partitions: the emulator refuses the later start with
        ``OutOfRange`` and the partition's lifetime. Records at or below the job's low watermark
        that this reads again are dropped downstream, as after any restart."""
        try:
            yield from self._read(partition_token, start, end)
        except api_exceptions.OutOfRange as error:
            ended = None if partition_token is None else partition_ended_before(str(error), start)
            if ended is None:
                raise
            yield from self._read(partition_token, ended, end)

    def _read(
        self, partition_token: str | None, start: Nanos, end: Nanos | None
    ) -> Iterator[ChangeRecord]:
        sql, params, types = statement(
            self.stream,
            self.dialect,
            partition_token,
            start,
            end,
            self.heartbeat_ms,
            self.mutable_key_range,
        )
        with self.database.snapshot() as snapshot:
            results = snapshot.execute_sql(
                sql,
                params=params,
                param_types=types,
                lazy_decode=True,
                timeout=self.deadline_s(end),
            )
            to_records = None
            for row in results:
                if to_records is None:
                    to_records = row_mapper(self.dialect, results.fields, self.mutable_key_range)
                yield from to_records(row)
