"""The change stream's record types, as plain values.

Field names follow the Spanner change stream record format. Timestamps are integer nanoseconds
(see ``ingest.model.timestamps``); JSON fields (keys, values, column types) are plain Python values
exactly as Spanner sent them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ingest.model.timestamps import Nanos

JsonValue = Any


@dataclass(frozen=True, slots=True)
class ColumnType:
    name: str
    type: dict[str, JsonValue]
    is_primary_key: bool
    ordinal_position: int


@dataclass(frozen=True, slots=True)
class Mod:
    keys: dict[str, JsonValue]
    new_values: dict[str, JsonValue]
    old_values: dict[str, JsonValue]


@dataclass(frozen=True, slots=True)
class DataChangeRecord:
    commit_timestamp: Nanos
    record_sequence: str
    server_transaction_id: str
    is_last_record_in_transaction_in_partition: bool
    table_name: str
    column_types: tuple[ColumnType, ...]
    mods: tuple[Mod, ...]
    mod_type: str
    value_capture_type: str
    number_of_records_in_transaction: int
    number_of_partitions_in_transaction: int
    transaction_tag: str
    is_system_transaction: bool


@dataclass(frozen=True, slots=True)
class HeartbeatRecord:
    timestamp: Nanos


@dataclass(frozen=True, slots=True)
class ChildPartition:
    token: str
    parent_partition_tokens: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ChildPartitionsRecord:
    start_timestamp: Nanos
    record_sequence: str
    child_partitions: tuple[ChildPartition, ...]


@dataclass(frozen=True, slots=True)
class PartitionStartRecord:
    """``MUTABLE_KEY_RANGE`` mode: partitions to query from ``start_timestamp``. The partition
    that returns it lives on (the initial query ends after announcing the first ones)."""

    start_timestamp: Nanos
    record_sequence: str
    partition_tokens: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PartitionEndRecord:
    """``MUTABLE_KEY_RANGE`` mode: the partition's last record; everything it will ever return
    has a timestamp at or below ``end_timestamp``."""

    end_timestamp: Nanos
    record_sequence: str
    partition_token: str


@dataclass(frozen=True, slots=True)
class PartitionEventRecord:
    """``MUTABLE_KEY_RANGE`` mode: key ranges moved into or out of the partition at
    ``commit_timestamp``. A reader that releases only below one global low watermark orders every
    key's changes without them; they prove the partition's progress like any record."""

    commit_timestamp: Nanos
    record_sequence: str
    partition_token: str


ChangeRecord = (
    DataChangeRecord
    | HeartbeatRecord
    | ChildPartitionsRecord
    | PartitionStartRecord
    | PartitionEndRecord
    | PartitionEventRecord
)


def record_timestamp(record: ChangeRecord) -> Nanos:
    """The timestamp a record is at in its partition's stream."""
    if isinstance(record, DataChangeRecord | PartitionEventRecord):
        return record.commit_timestamp
    if isinstance(record, HeartbeatRecord):
        return record.timestamp
    if isinstance(record, PartitionEndRecord):
        return record.end_timestamp
    return record.start_timestamp


def sequence_key(record_sequence: str) -> tuple[int, str]:
    """Order record sequences numerically when they are digits of differing width."""
    return (len(record_sequence), record_sequence)


@dataclass(frozen=True, slots=True)
class Transaction:
    """All data change records of one committed transaction, in record_sequence order."""

    commit_timestamp: Nanos
    server_transaction_id: str
    records: tuple[DataChangeRecord, ...]

    @property
    def order_key(self) -> tuple[Nanos, str]:
        return (self.commit_timestamp, self.server_transaction_id)

    @property
    def mod_count(self) -> int:
        return sum(len(record.mods) for record in self.records)


WatchedColumns = dict[str, tuple[ColumnType, ...]]
"""Table name → its watched columns (keys included, as records list them), in ordinal order."""
