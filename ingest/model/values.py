"""Decode mod values (JSON as Spanner sends them) into exact Python values, by column type.

INT64 → int, FLOAT64 → float, FLOAT32 → float (rounded to float32), NUMERIC → Decimal,
BYTES → bytes, DATE → date, TIMESTAMP → integer nanoseconds, JSON → parsed JSON, ARRAY → list;
unknown types pass through.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import struct
from decimal import Decimal
from typing import Any

from ingest.model.timestamps import parse_rfc3339

_NOT_TEXT = {"INT64", "FLOAT64", "FLOAT32", "BOOL", "NUMERIC", "DATE", "TIMESTAMP", "BYTES", "JSON"}


def decode_value(spanner_type: dict[str, Any], value: Any) -> Any:
    if value is None:
        return None
    code = spanner_type.get("code")
    if code == "ARRAY":
        element_type = spanner_type.get("array_element_type") or {}
        return [_decode_element(element_type, item) for item in value]
    if code in ("INT64", "ENUM"):
        return int(value)
    if code == "FLOAT64":
        return float(value)
    if code == "FLOAT32":
        return float32(float(value))
    if code == "BOOL":
        return bool(value)
    if code == "BYTES":
        return base64.b64decode(value)
    if code == "DATE":
        return dt.date.fromisoformat(value)
    if code == "TIMESTAMP":
        return parse_rfc3339(value)
    if code == "NUMERIC":
        return Decimal(str(value))
    if code == "JSON":
        return json.loads(value) if isinstance(value, str) else value
    return value


def float32(value: float) -> float:
    """FLOAT32 arrives as its shortest decimal text; the value is the nearest float32."""
    nearest: float = struct.unpack("f", struct.pack("f", value))[0]
    return nearest


def _decode_element(element_type: dict[str, Any], item: Any) -> Any:
    """The emulator sends a NULL element of a non-text array as the string "NULL" (never a
    valid value of those types: JSON text would be lowercase null)."""
    if item == "NULL" and element_type.get("code") in _NOT_TEXT:
        return None
    return decode_value(element_type, item)


def decode_row(column_types: dict[str, dict[str, Any]], values: dict[str, Any]) -> dict[str, Any]:
    return {name: decode_value(column_types[name], value) for name, value in values.items()}
