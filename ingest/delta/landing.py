"""What both runtimes do around each landing: the commit through the job's sink, the watched
columns read before it (``WatchedColumnsPoll``) and remembered after it, the ``delta_commit``
event and the page alert near the stream's retention. The service's flush policy
(``ingest.delta.batcher``) and the Spark source's batches (``ingest.sparksource.landing``) decide
only when and what to land."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ingest.delta.sink import CommitResult, DeltaChangeLogSink
from ingest.model.encoding import canonical_json as json_text
from ingest.model.records import WatchedColumns
from ingest.model.timestamps import NANOS_PER_SECOND, Nanos, to_rfc3339
from runtime.logs import Logger

STALE_READ_LIMIT_NANOS = 55 * 60 * NANOS_PER_SECOND
"""Spanner keeps old versions one hour by default: older watermarks are not read for schema."""


@dataclass
class WatchedColumnsPoll:
    """Which tables' watched columns differ from those this process landed, read at most once
    an interval at the low watermark being committed: the service's batcher and the Spark
    source's landing ask it before a commit and tell it what landed."""

    read: Callable[[Nanos], WatchedColumns] | None
    interval_s: float
    log: Logger
    wall_clock: Callable[[], Nanos] = time.time_ns
    landed_columns: WatchedColumns = field(default_factory=dict)
    known_columns: WatchedColumns = field(default_factory=dict)
    """What the change log held before this process (``landed_watched_columns``)."""
    read_defaults: Callable[[Nanos], set[tuple[str, str]]] | None = None
    """(table, column) of the columns with a DEFAULT at a timestamp."""
    read_at: float | None = None

    def changes(self, low_watermark: Nanos, now: float) -> WatchedColumns:
        """Tables whose watched columns at ``low_watermark`` differ from those landed; nothing
        before the interval passed, past Spanner's stale-read limit, or when the read fails."""
        due = self.read_at is None or now - self.read_at >= self.interval_s
        if self.read is None or not due:
            return {}
        self.read_at = now
        if self.wall_clock() - low_watermark > STALE_READ_LIMIT_NANOS:
            return {}
        try:
            watched = self.read(low_watermark)
        except Exception as error:  # any failure: read again next interval
            self.log.warning("watched_columns_unread", cause=_first_line(error))
            return {}
        return {t: c for t, c in watched.items() if self.landed_columns.get(t) != c}

    def landed(self, watched: WatchedColumns) -> None:
        self.landed_columns.update(watched)

    def gained_columns(self, watched: WatchedColumns, low_watermark: Nanos) -> tuple[str, ...]:
        """Tables of ``watched`` landed before that now have a column with a DEFAULT they
        lacked (a new name or type, or a column placed after the last one: dropped and added
        again). Spanner fills such a column's rows without a change record, so the table must
        be read again; a column without one is NULL in every row, which the schema rows show."""
        added: dict[str, set[str]] = {}
        for table, columns in sorted(watched.items()):
            before = self.landed_columns.get(table) or self.known_columns.get(table)
            if not before:
                continue
            known = {(c.name, json_text(c.type)) for c in before}
            last = max(c.ordinal_position for c in before)
            names = {
                c.name
                for c in columns
                if (c.name, json_text(c.type)) not in known or c.ordinal_position > last
            }
            if names:
                added[table] = names
        if not added:
            return ()
        defaulted = self._defaults(low_watermark)
        return tuple(
            table
            for table, names in added.items()
            if defaulted is None or any((table, name) in defaulted for name in names)
        )

    def _defaults(self, low_watermark: Nanos) -> set[tuple[str, str]] | None:
        """The columns with a DEFAULT; None (read every table again) when unknown."""
        if self.read_defaults is None:
            return None
        try:
            return self.read_defaults(low_watermark)
        except Exception as error:  # any failure: reading the table again is always right
            self.log.warning("column_defaults_unread", cause=_first_line(error))
            return None


@dataclass
class ChangeLogLanding:
    """Where a runtime lands (the job's sink) and what follows each landing in both runtimes.
    ``retention_nanos``: the stream's, for the alert when the change log trails by half of
    it (None: no alert)."""

    sink: DeltaChangeLogSink
    watched: WatchedColumnsPoll
    log: Logger
    retention_nanos: Nanos | None = None
    wall_clock: Callable[[], Nanos] = time.time_ns

    def landed(
        self,
        result: CommitResult,
        watched: WatchedColumns,
        low_watermark: Nanos,
        snapshot_rows: int = 0,
    ) -> None:
        """A commit landed: its watched columns remembered, its event logged, the alert
        raised when the change log trails too far."""
        self.watched.landed(watched)
        lag_nanos = self.wall_clock() - low_watermark
        _report_commit(self.log, result, watched, low_watermark, lag_nanos, snapshot_rows)
        if self.retention_nanos is not None:
            _warn_near_retention(self.log, lag_nanos, self.retention_nanos)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def _report_commit(
    log: Logger,
    result: CommitResult,
    watched: WatchedColumns,
    low_watermark: Nanos,
    lag_nanos: Nanos,
    snapshot_rows: int = 0,
) -> None:
    """A commit's ``delta_commit`` event, the same from both runtimes: what watches the
    service's commits watches the Spark source's."""
    log.info(
        "delta_commit",
        version=result.version,
        delta_version=result.delta_version,
        transactions=result.transactions,
        rows=result.rows,
        snapshot_rows=snapshot_rows,
        schema_rows=sorted(watched),
        low_watermark=to_rfc3339(low_watermark),
        watermark_lag_seconds=round(lag_nanos / NANOS_PER_SECOND, 3),
        replayed=result.replayed,
    )


def _warn_near_retention(log: Logger, lag_nanos: Nanos, retention_nanos: Nanos) -> None:
    """The page alert of both runtimes: the change log trails Spanner by more than half the
    stream's retention, and data past the retention is lost."""
    if lag_nanos > retention_nanos // 2:
        log.warning(
            "watermark_lag_near_retention",
            watermark_lag_seconds=round(lag_nanos / NANOS_PER_SECOND, 3),
            retention_seconds=retention_nanos // NANOS_PER_SECOND,
        )
