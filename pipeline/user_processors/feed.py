"""The typed change feed: change-log rows grouped as a processor chooses (in Spark), and each
row decoded into a ``Change`` or a ``SchemaChange`` (in the processor's Python worker)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from typing import Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from ingest.contract.changelog import SCHEMA_ROW, parse_column_types
from ingest.model.records import ColumnType, sequence_key
from ingest.model.timestamps import parse_rfc3339
from pipeline.processor import INPUT_COLUMNS, RowNotApplicable
from pipeline.types import spark_type
from pipeline.user_processors.api import Change, ChangeProcessor, Position, SchemaChange
from pipeline.values import spark_value

FEED_COLUMNS = [*INPUT_COLUMNS, "old_values"]
GROUP_KIND, GROUP = "_cdc_group_kind", "_cdc_group"
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
CHANGES, SCHEMAS = "change", "schema"


def grouped(changes: DataFrame, processor: type[ChangeProcessor]) -> Any:
    """The change log's rows of the processor's tables, once per group they join, grouped by
    (kind, group): a change by each ``group_by`` entry's value (a column's value as the change
    log spells it, from its new values, else its old values, else its keys; a tuple of columns
    as a JSON array of theirs), a schema row of a table under ``("schema", table)``."""
    rows = changes.where(F.col("table_name").isin(list(processor.tables))).select(*FEED_COLUMNS)
    keys: Column = F.array(F.lit(None).cast("string"))
    for table in processor.tables:
        columns = processor.group_by.get(table, ())
        values = F.array(*[_group_key(c) for c in columns]) if columns else keys
        keys = F.when(F.col("table_name") == table, F.array_distinct(values)).otherwise(keys)
    is_schema = F.col("mod_type") == SCHEMA_ROW
    return (
        rows.withColumn(GROUP_KIND, F.when(is_schema, F.lit(SCHEMAS)).otherwise(F.lit(CHANGES)))
        .withColumn(
            GROUP,
            F.explode(F.when(is_schema, F.array(F.col("table_name"))).otherwise(keys)),
        )
        .groupBy(GROUP_KIND, GROUP)
    )


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


def position(row: Any) -> Position:
    return (
        row["commit_timestamp_text"],
        row["server_transaction_id"],
        sequence_key(row["record_sequence"]),
        row["mod_index"],
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
                self._values(columns, row[name]) for name in ("keys", "new_values", "old_values")
            )
        except (ValueError, TypeError, ArithmeticError, LookupError) as error:
            # from None: a decoder's message may hold the value, and tracebacks are logged
            reason = f"a value does not decode with its column type: {type(error).__name__}"
            raise RowNotApplicable(row["table_name"], row["keys"], row, reason) from None
        return Change(
            table=row["table_name"],
            kind=row["mod_type"],
            keys=keys,
            values=values,
            old_values=old_values,
            column_types=self._types[row["column_types"]],
            commit_timestamp=_EPOCH
            + dt.timedelta(microseconds=parse_rfc3339(row["commit_timestamp_text"]) // 1000),
            commit_timestamp_text=row["commit_timestamp_text"],
            transaction_id=row["server_transaction_id"],
            position=position(row),
        )

    def schema_change(self, row: Any) -> SchemaChange:
        self._parsed(row["column_types"])
        return SchemaChange(
            row["table_name"], self._types[row["column_types"]], row["commit_timestamp_text"]
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
