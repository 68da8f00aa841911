"""GoogleSQL change stream rows → typed records, straight from the raw protobuf values.

The query runs with ``lazy_decode``: the client hands over each row's protobuf ``Value`` as
received, without its own decoding (proto-plus wrappers, a decoder call per value, a
``JsonObject`` per JSON value), which costs several times what the records need. Field positions
come from the result metadata, once per query; a record is then built by index. Column types
repeat for every record of a table, so they are built once per distinct encoding.

Record shapes: Spanner's "Change streams record format" page (GoogleSQL): ``ChangeRecord`` is
ARRAY<STRUCT<data_change_record ARRAY<STRUCT<...>>, heartbeat_record ARRAY<STRUCT<timestamp>>,
child_partitions_record ARRAY<STRUCT<start_timestamp, record_sequence, child_partitions
ARRAY<STRUCT<token, parent_partition_tokens ARRAY<STRING>>>>>>>. INT64 and TIMESTAMP arrive as
text, JSON as text. A field the records need that the metadata lacks fails the query at once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ingest.changestream.mapper import RECORD_FIELDS, UnknownRecordError
from ingest.model.records import (
    ChangeRecord,
    ChildPartition,
    ChildPartitionsRecord,
    ColumnType,
    DataChangeRecord,
    HeartbeatRecord,
    Mod,
)
from ingest.model.timestamps import parse_rfc3339

Values = Any
"""The repeated ``values`` of one struct's ``list_value``: fields by position."""

_COLUMN_TYPE_CACHE_SIZE = 4096


def _positions(struct_type: Any, kind: str, required: tuple[str, ...]) -> dict[str, int]:
    positions = {field.name: i for i, field in enumerate(struct_type.struct_type.fields)}
    missing = [name for name in required if name not in positions]
    if missing:
        raise UnknownRecordError(f"{kind} without fields {missing}: {sorted(positions)}")
    return positions


def _element(struct_type: Any, name: str) -> Any:
    """The element type of array field ``name`` of a struct type."""
    for field in struct_type.struct_type.fields:
        if field.name == name:
            return field.type_.array_element_type
    raise UnknownRecordError(f"no field {name!r} in {struct_type}")


_JSON = json.JSONDecoder()


def _json_object(text: str) -> dict[str, Any]:
    """Spanner's JSON text has no surrounding whitespace, so ``raw_decode`` (half the cost of
    ``json.loads``, which first matches whitespace twice) reads it whole; the end is checked."""
    if text in ("", "{}"):
        return {}  # "" is a NULL JSON value
    value, end = _JSON.raw_decode(text)
    if end != len(text) or not isinstance(value, dict):
        raise UnknownRecordError(f"expected a JSON object, got {text!r:.200}")
    return value


def _data_change_maker(struct_type: Any) -> Callable[[Values], DataChangeRecord]:
    at = _positions(
        struct_type,
        "data_change_record",
        (
            "commit_timestamp",
            "record_sequence",
            "server_transaction_id",
            "table_name",
            "column_types",
            "mods",
            "mod_type",
            "number_of_records_in_transaction",
        ),
    )
    column_types = _column_types_maker(_element(struct_type, "column_types"))
    mods_of = _mods_maker(_element(struct_type, "mods"))
    commit, sequence, transaction = (
        at["commit_timestamp"],
        at["record_sequence"],
        at["server_transaction_id"],
    )
    table, columns, mods, mod_type = (
        at["table_name"],
        at["column_types"],
        at["mods"],
        at["mod_type"],
    )
    records_in_transaction = at["number_of_records_in_transaction"]
    last = at.get("is_last_record_in_transaction_in_partition")
    capture = at.get("value_capture_type")
    partitions = at.get("number_of_partitions_in_transaction")
    tag = at.get("transaction_tag")
    system = at.get("is_system_transaction")

    def text(values: Values, position: int | None) -> str:
        return "" if position is None else values[position].string_value

    def make(values: Values) -> DataChangeRecord:
        return DataChangeRecord(
            commit_timestamp=parse_rfc3339(values[commit].string_value),
            record_sequence=values[sequence].string_value,
            server_transaction_id=values[transaction].string_value,
            is_last_record_in_transaction_in_partition=last is not None and values[last].bool_value,
            table_name=values[table].string_value,
            column_types=column_types(values[columns]),
            mods=mods_of(values[mods]),
            mod_type=values[mod_type].string_value,
            value_capture_type=text(values, capture),
            number_of_records_in_transaction=int(values[records_in_transaction].string_value),
            number_of_partitions_in_transaction=int(text(values, partitions) or 1),
            transaction_tag=text(values, tag),
            is_system_transaction=system is not None and values[system].bool_value,
        )

    return make


