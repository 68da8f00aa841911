"""The stateful processor: per (table, primary key), apply change-log rows to the current row image.

Schema rows (key "") apply to no row: they only show whether the table's shape is still current.

Rows of one key are applied in change-log order; any row at or before the last applied position
(a replayed change-log version, an older change) is ignored, including after a delete, whose
position stays in a tombstone with a TTL. One output row per key and micro-batch carries the
final image (UPSERT) or the key alone (DELETE) for the mirror MERGE.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Iterator, Mapping
from typing import Any

from pyspark.sql import Row
from pyspark.sql import types as T
from pyspark.sql.streaming.stateful_processor import StatefulProcessor, StatefulProcessorHandle

from ingest.delta.changelog import DELETES, SNAPSHOT_DELETE, SNAPSHOT_ROW
from ingest.model.records import ColumnType, sequence_key
from pipeline.state.variables import CHANGE_STATS, LAST_APPLIED, TOMBSTONE, row_variable
from pipeline.types import (
    TableShape,
    lists_every_column,
    mirror_value,
    parse_column_types,
    spark_value,
    state_value,
)

SOURCE_SCHEMA_CHANGED = "SOURCE_SCHEMA_CHANGED"
STATE_ROUNDTRIP_MISMATCH = "STATE_ROUNDTRIP_MISMATCH"
ROW_NOT_APPLICABLE = "ROW_NOT_APPLICABLE"
OPERATION = "_cdc_operation"
INPUT_COLUMNS = [
    "table_name",
    "keys",
    "commit_timestamp",
    "commit_timestamp_text",
    "server_transaction_id",
    "record_sequence",
    "mod_index",
    "mod_type",
    "new_values",
    "column_types",
    "value_capture_type",
]


class SourceSchemaChanged(RuntimeError):
    """A change-log row has a table or column the running state schema lacks: evolve, restart."""


class StateRoundTripMismatch(RuntimeError):
    """A state value read back differs from what was written (the open-source evolution bug)."""


class RowNotApplicable(RuntimeError):
    """A change-log row this version cannot apply: retrying cannot help, so the job stops.

    The message names the table, a digest of the key, the row's position and the reason, never
    a value (it reaches the logs).
    """

    def __init__(self, table: str, keys_json: str, row: Any, reason: str) -> None:
        digest = hashlib.sha256(keys_json.encode()).hexdigest()[:16]
        super().__init__(
            f"{ROW_NOT_APPLICABLE}: table {table!r}, key sha256:{digest}, commit "
            f"{row['commit_timestamp_text']}, transaction {row['server_transaction_id']}, "
            f"record {row['record_sequence']} mod {row['mod_index']}: {reason}"
        )


def output_schema(shapes: Mapping[str, TableShape]) -> T.StructType:
    fields = [
        T.StructField("table_name", T.StringType()),
        T.StructField("keys", T.StringType()),
        T.StructField(OPERATION, T.StringType()),
        T.StructField("commit_timestamp_text", T.StringType()),
    ]
    fields += [T.StructField(row_variable(n), s.struct()) for n, s in sorted(shapes.items())]
    return T.StructType(fields)


def position(row: Any) -> tuple[str, str, tuple[int, str], int]:
    """The change log's total order (docs/design.md, contract 1), comparable across rows and
    state."""
    return (
        row["commit_timestamp_text"],
        row["server_transaction_id"],
        sequence_key(row["record_sequence"]),
        row["mod_index"],
    )


class ChangeApplier(StatefulProcessor):
    def __init__(
        self,
        shapes: Mapping[str, TableShape],
        deleted_variables: tuple[str, ...] = (),
        added_fields: Mapping[str, tuple[str, ...]] | None = None,
        tombstone_ttl_ms: int = 86_400_000,
    ) -> None:
        self.shapes = dict(shapes)
        self.deleted_variables = deleted_variables
        self.added_fields = dict(added_fields or {})
        self.tombstone_ttl_ms = tombstone_ttl_ms
        self.output_fields = output_schema(shapes).fieldNames()

    def init(self, handle: StatefulProcessorHandle) -> None:
        for name in self.deleted_variables:
            handle.deleteIfExists(name)
        self.structs = {table: shape.state_struct() for table, shape in self.shapes.items()}
        self.images = {
            table: handle.getValueState(row_variable(table), struct)
            for table, struct in self.structs.items()
        }
        self.last_applied = handle.getValueState("last_applied", LAST_APPLIED)
        self.change_stats = handle.getValueState("change_stats", CHANGE_STATS)
        self.tombstone = handle.getValueState("tombstone", TOMBSTONE, self.tombstone_ttl_ms)
        self.fixed_fields = {
            table: shape.fixed_state_fields() for table, shape in self.shapes.items()
        }
        self.columns_cache: dict[str, list[ColumnType]] = {}
        self.covered: dict[tuple[str, str, bool, bool], bool] = {}

    def handleInputRows(self, key: Any, rows: Iterator[Row], timerValues: Any) -> Iterator[Row]:
        table, keys_json = key
        shape = self.shapes.get(table)
        if keys_json == "":
            self._check_schema_rows(shape, rows)
            return
        if shape is None:
            raise SourceSchemaChanged(f"{SOURCE_SCHEMA_CHANGED}: new table {table!r}")
        image_state = self.images[table]
        struct = self.structs[table]
        image = _read(image_state, struct)
        last, tombstoned = self._last_position()
        stats = _read(self.change_stats, CHANGE_STATS) or dict.fromkeys(CHANGE_STATS.fieldNames())
        applied = None
        for row in sorted(rows, key=position):
            if last is not None and position(row) <= last:
                continue
            columns = self._columns(row["column_types"])
            if not self._covers(shape, row, columns):
                raise SourceSchemaChanged(
                    f"{SOURCE_SCHEMA_CHANGED}: table {table!r} has new or retyped columns"
                )
            deleted = row["mod_type"] in DELETES
            try:
                image = None if deleted else self._apply(shape, image, columns, row)
            except _ValueError as error:
                raise RowNotApplicable(table, keys_json, row, error.reason) from error
            stats = _count(stats, row)
            last, applied = position(row), row
        if applied is None:
            return
        marker = (
            applied["commit_timestamp_text"],
            applied["server_transaction_id"],
            applied["record_sequence"],
            applied["mod_index"],
        )
        if image is None:
            image_state.clear()
            self.last_applied.clear()
            self.change_stats.clear()
            self.tombstone.update(marker)
            output = self._key_image(shape, keys_json)
            operation = "DELETE"
        else:
            written = tuple(image.get(name) for name in struct.fieldNames())
            try:
                image_state.update(written)
            except Exception as error:
                reason = f"state refused the row image: {_first_line(error)}"
                raise RowNotApplicable(table, keys_json, applied, reason) from error
            self.last_applied.update(marker)
            self.change_stats.update(tuple(stats[f] for f in CHANGE_STATS.fieldNames()))
            if tombstoned:
                self.tombstone.clear()
            self._check_round_trip(table, image_state, image)
            output = {
                c.name: None if field is None else mirror_value(c.type, image.get(field))
                for c in shape.columns
                for field in [shape.current_field(c)]
            }
            operation = "UPSERT"
        values = {
            "table_name": table,
            "keys": keys_json,
            OPERATION: operation,
            "commit_timestamp_text": marker[0],
            row_variable(table): tuple(output.get(c.name) for c in shape.columns),
        }
        yield Row(*self.output_fields)(*(values.get(name) for name in self.output_fields))

    def close(self) -> None:
        pass

    def _last_position(self) -> tuple[tuple | None, bool]:
        """The last applied position, and whether it is a tombstone's (a deleted row)."""
        for state in (self.last_applied, self.tombstone):
            marker = _read(state, LAST_APPLIED)
            if marker is not None:
                return position(marker), state is self.tombstone
        return None, False

    def _check_schema_rows(self, shape: TableShape | None, rows: Iterator[Row]) -> None:
        """Schema rows apply to no key; one showing a drop the shape lacks restarts the job,
        which learns it and renews the mirror column. A table no change record carried yet has
        no shape and nothing to drop."""
        for row in rows:
            watched = {c.name for c in self._columns(row["column_types"])}
            if shape is not None and not shape.shows_no_new_drop(
                row["commit_timestamp_text"], watched
            ):
                raise SourceSchemaChanged(
                    f"{SOURCE_SCHEMA_CHANGED}: table {shape.name!r} has dropped or unwatched "
                    "columns"
                )

    def _covers(self, shape: TableShape, row: Row, columns: list[ColumnType]) -> bool:
        history = row["commit_timestamp_text"] <= shape.learned_through
        every_column = lists_every_column(row["value_capture_type"], row["mod_type"])
        cached = (shape.name, row["column_types"], history, every_column)
        known = self.covered.get(cached)
        if known is None:
            when = row["commit_timestamp_text"]
            known = self.covered[cached] = shape.covers(when, columns, every_column)
        return known

    def _columns(self, column_types: str) -> list[ColumnType]:
        columns = self.columns_cache.get(column_types)
        if columns is None:
            columns = self.columns_cache[column_types] = parse_column_types(column_types)
        return columns

    def _apply(
        self,
        shape: TableShape,
        image: dict[str, Any] | None,
        columns: list[ColumnType],
        row: Row,
    ) -> dict[str, Any]:
        """Merge the mod's keys and new values into the image (NEW_VALUES sends changed ones),
        each read with the column types of its own change record, into its generation's field;
        fields of older generations and dropped columns are cleared, as Spanner holds no value
        for them."""
        types = {c.name: c for c in columns}
        fixed = self.fixed_fields[shape.name]
        updated = dict(image or {})
        when = row["commit_timestamp_text"]
        for text in (row["keys"], row["new_values"]):
            for name, value in json.loads(text).items():
                column = types.get(name)
                if column is None:
                    raise _ValueError(f"column {name!r} is not in the row's column_types")
                field = fixed.get(name)
                if field is None:
                    field = shape.state_field(shape.column(name) or column, when)
                try:
                    updated[field] = state_value(column.type, value)
                except (ValueError, TypeError, ArithmeticError, LookupError) as error:
                    # from None: the decoder's message holds the value, and tracebacks are logged
                    code = column.type.get("code")
                    raise _ValueError(f"column {name!r} ({code}): {type(error).__name__}") from None
        if shape.generations or shape.dropped:
            for stale in shape.stale_fields(when):
                updated[stale] = None
        return updated

    @staticmethod
    def _key_image(shape: TableShape, keys_json: str) -> dict[str, Any]:
        return {
            c.name: spark_value(c.type, value)
            for name, value in json.loads(keys_json).items()
            if (c := shape.column(name)) is not None
        }

    def _check_round_trip(self, table: str, state: Any, image: dict[str, Any]) -> None:
        """Fields added by this deployment must read back as written.

        Guards the open-source bug where, after a failed first batch following an evolution,
        added fields are stored as None for a whole run (docs/design.md, facts).
        """
        added = self.added_fields.get(row_variable(table))
        if not added:
            return
        stored = _read(state, self.structs[table]) or {}
        lost = [f for f in added if image.get(f) is not None and stored.get(f) is None]
        if lost:
            raise StateRoundTripMismatch(
                f"{STATE_ROUNDTRIP_MISMATCH}: {row_variable(table)} fields {lost} read back None"
            )


class _ValueError(Exception):
    """A mod value that cannot be read with its column type; the reason holds no value."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return (lines[-1] if lines else type(error).__name__)[:300]


def _read(state: Any, schema: T.StructType) -> dict[str, Any] | None:
    """A value state as a dict by field name (the Row API hands back a tuple), or None.

    One call to the state server (``get`` is None when unset), not two: each is a round trip.
    """
    value = state.get()
    return None if value is None else dict(zip(schema.fieldNames(), value, strict=True))


def _count(stats: dict[str, Any], row: Row) -> dict[str, Any]:
    stats = dict(stats)
    field = {
        "INSERT": "inserts",
        SNAPSHOT_ROW: "inserts",
        "UPDATE": "updates",
        "DELETE": "deletes",
        SNAPSHOT_DELETE: "deletes",
    }[row["mod_type"]]
    stats[field] = (stats[field] or 0) + 1
    when = row["commit_timestamp"]
    if isinstance(when, dt.datetime):
        stats["first_commit_timestamp"] = stats["first_commit_timestamp"] or when
        stats["last_commit_timestamp"] = when
    return stats
