"""Users' processors in the job's one transformWithState operator, beside the mirrors' own
processor: each processor's variables are opened on Spark's state API under
``<processor>.<variable>``, its groups' rows (``pipeline.user_processors.feed.routed``) decoded
into the typed feed, and its rows wrapped for the job's one output stream (``_cdc_output`` names
the processor, ``out_<name>`` holds the row; NULL for the mirrors' rows).

One operator, not one per processor: the change log is one source whatever the processors, and
adding or removing a processor adds or deletes state variables, which a checkpoint takes."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from pyspark.sql import Row
from pyspark.sql import types as T
from pyspark.sql.streaming.stateful_processor import StatefulProcessorHandle

from pipeline.processor import ChangeApplier, output_schema
from pipeline.shapes import TableShape
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
from pipeline.user_processors.feed import (
    SCHEMA_ROUTE,
    Decoder,
    changes_route,
    position,
    schema_route,
)

OUTPUT_COLUMN = "_cdc_output"
"""Which processor an output row of the job's stream came from; NULL for the mirrors' rows."""


def output_column(name: str) -> str:
    return f"out_{name}"


def state_name(processor: type[ChangeProcessor], variable: str) -> str:
    """A processor's variable among the operator's: what the gate records and refusals name."""
    return f"{processor.name}.{variable}"


def state_schemas(processors: Iterable[type[ChangeProcessor]]) -> dict[str, T.StructType]:
    """Every processor's variables, as recorded and checked between deployments."""
    return {
        state_name(p, name): v.recorded_schema()
        for p in processors
        for name, v in sorted(p.state.items())
    }


def job_output_schema(
    shapes: Mapping[str, TableShape],
    history: frozenset[str],
    processors: Iterable[type[ChangeProcessor]],
) -> T.StructType:
    """The operator's output: the mirrors' columns, then which processor and each one's row."""
    fields = list(output_schema(shapes, history).fields)
    processors = list(processors)
    if processors:
        fields.append(T.StructField(OUTPUT_COLUMN, T.StringType()))
        fields += [T.StructField(output_column(p.name), p.output) for p in processors]
    return T.StructType(fields)


class ChangeApplierWithProcessors(ChangeApplier):
    """The mirrors' processor, and the users' processors on the groups routed to them."""

    def __init__(
        self,
        processors: tuple[type[ChangeProcessor], ...],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.processors = processors
        self.output_fields = job_output_schema(self.shapes, self.history, processors).fieldNames()

    def init(self, handle: StatefulProcessorHandle) -> None:
        super().init(handle)
        envelope = Row(*self.output_fields)
        self.hosted: dict[str, _Hosted] = {}
        for processor in self.processors:
            hosted = _Hosted(processor, handle, envelope, self.output_fields)
            self.hosted[changes_route(processor)] = hosted
            self.hosted[schema_route(processor)] = hosted

    def handleInputRows(self, key: Any, rows: Iterator[Row], timerValues: Any) -> Iterator[Row]:
        route, group = key
        hosted = self.hosted.get(route)
        if hosted is None:
            yield from super().handleInputRows(key, rows, timerValues)
        elif route.startswith(SCHEMA_ROUTE):
            yield from hosted.schema_rows(rows)
        else:
            yield from hosted.changes(group, rows)


class _Hosted:
    """One user processor inside the operator: its state, decoder and output rows."""

    def __init__(
        self,
        processor: type[ChangeProcessor],
        handle: StatefulProcessorHandle,
        envelope: Any,
        output_fields: list[str],
    ) -> None:
        self.processor = processor()
        self.state = State(
            {
                name: _open(handle, state_name(processor, name), v)
                for name, v in processor.state.items()
            }
        )
        self.decoder = Decoder()
        self.envelope = envelope
        self.output_fields = output_fields
        self.fields = processor.output.fieldNames()
        self.column = output_column(processor.name)

    def changes(self, group: str | None, rows: Iterator[Row]) -> Iterator[Row]:
        changes = [self.decoder.change(row) for row in sorted(rows, key=position)]
        yield from self._wrapped(self.processor.process(group, changes, self.state))

    def schema_rows(self, rows: Iterator[Row]) -> Iterator[Row]:
        for row in sorted(rows, key=position):
            change = self.decoder.schema_change(row)
            yield from self._wrapped(self.processor.on_schema_change(change, self.state))

    def _wrapped(self, produced: Iterable[OutputRow]) -> Iterator[Row]:
        for item in produced:
            values = {OUTPUT_COLUMN: self.processor.name, self.column: self._as_tuple(item)}
            yield self.envelope(*(values.get(name) for name in self.output_fields))

    def _as_tuple(self, item: OutputRow) -> tuple[Any, ...]:
        if isinstance(item, Mapping):
            unknown = set(item) - set(self.fields)
            if unknown:
                raise ValueError(
                    f"processor {self.processor.name!r} returned fields {sorted(unknown)} its "
                    "output schema lacks"
                )
            return tuple(item.get(name) for name in self.fields)
        return tuple(item)


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
