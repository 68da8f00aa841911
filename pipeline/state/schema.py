"""State schemas: what each deployment runs with, recorded next to the checkpoint, and the rules
a new deployment's schemas must follow against the recorded ones (docs/design.md, evolution rules).

Spark checks some of these rules itself, but only once the query runs, and a rename passes its
check while silently dropping the old values. Checking here, before Spark starts, turns every
refused change into one message that names the variable, the field and the rule.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import fastavro
from pyarrow import fs as pafs
from pyspark.sql import types as T

from pipeline.types import TableShape

LAST_APPLIED = T.StructType(
    [
        T.StructField("commit_timestamp_text", T.StringType()),
        T.StructField("server_transaction_id", T.StringType()),
        T.StructField("record_sequence", T.StringType()),
        T.StructField("mod_index", T.IntegerType()),
    ]
)
CHANGE_STATS = T.StructType(
    [
        T.StructField("inserts", T.LongType()),
        T.StructField("updates", T.LongType()),
        T.StructField("deletes", T.LongType()),
        T.StructField("first_commit_timestamp", T.TimestampType()),
        T.StructField("last_commit_timestamp", T.TimestampType()),
    ]
)
TOMBSTONE = LAST_APPLIED
"""The position of the delete, kept (with a TTL) so replays of older changes stay ignored."""
STATE_LAYOUT = 2
"""How row images map Spanner types to state fields (pipeline.types.state_type). Layout 1 kept
each column in its mirror type; layout 2 keeps STRING as bytes and arrays as JSON text."""


def row_variable(table: str) -> str:
    return f"row_{table}"


def state_schemas(shapes: Mapping[str, TableShape]) -> dict[str, T.StructType]:
    """Every state variable of the change applier: one row image per table, then bookkeeping."""
    schemas = {row_variable(name): shape.state_struct() for name, shape in sorted(shapes.items())}
    schemas.update(last_applied=LAST_APPLIED, change_stats=CHANGE_STATS, tombstone=TOMBSTONE)
    return schemas


# -- Avro ------------------------------------------------------------------------------------


def avro_schema(struct: T.StructType, name: str) -> dict[str, Any]:
    """The Avro record Spark's Avro state encoding writes for ``struct`` (fields nullable)."""
    record = {
        "type": "record",
        "name": name,
        "fields": [
            {"name": f.name, "type": ["null", _avro_type(f.dataType, f"{name}_{f.name}")]}
            for f in struct.fields
        ],
    }
    fastavro.parse_schema(record)
    return record


def _avro_type(data_type: T.DataType, name: str) -> Any:
    simple = {
        T.LongType: "long",
        T.IntegerType: "int",
        T.DoubleType: "double",
        T.FloatType: "float",
        T.BooleanType: "boolean",
        T.StringType: "string",
        T.BinaryType: "bytes",
    }
    for spark_class, avro in simple.items():
        if isinstance(data_type, spark_class):
            return avro
    if isinstance(data_type, T.DateType):
        return {"type": "int", "logicalType": "date"}
    if isinstance(data_type, T.TimestampType):
        return {"type": "long", "logicalType": "timestamp-micros"}
    if isinstance(data_type, T.DecimalType):
        return {
            "type": "fixed",
            "name": name,
            "size": 16,
            "logicalType": "decimal",
            "precision": data_type.precision,
            "scale": data_type.scale,
        }
    if isinstance(data_type, T.ArrayType):
        return {"type": "array", "items": ["null", _avro_type(data_type.elementType, name)]}
    if isinstance(data_type, T.MapType):
        return {"type": "map", "values": ["null", _avro_type(data_type.valueType, name)]}
    if isinstance(data_type, T.StructType):
        return avro_schema(data_type, name)
    raise ValueError(f"no Avro type for {data_type.simpleString()}")


# -- the registry ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Deployment:
    """The state schemas one deployment ran with, as recorded."""

    number: int
    schemas: dict[str, T.StructType]
    deleted: tuple[str, ...] = ()
    recorded_at: str = ""
    layout: int = STATE_LAYOUT


def filesystem_for(uri: str) -> tuple[pafs.FileSystem, str]:
    if "://" not in uri:
        from pathlib import Path

        return pafs.LocalFileSystem(), str(Path(uri).resolve())
    filesystem, path = pafs.FileSystem.from_uri(uri)
    return filesystem, path


