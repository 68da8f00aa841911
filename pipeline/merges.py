"""How a micro-batch commits to a Delta table the job keeps (a mirror, a history, the batch log,
a processor's output): once.

Each commit carries the batch's application transaction (job id and checkpoint id, batch id)
as Delta's ``txn`` action (delta-spark's ``txnAppId``/``txnVersion`` session settings, delta-rs's
``CommitProperties.app_transactions``) and what the batch is consistent at in its commit info;
a table that already holds the batch is skipped, whichever way wrote it. A MERGE names the
batch's keys so it reads only the files that may hold them, and a conflict is retried: one that
left nothing committed, or the batch's own commit whose answer the store lost.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import pyarrow as pa
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

from pipeline.shapes import TableShape
from runtime.logs import Logger
from runtime.storage import delta_commit_retries, delta_storage_options, table_created_meanwhile

R = TypeVar("R")
RETRYABLE_CONFLICTS = (
    "ConcurrentAppendException",
    "ConcurrentDeleteReadException",
    "ConcurrentDeleteDeleteException",
    "MetadataChangedException",
    "ProtocolChangedException",
    "CommitFailedError",
)
"""Conflicts that left nothing committed, or only the batch's own commit (delta-spark's, then
delta-rs's): commit again, after checking the table for the batch. Users' maintenance raises
them: ``OPTIMIZE`` removes files a MERGE read or removes (seed 001), ``ALTER TABLE … SET
TBLPROPERTIES`` changes the metadata, turning on deletion vectors the protocol."""
USER_METADATA = "spark.databricks.delta.commitInfo.userMetadata"
JOB_COMMIT_KEY = "spanner_cdc_watermark"
"""Commit-info key of every commit the job makes to a mirror or a history (with the batch's W
when a batch made it): how the job tells its commits from users' (``pipeline.foreign_commits``)."""
LITERAL_KEYS_LIMIT = 1000
"""Up to this many keys the condition lists them; beyond, it bounds the first key column."""


