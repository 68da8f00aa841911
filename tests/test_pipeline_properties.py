"""Any change-log history replays to the same mirrors (real Spark, real Delta, few examples).

Hypothesis writes a history of one captured table under a NEW_ROW or a NEW_VALUES capture: ADD
COLUMN of twelve types, DROP COLUMN, STRING↔BYTES both ways, a dropped name added again,
interleaved with inserts, updates (whole rows as NEW_ROW captures send them, or changed columns
only as NEW_VALUES captures do) and deletes, arrays holding NULL elements, and schema rows
(the watched columns, as the ingest service lands them) after some stages. The change log is
written by the real sink, one Delta version per stage, and processed three ways (following each
stage, stopped after a random stage and restarted behind, rebuilt from scratch); all three
mirrors must equal each other and a model of Spanner at the last W.

Each example runs Spark about ten times, so there are only a few: the rules themselves have
fast tests elsewhere.
"""

from __future__ import annotations

import base64
import datetime as dt
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ingest.model.records import ColumnType
from pipeline.types import generation_label
from tests.builders import ChangeLog
from tests.pipeline_runs import processed_three_ways

KEY = ColumnType("id", {"code": "INT64"}, True, 1)
TYPES: dict[str, dict[str, Any]] = {
    "INT64": {"code": "INT64"},
    "FLOAT64": {"code": "FLOAT64"},
    "FLOAT32": {"code": "FLOAT32"},
    "BOOL": {"code": "BOOL"},
    "STRING": {"code": "STRING"},
    "BYTES": {"code": "BYTES"},
    "NUMERIC": {"code": "NUMERIC"},
    "DATE": {"code": "DATE"},
    "TIMESTAMP": {"code": "TIMESTAMP"},
    "JSON": {"code": "JSON"},
    "ARRAY<INT64>": {"code": "ARRAY", "array_element_type": {"code": "INT64"}},
    "ARRAY<STRING>": {"code": "ARRAY", "array_element_type": {"code": "STRING"}},
}
NAMES = ("a", "b", "c")


def value(type_name: str, n: int) -> tuple[Any, Any]:
    """(the JSON value Spanner's change stream sends, the value the mirror holds) for seed n."""
    text = f"v{n}-ü"
    match type_name:
        case "INT64":
            return str(n * 1_000_003), n * 1_000_003
        case "FLOAT64" | "FLOAT32":
            return n + 0.5, n + 0.5
        case "BOOL":
            return n % 2 == 0, n % 2 == 0
        case "STRING":
            return text, text
        case "BYTES":
            return base64.b64encode(text.encode()).decode(), text.encode()
        case "NUMERIC":
            return f"{n}.125", Decimal(f"{n}.125")
        case "DATE":
            day = dt.date(1, 1, 1) + dt.timedelta(days=n * 40_000)
            return day.isoformat(), day
        case "TIMESTAMP":
            moment = dt.datetime(2000, 1, 1, tzinfo=dt.UTC) + dt.timedelta(
                seconds=n * 1_000_003, microseconds=n
            )
            return moment.isoformat().replace("+00:00", "Z"), moment
        case "JSON":
            document = json.dumps({"n": n, "s": text})
            return document, document
        case "ARRAY<INT64>":
            return [str(n), None, "-1"], [n, None, -1]
        case _:
            return [text, None, ""], [text, None, ""]


@dataclass
class Spanner:
    """A model of the captured table as Spanner holds it: the oracle."""

    capture: str = "NEW_ROW_AND_OLD_VALUES"
    columns: dict[str, str] = field(default_factory=dict)
    ordinals: dict[str, int] = field(default_factory=dict)
    rows: dict[int, dict[str, Any]] = field(default_factory=dict)
    next_ordinal: int = 2
    unseen_drops: dict[str, set[str]] = field(default_factory=dict)
    """Dropped names no row has shown gone yet, with their state types: only records listing
    every column (NEW_ROW captures, not DELETE) and schema rows show a drop."""

    def column_types(self) -> tuple[ColumnType, ...]:
        ordered = sorted(self.columns.items(), key=lambda c: self.ordinals[c[0]])
        return (KEY, *(ColumnType(n, TYPES[k], False, self.ordinals[n]) for n, k in ordered))

    def add(self, name: str, kind: str) -> None:
        self.columns[name] = kind
        self.ordinals[name] = self.next_ordinal
        self.next_ordinal += 1
        for row in self.rows.values():
            row[name] = None

    def drop(self, name: str) -> None:
        self.unseen_drops.setdefault(name, set()).add(_kind(self.columns.pop(name)))
        for row in self.rows.values():
            row.pop(name)

    def written(self) -> None:
        """An INSERT or UPDATE was recorded: under a NEW_ROW capture it lists every column."""
        if self.capture.startswith("NEW_ROW"):
            self.unseen_drops.clear()

    def watched_read(self) -> None:
        """The ingest service read the watched columns: a schema row lists every column."""
        self.unseen_drops.clear()

    def retype(self, name: str) -> None:
        """STRING↔BYTES: Spanner converts the stored values (UTF-8)."""
        kind = self.columns[name] = "BYTES" if self.columns[name] == "STRING" else "STRING"
        for row in self.rows.values():
            held = row[name]
            if held is not None:
                row[name] = held.encode() if kind == "BYTES" else bytes(held).decode()


