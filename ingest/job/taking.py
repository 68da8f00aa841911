"""Taking a job, as every writer of one does (the service and the Spark source): open the Spanner
side; stand by while another process holds the writer lease, then continue after the newest
checkpoint; a new job records its start (and its snapshot's T0 and tables), a resumed one keeps
what its first commit recorded. And handing it over at a clean stop."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from ingest.changestream import query
from ingest.changestream.opening import OpenedStream, open_stream
from ingest.contract.changelog import Checkpoint
from ingest.delta.landing import ChangeLogLanding, WatchedColumnsPoll
from ingest.delta.lease import start_moved, wait_for_lease
from ingest.delta.schema_rows import landed_watched_columns
from ingest.delta.sink import DeltaChangeLogSink
from ingest.job.config import JobConfig
from ingest.job.snapshot_window import begin_snapshot
from ingest.model.resume import ResumePoint, start_point
from ingest.model.snapshot import SnapshotMode, SnapshotProgress
from ingest.model.timestamps import to_rfc3339
from runtime.logs import Logger


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

    def landing(self, config: JobConfig) -> ChangeLogLanding:
        """Where and how either runtime lands this job's commits: its sink, the watched columns
        read from its database against what the change log already holds, the stream's
        retention for the alert."""
        opened = self.opened
        watched = WatchedColumnsPoll(
            opened.watched_columns,
            config.watched_columns_interval_s,
            self.log,
            known_columns=landed_watched_columns(self.sink.table()),
            read_defaults=opened.column_defaults,
        )
        return ChangeLogLanding(self.sink, watched, self.log, opened.info.retention_nanos)


def take_job(config: JobConfig, owner: str, log: Logger, stop: threading.Event) -> TakenJob | None:
    """Steps 1-3 of every writer of a job (the service and the Spark source): open the Spanner
    side; stand by while another process holds the writer lease, then continue after the newest
    checkpoint; a new job records its start (and its snapshot's T0 and tables), a resumed one
    keeps what its first commit recorded. None when stopped while standing by."""
    log = log.bind(job_id=config.effective_job_id, owner=owner)
    opened = open_stream(config.address)
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
    opened: OpenedStream, config: JobConfig, sink: DeltaChangeLogSink, log: Logger
) -> tuple[ResumePoint, SnapshotProgress | None, dict[str, int] | None]:
    """Record a new job's start, refused at once if the stream cannot be read from there or a
    snapshot could not finish within retention; with its snapshot's rows at T0 per table, when
    counted."""
    now = time.time_ns()
    start = query.validate_start(config.start_timestamp or now, now, opened.info)
    opened.query().check_readable_from(start)
    resume = start_point(start)
    snapshot = rows = watched = None
    if SnapshotMode(config.snapshot_mode) is not SnapshotMode.NEVER:
        snapshot, watched, rows = begin_snapshot(opened, config, resume.low_watermark, now, log)
    sink.start_job(start, snapshot, watched)
    log.info(
        "job_started",
        job_start=to_rfc3339(start),
        snapshot_read_timestamp=to_rfc3339(snapshot.read_timestamp) if snapshot else None,
    )
    return resume, snapshot, rows


def resume_job(
    config: JobConfig, checkpoint: Checkpoint, log: Logger
) -> tuple[ResumePoint, SnapshotProgress | None]:
    if start_moved(config.start_timestamp, checkpoint):
        log.warning(
            "configured_start_ignored",
            configured_start=to_rfc3339(config.start_timestamp or 0),
            job_start=to_rfc3339(checkpoint.job_start or 0),
            note="a job's start never moves; start a new job to read from another point",
        )
    return checkpoint.resume_point, checkpoint.snapshot


def release_lease(sink: DeltaChangeLogSink, log: Logger) -> int:
    """A clean stop hands the job over at once: its last commit releases the writer lease. A
    process that crashes or is killed never gets here, and its lease runs out as before."""
    result = sink.release_lease()
    if result is not None:
        log.info("writer_lease_released", version=result.version)
    return 0
