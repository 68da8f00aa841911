"""The rules a new deployment's state schemas must follow against the recorded ones
(docs/design.md, evolution rules).

Spark checks some of these rules itself, but only once the query runs, and a rename passes its
check while silently dropping the old values. Checking here, before Spark starts, turns every
refused change into one message that names the variable, the field and the rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pyspark.sql import types as T

from pipeline.state.registry import Deployment
from pipeline.state.variables import STATE_LAYOUT
from runtime.errors import BadInput

OLDEST_READABLE_LAYOUT = 2
"""Layout 2 state moves into entries key by key (pipeline.state.variables); layout 1 values
have other types."""

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
_SAME_AVRO = {("timestamp", "bigint")}
"""Changes of Spark type that keep the Avro type: a timestamp is an Avro long of epoch
microseconds, read as a bigint unchanged (state layout 4 keeps TIMESTAMP so)."""
ALLOWED_TYPE_CHANGES = frozenset(_WIDENINGS | _SAME_AVRO)
"""Every (old, new) Spark type change a state field may make."""


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


class StateSchemaError(BadInput, ValueError):
    """A new deployment's state schemas break a rule; the message lists every refusal."""

    def __init__(self, refusals: list[Refusal]) -> None:
        self.refusals = refusals
        lines = "; ".join(map(str, refusals))
        super().__init__(f"state schema change refused ({len(refusals)}): {lines}")


@dataclass(frozen=True, slots=True)
class Limits:
    """Spark's two thresholds, with the values the job also sets in Spark.

    ``per_variable`` is ``valueStateSchemaEvolutionThreshold``: Spark numbers a variable's value
    schemas from 0 and refuses schema number ``per_variable``, so a variable evolves at most
    ``per_variable - 1`` times. ``per_query`` is ``maxNumStateSchemaFiles``: a deployment that
    changes the state writes one schema file, and Spark refuses file ``per_query + 1``.
    """

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
    if history[-1].layout < OLDEST_READABLE_LAYOUT:
        raise StateSchemaError([_layout_refusal(history[-1].layout)])
    old = history[-1].schemas
    refusals: list[Refusal] = []
    changed, added_fields = [], {}
    for name in sorted(new):
        before = _last_schema(history, name)
        if before is None or before == new[name]:
            continue
        if name in old:
            changed.append(name)
        refusals += _compare_struct(name, "", before, new[name], confirmed_drops)
        added = fields_added(before, new[name])
        if added:
            added_fields[name] = added
            refusals += _check_added(history, name, new[name], added, confirmed_drops)
        evolutions = _evolution_count(history, name) + 1
        if evolutions >= limits.per_variable:
            refusals.append(_variable_limit_refusal(name, evolutions, limits))
    evolution = Evolution(
        added_variables=tuple(sorted(set(new) - set(old))),
        removed_variables=tuple(sorted(set(old) - set(new))),
        changed_variables=tuple(changed),
        added_fields=added_fields,
    )
    schema_files = len(history) + evolution.is_change
    if schema_files > limits.per_query:
        refusals.append(_query_limit_refusal(schema_files, limits))
    if refusals:
        raise StateSchemaError(refusals)
    return evolution


def _check_added(
    history: list[Deployment],
    variable: str,
    new: T.StructType,
    added: tuple[str, ...],
    confirmed_drops: frozenset[str],
) -> list[Refusal]:
    """Seed 004's rules for added fields: each needs a default (nullable: Avro's null), and a
    field removed once must not come back under its name unconfirmed: keys written while it was
    gone read None, the others their old value (the lost update)."""
    refusals = []
    for path in added:
        field = _field_at(new, path)
        if field is not None and not field.nullable:
            refusals.append(
                Refusal(
                    variable,
                    path,
                    "added field without a default",
                    "an added field must be nullable (Avro's default null) so that state "
                    "written before it can be read; make it nullable",
                )
            )
        if _removed_before(history, variable, path) and f"{variable}.{path}" not in confirmed_drops:
            refusals.append(
                Refusal(
                    variable,
                    path,
                    "re-added after removal",
                    "a deployment removed this field; added back under its name, keys written "
                    "since read None while the others keep their old value (a lost update). "
                    "Use a new name, or confirm with "
                    f"confirmed_drops={variable}.{path}",
                )
            )
    return refusals


def _field_at(struct: T.StructType, path: str) -> T.StructField | None:
    """The field at a dotted path (``image.email``), or None."""
    head, _, rest = path.partition(".")
    field = next((f for f in struct.fields if f.name == head), None)
    if field is None or not rest:
        return field
    inner = field.dataType
    return _field_at(inner, rest) if isinstance(inner, T.StructType) else None


def _removed_before(history: list[Deployment], variable: str, path: str) -> bool:
    """Whether an earlier deployment held the variable with this field (the newest lacks it)."""
    return any(
        variable in deployment.schemas and _field_at(deployment.schemas[variable], path)
        for deployment in history
    )


def _layout_refusal(layout: int) -> Refusal:
    return Refusal(
        "*",
        "",
        "state layout changed",
        f"the checkpoint was recorded with state layout {layout}, this version reads layouts "
        f"{OLDEST_READABLE_LAYOUT} to {STATE_LAYOUT} (STRING as bytes, arrays as JSON text); "
        "rebuild the mirrors from the change log (docs/operations.md, Replay)",
    )


def _variable_limit_refusal(name: str, evolutions: int, limits: Limits) -> Refusal:
    return Refusal(
        name,
        "",
        "evolution limit per variable exceeded",
        f"this would be evolution {evolutions} of the variable; with "
        f"max_evolutions_per_variable={limits.per_variable} (Spark's "
        "spark.sql.streaming.stateStore.valueStateSchemaEvolutionThreshold) Spark "
        f"allows {limits.per_variable - 1}",
    )


def _query_limit_refusal(schema_files: int, limits: Limits) -> Refusal:
    return Refusal(
        "*",
        "",
        "evolution limit per query exceeded",
        f"this would be state schema file {schema_files} of the query; with "
        f"max_evolutions_per_query={limits.per_query} (Spark's "
        "spark.sql.streaming.stateStore.maxNumStateSchemaFiles) Spark allows "
        f"{limits.per_query}",
    )


def fields_added(old: T.StructType, new: T.StructType) -> tuple[str, ...]:
    """Fields of ``new`` that ``old`` lacks, nested ones as dotted paths (``image.email``)."""
    before = {f.name: f.dataType for f in old.fields}
    added: list[str] = []
    for field in new.fields:
        kept = before.get(field.name)
        if kept is None:
            added.append(field.name)
        elif isinstance(kept, T.StructType) and isinstance(field.dataType, T.StructType):
            added += [f"{field.name}.{path}" for path in fields_added(kept, field.dataType)]
    return tuple(added)


def _last_schema(history: list[Deployment], variable: str) -> T.StructType | None:
    """The variable's newest recorded schema, also when the latest deployment deleted it: Spark
    checks a variable added again against the schemas it had."""
    for deployment in reversed(history):
        if variable in deployment.schemas:
            return deployment.schemas[variable]
    return None


def _evolution_count(history: list[Deployment], variable: str) -> int:
    """How often the variable's schema changed between the deployments that held it.

    A deletion does not reset the count: Spark reads every old schema file, so a variable added
    again continues from its last schema number.
    """
    count, previous = 0, None
    for deployment in history:
        current = deployment.schemas.get(variable)
        if current is None:
            continue
        if previous is not None and current != previous:
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
    if pair in ALLOWED_TYPE_CHANGES:
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
