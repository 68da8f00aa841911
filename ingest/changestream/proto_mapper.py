"""``MUTABLE_KEY_RANGE`` change stream rows → typed records.

In this partition mode each row is one PROTO value holding a
``google.spanner.v1.ChangeStreamRecord`` (the Spanner v1 ``change_stream.proto``; the client
ships it as ``google.cloud.spanner_v1.types.ChangeStreamRecord``). GoogleSQL returns it as the
``ChangeRecord`` column of ``READ_<stream>``, PostgreSQL as the bytes of
``spanner.read_proto_bytes_<stream>``;
either way the raw protobuf ``Value`` carries the serialized message as base64 text. It is parsed
with the upb message class directly: proto-plus wrapping costs about ten times more.

Data change records come out exactly as the original mode's do (column types as Spanner's type
JSON, mod values as Spanner's JSON values: INT64 and NUMERIC as text), so nothing downstream
knows which mode a change came from. Partition start, end and event records keep their own types.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

from google.cloud.spanner_v1 import TypeCode
from google.cloud.spanner_v1.types import ChangeStreamRecord
from google.protobuf import json_format

from ingest.changestream.mapper import UnknownRecordError
from ingest.model.records import (
    ChangeRecord,
    ColumnType,
    DataChangeRecord,
    HeartbeatRecord,
    Mod,
    PartitionEndRecord,
    PartitionEventRecord,
    PartitionStartRecord,
)
from ingest.model.timestamps import NANOS_PER_SECOND, Nanos

PROTO_NAME = "google.spanner.v1.ChangeStreamRecord"
_MESSAGE = ChangeStreamRecord.pb()
_DATA = ChangeStreamRecord.DataChangeRecord
_MOD_TYPES = {v.number: v.name for v in _DATA.pb().DESCRIPTOR.enum_types_by_name["ModType"].values}
_CAPTURE_TYPES = {
    v.number: v.name for v in _DATA.pb().DESCRIPTOR.enum_types_by_name["ValueCaptureType"].values
}


def is_change_stream_record(field_type: Any) -> bool:
    """Whether a result column holds the ``MUTABLE_KEY_RANGE`` mode's PROTO record."""
    return field_type.code == TypeCode.PROTO and field_type.proto_type_fqn == PROTO_NAME


def _nanos(timestamp: Any) -> Nanos:
    return int(timestamp.seconds) * NANOS_PER_SECOND + int(timestamp.nanos)


def _plain(value: Any) -> Any:
    """A protobuf ``Value`` as the JSON value the original mode sends for it."""
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return value.string_value
    if kind == "null_value" or kind is None:
        return None
    if kind == "bool_value":
        return value.bool_value
    if kind == "number_value":
        return value.number_value
    if kind == "list_value":
        return [_plain(item) for item in value.list_value.values]
    return {key: _plain(item) for key, item in value.struct_value.fields.items()}


def _columns(record: Any) -> tuple[ColumnType, ...]:
    """Column metadata; the client's generated descriptor names the ``type`` field ``type_``
    (the wire format only knows its number)."""
    return tuple(
        ColumnType(
            name=column.name,
            type=json_format.MessageToDict(column.type_, preserving_proto_field_name=True),
            is_primary_key=column.is_primary_key,
            ordinal_position=int(column.ordinal_position),
        )
        for column in record.column_metadata
    )


def _data_change_record(record: Any) -> DataChangeRecord:
    columns = _columns(record)
    names = [column.name for column in columns]

    def values(mod_values: Any) -> dict[str, Any]:
        try:
            return {names[v.column_metadata_index]: _plain(v.value) for v in mod_values}
        except IndexError:
            raise UnknownRecordError(
                f"mod value names column {max(v.column_metadata_index for v in mod_values)} of "
                f"{len(names)}"
            ) from None

    return DataChangeRecord(
        commit_timestamp=_nanos(record.commit_timestamp),
        record_sequence=record.record_sequence,
        server_transaction_id=record.server_transaction_id,
        is_last_record_in_transaction_in_partition=record.is_last_record_in_transaction_in_partition,
        table_name=record.table,
        column_types=columns,
        mods=tuple(
            Mod(values(mod.keys), values(mod.new_values), values(mod.old_values))
            for mod in record.mods
        ),
        mod_type=_MOD_TYPES.get(record.mod_type, str(record.mod_type)),
        value_capture_type=_CAPTURE_TYPES.get(record.value_capture_type, ""),
        number_of_records_in_transaction=int(record.number_of_records_in_transaction),
        number_of_partitions_in_transaction=int(record.number_of_partitions_in_transaction) or 1,
        transaction_tag=record.transaction_tag,
        is_system_transaction=record.is_system_transaction,
    )


def record_from_bytes(data: bytes) -> ChangeRecord:
    """One serialized ``ChangeStreamRecord``; exactly one of its record fields is set."""
    message = _MESSAGE.FromString(data)
    kind = message.WhichOneof("record")
    if kind == "data_change_record":
        return _data_change_record(message.data_change_record)
    if kind == "heartbeat_record":
        return HeartbeatRecord(_nanos(message.heartbeat_record.timestamp))
    if kind == "partition_start_record":
        start = message.partition_start_record
        return PartitionStartRecord(
            _nanos(start.start_timestamp), start.record_sequence, tuple(start.partition_tokens)
        )
    if kind == "partition_end_record":
        end = message.partition_end_record
        return PartitionEndRecord(
            _nanos(end.end_timestamp), end.record_sequence, end.partition_token
        )
    if kind == "partition_event_record":
        event = message.partition_event_record
        return PartitionEventRecord(
            _nanos(event.commit_timestamp), event.record_sequence, event.partition_token
        )
    raise UnknownRecordError(f"change stream record with no record set ({len(data)} bytes)")


def proto_row_mapper(fields: Any) -> Callable[[list[Any]], list[ChangeRecord]]:
    """Mapper for raw (``lazy_decode``) rows whose one column is the serialized record."""
    if len(fields) != 1:
        raise UnknownRecordError(f"unexpected result columns: {[f.name for f in fields]}")
    return lambda row: [record_from_bytes(base64.b64decode(row[0].string_value))]
