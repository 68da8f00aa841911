"""The change stream as a Spark streaming data source (PySpark's Python data source API).

Offsets name the batch, not the data: ``version`` is the job's change-log version a batch is
planned from, ``end`` its end timestamp. The resume point itself (low watermark, partitions,
finished parents) is the checkpoint that version's commit carries, so a batch Spark replays
after a crash plans exactly the tasks it planned the first time, and every next batch plans from
what the change log holds. On the driver, ``latestOffset`` picks the end and ``partitions``
plans one read per ready partition (``rules.batches``), ``partitions_per_task`` reads a task;
each task runs ``task.read_partitions`` on an executor. ``reader`` serves a batch's further
waves (``landing``) as a batch read.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import pyarrow as pa
from google.cloud import spanner
from google.cloud.spanner_v1.database import Database
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows

from ingest.changestream.query import ChangeStreamQuery, Dialect, validate_heartbeat
from ingest.changestream.retries import RetryPolicy
from ingest.contract.changelog import Checkpoint
from ingest.delta.sink import DeltaChangeLogSink
from ingest.model.timestamps import NANOS_PER_SECOND, parse_rfc3339, to_rfc3339
from ingest.rules.batches import PartitionRead, plan_batch, share_of
from ingest.sparksource.rows import SPARK_SCHEMA, BatchIdentity, task_batches
from ingest.sparksource.task import read_partitions

NAME = "spanner_change_stream"
ROWS_PER_ARROW_BATCH = 4096
"""Change-log rows per Arrow batch a task hands Spark: memory per task stays bounded."""


@dataclass(frozen=True, slots=True)
class SourceOptions:
    """The source's options, as strings through ``DataStreamReader.option`` and back."""

    project: str
    instance: str
    database: str
    stream: str
    dialect: str
    """Resolved (``googlesql`` or ``postgresql``): tasks do not look it up again."""
    mutable_key_range: bool
    table_uri: str
    job_id: str
    heartbeat_ms: int = 1000
    settle_margin_s: float = 1.0
    max_batch_span_s: float = 60.0
    """A batch ends at most this long after the low watermark it starts from: a catch-up after
    downtime comes in bounded batches."""
    max_partitions_per_batch: int = 0
    """Partitions read per batch, lowest watermark first (0: every ready partition)."""
    max_records_per_batch: int = 0
    """Data change records per batch, shared among its partitions (0: no limit); Spark's
    ``ReadMaxRows``."""
    partitions_per_task: int = 8
    """Partitions one task reads, one after the other: a task costs Spark far more than a
    query, so thousands of partitions go in groups."""

    def __post_init__(self) -> None:
        validate_heartbeat(self.heartbeat_ms)  # a user's .option() reaches tasks unchecked

    def to_options(self) -> dict[str, str]:
        return {f.name: str(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_options(cls, options: dict[str, str]) -> SourceOptions:
        parsers: dict[str, Callable[[str], Any]] = {
            "int": int,
            "float": float,
            "bool": lambda text: text == "True",
            "str": str,
        }
        return cls(**{f.name: parsers[str(f.type)](options[f.name]) for f in fields(cls)})


class TaskInput(InputPartition):
    """One task: the partitions it reads, the batch it reports to, how it reaches Spanner."""

    def __init__(
        self, reads: list[PartitionRead], batch: BatchIdentity, options: SourceOptions
    ) -> None:
        super().__init__(len(reads))
        self.reads = reads
        self.batch = batch
        self.options = options


class ChangeStreamDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> str:
        return SPARK_SCHEMA

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        return ChangeStreamStreamReader(SourceOptions.from_options(dict(self.options)))

    def reader(self, schema: Any) -> DataSourceReader:
        """A further wave of a batch (``spark.read`` with the ``wave`` option), which the
        landing runs for partitions that became ready within the batch."""
        options = dict(self.options)
        reads, batch = parse_wave(options.pop(WAVE))
        return WaveReader(SourceOptions.from_options(options), reads, batch)


class WaveReader(DataSourceReader):
    def __init__(
        self, options: SourceOptions, reads: list[PartitionRead], batch: BatchIdentity
    ) -> None:
        self.options, self.reads, self.batch = options, reads, batch

    def partitions(self) -> Sequence[InputPartition]:
        return tasks_of(self.reads, self.batch, self.options)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, TaskInput)
        return read_task(partition)


class ChangeStreamStreamReader(DataSourceStreamReader):
    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self._sink = DeltaChangeLogSink(options.table_uri, options.job_id, owner="")
        self._newest: Checkpoint | None = None
        """The checkpoint ``latestOffset`` planned from: ``partitions`` asks for it next."""

    def initialOffset(self) -> dict[str, Any]:
        checkpoint = self._sink.latest_checkpoint()
        if checkpoint is None:
            raise RuntimeError(
                f"no change log of job {self.options.job_id} in {self.options.table_uri}: "
                "the job records its start before the source reads"
            )
        return {
            "version": checkpoint.version,
            "end": to_rfc3339(checkpoint.resume_point.low_watermark),
        }

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.options.max_records_per_batch:
            return ReadMaxRows(self.options.max_records_per_batch)
        return ReadAllAvailable()

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        """The next batch: from the newest checkpoint to what has settled, at most the span."""
        checkpoint = self._newest = self._sink.latest_checkpoint()
        if checkpoint is None:
            return start
        low = checkpoint.resume_point.low_watermark
        settled = time.time_ns() - int(self.options.settle_margin_s * NANOS_PER_SECOND)
        end = min(settled, low + int(self.options.max_batch_span_s * NANOS_PER_SECOND))
        if end <= low:
            return start
        max_rows = limit.max_rows if isinstance(limit, ReadMaxRows) else 0
        return {"version": checkpoint.version, "end": to_rfc3339(end), "max_records": max_rows}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        if "max_records" not in end:
            return []
        version, batch_end = end["version"], parse_rfc3339(end["end"])
        newest = self._newest
        planned_from = newest if newest and newest.version == version else None
        resume = (planned_from or self._sink.checkpoint(version)).resume_point
        limit = self.options.max_partitions_per_batch or None
        budget = end["max_records"] or None
        reads = plan_batch(resume, batch_end, limit)
        if budget is not None:
            reads = plan_batch(resume, batch_end, limit, share_of(budget, len(reads)))
        batch = BatchIdentity(version, batch_end, len(reads), budget)
        return tasks_of(reads, batch, self.options)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, TaskInput)
        return read_task(partition)