def quoted(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def keys_match(shape: TableShape) -> SparkColumn:
    """delta-spark's condition that a target row ``t`` has the source row ``s``'s key."""
    return functools.reduce(
        lambda left, right: left & right,
        [
            F.col(f"t.{quoted(c.name)}").eqNullSafe(F.col(f"s.{quoted(c.name)}"))
            for c in shape.key_columns
        ],
    )


def table_version(uri: str) -> int:
    """A Delta table's newest version, read by delta-rs from its log."""
    from deltalake import DeltaTable

    return DeltaTable(uri, storage_options=delta_storage_options(uri)).version()


def narrowing_condition(source: DataFrame, shape: TableShape) -> SparkColumn:
    """The first key column's values (or their range beyond ``LITERAL_KEYS_LIMIT``) as literals,
    so delta-spark reads only the mirror files that may hold the batch's keys."""
    first = shape.key_columns[0].name
    carried, literal = _literal_transport(source.schema[first].dataType)
    column = carried(F.col(quoted(first)))
    values = [
        r[0] for r in source.select(column).distinct().limit(LITERAL_KEYS_LIMIT + 1).collect()
    ]
    target = F.col(f"t.{quoted(first)}")
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


def job_commit(spark: SparkSession) -> contextlib.AbstractContextManager[None]:
    """delta-spark's next commit carries the job's mark and no batch (a mirror rewritten for a
    column's new type)."""
    return _commit_settings(spark, {USER_METADATA: json.dumps({JOB_COMMIT_KEY: "{}"})})


def batch_commit(
    spark: SparkSession, app_id: str, batch_id: int, metadata: Mapping[str, str] | None
) -> contextlib.AbstractContextManager[None]:
    """delta-spark's next commit carries the batch's ``txn`` and ``metadata`` (its commit
    info's user metadata, as JSON)."""
    settings = {
        "spark.databricks.delta.write.txnAppId": app_id,
        "spark.databricks.delta.write.txnVersion": str(batch_id),
    }
    if metadata:
        settings[USER_METADATA] = json.dumps(dict(metadata), sort_keys=True)
    return _commit_settings(spark, settings)


@contextlib.contextmanager
def _commit_settings(spark: SparkSession, settings: Mapping[str, str]) -> Iterator[None]:
    """Session settings delta-spark reads at its next commit, unset after it."""
    for name, value in settings.items():
        spark.conf.set(name, value)
    try:
        yield
    finally:
        for name in settings:
            spark.conf.unset(name)


STATISTICS_INEXACT = {"NUMERIC", "TIMESTAMP"}
"""Key types whose Delta file statistics (as delta-rs writes them) cannot be trusted to prune."""


def key_predicate(shape: TableShape, source: pa.Table) -> str:
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
        name = sql_name(column.name)
        terms.append(f"(t.{name} {equal} s.{name})")
    return " AND ".join(terms)


def sql_name(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def utc_timestamps(data_type: pa.DataType) -> pa.DataType:
    """Spark hands timestamps over in its session time zone; the mirror holds them in UTC."""
    if pa.types.is_timestamp(data_type):
        return pa.timestamp("us", tz="UTC")
    if pa.types.is_list(data_type) or pa.types.is_large_list(data_type):
        return pa.list_(utc_timestamps(data_type.value_type))
    return data_type


def holds_batch(table: Any, app_id: str, batch_id: int) -> bool:
    """Whether a Delta table (delta-rs) already holds the batch: its ``txn`` for the job."""
    done = table.transaction_version(app_id)
    return done is not None and done >= batch_id


def commit_properties(
    app_id: str, batch_id: int, metadata: Mapping[str, str] | None, creates_table: bool = False
) -> Any:
    """delta-rs's commit of a batch: its ``txn`` and ``metadata`` in the commit info; one that
    creates the table is retried by ``commit_once`` only (``delta_commit_retries``)."""
    from deltalake import CommitProperties, Transaction

    return CommitProperties(
        app_transactions=[Transaction(app_id, batch_id)],
        custom_metadata=dict(metadata or {}),
        max_commit_retries=delta_commit_retries(creates_table),
    )


def _conflict(error: BaseException | None) -> str | None:
    """Which retryable conflict ``error`` is (its name appears in its text), if any."""
    text = f"{type(error).__name__}: {error}"
    return next((name for name in RETRYABLE_CONFLICTS if name in text), None)


def _is_retryable(error: BaseException) -> bool:
    """A conflict, the store's error (delta-rs raises ``OSError`` for a timed-out or cut
    request) or a table created since the commit looked: each may have left the batch's commit
    landed, which the next attempt finds."""
    return (
        isinstance(error, OSError) or _conflict(error) is not None or table_created_meanwhile(error)
    )


def commit_once(table: str, commit: Callable[[], R], batch_id: int, log: Logger) -> R:
    """A batch's commit to one table, retried after a conflict or the store's error.

    The conflict may be the batch's own commit whose answer the store lost: the store took the
    log file, delta-rs's retry of the put finds that version taken by a commit carrying the same
    ``txn`` and reports a concurrent transaction. A put whose answer timed out may have landed
    too. ``commit`` therefore first checks whether the table holds the batch (``holds_batch``),
    and returns without writing when it does.
    """
    for attempt in store_retrying(before_sleep=functools.partial(_log_retry, log, table, batch_id)):
        with attempt:
            return commit()
    raise AssertionError("tenacity returns or raises")


def store_retrying(**options: Any) -> Retrying:
    """Attempts at a write to a Delta table, again after a conflict, the store's error or a
    table created meanwhile (``_is_retryable``): each attempt must look first for what an
    earlier one may have landed."""
    return Retrying(
        retry=retry_if_exception(_is_retryable),
        stop=stop_after_attempt(5),
        wait=wait_exponential_jitter(multiplier=0.2, max=5),
        reraise=True,
        **options,
    )


def _log_retry(
    log: structlog.typing.FilteringBoundLogger, table: str, batch_id: int, state: RetryCallState
) -> None:
    error = state.outcome.exception() if state.outcome else None
    log.warning(
        "batch_commit_retry",
        table=table,
        batch_id=batch_id,
        conflict=_conflict(error),
        cause=str(error)[:200],
    )
