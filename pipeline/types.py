"""Spanner column types as Spark types (docs/design.md, contract 3): in the mirrors, and in the
state (STRING and BYTES both as bytes, arrays as JSON text, PG_NUMERIC as text)."""

from __future__ import annotations

from typing import Any

from pyspark.sql import types as T

NUMERIC = T.DecimalType(38, 9)
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


_TEXT_OR_BYTES = {"STRING", "BYTES"}


def _is_pg_numeric(spanner_type: dict[str, Any]) -> bool:
    """PostgreSQL NUMERIC: arbitrary precision and NaN, beyond DECIMAL(38, 9); kept as text."""
    return spanner_type.get("type_annotation") == "PG_NUMERIC"


def spark_type(spanner_type: dict[str, Any]) -> T.DataType:
    """The mirror's Spark type of a Spanner type; anything unmapped is carried as its JSON text."""
    code = spanner_type.get("code")
    if code == "ARRAY":
        return T.ArrayType(spark_type(spanner_type.get("array_element_type") or {}))
    if _is_pg_numeric(spanner_type):
        return T.StringType()
    return _SCALARS.get(code or "", T.StringType())


def state_type(spanner_type: dict[str, Any]) -> T.DataType:
    """How the row image keeps a column in state (state layout 4).

    STRING and BYTES are both kept as bytes (STRING as UTF-8, as Spanner converts them), so a
    STRING↔BYTES change never touches state and rows of either type apply to the same field.
    Arrays are kept as JSON text: Spark's Avro state encoding refuses NULL array elements, which
    Spanner allows in every array type. TIMESTAMP is kept as epoch microseconds (the same Avro
    long as Spark's timestamp): PySpark reads a timestamp back through the host's local time,
    which fails within a day of years 1 and 9999.
    """
    code = spanner_type.get("code")
    if code == "ARRAY":
        return T.StringType()
    if code in _TEXT_OR_BYTES:
        return T.BinaryType()
    if code == "TIMESTAMP":
        return T.LongType()
    return spark_type(spanner_type)


def generation_label(spanner_type: dict[str, Any]) -> T.DataType:
    """What tells a column's generations apart: its state type, but a TIMESTAMP's own (INT64
    and TIMESTAMP share bigint in state, yet Spanner keeps no value across a drop and a re-add
    from one to the other, so each needs a field of its own)."""
    if spanner_type.get("code") == "TIMESTAMP":
        return T.TimestampType()
    return state_type(spanner_type)


def labelled_state_type(label: T.DataType) -> T.DataType:
    """The state type of a generation's label (``generation_label``)."""
    return T.LongType() if isinstance(label, T.TimestampType) else label


def is_mapped(spanner_type: dict[str, Any]) -> bool:
    code = spanner_type.get("code")
    if code == "ARRAY":
        return is_mapped(spanner_type.get("array_element_type") or {})
    return code in _SCALARS and not _is_pg_numeric(spanner_type)


def is_timestamp(spanner_type: dict[str, Any]) -> bool:
    """A TIMESTAMP, or an array of them: what the seed carries as epoch microseconds."""
    if spanner_type.get("code") == "ARRAY":
        return is_timestamp(spanner_type.get("array_element_type") or {})
    return spanner_type.get("code") == "TIMESTAMP"
