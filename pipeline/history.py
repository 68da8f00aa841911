"""History tables (SCD type 2), opt-in per table: one row per version of a Spanner row.

A version is the row as one commit left it, valid from that commit (``_valid_from``) until the
next commit that changed the row (``_valid_to``); the newest one is current (``_valid_to`` NULL,
``_is_current``). A delete closes the row's last version and opens none. Times are Spanner commit
timestamps, as Spark timestamps (microseconds, the precision of a commit timestamp) and as the
change log's exact RFC 3339 text, which sorts as time does: reads as of a time compare the text.

The versions come from the mirror job's own state (``pipeline.processor``: each change applied
to a key, one per commit, none for a change that left the row as it was), so a history follows
the same rules, schema changes and rebases as the mirror, and takes its columns the same way
(``pipeline.mirror.ensure_mirror``: a column dropped, or dropped and added again, shows NULL in
every version, as in the mirror). One MERGE per table and batch closes each key's current
version at its first change in the batch and inserts the batch's versions, once
(``pipeline.merges``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from ingest.contract.changelog import newest_checkpoint
from ingest.model.timestamps import to_rfc3339
from pipeline.catalog import checkpoint_at
from pipeline.columns import (
    FIRST_CHANGE,
    FIRST_CHANGE_TEXT,
    IS_CURRENT,
    KEYS_COLUMN,
    POSITION_COLUMN,
    VALID_FROM,
    VALID_FROM_TEXT,
    VALID_TO,
    VALID_TO_TEXT,
)
from pipeline.merges import (
    SparkColumn,
    batch_commit,
    commit_properties,
    holds_batch,
    key_predicate,
    keys_match,
    narrowing_condition,
    quoted,
    sql_name,
    table_version,
    utc_timestamps,
)
from pipeline.mirror import ensure_mirror
from pipeline.processor import history_variable
from pipeline.shapes import TableShape
from pipeline.state import cut
from pipeline.state.variables import row_variable
from runtime.logs import Logger
from runtime.storage import delta_storage_options

HISTORY_SINCE = "spanner_cdc.history_since"
"""History table property: the Spanner time from which it holds every version (none: from the
change log's beginning)."""
TEXT_PATTERN = "yyyy-MM-dd'T'HH:mm:ss.SSSSSSSSSX"
"""The change log's RFC 3339 text, read by Spark to microseconds."""
ACTION = "_cdc_action"
CLOSE, INSERT = "CLOSE", "INSERT"
PERIOD_COLUMNS = (VALID_FROM_TEXT, VALID_FROM, VALID_TO_TEXT, VALID_TO)


@dataclass(frozen=True, slots=True)
class Histories:
    """Which tables keep a history, and where: ``<root>/<table>``."""

    root: str
    tables: frozenset[str]

    def uri(self, table: str) -> str:
        return f"{self.root.rstrip('/')}/{table}"

    def of(self, shapes: Mapping[str, TableShape]) -> frozenset[str]:
        """The tables of ``shapes`` that keep one (``*`` names every table)."""
        return frozenset(shapes) if "*" in self.tables else self.tables & set(shapes)


def history_struct(shape: TableShape) -> T.StructType:
    """A history's columns: the table's (the mirror's types), its keys as the change log spells
    them, and the version's period."""
    return T.StructType(
        [
            *shape.struct().fields,
            T.StructField(KEYS_COLUMN, T.StringType(), True),
            T.StructField(VALID_FROM_TEXT, T.StringType(), True),
            T.StructField(VALID_FROM, T.TimestampType(), True),
            T.StructField(VALID_TO_TEXT, T.StringType(), True),
            T.StructField(VALID_TO, T.TimestampType(), True),
            T.StructField(IS_CURRENT, T.BooleanType(), True),
        ]
    )


def ensure_history(
    spark: SparkSession,
    uri: str,
    shape: TableShape,
    mirror: str,
    since: Callable[[], str],
    log: Logger,
) -> None:
    """Create the history, or bring its columns up to the table's shape as the mirror's.

    A history created for a table whose mirror already holds rows begins with them: each row a
    version valid from its last change (``_cdc_last_applied``). It then holds the table from
    ``since()`` on (a W the mirror had wholly reached), recorded as a table property that reads
    as of a time check."""
    from deltalake import DeltaTable

    created = not DeltaTable.is_deltatable(uri, storage_options=delta_storage_options(uri))
    ensure_mirror(spark, uri, shape, log, history_struct(shape))
    if not created or not _has_data_files(mirror):
        return
    rows = spark.read.format("delta").load(mirror)
    if rows.limit(1).count() == 0:
        return
    begins = since()
    fields = [f.name for f in shape.struct().fields]
    text = F.col(f"{POSITION_COLUMN}.commit_timestamp_text")
    seeded = rows.select(
        *[F.col(quoted(name)) for name in fields],
        F.col(KEYS_COLUMN),
        text.alias(VALID_FROM_TEXT),
        F.to_timestamp(text, TEXT_PATTERN).alias(VALID_FROM),
        F.lit(None).cast("string").alias(VALID_TO_TEXT),
        F.lit(None).cast("timestamp").alias(VALID_TO),
        F.lit(True).alias(IS_CURRENT),
    )
    seeded.write.format("delta").mode("append").save(uri)
    spark.sql(f"ALTER TABLE delta.{quoted(uri)} SET TBLPROPERTIES ('{HISTORY_SINCE}' = '{begins}')")
    log.info("history_created_from_mirror", table=shape.name, since=begins)


def _has_data_files(mirror: str) -> bool:
    """Whether a mirror's Delta log lists a data file, read without a Spark job: a new job's
    histories are made beside mirrors made a moment before, and reading one through Spark to
    find it empty cost seconds of every start."""
    from deltalake import DeltaTable

    return bool(DeltaTable(mirror, storage_options=delta_storage_options(mirror)).file_uris())


def mirrors_reached(changelog_uri: str, mirror_root: str) -> str:
    """A W the mirrors have wholly reached, from their cut: that of the first change-log version
    they do not wholly hold (all its changes, and any they hold of it, are at or below it) or,
    when it has not landed yet, that of the version before."""
    position = cut.read(mirror_root)
    candidates = [] if position is None else [position.starting_version]
    candidates += [] if position is None else [position.starting_version - 1]
    for version in candidates:
        checkpoint = checkpoint_at(changelog_uri, version) if version >= 0 else None
        if checkpoint is not None:
            return to_rfc3339(checkpoint.resume_point.low_watermark)
    from deltalake import DeltaTable

    newest = newest_checkpoint(
        DeltaTable(changelog_uri, storage_options=delta_storage_options(changelog_uri))
    )
    return "" if newest is None else to_rfc3339(newest[1].resume_point.low_watermark)


def merge_history_on_driver(
    uri: str,
    shape: TableShape,
    rows: pa.Table,
    app_id: str,
    batch_id: int,
    metadata: Mapping[str, str] | None = None,
) -> int:
    """MERGE one table's versions of the batch with delta-rs; the table's version after it."""
    from deltalake import DeltaTable

    history = DeltaTable(uri, storage_options=delta_storage_options(uri))
    if holds_batch(history, app_id, batch_id):
        return history.version()
    source = driver_source(shape, rows)
    if source.num_rows == 0:
        return history.version()
    names = [f.name for f in history_struct(shape).fields]
    inserted = {sql_name(name): f"s.{sql_name(name)}" for name in names}
    closed = {
        sql_name(VALID_TO_TEXT): f"s.{sql_name(VALID_TO_TEXT)}",
        sql_name(VALID_TO): f"s.{sql_name(VALID_TO)}",
        sql_name(IS_CURRENT): "false",
    }
    condition = (
        f"{key_predicate(shape, source)} AND t.{IS_CURRENT} = true AND s.{ACTION} = '{CLOSE}'"
    )
    (
        history.merge(
            source,
            condition,
            source_alias="s",
            target_alias="t",
            streamed_exec=False,
            commit_properties=commit_properties(app_id, batch_id, metadata),
        )
        .when_matched_update(closed)
        .when_not_matched_insert(inserted, predicate=f"s.{ACTION} = '{INSERT}'")
        .execute()
    )
    return history.version()


def driver_source(shape: TableShape, rows: pa.Table) -> pa.Table:
    """A MERGE's source from one table's output rows: a CLOSE row per key that changed (its
    current version ends at the key's first change of the batch), then an INSERT row per version
    the batch made."""
    names = [f.name for f in shape.struct().fields]
    closing = rows.filter(pc.is_valid(rows.column(FIRST_CHANGE_TEXT)))
    keys_image = closing.column(row_variable(shape.name)).combine_chunks()
    count = closing.num_rows
    close = {
        ACTION: pa.array([CLOSE] * count, pa.string()),
        **dict(zip(names, keys_image.flatten(), strict=True)),
        KEYS_COLUMN: closing.column("keys").combine_chunks(),
        VALID_FROM_TEXT: pa.nulls(count, pa.string()),
        VALID_FROM: pa.nulls(count, pa.timestamp("us", tz="UTC")),
        VALID_TO_TEXT: closing.column(FIRST_CHANGE_TEXT).combine_chunks(),
        VALID_TO: closing.column(FIRST_CHANGE).combine_chunks(),
        IS_CURRENT: pa.array([False] * count, pa.bool_()),
    }
    versions = rows.column(history_variable(shape.name)).combine_chunks()
    made = pc.list_flatten(versions)
    owners = pc.list_parent_indices(versions)
    insert = {
        ACTION: pa.array([INSERT] * len(made), pa.string()),
        **dict(zip(names, made.field("image").flatten(), strict=True)),
        KEYS_COLUMN: rows.column("keys").combine_chunks().take(owners),
        **{name: made.field(name) for name in PERIOD_COLUMNS},
        IS_CURRENT: pc.is_null(made.field(VALID_TO_TEXT)),
    }
    tables = [pa.table(close), pa.table(insert)]
    schema = pa.schema([pa.field(f.name, utc_timestamps(f.type)) for f in tables[1].schema])
    return pa.concat_tables([t.cast(schema) for t in tables])


def merge_history_with_spark(
    spark: SparkSession,
    uri: str,
    shape: TableShape,
    changes: DataFrame,
    app_id: str,
    batch_id: int,
    metadata: Mapping[str, str] | None = None,
) -> int:
    """MERGE one table's versions of the batch with delta-spark; the table's version after."""
    from delta.tables import DeltaTable

    mine = changes.where(F.col("table_name") == shape.name)
    image = f"{quoted(row_variable(shape.name))}.*"
    close = mine.where(F.col(FIRST_CHANGE_TEXT).isNotNull()).select(
        F.lit(CLOSE).alias(ACTION),
        F.col(image),
        F.col("keys").alias(KEYS_COLUMN),
        F.lit(None).cast("string").alias(VALID_FROM_TEXT),
        F.lit(None).cast("timestamp").alias(VALID_FROM),
        F.col(FIRST_CHANGE_TEXT).alias(VALID_TO_TEXT),
        F.col(FIRST_CHANGE).alias(VALID_TO),
        F.lit(False).alias(IS_CURRENT),
    )
    insert = mine.select(F.col("keys"), F.explode(history_variable(shape.name)).alias("v")).select(
        F.lit(INSERT).alias(ACTION),
        F.col("v.image.*"),
        F.col("keys").alias(KEYS_COLUMN),
        *[F.col(f"v.{name}").alias(name) for name in PERIOD_COLUMNS],
        F.col(f"v.{VALID_TO_TEXT}").isNull().alias(IS_CURRENT),
    )
    source = close.unionByName(insert)
    condition = (
        keys_match(shape)
        & narrowing_condition(source, shape)
        & F.col(f"t.{IS_CURRENT}")
        & (F.col(f"s.{ACTION}") == CLOSE)
    )
    closed: dict[str, str | SparkColumn] = {
        quoted(VALID_TO_TEXT): F.col(f"s.{VALID_TO_TEXT}"),
        quoted(VALID_TO): F.col(f"s.{VALID_TO}"),
        quoted(IS_CURRENT): F.lit(False),
    }
    inserted: dict[str, str | SparkColumn] = {
        quoted(f.name): F.col(f"s.{quoted(f.name)}") for f in history_struct(shape).fields
    }
    with batch_commit(spark, app_id, batch_id, metadata):
        (
            DeltaTable.forPath(spark, uri)
            .alias("t")
            .merge(source.alias("s"), condition)
            .whenMatchedUpdate(set=closed)
            .whenNotMatchedInsert(condition=F.col(f"s.{ACTION}") == INSERT, values=inserted)
            .execute()
        )
    return table_version(uri)
