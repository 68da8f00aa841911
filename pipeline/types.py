"""Spanner column types as Spark types (docs/design.md, contract 3), and mod values as Spark values.

A table's shape is learned from the change log's ``column_types``: the union of every column seen,
each with the type of its newest appearance, in ordinal order. That shape drives the state schema
of the table's row image and the columns of its mirror table.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from decimal import Context, Decimal
from typing import Any

from pyspark.sql import types as T

from ingest.contract.changelog import SCHEMA_ROW, parse_column_types
from ingest.model.encoding import canonical_json
from ingest.model.records import ColumnType
from ingest.model.timestamps import parse_rfc3339, to_rfc3339
from ingest.model.values import decode_value

NUMERIC = T.DecimalType(38, 9)
_NUMERIC_CONTEXT = Context(prec=38)
_NUMERIC_SCALE = Decimal("1e-9")
_SCALARS: dict[str, T.DataType] = {
    "INT64": T.LongType(),
    "FLOAT64": T.DoubleType(),
    "FLOAT32": T.FloatType(),
    "BOOL": T.BooleanType(),
    "STRING": T.StringType(),
    "BYTES": T.BinaryType(),
    "DATE": T.DateType(),
    "TIMESTAMP": T.TimestampType(),
    "NUMERIC": NUMERIC,
    "JSON": T.StringType(),
}


_TEXT_OR_BYTES = {"STRING", "BYTES"}


def _is_pg_numeric(spanner_type: dict[str, Any]) -> bool:
    """PostgreSQL NUMERIC: arbitrary precision and NaN, beyond DECIMAL(38, 9); kept as text."""
    return spanner_type.get("type_annotation") == "PG_NUMERIC"


def spark_type(spanner_type: dict[str, Any]) -> T.DataType:
    """The mirror's Spark type of a Spanner type; anything unmapped is carried as its JSON text."""
    code = spanner_type.get("code")
    if code == "ARRAY":
        return T.ArrayType(spark_type(spanner_type.get("array_element_type") or {}))
    if _is_pg_numeric(spanner_type):
        return T.StringType()
    return _SCALARS.get(code or "", T.StringType())


def state_type(spanner_type: dict[str, Any]) -> T.DataType:
    """How the row image keeps a column in state (state layout 2).

    STRING and BYTES are both kept as bytes (STRING as UTF-8, as Spanner converts them), so a
    STRING↔BYTES change never touches state and rows of either type apply to the same field.
    Arrays are kept as JSON text: Spark's Avro state encoding refuses NULL array elements, which
    Spanner allows in every array type.
    """
    code = spanner_type.get("code")
    if code == "ARRAY":
        return T.StringType()
    if code in _TEXT_OR_BYTES:
        return T.BinaryType()
    return spark_type(spanner_type)


def is_mapped(spanner_type: dict[str, Any]) -> bool:
    code = spanner_type.get("code")
    if code == "ARRAY":
        return is_mapped(spanner_type.get("array_element_type") or {})
    return code in _SCALARS and not _is_pg_numeric(spanner_type)


@dataclass(frozen=True, slots=True)
class Generation:
    """A column between a drop and a re-add under another state type.

    Spanner keeps no value across a drop, so each generation has a state field of its own: the
    column name, then ``<name>__g2``, ``<name>__g3``... A STRING↔BYTES change is not a new
    generation: Spanner converts the values and the state type is the same.
    """

    field: str
    state_type: T.DataType
    since: str
    """Commit timestamp (RFC 3339 text) of the generation's first row; "" for the first."""


def generation_field(column: str, number: int) -> str:
    return column if number == 1 else f"{column}__g{number}"


