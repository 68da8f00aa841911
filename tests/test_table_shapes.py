"""Table shapes learned from the change log: generations and drops (pure rules, then one Delta
change log read by the catalog, no Spark)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql import types as T

from ingest.encoding import canonical_json
from ingest.records import ColumnType
from ingest.timestamps import to_rfc3339
from pipeline.catalog import discover_shapes
from pipeline.types import Interval, Label, TableShape, merge_shapes, state_type
from tests.changelog_builder import ChangeLog

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


def shape_of(*rows: tuple[int, str, bool]) -> TableShape:
    """The shape of table t from (second, column_types, lists every column) rows, one interval
    per row, resolved row by row when intervals overlap."""
    intervals = [Interval("t", text, at(s), at(s), every) for s, text, every in rows]
    return merge_shapes(intervals, _resolver(rows))["t"]


def _resolver(rows: tuple[tuple[int, str, bool], ...]) -> Any:
    def resolve(
        table: str, column: str, labels: dict[tuple[str, bool], Label]
    ) -> list[tuple[str, Label]]:
        runs: list[tuple[str, Label]] = []
        for second, text, every in sorted(rows):
            if (text, every) in labels and (not runs or runs[-1][1] != labels[(text, every)]):
                runs.append((at(second), labels[(text, every)]))
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


LISTS = {
    "a": column_types(a="STRING"),
    "a_tier": column_types(a="STRING", tier="STRING"),
    "a_tier_int": column_types(a="STRING", tier="INT64"),
    "a_tier_f32": column_types(a="STRING", tier="FLOAT32"),
}


def oracle(rows: list[tuple[int, str, bool]]) -> tuple[list[tuple[str, T.DataType]], str | None]:
    """tier's generations and drop, walking the rows one by one."""
    lives: list[tuple[str, T.DataType]] = []
    previous: Label = None
    dropped = None
    for second, name, every in sorted(rows):
        types = {c["name"]: c["type"] for c in json.loads(LISTS[name])}
        if "tier" in types:
            label: Label = state_type(types["tier"])
            if label != previous:
                lives.append((at(second) if lives else "", label))
            previous, dropped = label, None
        elif every and lives:
            if previous is not None:
                dropped = at(second)
            previous = None
    return lives, dropped


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(sorted(LISTS)), st.booleans()), min_size=1, max_size=12))
def test_generations_and_drops_from_intervals_equal_a_row_by_row_walk(
    events: list[tuple[str, bool]],
) -> None:
    rows = [(second, name, every) for second, (name, every) in enumerate(events)]
    if not any("tier" in LISTS[name] for _, name, _ in rows):
        return
    grouped: dict[tuple[str, bool], list[int]] = {}
    for second, name, every in rows:
        grouped.setdefault((LISTS[name], every), []).append(second)
    intervals = [
        Interval("t", text, at(min(seconds)), at(max(seconds)), every)
        for (text, every), seconds in grouped.items()
    ]
    resolver = _resolver(tuple((s, LISTS[n], e) for s, n, e in rows))
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
