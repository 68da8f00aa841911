"""Change stream partitions: lifecycle, parent/child lineage, watermarks.

Pure bookkeeping with no I/O, so every rule of docs/design.md contract 2 is testable on a simulated
topology. The reader feeds it records per partition token and asks which partitions to start.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import structlog

from ingest.model.records import (
    ChangeRecord,
    ChildPartition,
    ChildPartitionsRecord,
    HeartbeatRecord,
    PartitionEndRecord,
    PartitionStartRecord,
    record_timestamp,
)
from ingest.model.resume import ResumablePartition, ResumablePartitions
from ingest.model.timestamps import Nanos, to_rfc3339
from runtime.logs import null_logger

INITIAL_PARTITION = ""
"""Token under which the initial query (``partition_token => NULL``) is tracked."""


class PartitionState(enum.Enum):
    """A partition's life, in order."""

    CREATED = "CREATED"
    """Known (the initial query, restored from a checkpoint, or named by a child partitions or
    partition start record) and waiting for every parent to finish."""
    SCHEDULED = "SCHEDULED"
    """Its parents finished: handed to the reader to query (``take_ready``)."""
    RUNNING = "RUNNING"
    """Its query started; its records arrive and move its watermark."""
    LANDING = "LANDING"
    """Its query sent its last record (or reached the reader's end timestamp), but records of
    it above the landed watermark have not landed: a restart must query it again."""
    FINISHED = "FINISHED"
    """Everything it delivered has landed; only its token is kept while a child may still wait
    for it or a retried parent may report it again."""


class PartitionLifecycleError(RuntimeError):
    """A partition event that contradicts the lineage rules: a bug, never data to skip."""


@dataclass(slots=True)
class Partition:
    token: str
    start_timestamp: Nanos
    end_timestamp: Nanos | None
    parent_tokens: frozenset[str]
    state: PartitionState = PartitionState.CREATED
    watermark: Nanos = 0
    """Every record with commit timestamp ≤ watermark has been delivered."""
    child_tokens: set[str] = field(default_factory=set)
    ended: bool = False
    """Its last record arrived: a child partitions or partition end record, or the initial
    query's partition start records."""
    reported_by: set[str] = field(default_factory=set)
    """Partitions whose child partitions records named this one (a retried query repeats them)."""
    attempts: int = 0

    @property
    def resume_timestamp(self) -> Nanos:
        return resume_timestamp(self.start_timestamp, self.watermark)


def resume_timestamp(start: Nanos, watermark: Nanos) -> Nanos:
    """Where a new query of a partition starts without missing anything: past its watermark,
    never before its start."""
    return max(start, watermark + 1)


def watermark_after(record: ChangeRecord) -> Nanos:
    """The partition watermark a record proves.

    Data at T: more records at T may follow (the same or another transaction), so only T - 1 is
    proven; so for a partition start or event record. A heartbeat at T proves T, and a partition
    end record at E (the partition's last) proves E. A child partitions record at S ends the
    partition at S - 1.
    """
    if isinstance(record, HeartbeatRecord | PartitionEndRecord):
        return record_timestamp(record)
    return record_timestamp(record) - 1


def ends_partition(token: str, record: ChangeRecord) -> bool:
    """Whether the partition's query ends with this record: a child partitions record, a
    partition end record, or (``MUTABLE_KEY_RANGE``) the initial query's partition start
    records."""
    if isinstance(record, ChildPartitionsRecord | PartitionEndRecord):
        return True
    return token == INITIAL_PARTITION and isinstance(record, PartitionStartRecord)


