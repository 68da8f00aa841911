"""Reads one table at exactly T0 in primary-key order, as change-log rows in Spanner's wire
encoding.

A streaming Read (not a partitioned query) because its order is the key order: the last key
landed is a resume position that stays valid in any later process, whereas partition tokens die
with the batch transaction that made them. Values are taken undecoded (``lazy_decode``) and kept in
the wire encoding change records use (INT64 and BYTES as text, …), so the pipeline reads a snapshot
row exactly as it reads a change record, and a key given back to ``KeyRange.start_open`` binds to
the same key.

Each read asks for at most ``range_rows`` rows (Spanner's ``limit``) and the next one starts just
after the last key: the client receives a whole read ahead of its consumer (on the emulator a
table's read alone rose to 453 MiB for 600,000 rows), so memory is bounded by the range, not the
table. With ``chunk_bytes`` both chunks and ranges are bounded by bytes too (rows of 1 MiB values
would otherwise make a 50,000-row range 50 GB).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from google.cloud.spanner_v1 import KeyRange, KeySet
from google.cloud.spanner_v1.database import Database
from google.protobuf import struct_pb2

from ingest.model.encoding import canonical_json
from ingest.model.records import ColumnType, JsonValue
from ingest.model.snapshot import Key, SnapshotChunk
from ingest.model.timestamps import Nanos, to_datetime


def wire_json(value: struct_pb2.Value) -> JsonValue:
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return value.string_value
    if kind == "number_value":
        return value.number_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "list_value":
        return [wire_json(v) for v in value.list_value.values]
    if kind == "struct_value":
        return {k: wire_json(v) for k, v in value.struct_value.fields.items()}
    return None


FIRST_RANGE_ROWS = 10
"""The first read of a table asks this few rows: its rows' size is unknown until they arrive."""


