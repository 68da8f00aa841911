"""Delta mirror tables: one per Spanner table, kept equal to it by an idempotent MERGE per batch.

Two ways to MERGE, one contract. A batch of at most ``local_merge_max_rows`` output rows (and
``local_merge_max_mb`` of them) is collected to the driver as Arrow and merged by delta-rs
(``deltalake``): about 0.1 s where
delta-spark's MERGE costs 4-8 s of fixed planning and jobs on two cores, which made the mirrors
trail Spanner by a minute. A larger batch is merged by delta-spark on the executors.

Idempotent: each MERGE carries the application transaction (job id and checkpoint id, batch id)
as Delta's ``txn`` action (delta-spark's ``txnAppId``/``txnVersion`` session settings, delta-rs's
``CommitProperties.app_transactions``), and a batch whose version the table already holds for the
job is skipped, whichever way wrote it.

Narrow: delta-spark's MERGE condition names the batch's keys as literals, and delta-rs derives a
pruning predicate from the source's keys, so the files a MERGE reads are only those that may hold
them, and a concurrent compaction of other files does not conflict (docs/design.md, Delta
concurrency). A conflict that does happen left nothing committed; it is retried.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import structlog
from pyspark.sql import Column as SparkColumn
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential_jitter,
)

from pipeline.processor import LAST_APPLIED_COLUMN, OPERATION
from pipeline.shapes import TableShape
from pipeline.state.variables import LAST_APPLIED, row_variable
from runtime.storage import delta_storage_options

Logger = structlog.typing.FilteringBoundLogger
RETRYABLE_CONFLICTS = (
    "ConcurrentAppendException",
    "ConcurrentDeleteReadException",
    "CommitFailedError",
)
"""Conflicts that left nothing committed (delta-spark's, then delta-rs's): MERGE again."""
LITERAL_KEYS_LIMIT = 1000
"""Up to this many keys the condition lists them; beyond, it bounds the first key column."""


def mirror_uri(mirror_root: str, table: str) -> str:
    return f"{mirror_root.rstrip('/')}/{table}"


def _quoted(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


MIRROR_TARGET_FILE_BYTES = 16 * 1024 * 1024
"""Mirror files written by the driver MERGE stay about this size (bench/RESULTS.md, mirror size)."""
GENERATIONS_PROPERTY = "spanner_cdc.generations"
"""Mirror table property: the generation each column holds (pipeline.shapes.Generation)."""


KEYS_COLUMN = "_cdc_keys"
"""Mirror column: the row's primary key as the change log spells it (JSON)."""
POSITION_COLUMN = "_cdc_last_applied"
"""Mirror column: the change-log position of the row's last applied change (commit timestamp
text, transaction id, record sequence, mod index). With ``_cdc_keys`` it lets a rebase seed
state from the mirror exactly (``pipeline.state.seed``)."""


def mirror_struct(shape: TableShape) -> T.StructType:
    """The mirror's columns: the table's, then the two the product keeps beside each row."""
    return T.StructType(
        [
            *shape.struct().fields,
            T.StructField(KEYS_COLUMN, T.StringType(), True),
            T.StructField(POSITION_COLUMN, LAST_APPLIED, True),
        ]
    )


def ensure_mirror(spark: SparkSession, uri: str, shape: TableShape, log: Logger) -> None:
    """Create the mirror, add new columns, and rewrite columns whose type changed.

    STRING↔BYTES: Delta cannot retype a column in place, so the mirror is rewritten with the cast
    values (Spanner converts them too). A column dropped and added again with another type is a new
    generation: Spanner holds NULL in it for every row, and so does the rewritten mirror. Either
    rewrite is a metadata change: concurrent readers of the mirror fail once and must be restarted
    (docs/design.md, Delta concurrency).
    """
    wanted = mirror_struct(shape)
    generations = {c.name: shape.mirror_generation(c) for c in shape.columns}
    newer = {name: number for name, number in sorted(generations.items()) if number > 1}
    current = _read_mirror_metadata(uri)
    if current is None:
        create_mirror(uri, wanted, newer)
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
        data = spark.read.format("delta").load(uri)
        columns = [
            F.lit(None).cast(f.dataType).alias(f.name)
            if f in renewed
            else F.col(_quoted(f.name)).cast(f.dataType).alias(f.name)
            for f in wanted.fields
            if f.name in existing
        ]
        data.select(*columns).write.format("delta").mode("overwrite").option(
            "overwriteSchema", "true"
        ).save(uri)
        if retyped:
            log.info("mirror_columns_retyped", table=shape.name, columns=[f.name for f in retyped])
        if renewed:
            log.info("mirror_columns_renewed", table=shape.name, columns=[f.name for f in renewed])
    added = [f for f in wanted.fields if f.name not in existing]
    if added:
        columns_sql = ", ".join(f"{_quoted(f.name)} {f.dataType.simpleString()}" for f in added)
        spark.sql(f"ALTER TABLE delta.{_quoted(uri)} ADD COLUMNS ({columns_sql})")
        log.info("mirror_columns_added", table=shape.name, columns=[f.name for f in added])
    if newer and recorded != newer:
        _record_generations(spark, uri, newer)


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
        f"ALTER TABLE delta.{_quoted(uri)} SET TBLPROPERTIES ('{GENERATIONS_PROPERTY}' = '{text}')"
    )


