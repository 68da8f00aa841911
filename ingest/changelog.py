"""The change-log table's rows (design.md contract 1): one row per mod, as an Arrow table."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable

import pyarrow as pa

from ingest.encoding import canonical_json
from ingest.records import Transaction
from ingest.timestamps import NANOS_PER_SECOND, to_rfc3339

UTC_MICROS = pa.timestamp("us", tz="UTC")

SCHEMA = pa.schema(
    [
        ("commit_timestamp", UTC_MICROS),
        # Spark timestamps stop at microseconds; the text keeps every digit Spanner sent.
        ("commit_timestamp_text", pa.string()),
        ("server_transaction_id", pa.string()),
        ("record_sequence", pa.string()),
        ("mod_index", pa.int32()),
        ("table_name", pa.string()),
        ("mod_type", pa.string()),
        ("value_capture_type", pa.string()),
        ("keys", pa.string()),
        ("new_values", pa.string()),
        ("old_values", pa.string()),
        ("column_types", pa.string()),
        ("number_of_records_in_transaction", pa.int32()),
        ("number_of_partitions_in_transaction", pa.int32()),
        ("transaction_tag", pa.string()),
        ("is_system_transaction", pa.bool_()),
        ("commit_date", pa.date32()),
    ]
)
PARTITION_COLUMNS = ["commit_date"]
ORDER_COLUMNS = ["commit_timestamp_text", "server_transaction_id", "record_sequence", "mod_index"]


def _column_types_json(transaction_record: object) -> str:
    return canonical_json(
        [
            {
                "name": c.name,
                "type": c.type,
                "is_primary_key": c.is_primary_key,
                "ordinal_position": c.ordinal_position,
            }
            for c in transaction_record.column_types  # type: ignore[attr-defined]
        ]
    )


def to_arrow(transactions: Iterable[Transaction]) -> pa.Table:
    columns: dict[str, list] = {name: [] for name in SCHEMA.names}
    for transaction in transactions:
        micros = transaction.commit_timestamp // 1000
        text = to_rfc3339(transaction.commit_timestamp)
        date = dt.date(1970, 1, 1) + dt.timedelta(
            days=transaction.commit_timestamp // (86400 * NANOS_PER_SECOND)
        )
        for record in transaction.records:
            column_types = _column_types_json(record)
            for index, mod in enumerate(record.mods):
                columns["commit_timestamp"].append(micros)
                columns["commit_timestamp_text"].append(text)
                columns["server_transaction_id"].append(record.server_transaction_id)
                columns["record_sequence"].append(record.record_sequence)
                columns["mod_index"].append(index)
                columns["table_name"].append(record.table_name)
                columns["mod_type"].append(record.mod_type)
                columns["value_capture_type"].append(record.value_capture_type)
                columns["keys"].append(canonical_json(mod.keys))
                columns["new_values"].append(canonical_json(mod.new_values))
                columns["old_values"].append(canonical_json(mod.old_values))
                columns["column_types"].append(column_types)
                columns["number_of_records_in_transaction"].append(
                    record.number_of_records_in_transaction
                )
                columns["number_of_partitions_in_transaction"].append(
                    record.number_of_partitions_in_transaction
                )
                columns["transaction_tag"].append(record.transaction_tag)
                columns["is_system_transaction"].append(record.is_system_transaction)
                columns["commit_date"].append(date)
    return pa.Table.from_pydict(columns, schema=SCHEMA)
