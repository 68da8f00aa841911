"""The change log's rows as the sink writes them (the contract is ``ingest.contract.changelog``):
one Arrow table per commit from released transactions, schema rows and snapshot chunks."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa

from ingest.contract.changelog import (
    SCHEMA,
    SCHEMA_ROW,
    SNAPSHOT_DELETE,
    SNAPSHOT_ROW,
    column_types_json,
)
from ingest.model.encoding import canonical_json
from ingest.model.records import ColumnType, DataChangeRecord, Transaction
from ingest.model.snapshot import SnapshotChunk
from ingest.model.timestamps import NANOS_PER_SECOND, Nanos, to_rfc3339


def _date(timestamp: Nanos) -> dt.date:
    return dt.date(1970, 1, 1) + dt.timedelta(days=timestamp // (86400 * NANOS_PER_SECOND))


def to_arrow(
    transactions: Iterable[Transaction],
    watched: Mapping[str, tuple[ColumnType, ...]] | None = None,
    watched_at: Nanos = 0,
    snapshot: Iterable[SnapshotChunk] = (),
    snapshot_at: Nanos = 0,
) -> pa.Table:
    """Snapshot rows read at ``snapshot_at`` (and the deletes of keys a snapshot did not find),
    rows of whole transactions, then schema rows of ``watched`` read at ``watched_at``."""
    columns: dict[str, list[Any]] = {name: [] for name in SCHEMA.names}
    for chunk in snapshot:
        _append_snapshot_rows(columns, chunk, snapshot_at)
    for transaction in transactions:
        _append_transaction_rows(columns, transaction)
    for table, watched_columns in sorted((watched or {}).items()):
        _append_schema_row(columns, table, watched_columns, watched_at)
    return pa.Table.from_pydict(columns, schema=SCHEMA)


def records_to_arrow(records: Iterable[DataChangeRecord]) -> pa.Table:
    """Rows of data change records read apart from their transactions (a Spark source's task):
    whoever lands them checks that each transaction is whole and orders them."""
    columns: dict[str, list[Any]] = {name: [] for name in SCHEMA.names}
    for record in records:
        _append_record_rows(columns, record)
    return pa.Table.from_pydict(columns, schema=SCHEMA)


def _append_transaction_rows(columns: dict[str, list[Any]], transaction: Transaction) -> None:
    """One row per mod, in record and mod order."""
    for record in transaction.records:
        _append_record_rows(columns, record)


def _append_record_rows(columns: dict[str, list[Any]], record: DataChangeRecord) -> None:
    """One row per mod, in mod order."""
    micros = record.commit_timestamp // 1000
    text = to_rfc3339(record.commit_timestamp)
    date = _date(record.commit_timestamp)
    column_types = column_types_json(record.column_types)
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
        columns["number_of_records_in_transaction"].append(record.number_of_records_in_transaction)
        columns["number_of_partitions_in_transaction"].append(
            record.number_of_partitions_in_transaction
        )
        columns["transaction_tag"].append(record.transaction_tag)
        columns["is_system_transaction"].append(record.is_system_transaction)
        columns["commit_date"].append(date)


def _append_schema_row(
    columns: dict[str, list[Any]], table: str, watched_columns: tuple[ColumnType, ...], at: Nanos
) -> None:
    row = {
        "commit_timestamp": at // 1000,
        "commit_timestamp_text": to_rfc3339(at),
        "server_transaction_id": "",
        "record_sequence": "",
        "mod_index": 0,
        "table_name": table,
        "mod_type": SCHEMA_ROW,
        "value_capture_type": None,
        "keys": "",
        "new_values": "{}",
        "old_values": "{}",
        "column_types": column_types_json(watched_columns),
        "number_of_records_in_transaction": 0,
        "number_of_partitions_in_transaction": 0,
        "transaction_tag": "",
        "is_system_transaction": False,
        "commit_date": _date(at),
    }
    for name, value in row.items():
        columns[name].append(value)


def _append_snapshot_rows(columns: dict[str, list[Any]], chunk: SnapshotChunk, at: Nanos) -> None:
    constant = {
        "commit_timestamp": at // 1000,
        "commit_timestamp_text": to_rfc3339(at),
        "server_transaction_id": "",
        "record_sequence": "",
        "mod_index": 0,
        "table_name": chunk.table,
        "old_values": "{}",
        "column_types": column_types_json(chunk.column_types),
        "number_of_records_in_transaction": 0,
        "number_of_partitions_in_transaction": 0,
        "transaction_tag": "",
        "is_system_transaction": False,
        "commit_date": _date(at),
    }
    rows: list[tuple[str, str, str, str | None]] = [
        (keys, values, SNAPSHOT_ROW, "NEW_ROW") for keys, values in chunk.rows
    ]
    rows += [(keys, "{}", SNAPSHOT_DELETE, None) for keys in chunk.deleted_keys]
    for name, value in constant.items():
        columns[name].extend([value] * len(rows))
    for keys, values, mod_type, capture in rows:
        columns["keys"].append(keys)
        columns["new_values"].append(values)
        columns["mod_type"].append(mod_type)
        columns["value_capture_type"].append(capture)
