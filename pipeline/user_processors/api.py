"""What a user's stateful processor is written against: the typed change feed, declared state
variables and the processor class the job runs (docs/processors.md is the guide).

A processor reads some captured tables. Each change reaches it as a ``Change``: the table, the
kind of change, the key and values typed as the mirror's Spark types (as this change was
written), the change's position, transaction id and commit timestamp. Changes are grouped by a
key the processor chooses (``group_by``: per table, the columns whose value is a group's key; a
change joins the group of each), and each group's changes come in change-log order, whole
transactions, commit order. A Spanner schema change reaches the processor as a
``SchemaChange``. State is what the processor declares in ``state``: value, list and map
variables of Spark struct types, kept in RocksDB as Avro and gated between deployments by the
same rules as the mirror job's own state. What ``process`` returns lands once in the
processor's own Delta table.
"""

from __future__ import annotations

import abc
import datetime as dt
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pyspark.sql import types as T

from ingest.contract.changelog import Position

INSERT, UPDATE, DELETE = "INSERT", "UPDATE", "DELETE"
FIRST_IMAGE = "SNAPSHOT"
"""A row as the change log's snapshot read it (the initial one at T0, or an on-demand one)."""
FIRST_IMAGE_DELETE = "SNAPSHOT_DELETE"
"""An on-demand snapshot did not find the key: it was gone at its time."""

OutputRow = Mapping[str, Any] | Sequence[Any]


@dataclass(frozen=True, slots=True)
class Change:
    """One mod of a captured table, typed as the mirror types its columns.

    ``values`` holds the columns the change carries (every column for ``NEW_ROW`` and
    ``NEW_ROW_AND_OLD_VALUES`` captures, the changed ones for ``NEW_VALUES`` and
    ``OLD_AND_NEW_VALUES``, Spanner's default; none for a delete); ``old_values`` what the
    ``OLD_AND_NEW_VALUES`` and ``NEW_ROW_AND_OLD_VALUES`` captures send. ``column_types`` is
    each column's Spark type as the change was written: after a STRING↔BYTES change, the same
    column arrives as ``str`` in older changes and ``bytes`` in newer ones."""

    table: str
    kind: str
    keys: Mapping[str, Any]
    values: Mapping[str, Any]
    old_values: Mapping[str, Any]
    column_types: Mapping[str, T.DataType]
    commit_timestamp: dt.datetime
    """Aware, in UTC, to the microsecond (a commit timestamp's precision)."""
    commit_timestamp_text: str
    """The exact commit timestamp (RFC 3339, nine digits); sorts as time does."""
    transaction_id: str
    position: Position

    @property
    def is_first_image(self) -> bool:
        """A snapshot's image: the row as it was at the snapshot, not a change made then."""
        return self.kind == FIRST_IMAGE

    @property
    def is_delete(self) -> bool:
        return self.kind in (DELETE, FIRST_IMAGE_DELETE)

    def get(self, column: str, default: Any = None) -> Any:
        """A column's value as this change carries it: its new value, else its key value."""
        if column in self.values:
            return self.values[column]
        return self.keys.get(column, default)


@dataclass(frozen=True, slots=True)
class SchemaChange:
    """A table's watched columns as the change log recorded them at ``commit_timestamp_text``
    (a schema row): how a processor learns that a column was added, dropped or retyped."""

    table: str
    column_types: Mapping[str, T.DataType]
    commit_timestamp_text: str


class Variable(abc.ABC):
    """A declared state variable; with ``ttl_s``, a group's value expires that long after it
    was last written (processing time)."""

    ttl_s: float | None

    @abc.abstractmethod
    def recorded_schema(self) -> T.StructType:
        """The schema recorded and checked between deployments."""


@dataclass(frozen=True, slots=True)
class Value(Variable):
    """One value per group: a struct."""

    schema: T.StructType
    ttl_s: float | None = None

    def recorded_schema(self) -> T.StructType:
        return self.schema