@dataclass(slots=True)
class SchemaRegistry:
    """``<checkpoint>/_state_schemas/NNNNNN.json``: a file per deployment that changed schemas."""

    checkpoint_uri: str
    _history: list[Deployment] | None = field(default=None, init=False)

    @property
    def _folder(self) -> tuple[pafs.FileSystem, str]:
        filesystem, root = filesystem_for(self.checkpoint_uri)
        return filesystem, f"{root.rstrip('/')}/_state_schemas"

    def history(self) -> list[Deployment]:
        if self._history is None:
            filesystem, folder = self._folder
            selector = pafs.FileSelector(folder, allow_not_found=True)
            infos = filesystem.get_file_info(selector)
            files = sorted(info.path for info in infos if info.path.endswith(".json"))
            self._history = [self._read(filesystem, path) for path in files]
        return self._history

    @staticmethod
    def _read(filesystem: pafs.FileSystem, path: str) -> Deployment:
        with filesystem.open_input_stream(path) as stream:
            document = json.loads(stream.read())
        return Deployment(
            number=document["number"],
            schemas={
                name: T.StructType.fromJson(variable["spark"])
                for name, variable in document["variables"].items()
            },
            deleted=tuple(document.get("deleted", [])),
            recorded_at=document.get("recorded_at", ""),
            layout=document.get("layout", 1),
        )

    def latest(self) -> Deployment | None:
        history = self.history()
        return history[-1] if history else None

    def record(self, schemas: Mapping[str, T.StructType], deleted: tuple[str, ...]) -> Deployment:
        """Record a deployment if its schemas differ from the latest one; return the latest."""
        latest = self.latest()
        if latest is not None and latest.schemas == dict(schemas) and not deleted:
            return latest
        number = 1 if latest is None else latest.number + 1
        deployment = Deployment(
            number=number,
            schemas=dict(schemas),
            deleted=deleted,
            recorded_at=dt.datetime.now(dt.UTC).isoformat(),
        )
        document = {
            "layout": STATE_LAYOUT,
            "number": number,
            "recorded_at": deployment.recorded_at,
            "deleted": list(deleted),
            "variables": {
                name: {"spark": struct.jsonValue(), "avro": avro_schema(struct, name)}
                for name, struct in sorted(schemas.items())
            },
        }
        filesystem, folder = self._folder
        filesystem.create_dir(folder, recursive=True)
        with filesystem.open_output_stream(f"{folder}/{number:06d}.json") as stream:
            stream.write(json.dumps(document, indent=1, sort_keys=True).encode())
        self.history().append(deployment)
        return deployment


# -- the compatibility rules -----------------------------------------------------------------

_WIDENINGS = {
    ("int", "bigint"),
    ("int", "float"),
    ("int", "double"),
    ("bigint", "float"),
    ("bigint", "double"),
    ("float", "double"),
    ("string", "binary"),
    ("binary", "string"),
}


@dataclass(frozen=True, slots=True)
class Refusal:
    variable: str
    field: str
    rule: str
    detail: str

    def __str__(self) -> str:
        where = f"state variable {self.variable!r}"
        if self.field:
            where += f", field {self.field!r}"
        return f"{where}: {self.rule}: {self.detail}"


class StateSchemaError(ValueError):
    """A new deployment's state schemas break a rule; the message lists every refusal."""

    def __init__(self, refusals: list[Refusal]) -> None:
        self.refusals = refusals
        lines = "; ".join(map(str, refusals))
        super().__init__(f"state schema change refused ({len(refusals)}): {lines}")


@dataclass(frozen=True, slots=True)
class Limits:
    per_variable: int = 16
    per_query: int = 128


@dataclass(frozen=True, slots=True)
class Evolution:
    """What a deployment changes against the latest recorded one; all of it allowed."""

    added_variables: tuple[str, ...]
    removed_variables: tuple[str, ...]
    changed_variables: tuple[str, ...]
    added_fields: dict[str, tuple[str, ...]]

    @property
    def is_change(self) -> bool:
        return bool(self.added_variables or self.removed_variables or self.changed_variables)


