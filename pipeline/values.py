"""Mod values as Spark values: a change's value as the state keeps it, as the mirror shows it,
and back from a mirror row into state (a rebase's seed)."""

from __future__ import annotations

import base64
import datetime as dt
import json
from decimal import Context, Decimal
from typing import Any

from ingest.model.encoding import canonical_json
from ingest.model.timestamps import parse_rfc3339, to_rfc3339
from ingest.model.values import decode_value
from pipeline.types import is_mapped

_NUMERIC_CONTEXT = Context(prec=38)
_NUMERIC_SCALE = Decimal("1e-9")


def spark_value(spanner_type: dict[str, Any], value: Any) -> Any:
    """A mod value (JSON as Spanner sent it) as the Python value Spark stores for its type."""
    if value is None:
        return None
    code = spanner_type.get("code")
    if code == "ARRAY":
        element, decoded = _array(spanner_type, value)
        return [None if v is None else _scalar(element, v, raw=False) for v in decoded]
    if not is_mapped(spanner_type):
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return _scalar(spanner_type, value, raw=True)


def state_value(spanner_type: dict[str, Any], value: Any) -> Any:
    """A mod value, read with the column type of its own change record, as state keeps it."""
    if value is None:
        return None
    code = spanner_type.get("code")
    if code == "ARRAY":
        element, decoded = _array(spanner_type, value)
        return canonical_json(
            [
                None if d is None else _element_state(element, raw, d)
                for raw, d in zip(value, decoded, strict=True)
            ]
        )
    if code == "STRING":
        return value.encode()
    if code == "TIMESTAMP":
        return parse_rfc3339(value) // 1000
    return spark_value(spanner_type, value)


def _array(spanner_type: dict[str, Any], value: Any) -> tuple[dict[str, Any], list[Any]]:
    """An ARRAY value's element type and its elements decoded."""
    return spanner_type.get("array_element_type") or {}, decode_value(spanner_type, value)


def _element_state(element_type: dict[str, Any], raw: Any, decoded: Any) -> Any:
    """Array elements stay as Spanner sent them, but text and bytes both as base64 bytes."""
    if element_type.get("code") == "STRING":
        return base64.b64encode(decoded.encode()).decode()
    return raw


def mirror_value(spanner_type: dict[str, Any], stored: Any) -> Any:
    """A state value as the mirror column of the table's newest ``spanner_type`` holds it."""
    if stored is None:
        return None
    code = spanner_type.get("code")
    if code == "ARRAY":
        element = spanner_type.get("array_element_type") or {}
        items = json.loads(stored)
        return [None if item is None else _element_mirror(element, item) for item in items]
    if code == "STRING":
        return bytes(stored).decode()
    if code == "BYTES":
        return bytes(stored)
    if code == "TIMESTAMP":
        return from_micros(stored)
    return stored


def from_micros(micros: int) -> dt.datetime:
    """Epoch microseconds (a TIMESTAMP in state) as an aware UTC datetime, at any year."""
    return _EPOCH + dt.timedelta(microseconds=micros)


def _element_mirror(element_type: dict[str, Any], item: Any) -> Any:
    code = element_type.get("code")
    if code == "STRING":
        return base64.b64decode(item).decode()
    if code == "BYTES":
        return base64.b64decode(item)
    if not is_mapped(element_type):
        return item if isinstance(item, str) else json.dumps(item, sort_keys=True)
    return _scalar(element_type, item, raw=True)


def state_from_seed(spanner_type: dict[str, Any], value: Any) -> Any:
    """A mirror value as state keeps it: a rebase seeds state from the mirrors. The seed
    carries timestamps as epoch microseconds (Spark's ``unix_micros``, exact at any year and
    in any time zone), as state keeps them; ``mirror_value`` of the result is the mirror's value
    again."""
    if value is None:
        return None
    code = spanner_type.get("code")
    if code == "ARRAY":
        element = spanner_type.get("array_element_type") or {}
        return canonical_json([None if v is None else _element_wire(element, v) for v in value])
    if code == "STRING":
        return str(value).encode()
    if code == "BYTES":
        return bytes(value)
    return value


def _element_wire(element_type: dict[str, Any], item: Any) -> Any:
    """An array element of the seed as state keeps it: as Spanner sends it, but text and
    bytes both as base64."""
    code = element_type.get("code")
    if code == "STRING":
        return base64.b64encode(str(item).encode()).decode()
    if code == "BYTES":
        return base64.b64encode(bytes(item)).decode()
    if not is_mapped(element_type):
        return item
    if code in ("INT64", "ENUM", "NUMERIC"):
        return str(item)
    if code == "DATE":
        return item.isoformat()
    if code == "TIMESTAMP":
        return to_rfc3339(item * 1000)
    return item


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def _scalar(spanner_type: dict[str, Any], value: Any, raw: bool) -> Any:
    code = spanner_type.get("code")
    if code == "TIMESTAMP":
        nanos = parse_rfc3339(value) if raw else value
        return from_micros(nanos // 1000)
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
