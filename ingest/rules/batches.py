"""Micro-batches of one change stream read by many tasks at once (the Spark source, design B of
docs/scaling.md): which partitions a batch reads, and the consistent cut it reaches once every
task has reported.

A batch starts from a resume point (low watermark W, the partitions to query) and an end E. Every
ready partition, up to a limit, is read from its resume timestamp to E (tasks read groups of
them). A partition that splits or moves within the batch (a child partitions record at S whose
children have it as their only parent) is followed by the same task: its children are read from
S to E, as nothing else waits for them. Other partitions the batch discovers (a merge's child,
which waits for all its parents; partitions a partition start record announces) are read by the
next batch unless a further wave of the same batch reads them (``BatchCut``), so the batch's
cut is the tracker's low watermark once every report is applied: below every such S no wave
read and below every partition not read to E. Everything at or below the cut was
read by every partition alive then, so each transaction at or below it is whole within the batch;
what tasks read above it is read again by the next batch, which starts from the cut's resume
point.

Pure: the same tracker (``rules.partitions``) as the service applies the lineage rules, on the
driver, from the tasks' reports; records themselves never pass through it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ingest.model.records import ChangeRecord, ChildPartitionsRecord, HeartbeatRecord
from ingest.model.resume import ResumePoint
from ingest.model.timestamps import Nanos
from ingest.rules.coordinator import Coordinator
from ingest.rules.partitions import INITIAL_PARTITION


@dataclass(frozen=True, slots=True)
class PartitionRead:
    """One task: a partition queried from ``start`` up to the batch's ``end``."""

    token: str
    start: Nanos
    end: Nanos
    max_records: int | None = None
    """The task stops once it read this many data change records and moved its partition's
    watermark on (admission control); None reads to the end."""


@dataclass(frozen=True, slots=True)
class PartitionReport:
    """What a task tells the driver of its partition, besides the data it read."""

    token: str
    lineage: tuple[ChangeRecord, ...]
    """Its child partitions, partition start and partition end records, in the order read."""
    watermark: Nanos
    """Every record with commit timestamp at or below it was read: the batch's end when the
    query closed cleanly there."""
    closed: bool
    """The query closed cleanly. False when the task stopped at its records limit."""
    followed: bool = False
    """A child the task read after its only parent ended within the batch (not planned)."""


def share_of(budget: int, reads: int) -> int:
    """Each read's records limit when ``reads`` share ``budget`` records: at least one each."""
    return max(1, -(-budget // max(1, reads)))


def stops_at_limit(read: PartitionRead, records_read: int, watermark: Nanos) -> bool:
    """Whether a task stops before its next record: it read its records limit and moved its
    partition's watermark past where it started, so every batch makes progress."""
    return (
        read.max_records is not None
        and records_read >= read.max_records
        and watermark >= read.start
    )


def children_to_follow(read: PartitionRead, report: PartitionReport) -> list[PartitionRead]:
    """The children a task reads after their parent within the batch: those of a split or move
    (the parent is their only parent), once the parent's query closed at its last record. Not
    the initial query's (the stream's first partitions are planned over tasks by the next
    batch), not a merge's (it waits for every parent), not announced partitions (two parents
    may announce one)."""
    if not report.closed or read.token == INITIAL_PARTITION:
        return []
    return [
        PartitionRead(child.token, record.start_timestamp, read.end, read.max_records)
        for record in report.lineage
        if isinstance(record, ChildPartitionsRecord)
        for child in record.child_partitions
        if child.parent_partition_tokens == (read.token,)
    ]


class BatchPlanError(RuntimeError):
    """Reports that do not match the batch's plan: a bug, never data to skip."""


def _coordinator(resume: ResumePoint) -> Coordinator:
    """A partition closing at a batch's end lives on: the tracker has no end timestamp, and a
    partition finishes only with its last record."""
    return Coordinator(resume.low_watermark + 1, None, resume_from=resume)


def plan_batch(
    resume: ResumePoint,
    end: Nanos,
    max_partitions: int | None = None,
    max_records: int | None = None,
) -> list[PartitionRead]:
    """The tasks of a batch from ``resume`` to ``end``: ready partitions, lowest watermark first,
    at most ``max_partitions`` of them (the others hold the cut at their watermark)."""
    if end <= resume.low_watermark:
        return []
    tracker = _coordinator(resume).tracker
    return [
        PartitionRead(p.token, p.resume_timestamp, end, max_records)
        for p in tracker.take_ready(max_partitions)
    ]


class BatchCut:
    """A batch's tracker on the driver, applying its tasks' reports wave by wave.

    The first wave is the planned reads. Once it has reported, partitions that became ready
    within the batch (a merge's child whose parents all finished, partitions a partition start
    record announced) may be read by a further wave from their start to the same end, so they
    no longer lower the cut; whatever no wave read holds the cut below its start.
    """

    def __init__(self, resume: ResumePoint, end: Nanos) -> None:
        self._end = end
        self._coordinator = _coordinator(resume)
        self._tracker = self._coordinator.tracker
        self._ready = {p.token: p for p in self._tracker.take_ready()}

    def apply(self, reports: Iterable[PartitionReport]) -> None:
        """One wave's reports. A partition that closed but read past the cut (its records
        above it are dropped) is queried again from the cut, as after a restart; the children
        it reported wait for it again. Reports of followed children come after their parent's,
        in the order their task read them."""
        tracker = self._tracker
        for report in sorted(reports, key=lambda r: r.followed):  # sorted() is stable
            take = tracker.take_child if report.followed else self._ready.pop
            partition = take(report.token, None)
            if partition is None:
                raise BatchPlanError(
                    f"partition {report.token!r} reported twice or was not ready in this batch"
                )
            self._coordinator.query_started(report.token, partition.resume_timestamp)
            for record in report.lineage:
                tracker.on_record(report.token, record)
            if report.watermark > partition.watermark:
                tracker.on_record(report.token, HeartbeatRecord(report.watermark))
            if report.closed and partition.ended:
                self._coordinator.stream_ended(report.token)

    def next_wave(self, budget: int | None = None) -> list[PartitionRead]:
        """Partitions that became ready within the batch, to read up to its end, sharing
        ``budget`` records. Partitions ready from the start but not planned (over the partitions
        limit) are not among them."""
        ready = self._tracker.take_ready()
        self._ready.update((p.token, p) for p in ready)
        limit = None if budget is None else share_of(budget, len(ready))
        return [PartitionRead(p.token, p.resume_timestamp, self._end, limit) for p in ready]

    def cut(self) -> ResumePoint:
        """The batch's consistent cut and where the next batch resumes."""
        low = self._coordinator.low_watermark()
        cut = self._end if low is None else min(low, self._end)
        return ResumePoint(cut, self._tracker.resumable(cut))


def cut_batch(resume: ResumePoint, end: Nanos, reports: Iterable[PartitionReport]) -> ResumePoint:
    """The cut of a batch of one wave (``BatchCut``)."""
    batch = BatchCut(resume, end)
    batch.apply(reports)
    return batch.cut()