@dataclass(frozen=True, slots=True)
class TableShape:
    """A Spanner table as the change log describes it."""

    name: str
    columns: tuple[ColumnType, ...]
    learned_through: str = ""
    """The newest commit timestamp (RFC 3339 text) of the table's rows the shape was learned from:
    rows up to it are history, whatever their column types."""
    generations: tuple[tuple[str, tuple[Generation, ...]], ...] = ()
    """Columns that had more than one generation, oldest first."""
    dropped: tuple[tuple[str, str], ...] = ()
    """Columns dropped and not added again: (name, commit timestamp of the first row that showed
    the drop). Their mirror column stays, NULL in every row, as Spanner has no value for them."""

    @property
    def key_columns(self) -> tuple[ColumnType, ...]:
        return tuple(c for c in self.columns if c.is_primary_key)

    def column(self, name: str) -> ColumnType | None:
        return next((c for c in self.columns if c.name == name), None)

    def generations_of(self, column: ColumnType) -> tuple[Generation, ...]:
        for name, generations in self.generations:
            if name == column.name:
                return generations
        return (Generation(column.name, state_type(column.type), ""),)

    def fixed_state_fields(self) -> dict[str, str]:
        """The state field of each column with one generation: the same whatever a row's commit
        time, so the processor looks it up once, not once per value."""
        fields = {}
        for column in self.columns:
            generations = self.generations_of(column)
            if len(generations) == 1:
                fields[column.name] = generations[0].field
        return fields

    def dropped_since(self, name: str) -> str | None:
        return next((since for column, since in self.dropped if column == name), None)

    def mirror_generation(self, column: ColumnType) -> int:
        """Counts the column's generations and a drop not yet followed by a re-add: each new
        number renews (NULLs) the mirror column."""
        return len(self.generations_of(column)) + (self.dropped_since(column.name) is not None)

    def current_field(self, column: ColumnType) -> str | None:
        """The state field the mirror column shows; None for a dropped column."""
        if self.dropped_since(column.name) is not None:
            return None
        return self.generations_of(column)[-1].field

    def stale_fields(self, commit_timestamp_text: str) -> list[str]:
        """State fields holding values Spanner no longer had at that time: older generations
        and dropped columns. A row applied at that time clears them (the mirror rule, in state)."""
        stale: list[str] = []
        names = {name for name, _ in self.generations} | {name for name, _ in self.dropped}
        for column in self.columns:
            if column.name not in names:
                continue
            fields = [g.field for g in self.generations_of(column)]
            dropped = self.dropped_since(column.name)
            if dropped is not None and commit_timestamp_text >= dropped:
                stale += fields
            else:
                current = self.state_field(column, commit_timestamp_text)
                stale += [f for f in fields if f != current]
        return stale

    def struct(self) -> T.StructType:
        """The mirror table's columns."""
        return T.StructType([T.StructField(c.name, spark_type(c.type), True) for c in self.columns])

    def state_struct(self) -> T.StructType:
        """The row image's fields in state: one per column generation."""
        return T.StructType(
            [
                T.StructField(g.field, g.state_type, True)
                for c in self.columns
                for g in self.generations_of(c)
            ]
        )

    def state_field(self, column: ColumnType, commit_timestamp_text: str) -> str:
        """The state field a value of ``column`` committed at that time belongs to."""
        generations = self.generations_of(column)
        if len(generations) == 1:
            return generations[0].field
        return [g for g in generations if g.since <= commit_timestamp_text][-1].field

    def shows_no_new_drop(self, commit_timestamp_text: str, watched: set[str]) -> bool:
        """Whether a schema row listing ``watched`` columns leaves this shape as it is: it is
        history, or it lists every column the shape holds live."""
        if commit_timestamp_text <= self.learned_through:
            return True
        return all(c.name in watched for c in self.columns if self.dropped_since(c.name) is None)

    def covers(
        self, commit_timestamp_text: str, columns: list[ColumnType], every_column: bool = False
    ) -> bool:
        """Whether a change record applies under this shape without learning it again.

        A record the shape was learned from applies with its own column types (an older type is
        converted: STRING↔BYTES; an older generation has its own field); a newer record must have
        only known, live columns of the newest types, and, if it lists every column, all the live
        ones, or the shape (and the mirror) must follow it.
        """
        if commit_timestamp_text <= self.learned_through:
            return all(self.column(c.name) is not None for c in columns)
        known_and_live = all(
            (known := self.column(c.name)) is not None
            and self.dropped_since(c.name) is None
            and spark_type(known.type) == spark_type(c.type)
            for c in columns
        )
        if not known_and_live or not every_column:
            return known_and_live
        listed = {c.name for c in columns}
        return all(c.name in listed for c in self.columns if self.dropped_since(c.name) is None)


EVERY_COLUMN_CAPTURES = ("NEW_ROW", "NEW_ROW_AND_OLD_VALUES")


def lists_every_column(value_capture_type: str | None, mod_type: str | None) -> bool:
    """Whether a row's ``column_types`` lists every watched column of its table, so a column
    missing from it is no longer there (dropped, or no longer watched).

    Schema rows do; of change records, Spanner documents it for the NEW_ROW captures: UPDATE
    records of the other captures list the changed columns only, and DELETE is not documented
    (emulator/NOTES.md).
    """
    if mod_type == SCHEMA_ROW:
        return True
    return value_capture_type in EVERY_COLUMN_CAPTURES and mod_type != "DELETE"


@dataclass(frozen=True, slots=True)
class Interval:
    """Rows of one table with one ``column_types`` text, from the first to the last commit."""

    table: str
    column_types: str
    first: str
    last: str
    every_column: bool = False
    """The rows list every watched column (``lists_every_column``)."""
    schema: bool = False
    """Schema rows: they show which columns exist, never a column's type or a new column (the
    shape learns those from change records, whose values need them)."""


