"""Delta mirror tables: one per Spanner table, kept equal to it by an idempotent MERGE per batch.

Two ways to MERGE, one contract. A batch of at most ``local_merge_max_rows`` output rows (and
``local_merge_max_mb`` of them) is collected to the driver as Arrow and merged by delta-rs
(``deltalake``): about 0.1 s where delta-spark's MERGE costs 4-8 s of fixed planning and jobs on
two cores, which made the mirrors trail Spanner by a minute. A larger batch is merged by
delta-spark on the executors. Either commits once per batch (``pipeline.merges``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from pipeline.columns import KEYS_COLUMN, LAST_APPLIED_COLUMN, OPERATION, POSITION_COLUMN
from pipeline.merges import (
    SparkColumn,
    batch_commit,
    commit_properties,
    holds_batch,
    job_commit,
    key_predicate,
    keys_match,
    narrowing_condition,
    quoted,
    sql_name,
    store_retrying,
    table_version,
    utc_timestamps,
)
from pipeline.shapes import TableShape
from pipeline.state.variables import LAST_APPLIED, row_variable
from runtime.logs import Logger
from runtime.storage import delta_storage_options

MIRROR_TARGET_FILE_BYTES = 16 * 1024 * 1024
"""Mirror files written by the driver MERGE stay about this size (bench/RESULTS.md, mirror size)."""
GENERATIONS_PROPERTY = "spanner_cdc.generations"
"""Mirror table property: the generation each column holds (pipeline.shapes.ColumnGeneration)."""


def mirror_struct(shape: TableShape) -> T.StructType:
    """The mirror's columns: the table's, then the two the product keeps beside each row."""
    return T.StructType(
        [
            *shape.struct().fields,
            T.StructField(KEYS_COLUMN, T.StringType(), True),
            T.StructField(POSITION_COLUMN, LAST_APPLIED, True),
        ]
    )


def ensure_mirror(
    spark: SparkSession,
    uri: str,
    shape: TableShape,
    log: Logger,
    wanted: T.StructType | None = None,
) -> None:
    """Create the mirror (or a table of ``wanted`` columns that follows the table's shape the
    same way: its history), add new columns, and rewrite columns whose type changed.

    STRING↔BYTES: Delta cannot retype a column in place, so the mirror is rewritten with the cast
    values (Spanner converts them too). A column dropped and added again with another type is a new
    generation: Spanner holds NULL in it for every row, and so does the rewritten mirror. Either
    rewrite is a metadata change: concurrent readers of the mirror fail once and must be restarted
    (docs/design.md, Delta concurrency).
    """
    wanted = wanted or mirror_struct(shape)
    generations = {c.name: shape.mirror_generation(c) for c in shape.columns}
    newer = {name: number for name, number in sorted(generations.items()) if number > 1}
    current = _read_or_create(uri, wanted, newer)
    if current is None:
        log.info("mirror_created", table=shape.name, uri=uri, columns=len(wanted.fields))
        return
    schema, properties = current
    existing = {f.name: f.dataType for f in schema.fields}
    recorded = json.loads(properties.get(GENERATIONS_PROPERTY) or "{}")
    renewed = [
        f
        for f in wanted.fields
        if f.name in existing and generations.get(f.name, 1) > recorded.get(f.name, 1)
    ]
    retyped = [
        f
        for f in wanted.fields
        if f.name in existing and existing[f.name] != f.dataType and f not in renewed
    ]
    if retyped or renewed:
        _rewrite(spark, uri, wanted, existing, renewed)
        if retyped:
            log.info("mirror_columns_retyped", table=shape.name, columns=[f.name for f in retyped])
        if renewed:
            log.info("mirror_columns_renewed", table=shape.name, columns=[f.name for f in renewed])
    added = [f for f in wanted.fields if f.name not in existing]
    if added:
        columns_sql = ", ".join(f"{quoted(f.name)} {f.dataType.simpleString()}" for f in added)
        spark.sql(f"ALTER TABLE delta.{quoted(uri)} ADD COLUMNS ({columns_sql})")
        log.info("mirror_columns_added", table=shape.name, columns=[f.name for f in added])
    if newer and recorded != newer:
        _record_generations(spark, uri, newer)


def _rewrite(
    spark: SparkSession,
    uri: str,
    wanted: T.StructType,
    existing: dict[str, T.DataType],
    renewed: list[T.StructField],
) -> None:
    """The table rewritten with each column cast to its wanted type, and NULL in columns of a
    new generation (the job's commit: ``pipeline.foreign_commits``)."""
    data = spark.read.format("delta").load(uri)
    columns = [
        F.lit(None).cast(f.dataType).alias(f.name)
        if f in renewed
        else F.col(quoted(f.name)).cast(f.dataType).alias(f.name)
        for f in wanted.fields
        if f.name in existing
    ]
    with job_commit(spark):
        data.select(*columns).write.format("delta").mode("overwrite").option(
            "overwriteSchema", "true"
        ).save(uri)


def create_mirror(uri: str, struct: T.StructType, newer: dict[str, int] | None = None) -> None:
    """An empty mirror, created by delta-rs in milliseconds (Spark's empty write took seconds
    per table at a job's first start). A Spark StructType's JSON is a Delta schema.

    ``delta.targetFileSize`` bounds the files delta-rs writes: its MERGE rewrites every file it
    touches, so smaller files keep a batch's cost from growing with the mirror.
    """
    from deltalake import DeltaTable, Schema

    properties = {"delta.targetFileSize": str(MIRROR_TARGET_FILE_BYTES)}
    if newer:
        properties[GENERATIONS_PROPERTY] = _generations_text(newer)
    DeltaTable.create(
        uri,
        Schema.from_json(struct.json()),
        configuration=properties,
        raise_if_key_not_exists=False,
    )


def _read_or_create(
    uri: str, struct: T.StructType, newer: dict[str, int]
) -> tuple[T.StructType, dict[str, str]] | None:
    """The table's schema and properties, or None when this call created it. The store's error
    (a request timed out or cut: its put may have landed) or a table created meanwhile is tried
    again from the look: one lost answer at a job's start stopped it with a traceback (seen on
    MinIO through the suite's fault proxy)."""
    for attempt in store_retrying():
        with attempt:
            current = _read_mirror_metadata(uri)
            if current is None:
                create_mirror(uri, struct, newer)
            return current
    raise AssertionError("tenacity returns or raises")


def _generations_text(newer: dict[str, int]) -> str:
    return json.dumps(newer, separators=(",", ":"))


def _read_mirror_metadata(uri: str) -> tuple[T.StructType, dict[str, str]] | None:
    """The mirror's schema and table properties, read by delta-rs from the Delta log alone:
    milliseconds, where Spark's read and ``DESCRIBE DETAIL`` cost seconds at every start. A
    Delta schema is Spark's StructType JSON."""
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    try:
        mirror = DeltaTable(uri)
    except TableNotFoundError:
        return None
    schema = T.StructType.fromJson(json.loads(mirror.schema().to_json()))
    return schema, dict(mirror.metadata().configuration)


def _record_generations(spark: SparkSession, uri: str, newer: dict[str, int]) -> None:
    """Record the columns past their first generation (the property lists only those)."""
    text = _generations_text(newer)
    spark.sql(
        f"ALTER TABLE delta.{quoted(uri)} SET TBLPROPERTIES ('{GENERATIONS_PROPERTY}' = '{text}')"
    )


def merge_into_mirror(
    spark: SparkSession,
    uri: str,
    shape: TableShape,
    changes: DataFrame,
    app_id: str,
    batch_id: int,
    metadata: Mapping[str, str] | None = None,
) -> int:
    """MERGE one table's rows of the batch with delta-spark; the table's version after it."""
    from delta.tables import DeltaTable

    struct_field = row_variable(shape.name)
    source = changes.where(F.col("table_name") == shape.name).select(
        F.col(OPERATION),
        F.col(f"{quoted(struct_field)}.*"),
        F.col("keys").alias(KEYS_COLUMN),
        F.col(LAST_APPLIED_COLUMN).alias(POSITION_COLUMN),
    )
    condition = keys_match(shape) & narrowing_condition(source, shape)
    upsert = F.col(f"s.{OPERATION}") == "UPSERT"
    values: dict[str, str | SparkColumn] = {
        quoted(f.name): F.col(f"s.{quoted(f.name)}") for f in mirror_struct(shape).fields
    }
    with batch_commit(spark, app_id, batch_id, metadata):
        (
            DeltaTable.forPath(spark, uri)
            .alias("t")
            .merge(source.alias("s"), condition)
            .whenMatchedDelete(condition=F.col(f"s.{OPERATION}") == "DELETE")
            .whenMatchedUpdate(condition=upsert, set=values)
            .whenNotMatchedInsert(condition=upsert, values=values)
            .execute()
        )
    return table_version(uri)


def merge_on_driver(
    uri: str,
    shape: TableShape,
    rows: pa.Table,
    app_id: str,
    batch_id: int,
    metadata: Mapping[str, str] | None = None,
) -> int:
    """MERGE one table's output rows with delta-rs; the table's version after it (the one that
    holds the batch, whether this call or an earlier one wrote it).

    The skip reads the application transaction the commit writes, so a batch replayed after a crash
    between the MERGE and Spark's checkpoint commit changes nothing.
    """
    from deltalake import DeltaTable

    mirror = DeltaTable(uri, storage_options=delta_storage_options(uri))
    if holds_batch(mirror, app_id, batch_id):
        return mirror.version()
    names = [f.name for f in shape.struct().fields]
    image = rows.column(row_variable(shape.name)).combine_chunks()
    columns = [
        rows.column(OPERATION).combine_chunks(),
        *image.flatten(),
        rows.column("keys").combine_chunks(),
        rows.column(LAST_APPLIED_COLUMN).combine_chunks(),
    ]
    names = [*names, KEYS_COLUMN, POSITION_COLUMN]
    source = pa.Table.from_arrays(columns, names=[OPERATION, *names])
    source = source.cast(
        pa.schema([pa.field(f.name, utc_timestamps(f.type)) for f in source.schema])
    )
    updates = {sql_name(name): f"s.{sql_name(name)}" for name in names}
    (
        mirror.merge(
            source,
            key_predicate(shape, source),
            source_alias="s",
            target_alias="t",
            streamed_exec=False,
            commit_properties=commit_properties(app_id, batch_id, metadata),
        )
        .when_matched_delete(predicate=f"s.{OPERATION} = 'DELETE'")
        .when_matched_update(updates, predicate=f"s.{OPERATION} = 'UPSERT'")
        .when_not_matched_insert(updates, predicate=f"s.{OPERATION} = 'UPSERT'")
        .execute()
    )
    return mirror.version()
