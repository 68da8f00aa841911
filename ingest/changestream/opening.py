"""The Spanner side of a job, opened in one place: the database, its dialect, the stream's
description and the query that reads it. The service, ``tail``, ``audit`` and the snapshot all
start here, so a new reader (the Spark source) opens the same way."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.cloud import spanner
from google.cloud.spanner_v1.database import Database

from ingest.changestream import query
from ingest.changestream.watched_columns import read_column_defaults, read_watched_columns
from ingest.model.records import WatchedColumns
from ingest.model.timestamps import Nanos


@dataclass(frozen=True, slots=True)
class StreamAddress:
    """Where a change stream is and how its partitions are queried."""

    project: str
    instance: str
    database: str
    stream: str
    dialect: str = "auto"
    """``auto`` reads it from the database's information schema."""
    heartbeat_ms: int = 1000


@dataclass(frozen=True, slots=True)
class OpenedStream:
    database: Database
    stream: str
    dialect: query.Dialect
    info: query.ChangeStreamInfo
    heartbeat_ms: int

    def query(self) -> query.ChangeStreamQuery:
        """A query of this stream's partitions (either partition mode, as the stream says)."""
        return query.ChangeStreamQuery(
            self.database, self.stream, self.dialect, self.heartbeat_ms, self.info.mutable_key_range
        )

    def version_retention(self) -> int:
        return query.version_retention(self.database)

    def watched_columns(self, read_timestamp: Nanos) -> WatchedColumns:
        """The stream's watched tables and columns as of exactly ``read_timestamp``."""
        return read_watched_columns(self.database, self.stream, self.dialect, read_timestamp)

    def column_defaults(self, read_timestamp: Nanos) -> set[tuple[str, str]]:
        """(table, column) of each column with a DEFAULT as of exactly ``read_timestamp``."""
        return read_column_defaults(self.database, read_timestamp)


def open_stream(
    address: StreamAddress, client: Callable[..., Any] = spanner.Client
) -> OpenedStream:
    """Validate the address, then look the database and the stream up: an unknown stream is a
    ``query.ChangeStreamRequestError`` before anything is read or written."""
    query.validate_stream_name(address.stream)
    query.validate_heartbeat(address.heartbeat_ms)
    database = client(project=address.project).instance(address.instance).database(address.database)
    dialect = (
        query.detect_dialect(database)
        if address.dialect == "auto"
        else query.Dialect(address.dialect)
    )
    info = query.describe_stream(database, address.stream)
    return OpenedStream(database, address.stream, dialect, info, address.heartbeat_ms)