def _kind(type_name: str) -> str:
    return generation_label(TYPES[type_name]).simpleString()


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[list[tuple]], Spanner, int]:
    """Stages of operations, and the model after them. DDL only where Spanner allows it; a
    dropped name whose drop no record has shown comes back only under another state type (the
    same type cannot be told apart: README, Dropped columns)."""
    model = Spanner(capture=draw(st.sampled_from(["NEW_ROW_AND_OLD_VALUES", "NEW_VALUES"])))
    stages: list[list[tuple]] = []
    seed = 0
    for _ in range(draw(st.integers(3, 4))):
        ops: list[tuple] = []
        choice = draw(st.sampled_from(["add", "add", "drop", "retype", "none"]))
        free = [n for n in NAMES if n not in model.columns]
        if choice == "add" and free:
            name = draw(st.sampled_from(free))
            gone = model.unseen_drops.get(name, set())
            kind = draw(st.sampled_from([k for k in TYPES if _kind(k) not in gone]))
            model.add(name, kind)
            ops.append(("add", name, kind))
        elif choice == "drop" and model.columns:
            name = draw(st.sampled_from(sorted(model.columns)))
            model.drop(name)
            ops.append(("drop", name))
        elif choice == "retype":
            textual = sorted(n for n, k in model.columns.items() if k in ("STRING", "BYTES"))
            if textual:
                name = draw(st.sampled_from(textual))
                model.retype(name)
                ops.append(("retype", name))
        for _ in range(draw(st.integers(1, 4))):
            key = draw(st.integers(1, 4))
            seed += 1
            if key not in model.rows:
                ops.append(("insert", key, dict.fromkeys(model.columns, seed)))
                model.rows[key] = {n: value(model.columns[n], seed)[1] for n in model.columns}
                model.written()
            elif draw(st.booleans()):
                ops.append(("delete", key))
                del model.rows[key]
            else:
                # NEW_ROW captures send every column; NEW_VALUES captures the changed ones.
                every = sorted(model.columns)
                if not every:
                    continue
                if model.capture == "NEW_VALUES":
                    names = sorted(set(draw(st.lists(st.sampled_from(every), min_size=1))))
                else:
                    names = every
                ops.append(("update", key, dict.fromkeys(names, seed)))
                for n in names:
                    model.rows[key][n] = value(model.columns[n], seed)[1]
                model.written()
        if draw(st.booleans()):
            ops.append(("watched",))
            model.watched_read()
        stages.append(ops)
    return stages, model, draw(st.integers(1, len(stages) - 1))


def writers(stages: list[list[tuple]], capture: str) -> list[Callable[[ChangeLog], None]]:
    """One change-log writer per stage; each change log follows its own copy of the schema."""
    schemas: dict[str, Spanner] = {}

    def write(changelog: ChangeLog, ops: list[tuple]) -> None:
        schema = schemas.setdefault(changelog.uri, Spanner(capture=capture))
        changelog.value_capture_type = capture
        watched = None
        for op in ops:
            if op[0] == "watched":
                watched = {"t": schema.column_types()}
            elif op[0] == "add":
                schema.add(op[1], op[2])
            elif op[0] == "drop":
                schema.drop(op[1])
            elif op[0] == "retype":
                schema.retype(op[1])
            elif op[0] == "delete":
                changelog.columns["t"] = schema.column_types()
                changelog.commit(("t", "DELETE", {"id": str(op[1])}, {}))
            else:
                mod_type = "INSERT" if op[0] == "insert" else "UPDATE"
                sent = {n: value(schema.columns[n], s)[0] for n, s in op[2].items()}
                listed = schema.column_types()
                if mod_type == "UPDATE" and capture == "NEW_VALUES":
                    listed = tuple(c for c in listed if c.is_primary_key or c.name in sent)
                changelog.columns["t"] = listed
                changelog.commit(("t", mod_type, {"id": str(op[1])}, sent))
        changelog.land(watched)

    return [functools.partial(write, ops=ops) for ops in stages]


@settings(
    max_examples=3,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(history=histories())
def test_any_history_replays_to_the_same_mirrors_equal_to_spanner(
    spark,
    tmp_path_factory: pytest.TempPathFactory,
    history: tuple[list[list[tuple]], Spanner, int],
) -> None:
    stages, model, stopped_after = history
    folder = tmp_path_factory.mktemp("history")
    mirrors = processed_three_ways(
        spark, folder, writers(stages, model.capture), "t", "id", stopped_after
    )
    assert mirrors[0] == mirrors[1] == mirrors[2], f"the three ways disagree: {stages}"
    # A dropped column stays in the mirror, NULL, once a record or a schema row has shown the
    # drop; a column no
    # record has carried since it was added is not in the mirror yet: NULL, as in Spanner.
    shown = {n for row in mirrors[0].values() for n in row} - {"id", *model.columns}
    shown -= set(model.unseen_drops)
    expected = {key: {"id": key, **row, **dict.fromkeys(shown)} for key, row in model.rows.items()}
    current = {
        key: {n: _instant(row.get(n)) for n in ("id", *model.columns, *shown)}
        for key, row in mirrors[0].items()
    }
    assert current == expected, (model.capture, stages)


def _instant(value: Any) -> Any:
    """Spark collects a TIMESTAMP as a naive datetime in the JVM's time zone."""
    if isinstance(value, dt.datetime) and value.tzinfo is None:
        return value.astimezone(dt.UTC)
    return value
