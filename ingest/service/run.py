"""The long-running ingest service: change stream → Delta change-log table, exactly once.

Start: wait as a standby while another process holds the job's writer lease, then resume from the
newest checkpoint in the table; a new job first commits its start position (the configured
timestamp, or now), so every restart resumes from that same position. Run: the reader releases
whole transactions at each low watermark; the batcher commits them with the checkpoint. Stop on
SIGTERM/SIGINT: land what is released, commit, exit 0.
"""

from __future__ import annotations

import functools
import threading
import time
import uuid

import structlog
from google.cloud import spanner

from ingest.changestream import query
from ingest.changestream.reader import ChangeStreamReader, ReaderConfig
from ingest.changestream.watched_columns import read_watched_columns
from ingest.delta.batcher import Batcher
from ingest.delta.lease import start_moved, wait_for_lease
from ingest.delta.sink import DeltaChangeLogSink
from ingest.model.timestamps import to_rfc3339
from ingest.rules.resume import start_point
from ingest.service.config import ServiceConfig
from ingest.service.health import HealthServer

Logger = structlog.typing.FilteringBoundLogger


def run_service(config: ServiceConfig, log: Logger, stop: threading.Event) -> int:
    owner = uuid.uuid4().hex
    log = log.bind(job_id=config.effective_job_id, owner=owner)
    database = (
        spanner.Client(project=config.project).instance(config.instance).database(config.database)
    )
    dialect = (
        query.detect_dialect(database)
        if config.dialect == "auto"
        else query.Dialect(config.dialect)
    )
    info = query.describe_stream(database, config.stream)
    sink = DeltaChangeLogSink(config.table_uri, config.effective_job_id, owner, log=log)
    checkpoint = wait_for_lease(sink, owner, config.lease_s, log, stop)
    if stop.is_set():
        return 0
    sink.continue_after(checkpoint)
    now = time.time_ns()
    new_job = checkpoint is None
    if checkpoint is None:
        start = query.validate_start(config.start_timestamp or now, now, info)
        sink.start_job(start)
        log.info("job_started", job_start=to_rfc3339(start))
        resume = start_point(start)
    else:
        if start_moved(config.start_timestamp, checkpoint):
            log.warning(
                "configured_start_ignored",
                configured_start=to_rfc3339(config.start_timestamp or 0),
                job_start=to_rfc3339(checkpoint.job_start or 0),
                note="a job's start never moves; start a new job to read from another point",
            )
        resume = checkpoint.resume_point
        start = query.validate_start(resume.low_watermark + 1, now, info)
    log.info(
        "ingest_started",
        table_uri=config.table_uri,
        dialect=dialect.value,
        resumed_from_version=checkpoint.version if checkpoint else None,
        start_timestamp=to_rfc3339(start),
    )
    reader = ChangeStreamReader(
        query.ChangeStreamQuery(database, config.stream, dialect, config.heartbeat_ms),
        ReaderConfig(
            start_timestamp=start,
            heartbeat_ms=config.heartbeat_ms,
            max_concurrent_partitions=config.max_concurrent_partitions,
            memory_budget_bytes=config.memory_budget_mb * 1024 * 1024,
            stats_interval_s=config.stats_interval_s,
        ),
        log,
        resume_from=resume,
    )
    batcher = Batcher(
        sink,
        config.flush_latency_ms / 1000,
        config.max_batch_rows,
        config.checkpoint_interval_s,
        info.retention_nanos,
        log,
        watched_columns=functools.partial(read_watched_columns, database, config.stream, dialect),
        watched_interval_s=config.watched_columns_interval_s,
    )
    if new_job:
        batcher.landed(resume.low_watermark)
    health = (
        HealthServer(config.health_port, config.readiness_s, batcher)
        if config.health_port
        else None
    )

    def tick() -> None:
        if health is not None:
            health.last_tick = time.monotonic()
        batcher.on_tick()

    try:
        reader.run(batcher.on_release, stop, on_tick=tick)
        batcher.flush()
    finally:
        if health is not None:
            health.close()
    log.info(
        "ingest_stopped",
        low_watermark=to_rfc3339(reader.assembler.released_watermark),
        commits=batcher.commits,
        duplicates_dropped=reader.assembler.stats.duplicates_dropped,
    )
    return 0
