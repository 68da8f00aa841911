"""Spanner column types as Spark types (design.md contract 3), and mod values as Spark values.

A table's shape is learned from the change log's ``column_types``: the union of every column seen,
each with the type of its newest appearance, in ordinal order. That shape drives the state schema
of the table's row image and the columns of its mirror table.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
from dataclasses import dataclass
from decimal import Context, Decimal
from typing import Any

from pyspark.sql import types as T

from ingest.records import ColumnType
from ingest.timestamps import parse_rfc3339
from ingest.values import decode_value

NUMERIC = T.DecimalType(38, 9)
_NUMERIC_CONTEXT = Context(prec=38)
_NUMERIC_SCALE = Decimal("1e-9")
_SCALARS: dict[str, T.DataType] = {
    "INT64": T.LongType(),
    "FLOAT64": T.DoubleType(),
    "FLOAT32": T.FloatType(),
    "BOOL": T.BooleanType(),
    "STRING": T.StringType(),
    "BYTES": T.BinaryType(),
    "DATE": T.DateType(),
    "TIMESTAMP": T.TimestampType(),
    "NUMERIC": NUMERIC,
    "JSON": T.StringType(),
}


def spark_type(spanner_type: dict[str, Any]) -> T.DataType:
    """The Spark type of a Spanner type; anything unmapped is carried as its JSON text."""
    code = spanner_type.get("code")
    if code == "ARRAY":
        return T.ArrayType(spark_type(spanner_type.get("array_element_type") or {}))
    return _SCALARS.get(code or "", T.StringType())


def is_mapped(spanner_type: dict[str, Any]) -> bool:
    code = spanner_type.get("code")
    if code == "ARRAY":
        return is_mapped(spanner_type.get("array_element_type") or {})
    return code in _SCALARS


@dataclass(frozen=True, slots=True)
class TableShape:
    """A Spanner table as the change log describes it."""

    name: str
    columns: tuple[ColumnType, ...]

    @property
    def key_columns(self) -> tuple[ColumnType, ...]:
        return tuple(c for c in self.columns if c.is_primary_key)

    def column(self, name: str) -> ColumnType | None:
        return next((c for c in self.columns if c.name == name), None)

    def struct(self) -> T.StructType:
        return T.StructType([T.StructField(c.name, spark_type(c.type), True) for c in self.columns])

    def covers(self, columns: list[ColumnType]) -> bool:
        """True when every column (name and type) of a change record is already in this shape."""
        return all(
            (known := self.column(c.name)) is not None
            and spark_type(known.type) == spark_type(c.type)
            for c in columns
        )


def parse_column_types(column_types_json: str) -> list[ColumnType]:
    """The change log's ``column_types`` text (written by ingest.changelog) as record types."""
    return [
        ColumnType(
            name=c["name"],
            type=c["type"],
            is_primary_key=bool(c["is_primary_key"]),
            ordinal_position=int(c["ordinal_position"]),
        )
        for c in json.loads(column_types_json)
    ]


def merge_shapes(observed: list[tuple[str, str]]) -> dict[str, TableShape]:
    """Table shapes from (table_name, column_types JSON) pairs in commit order, oldest first.

    A column keeps its newest type (STRING↔BYTES changes) and its position; columns dropped from
    Spanner stay, since older rows still hold them.
    """
    columns: dict[str, dict[str, ColumnType]] = {}
    for table, column_types in observed:
        known = columns.setdefault(table, {})
        for column in parse_column_types(column_types):
            known[column.name] = column
    return {
        table: TableShape(table, tuple(sorted(cols.values(), key=lambda c: c.ordinal_position)))
        for table, cols in sorted(columns.items())
    }


def spark_value(spanner_type: dict[str, Any], value: Any) -> Any:
    """A mod value (JSON as Spanner sent it) as the Python value Spark stores for its type."""
    if value is None:
        return None
    code = spanner_type.get("code")
    if code == "ARRAY":
        element = spanner_type.get("array_element_type") or {}
        decoded = decode_value(spanner_type, value)
        return [None if v is None else _scalar(element, v, raw=False) for v in decoded]
    if not is_mapped(spanner_type):
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return _scalar(spanner_type, value, raw=True)


def _scalar(spanner_type: dict[str, Any], value: Any, raw: bool) -> Any:
    code = spanner_type.get("code")
    if code == "TIMESTAMP":
        nanos = parse_rfc3339(value) if raw else value
        return dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(microseconds=nanos // 1000)
    if code == "JSON":
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    if code == "NUMERIC":
        return numeric(value)
    if code == "BYTES" and not raw:
        return value
    return decode_value(spanner_type, value) if raw else value


def numeric(value: Any) -> Decimal:
    """A NUMERIC as Spark's DECIMAL(38, 9); needs 38 digits, past the default context's 28."""
    return _NUMERIC_CONTEXT.quantize(Decimal(str(value)), _NUMERIC_SCALE)


def to_json_value(value: Any) -> Any:
    """A Spark value as JSON for the processor's output (bytes as base64, like Spanner)."""
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    if isinstance(value, list):
        return [to_json_value(v) for v in value]
    return value
