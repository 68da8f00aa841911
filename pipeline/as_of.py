"""Every captured table as it was at a Spanner time T, with deltalake or with Spark.

- **Exactly, from the histories** (``pipeline.history``): each table's versions valid at T,
  ``_valid_from_text ≤ T < _valid_to_text``. T must lie between where the history begins (the
  change log's start, or when the table's history was created from its mirror) and the W of the
  newest consistent batch: beyond it, changes may still be on their way.
- **At batch granularity, from the mirrors**: the newest consistent batch whose W ≤ T
  (``pipeline.batch_log``) and each mirror at the Delta version that batch left: every table at
  the same W, which the result names.

Times are RFC 3339 text with nine fractional digits, the change log's spelling, which sorts as
time does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from ingest.model.timestamps import parse_rfc3339, to_rfc3339
from pipeline import batch_log
from pipeline.batch_log import AppliedBatch
from pipeline.catalog import query, scan
from pipeline.columns import PRODUCT_COLUMNS, VALID_FROM_TEXT, VALID_TO_TEXT, mirror_uri
from pipeline.history import HISTORY_SINCE, Histories
from runtime.errors import BadInput
from runtime.storage import delta_storage_options


class NotAvailableAsOf(BadInput, ValueError):
    """The tables do not hold T: before their history begins or beyond what has landed."""


@dataclass(frozen=True, slots=True)
class AsOf:
    """Tables as of ``at``; ``consistent_at`` is the Spanner time they equal (T itself from the
    histories, the batch's W from the mirrors)."""

    at: str
    consistent_at: str
    source: str
    tables: dict[str, Any]
    """Table name → a pyarrow Table (deltalake) or a DataFrame (Spark), the table's columns only."""


def canonical(at: str) -> str:
    """T in the change log's spelling."""
    try:
        return to_rfc3339(parse_rfc3339(at))
    except ValueError:
        raise NotAvailableAsOf(f"{at!r} is no RFC 3339 time (2026-11-25T08:00:00.5Z)") from None


def history_as_of(
    histories: Histories, mirror_root: str, at: str, tables: Iterable[str] | None = None
) -> AsOf:
    """Each history's versions valid at ``at``, read by deltalake."""
    from deltalake import DeltaTable

    at = canonical(at)
    chosen = _history_tables(histories, mirror_root, at, tables)
    result = {}
    for table, uri in chosen.items():
        history = DeltaTable(uri, storage_options=delta_storage_options(uri))
        rows = _valid_at(history, at)
        result[table] = _table_columns(rows)
    return AsOf(at, at, "history", result)


def spark_history_as_of(
    spark: Any,
    histories: Histories,
    mirror_root: str,
    at: str,
    tables: Iterable[str] | None = None,
) -> AsOf:
    """The same, as Spark DataFrames."""
    from pyspark.sql import functions as F

    at = canonical(at)
    chosen = _history_tables(histories, mirror_root, at, tables)
    result = {}
    for table, uri in chosen.items():
        rows = spark.read.format("delta").load(uri)
        valid = (F.col(VALID_FROM_TEXT) <= F.lit(at)) & (
            F.col(VALID_TO_TEXT).isNull() | (F.col(VALID_TO_TEXT) > F.lit(at))
        )
        columns = [c for c in rows.columns if not _product_column(c)]
        result[table] = rows.where(valid).select(*[f"`{c}`" for c in columns])
    return AsOf(at, at, "history", result)


def mirrors_as_of(mirror_root: str, at: str, tables: Iterable[str] | None = None) -> AsOf:
    """Each mirror as the newest consistent batch at or before ``at`` left it, by deltalake."""
    from deltalake import DeltaTable

    at = canonical(at)
    batch, versions = _batch_at(mirror_root, at, tables)
    result = {}
    for table, version in versions.items():
        uri = mirror_uri(mirror_root, table)
        mirror = DeltaTable(uri, version=version, storage_options=delta_storage_options(uri))
        result[table] = _table_columns(scan(mirror))
    assert batch.watermark_text is not None
    return AsOf(at, batch.watermark_text, "mirrors", result)


def spark_mirrors_as_of(
    spark: Any, mirror_root: str, at: str, tables: Iterable[str] | None = None
) -> AsOf:
    """The same, as Spark DataFrames (Delta time travel, ``versionAsOf``)."""
    at = canonical(at)
    batch, versions = _batch_at(mirror_root, at, tables)
    result = {}
    for table, version in versions.items():
        rows = (
            spark.read.format("delta")
            .option("versionAsOf", version)
            .load(mirror_uri(mirror_root, table))
        )
        columns = [c for c in rows.columns if not _product_column(c)]
        result[table] = rows.select(*[f"`{c}`" for c in columns])
    assert batch.watermark_text is not None
    return AsOf(at, batch.watermark_text, "mirrors", result)


def _history_tables(
    histories: Histories, mirror_root: str, at: str, tables: Iterable[str] | None
) -> dict[str, str]:
    """The histories to read at ``at``, once it is checked that they hold it."""
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    landed = batch_log.consistent(mirror_root)
    if not landed:
        raise NotAvailableAsOf("no consistent batch has landed yet: the histories hold no time")
    newest = landed[-1]
    assert newest.watermark_text is not None
    if at > newest.watermark_text:
        raise NotAvailableAsOf(
            f"{at} is after the newest consistent batch's W {newest.watermark_text}: changes "
            "up to it may not have landed"
        )
    start = newest.changelog_start_text or ""
    if at < start:
        raise NotAvailableAsOf(f"{at} is before the change log begins ({start})")
    chosen = {}
    for table in sorted(tables if tables is not None else _kept(histories, mirror_root, landed)):
        uri = histories.uri(table)
        try:
            history = DeltaTable(uri, storage_options=delta_storage_options(uri))
        except TableNotFoundError:
            raise NotAvailableAsOf(f"table {table!r} keeps no history") from None
        since = history.metadata().configuration.get(HISTORY_SINCE) or ""
        if at < since:
            raise NotAvailableAsOf(f"{at} is before table {table!r}'s history begins ({since})")
        chosen[table] = uri
    return chosen


def _kept(histories: Histories, mirror_root: str, landed: list[AppliedBatch]) -> set[str]:
    """Every table with a history: named by a batch, or by the configuration."""
    named = {t for b in landed for t in b.history_versions}
    return named | ({t for t in histories.tables if t != "*"})


def _batch_at(
    mirror_root: str, at: str, tables: Iterable[str] | None
) -> tuple[AppliedBatch, dict[str, int]]:
    """The newest consistent batch whose W ≤ ``at``, and each mirror's version it left: the
    newest one the batches up to it recorded (a batch records the mirrors it changed; batches
    that end at one change-log version are in no order of their own)."""
    landed = batch_log.read(mirror_root)
    chosen = None
    for position, batch in enumerate(landed):
        if batch.consistent and batch.watermark_text and batch.watermark_text <= at:
            chosen = position
    if chosen is None:
        first = next((b.watermark_text for b in landed if b.consistent), None)
        raise NotAvailableAsOf(
            f"no consistent batch at or before {at}"
            + (f" (the first is at {first})" if first else " has landed yet")
        )
    versions: dict[str, int] = {}
    for batch in landed[: chosen + 1]:
        for table, version in batch.mirror_versions.items():
            versions[table] = max(version, versions.get(table, version))
    if tables is not None:
        wanted = set(tables)
        unknown = wanted - set(versions)
        if unknown:
            raise NotAvailableAsOf(f"no mirror of {sorted(unknown)} at {at}")
        versions = {t: v for t, v in versions.items() if t in wanted}
    return landed[chosen], dict(sorted(versions.items()))


def _valid_at(history: Any, at: str) -> pa.Table:
    """A history's versions valid at ``at``, filtered by delta-rs's query engine as they are
    read (a history holds every version ever made)."""
    sql = (
        f"SELECT * FROM history WHERE \"{VALID_FROM_TEXT}\" <= '{at}' "
        f'AND ("{VALID_TO_TEXT}" IS NULL OR "{VALID_TO_TEXT}" > \'{at}\')'
    )
    return query(history, "history", sql)


def _product_column(name: str) -> bool:
    return name in PRODUCT_COLUMNS


def _table_columns(rows: pa.Table) -> pa.Table:
    return rows.select([n for n in rows.column_names if not _product_column(n)])
