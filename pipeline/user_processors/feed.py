"""The typed change feed: change-log rows routed to the groups processors choose (in Spark), and
each row decoded into a ``Change`` or a ``SchemaChange`` (in the operator's Python worker)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from ingest.contract.changelog import SCHEMA_ROW, parse_column_types, position
from ingest.model.records import ColumnType
from ingest.model.timestamps import parse_rfc3339
from pipeline.processor import INPUT_COLUMNS, RowNotApplicable
from pipeline.types import spark_type
from pipeline.user_processors.api import Change, ChangeProcessor, SchemaChange
from pipeline.values import from_micros, spark_value

FEED_COLUMNS = [*INPUT_COLUMNS, "old_values"]
SOURCE_TABLE, SOURCE_KEYS = "_cdc_source_table", "_cdc_source_keys"
"""A routed row's own table and key (its ``table_name`` and ``keys`` name its group)."""
CHANGES_ROUTE, SCHEMA_ROUTE = "\x00", "\x01"
"""Prefixes of a processor's groups among the operator's keys; no Spanner table name has them."""
_ROUTES = T.ArrayType(
    T.StructType([T.StructField("table", T.StringType()), T.StructField("key", T.StringType())])
)


def changes_route(processor: type[ChangeProcessor]) -> str:
    return CHANGES_ROUTE + processor.name


def schema_route(processor: type[ChangeProcessor]) -> str:
    return SCHEMA_ROUTE + processor.name


def routed(log_rows: DataFrame, processors: Iterable[type[ChangeProcessor]]) -> DataFrame:
    """The change log's rows for the job's one operator: each once for the mirrors, keyed by
    (table, key) as without processors, and once per group of each processor it joins, keyed
    by (the processor's route, the group). One select over one source: the change log is read
    once, whatever the processors.

    A change joins a group per ``group_by`` entry (a column's value as the change log spells
    it, from its new values, else its old values, else its keys; a tuple of columns as the JSON
    array of theirs); a schema row of a table a processor reads joins its schema group."""
    routes = [F.array(F.struct(F.col("table_name").alias("table"), F.col("keys").alias("key")))]
    is_schema = F.col("mod_type") == SCHEMA_ROW
    for processor in processors:
        groups: Column = F.array(F.lit(None).cast("string"))
        for table in processor.tables:
            columns = processor.group_by.get(table, ())
            if columns:
                values = F.array_distinct(F.array(*[_group_key(c) for c in columns]))
                groups = F.when(F.col("table_name") == table, values).otherwise(groups)
        to_changes = _to_route(changes_route(processor), groups)
        to_schema = _to_route(schema_route(processor), F.array(F.col("table_name")))
        reads = F.col("table_name").isin(list(processor.tables))
        routes.append(
            F.when(reads, F.when(is_schema, to_schema).otherwise(to_changes)).otherwise(
                F.array().cast(_ROUTES)
            )
        )
    return log_rows.select(
        *[F.col(c) for c in FEED_COLUMNS if c not in ("table_name", "keys")],
        F.col("table_name").alias(SOURCE_TABLE),
        F.col("keys").alias(SOURCE_KEYS),
        F.explode(F.concat(*routes)).alias("route"),
    ).select(
        F.col("route.table").alias("table_name"),
        F.col("route.key").alias("keys"),
        *[F.col(c) for c in FEED_COLUMNS if c not in ("table_name", "keys")],
        SOURCE_TABLE,
        SOURCE_KEYS,
    )


def _to_route(route: str, keys: Column) -> Column:
    """Each of ``keys`` as a (route, key) pair."""
    table = F.lit(route).alias("table")
    return F.transform(keys, lambda key: F.struct(table, key.alias("key")))


def _group_key(columns: str | tuple[str, ...]) -> Column:
    """One column's value, or several columns' values as a JSON array of their texts."""
    if isinstance(columns, str):
        return _value_text(columns)
    return F.to_json(F.array(*[_value_text(c) for c in columns]))


def _value_text(column: str) -> Column:
    path = "$['" + column.replace("\\", "\\\\").replace("'", "\\'") + "']"
    return F.coalesce(
        F.get_json_object(F.col("new_values"), path),
        F.get_json_object(F.col("old_values"), path),
        F.get_json_object(F.col("keys"), path),
    )


class Decoder:
    """Change-log rows as ``Change``s, each value read with its own row's column types; the
    parsed column lists are cached (a table's rows share a few)."""

    def __init__(self) -> None:
        self._columns: dict[str, dict[str, ColumnType]] = {}
        self._types: dict[str, dict[str, T.DataType]] = {}

    def change(self, row: Any) -> Change:
        columns = self._parsed(row["column_types"])
        try:
            keys, values, old_values = (
                self._values(columns, row[name])
                for name in (SOURCE_KEYS, "new_values", "old_values")
            )
        except (ValueError, TypeError, ArithmeticError, LookupError) as error:
            # from None: a decoder's message may hold the value, and tracebacks are logged
            reason = f"a value does not decode with its column type: {type(error).__name__}"
            raise RowNotApplicable(row[SOURCE_TABLE], row[SOURCE_KEYS], row, reason) from None
        return Change(
            table=row[SOURCE_TABLE],
            kind=row["mod_type"],
            keys=keys,
            values=values,
            old_values=old_values,
            column_types=self._types[row["column_types"]],
            commit_timestamp=from_micros(parse_rfc3339(row["commit_timestamp_text"]) // 1000),
            commit_timestamp_text=row["commit_timestamp_text"],
            transaction_id=row["server_transaction_id"],
            position=position(row),
        )

    def schema_change(self, row: Any) -> SchemaChange:
        self._parsed(row["column_types"])
        return SchemaChange(
            row[SOURCE_TABLE], self._types[row["column_types"]], row["commit_timestamp_text"]
        )

    def _parsed(self, text: str) -> dict[str, ColumnType]:
        columns = self._columns.get(text)
        if columns is None:
            parsed = parse_column_types(text)
            columns = self._columns[text] = {c.name: c for c in parsed}
            self._types[text] = {c.name: spark_type(c.type) for c in parsed}
        return columns

    @staticmethod
    def _values(columns: Mapping[str, ColumnType], text: str | None) -> dict[str, Any]:
        if not text:
            return {}
        values = {}
        for name, value in json.loads(text).items():
            column = columns.get(name)
            if column is None:
                raise LookupError(name)
            values[name] = spark_value(column.type, value)
        return values
