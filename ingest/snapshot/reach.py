"""When a snapshot may start, and when it is refused: T0 must stay readable until the snapshot
ends, so the database's versions (and, when the stream follows the snapshot from T0, the change
stream's records) must outlive it; while it runs, its progress reports say whether it will.
Both engines (per table, ``initial``; per key range,
``parts``) and both runtimes' job start (``ingest.job``) check a snapshot here."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ingest.model.snapshot import SnapshotProgress
from ingest.model.timestamps import NANOS_PER_SECOND, Nanos, to_rfc3339
from runtime.errors import BadInput
from runtime.logs import Logger


class SnapshotOutOfReach(BadInput, RuntimeError):
    """T0 is older than the database keeps versions: the snapshot cannot be read consistently."""


def check_reachable(read_timestamp: Nanos, now: Nanos, version_retention: Nanos) -> Nanos:
    """The deadline by which the snapshot must be read; refused once T0 is out of reach."""
    deadline = read_timestamp + version_retention
    if now >= deadline:
        raise SnapshotOutOfReach(
            f"snapshot read timestamp {to_rfc3339(read_timestamp)} is older than the database's "
            f"version_retention_period ({version_retention // NANOS_PER_SECOND} s): raise it "
            "(ALTER DATABASE … SET OPTIONS (version_retention_period = '…')) before the next "
            "snapshot, or start a new job with a new table or job id; nothing landed is lost"
        )
    return deadline


@dataclass(frozen=True, slots=True)
class Retention:
    """How long Spanner keeps what a snapshot needs: versions to read at T0, and (when the
    stream follows the snapshot from T0) the change stream's records."""

    version_retention: Nanos
    stream_retention: Nanos | None

    @property
    def limit(self) -> Nanos:
        return min(self.version_retention, self.stream_retention or self.version_retention)


def check_fits_retention(
    read_timestamp: Nanos, rows: int, rows_per_s: float, retention: Retention
) -> Nanos:
    """The snapshot's expected end (``rows`` at ``rows_per_s`` from T0); refused when that is
    past what Spanner keeps, with both figures and what to change."""
    expected = int(rows / rows_per_s * NANOS_PER_SECOND)
    if expected < retention.limit:
        return read_timestamp + expected
    stream = (
        f"; the change stream keeps changes for {_duration(retention.stream_retention)} "
        "(ALTER CHANGE STREAM … SET OPTIONS (retention_period = '…'))"
        if retention.stream_retention is not None
        else ""
    )
    rate = f"{rows_per_s:,.0f}" if rows_per_s >= 1 else f"{rows_per_s:g}"
    raise SnapshotOutOfReach(
        f"the snapshot of {rows:,} rows needs about {_duration(expected)} at "
        f"{rate} rows/s (snapshot_rows_per_s), longer than Spanner keeps what it "
        f"needs: the database keeps versions for {_duration(retention.version_retention)} "
        "(ALTER DATABASE … SET OPTIONS (version_retention_period = '…'))"
        f"{stream}. Raise them above {_duration(2 * expected)}, or set snapshot_rows_per_s to "
        "the rate this deployment has shown; nothing was landed"
    )


def _duration(nanos: Nanos) -> str:
    seconds = nanos / NANOS_PER_SECOND
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 2 * 86_400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86_400:.1f} d"


def check_projected_end(
    log: Logger,
    expected_rows: int | None,
    deadline: Nanos | None,
    progress: SnapshotProgress,
    rate: float,
    now: Nanos,
) -> None:
    """An error event while a snapshot's rate would end it past its deadline."""
    if expected_rows is None or deadline is None or progress.complete:
        return
    remaining = max(0, expected_rows - progress.rows)
    projected = now + int(remaining / rate * NANOS_PER_SECOND) if rate > 0 else None
    if projected is None or projected > deadline:
        log.error(
            "snapshot_outliving_retention",
            rows=progress.rows,
            expected_rows=expected_rows,
            rows_per_second=round(rate, 1),
            projected_end=to_rfc3339(projected) if projected is not None else None,
            deadline=to_rfc3339(deadline),
            action="raise version_retention_period (and the change stream's retention_period) "
            "now, while the snapshot runs",
        )


def report(
    log: Logger, event: str, progress: SnapshotProgress, rows_now: int, elapsed: float
) -> None:
    """Rows and tables landed, and this process's rate (the tables' sizes are not known ahead:
    counting them would cost another read of every table)."""
    log.info(
        event,
        read_timestamp=to_rfc3339(progress.read_timestamp),
        tables_done=sum(t.done for t in progress.tables),
        tables=len(progress.tables),
        rows=progress.rows,
        rows_per_second=round(rows_now / elapsed, 1) if elapsed > 0 else None,
        complete=progress.complete,
    )


class ReportSettings(Protocol):
    """What both engines' settings say of their reports."""

    @property
    def progress_interval_s(self) -> float: ...
    @property
    def expected_rows(self) -> int | None: ...
    @property
    def deadline(self) -> Nanos | None: ...


@dataclass
class ProgressReports:
    """A running snapshot's ``snapshot_progress`` every interval and at its end, each followed
    by the projected-end check: one for both engines."""

    settings: ReportSettings
    rows_before: int
    log: Logger
    monotonic: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], Nanos] = time.time_ns
    started: float = field(init=False)
    last: float = field(init=False)

    def __post_init__(self) -> None:
        self.started = self.last = self.monotonic()

    @classmethod
    def of(
        cls,
        settings: ReportSettings,
        progress: SnapshotProgress,
        log: Logger,
        monotonic: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], Nanos] = time.time_ns,
    ) -> ProgressReports:
        """Reports of this process's part of the snapshot, from ``progress`` as it starts."""
        return cls(settings, progress.rows, log, monotonic, wall_clock)

    def after_commit(self, progress: SnapshotProgress) -> None:
        now = self.monotonic()
        if now - self.last < self.settings.progress_interval_s and not progress.complete:
            return
        self.last = now
        rows_now, elapsed = progress.rows - self.rows_before, now - self.started
        report(self.log, "snapshot_progress", progress, rows_now, elapsed)
        rate = rows_now / elapsed if elapsed > 0 else 0.0
        settings = self.settings
        check_projected_end(
            self.log, settings.expected_rows, settings.deadline, progress, rate, self.wall_clock()
        )