def tasks_of(
    reads: list[PartitionRead], batch: BatchIdentity, options: SourceOptions
) -> list[InputPartition]:
    size = options.partitions_per_task
    return [TaskInput(reads[i : i + size], batch, options) for i in range(0, len(reads), size)]


def read_task(task: TaskInput) -> Iterator[pa.RecordBatch]:
    """What one task yields: its partitions' rows and reports (``task.read_partitions``)."""
    options = task.options
    source = ChangeStreamQuery(
        spanner_database(options.project, options.instance, options.database),
        options.stream,
        Dialect(options.dialect),
        options.heartbeat_ms,
        options.mutable_key_range,
    )
    items = read_partitions(source, task.reads, RetryPolicy(), time.sleep)
    yield from task_batches(items, task.batch, ROWS_PER_ARROW_BATCH)


WAVE = "wave"


def wave_json(reads: list[PartitionRead], batch: BatchIdentity) -> str:
    return json.dumps(
        {
            "version": batch.version,
            "end": to_rfc3339(batch.end),
            "partitions": batch.partitions,
            "max_records": batch.max_records,
            "reads": [[r.token, to_rfc3339(r.start), r.max_records] for r in reads],
        }
    )


def parse_wave(text: str) -> tuple[list[PartitionRead], BatchIdentity]:
    data = json.loads(text)
    end = parse_rfc3339(data["end"])
    reads = [
        PartitionRead(token, parse_rfc3339(start), end, limit)
        for token, start, limit in data["reads"]
    ]
    return reads, BatchIdentity(data["version"], end, data["partitions"], data["max_records"])


@functools.lru_cache(maxsize=8)
def spanner_database(project: str, instance: str, database: str) -> Database:
    """One client per executor's Python worker and database: Spark reuses its workers across
    tasks, and a client (sessions, channels) costs far more than a query."""
    return spanner.Client(project=project).instance(instance).database(database)
