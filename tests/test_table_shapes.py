"""Table shapes learned from the change log: generations and drops (pure rules, then one Delta
change log read by the catalog, no Spark)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql import types as T

from ingest.model.encoding import canonical_json
from ingest.model.records import ColumnType
from ingest.model.timestamps import to_rfc3339
from pipeline.catalog import discover_shapes
from pipeline.shapes import Interval, Label, Source, TableShape, merge_shapes
from pipeline.types import state_type
from tests.builders import ChangeLog

ID = {"name": "id", "type": {"code": "INT64"}, "is_primary_key": True, "ordinal_position": 1}
KINDS = {"STRING": {"code": "STRING"}, "INT64": {"code": "INT64"}, "FLOAT32": {"code": "FLOAT32"}}


def column_types(**columns: str) -> str:
    listed = [ID] + [
        {"name": name, "type": KINDS[kind], "is_primary_key": False, "ordinal_position": n}
        for n, (name, kind) in enumerate(columns.items(), 2)
    ]
    return canonical_json(listed)


def at(second: int) -> str:
    return f"2026-11-23T10:00:{second:02d}.000000000Z"


Row = tuple[int, str, bool, bool]
"""(second, column_types, lists every column, schema row)"""


def shape_of(*rows: tuple[int, str, bool] | Row) -> TableShape:
    """The shape of table t from rows, one interval per row, resolved row by row when intervals
    overlap."""
    full = tuple((*row, False)[:4] for row in rows)
    intervals = [Interval("t", text, at(s), at(s), every, kind) for s, text, every, kind in full]
    return merge_shapes(intervals, _resolver(full))["t"]


def _resolver(rows: tuple[Row, ...]) -> Any:
    def resolve(table: str, column: str, labels: dict[Source, Label]) -> list[tuple[str, Label]]:
        runs: list[tuple[str, Label]] = []
        for second, text, every, schema in sorted(rows):
            source = (text, every, schema)
            if source in labels and (not runs or runs[-1][1] != labels[source]):
                runs.append((at(second), labels[source]))
        return runs

    return resolve


def test_a_column_missing_from_a_record_listing_every_column_is_dropped() -> None:
    shape = shape_of(
        (1, column_types(a="STRING", tier="STRING"), True),
        (3, column_types(a="STRING"), True),
    )
    tier = shape.column("tier")
    assert tier is not None
    assert shape.dropped == (("tier", at(3)),)
    assert shape.current_field(tier) is None
    assert shape.mirror_generation(tier) == 2
    assert shape.stale_fields(at(2)) == []
    assert shape.stale_fields(at(3)) == ["tier"]


def test_updates_of_new_values_streams_list_changed_columns_only_and_drop_nothing() -> None:
    shape = shape_of(
        (1, column_types(a="STRING", tier="STRING"), True),
        (3, column_types(a="STRING"), False),
    )
    assert shape.dropped == ()
    assert shape.stale_fields(at(3)) == []


def test_a_column_added_later_is_one_generation() -> None:
    shape = shape_of(
        (1, column_types(a="STRING"), True), (2, column_types(a="STRING", b="INT64"), True)
    )
    assert shape.generations == () and shape.dropped == ()


def test_a_column_back_after_a_drop_is_a_new_generation_even_with_the_same_type() -> None:
    shape = shape_of(
        (1, column_types(a="STRING", tier="STRING"), True),
        (3, column_types(a="STRING"), True),
        (5, column_types(a="STRING", tier="STRING"), True),
    )
    tier = shape.column("tier")
    assert tier is not None
    assert [(g.field, g.since) for g in shape.generations_of(tier)] == [
        ("tier", ""),
        ("tier__g2", at(5)),
    ]
    assert shape.dropped == ()
    assert shape.current_field(tier) == "tier__g2"
    assert shape.mirror_generation(tier) == 2
    assert shape.stale_fields(at(2)) == ["tier__g2"]
    assert shape.stale_fields(at(5)) == ["tier"]


def test_a_newer_record_that_lists_every_column_but_lacks_a_live_one_is_learned_again() -> None:
    shape = shape_of((1, column_types(a="STRING", tier="STRING"), True))
    without_tier = [
        ColumnType("id", {"code": "INT64"}, True, 1),
        ColumnType("a", {"code": "STRING"}, False, 2),
    ]
    assert shape.covers(at(2), without_tier, every_column=False)
    assert not shape.covers(at(2), without_tier, every_column=True)
    assert shape.covers(at(1), without_tier, every_column=True)


def test_a_schema_row_lacking_a_column_shows_it_dropped_under_any_capture() -> None:
    shape = shape_of(
        (1, column_types(a="STRING", tier="STRING"), False),
        (2, column_types(a="STRING"), False),
        (4, column_types(a="STRING"), True, True),
    )
    tier = shape.column("tier")
    assert tier is not None
    assert shape.dropped == (("tier", at(4)),)
    assert shape.current_field(tier) is None
    assert shape.learned_through == at(4)


def test_a_schema_row_adds_only_a_column_no_record_carried() -> None:
    """A column no record carried (added to a table nobody writes since, or under a capture
    that lists changed columns only) comes from schema rows, with their type: every row holds
    NULL there. A column back after a drop stays a record's to show (its type, its values)."""
    shape = shape_of(
        (1, column_types(a="STRING", tier="STRING"), True),
        (2, column_types(a="STRING"), True, True),
        (3, column_types(a="STRING", tier="INT64", b="INT64"), True, True),
    )
    assert [c.name for c in shape.columns] == ["id", "a", "tier", "b"]
    b = shape.column("b")
    assert b is not None and b.type == {"code": "INT64"}
    assert [g.since for g in shape.generations_of(b)] == [""]
    assert shape.dropped == (("tier", at(2)),)
    back = shape_of(
        (1, column_types(a="STRING", tier="STRING"), True),
        (2, column_types(a="STRING"), True, True),
        (3, column_types(a="STRING", tier="STRING"), True, True),
        (5, column_types(a="STRING", tier="STRING"), False),
    )
    tier = back.column("tier")
    assert tier is not None
    assert [(g.field, g.since) for g in back.generations_of(tier)] == [
        ("tier", ""),
        ("tier__g2", at(5)),
    ]
    assert back.dropped == ()


