"""The Delta change-log sink: one Delta commit per consistent cut, exactly once.

Each commit appends the rows of whole transactions with W(previous) < commit timestamp ≤ W and
carries, atomically, an application transaction (job id, version n) and the checkpoint to resume
from W. Exactly once: before writing version n the sink reads the job's landed version; a replayed
n is skipped, never written twice.

One writer per job: the app transaction is also the fence. A writer only commits n when the
table's version for the job is n - 1, and Delta refuses a commit carrying the job's app id that
races another one (ConcurrentTransaction), on a local path and on object stores alike, because it
rests on the Delta log's own atomic commit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa
import structlog
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.exceptions import CommitFailedError, TableNotFoundError
from deltalake.transaction import AddAction
from tenacity import (
    Retrying,
    retry_if_exception,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential_jitter,
)

from ingest.contract.changelog import (
    CHECKPOINT_KEY,
    PARTITION_COLUMNS,
    SCHEMA,
    Checkpoint,
    checkpoints_newest_first,
    to_json,
)
from ingest.delta import changelog
from ingest.delta.version_checksum import write_version_checksum
from ingest.model.records import ColumnType
from ingest.model.records import Transaction as SpannerTransaction
from ingest.model.resume import ResumePoint, start_point
from ingest.model.snapshot import SnapshotChunk, SnapshotProgress
from ingest.model.timestamps import Nanos
from runtime.errors import ReportedError
from runtime.logs import null_logger
from runtime.storage import (
    delta_commit_retries,
    delta_storage_options,
    delta_write_mode,
    table_created_meanwhile,
)

TABLE_CONFIGURATION = {"delta.appendOnly": "true"}
WriteCommit = Callable[[DeltaTable | None, CommitProperties], None]
"""One commit's write: (the table, None before its first commit; the job's commit properties:
its app transaction and checkpoint)."""


class WriterFenced(ReportedError, RuntimeError):
    """Another process committed for this job: this one must stop writing."""


@dataclass(frozen=True, slots=True)
class CommitResult:
    version: int
    delta_version: int | None
    rows: int
    transactions: int
    replayed: bool


@dataclass(frozen=True, slots=True)
class Maintenance:
    log_checkpoint_every: int = 100
    """Delta log checkpoint every N table versions, so readers never replay a long JSON log."""
    compact_every: int = 500
    """Compaction of small files every N table versions (dataChange=false: streams skip it)."""
    version_checksums: bool = True
    """A checksum beside each version the sink makes, so Spark readers take the protocol and
    metadata from it instead of a job (``ingest.delta.version_checksum``)."""


class DeltaChangeLogSink:
    def __init__(
        self,
        table_uri: str,
        job_id: str,
        owner: str,
        storage_options: dict[str, str] | None = None,
        maintenance: Maintenance | None = None,
        log: structlog.typing.FilteringBoundLogger | None = None,
        wall_clock: Callable[[], Nanos] = time.time_ns,
        retry_attempts: int = 8,
    ) -> None:
        self._uri = table_uri
        self._job_id = job_id
        self._owner = owner
        self._storage_options = (
            storage_options if storage_options is not None else delta_storage_options(table_uri)
        )
        self._maintenance = maintenance or Maintenance()
        self._log = log or null_logger()
        self._wall_clock = wall_clock
        self._retry_attempts = retry_attempts
        self._next_version = 1
        self._job_start: Nanos | None = None
        self._snapshot: SnapshotProgress | None = None
        self._table_snapshot: SnapshotProgress | None = None
        self._resume_point: ResumePoint | None = None
        """The resume point of this process's newest commit."""
        self._landed: Checkpoint | None = None
        """The checkpoint of this process's newest commit, landed."""

    @property
    def job_id(self) -> str:
        return self._job_id

    def table(self) -> DeltaTable | None:
        try:
            return DeltaTable(self._uri, storage_options=self._storage_options)
        except TableNotFoundError:
            return None

    def latest_checkpoint(self) -> Checkpoint | None:
        table = self.table()
        if table is None:
            return None
        version = table.transaction_version(self._job_id)
        if version is None:
            return None
        return self.checkpoint(version, table)

    def checkpoint(self, version: int, table: DeltaTable | None = None) -> Checkpoint:
        """The checkpoint the job's commit ``version`` carries."""
        if self._landed is not None and self._landed.version == version:
            return self._landed
        table = table or self.table()
        checkpoint = self._checkpoint_at(table, version) if table is not None else None
        if checkpoint is None:
            raise RuntimeError(
                f"table {self._uri} records version {version} of job {self._job_id} "
                "but no commit carries its checkpoint"
            )
        return checkpoint

    def _checkpoint_at(self, table: DeltaTable, version: int) -> Checkpoint | None:
        """The newest commit first: a commit's checkpoint lists every partition (hundreds of
        KiB at thousands of partitions), and the version asked for is usually the newest."""
        for _, checkpoint in checkpoints_newest_first(table, pages=(1, 50, None)):
            if checkpoint.job_id == self._job_id and checkpoint.version == version:
                return checkpoint
        return None

    def continue_after(self, checkpoint: Checkpoint | None) -> None:
        """Take over the job from its newest checkpoint (or start it)."""
        self._next_version = (checkpoint.version if checkpoint else 0) + 1
        self._job_start = checkpoint.job_start if checkpoint else None
        self._snapshot = checkpoint.snapshot if checkpoint else None
        self._table_snapshot = checkpoint.table_snapshot if checkpoint else None

    @property
    def snapshot(self) -> SnapshotProgress | None:
        """The initial snapshot's progress the commits carry."""
        return self._snapshot

    @property
    def table_snapshot(self) -> SnapshotProgress | None:
        return self._table_snapshot

    def track_table_snapshot(self, progress: SnapshotProgress | None) -> None:
        """The on-demand snapshot's progress the next commits carry (None: none running); its
        chunks land at its read timestamp."""
        self._table_snapshot = progress

    def start_job(
        self,
        start: Nanos,
        snapshot: SnapshotProgress | None = None,
        watched: Mapping[str, tuple[ColumnType, ...]] | None = None,
    ) -> CommitResult:
        """Make a new job's start durable before anything is read: version 1 holds no change
        and a checkpoint to resume from ``start``, so a crash before the first data commit cannot
        move the start forward and skip what was committed in between. A job that snapshots
        records the snapshot's T0 and tables here too, and a schema row of each table's
        ``watched`` columns: the pipeline knows every table before its first row lands."""
        self._job_start = start
        self._snapshot = snapshot
        return self.commit([], start_point(start), watched)

    def commit_snapshot(
        self, chunks: Sequence[SnapshotChunk], progress: SnapshotProgress
    ) -> CommitResult:
        """Land snapshot rows with the progress they reach, atomically: a restart reads each
        table again from just after the last key this commit records."""
        self._snapshot = progress
        return self.commit([], start_point(self._job_start or 0), snapshot=chunks)

    def commit(
        self,
        transactions: Sequence[SpannerTransaction],
        resume_point: ResumePoint,
        watched: Mapping[str, tuple[ColumnType, ...]] | None = None,
        snapshot: Sequence[SnapshotChunk] = (),
        lease_released: bool = False,
    ) -> CommitResult:
        """Land whole transactions up to the resume point's low watermark, and schema rows of
        the tables whose ``watched`` columns (read at that watermark) changed."""
        reading = self._table_snapshot or self._snapshot
        snapshot_at = reading.read_timestamp if reading is not None else 0
        rows = changelog.to_arrow(
            transactions, watched, resume_point.low_watermark, snapshot, snapshot_at
        )
        return self._land(
            self._append(rows), rows.num_rows, len(transactions), resume_point, lease_released
        )

    def commit_rows(
        self,
        rows: pa.Table,
        transactions: int,
        resume_point: ResumePoint,
        watched: Mapping[str, tuple[ColumnType, ...]] | None = None,
    ) -> CommitResult:
        """Land change-log rows built elsewhere (a Spark source's tasks): the rows of
        ``transactions`` whole transactions up to the resume point's low watermark, in commit
        order; schema rows of ``watched`` are added as ``commit`` adds them."""
        schema_rows = changelog.to_arrow([], watched, resume_point.low_watermark)
        rows = pa.concat_tables([rows.select(schema_rows.schema.names), schema_rows])
        return self._land(
            self._append(rows),
            rows.num_rows,
            transactions,
            resume_point,
            lease_released=False,
        )

    def commit_snapshot_files(
        self, files: Sequence[AddAction], rows: int, progress: SnapshotProgress
    ) -> CommitResult:
        """Land Parquet files of snapshot rows that tasks wrote into the table's folder (their
        ``rows`` in all) with the progress they reach, atomically: until this commit they are
        no part of the table, so a task that died or a driver that died before it leaves only
        files no version references."""
        self._snapshot = progress

        def write(table: DeltaTable | None, properties: CommitProperties) -> None:
            if table is None:
                raise RuntimeError(f"no change log at {self._uri}: a job's start creates it")
            table.create_write_transaction(
                list(files),
                mode="append",
                schema=SCHEMA,
                partition_by=PARTITION_COLUMNS,
                commit_properties=properties,
            )

        return self._land(write, rows, 0, start_point(self._job_start or 0), False)

    def _append(self, rows: pa.Table) -> WriteCommit:
        """The commit of ``rows`` appended (the table created by the first)."""

        def write(table: DeltaTable | None, properties: CommitProperties) -> None:
            write_deltalake(
                table if table is not None else self._uri,
                rows,
                mode=delta_write_mode(creates_table=table is None),
                partition_by=PARTITION_COLUMNS,
                configuration=TABLE_CONFIGURATION if table is None else None,
                storage_options=self._storage_options if table is None else None,
                commit_properties=properties,
            )

        return write

    def _land(
        self,
        write: WriteCommit,
        row_count: int,
        transactions: int,
        resume_point: ResumePoint,
        lease_released: bool,
    ) -> CommitResult:
        version = self._next_version
        checkpoint = Checkpoint(
            self._job_id,
            version,
            self._owner,
            self._wall_clock(),
            resume_point,
            self._job_start,
            self._snapshot,
            self._table_snapshot,
            lease_released,
        )
        retrying = Retrying(
            retry=retry_if_exception_type((CommitFailedError, OSError))
            | retry_if_exception(table_created_meanwhile),
            wait=wait_exponential_jitter(multiplier=0.05, max=5),
            stop=stop_after_attempt(self._retry_attempts),
            before_sleep=lambda state: self._log.warning(
                "delta_commit_retry",
                version=version,
                attempt=state.attempt_number,
                cause=repr(state.outcome.exception()) if state.outcome else None,
            ),
            reraise=True,
        )
        for attempt in retrying:
            with attempt:
                replayed = self._write_once(version, write, checkpoint)
        self._next_version = version + 1
        self._resume_point = resume_point
        self._landed = checkpoint
        table = self.table()
        delta_version = table.version() if table is not None else None
        if table is not None and not replayed:
            self._add_checksum(table)
            self._maintain(table)
        return CommitResult(version, delta_version, row_count, transactions, replayed)

    def release_lease(self) -> CommitResult | None:
        """A clean stop's last commit: no rows, the newest checkpoint again, marked released, so
        the next process writes at once instead of waiting out the lease. Fencing is unchanged:
        a writer still commits version n only at n - 1. None when this process holds nothing."""
        if self._resume_point is None:
            return None
        return self.commit([], self._resume_point, lease_released=True)

    def _write_once(self, version: int, write: WriteCommit, checkpoint: Checkpoint) -> bool:
        """Write version n once; True when it had landed already (a retried commit). The commit
        that creates the table is retried here only (``delta_commit_retries``) and fails if
        another writer created it since ``table`` looked (``delta_write_mode``)."""
        table = self.table()
        landed = table.transaction_version(self._job_id) if table is not None else None
        if landed is not None and landed >= version:
            existing = self._checkpoint_at(table, version) if table is not None else None
            if existing is not None and existing.owner == self._owner:
                return True
            raise WriterFenced(
                f"job {self._job_id} version {version} was committed by another process "
                f"({existing.owner if existing else 'unknown'}); this one stops writing"
            )
        if (landed or 0) != version - 1:
            raise WriterFenced(
                f"job {self._job_id} is at version {landed} in {self._uri}, expected "
                f"{version - 1}: another process writes this job"
            )
        write(
            table,
            CommitProperties(
                app_transactions=[Transaction(self._job_id, version)],
                custom_metadata={CHECKPOINT_KEY: to_json(checkpoint)},
                max_commit_retries=delta_commit_retries(creates_table=table is None),
            ),
        )
        return False

    def _add_checksum(self, table: DeltaTable) -> None:
        if self._maintenance.version_checksums:
            write_version_checksum(table, self._uri, self._log)

    def _maintain(self, table: DeltaTable) -> None:
        delta_version = table.version()
        if delta_version and delta_version % self._maintenance.compact_every == 0:
            metrics = table.optimize.compact()
            self._log.info(
                "delta_compacted",
                files_added=metrics.get("numFilesAdded"),
                files_removed=metrics.get("numFilesRemoved"),
            )
            table = self.table() or table
            self._add_checksum(table)
        if delta_version and delta_version % self._maintenance.log_checkpoint_every == 0:
            table.create_checkpoint()
            self._log.info("delta_log_checkpoint", delta_version=table.version())
