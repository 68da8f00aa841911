"""One task of the Spark source (``ingest.sparksource.task``) on a scripted source: a query that
fails mid-way is retried from the partition's watermark without yielding a record twice, a task
stops at its records limit only once its watermark moved, and a clean close proves the end."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from google.api_core import exceptions as api_exceptions

from ingest.changestream.retries import RetryPolicy
from ingest.model.records import (
    ChangeRecord,
    ChildPartition,
    ChildPartitionsRecord,
    DataChangeRecord,
    HeartbeatRecord,
    record_timestamp,
)
from ingest.rules.batches import PartitionRead, PartitionReport
from ingest.sparksource.task import read_partition
from tests.builders import record

STREAM: list[ChangeRecord] = [
    record(100, "tx-a", 0, 2),
    record(100, "tx-a", 1, 2),
    HeartbeatRecord(150),
    record(200, "tx-b", 0, 1),
    record(200, "tx-c", 0, 1),
    record(300, "tx-d", 0, 1),
    ChildPartitionsRecord(400, "00000009", (ChildPartition("child", ("p",)),)),
]


class FailingSource:
    """Serves ``STREAM`` and fails once after each listed number of records."""

    def __init__(self, fail_after: list[int]) -> None:
        self.fail_after = list(fail_after)
        self.queries: list[int] = []

    def read(self, token: str | None, start: int, end: int | None) -> Iterator[ChangeRecord]:
        self.queries.append(start)
        sent = 0
        for item in STREAM:
            if start <= record_timestamp(item) and (end is None or record_timestamp(item) <= end):
                if self.fail_after and sent == self.fail_after[0]:
                    self.fail_after.pop(0)
                    raise api_exceptions.ServiceUnavailable("connection reset")
                sent += 1
                yield item


def run(source: FailingSource, read: PartitionRead) -> tuple[list[str], PartitionReport]:
    items = list(read_partition(source, read, RetryPolicy(initial_backoff_s=0), lambda _: None))
    data = [i for i in items if isinstance(i, DataChangeRecord)]
    report = items[-1]
    assert isinstance(report, PartitionReport)
    return [f"{r.server_transaction_id}/{r.record_sequence[-1]}" for r in data], report


@pytest.mark.parametrize("fail_after", [[1], [4], [1, 1, 2], [5, 0]])
def test_a_retried_query_yields_every_record_once(fail_after: list[int]) -> None:
    source = FailingSource(fail_after)
    data, report = run(source, PartitionRead("p", 50, 1_000))
    assert data == ["tx-a/0", "tx-a/1", "tx-b/0", "tx-c/0", "tx-d/0"]
    assert (report.watermark, report.closed) == (399, True)
    assert [type(r).__name__ for r in report.lineage] == ["ChildPartitionsRecord"]
    assert len(source.queries) == len(fail_after) + 1
    assert source.queries == sorted(source.queries), "each retry starts past the watermark"


def test_a_task_stops_at_its_limit_once_its_watermark_moved() -> None:
    data, report = run(FailingSource([]), PartitionRead("p", 50, 1_000, max_records=1))
    assert data == ["tx-a/0"]
    assert (report.watermark, report.closed) == (99, False), "tx-a/1 is read by the next batch"
    data, report = run(FailingSource([]), PartitionRead("p", 100, 1_000, max_records=1))
    assert data == ["tx-a/0", "tx-a/1"], "records at the query's start do not move it on"
    assert (report.watermark, report.closed) == (150, False)


def test_a_clean_close_proves_the_batch_end() -> None:
    data, report = run(FailingSource([]), PartitionRead("p", 50, 250))
    assert data == ["tx-a/0", "tx-a/1", "tx-b/0", "tx-c/0"]
    assert (report.watermark, report.closed, report.lineage) == (250, True, ())


def test_a_query_failing_without_progress_gives_up() -> None:
    source = FailingSource([0] * 10)
    with pytest.raises(api_exceptions.ServiceUnavailable):
        run(source, PartitionRead("p", 50, 1_000))
    assert len(source.queries) == RetryPolicy().max_failures