def test_a_table_only_schema_rows_name_has_its_shape_from_them() -> None:
    """A new job's first version names every captured table before its snapshot lands."""
    intervals = [
        Interval("t", column_types(a="STRING"), at(1), at(1), True),
        Interval("quiet", column_types(a="INT64"), at(2), at(2), True, True),
    ]
    shapes = merge_shapes(intervals)
    assert sorted(shapes) == ["quiet", "t"]
    assert [(c.name, c.type["code"]) for c in shapes["quiet"].columns] == [
        ("id", "INT64"),
        ("a", "INT64"),
    ]


def test_a_newer_schema_row_lacking_a_live_column_is_learned_again() -> None:
    shape = shape_of((1, column_types(a="STRING", tier="STRING"), True))
    assert shape.shows_no_new_drop(at(2), {"id", "a", "tier"})
    assert not shape.shows_no_new_drop(at(2), {"id", "a", "tier", "new"}), "an added column"
    assert not shape.shows_no_new_drop(at(2), {"id", "a"})
    assert shape.shows_no_new_drop(at(1), {"id", "a"})


LISTS = {
    "a": column_types(a="STRING"),
    "a_tier": column_types(a="STRING", tier="STRING"),
    "a_tier_int": column_types(a="STRING", tier="INT64"),
    "a_tier_f32": column_types(a="STRING", tier="FLOAT32"),
}


def oracle(rows: list[Row]) -> tuple[list[tuple[str, T.DataType]], str | None]:
    """tier's generations and drop, walking the rows one by one."""
    lives: list[tuple[str, T.DataType]] = []
    previous: Label = None
    dropped = None
    for second, name, every, schema in sorted(rows):
        types = {c["name"]: c["type"] for c in json.loads(LISTS[name])}
        if "tier" in types:
            if schema:
                continue
            label = state_type(types["tier"])
            if label != previous:
                lives.append((at(second) if lives else "", label))
            previous, dropped = label, None
        elif every and lives:
            if previous is not None:
                dropped = at(second)
            previous = None
    return lives, dropped


