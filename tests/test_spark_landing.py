"""A Spark source batch's landing (``ingest.sparksource.landing``) on a real change-log table,
without Spark: the rows its tasks would send, the cut, the checks, and the exactly-once rules for
a replayed batch, a batch another writer superseded, and a writer that lost the job."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from structlog.testing import CapturingLogger

from ingest.delta.landing import ChangeLogLanding, WatchedColumnsPoll
from ingest.delta.sink import DeltaChangeLogSink, WriterFenced
from ingest.model.records import ChildPartition, ChildPartitionsRecord, DataChangeRecord
from ingest.model.resume import ResumablePartition, ResumablePartitions, ResumePoint
from ingest.rules.assembler import IncompleteTransactionError
from ingest.rules.batches import PartitionRead, PartitionReport, plan_batch
from ingest.sparksource.landing import BatchLanding, DuplicateRecordError, LandedBatch
from ingest.sparksource.rows import (
    SOURCE_SCHEMA,
    BatchIdentity,
    data_rows,
    parse_report,
    report_json,
    report_row,
    task_batches,
)
from runtime.logs import null_logger
from tests.builders import record
from tests.delta_checks import read_versions

START = 1_000_000_000
JOB = "bank.all_changes"


def resume_at(watermark: int, *tokens: str) -> ResumePoint:
    partitions = tuple(ResumablePartition(t, START, ()) for t in tokens)
    return ResumePoint(watermark, ResumablePartitions(partitions, ()))


def job_at(tmp_path: Path, owner: str = "spark-a") -> DeltaChangeLogSink:
    sink = DeltaChangeLogSink(str(tmp_path / "changelog"), JOB, owner)
    sink.continue_after(None)
    sink.start_job(START)
    sink.commit([], resume_at(START + 99, "p1", "p2"))
    return sink


class Landing:
    """The landing under test; every batch here plans something, so each lands a result."""

    def __init__(self, sink: DeltaChangeLogSink) -> None:
        watched = WatchedColumnsPoll(None, 10.0, null_logger())
        self.landing = BatchLanding(ChangeLogLanding(sink, watched, null_logger()))

    def land(self, table: pa.Table, batch_id: int) -> LandedBatch:
        landed = self.landing.land(table, batch_id)
        assert landed is not None
        return landed


def landing(sink: DeltaChangeLogSink) -> Landing:
    return Landing(sink)


def batch(
    version: int,
    end: int,
    reads: dict[str, tuple[list[DataChangeRecord], PartitionReport]],
) -> pa.Table:
    identity = BatchIdentity(version, end, len(reads))
    parts = []
    for records, report in reads.values():
        if records:
            parts.append(data_rows(records))
        parts.append(report_row(report, identity))
    return pa.Table.from_batches(parts, schema=SOURCE_SCHEMA)


def closed(token: str, end: int, *lineage: ChildPartitionsRecord) -> PartitionReport:
    watermark = lineage[-1].start_timestamp - 1 if lineage else end
    return PartitionReport(token, lineage, watermark, True)


def test_rows_at_or_below_the_cut_land_in_commit_order_and_the_rest_waits(tmp_path: Path) -> None:
    sink = job_at(tmp_path)
    split = ChildPartitionsRecord(START + 300, "00000001", (ChildPartition("p3", ("p2",)),))
    p1 = [record(START + 250, "tx-b", 0, 2), record(START + 400, "tx-c", 0, 1)]
    p2 = [record(START + 120, "tx-a", 0, 1), record(START + 250, "tx-b", 1, 2)]
    table = batch(
        2,
        START + 500,
        {"p1": (p1, closed("p1", START + 500)), "p2": (p2, closed("p2", START + 500, split))},
    )
    landed = landing(sink).land(table, batch_id=0)
    assert (landed.outcome, landed.version, landed.low_watermark) == ("landed", 3, START + 299)
    assert (landed.transactions, landed.rows, landed.rows_above_cut) == (2, 3, 1)
    newest = read_versions(tmp_path / "changelog")[-1]
    assert [(r["server_transaction_id"], r["record_sequence"]) for r in newest.rows] == [
        ("tx-a", "00000000"),
        ("tx-b", "00000000"),
        ("tx-b", "00000001"),
    ]
    assert newest.checkpoint is not None
    partitions = newest.checkpoint.resume_point.partitions
    assert {p.token for p in partitions.partitions} == {"p1", "p3"}, "p1 is read again from the cut"
    assert partitions.finished_parents == ("p2",), "p3 starts after its parent p2"


def test_a_replayed_batch_lands_nothing_and_another_writers_successor_supersedes_it_once(
    tmp_path: Path,
) -> None:
    sink = job_at(tmp_path)
    reads: dict[str, tuple[list[DataChangeRecord], PartitionReport]] = {
        "p1": ([], closed("p1", START + 200)),
        "p2": ([], closed("p2", START + 200)),
    }
    first = landing(sink)
    assert first.land(batch(2, START + 200, reads), 0).outcome == "landed"
    restarted = landing(DeltaChangeLogSink(str(tmp_path / "changelog"), JOB, "spark-a"))
    assert restarted.land(batch(2, START + 200, reads), 0).outcome == "replayed"

    service = DeltaChangeLogSink(str(tmp_path / "changelog"), JOB, "service")
    service.continue_after(service.latest_checkpoint())
    service.commit([], resume_at(START + 300, "p1", "p2"), lease_released=True)
    handed_back = landing(DeltaChangeLogSink(str(tmp_path / "changelog"), JOB, "spark-a"))
    stale = batch(3, START + 400, reads)
    assert handed_back.land(stale, 1).outcome == "superseded"
    with pytest.raises(WriterFenced):
        handed_back.land(stale, 1)
    assert len(read_versions(tmp_path / "changelog")) == 4, "start, seed, batch, service"


def test_a_transaction_not_whole_below_the_cut_stops_the_batch(tmp_path: Path) -> None:
    sink = job_at(tmp_path)
    reads = {
        "p1": ([record(START + 150, "tx-a", 0, 2)], closed("p1", START + 200)),
        "p2": ([], closed("p2", START + 200)),
    }
    with pytest.raises(IncompleteTransactionError):
        landing(sink).land(batch(2, START + 200, reads), 0)
    twice = [record(START + 150, "tx-a", 0, 1)] * 2
    reads["p1"] = (twice, closed("p1", START + 200))
    with pytest.raises(DuplicateRecordError):
        landing(sink).land(batch(2, START + 200, reads), 0)
    assert len(read_versions(tmp_path / "changelog")) == 2, "nothing landed after the seed"


def test_a_report_round_trips_and_the_plan_is_what_the_checkpoint_says() -> None:
    split = ChildPartitionsRecord(START + 5, "00000002", (ChildPartition("c", ("a", "b")),))
    report = PartitionReport("a", (split,), START + 4, True)
    identity = BatchIdentity(7, START + 9, 3)
    assert parse_report(report_json(report, identity)) == (report, identity)
    reads = plan_batch(resume_at(START + 99, "p1", "p2"), START + 200)
    assert [(r.token, r.start) for r in reads] == [("p1", START + 100), ("p2", START + 100)]


def test_a_batch_that_planned_nothing_lands_nothing(tmp_path: Path) -> None:
    sink = job_at(tmp_path)
    empty = pa.Table.from_batches([], schema=SOURCE_SCHEMA)
    assert landing(sink).landing.land(empty, 0) is None
    assert len(read_versions(tmp_path / "changelog")) == 2


def test_a_tasks_output_holds_each_row_once_and_each_report_after_its_rows() -> None:
    identity = BatchIdentity(2, START + 500, 2)
    first = [record(START + 100 + n, f"tx-{n}", 0, 1) for n in range(5)]
    second = [record(START + 200 + n, f"ty-{n}", 0, 1) for n in range(3)]
    items: list[DataChangeRecord | PartitionReport] = [
        *first,
        closed("p1", START + 500),
        *second,
        closed("p2", START + 500),
    ]
    batches = list(task_batches(items, identity, rows_per_batch=2))
    table = pa.Table.from_batches(batches, schema=SOURCE_SCHEMA)
    ids = [t for t in table["server_transaction_id"].to_pylist() if t is not None]
    assert ids == [r.server_transaction_id for r in first + second]
    reports = [i for i, r in enumerate(table["report"].to_pylist()) if r is not None]
    assert reports == [5, 9], "each report follows its partition's rows"


def test_a_merge_within_a_batch_is_read_by_a_further_wave_and_rows_below_w_never_land(
    tmp_path: Path,
) -> None:
    sink = job_at(tmp_path)
    merge = ChildPartitionsRecord(START + 300, "00000001", (ChildPartition("p3", ("p1", "p2")),))
    again = record(START + 50, "tx-old", 0, 1)  # at or below W: landed by an earlier version
    reads = {
        "p1": ([again, record(START + 120, "tx-a", 0, 1)], closed("p1", START + 500, merge)),
        "p2": ([], closed("p2", START + 500, merge)),
    }
    asked: list[list[PartitionRead]] = []

    def read_wave(wave: list[PartitionRead], identity: BatchIdentity) -> pa.Table:
        asked.append(wave)
        rows = data_rows([record(START + 350, "tx-m", 0, 1)])
        report = report_row(closed("p3", START + 500), identity)
        return pa.Table.from_batches([rows, report], schema=SOURCE_SCHEMA)

    watched = WatchedColumnsPoll(None, 10.0, null_logger())
    without = BatchLanding(ChangeLogLanding(sink, watched, null_logger()))
    first = without.land(batch(2, START + 500, reads), 0)
    assert first is not None and first.low_watermark == START + 299, "the merge lowers the cut"
    sink2 = DeltaChangeLogSink(str(tmp_path / "again"), JOB, "spark-a")
    sink2.continue_after(None)
    sink2.start_job(START)
    sink2.commit([], resume_at(START + 99, "p1", "p2"))
    landed = BatchLanding(
        ChangeLogLanding(sink2, watched, null_logger()), read_wave=read_wave
    ).land(batch(2, START + 500, reads), 0)
    assert asked == [[PartitionRead("p3", START + 300, START + 500)]]
    assert landed is not None and (landed.low_watermark, landed.transactions) == (START + 500, 2)
    rows = read_versions(tmp_path / "again")[-1].rows
    assert [r["server_transaction_id"] for r in rows] == ["tx-a", "tx-m"]


def test_after_the_hand_over_no_batch_lands(tmp_path: Path) -> None:
    sink = job_at(tmp_path)
    reads: dict[str, tuple[list[DataChangeRecord], PartitionReport]] = {
        "p1": ([record(START + 150, "tx-a", 0, 1)], closed("p1", START + 200)),
        "p2": ([], closed("p2", START + 200)),
    }
    spark = landing(sink)
    spark.land(batch(2, START + 200, reads), 0)
    assert spark.landing.hand_over() is not None
    assert spark.landing.land(batch(3, START + 300, reads), 1) is None
    newest = read_versions(tmp_path / "changelog")[-1]
    assert newest.checkpoint is not None and newest.checkpoint.lease_released
    assert newest.checkpoint.resume_point.low_watermark == START + 200


def test_a_change_log_trailing_by_half_the_retention_raises_the_page_alert(tmp_path: Path) -> None:
    """spark-run raises the service's page alert (docs/operations.md) from the same rule."""
    log = CapturingLogger()
    sink = job_at(tmp_path)
    watched = WatchedColumnsPoll(None, 10.0, null_logger())
    hour = 3600 * 10**9
    landing = BatchLanding(ChangeLogLanding(sink, watched, log, retention_nanos=hour))
    p1 = [record(START + 120, "tx-a", 0, 1)]
    landing.land(batch(2, START + 500, {"p1": (p1, closed("p1", START + 500))}), batch_id=0)
    alerts = [c.kwargs for c in log.calls if c.args == ("watermark_lag_near_retention",)]
    assert alerts and alerts[0]["retention_seconds"] == 3600, log.calls