class PartitionTracker:
    def __init__(
        self,
        start_timestamp: Nanos,
        end_timestamp: Nanos | None,
        log: structlog.typing.FilteringBoundLogger | None = None,
    ) -> None:
        self._start_timestamp = start_timestamp
        self._end_timestamp = end_timestamp
        self._log = log or null_logger()
        self._partitions: dict[str, Partition] = {}
        self._created: dict[str, Partition] = {}
        """Partitions not scheduled yet: scanned every reader loop, so kept apart from the
        thousands that run."""
        self._finished: dict[str, frozenset[str]] = {}
        """Finished tokens still needed, with the partitions that reported them."""
        self._landing: dict[str, Partition] = {}
        """LANDING partitions: finished reading, records above the landed watermark."""
        self._restored_starts: dict[str, Nanos] = {}
        """Start of each partition restored from a checkpoint: who reported it is not kept, and
        a restored partition queried again may report it again."""

    # -- creation --------------------------------------------------------------------------

    def add_initial(self) -> Partition:
        return self._create(INITIAL_PARTITION, self._start_timestamp, frozenset())

    def restore(self, checkpoint: ResumablePartitions, low_watermark: Nanos) -> None:
        """Resume from a checkpoint taken at ``low_watermark``: everything at or below it landed."""
        for token in checkpoint.finished_parents:
            self._finished[token] = frozenset()
        for saved in checkpoint.partitions:
            partition = Partition(
                token=saved.token,
                start_timestamp=saved.start_timestamp,
                end_timestamp=self._end_timestamp,
                parent_tokens=frozenset(saved.parent_tokens),
                watermark=max(saved.start_timestamp - 1, low_watermark),
            )
            self._partitions[partition.token] = partition
            self._created[partition.token] = partition
            self._restored_starts[partition.token] = partition.start_timestamp
            self._log.info(
                "partition_restored",
                partition_token=partition.token,
                resume_timestamp=to_rfc3339(partition.resume_timestamp),
                parent_partition_tokens=sorted(saved.parent_tokens),
            )

    def _create(self, token: str, start: Nanos, parents: frozenset[str]) -> Partition:
        partition = Partition(
            token=token,
            start_timestamp=start,
            end_timestamp=self._end_timestamp,
            parent_tokens=parents,
            watermark=start - 1,
        )
        self._partitions[token] = partition
        self._created[token] = partition
        self._log.info(
            "partition_created",
            partition_token=token,
            start_timestamp=to_rfc3339(start),
            parent_partition_tokens=sorted(parents),
        )
        return partition

    # -- scheduling ------------------------------------------------------------------------

    def _ready(self) -> list[Partition]:
        return [p for p in self._created.values() if p.parent_tokens <= self._finished.keys()]

    def take_ready(self, limit: int | None = None) -> list[Partition]:
        """Mark up to ``limit`` (or all) CREATED partitions whose parents have all finished as
        SCHEDULED."""
        ready = self._ready()
        ready.sort(key=lambda p: (p.watermark, p.token))
        taken = ready if limit is None else ready[: max(limit, 0)]
        for partition in taken:
            partition.state = PartitionState.SCHEDULED
            del self._created[partition.token]
            self._log.info("partition_scheduled", partition_token=partition.token)
        return taken

    def take_child(self, token: str, default: None = None) -> Partition | None:
        """SCHEDULED now: a CREATED partition whose parents have all finished (a child a Spark
        source's task read after its parent in the same batch); ``default`` otherwise."""
        partition = self._created.get(token)
        if partition is None or not partition.parent_tokens <= self._finished.keys():
            return default
        partition.state = PartitionState.SCHEDULED
        del self._created[token]
        self._log.info("partition_scheduled", partition_token=token)
        return partition

    def mark_running(self, token: str, query_start: Nanos) -> None:
        partition = self._get(token)
        if partition.state not in (PartitionState.SCHEDULED, PartitionState.RUNNING):
            raise PartitionLifecycleError(f"partition {token!r} started from {partition.state}")
        partition.state = PartitionState.RUNNING
        partition.attempts += 1
        log = self._log.info if partition.attempts == 1 else self._log.debug
        log(
            "partition_running",
            partition_token=token,
            query_start_timestamp=to_rfc3339(query_start),
            attempt=partition.attempts,
        )

    # -- records ---------------------------------------------------------------------------

    def on_record(self, token: str, record: ChangeRecord) -> list[Partition]:
        """Advance the partition's watermark; return child partitions created by this record."""
        partition = self._get(token)
        if partition.state is not PartitionState.RUNNING:
            raise PartitionLifecycleError(f"record for partition {token!r} in {partition.state}")
        partition.watermark = max(partition.watermark, watermark_after(record))
        partition.ended = partition.ended or ends_partition(token, record)
        if isinstance(record, ChildPartitionsRecord):
            return self._register_children(
                partition, record.start_timestamp, record.child_partitions
            )
        if isinstance(record, PartitionStartRecord):
            announced = tuple(ChildPartition(t, ()) for t in record.partition_tokens)
            return self._register_children(partition, record.start_timestamp, announced)
        return []

    def _register_children(
        self, parent: Partition, start: Nanos, children: tuple[ChildPartition, ...]
    ) -> list[Partition]:
        """Partitions a child partitions record (or a partition start record: no parents to
        wait for) starts at ``start``, registered before the low watermark can pass it: the
        reporting partition's watermark stays below ``start`` until this record."""
        created = []
        for child in children:
            parent.child_tokens.add(child.token)
            parents = frozenset(child.parent_partition_tokens)
            known = self._partitions.get(child.token)
            if known is not None or child.token in self._finished:
                if known is not None:
                    known.reported_by.add(parent.token)
                    known.parent_tokens = known.parent_tokens | parents
                self._log.info(
                    "child_partition_deduplicated",
                    partition_token=child.token,
                    reported_by=parent.token,
                )
                continue
            partition = self._create(child.token, start, parents)
            partition.reported_by.add(parent.token)
            created.append(partition)
        return created

    def on_stream_end(self, token: str) -> None:
        """The partition's query closed cleanly: LANDING once its last record arrived.

        A query bounded by the reader's end timestamp closes without one once it delivered
        everything up to that end; an unbounded one must have sent its last record.
        """
        partition = self._get(token)
        if not partition.ended:
            if partition.end_timestamp is None:
                raise PartitionLifecycleError(
                    f"partition {token!r} ended without its last record; retry it"
                )
            partition.watermark = max(partition.watermark, partition.end_timestamp)
        partition.state = PartitionState.LANDING
        self._finished[token] = frozenset(partition.reported_by)
        del self._partitions[token]
        self._landing[token] = partition
        self._log.info(
            "partition_finished",
            partition_token=token,
            watermark=to_rfc3339(partition.watermark),
            child_partition_tokens=sorted(partition.child_tokens),
        )
        self._forget_unreferenced_finished()

    def _forget_unreferenced_finished(self) -> None:
        """Forget a finished token once no partition awaits it and none can report it again.

        A restored partition's reporters are not known: any live partition that started before
        it may be one (a parent starts before its child), queried again from the checkpoint's
        watermark, so it is kept while one lives. Without this a partition announced without
        parents (``MUTABLE_KEY_RANGE``), finished before its announcer reports it again, would
        be created again and read twice."""
        live = self._partitions.keys()
        requeried_after_restart = [*self._partitions.values(), *self._landing.values()]
        awaited = set().union(*(p.parent_tokens for p in requeried_after_restart))
        earliest_live = min((p.start_timestamp for p in self._partitions.values()), default=None)

        def may_be_reported(token: str) -> bool:
            start = self._restored_starts.get(token)
            return start is not None and earliest_live is not None and earliest_live < start

        self._finished = {
            token: reporters
            for token, reporters in self._finished.items()
            if token in awaited or reporters & live or may_be_reported(token)
        }
        self._restored_starts = {
            token: start
            for token, start in self._restored_starts.items()
            if token in self._partitions or token in self._finished
        }

    # -- watermarks ------------------------------------------------------------------------

    def low_watermark(self) -> Nanos | None:
        """Minimum watermark over unfinished partitions, including children not started yet.

        None once every partition has finished (a bounded read that reached its end timestamp).
        """
        if not self._partitions:
            return None
        return min(p.watermark for p in self._partitions.values())

    @property
    def live_count(self) -> int:
        """Partitions not finished (read by the metrics thread: one atomic ``len``)."""
        return len(self._partitions)

    @property
    def all_finished(self) -> bool:
        return not self._partitions

    def resumable(self, landed_watermark: Nanos) -> ResumablePartitions:
        """Partitions to query again after a restart from ``landed_watermark``.

        Unfinished partitions, and finished ones that delivered records above the landed
        watermark: resuming only their children would lose those records.
        """
        for partition in self._landing.values():
            if partition.watermark <= landed_watermark:
                partition.state = PartitionState.FINISHED
        self._landing = {
            token: p for token, p in self._landing.items() if p.state is PartitionState.LANDING
        }
        saved = [*self._landing.values(), *self._partitions.values()]
        awaited = set().union(*(p.parent_tokens for p in saved))
        requeried = {p.token for p in saved}
        return ResumablePartitions(
            tuple(
                ResumablePartition(p.token, p.start_timestamp, tuple(sorted(p.parent_tokens)))
                for p in saved
            ),
            tuple(sorted((awaited & self._finished.keys()) - requeried)),
        )

    def unfinished(self) -> list[Partition]:
        return list(self._partitions.values())

    def partition(self, token: str) -> Partition:
        """A partition not finished yet."""
        return self._get(token)

    def _get(self, token: str) -> Partition:
        partition = self._partitions.get(token)
        if partition is None:
            raise PartitionLifecycleError(f"unknown or finished partition {token!r}")
        return partition
