"""The flush policy between the reader and the sink: when released transactions, checkpoints and
schema rows are committed."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ingest.delta.sink import CommitResult, DeltaChangeLogSink
from ingest.model.encoding import canonical_json as json_text
from ingest.model.records import Transaction, WatchedColumns
from ingest.model.resume import Release, ResumePoint
from ingest.model.snapshot import SnapshotChunk
from ingest.model.timestamps import NANOS_PER_SECOND, Nanos, to_rfc3339
from runtime.logs import Logger

STALE_READ_LIMIT_NANOS = 55 * 60 * NANOS_PER_SECOND
"""Spanner keeps old versions one hour by default: older watermarks are not read for schema."""


class Riders(Protocol):
    """Work that rides on the stream's commits (an on-demand table snapshot)."""

    def due(self) -> bool: ...

    def backfill(self, tables: Sequence[str]) -> bool: ...

    def recorded(self) -> tuple[str, ...]: ...

    def before_commit(
        self, low_watermark: Nanos, transactions: Sequence[Transaction]
    ) -> tuple[list[SnapshotChunk], bool]: ...

    def after_commit(self) -> None: ...


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
class Batcher:
    """Flush policy: commit released transactions within ``flush_latency`` or ``max_rows``;
    with nothing to land, still commit the checkpoint every ``checkpoint_interval`` so a restart
    never re-reads more than that much of the stream (and the writer lease stays fresh).

    Once ``watched_interval`` has passed, the next commit that is due anyway reads the watched
    columns at its own low watermark; tables whose columns differ from what this process landed
    last get schema rows in that commit. Schema rows never force a commit of their own: a new
    job's first data commit stays one flush latency after its start commit, and a drop reaches the
    change log within ``watched_interval`` plus ``checkpoint_interval``.
    """

    sink: DeltaChangeLogSink
    flush_latency_s: float
    max_rows: int
    checkpoint_interval_s: float
    retention_nanos: Nanos
    log: Logger
    monotonic: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], Nanos] = time.time_ns
    watched_columns: Callable[[Nanos], WatchedColumns] | None = None
    watched_interval_s: float = 10.0
    known_columns: WatchedColumns = field(default_factory=dict)
    """The watched columns the change log landed before this process started."""
    column_defaults: Callable[[Nanos], set[tuple[str, str]]] | None = None
    """Which columns have a DEFAULT at a timestamp (``read_column_defaults``)."""
    riders: Riders | None = None
    on_commit: Callable[[list[Transaction], Nanos], None] | None = None
    """Told of each commit's transactions and low watermark (the service's metrics)."""
    pending: list[Transaction] = field(default_factory=list)
    pending_rows: int = 0
    pending_since: float | None = None
    resume_point: ResumePoint | None = None
    committed_watermark: Nanos | None = None
    last_commit_at: float = 0.0
    commits: int = 0

    def __post_init__(self) -> None:
        self._watched = WatchedColumnsPoll(
            self.watched_columns,
            self.watched_interval_s,
            self.log,
            self.wall_clock,
            known_columns=self.known_columns,
            read_defaults=self.column_defaults,
        )

    def on_release(self, release: Release) -> None:
        self.resume_point = release.resume_point
        if release.transactions:
            if self.pending_since is None:
                self.pending_since = self.monotonic()
            self.pending.extend(release.transactions)
            self.pending_rows += sum(t.mod_count for t in release.transactions)
        if self.pending_rows >= self.max_rows:
            self.flush()

    def on_tick(self) -> None:
        now = self.monotonic()
        batch_due = (
            self.pending_since is not None and now - self.pending_since >= self.flush_latency_s
        )
        checkpoint_due = now - self.last_commit_at >= self.checkpoint_interval_s
        riders_due = self.riders is not None and self.riders.due()
        if batch_due or checkpoint_due or riders_due:
            self.flush(self._watched_changes(now))

    def _watched_changes(self, now: float) -> WatchedColumns:
        point = self.resume_point
        if point is None:
            return {}
        return self._watched.changes(point.low_watermark, now)

    def flush(self, watched: WatchedColumns | None = None) -> None:
        point = self.resume_point
        if point is None:
            return
        riders = self.riders
        gained = (
            self._watched.gained_columns(watched or {}, point.low_watermark)
            if riders is not None
            else ()
        )
        asked = bool(gained) and riders is not None and riders.backfill(gained)
        if gained and not asked:
            watched = self._held_back(watched or {}, gained, "a table snapshot runs")
        chunks, riders_due = (
            riders.before_commit(point.low_watermark, self.pending) if riders else ([], False)
        )
        if asked and riders is not None:
            if riders.recorded() == gained:
                self.log.info("column_backfill_recorded", tables=list(gained))
            else:
                watched = self._held_back(watched or {}, gained, "the request was not recorded")
        if (
            not self.pending
            and not watched
            and not riders_due
            and point.low_watermark == self.committed_watermark
        ):
            return
        result = self.sink.commit(self.pending, point, watched, snapshot=chunks)
        if self.riders is not None:
            self.riders.after_commit()
        if self.on_commit is not None:
            self.on_commit(self.pending, point.low_watermark)
        self._watched.landed(watched or {})
        snapshot_rows = sum(len(c.rows) + len(c.deleted_keys) for c in chunks)
        lag_nanos = self.wall_clock() - point.low_watermark
        report_commit(
            self.log, result, watched or {}, point.low_watermark, lag_nanos, snapshot_rows
        )
        warn_near_retention(self.log, lag_nanos, self.retention_nanos)
        self.pending, self.pending_rows, self.pending_since = [], 0, None
        self.landed(point.low_watermark)

    def _held_back(
        self, watched: WatchedColumns, gained: tuple[str, ...], why: str
    ) -> WatchedColumns:
        """The schema rows of tables that gained a column land with the snapshot that reads
        them again, never before it: held back, the next poll finds them again (a crash between
        the two would leave the column's values unread for good)."""
        self.log.warning("column_backfill_waiting", tables=list(gained), reason=why)
        return {t: c for t, c in watched.items() if t not in gained}

    def landed(self, low_watermark: Nanos) -> None:
        """A commit up to ``low_watermark`` landed: the next checkpoint-only commit is due one
        interval from now."""
        self.committed_watermark = low_watermark
        self.last_commit_at = self.monotonic()
        self.commits += 1


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def report_commit(
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


def warn_near_retention(log: Logger, lag_nanos: Nanos, retention_nanos: Nanos) -> None:
    """The page alert of both runtimes: the change log trails Spanner by more than half the
    stream's retention, and data past the retention is lost."""
    if lag_nanos > retention_nanos // 2:
        log.warning(
            "watermark_lag_near_retention",
            watermark_lag_seconds=round(lag_nanos / NANOS_PER_SECOND, 3),
            retention_seconds=retention_nanos // NANOS_PER_SECOND,
        )