Label = T.DataType | None
"""A column's state type in a run of rows, or None where rows listing every column lack it."""
Source = tuple[str, bool, bool]
"""Rows with one (``column_types`` text, every_column, schema) in an interval."""
Resolver = Callable[[str, str, dict[Source, Label]], list[tuple[str, Label]]]
"""(table, column, its label by source) → the column's exact runs."""


@dataclass(frozen=True, slots=True)
class _Span:
    first: str
    last: str
    label: Label
    source: Source


def merge_shapes(
    observed: Iterable[Interval], resolve: Resolver | None = None
) -> dict[str, TableShape]:
    """Table shapes from the change log's intervals, in any order.

    A column keeps the type of its newest appearance (STRING↔BYTES changes) and its position;
    columns dropped from Spanner stay, since older rows still hold them. A column gets a new
    generation when its state type changes or when it comes back after rows listing every column
    showed it gone; it is dropped when such rows show it gone after its last appearance. Schema
    rows only show columns gone: columns and their types come from change records. When
    intervals of different labels overlap in time (a column list came back), ``resolve`` finds
    the exact change points from the rows.
    """
    seen = _Seen.of(observed)
    generations: dict[str, list[tuple[str, tuple[Generation, ...]]]] = {}
    dropped: dict[str, list[tuple[str, str]]] = {}
    for (table, name), carried in sorted(seen.spans.items()):
        absent = [
            _Span(i.first, i.last, None, (i.column_types, True, i.schema))
            for i, names in seen.complete.get(table, [])
            if name not in names
        ]
        runs = _runs(carried + absent)
        if runs is None:
            labels = {span.source: span.label for span in carried + absent}
            runs = (resolve or _unresolvable)(table, name, labels)
        lives = _lives(runs)
        if len(lives) > 1:
            generations.setdefault(table, []).append(
                (
                    name,
                    tuple(
                        Generation(generation_field(name, n), kind, "" if n == 1 else since)
                        for n, (since, kind) in enumerate(lives, 1)
                    ),
                )
            )
        if runs[-1][1] is None:
            dropped.setdefault(table, []).append((name, runs[-1][0]))
    return {
        table: TableShape(
            table,
            tuple(sorted(cols.values(), key=lambda c: c.ordinal_position)),
            seen.through[table],
            tuple(generations.get(table, ())),
            tuple(dropped.get(table, ())),
        )
        for table, cols in sorted(seen.columns.items())
    }


@dataclass(slots=True)
class _Seen:
    """What the change log's intervals show, table by table: each column's newest type and
    when it was carried, when rows listing every column were written, how far each table was
    read."""

    columns: dict[str, dict[str, ColumnType]] = field(default_factory=dict)
    through: dict[str, str] = field(default_factory=dict)
    spans: dict[tuple[str, str], list[_Span]] = field(default_factory=dict)
    complete: dict[str, list[tuple[Interval, frozenset[str]]]] = field(default_factory=dict)

    @classmethod
    def of(cls, observed: Iterable[Interval]) -> _Seen:
        seen = cls()
        for interval in sorted(observed, key=lambda interval: interval.last):
            table = interval.table
            seen.through[table] = max(seen.through.get(table, ""), interval.last)
            listed = parse_column_types(interval.column_types)
            source = (interval.column_types, interval.every_column, interval.schema)
            if not interval.schema:
                known = seen.columns.setdefault(table, {})
                for column in listed:
                    known[column.name] = column
                    seen.spans.setdefault((table, column.name), []).append(
                        _Span(interval.first, interval.last, state_type(column.type), source)
                    )
            if interval.every_column:
                names = frozenset(c.name for c in listed)
                seen.complete.setdefault(table, []).append((interval, names))
        return seen


def _runs(spans: list[_Span]) -> list[tuple[str, Label]] | None:
    """(since, label) runs of one column, or None when different labels overlap in time."""
    runs: list[tuple[str, Label]] = []
    run_end = ""
    for span in sorted(spans, key=lambda s: (s.first, s.last)):
        if runs and runs[-1][1] == span.label:
            run_end = max(run_end, span.last)
            continue
        if runs and span.first <= run_end:
            return None
        runs.append((span.first, span.label))
        run_end = span.last
    return runs


def _lives(runs: list[tuple[str, Label]]) -> list[tuple[str, T.DataType]]:
    """The column's generations: a new one at each change of state type and after each gap."""
    lives: list[tuple[str, T.DataType]] = []
    previous: Label = None
    for since, label in runs:
        if label is not None and label != previous:
            lives.append((since, label))
        previous = label
    return lives


def _unresolvable(table: str, column: str, labels: dict[Source, Label]) -> list[tuple[str, Label]]:
    raise ValueError(f"{table}.{column} changed under one column list; rows are needed")


