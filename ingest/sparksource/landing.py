"""Each micro-batch of the Spark source lands as one change-log commit (``foreachBatch`` on the
driver): the batch's cut from its tasks' reports (``rules.batches``), the rows at or below it
checked whole and put in commit order, committed with the cut's resume point by the service's
sink, so the change log and its checkpoints are the service's own.

Each batch logs ``spark_batch`` (its outcome, partitions read, rows kept and dropped above the
cut); each commit logs ``delta_commit`` with the service's fields, so what watches the service's
commits watches these.

Exactly once: a batch is planned from the job's change-log version v and lands v + 1 only while
the job is at v (the sink's fence). A batch the query replays after it failed in this driver
finds v + 1 landed by the sink's own owner and lands nothing; one whose v + 1 another writer
landed while this query was down (a driver killed before it, whose owner was its own; the
service, during a hand-over) is fenced off as the first batch of this driver: superseded, it
lands nothing, and the next batch plans from the newest checkpoint. While the query runs,
another writer's commit fences it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pyarrow as pa
import pyarrow.compute as pc

from ingest.contract.changelog import SCHEMA, Checkpoint, in_total_order
from ingest.delta.landing import ChangeLogLanding
from ingest.delta.sink import CommitResult, WriterFenced
from ingest.model.records import WatchedColumns
from ingest.model.resume import ResumePoint
from ingest.model.timestamps import NANOS_PER_SECOND, Nanos, to_rfc3339
from ingest.rules.assembler import IncompleteTransactionError, InconsistentTransactionError
from ingest.rules.batches import BatchCut, BatchPlanError, PartitionRead, PartitionReport
from ingest.sparksource.rows import COMMIT_NANOS, REPORT, BatchIdentity, parse_report

ReadWave = Callable[[list[PartitionRead], BatchIdentity], pa.Table]
"""Reads a wave's partitions on the executors: the rows and reports its tasks send."""


@dataclass(frozen=True, slots=True)
class LandedBatch:
    batch_id: int
    version: int | None
    """The job's change-log version this batch landed; None when it landed nothing."""
    low_watermark: Nanos
    end: Nanos
    partitions: int
    """Partitions read: those planned and the children tasks followed."""
    transactions: int
    rows: int
    rows_above_cut: int
    records_read: int
    """Data change records the batch's tasks read, every wave's (what its records limit
    bounds)."""
    outcome: str
    """``landed``, ``replayed`` (landed before a crash) or ``superseded`` (another writer)."""
    commit_timestamps: tuple[Nanos, ...] = ()
    """Of the transactions this batch landed (none when it landed nothing)."""


class DuplicateRecordError(RuntimeError):
    """A batch holds a change-log row twice: a task yielded a record twice (a bug)."""


