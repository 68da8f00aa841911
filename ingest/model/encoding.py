"""Canonical JSON text of records and transactions (sorted keys, compact separators).

Values stay exactly as Spanner sent them; canonical text makes equal values equal strings, which
the change-log table and the tests rely on.
"""

from __future__ import annotations

import json
from typing import Any

from ingest.model.records import ColumnType, DataChangeRecord, Transaction
from ingest.model.timestamps import to_rfc3339

_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
"""One encoder for every call: ``json.dumps`` with options builds a new one each time (a
snapshot encodes two texts per row; bench/RESULTS.md, the Spark snapshot's profile)."""


def canonical_json(value: Any) -> str:
    return _CANONICAL.encode(value)


def column_type_to_dict(column: ColumnType) -> dict[str, Any]:
    """A column's type as Spanner's change records spell it (``column_types`` entries)."""
    return {
        "name": column.name,
        "type": column.type,
        "is_primary_key": column.is_primary_key,
        "ordinal_position": column.ordinal_position,
    }


def column_type_from_dict(data: dict[str, Any]) -> ColumnType:
    return ColumnType(
        name=data["name"],
        type=data["type"],
        is_primary_key=bool(data["is_primary_key"]),
        ordinal_position=int(data["ordinal_position"]),
    )


def record_to_dict(record: DataChangeRecord) -> dict[str, Any]:
    return {
        "record_sequence": record.record_sequence,
        "table_name": record.table_name,
        "mod_type": record.mod_type,
        "value_capture_type": record.value_capture_type,
        "is_last_record_in_transaction_in_partition": (
            record.is_last_record_in_transaction_in_partition
        ),
        "column_types": [column_type_to_dict(column) for column in record.column_types],
        "mods": [
            {"keys": mod.keys, "new_values": mod.new_values, "old_values": mod.old_values}
            for mod in record.mods
        ],
    }


def transaction_to_dict(transaction: Transaction) -> dict[str, Any]:
    first = transaction.records[0]
    return {
        "commit_timestamp": to_rfc3339(transaction.commit_timestamp),
        "server_transaction_id": transaction.server_transaction_id,
        "number_of_records_in_transaction": first.number_of_records_in_transaction,
        "number_of_partitions_in_transaction": first.number_of_partitions_in_transaction,
        "transaction_tag": first.transaction_tag,
        "is_system_transaction": first.is_system_transaction,
        "records": [record_to_dict(record) for record in transaction.records],
    }
