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
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import structlog
from google.cloud import spanner

from ingest import query
from ingest.checkpoint import Checkpoint
from ingest.config import ServiceConfig
from ingest.reader import ChangeStreamReader, ReaderConfig, Release, ResumePoint
from ingest.records import Transaction
from ingest.sink import DeltaChangeLogSink, start_point
from ingest.timestamps import NANOS_PER_SECOND, Nanos, to_rfc3339
from ingest.watched_columns import WatchedColumns, read_watched_columns

Logger = structlog.typing.FilteringBoundLogger


STALE_READ_LIMIT_NANOS = 55 * 60 * NANOS_PER_SECOND
"""Spanner keeps old versions one hour by default: older watermarks are not read for schema."""


@dataclass
class Batcher:
    """Flush policy: commit released transactions within ``flush_latency`` or ``max_rows``;
    with nothing to land, still commit the checkpoint every ``checkpoint_interval`` so a restart
    never re-reads more than that much of the stream (and the writer lease stays fresh).

    Every ``watched_interval`` the watched columns are read at the released low watermark; tables
    whose columns differ from what this process landed last get schema rows, committed at once.
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
    watched_landed: WatchedColumns = field(default_factory=dict)
    watched_read_at: float | None = None
    pending: list[Transaction] = field(default_factory=list)
    pending_rows: int = 0
    pending_since: float | None = None
    resume_point: ResumePoint | None = None
    committed_watermark: Nanos | None = None
    last_commit_at: float = 0.0
    commits: int = 0

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
        watched = self._watched_changes(now)
        if batch_due or checkpoint_due or watched:
            self.flush(watched)

    def _watched_changes(self, now: float) -> WatchedColumns:
        """Tables whose watched columns at the released watermark differ from those landed."""
        due = self.watched_read_at is None or now - self.watched_read_at >= self.watched_interval_s
        point = self.resume_point
        if self.watched_columns is None or point is None or not due:
            return {}
        self.watched_read_at = now
        if self.wall_clock() - point.low_watermark > STALE_READ_LIMIT_NANOS:
            return {}
        try:
            watched = self.watched_columns(point.low_watermark)
        except Exception as error:  # any failure: read again next interval
            self.log.warning("watched_columns_unread", cause=_first_line(error))
            return {}
        return {t: c for t, c in watched.items() if self.watched_landed.get(t) != c}

    def flush(self, watched: WatchedColumns | None = None) -> None:
        point = self.resume_point
        if point is None or (
            not self.pending and not watched and point.low_watermark == self.committed_watermark
        ):
            return
        result = self.sink.commit(self.pending, point, watched)
        self.watched_landed.update(watched or {})
        lag_nanos = self.wall_clock() - point.low_watermark
        self.log.info(
            "delta_commit",
            version=result.version,
            delta_version=result.delta_version,
            transactions=result.transactions,
            rows=result.rows,
            schema_rows=sorted(watched or {}),
            low_watermark=to_rfc3339(point.low_watermark),
            watermark_lag_seconds=round(lag_nanos / NANOS_PER_SECOND, 3),
            replayed=result.replayed,
        )
        if lag_nanos > self.retention_nanos // 2:
            self.log.warning(
                "watermark_lag_near_retention",
                watermark_lag_seconds=round(lag_nanos / NANOS_PER_SECOND, 3),
                retention_seconds=self.retention_nanos // NANOS_PER_SECOND,
            )
        self.pending, self.pending_rows, self.pending_since = [], 0, None
        self.landed(point.low_watermark)

    def landed(self, low_watermark: Nanos) -> None:
        """A commit up to ``low_watermark`` landed: the next checkpoint-only commit is due one
        interval from now."""
        self.committed_watermark = low_watermark
        self.last_commit_at = self.monotonic()
        self.commits += 1


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


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
    if new_job:
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
