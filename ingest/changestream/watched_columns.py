"""Which columns a change stream watches at a timestamp, read from ``information_schema``.

A data change record of a NEW_VALUES or OLD_AND_NEW_VALUES stream lists only the keys and the
changed columns, and a table that is not written again sends none at all, so records alone cannot
show that a column was dropped (or is no longer watched). The sink lands what this reads as schema
rows of the change log (``ingest.contract.changelog``) whenever it changes.
"""

from __future__ import annotations

import re
from typing import Any

from google.cloud.spanner_v1.database import Database

from ingest.changestream.query import Dialect, validate_stream_name
from ingest.model.records import ColumnType, WatchedColumns
from ingest.model.timestamps import Nanos, to_datetime

_GOOGLESQL_ARRAY = re.compile(r"^ARRAY<(.*)>$")
_GOOGLESQL_NAMED = re.compile(r"^(PROTO|ENUM)<(.*)>$")
_POSTGRESQL_CODES = {
    "bigint": {"code": "INT64"},
    "double precision": {"code": "FLOAT64"},
    "real": {"code": "FLOAT32"},
    "boolean": {"code": "BOOL"},
    "character varying": {"code": "STRING"},
    "text": {"code": "STRING"},
    "bytea": {"code": "BYTES"},
    "date": {"code": "DATE"},
    "timestamp with time zone": {"code": "TIMESTAMP"},
    "spanner.commit_timestamp": {"code": "TIMESTAMP"},
    "numeric": {"code": "NUMERIC", "type_annotation": "PG_NUMERIC"},
    "jsonb": {"code": "JSON", "type_annotation": "PG_JSONB"},
}
_HIDDEN_TYPES = ("TOKENLIST", "spanner.tokenlist")
"""Search index columns: never in a data change record (nor are generated columns)."""


def column_type(spanner_type: str, dialect: Dialect) -> dict[str, Any]:
    """``information_schema.columns.spanner_type`` as a record's column type (its JSON form)."""
    if dialect is Dialect.POSTGRESQL:
        if spanner_type.endswith("[]"):
            return {"code": "ARRAY", "array_element_type": column_type(spanner_type[:-2], dialect)}
        base = re.sub(r"\(.*\)$", "", spanner_type).strip()
        return dict(_POSTGRESQL_CODES.get(base, {"code": "TYPE_CODE_UNSPECIFIED"}))
    if array := _GOOGLESQL_ARRAY.match(spanner_type):
        return {"code": "ARRAY", "array_element_type": column_type(array.group(1), dialect)}
    if named := _GOOGLESQL_NAMED.match(spanner_type):
        return {"code": named.group(1), "proto_type_fqn": named.group(2)}
    return {"code": re.sub(r"\(.*\)$", "", spanner_type)}


def read_watched_columns(
    database: Database, stream: str, dialect: Dialect, read_timestamp: Nanos
) -> WatchedColumns:
    """The stream's watched tables and columns as of exactly ``read_timestamp`` (a stale read:
    it must lie within the database's version retention, one hour by default)."""
    validate_stream_name(stream)
    with database.snapshot(read_timestamp=to_datetime(read_timestamp), multi_use=True) as snap:

        def rows(sql: str) -> list[dict[str, Any]]:
            result = snap.execute_sql(sql)
            found = list(result)
            names = [f.name.lower() for f in result.fields]
            return [dict(zip(names, row, strict=True)) for row in found]

        streams = rows(
            f"SELECT * FROM information_schema.change_streams WHERE change_stream_name = '{stream}'"
        )
        if not streams:
            return {}
        columns = rows(
            "SELECT table_schema, table_name, column_name, ordinal_position, spanner_type "
            "FROM information_schema.columns WHERE is_generated = 'NEVER'"
        )
        keys = rows(
            "SELECT table_schema, table_name, column_name FROM information_schema.index_columns "
            "WHERE index_type = 'PRIMARY_KEY'"
        )
        tables: dict[tuple[str, str], set[str] | None]
        if _yes(streams[0]["all"]):
            tables = {
                (r["table_schema"], r["table_name"]): None
                for r in rows(
                    "SELECT table_schema, table_name FROM information_schema.tables "
                    "WHERE table_type = 'BASE TABLE'"
                )
                if r["table_schema"] not in _SYSTEM_SCHEMAS
            }
        else:
            tables = _watched_tables(rows, stream)
    key_names = {(k["table_schema"], k["table_name"], k["column_name"]) for k in keys}
    watched: WatchedColumns = {}
    for (schema, table), chosen in sorted(tables.items(), key=lambda t: (t[0][0] or "", t[0][1])):
        listed = [
            ColumnType(
                c["column_name"],
                column_type(c["spanner_type"], dialect),
                (schema, table, c["column_name"]) in key_names,
                int(c["ordinal_position"]),
            )
            for c in columns
            if (c["table_schema"], c["table_name"]) == (schema, table)
            and not str(c["spanner_type"]).startswith(_HIDDEN_TYPES)
        ]
        kept = [c for c in listed if chosen is None or c.is_primary_key or c.name in chosen]
        watched[_record_table_name(schema, table)] = tuple(
            sorted(kept, key=lambda c: c.ordinal_position)
        )
    return watched


_SYSTEM_SCHEMAS = (
    "INFORMATION_SCHEMA",
    "SPANNER_SYS",
    "information_schema",
    "pg_catalog",
    "spanner_sys",
)
_DEFAULT_SCHEMAS = ("", "public", None)


def _watched_tables(rows: Any, stream: str) -> dict[tuple[str, str], set[str] | None]:
    """(schema, table) → watched non-key columns, None for all of them."""
    tables: dict[tuple[str, str], set[str] | None] = {
        (r["table_schema"], r["table_name"]): None if _yes(r["all_columns"]) else set()
        for r in rows(
            "SELECT table_schema, table_name, all_columns FROM "
            f"information_schema.change_stream_tables WHERE change_stream_name = '{stream}'"
        )
    }
    for r in rows(
        "SELECT table_schema, table_name, column_name FROM "
        f"information_schema.change_stream_columns WHERE change_stream_name = '{stream}'"
    ):
        chosen = tables.get((r["table_schema"], r["table_name"]))
        if chosen is not None:
            chosen.add(r["column_name"])
    return tables


def read_column_defaults(database: Database, read_timestamp: Nanos) -> set[tuple[str, str]]:
    """(table, column) of each column with a DEFAULT at exactly ``read_timestamp``, tables named
    as records name them: Spanner fills such a column's rows when it is added."""
    with database.snapshot(read_timestamp=to_datetime(read_timestamp)) as snap:
        rows = snap.execute_sql(
            "SELECT table_schema, table_name, column_name FROM information_schema.columns "
            "WHERE column_default IS NOT NULL"
        )
        return {(_record_table_name(schema, table), column) for schema, table, column in rows}


def _yes(flag: Any) -> bool:
    """GoogleSQL answers BOOL, PostgreSQL 'YES'/'NO'."""
    return flag is True or flag == "YES"


def _record_table_name(schema: str | None, table: str) -> str:
    """A table of a named schema is ``schema.table`` in data change records."""
    return table if schema in _DEFAULT_SCHEMAS else f"{schema}.{table}"
