"""The long-running ingest service: change stream → Delta change-log table, exactly once.

Start: wait as a standby while another process holds the job's writer lease, then resume from the
newest checkpoint in the table; a new job first commits its start position (the configured
timestamp, or now), so every restart resumes from that same position. Run: the reader releases
whole transactions at each low watermark; the batcher commits them with the checkpoint. Stop on
SIGTERM/SIGINT: land what is released, commit, exit 0.
"""

from __future__ import annotations

import functools
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import structlog
from google.cloud import spanner

from ingest.changestream import query
from ingest.changestream.reader import ChangeStreamReader, ReaderConfig
from ingest.changestream.watched_columns import read_watched_columns
from ingest.delta.batcher import Batcher
from ingest.delta.changelog import Checkpoint
from ingest.delta.sink import DeltaChangeLogSink
from ingest.model.timestamps import NANOS_PER_SECOND, Nanos, to_rfc3339
from ingest.rules.resume import start_point
from ingest.service.config import ServiceConfig

Logger = structlog.typing.FilteringBoundLogger


class HealthServer:
    """``/healthz``: the reader loop is turning. ``/readyz``: a commit within ``readiness_s``."""

    def __init__(self, port: int, readiness_s: float, batcher: Batcher) -> None:
        self.last_tick = time.monotonic()
        self._batcher = batcher
        self._readiness_s = readiness_s
        health = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                ok, body = health.check(self.path)
                self.send_response(200 if ok else 503)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(json.dumps(body).encode())

            def log_message(self, *_: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def check(self, path: str) -> tuple[bool, dict[str, object]]:
        now = time.monotonic()
        if path.startswith("/healthz"):
            age = now - self.last_tick
            return age < 30, {"reader_loop_age_s": round(age, 3)}
        if path.startswith("/readyz"):
            committed = self._batcher.commits > 0
            age = now - self._batcher.last_commit_at
            return committed and age < self._readiness_s, {
                "commits": self._batcher.commits,
                "last_commit_age_s": round(age, 3) if committed else None,
            }
        return False, {"error": "unknown path"}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def wait_for_lease(
    sink: DeltaChangeLogSink, owner: str, lease_s: float, log: Logger, stop: threading.Event
) -> Checkpoint | None:
    """Stand by while another process committed for this job within the lease period.

    A live writer commits at least every checkpoint interval (at most half the lease), so a
    lease that has run out means the writer is gone. If it was only slow, its next commit is
    refused by the Delta fence and it stops.
    """
    announced = False
    while not stop.is_set():
        checkpoint = sink.latest_checkpoint()
        if checkpoint is None or checkpoint.owner == owner:
            return checkpoint
        age = (time.time_ns() - checkpoint.committed_at) / NANOS_PER_SECOND
        if age >= lease_s:
            log.info(
                "writer_lease_taken_over",
                previous_owner=checkpoint.owner,
                last_commit_age_seconds=round(age, 1),
            )
            return checkpoint
        if not announced:
            log.info(
                "standby_waiting_for_lease", current_owner=checkpoint.owner, lease_seconds=lease_s
            )
            announced = True
        stop.wait(min(1.0, lease_s - age))
    return None


def start_moved(configured: Nanos | None, checkpoint: Checkpoint) -> bool:
    """Whether a configured start disagrees with the one the job's first commit recorded.

    A job's start never moves once recorded: the checkpoint wins and the configured value is
    ignored (logged), as a standby or a restarted replica may carry an edited configuration.
    """
    recorded = checkpoint.job_start
    return configured is not None and recorded is not None and configured != recorded


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
            heartbeat_millis=config.heartbeat_ms,
            max_concurrent_partitions=config.max_concurrent_partitions,
            memory_budget_bytes=config.memory_budget_mb * 1024 * 1024,
            stats_interval_seconds=config.stats_interval_s,
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
