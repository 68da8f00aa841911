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

import functools
import threading
import time
import uuid
from collections.abc import Callable

from deltalake import DeltaTable
from google.cloud.spanner_v1.database import Database

from ingest.changestream import query
from ingest.changestream.config import reader_config
from ingest.changestream.opening import OpenedStream
from ingest.changestream.reader import ChangeStreamReader
from ingest.delta.absent_keys import absent_keys, deleted_after, keys_of_earlier_jobs
from ingest.delta.batcher import Batcher
from ingest.delta.sink import DeltaChangeLogSink
from ingest.job.config import JobConfig
from ingest.job.metrics import IngestMetrics
from ingest.job.snapshot_window import open_snapshot
from ingest.job.taking import TakenJob, release_lease, take_job
from ingest.model.snapshot import SnapshotMode, SnapshotProgress
from ingest.model.timestamps import to_rfc3339
from ingest.service.health import Commits, HealthServer, token_file
from ingest.snapshot.initial import (
    ReadTable,
    SnapshotSettings,
    run_snapshot,
)
from ingest.snapshot.on_demand import TableSnapshots
from ingest.snapshot.reader import read_table
from runtime.logs import Logger


def run_service(config: JobConfig, log: Logger, stop: threading.Event) -> int:
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
    opened, sink, log = job.opened, job.sink, job.log
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
        _stream(job, config, snapshot, stop, health, metrics)
        return release_lease(sink, log)
    finally:
        if health is not None:
            health.close()


def _health_server(
    config: JobConfig, snapshot_commits: Commits, metrics: IngestMetrics
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


def _stream(
    job: TakenJob,
    config: JobConfig,
    snapshot: SnapshotProgress | None,
    stop: threading.Event,
    health: HealthServer | None,
    metrics: IngestMetrics,
) -> None:
    """Read the change stream from the resume point until stopped (``snapshot``: the job's, as
    its snapshot left it)."""
    opened, checkpoint, resume, log = job.opened, job.checkpoint, job.resume, job.log
    landing = job.landing(config)
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
    table_snapshots = _table_snapshots(opened, config, landing.sink, log, stop)
    batcher = Batcher(
        landing,
        config.flush_latency_ms / 1000,
        config.max_batch_rows,
        config.checkpoint_interval_s,
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
    config: JobConfig,
    sink: DeltaChangeLogSink,
    log: Logger,
    stop: threading.Event,
) -> TableSnapshots:
    """On-demand snapshots of some tables, resumed where a previous process left one."""
    table_snapshots = TableSnapshots(
        sink,
        _table_reader(opened.database, config),
        opened.watched_columns,
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
    config: JobConfig,
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
    columns = opened.watched_columns(progress.read_timestamp)
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


def _table_reader(database: Database, config: JobConfig) -> ReadTable:
    return functools.partial(
        read_table,
        database,
        chunk_rows=config.snapshot_chunk_rows,
        chunk_bytes=config.snapshot_chunk_mb * 1024 * 1024,
    )


def _changelog(sink: DeltaChangeLogSink) -> DeltaTable:
    table = sink.table()
    if table is None:
        raise RuntimeError("the change log vanished while the job runs")
    return table
