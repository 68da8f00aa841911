"""Columns added to tables on a stream with Spanner's default options (``OLD_AND_NEW_VALUES``
capture, the product's default heartbeat), from the real emulator through the real ingest
service and pipeline processes.

Spanner fills an added column's existing rows (its DEFAULT, else NULL) without writing a data
change record, and a table nobody writes afterwards sends none at all (issue 40): a mirror kept
NULL where Spanner held the default, or never gained the column. The ingest reads a table whose
added column has a DEFAULT again; a column without one comes from the schema rows. The mirrors,
the histories and a processor's typed feed must equal Spanner at W, through a kill -9 of the
pipeline between the DDL and its next batch.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator, Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable
from google.cloud import spanner
from pyspark.sql import types as T

from emulator.bootstrap import bootstrap
from emulator.processes import kill_tree
from emulator.verify import changelog_watermark
from ingest.model.timestamps import from_datetime, to_datetime, to_rfc3339
from pipeline.as_of import history_as_of
from pipeline.history import Histories
from pipeline.user_processors import Change, ChangeProcessor, State
from pipeline.user_processors.outputs import output_uri
from tests.checks import apply_ddl, assert_mirrors_equal, compare_at_watermark
from tests.processes import INGEST_STOP_S, Pipeline, Service, service_in, wait_until

pytestmark = pytest.mark.emulator

STREAM = "defaults_for_all"
"""A stream created without options (OLD_AND_NEW_VALUES, what most users have), FOR ALL: a
third stream on the sample's accounts, the most Spanner allows."""
TABLES = ("orders", "quiet")
Row = dict[str, Any]


def text(value: Any) -> Any:
    """A value as both sides compare it: NUMERIC by its number, not its scale."""
    if isinstance(value, Decimal):
        return format(value.normalize(), "f")
    return value


class LatestValues(ChangeProcessor):
    """Every change of the feed, as it arrives: folding them per key gives the table."""

    name = "latest_values"
    tables = TABLES
    group_by = {"orders": ("id",), "quiet": ("id",)}
    state = {}
    output = T.StructType(
        [
            T.StructField("table_name", T.StringType()),
            T.StructField("id", T.LongType()),
            T.StructField("position", T.StringType()),
            T.StructField("is_delete", T.BooleanType()),
            T.StructField("values", T.StringType()),
        ]
    )

    def process(self, group: str | None, changes: Sequence[Change], state: State) -> Iterator[Row]:
        for change in changes:
            values = {name: text(value) for name, value in change.values.items()}
            yield {
                "table_name": change.table,
                "id": change.keys["id"],
                "position": json.dumps(change.position),
                "is_delete": change.is_delete,
                "values": json.dumps(values, sort_keys=True),
            }


def folded_feed(uri: str, watermark: str) -> dict[str, dict[int, Row]]:
    """The processor's output folded in change-log order up to W: each key's values over its
    last ones (a first image replaces them all), gone at a delete."""
    rows = DeltaTable(uri).to_pyarrow_table().to_pylist()
    tables: dict[str, dict[int, Row]] = {name: {} for name in TABLES}
    for row in sorted(rows, key=lambda r: json.loads(r["position"])):
        if json.loads(row["position"])[0] > watermark:
            continue
        held = tables[row["table_name"]]
        if row["is_delete"]:
            held.pop(row["id"], None)
        else:
            held[row["id"]] = {**held.get(row["id"], {}), **json.loads(row["values"])}
    return tables


def spanner_tables(database: Any, at: int) -> dict[str, dict[int, Row]]:
    """Each table read at exactly ``at``, its columns by name."""
    read: dict[str, dict[int, Row]] = {}
    with database.snapshot(read_timestamp=to_datetime(at), multi_use=True) as snapshot:
        for table in TABLES:
            result = snapshot.execute_sql(f"SELECT * FROM {table}")
            rows = list(result)
            names = [field.name for field in result.fields]
            read[table] = {
                row[0]: {n: text(v) for n, v in zip(names[1:], row[1:], strict=True)}
                for row in rows
            }
    return read


def spanner_columns(database: Any, table: str) -> list[str]:
    with database.snapshot() as snapshot:
        rows = snapshot.execute_sql(
            "SELECT column_name FROM information_schema.columns WHERE table_name = @t "
            "ORDER BY ordinal_position",
            params={"t": table},
            param_types={"t": spanner.param_types.STRING},
        )
        return [row[0] for row in rows]


def read_again(service: Service, last: int, changelog: Path) -> bool:
    """The table whose added columns have a DEFAULT read again, and the last commit landed."""
    events = service.events()
    recorded = [e for e in events if e["event"] == "column_backfill_recorded"]
    done = [e for e in events if e["event"] == "table_snapshot_done"]
    backfilled = {table for e in recorded for table in e["tables"]}
    watermark = changelog_watermark(str(changelog))
    return (
        backfilled >= {"orders"}
        and len(done) >= len(recorded)
        and watermark is not None
        and watermark.low_watermark >= last
    )


