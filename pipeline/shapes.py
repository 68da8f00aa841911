"""Table shapes: a table as the change log describes it (docs/design.md, contract 3).

A table's shape is learned from the change log's ``column_types``: the union of every column seen,
each with the type of its newest appearance, in ordinal order, with the generations of a column
whose state type changed and the columns dropped. That shape drives the state schema of the
table's row image and the columns of its mirror table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pyspark.sql import types as T

from ingest.contract.changelog import SCHEMA_ROW, parse_column_types
from ingest.model.records import ColumnType
from pipeline.types import generation_label, labelled_state_type, spark_type, state_type


@dataclass(frozen=True, slots=True)
class ColumnGeneration:
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
    generations: tuple[tuple[str, tuple[ColumnGeneration, ...]], ...] = ()
    """Columns that had more than one generation, oldest first."""
    dropped: tuple[tuple[str, str], ...] = ()
    """Columns dropped and not added again: (name, commit timestamp of the first row that showed
    the drop). Their mirror column stays, NULL in every row, as Spanner has no value for them."""

    @property
    def key_columns(self) -> tuple[ColumnType, ...]:
        return tuple(c for c in self.columns if c.is_primary_key)

    def column(self, name: str) -> ColumnType | None:
        return next((c for c in self.columns if c.name == name), None)

    def generations_of(self, column: ColumnType) -> tuple[ColumnGeneration, ...]:
        for name, generations in self.generations:
            if name == column.name:
                return generations
        return (ColumnGeneration(column.name, state_type(column.type), ""),)

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
        history, or it lists every column the shape holds live and no column the shape lacks
        (one added since: learned from the schema rows, ``_Seen.add_uncarried_columns``)."""
        if commit_timestamp_text <= self.learned_through:
            return True
        live = {c.name for c in self.columns if self.dropped_since(c.name) is None}
        return live <= watched and watched <= {c.name for c in self.columns}

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
    """Schema rows: they show which columns exist; a column's type comes from change records
    (whose values need it), but a column no record carried yet comes from schema rows."""


Label = T.DataType | None
"""A column's ``generation_label`` in a run of rows, or None where rows listing every column
lack it."""
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
    generations: dict[str, list[tuple[str, tuple[ColumnGeneration, ...]]]] = {}
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
                        ColumnGeneration(
                            generation_field(name, n),
                            labelled_state_type(label),
                            "" if n == 1 else since,
                        )
                        for n, (since, label) in enumerate(lives, 1)
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
        intervals = sorted(observed, key=lambda interval: interval.last)
        for interval in intervals:
            table = interval.table
            seen.through[table] = max(seen.through.get(table, ""), interval.last)
            listed = parse_column_types(interval.column_types)
            source = (interval.column_types, interval.every_column, interval.schema)
            if not interval.schema:
                known = seen.columns.setdefault(table, {})
                for column in listed:
                    known[column.name] = column
                    seen.spans.setdefault((table, column.name), []).append(
                        _Span(interval.first, interval.last, generation_label(column.type), source)
                    )
            if interval.every_column:
                names = frozenset(c.name for c in listed)
                seen.complete.setdefault(table, []).append((interval, names))
        seen.add_uncarried_columns(intervals)
        return seen

    def add_uncarried_columns(self, intervals: list[Interval]) -> None:
        """Columns of a table that schema rows list and no change record carried yet: a column
        added to a table nobody writes since, or one whose records list changed columns only.
        Every row holds NULL there (an added column with a DEFAULT is read again by the ingest,
        whose snapshot rows carry it), so the mirror has it from the schema rows, with the type
        of its newest listing (``intervals`` in the order of their last row). A table only
        schema rows list yet (a new job's first version names every captured table before its
        snapshot lands) has its shape from them, so the job's query starts with every table."""
        schema_only: dict[tuple[str, str], list[_Span]] = {}
        for interval in intervals:
            if not interval.schema:
                continue
            known = self.columns.setdefault(interval.table, {})
            source = (interval.column_types, interval.every_column, interval.schema)
            for column in parse_column_types(interval.column_types):
                if (interval.table, column.name) in self.spans:
                    continue
                label = generation_label(column.type)
                span = _Span(interval.first, interval.last, label, source)
                schema_only.setdefault((interval.table, column.name), []).append(span)
                known[column.name] = column
        self.spans.update(schema_only)


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