def _column_types_maker(struct_type: Any) -> Callable[[Any], tuple[ColumnType, ...]]:
    """Column types repeat for every record of a table: built once per distinct encoding."""
    column = _positions(struct_type, "column_types", ("name", "type"))
    name, type_ = column["name"], column["type"]
    key, ordinal = column.get("is_primary_key"), column.get("ordinal_position")
    built: dict[bytes, tuple[ColumnType, ...]] = {}

    def column_types(value: Any) -> tuple[ColumnType, ...]:
        encoded = value.SerializeToString()
        known = built.get(encoded)
        if known is not None:
            return known
        made = tuple(
            ColumnType(
                name=v[name].string_value,
                type=_json_object(v[type_].string_value),
                is_primary_key=key is not None and v[key].bool_value,
                ordinal_position=int(v[ordinal].string_value or 0) if ordinal is not None else 0,
            )
            for v in (item.list_value.values for item in value.list_value.values)
        )
        if len(built) < _COLUMN_TYPE_CACHE_SIZE:
            built[encoded] = made
        return made

    return column_types


def _mods_maker(struct_type: Any) -> Callable[[Any], tuple[Mod, ...]]:
    mod = _positions(struct_type, "mods", ("keys", "new_values", "old_values"))
    keys, new_values, old_values = mod["keys"], mod["new_values"], mod["old_values"]

    def mods(value: Any) -> tuple[Mod, ...]:
        return tuple(
            Mod(
                _json_object(m[keys].string_value),
                _json_object(m[new_values].string_value),
                _json_object(m[old_values].string_value),
            )
            for m in (item.list_value.values for item in value.list_value.values)
        )

    return mods


def _heartbeat_maker(struct_type: Any) -> Callable[[Values], HeartbeatRecord]:
    at = _positions(struct_type, "heartbeat_record", ("timestamp",))["timestamp"]
    return lambda values: HeartbeatRecord(parse_rfc3339(values[at].string_value))


def _child_partitions_maker(struct_type: Any) -> Callable[[Values], ChildPartitionsRecord]:
    at = _positions(
        struct_type,
        "child_partitions_record",
        ("start_timestamp", "record_sequence", "child_partitions"),
    )
    child = _positions(_element(struct_type, "child_partitions"), "child_partitions", ("token",))
    start, sequence, children = (
        at["start_timestamp"],
        at["record_sequence"],
        at["child_partitions"],
    )
    token, parents = child["token"], child.get("parent_partition_tokens")

    def parent_tokens(child_values: Values) -> tuple[str, ...]:
        if parents is None:
            return ()
        return tuple(
            p.string_value for p in child_values[parents].list_value.values if p.string_value
        )

    def make(values: Values) -> ChildPartitionsRecord:
        return ChildPartitionsRecord(
            start_timestamp=parse_rfc3339(values[start].string_value),
            record_sequence=values[sequence].string_value,
            child_partitions=tuple(
                ChildPartition(
                    token=c[token].string_value,
                    parent_partition_tokens=parent_tokens(c),
                )
                for c in (item.list_value.values for item in values[children].list_value.values)
            ),
        )

    return make


_MAKERS: dict[str, Callable[[Any], Callable[[Values], ChangeRecord]]] = {
    "data_change_record": _data_change_maker,
    "heartbeat_record": _heartbeat_maker,
    "child_partitions_record": _child_partitions_maker,
}


def googlesql_raw_row_mapper(fields: Any) -> Callable[[list[Any]], list[ChangeRecord]]:
    """Mapper for raw rows of ``SELECT ChangeRecord FROM READ_<stream>(...)``."""
    if len(fields) != 1 or fields[0].name != "ChangeRecord":
        raise UnknownRecordError(f"unexpected result columns: {[f.name for f in fields]}")
    element = fields[0].type_.array_element_type
    names = [field.name for field in element.struct_type.fields]
    unknown = set(names) - set(RECORD_FIELDS)
    if unknown:
        raise UnknownRecordError(f"unknown change record fields: {sorted(unknown)}")
    makers = [
        (position, _MAKERS[field.name](field.type_.array_element_type))
        for position, field in enumerate(element.struct_type.fields)
    ]

    def to_records(row: list[Any]) -> list[ChangeRecord]:
        records: list[ChangeRecord] = []
        for change_record in row[0].list_value.values:
            values = change_record.list_value.values
            made = len(records)
            for position, make in makers:
                items = values[position].list_value.values
                records.extend(make(item.list_value.values) for item in items)
            if len(records) == made:
                raise UnknownRecordError("change record with no record set")
        return records

    return to_records
