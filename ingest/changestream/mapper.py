"""Result rows of a change stream query → typed records, for both SQL dialects.

PostgreSQL returns one JSONB document per row, read as text from the raw protobuf value the
client leaves undecoded (``lazy_decode``), then built into records by field name. GoogleSQL rows
are built by position from the same raw values (``raw_mapper``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from google.cloud.spanner_v1.data_types import JsonObject

from ingest.model import timestamps
from ingest.model.records import (
    ChangeRecord,
    ChildPartition,
    ChildPartitionsRecord,
    ColumnType,
    DataChangeRecord,
    HeartbeatRecord,
    Mod,
)

RECORD_FIELDS = ("data_change_record", "heartbeat_record", "child_partitions_record")


class UnknownRecordError(ValueError):
    """A row that is none of the three change stream record types."""


def plain_json(value: Any) -> Any:
    """Unwrap the client's ``JsonObject`` (or parse JSON text) into plain dicts, lists, scalars.

    The client builds ``JsonObject`` with ``json.loads``, so what it wraps is plain already.
    """
    if isinstance(value, JsonObject):
        if value._is_null:
            return None
        if value._is_array:
            return list(value._array_value)
        if value._is_scalar_value:
            return value._simple_value
        return dict(value)
    if isinstance(value, str):
        return json.loads(value)
    return value


def postgresql_raw_row_mapper(fields: Any) -> Callable[[list[Any]], list[ChangeRecord]]:
    """Mapper for raw (``lazy_decode``) rows of ``spanner.read_json_<stream>``: each row is one
    JSONB document, as text."""
    if len(fields) != 1:
        raise UnknownRecordError(f"unexpected result columns: {[f.name for f in fields]}")

    def to_records(row: list[Any]) -> list[ChangeRecord]:
        document = json.loads(row[0].string_value)
        if not isinstance(document, dict):
            raise UnknownRecordError(f"change record is not a JSON object: {document!r:.200}")
        return records_from_change_record(document)

    return to_records


def records_from_change_record(change_record: Mapping[str, Any]) -> list[ChangeRecord]:
    """Typed records of one ChangeRecord element; exactly one of its three fields is set."""
    unknown = set(change_record) - set(RECORD_FIELDS)
    if unknown:
        raise UnknownRecordError(f"unknown change record fields: {sorted(unknown)}")
    records: list[ChangeRecord] = []
    for field in RECORD_FIELDS:
        value = change_record.get(field)
        if not value:
            continue
        items = value if isinstance(value, list) else [value]
        make = _MAKERS[field]
        records.extend(make(item) for item in items)
    if not records:
        raise UnknownRecordError(f"change record with no record set: {dict(change_record)!r:.300}")
    return records


def _require(item: Mapping[str, Any], name: str, kind: str) -> Any:
    if name not in item:
        raise UnknownRecordError(f"{kind} without field {name!r}: {sorted(item)}")
    return item[name]


def _json_object(value: Any) -> dict[str, Any]:
    plain = plain_json(value)
    if plain is None:
        return {}
    if not isinstance(plain, dict):
        raise UnknownRecordError(f"expected a JSON object, got {plain!r:.200}")
    return plain


def _data_change_record(item: Mapping[str, Any]) -> DataChangeRecord:
    kind = "data_change_record"
    return DataChangeRecord(
        commit_timestamp=timestamps.coerce(_require(item, "commit_timestamp", kind)),
        record_sequence=str(_require(item, "record_sequence", kind)),
        server_transaction_id=str(_require(item, "server_transaction_id", kind)),
        is_last_record_in_transaction_in_partition=bool(
            item.get("is_last_record_in_transaction_in_partition")
        ),
        table_name=str(_require(item, "table_name", kind)),
        column_types=tuple(
            ColumnType(
                name=str(_require(column, "name", "column_types")),
                type=_json_object(_require(column, "type", "column_types")),
                is_primary_key=bool(column.get("is_primary_key")),
                ordinal_position=int(column.get("ordinal_position") or 0),
            )
            for column in _require(item, "column_types", kind) or ()
        ),
        mods=tuple(
            Mod(
                keys=_json_object(mod.get("keys")),
                new_values=_json_object(mod.get("new_values")),
                old_values=_json_object(mod.get("old_values")),
            )
            for mod in _require(item, "mods", kind) or ()
        ),
        mod_type=str(_require(item, "mod_type", kind)),
        value_capture_type=str(item.get("value_capture_type") or ""),
        number_of_records_in_transaction=int(
            _require(item, "number_of_records_in_transaction", kind)
        ),
        number_of_partitions_in_transaction=int(
            item.get("number_of_partitions_in_transaction") or 1
        ),
        transaction_tag=str(item.get("transaction_tag") or ""),
        is_system_transaction=bool(item.get("is_system_transaction")),
    )


def _heartbeat_record(item: Mapping[str, Any]) -> HeartbeatRecord:
    return HeartbeatRecord(timestamp=timestamps.coerce(_require(item, "timestamp", "heartbeat")))


def _child_partitions_record(item: Mapping[str, Any]) -> ChildPartitionsRecord:
    kind = "child_partitions_record"
    return ChildPartitionsRecord(
        start_timestamp=timestamps.coerce(_require(item, "start_timestamp", kind)),
        record_sequence=str(_require(item, "record_sequence", kind)),
        child_partitions=tuple(
            ChildPartition(
                token=str(_require(child, "token", "child_partitions")),
                parent_partition_tokens=tuple(
                    str(parent) for parent in child.get("parent_partition_tokens") or () if parent
                ),
            )
            for child in _require(item, "child_partitions", kind) or ()
        ),
    )


_MAKERS: dict[str, Callable[[Mapping[str, Any]], ChangeRecord]] = {
    "data_change_record": _data_change_record,
    "heartbeat_record": _heartbeat_record,
    "child_partitions_record": _child_partitions_record,
}
