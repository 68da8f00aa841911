"""The snapshot's window: a new job's snapshot begun (refused when T0 is out of reach or it could
not finish within what Spanner keeps), what Spanner keeps at its T0 while it runs (refused once out
of reach), the deadline it must finish by, and the rows it is expected to read."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

from ingest.changestream import query
from ingest.changestream.opening import OpenedStream
from ingest.job.config import JobConfig
from ingest.model.records import WatchedColumns
from ingest.model.snapshot import SnapshotProgress
from ingest.model.timestamps import Nanos, to_rfc3339
from ingest.snapshot.reach import (
    Retention,
    SnapshotOutOfReach,
    check_fits_retention,
    check_reachable,
)
from ingest.snapshot.reader import count_rows
from runtime.logs import Logger


@dataclass(frozen=True, slots=True)
class SnapshotWindow:
    """What Spanner keeps for a snapshot at its T0, and the rows it is expected to read."""

    read_timestamp: Nanos
    version_retention: Nanos
    deadline: Nanos
    table_rows: dict[str, int] | None
    """Rows at T0 per table (landed rows for a table done); None when not counted."""

    @property
    def expected(self) -> int | None:
        return sum(self.table_rows.values()) if self.table_rows is not None else None

    @contextlib.contextmanager
    def out_of_reach_named(self) -> Iterator[None]:
        """A read that fails once T0 is out of reach says so (``SnapshotOutOfReach``)."""
        try:
            yield
        except Exception as error:
            try:
                check_reachable(self.read_timestamp, time.time_ns(), self.version_retention)
            except SnapshotOutOfReach as out_of_reach:
                raise out_of_reach from error
            raise


def begin_snapshot(
    opened: OpenedStream, config: JobConfig, read_at: Nanos, now: Nanos, log: Logger
) -> tuple[SnapshotProgress, WatchedColumns, dict[str, int] | None]:
    """A new job's snapshot at T0 ``read_at``, with the tables the stream watches then and their
    rows (when counted); refused at once if T0 is out of reach or the snapshot could not finish
    within what Spanner keeps."""
    retention = retention_of(opened)
    check_reachable(read_at, now, retention.version_retention)
    watched = opened.watched_columns(read_at)
    snapshot = SnapshotProgress.begin(read_at, list(watched))
    rows = table_rows(opened, config, snapshot)
    if rows is not None:
        expected = sum(rows.values())
        end = check_fits_retention(read_at, expected, config.snapshot_rows_per_s, retention)
        log.info("snapshot_estimated", rows=expected, expected_end=to_rfc3339(end))
    return snapshot, watched, rows


def open_snapshot(
    opened: OpenedStream,
    config: JobConfig,
    progress: SnapshotProgress,
    rows: dict[str, int] | None,
    log: Logger,
    **fields: object,
) -> SnapshotWindow:
    """Refused once T0 is out of reach; the deadline, the rows per table (counted here for a
    resumed job), and the ``snapshot_started`` event with ``fields``."""
    read_at = progress.read_timestamp
    retention = retention_of(opened)
    check_reachable(read_at, time.time_ns(), retention.version_retention)
    deadline = read_at + retention.limit
    if rows is None:
        rows = table_rows(opened, config, progress)
    window = SnapshotWindow(read_at, retention.version_retention, deadline, rows)
    log.info(
        "snapshot_started",
        read_timestamp=to_rfc3339(read_at),
        deadline=to_rfc3339(deadline),
        tables=len(progress.tables),
        tables_done=sum(t.done for t in progress.tables),
        rows=progress.rows,
        expected_rows=window.expected,
        **fields,
    )
    return window


def retention_of(opened: OpenedStream) -> Retention:
    return Retention(opened.version_retention(), opened.info.retention_nanos)


def table_rows(
    opened: OpenedStream, config: JobConfig, progress: SnapshotProgress
) -> dict[str, int] | None:
    """Rows at T0 of each table with something left to read, the landed rows of each done one
    (so the projection compares like with like); None when the estimate is off."""
    if not config.snapshot_rows_per_s:
        return None
    postgresql = opened.dialect is query.Dialect.POSTGRESQL
    return {
        t.table: count_rows(opened.database, t.table, progress.read_timestamp, postgresql)
        if not t.done
        else t.rows
        for t in progress.tables
    }
