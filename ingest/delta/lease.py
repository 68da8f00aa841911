"""One writer per job, and a job start that never moves: what a process checks in the change log
before it writes. The fence itself is in the sink (a version is written only at n - 1)."""

from __future__ import annotations

import threading
import time

from ingest.contract.changelog import Checkpoint
from ingest.delta.sink import DeltaChangeLogSink
from ingest.model.timestamps import NANOS_PER_SECOND, Nanos
from runtime.logs import Logger


def wait_for_lease(
    sink: DeltaChangeLogSink, owner: str, lease_s: float, log: Logger, stop: threading.Event
) -> Checkpoint | None:
    """Stand by while another process committed for this job within the lease period, unless
    its last commit released the lease (a clean stop).

    A live writer commits at least every checkpoint interval (at most half the lease), so a
    lease that has run out means the writer is gone. If it was only slow, its next commit is
    refused by the Delta fence and it stops.
    """
    announced = False
    while not stop.is_set():
        checkpoint = sink.latest_checkpoint()
        if checkpoint is None or checkpoint.owner == owner:
            return checkpoint
        if checkpoint.lease_released:
            log.info("writer_lease_released_by_previous_owner", previous_owner=checkpoint.owner)
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
