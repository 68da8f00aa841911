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
from dataclasses import dataclass
from typing import Any

from pyspark.sql import Row
from pyspark.sql import types as T
from pyspark.sql.streaming.stateful_processor import StatefulProcessor, StatefulProcessorHandle

from ingest.contract.changelog import (
    DELETES,
    SNAPSHOT_DELETE,
    SNAPSHOT_ROW,
    parse_column_types,
    position,
)
from ingest.model.records import ColumnType
from pipeline.columns import (
    FIRST_CHANGE,
    FIRST_CHANGE_TEXT,
    LAST_APPLIED_COLUMN,
    OPERATION,
    VALID_FROM,
    VALID_FROM_TEXT,
    VALID_TO,
    VALID_TO_TEXT,
)
from pipeline.shapes import TableShape, lists_every_column
from pipeline.state.variables import (
    CHANGE_STATS,
    LAST_APPLIED,
    LEGACY_BOOKKEEPING,
    TOMBSTONE,
    entry_struct,
    entry_variable,
    row_variable,
)
from pipeline.values import mirror_value, spark_value, state_from_seed, state_value
from pipeline.worker_output import install

install()  # in a Python worker: unpickling the processor imports this before any output

BATCH_ID_PROPERTY = "streaming.sql.batchId"
"""Spark's local property naming the micro-batch a task runs (its Python workers see it too).
Internal to Spark: where it is missing, no batch is taken for the first."""
SOURCE_SCHEMA_CHANGED = "SOURCE_SCHEMA_CHANGED"
STATE_ROUNDTRIP_MISMATCH = "STATE_ROUNDTRIP_MISMATCH"
ROW_NOT_APPLICABLE = "ROW_NOT_APPLICABLE"
_LOCAL_TIMESTAMP = T.TimestampType()
"""Layout 2 kept TIMESTAMP as Spark's timestamp, which PySpark hands back naive in local time;
its ``toInternal`` turns that back into the epoch microseconds layout 4 keeps."""
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


def history_variable(table: str) -> str:
    """The output column of a history table's versions."""
    return f"history_{table}"


def versions_struct(shape: TableShape) -> T.ArrayType:
    """The versions one batch made of a key, oldest first: the row as it was from each commit
    until the next one changed it (``valid_to`` NULL for the version still current)."""
    return T.ArrayType(
        T.StructType(
            [
                T.StructField(VALID_FROM_TEXT, T.StringType()),
                T.StructField(VALID_FROM, T.TimestampType()),
                T.StructField(VALID_TO_TEXT, T.StringType()),
                T.StructField(VALID_TO, T.TimestampType()),
                T.StructField("image", shape.struct()),
            ]
        )
    )


def output_schema(
    shapes: Mapping[str, TableShape], history: frozenset[str] = frozenset()
) -> T.StructType:
    """One row per changed key: its keys as the change log spells them, the operation, the image
    (one struct per table) and the position of the key's last applied change, which the mirror
    keeps beside the row so a rebase can seed state from it exactly. For a table with a history:
    the versions the batch made and when the key's first change of the batch was (it closes the
    version current before it)."""
    fields = [
        T.StructField("table_name", T.StringType()),
        T.StructField("keys", T.StringType()),
        T.StructField(OPERATION, T.StringType()),
        T.StructField("commit_timestamp_text", T.StringType()),
    ]
    fields += [T.StructField(row_variable(n), s.struct()) for n, s in sorted(shapes.items())]
    fields.append(T.StructField(LAST_APPLIED_COLUMN, LAST_APPLIED))
    if history:
        fields += [
            T.StructField(history_variable(n), versions_struct(s))
            for n, s in sorted(shapes.items())
            if n in history
        ]
        fields += [
            T.StructField(FIRST_CHANGE_TEXT, T.StringType()),
            T.StructField(FIRST_CHANGE, T.TimestampType()),
        ]
    return T.StructType(fields)


@dataclass(slots=True)
class _Entry:
    """What state holds for one key before a batch's rows apply."""

    image: dict[str, Any] | None
    last: tuple | None
    stats: dict[str, Any]
    found_in: str
    """"entry", "legacy" (layout 2's variables), "tombstone" or "" (a key never seen)."""