@dataclass(frozen=True, slots=True)
class ListOf(Variable):
    """A list of structs per group."""

    element: T.StructType
    ttl_s: float | None = None

    def recorded_schema(self) -> T.StructType:
        return T.StructType([T.StructField("items", T.ArrayType(self.element))])


@dataclass(frozen=True, slots=True)
class MapOf(Variable):
    """A map per group from a struct key to a struct value; its key schema may never change."""

    key: T.StructType
    value: T.StructType
    ttl_s: float | None = None

    def recorded_schema(self) -> T.StructType:
        return T.StructType([T.StructField("entries", T.MapType(self.key, self.value))])


class ValueHandle(abc.ABC):
    @abc.abstractmethod
    def get(self) -> dict[str, Any] | None: ...

    @abc.abstractmethod
    def set(self, value: Mapping[str, Any]) -> None: ...

    @abc.abstractmethod
    def clear(self) -> None: ...


class ListHandle(abc.ABC):
    @abc.abstractmethod
    def get(self) -> list[dict[str, Any]]: ...

    @abc.abstractmethod
    def put(self, items: Iterable[Mapping[str, Any]]) -> None: ...

    @abc.abstractmethod
    def append(self, item: Mapping[str, Any]) -> None: ...

    @abc.abstractmethod
    def clear(self) -> None: ...


class MapHandle(abc.ABC):
    @abc.abstractmethod
    def get(self, key: Mapping[str, Any]) -> dict[str, Any] | None: ...

    @abc.abstractmethod
    def put(self, key: Mapping[str, Any], value: Mapping[str, Any]) -> None: ...

    @abc.abstractmethod
    def remove(self, key: Mapping[str, Any]) -> None: ...

    @abc.abstractmethod
    def items(self) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]: ...

    @abc.abstractmethod
    def clear(self) -> None: ...


class State:
    """A group's declared variables. Values are dicts of their struct's fields (a timestamp
    field aware, in UTC); a field added by a later deployment reads as None in values written
    before it."""

    def __init__(self, handles: Mapping[str, ValueHandle | ListHandle | MapHandle]) -> None:
        self._handles = dict(handles)

    def value(self, name: str) -> ValueHandle:
        handle = self._handles[name]
        assert isinstance(handle, ValueHandle), f"{name!r} is not a Value"
        return handle

    def list(self, name: str) -> ListHandle:
        handle = self._handles[name]
        assert isinstance(handle, ListHandle), f"{name!r} is not a ListOf"
        return handle

    def map(self, name: str) -> MapHandle:
        handle = self._handles[name]
        assert isinstance(handle, MapHandle), f"{name!r} is not a MapOf"
        return handle


class ChangeProcessor(abc.ABC):
    """Subclass this, declare the class attributes and write ``process``.

    ``name`` names the output table (``<processor_root>/<name>``) and the processor's state in
    the checkpoint: keep it across deployments. ``group_by`` maps each table read to what
    keys its groups: columns (a key column or any other; a change joins one group per listed
    column, once per distinct value) or tuples of columns (one group per combination). A group
    key is the value as the change log spells it (an INT64 as its decimal text); a tuple's is
    the JSON array of its values' texts (``["5","alpha"]``)."""

    name: ClassVar[str]
    tables: ClassVar[tuple[str, ...]]
    group_by: ClassVar[Mapping[str, tuple[str | tuple[str, ...], ...]]]
    state: ClassVar[Mapping[str, Variable]]
    output: ClassVar[T.StructType]

    @abc.abstractmethod
    def process(
        self, group: str | None, changes: Sequence[Change], state: State
    ) -> Iterable[OutputRow]:
        """A group's changes of one micro-batch, in change-log order; rows for the output
        table (dicts by field name, or tuples in ``output``'s order)."""

    def on_schema_change(self, change: SchemaChange, state: State) -> Iterable[OutputRow]:
        """A schema row of a table read; its state is a group of its own. Nothing by default."""
        return ()