def present(tables: dict[str, dict[int, Row]]) -> dict[str, dict[int, Row]]:
    """Rows without their NULL columns: a change need not carry a column it leaves NULL."""
    return {
        table: {key: {n: v for n, v in row.items() if v is not None} for key, row in rows.items()}
        for table, rows in tables.items()
    }


def test_added_columns_reach_mirrors_histories_and_the_feed_on_a_default_stream(
    spanner_client: spanner.Client, tmp_path: Path
) -> None:
    database = bootstrap(spanner_client, database_id=f"defaults_{os.getpid() % 10000}", accounts=0)
    apply_ddl(
        database,
        "CREATE TABLE orders (id INT64 NOT NULL, note STRING(MAX)) PRIMARY KEY (id)",
        "CREATE TABLE quiet (id INT64 NOT NULL, v INT64) PRIMARY KEY (id)",
        f"CREATE CHANGE STREAM {STREAM} FOR ALL",
    )
    changelog = tmp_path / "changelog"
    service = service_in(
        tmp_path,
        database.database_id,
        start=None,
        SPANNER_CHANGE_STREAM=STREAM,
        INGEST_HEARTBEAT_MS="1000",
        INGEST_WATCHED_COLUMNS_INTERVAL_S="2",
    )
    pipeline = Pipeline(
        changelog,
        tmp_path,
        tmp_path / "pipeline.log",
        PIPELINE_HISTORY_TABLES="*",
        PIPELINE_HISTORY_ROOT=str(tmp_path / "history"),
        PIPELINE_PROCESSORS=f"{__name__}:LatestValues",
        PIPELINE_PROCESSOR_ROOT=str(tmp_path / "processors"),
    )
    ingest = service.start()
    running = None
    try:
        service.wait_for("ingest_started", 1, timeout=120, process=ingest)
        with database.batch() as batch:
            batch.insert("orders", ("id", "note"), [(i, f"n{i}") for i in range(1, 41)])
            batch.insert("quiet", ("id", "v"), [(i, i) for i in range(1, 21)])
        running = pipeline.start()
        pipeline.wait_for("pipeline_batch", 1, timeout=400, process=running)

        apply_ddl(
            database,
            "ALTER TABLE orders ADD COLUMN status STRING(20) NOT NULL DEFAULT ('new')",
            "ALTER TABLE orders ADD COLUMN price NUMERIC DEFAULT (NUMERIC '1.5')",
            "ALTER TABLE quiet ADD COLUMN flag BOOL",
        )
        kill_tree(running)  # between the DDL and the pipeline's next batch
        running.wait()
        with database.batch() as batch:
            batch.update("orders", ("id", "note"), [(i, f"m{i}") for i in range(1, 11)])
            batch.insert("orders", ("id", "note"), [(41, "late")])
        apply_ddl(database, "ALTER TABLE orders ALTER COLUMN price SET DEFAULT (NUMERIC '2.5')")
        with database.batch() as batch:
            batch.insert("orders", ("id", "note"), [(42, "later")])
            batch.delete("orders", spanner.KeySet(keys=[[2]]))
        last = from_datetime(batch.committed)

        running = pipeline.start()
        wait_until(lambda: read_again(service, last, changelog), 300, "the backfill", ingest)
        os.killpg(ingest.pid, signal.SIGTERM)  # its last commit is the change log's final W
        assert ingest.wait(timeout=INGEST_STOP_S) == 0, service.log.read_text()[-3000:]
        running.send_signal(signal.SIGUSR1)  # drain: process what the change log holds, exit
        assert running.wait(timeout=400) == 0, pipeline.log.read_text()[-3000:]
    finally:
        for process in (ingest, running):
            if process is not None and process.poll() is None:
                kill_tree(process)

    backfills = [e for e in service.events() if e["event"] == "column_backfill_recorded"]
    # quiet's added column has no DEFAULT: NULL in every row, shown by the schema rows alone
    assert {t for e in backfills for t in e["tables"]} == {"orders"}
    watermark = changelog_watermark(str(changelog))
    assert watermark is not None
    shapes, comparisons = compare_at_watermark(
        database, str(changelog), str(tmp_path / "mirrors"), TABLES
    )
    assert_mirrors_equal(comparisons)
    for table in TABLES:
        assert [c.name for c in shapes[table].columns] == spanner_columns(database, table), table
    expected = spanner_tables(database, watermark.low_watermark)
    assert expected["orders"][1]["status"] == "new" and expected["orders"][42]["price"] == "2.5"
    at = to_rfc3339(watermark.low_watermark)
    histories = Histories(str(tmp_path / "history"), frozenset({"*"}))
    as_of = history_as_of(histories, str(tmp_path / "mirrors"), at)
    for table in TABLES:
        from_history = {
            r["id"]: {n: text(v) for n, v in r.items() if n != "id" and not n.startswith("_")}
            for r in as_of.tables[table].to_pylist()
        }
        assert from_history == expected[table], table
    feed = folded_feed(output_uri(str(tmp_path / "processors"), "latest_values"), at)
    assert present(feed) == present(expected)
