"""A micro-batch's end (the query's ``foreachBatch``): MERGE it into the mirrors, histories and
processors' outputs, record the mirrors' cut, retire a replaced generation, and report."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from pyspark.sql import functions as F

from ingest.model.timestamps import to_rfc3339
from pipeline import batch_log
from pipeline.catalog import checkpoint_at
from pipeline.config import PipelineConfig
from pipeline.deployment import Plan
from pipeline.foreign_commits import DeltaCommits, ForeignCommitCheck
from pipeline.landing import BatchResult, write_batch
from pipeline.metrics import PipelineMetrics
from pipeline.processor import output_schema
from pipeline.rebase import retire_replaced
from pipeline.state import cut
from pipeline.state.checkpoint import checkpoint_id
from pipeline.state.generations import Generation
from pipeline.user_processors.host import OUTPUT_COLUMN, output_column
from pipeline.user_processors.outputs import append_batch, output_uri
from runtime.logs import Logger


@dataclass(slots=True)
class JobStats:
    batches: int = 0
    rows_merged: int = 0
    restarts: int = 0
    rebases: int = 0


@dataclass(eq=False)
class BatchWriter:
    """Each micro-batch's end: MERGE it into the mirrors, record the mirrors' cut, retire the
    generation a rebase replaced once this one has committed a batch, and report.

    ``lease`` raises when this job no longer holds the checkpoint; it is asked before the
    mirrors are written, just before the cut is recorded, and again before a batch is reported
    or a generation retired: a job paused past its lease inside a batch may finish that batch's
    idempotent writes (the cut never moves backwards), but it reports nothing and stops."""

    config: PipelineConfig
    plan: Plan
    stats: JobStats
    log: Logger
    metrics: PipelineMetrics
    generation: Generation
    lease: Callable[[], None] = lambda: None
    _app_id: str | None = field(default=None, init=False)
    _changelog_id: str = field(default="", init=False)
    _retired: bool = field(default=False, init=False)
    _foreign: ForeignCommitCheck = field(
        default_factory=lambda: ForeignCommitCheck(DeltaCommits()), init=False
    )

    def __call__(self, batch: Any, batch_id: int) -> None:
        config = self.config
        started = time.monotonic()
        if self._app_id is None:
            self._app_id = f"{config.job_id}:{checkpoint_id(config.checkpoint_uri)}"
        self.lease()
        offset = cut.batch_end_offset(config.checkpoint_uri, batch_id)
        applied = self._applied(batch_id, offset)
        metadata = batch_log.commit_metadata(applied.watermark_text, batch_id)
        if self.plan.processors:
            batch = batch.persist()
            mirrored = batch.where(F.col(OUTPUT_COLUMN).isNull()).select(*self._mirror_columns)
        else:
            mirrored = batch
        with self.metrics.batch_running():
            result = write_batch(
                mirrored,
                batch_id,
                self.plan.shapes,
                config.mirror_root,
                self._app_id,
                self.log,
                config.local_merge_max_rows,
                config.local_merge_max_mb * 1024 * 1024,
                self.plan.histories,
                metadata,
                self._foreign,
            )
            self._append_outputs(batch, batch_id, metadata)
        if self.plan.processors:
            batch.unpersist()
        position = None if offset is None else self._cut(offset, batch_id)
        self.lease()
        if position is not None:
            cut.record(config.mirror_root, position)
        batch_log.record(
            config.mirror_root,
            replace(
                applied,
                mirror_versions=result.mirror_versions,
                history_versions=result.history_versions,
            ),
            self._app_id,
            self.log,
        )
        self.lease()
        if batch_id >= 1 and not self._retired:
            retire_replaced(self.generation, self.log)
            self._retired = True
        self._report(result, batch_id, time.monotonic() - started)

    def _report(self, result: BatchResult, batch_id: int, seconds: float) -> None:
        self.stats.batches += 1
        self.stats.rows_merged += sum(result.rows.values())
        self.metrics.batch_landed(result.rows, result.newest_commit)
        self.log.info(
            "pipeline_batch",
            batch_id=batch_id,
            rows=result.rows,
            newest_commit=result.newest_commit,
            merged_on="driver" if result.merged_on_driver else "spark" if result.rows else "-",
            bytes=result.bytes,
            seconds=round(seconds, 3),
        )

    def _cut(self, offset: dict[str, object], batch_id: int) -> cut.Cut:
        """Where the mirrors stand after this batch, naming the change log they belong to."""
        if not self._changelog_id:
            self._changelog_id = cut.changelog_id(self.config.changelog_uri)
        return cut.Cut(
            cut.next_version(offset), self.generation.number, batch_id, self._changelog_id
        )

    @property
    def _mirror_columns(self) -> list[str]:
        return output_schema(self.plan.shapes, self.plan.kept).fieldNames()

    def _append_outputs(self, batch: Any, batch_id: int, metadata: dict[str, str]) -> None:
        """Each processor's rows of the batch, appended once to its table."""
        assert self._app_id is not None
        for processor in self.plan.processors:
            name = processor.name
            rows = batch.where(F.col(OUTPUT_COLUMN) == name).select(f"{output_column(name)}.*")
            _, appended = append_batch(
                rows,
                output_uri(self.config.processor_root, name),
                self._app_id,
                batch_id,
                self.config.local_merge_max_rows,
                self.log,
                metadata,
            )
            self.metrics.processor_rows.labels(name).inc(appended)

    def _applied(self, batch_id: int, offset: dict[str, object] | None) -> batch_log.AppliedBatch:
        """Where the batch leaves the mirrors: the last change-log version it applies whole,
        that version's W, and whether the mirrors then equal Spanner at W."""
        whole = -1 if offset is None else cut.next_version(offset) - 1
        ends_a_version = offset is not None and int(str(offset["index"])) in (
            cut.END_INDEX,
            cut.BASE_INDEX,
        )
        checkpoint = checkpoint_at(self.config.changelog_uri, whole) if whole >= 0 else None
        start = None
        if checkpoint is not None:
            begins = checkpoint.snapshot.read_timestamp if checkpoint.snapshot else None
            begins = begins if begins is not None else checkpoint.job_start
            start = None if begins is None else to_rfc3339(begins)
        return batch_log.AppliedBatch(
            batch_id=batch_id,
            generation=self.generation.number,
            changelog_version=whole,
            watermark_text=(
                None if checkpoint is None else to_rfc3339(checkpoint.resume_point.low_watermark)
            ),
            consistent=ends_a_version and checkpoint is not None and checkpoint.consistent,
            changelog_start_text=start,
        )