def spark_value(spanner_type: dict[str, Any], value: Any) -> Any:
    """A mod value (JSON as Spanner sent it) as the Python value Spark stores for its type."""
    if value is None:
        return None
    code = spanner_type.get("code")
    if code == "ARRAY":
        element = spanner_type.get("array_element_type") or {}
        decoded = decode_value(spanner_type, value)
        return [None if v is None else _scalar(element, v, raw=False) for v in decoded]
    if not is_mapped(spanner_type):
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return _scalar(spanner_type, value, raw=True)


def state_value(spanner_type: dict[str, Any], value: Any) -> Any:
    """A mod value, read with the column type of its own change record, as state keeps it."""
    if value is None:
        return None
    code = spanner_type.get("code")
    if code == "ARRAY":
        element = spanner_type.get("array_element_type") or {}
        decoded = decode_value(spanner_type, value)
        return canonical_json(
            [
                None if d is None else _element_state(element, raw, d)
                for raw, d in zip(value, decoded, strict=True)
            ]
        )
    if code == "STRING":
        return value.encode()
    return spark_value(spanner_type, value)


def _element_state(element_type: dict[str, Any], raw: Any, decoded: Any) -> Any:
    """Array elements stay as Spanner sent them, but text and bytes both as base64 bytes."""
    if element_type.get("code") == "STRING":
        return base64.b64encode(decoded.encode()).decode()
    return raw


def mirror_value(spanner_type: dict[str, Any], stored: Any) -> Any:
    """A state value as the mirror column of the table's newest ``spanner_type`` holds it."""
    if stored is None:
        return None
    code = spanner_type.get("code")
    if code == "ARRAY":
        element = spanner_type.get("array_element_type") or {}
        items = json.loads(stored)
        return [None if item is None else _element_mirror(element, item) for item in items]
    if code == "STRING":
        return bytes(stored).decode()
    if code == "BYTES":
        return bytes(stored)
    return stored


def _element_mirror(element_type: dict[str, Any], item: Any) -> Any:
    code = element_type.get("code")
    if code == "STRING":
        return base64.b64decode(item).decode()
    if code == "BYTES":
        return base64.b64decode(item)
    if not is_mapped(element_type):
        return item if isinstance(item, str) else json.dumps(item, sort_keys=True)
    return _scalar(element_type, item, raw=True)


def state_from_seed(spanner_type: dict[str, Any], value: Any) -> Any:
    """A mirror value as state keeps it: a rebase seeds state from the mirrors. The seed
    carries timestamps as epoch microseconds (Spark's ``unix_micros``, exact at any year and
    in any time zone); ``mirror_value`` of the result is the mirror's value again."""
    if value is None:
        return None
    code = spanner_type.get("code")
    if code == "ARRAY":
        element = spanner_type.get("array_element_type") or {}
        return canonical_json([None if v is None else _element_wire(element, v) for v in value])
    if code == "STRING":
        return str(value).encode()
    if code == "BYTES":
        return bytes(value)
    if code == "TIMESTAMP":
        return _EPOCH + dt.timedelta(microseconds=value)
    return value


def _element_wire(element_type: dict[str, Any], item: Any) -> Any:
    """An array element of the seed as state keeps it: as Spanner sends it, but text and
    bytes both as base64."""
    code = element_type.get("code")
    if code == "STRING":
        return base64.b64encode(str(item).encode()).decode()
    if code == "BYTES":
        return base64.b64encode(bytes(item)).decode()
    if not is_mapped(element_type):
        return item
    if code in ("INT64", "ENUM", "NUMERIC"):
        return str(item)
    if code == "DATE":
        return item.isoformat()
    if code == "TIMESTAMP":
        return to_rfc3339(item * 1000)
    return item


def is_timestamp(spanner_type: dict[str, Any]) -> bool:
    """A TIMESTAMP, or an array of them: what the seed carries as epoch microseconds."""
    if spanner_type.get("code") == "ARRAY":
        return is_timestamp(spanner_type.get("array_element_type") or {})
    return spanner_type.get("code") == "TIMESTAMP"


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def _scalar(spanner_type: dict[str, Any], value: Any, raw: bool) -> Any:
    code = spanner_type.get("code")
    if code == "TIMESTAMP":
        nanos = parse_rfc3339(value) if raw else value
        return dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(microseconds=nanos // 1000)
    if code == "JSON":
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    if code == "NUMERIC":
        return numeric(value)
    if code == "BYTES" and not raw:
        return value
    return decode_value(spanner_type, value) if raw else value


def numeric(value: Any) -> Decimal:
    """A NUMERIC as Spark's DECIMAL(38, 9); needs 38 digits, past the default context's 28."""
    return _NUMERIC_CONTEXT.quantize(Decimal(str(value)), _NUMERIC_SCALE)