def _narrowing_condition(source: DataFrame, shape: TableShape) -> SparkColumn:
    """The first key column's values (or their range beyond ``LITERAL_KEYS_LIMIT``) as literals,
    so delta-spark reads only the mirror files that may hold the batch's keys."""
    first = shape.key_columns[0].name
    carried, literal = _literal_transport(source.schema[first].dataType)
    column = carried(F.col(_quoted(first)))
    values = [
        r[0] for r in source.select(column).distinct().limit(LITERAL_KEYS_LIMIT + 1).collect()
    ]
    target = F.col(f"t.{_quoted(first)}")
    if len(values) <= LITERAL_KEYS_LIMIT and None not in values:
        return target.isin([literal(v) for v in values])
    bounds = source.agg(F.min(column), F.max(column)).first()
    assert bounds is not None, "an aggregate has one row"
    return target.isNull() | target.between(literal(bounds[0]), literal(bounds[1]))


def _literal_transport(
    data_type: T.DataType,
) -> tuple[Callable[[SparkColumn], SparkColumn], Callable[[Any], SparkColumn]]:
    """How a key value travels to the driver and back into a literal unchanged.

    Dates and timestamps go as days and microseconds since the epoch: PySpark hands a Python
    date to the JVM as ``strftime`` text, which has no leading zeros before year 1000 (Spanner
    dates start at year 1) and fails to parse, and ``collect()`` fails on year-1 timestamps.
    """
    if isinstance(data_type, T.DateType):
        return F.unix_date, lambda days: F.date_from_unix_date(F.lit(days))
    if isinstance(data_type, T.TimestampType):
        return F.unix_micros, lambda micros: F.timestamp_micros(F.lit(micros))
    return (lambda column: column), F.lit


def merge_into_mirror(
    spark: SparkSession,
    uri: str,
    shape: TableShape,
    changes: DataFrame,
    app_id: str,
    batch_id: int,
) -> None:
    from delta.tables import DeltaTable

    struct_field = row_variable(shape.name)
    source = changes.where(F.col("table_name") == shape.name).select(
        F.col(OPERATION),
        F.col(f"{_quoted(struct_field)}.*"),
        F.col("keys").alias(KEYS_COLUMN),
        F.col(LAST_APPLIED_COLUMN).alias(POSITION_COLUMN),
    )
    keys = [c.name for c in shape.key_columns]
    matches = functools.reduce(
        lambda left, right: left & right,
        [F.col(f"t.{_quoted(k)}").eqNullSafe(F.col(f"s.{_quoted(k)}")) for k in keys],
    )
    condition = matches & _narrowing_condition(source, shape)
    upsert = F.col(f"s.{OPERATION}") == "UPSERT"
    values: dict[str, str | SparkColumn] = {
        _quoted(f.name): F.col(f"s.{_quoted(f.name)}") for f in mirror_struct(shape).fields
    }
    spark.conf.set("spark.databricks.delta.write.txnAppId", app_id)
    spark.conf.set("spark.databricks.delta.write.txnVersion", str(batch_id))
    try:
        (
            DeltaTable.forPath(spark, uri)
            .alias("t")
            .merge(source.alias("s"), condition)
            .whenMatchedDelete(condition=F.col(f"s.{OPERATION}") == "DELETE")
            .whenMatchedUpdate(condition=upsert, set=values)
            .whenNotMatchedInsert(condition=upsert, values=values)
            .execute()
        )
    finally:
        spark.conf.unset("spark.databricks.delta.write.txnAppId")
        spark.conf.unset("spark.databricks.delta.write.txnVersion")


STATISTICS_INEXACT = {"NUMERIC", "TIMESTAMP"}
"""Key types whose Delta file statistics (as delta-rs writes them) cannot be trusted to prune."""


def _key_predicate(shape: TableShape, source: pa.Table) -> str:
    """Key equality in delta-rs's SQL, one parenthesised term per key column.

    Plain ``=`` lets delta-rs prune the mirror's files by the source's keys; only a key column
    holding a NULL in this batch (Spanner allows NULL in nullable key columns) needs null-safe
    equality, which delta-rs cannot prune by. A column without NULLs in the source keeps ``=``:
    a NULL in the mirror never equals a source value either way. The parentheses are needed:
    delta-rs parses ``a IS NOT DISTINCT FROM b AND c ...`` as ``a IS NOT DISTINCT FROM (b AND
    c) ...`` and fails to plan it.

    NUMERIC and TIMESTAMP keys never prune: delta-rs keeps a DECIMAL's file statistics as a JSON
    float (-1013600356.374246144 became -1013600356.3742461, above the value itself) and a
    timestamp's at milliseconds, so ``=`` skipped the file holding the key and the MERGE inserted
    a second row (found by tests/test_mirror_keys.py).
    """
    terms = []
    for column in shape.key_columns:
        unprunable = column.type.get("code") in STATISTICS_INEXACT
        nulls = source.column(column.name).null_count
        equal = "IS NOT DISTINCT FROM" if nulls or unprunable else "="
        name = _sql_name(column.name)
        terms.append(f"(t.{name} {equal} s.{name})")
    return " AND ".join(terms)


