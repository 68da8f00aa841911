"""A failed query: restarted on the same checkpoint when its cause passes (a schema change, a
conflict, a late worker), or the job stopped with the one line an operator needs."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pipeline.batch_writer import JobStats
from pipeline.catalog import version_holding
from pipeline.config import PipelineConfig
from pipeline.files_gone import files_gone_line
from pipeline.foreign_commits import TABLE_CHANGED_BEHIND_JOB
from pipeline.metrics import PipelineMetrics
from pipeline.processor import ROW_NOT_APPLICABLE, SOURCE_SCHEMA_CHANGED, STATE_ROUNDTRIP_MISMATCH
from runtime.errors import ReportedError
from runtime.logs import Logger

PYTHON_WORKER_LATE = "Python worker failed to connect back"
"""A Python worker started slower than Spark waits for it (a host whose CPU is busy: seen with one
core kept busy beside the suite); the batch did not commit, so the query starts again on the
same checkpoint, like after the other markers, at most ``max_restarts`` times in a row."""
RESTART_MARKERS = (
    SOURCE_SCHEMA_CHANGED,
    STATE_ROUNDTRIP_MISMATCH,
    "ConcurrentAppendException",
    PYTHON_WORKER_LATE,
)


class PipelineFailed(ReportedError, RuntimeError):
    pass


@dataclass(slots=True)
class Restarts:
    """Restarts count against ``max_restarts`` only while no batch lands between them."""

    in_a_row: int = 0
    batches_at_restart: int = 0

    def record(
        self,
        error: BaseException,
        stats: JobStats,
        config: PipelineConfig,
        metrics: PipelineMetrics,
        log: Logger,
    ) -> None:
        """Count a restart on the same checkpoint; PipelineFailed when the query must not."""
        if stats.batches > self.batches_at_restart:
            self.in_a_row = 0
        reason = restart_reason(error, self.in_a_row, config)
        stats.restarts += 1
        metrics.restarts.labels(reason).inc()
        self.in_a_row, self.batches_at_restart = self.in_a_row + 1, stats.batches
        log.warning(
            "pipeline_query_restarting",
            reason=reason,
            restarts=stats.restarts,
            restarts_in_a_row=self.in_a_row,
        )


STATE_UNREADABLE_MARKERS = ("CANNOT_LOAD_STATE_STORE", "CANNOT_READ_STATE_STORE")


def restart_reason(error: BaseException, in_a_row: int, config: PipelineConfig) -> str:
    """Why a failed query restarts on the same checkpoint; PipelineFailed when it must not."""
    unreadable = _unreadable_state(error, config) or files_gone_line(str(error), config)
    if unreadable is not None:
        raise PipelineFailed(unreadable) from error
    reason = next((m for m in RESTART_MARKERS if m in str(error)), None)
    if reason is None or in_a_row >= config.max_restarts:
        raise PipelineFailed(_with_changelog_version(first_line(error), config)) from error
    return reason


def _unreadable_state(error: BaseException, config: PipelineConfig) -> str | None:
    """The line for a checkpoint whose state Spark cannot load (a truncated or corrupt RocksDB
    file): restarting reads the same files, and a rebase from the mirrors is the way out."""
    text = str(error)
    marker = next((m for m in STATE_UNREADABLE_MARKERS if m in text), None)
    if marker is None:
        return None
    causes = [line.strip() for line in text.splitlines() if line.strip().startswith("Caused by:")]
    cause = causes[-1].removeprefix("Caused by:").strip() if causes else marker
    return (
        f"{marker}: the pipeline checkpoint {config.checkpoint_uri} cannot be read ({cause}); "
        "restarting reads the same files: stop the job, run `python -m pipeline rebase` with "
        "the same change log, mirrors and checkpoint (a new state generation seeded from the "
        "mirrors), then start the job again (docs/operations.md, Rebase)"
    )


def _with_changelog_version(line: str, config: PipelineConfig) -> str:
    """A row the job cannot apply, located in the change log for whoever must resolve it."""
    found = re.search(rf"{ROW_NOT_APPLICABLE}: .*?, commit (\S+),", line)
    if found is None:
        return line
    version = version_holding(config.changelog_uri, found.group(1))
    start = line.index(ROW_NOT_APPLICABLE)
    return f"{line[start:]} (change-log version {version}); the job stops: retrying cannot help"


def first_line(error: BaseException) -> str:
    """The line an operator needs from a Spark failure: the cause, not the Java stack."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for marker in (*RESTART_MARKERS, ROW_NOT_APPLICABLE, TABLE_CHANGED_BEHIND_JOB):
        for line in lines:
            if marker in line:
                return line[line.index(marker) :]
    causes = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)]
    return causes[-1] if causes else (lines[0] if lines else type(error).__name__)