@dataclass(eq=False)
class BatchLanding:
    """Lands the Spark source's micro-batches in the change log (``__call__``: ``foreachBatch``).

    ``read_wave`` reads a further wave of a batch (partitions that became ready within it) on the
    executors, at most ``max_waves`` waves per batch in all; without it every such partition
    lowers the cut."""

    landing: ChangeLogLanding
    monotonic: Callable[[], float] = time.monotonic
    on_landed: Callable[[LandedBatch], None] | None = None
    read_wave: ReadWave | None = None
    max_waves: int = 4
    _landed_any: bool = field(default=False, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    """Held while a batch lands: the lease is handed over only between batches."""
    _handed_over: bool = field(default=False, init=False)

    def __call__(self, frame: object, batch_id: int) -> None:
        self.land(frame.toArrow(), batch_id)  # type: ignore[attr-defined]

    def hand_over(self) -> CommitResult | None:
        """A clean stop's last commit (the lease released), once no batch is landing; no batch
        lands after it. A stopped query's batch may still be finishing on its callback thread."""
        with self._lock:
            self._handed_over = True
            return self.landing.sink.release_lease()

    def land(self, batch: pa.Table, batch_id: int) -> LandedBatch | None:
        """None for a batch that planned nothing (Spark's first batch of a job whose start has
        not settled yet: its offsets are equal), or that came after the hand-over."""
        with self._lock:
            if batch.num_rows == 0 or self._handed_over:
                return None
            return self._land(batch, batch_id)

    def _land(self, batch: pa.Table, batch_id: int) -> LandedBatch:
        reports, identity = _reports(batch)
        checkpoint = self.landing.sink.checkpoint(identity.version)
        batch_cut = BatchCut(checkpoint.resume_point, identity.end)
        batch_cut.apply(reports)
        waves, reports = self._waves(batch, identity, batch_cut, reports)
        cut = batch_cut.cut()
        everything = pa.concat_tables(waves)
        data = everything.filter(pc.is_null(everything[REPORT]))
        after = checkpoint.resume_point.low_watermark
        stamps = data[COMMIT_NANOS]
        below = data.filter(
            pc.and_(pc.greater(stamps, after), pc.less_equal(stamps, cut.low_watermark))
        )
        commit_timestamps = _check_whole(below)
        transactions = len(commit_timestamps)
        result = self._commit(checkpoint, below, transactions, cut)
        outcome = "superseded" if result is None else "replayed" if result.replayed else "landed"
        version = result.version if result is not None else None
        self._landed_any = True
        landed = LandedBatch(
            batch_id,
            version,
            cut.low_watermark,
            identity.end,
            len(reports),
            transactions,
            below.num_rows,
            pc.sum(pc.greater(stamps, cut.low_watermark)).as_py() or 0,
            _records(data),
            outcome,
            commit_timestamps if outcome == "landed" else (),
        )
        self.landing.log.info(
            "spark_batch",
            batch_id=batch_id,
            outcome=outcome,
            version=version,
            planned_from_version=identity.version,
            partitions=len(reports),
            waves=len(waves),
            transactions=transactions,
            rows=below.num_rows,
            rows_above_cut=landed.rows_above_cut,
            records_read=landed.records_read,
            low_watermark=to_rfc3339(cut.low_watermark),
            cut_lowered=cut.low_watermark < identity.end,
            watermark_lag_seconds=self._lag_s(cut.low_watermark),
        )
        if self.on_landed is not None:
            self.on_landed(landed)
        return landed

    def _waves(
        self,
        batch: pa.Table,
        identity: BatchIdentity,
        batch_cut: BatchCut,
        reports: list[PartitionReport],
    ) -> tuple[list[pa.Table], list[PartitionReport]]:
        """The batch's first wave and the ones the driver reads after it, while the cut can
        still move and the record budget lasts; every wave's reports."""
        waves = [batch]
        while len(waves) < self.max_waves and self.read_wave is not None:
            budget = _records_left(identity.max_records, waves)
            if budget == 0:
                break
            reads = batch_cut.next_wave(budget)
            if not reads:
                break
            wave = self.read_wave(reads, replace(identity, partitions=len(reads)))
            wave_reports, wave_identity = _reports(wave)
            if wave_identity.partitions != len(reads):
                raise BatchPlanError(f"a wave of {len(reads)} reads reported as another")
            batch_cut.apply(wave_reports)
            reports = reports + wave_reports
            waves.append(wave)
        return waves, reports

    def _commit(
        self, checkpoint: Checkpoint, below: pa.Table, transactions: int, cut: ResumePoint
    ) -> CommitResult | None:
        """The whole transactions below the cut as the change log's next version; None when
        another writer landed it first (this query was down)."""
        self.landing.sink.continue_after(checkpoint)
        watched = self.landing.watched.changes(cut.low_watermark, self.monotonic())
        try:
            result = self.landing.sink.commit_rows(
                in_total_order(below).select(SCHEMA.names), transactions, cut, watched
            )
        except WriterFenced:
            if self._landed_any:
                raise
            return None  # superseded: another writer landed v + 1 while this query was down
        if not result.replayed:
            self._needs_backfill(watched, cut.low_watermark)
            self.landing.landed(result, watched, cut.low_watermark)
        return result

    def _needs_backfill(self, watched: WatchedColumns, low_watermark: Nanos) -> None:
        """The Spark source runs no table snapshot: a table whose new columns Spanner filled
        without change records is named for the service to read again."""
        gained = self.landing.watched.gained_columns(watched, low_watermark)
        if gained:
            self.landing.log.error(
                "column_backfill_needed",
                tables=list(gained),
                remedy="run `python -m ingest run` and `python -m ingest snapshot-table` for "
                "these tables: their added columns' values reach the change log only so",
            )

    def _lag_s(self, low_watermark: Nanos) -> float:
        return round((self.landing.wall_clock() - low_watermark) / NANOS_PER_SECOND, 3)


def _records_left(budget: int | None, waves: list[pa.Table]) -> int | None:
    """What the batch's records limit leaves for another wave (None: no limit)."""
    if budget is None:
        return None
    return max(0, budget - sum(_records(wave) for wave in waves))


def _records(rows: pa.Table) -> int:
    """Data change records among change-log rows (report rows have no mod index)."""
    return pc.sum(pc.equal(rows["mod_index"], 0)).as_py() or 0


def _reports(batch: pa.Table) -> tuple[list[PartitionReport], BatchIdentity]:
    texts = batch.filter(pc.is_valid(batch[REPORT]))[REPORT].to_pylist()
    parsed = [parse_report(text) for text in texts]
    if not parsed:
        raise BatchPlanError("a batch without task reports: no task of the plan reported")
    identities = {identity for _, identity in parsed}
    if len(identities) != 1:
        raise BatchPlanError(f"one batch's tasks name different batches: {identities}")
    (identity,) = identities
    planned = sum(not report.followed for report, _ in parsed)
    if planned != identity.partitions:
        raise BatchPlanError(
            f"{planned} of the batch's {identity.partitions} planned partitions reported"
        )
    return [report for report, _ in parsed], identity


def _check_whole(rows: pa.Table) -> tuple[Nanos, ...]:
    """Each transaction's commit timestamp, once each is shown whole and consistent, and no row
    twice."""
    distinct = rows.group_by(["server_transaction_id", "record_sequence", "mod_index"]).aggregate(
        []
    )
    if distinct.num_rows != rows.num_rows:
        raise DuplicateRecordError(
            f"{rows.num_rows - distinct.num_rows} change-log rows of the batch came twice"
        )
    per_transaction = rows.group_by("server_transaction_id").aggregate(
        [
            ("record_sequence", "count_distinct"),
            ("number_of_records_in_transaction", "min_max"),
            (COMMIT_NANOS, "min_max"),
        ]
    )
    for row in per_transaction.to_pylist():
        txid = row["server_transaction_id"]
        expected = row["number_of_records_in_transaction_min_max"]
        committed = row[f"{COMMIT_NANOS}_min_max"]
        if expected["min"] != expected["max"] or committed["min"] != committed["max"]:
            raise InconsistentTransactionError(
                f"records of transaction {txid} disagree on commit timestamp or record count"
            )
        if row["record_sequence_count_distinct"] != expected["min"]:
            raise IncompleteTransactionError(
                f"transaction {txid} at {to_rfc3339(committed['min'])} has "
                f"{row['record_sequence_count_distinct']} of {expected['min']} records at or "
                "below the batch's cut"
            )
    return tuple(
        per_transaction[f"{COMMIT_NANOS}_min_max"].combine_chunks().field("min").to_pylist()
    )