class ChangeApplier(StatefulProcessor):
    def __init__(
        self,
        shapes: Mapping[str, TableShape],
        deleted_variables: tuple[str, ...] = (),
        added_fields: Mapping[str, tuple[str, ...]] | None = None,
        tombstone_ttl_ms: int = 86_400_000,
        legacy: Mapping[str, T.StructType] | None = None,
        history: frozenset[str] = frozenset(),
        seeded: bool = True,
    ) -> None:
        self.shapes = dict(shapes)
        self.seeded = seeded
        self.deleted_variables = deleted_variables
        self.added_fields = dict(added_fields or {})
        self.tombstone_ttl_ms = tombstone_ttl_ms
        self.legacy = dict(legacy or {})
        self.history = history & set(shapes)
        self.output_fields = output_schema(shapes, self.history).fieldNames()

    def init(self, handle: StatefulProcessorHandle) -> None:
        for name in self.deleted_variables:
            handle.deleteIfExists(name)
        self.structs = {table: shape.state_struct() for table, shape in self.shapes.items()}
        self.image_fields = {table: struct.fieldNames() for table, struct in self.structs.items()}
        self.entries = {
            table: handle.getValueState(entry_variable(table), entry_struct(shape))
            for table, shape in self.shapes.items()
        }
        self.tombstone = handle.getValueState("tombstone", TOMBSTONE, self.tombstone_ttl_ms)
        self.legacy_states = {
            name: handle.getValueState(name, struct) for name, struct in self.legacy.items()
        }
        self.fixed_fields = {
            table: shape.fixed_state_fields() for table, shape in self.shapes.items()
        }
        self.state_empty = state_starts_empty(self.seeded)
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
        entry = self._read_entry(table)
        versions: list[tuple[Row, dict[str, Any] | None]] | None = (
            [] if table in self.history else None
        )
        image, stats, applied = self._apply_rows(shape, keys_json, rows, entry, versions)
        if applied is None:
            return
        marker = (
            applied["commit_timestamp_text"],
            applied["server_transaction_id"],
            applied["record_sequence"],
            applied["mod_index"],
        )
        if image is None:
            if entry.found_in == "entry":
                self.entries[table].clear()
            self.tombstone.update(marker)
            output = self._key_image(shape, keys_json)
            operation = "DELETE"
        else:
            output = self._store_image(shape, keys_json, entry, image, stats, applied, marker)
            operation = "UPSERT"
        if entry.found_in == "legacy":
            for name in (row_variable(table), *LEGACY_BOOKKEEPING):
                self.legacy_states[name].clear()
        values = {
            "table_name": table,
            "keys": keys_json,
            OPERATION: operation,
            "commit_timestamp_text": marker[0],
            row_variable(table): tuple(output.get(c.name) for c in shape.columns),
            LAST_APPLIED_COLUMN: marker,
        }
        if versions:
            values[history_variable(table)] = self._versions(shape, versions)
            values[FIRST_CHANGE_TEXT] = versions[0][0]["commit_timestamp_text"]
            values[FIRST_CHANGE] = versions[0][0]["commit_timestamp"]
        yield Row(*self.output_fields)(*(values.get(name) for name in self.output_fields))

    def _versions(
        self, shape: TableShape, versions: list[tuple[Row, dict[str, Any] | None]]
    ) -> list[tuple[Any, ...]]:
        """The live versions among a key's changes, each valid until the next change."""
        made = []
        for i, (row, image) in enumerate(versions):
            if image is None:
                continue
            after = versions[i + 1][0] if i + 1 < len(versions) else None
            made.append(
                (
                    row["commit_timestamp_text"],
                    row["commit_timestamp"],
                    None if after is None else after["commit_timestamp_text"],
                    None if after is None else after["commit_timestamp"],
                    tuple(mirror_row(shape, image).values()),
                )
            )
        return made

    def _apply_rows(
        self,
        shape: TableShape,
        keys_json: str,
        rows: Iterator[Row],
        entry: _Entry,
        versions: list[tuple[Row, dict[str, Any] | None]] | None = None,
    ) -> tuple[dict[str, Any] | None, Any, Row | None]:
        """The key's rows in change-log order onto its entry, skipping what it already applied:
        the new image (None: deleted), change statistics, and the last row applied. With
        ``versions``, each commit that changed the row is added to it with the image it left:
        one per commit, and none for a change that left the row as it was (an on-demand
        snapshot's image of an unchanged row)."""
        image, last, stats = entry.image, entry.last, entry.stats
        applied = None
        for row in sorted(rows, key=position):
            if last is not None and position(row) <= last:
                continue
            columns = self._columns(row["column_types"])
            if not self._covers(shape, row, columns):
                raise SourceSchemaChanged(
                    f"{SOURCE_SCHEMA_CHANGED}: table {shape.name!r} has new or retyped columns"
                )
            deleted = row["mod_type"] in DELETES
            try:
                image = None if deleted else self._apply(shape, image, columns, row)
            except _ValueError as error:
                raise RowNotApplicable(shape.name, keys_json, row, error.reason) from error
            stats = _count(stats, row)
            if versions is not None:
                _add_version(versions, row, image, entry.image)
            last, applied = position(row), row
        return image, stats, applied

    def _store_image(
        self,
        shape: TableShape,
        keys_json: str,
        entry: _Entry,
        image: dict[str, Any],
        stats: Any,
        applied: Row,
        marker: tuple[Any, ...],
    ) -> dict[str, Any]:
        """Write the key's entry (clearing a tombstone it came back from); the mirror row."""
        table = shape.name
        written = (
            tuple(image.get(name) for name in self.image_fields[table]),
            marker,
            tuple(stats[f] for f in CHANGE_STATS.fieldNames()),
        )
        try:
            self.entries[table].update(written)
        except Exception as error:
            reason = f"state refused the row image: {_cause(error)}"
            raise RowNotApplicable(table, keys_json, applied, reason) from error
        if entry.found_in == "tombstone":
            self.tombstone.clear()
        self._check_round_trip(table, image)
        return mirror_row(shape, image)

    def handleInitialState(self, key: Any, initialState: Row, timerValues: Any) -> None:
        """A rebased generation's first batch: one mirror row becomes the key's entry
        (``pipeline.state.seed``)."""
        table, _ = key
        shape = self.shapes[table]
        mirrored = _fields(initialState[row_variable(table)])
        image: dict[str, Any] = {}
        for column in shape.columns:
            field = shape.current_field(column)
            if field is not None:
                image[field] = state_from_seed(column.type, mirrored.get(column.name))
        position = _fields(initialState[LAST_APPLIED_COLUMN])
        marker = tuple(position[name] for name in LAST_APPLIED.fieldNames())
        blank = tuple(None for _ in CHANGE_STATS.fieldNames())
        self.entries[table].update(
            (tuple(image.get(name) for name in self.image_fields[table]), marker, blank)
        )

    def close(self) -> None:
        pass

    def _read_entry(self, table: str) -> _Entry:
        """The key's entry: one state-server call for a key seen before, then layout 2's
        variables for a key not moved yet, then the tombstone of a deleted key. None of them in
        the first batch of an unseeded state store, which holds nothing."""
        if self.state_empty:
            return _Entry(None, None, dict.fromkeys(CHANGE_STATS.fieldNames()), "")
        value = self.entries[table].get()
        if value is not None:
            image, marker, stats = value
            return _Entry(
                _as_dict(image, self.image_fields[table]),
                position(_as_dict(marker, LAST_APPLIED.fieldNames())),
                _as_dict(stats, CHANGE_STATS.fieldNames()),
                "entry",
            )
        legacy = self._read_legacy(table)
        if legacy is not None:
            return legacy
        marker = _read(self.tombstone, LAST_APPLIED)
        blank = dict.fromkeys(CHANGE_STATS.fieldNames())
        if marker is None:
            return _Entry(None, None, blank, "")
        return _Entry(None, position(marker), blank, "tombstone")

    def _read_legacy(self, table: str) -> _Entry | None:
        """A live key as layout 2 kept it (image, last_applied and change_stats variables)."""
        image_state = self.legacy_states.get(row_variable(table))
        if image_state is None:
            return None
        image = _read(image_state, self.legacy[row_variable(table)])
        if image is None:
            return None
        marker = _read(self.legacy_states["last_applied"], LAST_APPLIED)
        stats = _read(self.legacy_states["change_stats"], CHANGE_STATS)
        fields = set(self.image_fields[table])
        timestamps = {
            f.name
            for f in self.legacy[row_variable(table)].fields
            if isinstance(f.dataType, T.TimestampType)
        }
        return _Entry(
            {
                name: _LOCAL_TIMESTAMP.toInternal(value) if name in timestamps else value
                for name, value in image.items()
                if name in fields
            },
            None if marker is None else position(marker),
            stats or dict.fromkeys(CHANGE_STATS.fieldNames()),
            "legacy",
        )

    def _check_schema_rows(self, shape: TableShape | None, rows: Iterator[Row]) -> None:
        """Schema rows apply to no key; one showing a drop or an added column the shape lacks
        restarts the job, which learns it (renews or adds the mirror column), as does one of a
        table the query started without (added to the stream since: its mirror is made)."""
        for row in rows:
            if shape is None:
                raise SourceSchemaChanged(
                    f"{SOURCE_SCHEMA_CHANGED}: new table {row['table_name']!r}"
                )
            watched = {c.name for c in self._columns(row["column_types"])}
            if not shape.shows_no_new_drop(row["commit_timestamp_text"], watched):
                raise SourceSchemaChanged(
                    f"{SOURCE_SCHEMA_CHANGED}: table {shape.name!r} has dropped, unwatched or "
                    "added columns"
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

    def _check_round_trip(self, table: str, image: dict[str, Any]) -> None:
        """Image fields added by this deployment must read back as written.

        Guards the open-source bug where, after a failed first batch following an evolution,
        added fields are stored as None for a whole run (docs/design.md, facts).
        """
        variable = entry_variable(table)
        added = [p.removeprefix("image.") for p in self.added_fields.get(variable, ())]
        written = [f for f in added if image.get(f) is not None]
        if not written:
            return
        try:
            value = self.entries[table].get()
        except Exception as error:  # the same bug, met with nested fields: the read fails
            raise StateRoundTripMismatch(
                f"{STATE_ROUNDTRIP_MISMATCH}: {variable} could not be read back: {_cause(error)}"
            ) from error
        stored = _as_dict(value[0] if value else None, self.image_fields[table])
        lost = [f for f in written if stored.get(f) is None]
        if lost:
            raise StateRoundTripMismatch(
                f"{STATE_ROUNDTRIP_MISMATCH}: {variable} fields {lost} read back None"
            )


def state_starts_empty(seeded: bool) -> bool:
    """Whether this task runs batch 0 of a state store without a seed: Spark loads its version 0,
    empty, so reading a key can only find nothing (two state-server calls a new key saves)."""
    if seeded:
        return False
    from pyspark import TaskContext

    context = TaskContext.get()
    return context is not None and context.getLocalProperty(BATCH_ID_PROPERTY) == "0"


def _add_version(
    versions: list[tuple[Row, dict[str, Any] | None]],
    row: Row,
    image: dict[str, Any] | None,
    before_batch: dict[str, Any] | None,
) -> None:
    """Record the image ``row`` left, replacing one of the same commit."""
    if versions and versions[-1][0]["commit_timestamp_text"] == row["commit_timestamp_text"]:
        versions.pop()
    previous = versions[-1][1] if versions else before_batch
    if not same_image(image, previous):
        versions.append((row, None if image is None else dict(image)))


def same_image(first: dict[str, Any] | None, second: dict[str, Any] | None) -> bool:
    """Whether two state images hold the same row: value by value, NaN equal to itself (a
    FLOAT64 NaN written again changes nothing)."""
    if first is None or second is None:
        return first is second
    names = first.keys() | second.keys()
    return all(_same_value(first.get(name), second.get(name)) for name in names)


def _same_value(first: Any, second: Any) -> bool:
    if isinstance(first, float) and isinstance(second, float):
        return first == second or (first != first and second != second)
    return bool(first == second)


def mirror_row(shape: TableShape, image: dict[str, Any]) -> dict[str, Any]:
    """A state image as the mirror's (and a history version's) columns: each column's newest
    generation, NULL once dropped."""
    return {
        c.name: None if field is None else mirror_value(c.type, image.get(field))
        for c in shape.columns
        for field in [shape.current_field(c)]
    }


class _ValueError(Exception):
    """A mod value that cannot be read with its column type; the reason holds no value."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _cause(error: BaseException) -> str:
    """A state call's error as a reason's one line: its text's last line, cut at 300."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return (lines[-1] if lines else type(error).__name__)[:300]


def _as_dict(value: Any, names: list[str]) -> dict[str, Any]:
    return {} if value is None else dict(zip(names, value, strict=True))


def _read(state: Any, schema: T.StructType) -> dict[str, Any] | None:
    """A value state as a dict by field name (the Row API hands back a tuple), or None.

    One call to the state server (``get`` is None when unset), not two: each is a round trip.
    """
    value = state.get()
    return None if value is None else _as_dict(value, schema.fieldNames())


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


def _fields(value: Any) -> dict[str, Any]:
    """A struct of the initial state by field name (PySpark hands nested structs over as Rows
    or as dicts)."""
    return value.asDict() if isinstance(value, Row) else dict(value)
