"""A micro-batch of the processor's output into the tables it changes: each mirror it touches
and, for tables that keep one, their history; on the driver (delta-rs) when the batch is small,
through Spark when it is not. Every commit carries the batch's ``txn`` and ``metadata``
(``pipeline.merges``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import structlog
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from pipeline.history import Histories, merge_history_on_driver, merge_history_with_spark
from pipeline.merges import merge_each_table
from pipeline.mirror import merge_into_mirror, merge_on_driver, mirror_uri
from pipeline.shapes import TableShape

Logger = structlog.typing.FilteringBoundLogger


@dataclass(frozen=True, slots=True)
class BatchResult:
    rows: dict[str, int]
    """Keys merged per table."""
    newest_commit: str | None
    """The newest commit timestamp applied by the batch: how fresh the mirrors are."""
    merged_on_driver: bool = False
    """Merged by delta-rs on the driver (small enough in rows and bytes), else by Spark."""
    bytes: int = 0
    """The batch's size as its rows' JSON, measured on the executors: what decided the above."""
    mirror_versions: dict[str, int] = field(default_factory=dict)
    """Each touched mirror's Delta version holding the batch."""
    history_versions: dict[str, int] = field(default_factory=dict)
    """Each touched history's Delta version holding the batch."""


def write_batch(
    changes: DataFrame,
    batch_id: int,
    shapes: Mapping[str, TableShape],
    mirror_root: str,
    app_id: str,
    log: Logger,
    local_merge_max_rows: int = 0,
    local_merge_max_bytes: int = 64 * 1024 * 1024,
    histories: Histories | None = None,
    metadata: Mapping[str, str] | None = None,
) -> BatchResult:
    """MERGE one micro-batch of processor output into every mirror it touches, and into their
    histories: on the driver through delta-rs when it holds at most ``local_merge_max_rows``
    rows and about ``local_merge_max_bytes`` bytes (its rows as JSON, measured on the executors
    before anything is collected), else through Spark. Rows of large values so never exhaust
    the driver."""
    spark = changes.sparkSession
    changes = changes.persist()
    kept = set() if histories is None else histories.of(shapes)
    try:
        row_bytes = F.octet_length(F.to_json(F.struct(*[F.col(c) for c in changes.columns])))
        per_table = (
            changes.groupBy("table_name")
            .agg(
                F.count("*").alias("rows"),
                F.max("commit_timestamp_text").alias("newest"),
                F.sum(row_bytes).alias("bytes"),
            )
            .collect()
        )
        counts = {r["table_name"]: r["rows"] for r in per_table}
        newest = max((r["newest"] for r in per_table), default=None)
        size = sum(r["bytes"] or 0 for r in per_table)
        small = 0 < sum(counts.values()) <= local_merge_max_rows and size <= local_merge_max_bytes
        mirrors: dict[str, int] = {}
        kept_versions: dict[str, int] = {}
        merge_mirror: Callable[[str], object]
        merge_history: Callable[[str], object]
        if small:
            batch = changes.toArrow()
            tables = batch.column("table_name")

            def rows_of(table: str) -> pa.Table:
                return batch.filter(pc.equal(tables, table))

            def merge_mirror(table: str) -> None:
                uri = mirror_uri(mirror_root, table)
                mirrors[table] = merge_on_driver(
                    uri, shapes[table], rows_of(table), app_id, batch_id, metadata
                )

            def merge_history(table: str) -> None:
                assert histories is not None
                kept_versions[table] = merge_history_on_driver(
                    histories.uri(table), shapes[table], rows_of(table), app_id, batch_id, metadata
                )

        else:

            def merge_mirror(table: str) -> None:
                uri = mirror_uri(mirror_root, table)
                mirrors[table] = merge_into_mirror(
                    spark, uri, shapes[table], changes, app_id, batch_id, metadata
                )

            def merge_history(table: str) -> None:
                assert histories is not None
                kept_versions[table] = merge_history_with_spark(
                    spark, histories.uri(table), shapes[table], changes, app_id, batch_id, metadata
                )

        merge_each_table(sorted(counts), merge_mirror, batch_id, log)
        merge_each_table(sorted(kept & set(counts)), merge_history, batch_id, log)
        return BatchResult(counts, newest, small, size, mirrors, kept_versions)
    finally:
        changes.unpersist()
