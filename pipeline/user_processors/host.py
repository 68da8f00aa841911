"""A user's processor run as a transformWithState processor: its declared variables opened on
Spark's state API, each group's rows decoded into the typed feed, its rows wrapped for the
job's one output stream (``_cdc_output`` names the processor, ``out_<name>`` holds the row)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from pyspark.sql import Row
from pyspark.sql import types as T
from pyspark.sql.streaming.stateful_processor import StatefulProcessor, StatefulProcessorHandle

from pipeline.user_processors.api import (
    ChangeProcessor,
    ListHandle,
    ListOf,
    MapHandle,
    MapOf,
    OutputRow,
    State,
    Value,
    ValueHandle,
    Variable,
)
from pipeline.user_processors.feed import SCHEMAS, Decoder, position

OUTPUT_COLUMN = "_cdc_output"
"""Which processor an output row of the job's stream came from; NULL for the mirrors' rows."""


def output_column(name: str) -> str:
    return f"out_{name}"


def host_schema(processor: type[ChangeProcessor]) -> T.StructType:
    return T.StructType(
        [
            T.StructField(OUTPUT_COLUMN, T.StringType()),
            T.StructField(output_column(processor.name), processor.output),
        ]
    )


class ProcessorHost(StatefulProcessor):
    def __init__(
        self, processor: type[ChangeProcessor], deleted_variables: tuple[str, ...] = ()
    ) -> None:
        self.processor_class = processor
        self.deleted_variables = deleted_variables

    def init(self, handle: StatefulProcessorHandle) -> None:
        for name in self.deleted_variables:
            handle.deleteIfExists(name)
        self.processor = self.processor_class()
        self.state = State(
            {name: _open(handle, name, v) for name, v in self.processor.state.items()}
        )
        self.decoder = Decoder()
        self.output_fields = self.processor.output.fieldNames()
        self.envelope = Row(OUTPUT_COLUMN, output_column(self.processor.name))

    def handleInputRows(self, key: Any, rows: Iterator[Row], timerValues: Any) -> Iterator[Row]:
        kind, group = key
        ordered = sorted(rows, key=position)
        produced: Iterable[OutputRow]
        if kind == SCHEMAS:
            produced = (
                item
                for row in ordered
                for item in self.processor.on_schema_change(
                    self.decoder.schema_change(row), self.state
                )
            )
        else:
            changes = [self.decoder.change(row) for row in ordered]
            produced = self.processor.process(group, changes, self.state)
        for item in produced:
            yield self.envelope(self.processor.name, self._as_tuple(item))

    def _as_tuple(self, item: OutputRow) -> tuple[Any, ...]:
        if isinstance(item, Mapping):
            unknown = set(item) - set(self.output_fields)
            if unknown:
                raise ValueError(
                    f"processor {self.processor.name!r} returned fields {sorted(unknown)} its "
                    "output schema lacks"
                )
            return tuple(item.get(name) for name in self.output_fields)
        return tuple(item)

    def close(self) -> None:
        pass


def _open(handle: StatefulProcessorHandle, name: str, variable: Variable) -> Any:
    ttl = None if variable.ttl_s is None else int(variable.ttl_s * 1000)
    if isinstance(variable, Value):
        return _Value(handle.getValueState(name, variable.schema, ttl), variable.schema)
    if isinstance(variable, ListOf):
        return _List(handle.getListState(name, variable.element, ttl), variable.element)
    if isinstance(variable, MapOf):
        state = handle.getMapState(name, variable.key, variable.value, ttl)
        return _Map(state, variable.key, variable.value)
    raise TypeError(f"state variable {name!r}: declare a Value, ListOf or MapOf")


def _as_dict(value: Any, schema: T.StructType) -> dict[str, Any]:
    """A state value by field name, its timestamps aware in UTC (PySpark hands them back naive
    in the local time zone)."""
    return {
        field.name: _utc(item) if isinstance(field.dataType, T.TimestampType) else item
        for field, item in zip(schema.fields, value, strict=True)
    }


def _utc(value: Any) -> Any:
    if isinstance(value, dt.datetime) and value.tzinfo is None:
        return value.astimezone(dt.UTC)
    return value


def _as_tuple(value: Mapping[str, Any], schema: T.StructType) -> tuple[Any, ...]:
    return tuple(value.get(name) for name in schema.fieldNames())


class _Value(ValueHandle):
    def __init__(self, state: Any, schema: T.StructType) -> None:
        self._state, self._schema = state, schema

    def get(self) -> dict[str, Any] | None:
        value = self._state.get()
        return None if value is None else _as_dict(value, self._schema)

    def set(self, value: Mapping[str, Any]) -> None:
        self._state.update(_as_tuple(value, self._schema))

    def clear(self) -> None:
        self._state.clear()


class _List(ListHandle):
    def __init__(self, state: Any, schema: T.StructType) -> None:
        self._state, self._schema = state, schema

    def get(self) -> list[dict[str, Any]]:
        return [_as_dict(item, self._schema) for item in self._state.get()]

    def put(self, items: Iterable[Mapping[str, Any]]) -> None:
        values = [_as_tuple(item, self._schema) for item in items]
        if values:
            self._state.put(values)
        else:
            self._state.clear()

    def append(self, item: Mapping[str, Any]) -> None:
        self._state.appendValue(_as_tuple(item, self._schema))

    def clear(self) -> None:
        self._state.clear()


class _Map(MapHandle):
    def __init__(self, state: Any, key: T.StructType, value: T.StructType) -> None:
        self._state, self._key, self._value = state, key, value

    def get(self, key: Mapping[str, Any]) -> dict[str, Any] | None:
        value = self._state.getValue(_as_tuple(key, self._key))
        return None if value is None else _as_dict(value, self._value)

    def put(self, key: Mapping[str, Any], value: Mapping[str, Any]) -> None:
        self._state.updateValue(_as_tuple(key, self._key), _as_tuple(value, self._value))

    def remove(self, key: Mapping[str, Any]) -> None:
        self._state.removeKey(_as_tuple(key, self._key))

    def items(self) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
        for key, value in self._state.iterator():
            yield _as_dict(key, self._key), _as_dict(value, self._value)

    def clear(self) -> None:
        self._state.clear()
