"""What the Spark source's tasks send the driver: change-log rows of the data change records they
read (with the exact commit timestamp in nanoseconds, which the cut compares) and one report row
per task (its partition's lineage records, watermark, and the batch it belongs to)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from ingest.contract.changelog import SCHEMA
from ingest.delta.changelog import records_to_arrow
from ingest.model.records import (
    ChangeRecord,
    ChildPartition,
    ChildPartitionsRecord,
    DataChangeRecord,
    PartitionEndRecord,
    PartitionStartRecord,
)
from ingest.model.timestamps import Nanos, parse_rfc3339, to_rfc3339
from ingest.rules.batches import PartitionReport

COMMIT_NANOS = "commit_nanos"
REPORT = "report"
SOURCE_SCHEMA = pa.schema(
    [*SCHEMA, pa.field(COMMIT_NANOS, pa.int64()), pa.field(REPORT, pa.string())]
)
SPARK_TYPES = {
    pa.timestamp("us", tz="UTC"): "timestamp",
    pa.string(): "string",
    pa.int32(): "int",
    pa.int64(): "bigint",
    pa.bool_(): "boolean",
    pa.date32(): "date",
}
SPARK_SCHEMA = ", ".join(f"{f.name} {SPARK_TYPES[f.type]}" for f in SOURCE_SCHEMA)
"""The source's schema as Spark DDL."""


@dataclass(frozen=True, slots=True)
class BatchIdentity:
    """The batch a task belongs to: the job's change-log version it was planned from, its end,
    and how many partitions it planned (the driver checks that every one reported)."""

    version: int
    end: Nanos
    partitions: int
    max_records: int | None = None
    """The batch's data change records limit (admission control), shared among the reads of
    each wave: what the first waves read is not there for the next."""


def task_batches(
    items: Iterable[DataChangeRecord | PartitionReport], batch: BatchIdentity, rows_per_batch: int
) -> Iterator[pa.RecordBatch]:
    """A task's output: its records' rows in batches of about ``rows_per_batch``, and each
    partition's report after the rows of that partition."""
    pending: list[DataChangeRecord] = []
    rows = 0
    for item in items:
        if isinstance(item, DataChangeRecord):
            pending.append(item)
            rows += len(item.mods)
            if rows < rows_per_batch:
                continue
        if pending:
            yield data_rows(pending)
            pending, rows = [], 0
        if isinstance(item, PartitionReport):
            yield report_row(item, batch)
    if pending:
        yield data_rows(pending)


def data_rows(records: Iterable[DataChangeRecord]) -> pa.RecordBatch:
    records = list(records)
    rows = records_to_arrow(records)
    nanos = [r.commit_timestamp for r in records for _ in r.mods]
    table = rows.append_column(COMMIT_NANOS, pa.array(nanos, pa.int64())).append_column(
        REPORT, pa.nulls(rows.num_rows, pa.string())
    )
    return _one_batch(table)


def report_row(report: PartitionReport, batch: BatchIdentity) -> pa.RecordBatch:
    columns = {field.name: pa.nulls(1, field.type) for field in SOURCE_SCHEMA}
    columns[REPORT] = pa.array([report_json(report, batch)], pa.string())
    return _one_batch(pa.table(columns, schema=SOURCE_SCHEMA))


def _one_batch(table: pa.Table) -> pa.RecordBatch:
    batches = table.combine_chunks().to_batches()
    return batches[0] if batches else pa.RecordBatch.from_pylist([], schema=SOURCE_SCHEMA)


def report_json(report: PartitionReport, batch: BatchIdentity) -> str:
    return json.dumps(
        {
            "version": batch.version,
            "end": to_rfc3339(batch.end),
            "partitions": batch.partitions,
            "max_records": batch.max_records,
            "token": report.token,
            "watermark": to_rfc3339(report.watermark),
            "closed": report.closed,
            "followed": report.followed,
            "lineage": [_lineage_json(r) for r in report.lineage],
        },
        separators=(",", ":"),
    )


def parse_report(text: str) -> tuple[PartitionReport, BatchIdentity]:
    data = json.loads(text)
    report = PartitionReport(
        data["token"],
        tuple(_lineage_record(r) for r in data["lineage"]),
        parse_rfc3339(data["watermark"]),
        data["closed"],
        data["followed"],
    )
    identity = BatchIdentity(
        data["version"], parse_rfc3339(data["end"]), data["partitions"], data["max_records"]
    )
    return report, identity


def _lineage_json(record: ChangeRecord) -> dict[str, Any]:
    if isinstance(record, ChildPartitionsRecord):
        return {
            "kind": "child_partitions",
            "start_timestamp": to_rfc3339(record.start_timestamp),
            "record_sequence": record.record_sequence,
            "child_partitions": [
                {"token": c.token, "parent_partition_tokens": list(c.parent_partition_tokens)}
                for c in record.child_partitions
            ],
        }
    if isinstance(record, PartitionStartRecord):
        return {
            "kind": "partition_start",
            "start_timestamp": to_rfc3339(record.start_timestamp),
            "record_sequence": record.record_sequence,
            "partition_tokens": list(record.partition_tokens),
        }
    if isinstance(record, PartitionEndRecord):
        return {
            "kind": "partition_end",
            "end_timestamp": to_rfc3339(record.end_timestamp),
            "record_sequence": record.record_sequence,
            "partition_token": record.partition_token,
        }
    raise TypeError(f"not a lineage record: {type(record).__name__}")


def _lineage_record(data: dict[str, Any]) -> ChangeRecord:
    if data["kind"] == "child_partitions":
        return ChildPartitionsRecord(
            parse_rfc3339(data["start_timestamp"]),
            data["record_sequence"],
            tuple(
                ChildPartition(c["token"], tuple(c["parent_partition_tokens"]))
                for c in data["child_partitions"]
            ),
        )
    if data["kind"] == "partition_start":
        return PartitionStartRecord(
            parse_rfc3339(data["start_timestamp"]),
            data["record_sequence"],
            tuple(data["partition_tokens"]),
        )
    return PartitionEndRecord(
        parse_rfc3339(data["end_timestamp"]), data["record_sequence"], data["partition_token"]
    )
