"""A micro-batch of the processor's output into the tables it changes: each mirror it touches
and, for tables that keep one, their history; on the driver (delta-rs) when the batch is small,
through Spark when it is not. Every commit carries the batch's ``txn`` and ``metadata``
(``pipeline.merges``)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import pyarrow.compute as pc
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from pipeline.columns import mirror_uri
from pipeline.foreign_commits import ForeignCommitCheck
from pipeline.history import Histories, merge_history_on_driver, merge_history_with_spark
from pipeline.merges import commit_once
from pipeline.mirror import merge_into_mirror, merge_on_driver
from pipeline.shapes import TableShape
from runtime.logs import Logger


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
    foreign: ForeignCommitCheck | None = None,
) -> BatchResult:
    """MERGE one micro-batch of processor output into every mirror it touches, and into their
    histories: on the driver through delta-rs when it holds at most ``local_merge_max_rows``
    rows and about ``local_merge_max_bytes`` bytes (its rows as JSON, measured on the executors
    before anything is collected), else through Spark. Rows of large values so never exhaust
    the driver. Each table is first checked for rows changed behind the job (``foreign``)."""
    changes = changes.persist()
    kept = set() if histories is None else histories.of(shapes)
    try:
        counts, newest, size = _measure(changes)
        small = 0 < sum(counts.values()) <= local_merge_max_rows and size <= local_merge_max_bytes
        merge_mirror, merge_history = _mergers(changes, small, shapes, app_id, batch_id, metadata)
        merge_tables = functools.partial(_merge_tables, batch_id=batch_id, foreign=foreign, log=log)
        mirrors = merge_tables(
            {t: mirror_uri(mirror_root, t) for t in sorted(counts)}, merge_mirror, "mirror"
        )
        kept_versions = {}
        if histories is not None:
            touched = sorted(kept & set(counts))
            kept_versions = merge_tables(
                {t: histories.uri(t) for t in touched}, merge_history, "history"
            )
        return BatchResult(counts, newest, small, size, mirrors, kept_versions)
    finally:
        changes.unpersist()


Merge = Callable[[str, str], int]
"""One table's rows of the batch into the Delta table at a URI: the version holding them."""


def _measure(changes: DataFrame) -> tuple[dict[str, int], str | None, int]:
    """Rows per table, the newest commit timestamp and the rows' size as JSON, in one job."""
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
    return counts, newest, sum(r["bytes"] or 0 for r in per_table)


def _mergers(
    changes: DataFrame,
    small: bool,
    shapes: Mapping[str, TableShape],
    app_id: str,
    batch_id: int,
    metadata: Mapping[str, str] | None,
) -> tuple[Merge, Merge]:
    """The MERGE of a mirror and of a history: delta-rs on the driver when ``small``."""
    if not small:
        spark = changes.sparkSession

        def mirror_with_spark(table: str, uri: str) -> int:
            return merge_into_mirror(spark, uri, shapes[table], changes, app_id, batch_id, metadata)

        def history_with_spark(table: str, uri: str) -> int:
            return merge_history_with_spark(
                spark, uri, shapes[table], changes, app_id, batch_id, metadata
            )

        return mirror_with_spark, history_with_spark
    batch = changes.toArrow()
    tables = batch.column("table_name")

    def mirror_on_driver(table: str, uri: str) -> int:
        rows = batch.filter(pc.equal(tables, table))
        return merge_on_driver(uri, shapes[table], rows, app_id, batch_id, metadata)

    def history_on_driver(table: str, uri: str) -> int:
        rows = batch.filter(pc.equal(tables, table))
        return merge_history_on_driver(uri, shapes[table], rows, app_id, batch_id, metadata)

    return mirror_on_driver, history_on_driver


def _merge_tables(
    uris: Mapping[str, str],
    merge: Merge,
    kind: str,
    batch_id: int,
    foreign: ForeignCommitCheck | None,
    log: Logger,
) -> dict[str, int]:
    """Each table checked, then merged once (``commit_once``); the versions holding the batch."""
    versions = {}
    for table, uri in uris.items():
        if foreign is not None:
            foreign.check(f"{kind} {table}", uri)
        versions[table] = commit_once(table, functools.partial(merge, table, uri), batch_id, log)
        if foreign is not None:
            foreign.wrote(uri, versions[table])
    return versions
