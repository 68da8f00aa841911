"""One task of a batch: a partition queried from its resume timestamp to the batch's end, with
the service's retry policy, as data rows and one report for the driver.

A retried query starts again just past the partition's watermark; the records it had read at the
timestamp above the watermark come again and are skipped, so a task never yields a record twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from tenacity import Retrying, retry_if_exception, wait_exponential_jitter

from ingest.changestream.config import ChangeStreamSource
from ingest.changestream.retries import RetryPolicy, is_transient
from ingest.model.records import (
    ChangeRecord,
    ChildPartitionsRecord,
    DataChangeRecord,
    PartitionEndRecord,
    PartitionStartRecord,
)
from ingest.model.timestamps import Nanos
from ingest.rules.batches import (
    PartitionRead,
    PartitionReport,
    children_to_follow,
    stops_at_limit,
)
from ingest.rules.partitions import INITIAL_PARTITION, ends_partition, watermark_after

LINEAGE = (ChildPartitionsRecord, PartitionStartRecord, PartitionEndRecord)


@dataclass(slots=True)
class _Progress:
    watermark: Nanos
    records: int = 0
    ended: bool = False
    stopped: bool = False
    lineage: list[ChangeRecord] = field(default_factory=list)
    at_frontier: set[tuple[str, str]] = field(default_factory=set)
    """Records yielded above the watermark: a retried query returns them again."""
    failures_without_progress: int = 0


def read_partitions(
    source: ChangeStreamSource,
    reads: list[PartitionRead],
    retry: RetryPolicy,
    sleep: Callable[[float], None],
) -> Iterator[DataChangeRecord | PartitionReport]:
    """A task's group of partitions, one after the other, each followed by the children it
    split or moved into within the batch (``rules.batches.children_to_follow``)."""
    for planned in reads:
        queue = [planned]
        while queue:
            read = queue.pop(0)
            for item in read_partition(source, read, retry, sleep):
                if isinstance(item, PartitionReport):
                    queue += children_to_follow(read, item)
                    item = replace(item, followed=read is not planned)
                yield item


def read_partition(
    source: ChangeStreamSource,
    read: PartitionRead,
    retry: RetryPolicy,
    sleep: Callable[[float], None],
) -> Iterator[DataChangeRecord | PartitionReport]:
    """The partition's data change records, each once, then its report."""
    progress = _Progress(read.start - 1)
    retrying = Retrying(
        retry=retry_if_exception(is_transient),
        wait=wait_exponential_jitter(multiplier=retry.initial_backoff_s, max=retry.max_backoff_s),
        stop=lambda _: progress.failures_without_progress >= retry.max_failures,
        sleep=sleep,
        reraise=True,
    )
    for attempt in retrying:
        with attempt:
            yield from _query_once(source, read, progress)
    closed = not progress.stopped
    if closed and not progress.ended:
        progress.watermark = max(progress.watermark, read.end)
    yield PartitionReport(read.token, tuple(progress.lineage), progress.watermark, closed)


def _query_once(
    source: ChangeStreamSource, read: PartitionRead, progress: _Progress
) -> Iterator[DataChangeRecord]:
    before = progress.watermark
    token = None if read.token == INITIAL_PARTITION else read.token
    records = source.read(token, max(read.start, progress.watermark + 1), read.end)
    try:
        for record in records:
            if stops_at_limit(read, progress.records, progress.watermark):
                progress.stopped = True
                return
            if isinstance(record, DataChangeRecord) and _seen(progress, record):
                continue
            moved = watermark_after(record)
            if moved > progress.watermark:
                progress.watermark = moved
                progress.at_frontier.clear()
            progress.ended = progress.ended or ends_partition(read.token, record)
            if isinstance(record, DataChangeRecord):
                progress.at_frontier.add((record.server_transaction_id, record.record_sequence))
                progress.records += 1
                yield record
            elif isinstance(record, LINEAGE) and record not in progress.lineage:
                progress.lineage.append(record)
    except BaseException:
        moved_on = progress.watermark > before
        progress.failures_without_progress = (
            1 if moved_on else progress.failures_without_progress + 1
        )
        raise
    finally:
        close = getattr(records, "close", None)
        if close is not None:
            close()
    progress.failures_without_progress = 0


def _seen(progress: _Progress, record: DataChangeRecord) -> bool:
    return (record.server_transaction_id, record.record_sequence) in progress.at_frontier
