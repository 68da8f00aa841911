"""The snapshot of a Spark source's job, read on the executors: each table cut into key ranges
fixed in the checkpoint (``snapshot.parts``), each range read at T0 by a task that writes its rows
as Parquet into the change log's folder, and the driver committing each task's files with the
range's progress. Joined to the stream as the service's snapshot is: rows at T0, the stream from
T0 on, and keys an earlier job left alive deleted with a table's last range.

Key ranges rather than Spanner's partitioned queries: a partition token lives only as long as the
``BatchSnapshot`` transaction that made it, so a new driver cannot ask for the same partitions
again, and a partition's rows come in no order, so a task cut short cannot go on from a landed key.
Ranges read in key order can (bench/RESULTS.md compares the two reads' rates).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from ingest.changestream import query
from ingest.changestream.opening import OpenedStream
from ingest.contract.changelog import (
    column_types_json,
    key_from_json,
    key_to_json,
    parse_column_types,
)
from ingest.delta.absent_keys import absent_keys, holds_rows_before
from ingest.delta.sink import DeltaChangeLogSink
from ingest.delta.snapshot_files import SnapshotFile, SnapshotFileWriter, read_keys
from ingest.job.config import JobConfig
from ingest.job.snapshot_window import open_snapshot
from ingest.model.records import ColumnType, WatchedColumns
from ingest.model.snapshot import Key, PartProgress, SnapshotChunk, SnapshotProgress
from ingest.model.timestamps import Nanos, parse_rfc3339, to_rfc3339
from ingest.rules.snapshot_parts import PartToRead
from ingest.snapshot.parts import PartRead, PartSettings, read_parts, read_range, split_tables
from ingest.snapshot.reader import count_rows, read_table, sample_keys
from ingest.sparksource.source import spanner_database
from runtime.logs import Logger

NAME = "spanner_snapshot_part"
PART_SCHEMA = "file STRING, rows BIGINT, last_key STRING, done BOOLEAN"
FILE_BYTES = 128 * 1024 * 1024
"""A task's Parquet files are cut at about this size."""


@dataclass(frozen=True, slots=True)
class PartTask:
    """What one task needs to read a range and write its rows (the ``part`` option, JSON)."""

    project: str
    instance: str
    database: str
    table_uri: str
    table: str
    column_types: str
    read_timestamp: str
    after: list[Any] | None
    end: list[Any] | None
    budget_bytes: int
    chunk_rows: int
    chunk_bytes: int

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> PartTask:
        return PartTask(**json.loads(text))