KINDS_OF_ROWS = {"changed columns": (False, False), "every column": (True, False)}
KINDS_OF_ROWS["schema row"] = (True, True)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(sorted(LISTS)), st.sampled_from(sorted(KINDS_OF_ROWS))),
        min_size=1,
        max_size=12,
    )
)
def test_generations_and_drops_from_intervals_equal_a_row_by_row_walk(
    events: list[tuple[str, str]],
) -> None:
    rows = [(second, name, *KINDS_OF_ROWS[kind]) for second, (name, kind) in enumerate(events)]
    if not any("tier" in LISTS[name] and not schema for _, name, _, schema in rows):
        return
    grouped: dict[Source, list[int]] = {}
    for second, name, every, schema in rows:
        grouped.setdefault((LISTS[name], every, schema), []).append(second)
    intervals = [
        Interval("t", text, at(min(seconds)), at(max(seconds)), every, schema)
        for (text, every, schema), seconds in grouped.items()
    ]
    resolver = _resolver(tuple((s, LISTS[n], e, k) for s, n, e, k in rows))
    shape = merge_shapes(intervals, resolver)["t"]
    tier = shape.column("tier")
    assert tier is not None
    lives, dropped = oracle(rows)
    assert [(g.since, g.state_type) for g in shape.generations_of(tier)] == lives
    assert shape.dropped_since("tier") == dropped


def test_the_catalog_reads_drops_and_returns_from_the_change_log(tmp_path: Path) -> None:
    """The same column list before and after a drop: intervals overlap, rows decide."""
    changelog = ChangeLog(str(tmp_path / "changelog"))
    with_tier = (
        ColumnType("id", {"code": "INT64"}, True, 1),
        ColumnType("tier", {"code": "STRING"}, False, 2),
    )
    changelog.columns["t"] = with_tier
    changelog.commit(("t", "INSERT", {"id": "1"}, {"tier": "gold"}))
    changelog.land()
    changelog.columns["t"] = with_tier[:1]
    dropped_at = changelog.commit(("t", "UPDATE", {"id": "1"}, {})).commit_timestamp
    changelog.land()
    changelog.columns["t"] = with_tier
    back_at = changelog.commit(("t", "UPDATE", {"id": "1"}, {"tier": None})).commit_timestamp
    changelog.land()
    shape = discover_shapes(changelog.uri)["t"]
    generations = shape.generations_of(with_tier[1])
    assert [g.field for g in generations] == ["tier", "tier__g2"]
    assert generations[1].since == to_rfc3339(back_at)
    assert shape.dropped == ()

    changelog.columns["t"] = with_tier[:1]
    gone_again = changelog.commit(("t", "UPDATE", {"id": "1"}, {})).commit_timestamp
    changelog.land()
    shape = discover_shapes(changelog.uri)["t"]
    assert shape.dropped == (("tier", to_rfc3339(gone_again)),)
    assert dropped_at < back_at < gone_again


def test_the_catalog_reads_a_drop_from_a_schema_row(tmp_path: Path) -> None:
    """A NEW_VALUES stream: the update lists changed columns only, the schema row shows tier
    gone; a table only schema rows name has its shape from them."""
    changelog = ChangeLog(str(tmp_path / "changelog"), value_capture_type="NEW_VALUES")
    with_tier = (
        ColumnType("id", {"code": "INT64"}, True, 1),
        ColumnType("tier", {"code": "STRING"}, False, 2),
        ColumnType("a", {"code": "STRING"}, False, 3),
    )
    changelog.columns["t"] = with_tier
    changelog.commit(("t", "INSERT", {"id": "1"}, {"tier": "gold", "a": "x"}))
    changelog.land()
    changelog.columns["t"] = (with_tier[0], with_tier[2])
    changelog.commit(("t", "UPDATE", {"id": "1"}, {"a": "y"}))
    changelog.land(watched={"t": with_tier})
    assert discover_shapes(changelog.uri)["t"].dropped == ()
    changelog.land(watched={"t": (with_tier[0], with_tier[2]), "quiet": with_tier})
    shapes = discover_shapes(changelog.uri)
    assert sorted(shapes) == ["quiet", "t"]
    assert shapes["t"].dropped == (("tier", to_rfc3339(changelog.clock)),)
    assert [c.name for c in shapes["quiet"].columns] == ["id", "tier", "a"]