def read_table(
    database: Database,
    table: str,
    column_types: tuple[ColumnType, ...],
    read_timestamp: Nanos,
    after_key: Key | None,
    chunk_rows: int,
    range_rows: int | None = None,
    chunk_bytes: int | None = None,
    end_key: Key | None = None,
) -> Iterator[SnapshotChunk]:
    """The table's rows after ``after_key`` (all of them for None) up to ``end_key`` included
    (the table's last for None) as of exactly ``read_timestamp``, in chunks of ``chunk_rows``
    rows or ``chunk_bytes`` bytes, whichever comes first; the last chunk is marked done (it may
    be empty). Reads ``range_rows`` rows at a time (five chunks unless told), fewer when rows
    are large: with a byte bound the ranges after the first hold about five chunks' bytes, so
    wide rows bound memory as narrow ones do."""
    values = [c for c in column_types if not c.is_primary_key]
    most_rows = range_rows or 5 * chunk_rows
    limit = most_rows if chunk_bytes is None else min(most_rows, FIRST_RANGE_ROWS)
    rows: list[tuple[str, str]] = []
    size = 0
    last_key = after_key
    with database.snapshot(read_timestamp=to_datetime(read_timestamp), multi_use=True) as snapshot:
        keys = primary_key(snapshot, table, column_types)
        columns = [c.name for c in keys] + [c.name for c in values]
        width = len(keys)
        while True:
            key_set = _key_set(last_key, end_key)
            result: Any = snapshot.read(table, columns, key_set, limit=limit, lazy_decode=True)
            read = read_bytes = 0
            for row in result:
                read += 1
                decoded = [wire_json(v) for v in row]
                last_key = tuple(decoded[:width])
                keys_json = canonical_json({c.name: v for c, v in zip(keys, last_key, strict=True)})
                values_json = canonical_json(
                    {c.name: v for c, v in zip(values, decoded[width:], strict=True)}
                )
                rows.append((keys_json, values_json))
                row_bytes = len(keys_json) + len(values_json)
                size += row_bytes
                read_bytes += row_bytes
                if len(rows) == chunk_rows or (chunk_bytes is not None and size >= chunk_bytes):
                    yield SnapshotChunk(table, column_types, rows, last_key, done=False)
                    rows, size = [], 0
            if read < limit:
                break
            if chunk_bytes is not None:
                limit = max(1, min(most_rows, 5 * chunk_bytes * read // max(read_bytes, 1)))
    yield SnapshotChunk(table, column_types, rows, last_key, done=True)


def primary_key(
    snapshot: Any, table: str, column_types: tuple[ColumnType, ...]
) -> list[ColumnType]:
    """The table's key columns in the primary key's order, which a key binds to: column order
    (``ordinal_position``, the order of ``column_types``) may differ, as in ``CREATE TABLE t (b
    STRING(MAX), a INT64) PRIMARY KEY (a, b)``."""
    schema, _, name = table.rpartition(".")

    def literal(text: str) -> str:
        return "'" + text.replace("'", "''") + "'"

    in_schema = f" AND table_schema = {literal(schema)}" if schema else ""
    order = [
        row[0]
        for row in snapshot.execute_sql(
            "SELECT column_name FROM information_schema.index_columns "
            f"WHERE index_type = 'PRIMARY_KEY' AND table_name = {literal(name)}{in_schema} "
            "ORDER BY ordinal_position"
        )
    ]
    keys = {c.name: c for c in column_types if c.is_primary_key}
    if sorted(order) != sorted(keys):
        raise ValueError(f"the primary key of {table} is {order}, the columns say {sorted(keys)}")
    return [keys[name] for name in order]


def _key_set(after: Key | None, end: Key | None) -> KeySet:
    if after is None and end is None:
        return KeySet(all_=True)
    last = list(end) if end is not None else []
    if after is None:
        return KeySet(ranges=[KeyRange(start_closed=[], end_closed=last)])
    return KeySet(ranges=[KeyRange(start_open=list(after), end_closed=last)])


def sample_keys(
    database: Database,
    table: str,
    key_columns: tuple[ColumnType, ...],
    read_timestamp: Nanos,
    rows: int,
    postgresql: bool,
) -> list[Key]:
    """Up to ``rows`` keys of the table at ``read_timestamp``, in key order: the keys whose
    fingerprint is lowest (Spanner scans the table's keys once and sends only these). A hash
    rather than ``TABLESAMPLE`` because both dialects serve it (the PostgreSQL interface has no
    ``TABLESAMPLE``) and the same table at the same timestamp gives the same sample. Read back by
    key, a read yields rows in key order, whatever each key column's direction."""
    quote = '"' if postgresql else "`"

    def quoted(name: str) -> str:
        return f"{quote}{name.replace(quote, quote * 2)}{quote}"

    def as_text(column: ColumnType) -> str:
        value = quoted(column.name)
        if column.type.get("code") == "BYTES":
            value = f"{'spanner.farm_fingerprint' if postgresql else 'FARM_FINGERPRINT'}({value})"
        text = "varchar" if postgresql else "STRING"
        return f"{'COALESCE' if postgresql else 'IFNULL'}(CAST({value} AS {text}), '')"

    fingerprint = "spanner.farm_fingerprint" if postgresql else "FARM_FINGERPRINT"
    with database.snapshot(read_timestamp=to_datetime(read_timestamp), multi_use=True) as snapshot:
        keys = primary_key(snapshot, table, key_columns)
        if not keys:
            return []
        names = [c.name for c in keys]
        joined = " || '|' || ".join(as_text(c) for c in keys)
        sql = (
            f"SELECT {', '.join(quoted(n) for n in names)} "
            f"FROM {'.'.join(quoted(p) for p in table.split('.'))} "
            f"ORDER BY {fingerprint}({joined}) LIMIT {int(rows)}"
        )
        result: Any = snapshot.execute_sql(sql, lazy_decode=True)
        sampled = [[wire_json(v) for v in row] for row in result]
        if not sampled:
            return []
        ordered: Any = snapshot.read(table, names, KeySet(keys=sampled), lazy_decode=True)
        return [tuple(wire_json(v) for v in row) for row in ordered]


def count_rows(database: Database, table: str, read_timestamp: Nanos, postgresql: bool) -> int:
    """The table's rows at ``read_timestamp``: what a snapshot's time estimate rests on. One
    ``COUNT(*)`` (Spanner scans the smallest index), before the snapshot reads anything."""
    quote = '"' if postgresql else "`"
    sql = f"SELECT COUNT(*) FROM {quote}{table.replace(quote, quote * 2)}{quote}"
    with database.snapshot(read_timestamp=to_datetime(read_timestamp)) as snapshot:
        return int(next(iter(snapshot.execute_sql(sql)))[0])
