"""Watched columns read from information_schema, and when the ingest service lands them as schema
rows: the type mapping and the polling rules without I/O, then both dialects on the emulator
against what data change records list."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import structlog
from deltalake import DeltaTable

from ingest.changestream.query import Dialect
from ingest.changestream.watched_columns import column_type, read_watched_columns
from ingest.delta.batcher import Batcher
from ingest.delta.landing import STALE_READ_LIMIT_NANOS, ChangeLogLanding, WatchedColumnsPoll
from ingest.delta.schema_rows import landed_watched_columns
from ingest.model.records import ColumnType, WatchedColumns
from ingest.model.resume import ResumablePartitions, ResumePoint
from ingest.model.timestamps import NANOS_PER_SECOND, parse_rfc3339
from tests.builders import ChangeLog
from tests.checks import start_after_setup
from tests.processes import tail_argv

GOOGLESQL = Dialect.GOOGLE_STANDARD_SQL
POSTGRESQL = Dialect.POSTGRESQL


def test_information_schema_types_read_as_record_types() -> None:
    assert column_type("STRING(MAX)", GOOGLESQL) == {"code": "STRING"}
    assert column_type("BYTES(16)", GOOGLESQL) == {"code": "BYTES"}
    assert column_type("ARRAY<STRING(10)>", GOOGLESQL) == {
        "code": "ARRAY",
        "array_element_type": {"code": "STRING"},
    }
    assert column_type("PROTO<a.b.C>", GOOGLESQL) == {"code": "PROTO", "proto_type_fqn": "a.b.C"}
    assert column_type("character varying(32)", POSTGRESQL) == {"code": "STRING"}
    assert column_type("numeric[]", POSTGRESQL) == {
        "code": "ARRAY",
        "array_element_type": {"code": "NUMERIC", "type_annotation": "PG_NUMERIC"},
    }
    assert column_type("jsonb", POSTGRESQL) == {"code": "JSON", "type_annotation": "PG_JSONB"}
    assert column_type("timestamp with time zone", POSTGRESQL) == {"code": "TIMESTAMP"}


@dataclass
class FakeSink:
    commits: list[tuple[int, WatchedColumns | None]] = field(default_factory=list)

    def commit(
        self, transactions: Any, point: ResumePoint, watched: Any = None, snapshot: Any = ()
    ) -> Any:
        self.commits.append((point.low_watermark, watched))

        @dataclass
        class Result:
            version: int = len(self.commits)
            delta_version: int = 0
            rows: int = 0
            transactions: int = 0
            replayed: bool = False

        return Result()


ID = ColumnType("id", {"code": "INT64"}, True, 1)
TIER = ColumnType("tier", {"code": "STRING"}, False, 2)
NOW = parse_rfc3339("2026-11-23T10:00:00Z")


def batcher(sink: FakeSink, schema: list[Any], clock: list[float]) -> Batcher:
    def read(timestamp: int) -> WatchedColumns:
        answer = schema[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    log = structlog.get_logger()
    watched = WatchedColumnsPoll(read, 10.0, log, wall_clock=lambda: NOW)
    return Batcher(
        ChangeLogLanding(
            sink,  # type: ignore[arg-type]
            watched,
            log,
            retention_nanos=86_400 * NANOS_PER_SECOND,
            wall_clock=lambda: NOW,
        ),
        flush_latency_s=1.0,
        max_rows=100,
        checkpoint_interval_s=4.0,
        monotonic=lambda: clock[0],
        last_commit_at=0.0,
    )


def released(b: Batcher, seconds_ago: int) -> None:
    b.resume_point = ResumePoint(NOW - seconds_ago * NANOS_PER_SECOND, ResumablePartitions((), ()))


def test_schema_rows_ride_on_the_next_due_commit_for_changed_tables_only() -> None:
    sink, clock = FakeSink(), [1.0]
    schema: list[Any] = [{"t": (ID, TIER), "u": (ID,)}]
    b = batcher(sink, schema, clock)
    b.on_tick()
    assert sink.commits == [], "nothing released yet: no watermark to read at"
    released(b, 9)
    clock[0] = 3.0
    b.on_tick()
    assert sink.commits == [], "schema rows never force a commit of their own"
    clock[0] = 4.0
    b.on_tick()
    assert sink.commits == [(NOW - 9 * NANOS_PER_SECOND, {"t": (ID, TIER), "u": (ID,)})]
    schema[0] = {"t": (ID,), "u": (ID,)}
    released(b, 8)
    clock[0] = 8.0
    b.on_tick()
    assert sink.commits[-1] == (NOW - 8 * NANOS_PER_SECOND, {}), "not read within the interval"
    released(b, 7)
    clock[0] = 14.0
    b.on_tick()
    assert sink.commits[-1] == (NOW - 7 * NANOS_PER_SECOND, {"t": (ID,)}), "read at the commit's W"
    released(b, 6)
    clock[0] = 24.0
    b.on_tick()
    assert sink.commits[-1] == (NOW - 6 * NANOS_PER_SECOND, {}), "unchanged columns land nothing"


def test_a_failed_or_too_stale_read_lands_nothing_and_is_tried_again() -> None:
    sink, clock = FakeSink(), [4.0]
    schema: list[Any] = [RuntimeError("deadline exceeded")]
    b = batcher(sink, schema, clock)
    released(b, 1)
    b.on_tick()
    assert sink.commits == [(NOW - NANOS_PER_SECOND, {})], "the checkpoint commits all the same"
    schema[0] = {"t": (ID, TIER)}
    b.resume_point = ResumePoint(NOW - STALE_READ_LIMIT_NANOS - 1, ResumablePartitions((), ()))
    clock[0] = 14.0
    b.on_tick()
    assert sink.commits[-1] == (NOW - STALE_READ_LIMIT_NANOS - 1, {})
    released(b, 1)
    clock[0] = 24.0
    b.on_tick()
    assert sink.commits[-1] == (NOW - NANOS_PER_SECOND, {"t": (ID, TIER)})


FLAG = ColumnType("flag", {"code": "BOOL"}, False, 3)


@dataclass
class FakeSnapshots:
    """The on-demand snapshot as the batcher sees it: busy or free, recording or refusing."""

    busy: bool = False
    refuse: bool = False
    asked: list[tuple[str, ...]] = field(default_factory=list)
    requested: tuple[str, ...] = ()

    def due(self) -> bool:
        return False

    def backfill(self, tables: Any) -> bool:
        if self.busy:
            return False
        self.requested = tuple(tables)
        self.asked.append(self.requested)
        return True

    def before_commit(self, low_watermark: int, transactions: Any) -> tuple[list[Any], bool]:
        return [], bool(self.requested)

    def recorded(self) -> tuple[str, ...]:
        return () if self.refuse else self.requested

    def after_commit(self) -> None:
        self.requested = ()


def test_a_table_that_gains_a_column_lands_its_schema_rows_with_a_snapshot_of_it() -> None:
    """Spanner fills an added column's rows with its DEFAULT without change records: the table
    is read again, recorded by the commit that lands its new columns, or neither lands. A
    column without a DEFAULT is NULL in every row: its schema rows land alone."""
    sink, clock, snapshots = FakeSink(), [4.0], FakeSnapshots()
    schema: list[Any] = [{"t": (ID, TIER), "u": (ID,)}]
    b = batcher(sink, schema, clock)
    b.riders = snapshots
    b.landing.watched.read_defaults = lambda at: {("t", "flag"), ("u", "tier")}
    released(b, 9)
    b.on_tick()
    assert snapshots.asked == [], "columns seen for the first time are no added columns"
    schema[0] = {"t": (ID,), "u": (ID,)}
    released(b, 8)
    clock[0] = 14.0
    b.on_tick()
    assert snapshots.asked == [] and sink.commits[-1][1] == {"t": (ID,)}, "a drop reads nothing"
    schema[0] = {"t": (ID, FLAG), "u": (ID,)}
    snapshots.busy = True
    released(b, 7)
    clock[0] = 24.0
    b.on_tick()
    assert sink.commits[-1][1] == {}, "held back while another snapshot runs"
    snapshots.busy, snapshots.refuse = False, True
    released(b, 6)
    clock[0] = 34.0
    b.on_tick()
    assert sink.commits[-1][1] == {}, "held back when the request was not recorded"
    snapshots.refuse = False
    released(b, 5)
    clock[0] = 44.0
    b.on_tick()
    assert sink.commits[-1][1] == {"t": (ID, FLAG)}
    assert snapshots.asked == [("t",), ("t",)]
    schema[0] = {"t": (ID, FLAG), "u": (ID, replace(TIER, ordinal_position=3))}
    released(b, 4)
    clock[0] = 54.0
    b.on_tick()
    assert snapshots.asked[-1] == ("u",) and sink.commits[-1][1] == {"u": schema[0]["u"]}
    note = ColumnType("note", {"code": "STRING"}, False, 4)
    schema[0] = {"t": (ID, FLAG, note), "u": schema[0]["u"]}
    released(b, 3)
    clock[0] = 64.0
    b.on_tick()
    assert len(snapshots.asked) == 3, "a column without a DEFAULT is read from no table"
    assert sink.commits[-1][1] == {"t": (ID, FLAG, note)}


def test_a_column_added_while_no_process_ran_is_found_from_the_change_log(tmp_path: Any) -> None:
    """A restarted process compares with the newest schema rows the change log holds."""
    changelog = ChangeLog(str(tmp_path / "changelog"))
    changelog.land(watched={"t": (ID, TIER), "u": (ID,)})
    changelog.land(watched={"t": (ID,)})
    known = landed_watched_columns(DeltaTable(str(tmp_path / "changelog")))
    assert known == {"t": (ID,), "u": (ID,)}
    sink, clock, snapshots = FakeSink(), [4.0], FakeSnapshots()
    b = batcher(sink, [{"t": (ID, FLAG), "u": (ID,)}], clock)
    b.riders, b.landing.watched.known_columns = snapshots, known
    released(b, 9)
    b.on_tick()
    assert snapshots.asked == [("t",)]


def _records(database: Any, stream: str, start: int, end: int) -> list[tuple[int, dict]]:
    """(commit timestamp, record) of every data change record, read by `ingest tail`."""
    printed = subprocess.run(
        tail_argv(database.database_id, stream, start, end, "--heartbeat-ms", "1000"),
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ),
    ).stdout
    return [
        (parse_rfc3339(t["commit_timestamp"]), record)
        for t in map(json.loads, printed.splitlines())
        for record in t["records"]
    ]


WATCHED_TABLES = {
    "g_rows": ["g"],
    "all_changes": ["accounts", "all_types", "g", "transfers"],
    "account_balances": ["accounts"],
}


@pytest.mark.emulator
@pytest.mark.parametrize("dialect", ["googlesql", "postgresql"])
def test_watched_columns_equal_what_new_row_records_list(new_database, dialect: str) -> None:
    """Every type of the sample's all_types table, a stored generated column (never watched)
    and a stream watching one column: the schema read at a record's commit timestamp lists the
    columns, types, keys and ordinals the record lists."""
    database = new_database(dialect, accounts=0)
    if dialect == "googlesql":
        ddl = [
            "CREATE TABLE g (id INT64 NOT NULL, a INT64, b INT64 AS (a * 2) STORED, "
            "c ARRAY<NUMERIC>) PRIMARY KEY (id)",
            "CREATE CHANGE STREAM g_rows FOR g OPTIONS (value_capture_type = 'NEW_ROW')",
        ]
    else:
        ddl = [
            "CREATE TABLE g (id bigint NOT NULL, a bigint, b bigint GENERATED ALWAYS AS (a * 2) "
            "STORED, c numeric[], d jsonb, PRIMARY KEY (id))",
            "CREATE CHANGE STREAM g_rows FOR g WITH (value_capture_type = 'NEW_ROW')",
        ]
    database.update_ddl(ddl).result(120)
    start = start_after_setup()

    def write(transaction: Any) -> None:
        transaction.execute_update("INSERT INTO g (id, a) VALUES (1, 2)")
        transaction.execute_update("INSERT INTO all_types (id, variant) VALUES (1, 'x')")
        transaction.execute_update(
            "INSERT INTO accounts (account_id, owner, balance) VALUES (1, 'o', 1)"
        )

    database.run_in_transaction(write)
    end = start_after_setup()
    compared = set()
    for stream in ("g_rows", "all_changes", "account_balances"):
        for committed, record in _records(database, stream, start, end):
            watched = read_watched_columns(database, stream, Dialect(dialect), committed)
            listed = [
                ColumnType(c["name"], c["type"], c["is_primary_key"], c["ordinal_position"])
                for c in record["column_types"]
            ]
            assert list(watched[record["table_name"]]) == listed, (stream, record["table_name"])
            compared.add((stream, record["table_name"]))
        tables = sorted(read_watched_columns(database, stream, Dialect(dialect), end))
        assert tables == WATCHED_TABLES[stream]
    assert compared == {
        ("g_rows", "g"),
        ("all_changes", "g"),
        ("all_changes", "all_types"),
        ("all_changes", "accounts"),
        ("account_balances", "accounts"),
    }