def _sql_name(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _utc_timestamps(data_type: pa.DataType) -> pa.DataType:
    """Spark hands timestamps over in its session time zone; the mirror holds them in UTC."""
    if pa.types.is_timestamp(data_type):
        return pa.timestamp("us", tz="UTC")
    if pa.types.is_list(data_type) or pa.types.is_large_list(data_type):
        return pa.list_(_utc_timestamps(data_type.value_type))
    return data_type


def merge_on_driver(
    uri: str, shape: TableShape, rows: pa.Table, app_id: str, batch_id: int
) -> bool:
    """MERGE one table's output rows with delta-rs; False when the table already holds the batch.

    The skip reads the application transaction the commit writes, so a batch replayed after a crash
    between the MERGE and Spark's checkpoint commit changes nothing.
    """
    from deltalake import CommitProperties, DeltaTable, Transaction

    mirror = DeltaTable(uri, storage_options=delta_storage_options(uri))
    done = mirror.transaction_version(app_id)
    if done is not None and done >= batch_id:
        return False
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
        pa.schema([pa.field(f.name, _utc_timestamps(f.type)) for f in source.schema])
    )
    updates = {_sql_name(name): f"s.{_sql_name(name)}" for name in names}
    (
        mirror.merge(
            source,
            _key_predicate(shape, source),
            source_alias="s",
            target_alias="t",
            streamed_exec=False,
            commit_properties=CommitProperties(app_transactions=[Transaction(app_id, batch_id)]),
        )
        .when_matched_delete(predicate=f"s.{OPERATION} = 'DELETE'")
        .when_matched_update(updates, predicate=f"s.{OPERATION} = 'UPSERT'")
        .when_not_matched_insert(updates, predicate=f"s.{OPERATION} = 'UPSERT'")
        .execute()
    )
    return True


def _is_retryable_conflict(error: BaseException) -> bool:
    text = f"{type(error).__name__}: {error}"
    return any(name in text for name in RETRYABLE_CONFLICTS)


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


def write_batch(
    changes: DataFrame,
    batch_id: int,
    shapes: Mapping[str, TableShape],
    mirror_root: str,
    app_id: str,
    log: Logger,
    local_merge_max_rows: int = 0,
    local_merge_max_bytes: int = 64 * 1024 * 1024,
) -> BatchResult:
    """MERGE one micro-batch of processor output into every mirror it touches: on the driver
    through delta-rs when it holds at most ``local_merge_max_rows`` rows and about
    ``local_merge_max_bytes`` bytes (its rows as JSON, measured on the executors before anything
    is collected), else through Spark. Rows of large values so never exhaust the driver."""
    spark = changes.sparkSession
    changes = changes.persist()
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
        if small:
            batch = changes.toArrow()
            tables = batch.column("table_name")

            def on_driver(table: str) -> None:
                rows = batch.filter(pc.equal(tables, table))
                merge_on_driver(
                    mirror_uri(mirror_root, table), shapes[table], rows, app_id, batch_id
                )

            _merge_each_table(sorted(counts), on_driver, batch_id, log)
        else:
            _merge_each_table(
                sorted(counts),
                lambda table: merge_into_mirror(
                    spark, mirror_uri(mirror_root, table), shapes[table], changes, app_id, batch_id
                ),
                batch_id,
                log,
            )
        return BatchResult(counts, newest, small, size)
    finally:
        changes.unpersist()


def _merge_each_table(
    tables: list[str], merge: Callable[[str], object], batch_id: int, log: Logger
) -> None:
    """MERGE table by table, each retried after a conflict that left nothing committed."""
    for table in tables:
        for attempt in Retrying(
            retry=retry_if_exception(_is_retryable_conflict),
            stop=stop_after_attempt(5),
            wait=wait_exponential_jitter(multiplier=0.2, max=5),
            before_sleep=functools.partial(_log_retry, log, table, batch_id),
            reraise=True,
        ):
            with attempt:
                merge(table)


def _log_retry(
    log: structlog.typing.FilteringBoundLogger, table: str, batch_id: int, state: RetryCallState
) -> None:
    cause = str(state.outcome.exception())[:200] if state.outcome else None
    log.warning("mirror_merge_retry", table=table, batch_id=batch_id, cause=cause)