def check_evolution(
    history: list[Deployment],
    new: Mapping[str, T.StructType],
    confirmed_drops: frozenset[str] = frozenset(),
    limits: Limits = Limits(),
) -> Evolution:
    """The evolution from the latest recorded deployment to ``new``, or StateSchemaError."""
    if not history:
        return Evolution(tuple(sorted(new)), (), (), {})
    old = history[-1].schemas
    refusals: list[Refusal] = []
    changed, added_fields = [], {}
    for name in sorted(set(old) & set(new)):
        if old[name] == new[name]:
            continue
        changed.append(name)
        refusals += _compare_struct(name, "", old[name], new[name], confirmed_drops)
        added = fields_added(old[name], new[name])
        if added:
            added_fields[name] = added
        evolutions = _evolution_count(history, name) + 1
        if evolutions > limits.per_variable:
            refusals.append(
                Refusal(
                    name,
                    "",
                    "evolution limit per variable exceeded",
                    f"this would be evolution {evolutions} of the variable, the limit is "
                    f"{limits.per_variable} (max_evolutions_per_variable; Spark's "
                    "spark.sql.streaming.stateStore.valueStateSchemaEvolutionThreshold)",
                )
            )
    evolution = Evolution(
        added_variables=tuple(sorted(set(new) - set(old))),
        removed_variables=tuple(sorted(set(old) - set(new))),
        changed_variables=tuple(changed),
        added_fields=added_fields,
    )
    query_evolutions = len(history) - 1 + evolution.is_change
    if query_evolutions > limits.per_query:
        refusals.append(
            Refusal(
                "*",
                "",
                "evolution limit per query exceeded",
                f"this would be evolution {query_evolutions} of the query, the limit is "
                f"{limits.per_query} (max_evolutions_per_query; Spark's "
                "spark.sql.streaming.stateStore.maxNumStateSchemaFiles)",
            )
        )
    if refusals and history[-1].layout < STATE_LAYOUT:
        refusals.append(
            Refusal(
                "*",
                "",
                "state layout changed",
                f"the checkpoint was recorded with state layout {history[-1].layout}, this "
                f"version uses layout {STATE_LAYOUT} (STRING as bytes, arrays as JSON text); "
                "rebuild the mirrors from the change log (README, Replay)",
            )
        )
    if refusals:
        raise StateSchemaError(refusals)
    return evolution


def fields_added(old: T.StructType, new: T.StructType) -> tuple[str, ...]:
    return tuple(f for f in new.fieldNames() if f not in old.fieldNames())


def _evolution_count(history: list[Deployment], variable: str) -> int:
    count, previous = 0, None
    for deployment in history:
        current = deployment.schemas.get(variable)
        if variable in deployment.deleted:
            previous = None
        if current is not None and previous is not None and current != previous:
            count += 1
        previous = current
    return count


def _compare_struct(
    variable: str,
    prefix: str,
    old: T.StructType,
    new: T.StructType,
    confirmed_drops: frozenset[str],
) -> list[Refusal]:
    refusals = []
    old_fields = {f.name: f.dataType for f in old.fields}
    new_fields = {f.name: f.dataType for f in new.fields}
    for name in old_fields.keys() & new_fields.keys():
        refusals += _compare_type(
            variable, prefix + name, old_fields[name], new_fields[name], confirmed_drops
        )
    removed = [n for n in old_fields if n not in new_fields]
    added = [n for n in new_fields if n not in old_fields]
    for gone in removed:
        twins = [a for a in added if new_fields[a] == old_fields[gone]]
        if twins and f"{variable}.{prefix}{gone}" not in confirmed_drops:
            refusals.append(
                Refusal(
                    variable,
                    prefix + gone,
                    "rename",
                    f"removed while {prefix + twins[0]!r} of the same type "
                    f"({old_fields[gone].simpleString()}) is added; Spark matches fields by "
                    f"name and would silently drop the values of {prefix + gone!r}. Keep the old "
                    f"name, or confirm the drop with confirmed_drops={variable}.{prefix}{gone}",
                )
            )
    return refusals


def _compare_type(
    variable: str,
    path: str,
    old: T.DataType,
    new: T.DataType,
    confirmed_drops: frozenset[str],
) -> list[Refusal]:
    if old == new:
        return []
    if isinstance(old, T.StructType) and isinstance(new, T.StructType):
        return _compare_struct(variable, f"{path}.", old, new, confirmed_drops)
    if isinstance(old, T.ArrayType) and isinstance(new, T.ArrayType):
        return _compare_type(
            variable, f"{path}[]", old.elementType, new.elementType, confirmed_drops
        )
    if isinstance(old, T.MapType) and isinstance(new, T.MapType):
        if old.keyType != new.keyType:
            return [
                Refusal(
                    variable,
                    path,
                    "map key change",
                    f"key type {old.keyType.simpleString()} → {new.keyType.simpleString()}; "
                    "state map keys cannot change name or type",
                )
            ]
        return _compare_type(variable, f"{path}{{}}", old.valueType, new.valueType, confirmed_drops)
    pair = (old.simpleString(), new.simpleString())
    if pair in _WIDENINGS:
        return []
    rule = "narrowing" if (pair[1], pair[0]) in _WIDENINGS else "type change"
    return [
        Refusal(
            variable,
            path,
            rule,
            f"{pair[0]} → {pair[1]}; allowed are int→bigint/float/double, bigint→float/double, "
            "float→double and string↔binary",
        )
    ]
