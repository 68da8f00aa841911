"""The long-running ingest service: change stream → Delta change-log table, exactly once.

Start: wait as a standby while another process holds the job's writer lease, then resume from the
newest checkpoint in the table; a new job first commits its start position (the configured
timestamp, or now) and, unless its snapshot mode is ``never``, the snapshot's T0 (just below the
start) and tables, so every restart resumes from that same position. Snapshot: land every captured
table as read at T0 (``ingest.snapshot.initial``). Run: the reader releases whole transactions at
each low watermark; the batcher commits them with the checkpoint. Stop on SIGTERM/SIGINT: land what
is released, commit, exit 0.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import structlog
from deltalake import DeltaTable
from google.cloud.spanner_v1.database import Database

from ingest.changestream import query
from ingest.changestream.config import reader_config
from ingest.changestream.opening import OpenedStream, StreamAddress, open_stream
from ingest.changestream.reader import ChangeStreamReader
from ingest.changestream.watched_columns import read_column_defaults, read_watched_columns
from ingest.contract.changelog import Checkpoint
from ingest.delta.absent_keys import absent_keys, deleted_after, keys_of_earlier_jobs
from ingest.delta.batcher import Batcher
from ingest.delta.lease import start_moved, wait_for_lease
from ingest.delta.schema_rows import landed_watched_columns
from ingest.delta.sink import DeltaChangeLogSink
from ingest.model.resume import ResumePoint, start_point
from ingest.model.snapshot import SnapshotMode, SnapshotProgress
from ingest.model.timestamps import Nanos, to_rfc3339
from ingest.service.config import ServiceConfig
from ingest.service.health import Commits, HealthServer, token_file
from ingest.service.metrics import IngestMetrics
from ingest.snapshot.initial import (
    ReadTable,
    Retention,
    SnapshotOutOfReach,
    SnapshotSettings,
    check_fits_retention,
    check_reachable,
    run_snapshot,
)
from ingest.snapshot.on_demand import TableSnapshots
from ingest.snapshot.reader import count_rows, read_table

Logger = structlog.typing.FilteringBoundLogger


def run_service(config: ServiceConfig, log: Logger, stop: threading.Event) -> int:
    """The service's life, in order:

    1. open the Spanner side: database, dialect, the stream's description;
    2. wait as a standby while another process holds the job's writer lease, then continue
       after the newest checkpoint;
    3. a new job records where it starts (and its snapshot's T0 and tables); a resumed one
       keeps what its first commit recorded;
    4. serve health and metrics;
    5. finish the snapshot, if one is unfinished (``initial_only`` stops after it);
    6. read the stream from the resume point until stopped;
    7. hand the lease over with a last commit.
    """
    job = take_job(config, uuid.uuid4().hex, log, stop)
    if job is None:
        return 0
    opened, sink, checkpoint, log = job.opened, job.sink, job.checkpoint, job.log
    resume, snapshot, table_rows = job.resume, job.snapshot, job.table_rows
    metrics = IngestMetrics()
    metrics.sources.landed_watermark = resume.low_watermark
    metrics.sources.snapshot = lambda: sink.table_snapshot or sink.snapshot
    snapshot_commits = Commits()
    health = _health_server(config, snapshot_commits, metrics)
    try:
        if snapshot is not None and not snapshot.complete:
            snapshot = snapshot_tables(
                opened, config, snapshot, table_rows, sink, log, stop, health, snapshot_commits
            )
            if not snapshot.complete:
                log.info("ingest_stopped", reason="stopped during the snapshot")
                return release_lease(sink, log)
        if SnapshotMode(config.snapshot_mode) is SnapshotMode.INITIAL_ONLY:
            log.info(
                "ingest_stopped", reason="snapshot_mode initial_only: the snapshot is complete"
            )
            return release_lease(sink, log)
        _stream(opened, config, sink, checkpoint, snapshot, resume, log, stop, health, metrics)
        return release_lease(sink, log)
    finally:
        if health is not None:
            health.close()


@dataclass(frozen=True, slots=True)
class TakenJob:
    """A job this process writes from now on: where it reads, its sink, where it resumes."""

    opened: OpenedStream
    sink: DeltaChangeLogSink
    checkpoint: Checkpoint | None
    """The newest checkpoint; None for a new job."""
    resume: ResumePoint
    snapshot: SnapshotProgress | None
    table_rows: dict[str, int] | None
    """A new job's snapshot rows at T0 per table, when counted."""
    log: Logger


def take_job(
    config: ServiceConfig, owner: str, log: Logger, stop: threading.Event
) -> TakenJob | None:
    """Steps 1-3 of every writer of a job (the service and the Spark source): open the Spanner
    side; stand by while another process holds the writer lease, then continue after the newest
    checkpoint; a new job records its start (and its snapshot's T0 and tables), a resumed one
    keeps what its first commit recorded. None when stopped while standing by."""
    log = log.bind(job_id=config.effective_job_id, owner=owner)
    opened = open_stream(
        StreamAddress(
            config.project,
            config.instance,
            config.database,
            config.stream,
            config.dialect,
            config.heartbeat_ms,
        )
    )
    sink = DeltaChangeLogSink(config.table_uri, config.effective_job_id, owner, log=log)
    checkpoint = wait_for_lease(sink, owner, config.lease_s, log, stop)
    if stop.is_set():
        return None
    sink.continue_after(checkpoint)
    table_rows: dict[str, int] | None = None
    if checkpoint is None:
        resume, snapshot, table_rows = start_job(opened, config, sink, log)
    else:
        resume, snapshot = resume_job(config, checkpoint, log)
    return TakenJob(opened, sink, checkpoint, resume, snapshot, table_rows, log)


def start_job(
    opened: OpenedStream, config: ServiceConfig, sink: DeltaChangeLogSink, log: Logger
) -> tuple[ResumePoint, SnapshotProgress | None, dict[str, int] | None]:
    """Record a new job's start, refused at once if the stream cannot be read from there or a
    snapshot could not finish within retention; with its snapshot's rows at T0 per table, when
    counted."""
    now = time.time_ns()
    start = query.validate_start(config.start_timestamp or now, now, opened.info)
    opened.query().check_readable_from(start)
    resume = start_point(start)
    snapshot = None
    rows = None
    if SnapshotMode(config.snapshot_mode) is not SnapshotMode.NEVER:
        read_at = resume.low_watermark
        retention = retention_of(opened)
        check_reachable(read_at, now, retention.version_retention)
        tables = read_watched_columns(opened.database, config.stream, opened.dialect, read_at)
        snapshot = SnapshotProgress.begin(read_at, list(tables))
        rows = table_rows(opened, config, snapshot)
        if rows is not None:
            expected = sum(rows.values())
            end = check_fits_retention(read_at, expected, config.snapshot_rows_per_s, retention)
            log.info("snapshot_estimated", rows=expected, expected_end=to_rfc3339(end))
    sink.start_job(start, snapshot)
    log.info(
        "job_started",
        job_start=to_rfc3339(start),
        snapshot_read_timestamp=to_rfc3339(snapshot.read_timestamp) if snapshot else None,
    )
    return resume, snapshot, rows


def resume_job(
    config: ServiceConfig, checkpoint: Checkpoint, log: Logger
) -> tuple[ResumePoint, SnapshotProgress | None]:
    if start_moved(config.start_timestamp, checkpoint):
        log.warning(
            "configured_start_ignored",
            configured_start=to_rfc3339(config.start_timestamp or 0),
            job_start=to_rfc3339(checkpoint.job_start or 0),
            note="a job's start never moves; start a new job to read from another point",
        )
    return checkpoint.resume_point, checkpoint.snapshot


def _health_server(
    config: ServiceConfig, snapshot_commits: Commits, metrics: IngestMetrics
) -> HealthServer | None:
    if not config.health_port:
        return None
    health = HealthServer(
        config.health_port,
        config.readiness_s,
        snapshot_commits,
        config.max_stuck_restarts,
        token_file(config.control_token_file),
    )
    health.metrics = metrics.render
    return health


def release_lease(sink: DeltaChangeLogSink, log: Logger) -> int:
    """A clean stop hands the job over at once: its last commit releases the writer lease. A
    process that crashes or is killed never gets here, and its lease runs out as before."""
    result = sink.release_lease()
    if result is not None:
        log.info("writer_lease_released", version=result.version)
    return 0


def _stream(
    opened: OpenedStream,
    config: ServiceConfig,
    sink: DeltaChangeLogSink,
    checkpoint: Checkpoint | None,
    snapshot: SnapshotProgress | None,
    resume: ResumePoint,
    log: Logger,
    stop: threading.Event,
    health: HealthServer | None,
    metrics: IngestMetrics,
) -> None:
    """Read the change stream from the resume point until stopped."""
    start = query.validate_start(resume.low_watermark + 1, time.time_ns(), opened.info)
    log.info(
        "ingest_started",
        table_uri=config.table_uri,
        dialect=opened.dialect.value,
        resumed_from_version=checkpoint.version if checkpoint else None,
        start_timestamp=to_rfc3339(start),
    )
    reader = ChangeStreamReader(
        opened.query(), reader_config(config, start), log, resume_from=resume
    )
    table_snapshots = _table_snapshots(opened, config, sink, log, stop)
    batcher = Batcher(
        sink,
        config.flush_latency_ms / 1000,
        config.max_batch_rows,
        config.checkpoint_interval_s,
        opened.info.retention_nanos,
        log,
        watched_columns=functools.partial(
            read_watched_columns, opened.database, config.stream, opened.dialect
        ),
        watched_interval_s=config.watched_columns_interval_s,
        known_columns=landed_watched_columns(sink.table()),
        column_defaults=functools.partial(read_column_defaults, opened.database),
        riders=table_snapshots,
        on_commit=metrics.committed,
    )
    metrics.sources.reader = reader
    if checkpoint is None and snapshot is None:
        batcher.landed(resume.low_watermark)
    try:
        reader.run(
            batcher.on_release, stop, on_tick=_ticks(health, batcher, table_snapshots, reader)
        )
        batcher.flush()
    finally:
        table_snapshots.close()
    log.info(
        "ingest_stopped",
        low_watermark=to_rfc3339(reader.assembler.released_watermark),
        commits=batcher.commits,
        duplicates_dropped=reader.assembler.stats.duplicates_dropped,
    )


def _ticks(
    health: HealthServer | None,
    batcher: Batcher,
    table_snapshots: TableSnapshots,
    reader: ChangeStreamReader,
) -> Callable[[], None]:
    """What runs on the reader's loop: the batcher's flushes and, with a health server, its
    view of commits, snapshot requests and stuck partitions."""
    if health is None:
        return batcher.on_tick
    health.committer = batcher
    health.snapshot_requests = table_snapshots.request
    health.stuck_restarts = lambda: reader.watchdog.most_restarts_in_a_row

    def tick() -> None:
        health.tick()
        batcher.on_tick()

    return tick


def _table_snapshots(
    opened: OpenedStream,
    config: ServiceConfig,
    sink: DeltaChangeLogSink,
    log: Logger,
    stop: threading.Event,
) -> TableSnapshots:
    """On-demand snapshots of some tables, resumed where a previous process left one."""
    table_snapshots = TableSnapshots(
        sink,
        _table_reader(opened.database, config),
        functools.partial(read_watched_columns, opened.database, config.stream, opened.dialect),
        lambda table, at, found: absent_keys(_changelog(sink), table, at, found),
        lambda table, at: deleted_after(_changelog(sink), table, at),
        opened.version_retention,
        config.snapshot_workers,
        log,
        stop,
    )
    table_snapshots.resume()
    return table_snapshots


def snapshot_tables(
    opened: OpenedStream,
    config: ServiceConfig,
    progress: SnapshotProgress,
    table_rows: dict[str, int] | None,
    sink: DeltaChangeLogSink,
    log: Logger,
    stop: threading.Event,
    health: HealthServer | None = None,
    commits: Commits | None = None,
) -> SnapshotProgress:
    """Land the tables the snapshot has not finished; refused once T0 is out of reach, and a
    read that fails past that deadline says so. ``table_rows``: its rows at T0 per table, when
    the job's start just counted them (a resumed job counts them here)."""
    window = open_snapshot(opened, config, progress, table_rows, log)
    columns = read_watched_columns(
        opened.database, config.stream, opened.dialect, progress.read_timestamp
    )
    with window.out_of_reach_named():
        return run_snapshot(
            sink,
            progress,
            columns,
            _table_reader(opened.database, config),
            SnapshotSettings(
                config.snapshot_workers, expected_rows=window.expected, deadline=window.deadline
            ),
            log,
            stop,
            on_tick=health.tick if health is not None else lambda: None,
            on_commit=commits.count if commits is not None else lambda: None,
            absent_keys=lambda table, at, found: keys_of_earlier_jobs(
                _changelog(sink), table, at, found
            ),
        )


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


def open_snapshot(
    opened: OpenedStream,
    config: ServiceConfig,
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


def _table_reader(database: Database, config: ServiceConfig) -> ReadTable:
    return functools.partial(
        read_table,
        database,
        chunk_rows=config.snapshot_chunk_rows,
        chunk_bytes=config.snapshot_chunk_mb * 1024 * 1024,
    )


def retention_of(opened: OpenedStream) -> Retention:
    return Retention(opened.version_retention(), opened.info.retention_nanos)


def table_rows(
    opened: OpenedStream, config: ServiceConfig, progress: SnapshotProgress
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


def _changelog(sink: DeltaChangeLogSink) -> DeltaTable:
    table = sink.table()
    if table is None:
        raise RuntimeError("the change log vanished while the job runs")
    return table
