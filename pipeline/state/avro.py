"""State schemas as Avro, the encoding Spark uses for them in the RocksDB state store."""

from __future__ import annotations

from typing import Any

import fastavro
from pyspark.sql import types as T


def avro_schema(struct: T.StructType, name: str) -> dict[str, Any]:
    """The Avro record Spark's Avro state encoding writes for ``struct`` (fields nullable)."""
    record = {
        "type": "record",
        "name": name,
        "fields": [
            {"name": f.name, "type": ["null", _avro_type(f.dataType, f"{name}_{f.name}")]}
            for f in struct.fields
        ],
    }
    fastavro.parse_schema(record)
    return record


def _avro_type(data_type: T.DataType, name: str) -> Any:
    simple = {
        T.LongType: "long",
        T.IntegerType: "int",
        T.DoubleType: "double",
        T.FloatType: "float",
        T.BooleanType: "boolean",
        T.StringType: "string",
        T.BinaryType: "bytes",
    }
    for spark_class, avro in simple.items():
        if isinstance(data_type, spark_class):
            return avro
    if isinstance(data_type, T.DateType):
        return {"type": "int", "logicalType": "date"}
    if isinstance(data_type, T.TimestampType):
        return {"type": "long", "logicalType": "timestamp-micros"}
    if isinstance(data_type, T.DecimalType):
        return {
            "type": "fixed",
            "name": name,
            "size": 16,
            "logicalType": "decimal",
            "precision": data_type.precision,
            "scale": data_type.scale,
        }
    if isinstance(data_type, T.ArrayType):
        return {"type": "array", "items": ["null", _avro_type(data_type.elementType, name)]}
    if isinstance(data_type, T.MapType):
        return {"type": "map", "values": ["null", _avro_type(data_type.valueType, name)]}
    if isinstance(data_type, T.StructType):
        return avro_schema(data_type, name)
    raise ValueError(f"no Avro type for {data_type.simpleString()}")