class SnapshotPartSource(DataSource):
    """One range of one table, read by one task (``spark.read`` with the ``part`` option)."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> str:
        return PART_SCHEMA

    def reader(self, schema: Any) -> DataSourceReader:
        return PartReader(PartTask.from_json(self.options["part"]))


class PartReader(DataSourceReader):
    def __init__(self, task: PartTask) -> None:
        self.task = task

    def partitions(self) -> Sequence[InputPartition]:
        return [InputPartition(0)]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        return run_part_task(self.task)


def run_part_task(task: PartTask) -> Iterator[tuple[Any, ...]]:
    """On an executor: the range from just after its landed key into Parquet files; one row per
    file written, then one row saying how far the range got."""
    database = spanner_database(task.project, task.instance, task.database)
    columns = tuple(parse_column_types(task.column_types))
    read_timestamp = parse_rfc3339(task.read_timestamp)

    def read(after: Key | None, end: Key | None) -> Iterator[SnapshotChunk]:
        return read_table(
            database,
            task.table,
            columns,
            read_timestamp,
            after,
            task.chunk_rows,
            chunk_bytes=task.chunk_bytes,
            end_key=end,
        )

    writer = SnapshotFileWriter(task.table_uri, read_timestamp, FILE_BYTES)
    part = PartProgress(key_from_json(task.after), key_from_json(task.end))
    done = read_range(read, part, lambda chunk: writer.write([chunk]), task.budget_bytes)
    for written in writer.close():
        yield (written.to_json(), None, None, None)
    last_key = json.dumps(list(done.last_key)) if done.last_key is not None else None
    yield (None, done.rows, last_key, done.done)


@dataclass(frozen=True, slots=True)
class SparkSnapshotSettings:
    tasks: int
    most_parts: int
    task_bytes: int


@dataclass(frozen=True, slots=True)
class SparkSnapshot:
    """The driver's side: ranges read as one-task Spark jobs, their files committed by the
    service's sink (the job's only writer, fenced as every commit is)."""

    session: Any
    config: JobConfig
    sink: DeltaChangeLogSink
    columns: WatchedColumns
    read_timestamp: Nanos
    settings: SparkSnapshotSettings
    log: Logger
    on_reads: Callable[[Sequence[PartRead]], None]

    def read_part(self, part: PartToRead) -> PartRead:
        task = PartTask(
            self.config.project,
            self.config.instance,
            self.config.database,
            self.config.table_uri,
            part.table,
            column_types_json(self.columns[part.table]),
            to_rfc3339(self.read_timestamp),
            key_to_json(part.part.resume_after),
            key_to_json(part.part.end),
            self.settings.task_bytes,
            self.config.snapshot_chunk_rows,
            self.config.snapshot_chunk_mb * 1024 * 1024,
        )
        rows = self.session.read.format(NAME).option("part", task.to_json()).load().collect()
        files = tuple(SnapshotFile.from_json(r.file) for r in rows if r.file is not None)
        (summary,) = [r for r in rows if r.file is None]
        last_key = (
            key_from_json(json.loads(summary.last_key)) if summary.last_key is not None else None
        )
        return PartRead(part.table, part.index, summary.rows, last_key, summary.done, files)

    def commit_parts(self, reads: Sequence[PartRead], progress: SnapshotProgress) -> object:
        """The reads' files, and with a table's last range the deletes of keys an earlier job
        left alive that the snapshot did not find, in one commit."""
        written = {
            table: _files(r for r in reads if r.table == table)
            for table in {r.table for r in reads}
        }
        files = [f for table_files in written.values() for f in table_files]
        rows = sum(r.rows for r in reads)
        for table in sorted(t for t in written if progress.table(t).done):
            deletes = self._deletes(table, written[table])
            files += deletes
            rows += sum(f.rows for f in deletes)
        landed = self.sink.commit_snapshot_files([f.add_action() for f in files], rows, progress)
        self.on_reads(reads)
        return landed

    def _deletes(self, table: str, landing: list[SnapshotFile]) -> list[SnapshotFile]:
        changelog = self.sink.table()
        if changelog is None or not holds_rows_before(changelog, table, self.read_timestamp):
            return []
        found = read_keys(self.config.table_uri, landing)
        deleted = absent_keys(changelog, table, self.read_timestamp, found)
        if not deleted:
            return []
        writer = SnapshotFileWriter(self.config.table_uri, self.read_timestamp, FILE_BYTES)
        columns: tuple[ColumnType, ...] = self.columns[table]
        writer.write([SnapshotChunk(table, columns, [], None, True, tuple(deleted))])
        self.log.info("snapshot_keys_deleted", table=table, keys=len(deleted))
        return writer.close()


def _files(reads: Iterable[PartRead]) -> list[SnapshotFile]:
    files = [f for r in reads for f in r.files]
    wrong = [f for f in files if not isinstance(f, SnapshotFile)]
    if wrong:
        raise TypeError(f"a range read handed over {type(wrong[0]).__name__}, not a SnapshotFile")
    return [f for f in files if isinstance(f, SnapshotFile)]


def snapshot_in_tasks(
    session: Any,
    opened: OpenedStream,
    config: JobConfig,
    settings: SparkSnapshotSettings,
    progress: SnapshotProgress,
    sink: DeltaChangeLogSink,
    log: Logger,
    stop: threading.Event,
    table_rows: dict[str, int] | None = None,
    on_reads: Callable[[Sequence[PartRead]], None] = lambda _: None,
) -> SnapshotProgress:
    """Fix the ranges of tables not split yet, then read every range not done on the
    executors; refused once T0 is out of reach. ``table_rows``: its rows at T0 per table, when
    the job's start just counted them (a resumed job counts them here, unless the estimate is
    off). The progress reached (complete unless stopped)."""
    read_at = progress.read_timestamp
    window = open_snapshot(opened, config, progress, table_rows, log, tasks=settings.tasks)
    postgresql = opened.dialect is query.Dialect.POSTGRESQL
    columns = opened.watched_columns(read_at)
    part_settings = PartSettings(
        settings.tasks, settings.most_parts, expected_rows=window.expected, deadline=window.deadline
    )

    def count(table: str) -> int:
        """Counted once: the window's count when it has one."""
        if window.table_rows is not None and table in window.table_rows:
            return window.table_rows[table]
        return count_rows(opened.database, table, read_at, postgresql)

    def sample(table: str, rows: int) -> list[Key]:
        keys = tuple(c for c in columns[table] if c.is_primary_key)
        return sample_keys(opened.database, table, keys, read_at, rows, postgresql)

    session.dataSource.register(SnapshotPartSource)
    spark_snapshot = SparkSnapshot(session, config, sink, columns, read_at, settings, log, on_reads)
    try:
        with window.out_of_reach_named():
            progress = split_tables(
                progress,
                count,
                sample,
                part_settings,
                lambda split: sink.commit_snapshot([], split),
                log,
            )
            return read_parts(
                progress, spark_snapshot.read_part, spark_snapshot, part_settings, log, stop
            )
    finally:
        if stop.is_set():
            session.sparkContext.cancelAllJobs()
