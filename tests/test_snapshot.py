"""The initial snapshot on the real emulator: a database that already holds rows lands in the
change log from one consistent timestamp T0, then from the stream after it, through kill -9 of the
ingest service.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import itertools
import json
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable
from google.protobuf import timestamp_pb2

from emulator.verify import latest_checkpoint
from emulator.workload import CommittedTransaction, load_existing_rows
from ingest.contract.changelog import SNAPSHOT_ROW
from ingest.delta.sink import DeltaChangeLogSink
from ingest.model.encoding import canonical_json
from ingest.model.records import ColumnType
from ingest.model.snapshot import SnapshotProgress
from ingest.model.timestamps import NANOS_PER_SECOND, from_datetime, to_rfc3339
from ingest.rules.snapshot_parts import key_ranges
from ingest.snapshot.reader import read_table, sample_keys
from tests.checks import ACCOUNTS, apply_ddl, crash_seed, hundred_thousand_rows
from tests.delta_checks import assert_change_log_invariants
from tests.processes import (
    INGEST_STOP_S,
    Service,
    background_workload,
    service_in,
    wait_until_landed,
)

KEYS = {
    "accounts": ["account_id"],
    "transfers": ["from_account_id", "transfer_id"],
    "all_types": ["id", "variant"],
}


def snapshot_rows(table: Path) -> list[dict[str, Any]]:
    dataset = DeltaTable(str(table)).to_pyarrow_dataset()
    return dataset.to_table(
        columns=["table_name", "keys", "new_values", "commit_timestamp_text", "column_types"],
        filter=pc.field("mod_type") == SNAPSHOT_ROW,
    ).to_pylist()


def spanner_keys(database: Any, table: str, read_timestamp: int, dialect: str) -> Counter:
    """Every key of the table at exactly ``read_timestamp``, as the change log writes it."""
    seconds, nanos = divmod(read_timestamp, NANOS_PER_SECOND)
    quote = '"' if dialect == "postgresql" else "`"
    columns = ", ".join(f"{quote}{k}{quote}" for k in KEYS[table])
    with database.snapshot(
        read_timestamp=timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos)
    ) as snapshot:
        rows = snapshot.execute_sql(f"SELECT {columns} FROM {table}")
        return Counter(
            json.dumps(dict(zip(KEYS[table], map(str, row), strict=True)), sort_keys=True)
            for row in rows
        )


def landed_keys(rows: list[dict[str, Any]], table: str) -> Counter:
    return Counter(
        json.dumps({k: str(v) for k, v in json.loads(r["keys"]).items()}, sort_keys=True)
        for r in rows
        if r["table_name"] == table
    )


def stop_once_landed(
    process: subprocess.Popen[bytes], changelog: Path, committed: list[CommittedTransaction]
) -> tuple[int, list[CommittedTransaction]]:
    """T0 and the transactions after it, once all have landed and the service has stopped."""
    try:
        checkpoint = latest_checkpoint(str(changelog))
        assert checkpoint is not None and checkpoint.snapshot is not None
        read_at = checkpoint.snapshot.read_timestamp
        expected = [t for t in committed if t.commit_timestamp > read_at]
        wait_until_landed(changelog, len(expected), timeout=180)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=INGEST_STOP_S) == 0
    finally:
        process.kill()
    return read_at, expected


@pytest.mark.emulator
def test_an_existing_database_lands_once_from_one_timestamp_through_kill_9(
    new_database, tmp_path: Path
) -> None:
    seed, rng = crash_seed()
    database = new_database("googlesql", accounts=ACCOUNTS, existing=hundred_thousand_rows(seed))
    changelog = tmp_path / "changelog"
    service = service_in(
        tmp_path,
        database.database_id,
        None,
        INGEST_SNAPSHOT_MODE="initial",
        INGEST_SNAPSHOT_CHUNK_ROWS="1000",
        INGEST_SNAPSHOT_WORKERS="2",
    )
    workload, stop_workload, committed = background_workload(database, 600, 20, seed)
    kills_during_snapshot = 0
    process = service.start()
    with killed_on_failure(service, stop_workload, workload):
        while True:
            started = service.count("snapshot_started")
            service.wait_for("snapshot_started", started + 1, timeout=90, process=process)
            time.sleep(rng.uniform(0.1, 1.2))
            process.kill()
            process.wait()
            checkpoint = latest_checkpoint(str(changelog))
            assert checkpoint is not None and checkpoint.snapshot is not None
            if checkpoint.snapshot.complete:
                break
            kills_during_snapshot += 1
            process = service.start()
            if kills_during_snapshot == 6:
                break
        process = service.start() if process.poll() is not None else process
        wait_until_streaming(service, process, timeout=300)
    read_at, expected = stop_once_landed(process, changelog, committed)

    assert kills_during_snapshot >= 5, f"seed {seed}: only {kills_during_snapshot} kills in time"
    rows = snapshot_rows(changelog)
    assert {r["commit_timestamp_text"] for r in rows} == {to_rfc3339(read_at)}
    for table in KEYS:
        landed = landed_keys(rows, table)
        assert max(landed.values()) == 1, f"seed {seed}: a {table} row landed twice"
        assert landed == spanner_keys(database, table, read_at, "googlesql"), (
            f"seed {seed}: {table} snapshot differs from Spanner at T0"
        )
    assert len(rows) >= 100_000
    # Every transaction after T0 once, none at or before it, all after every snapshot row.
    # The mirrors of these 100,000 rows are checked against Spanner by the Spark source's
    # standalone-cluster test (same rows, same reader, same pipeline) and the service's snapshot
    # through the mirrors by tests/test_make_run.py and tests/test_image.py: mirroring them here
    # again cost about 100 CPU-s of the suite (bench/RESULTS.md, "The suite").
    assert_change_log_invariants(changelog, expected)


@contextlib.contextmanager
def killed_on_failure(
    service: Service, stop_workload: threading.Event, workload: threading.Thread
) -> Iterator[None]:
    """What the block raises kills the service's processes (no service outlives a failed
    test); the workload stops either way."""
    try:
        yield
    except BaseException:
        for process in service.started:
            process.kill()
        raise
    finally:
        stop_workload.set()
        workload.join()


def wait_until_streaming(service: Service, process: Any, timeout: float) -> None:
    """Until the service streams after its snapshot: started, and three commits landed."""
    service.wait_for("ingest_started", 1, timeout=timeout, process=process)
    service.wait_for("delta_commit", 3, timeout=60, process=process)


def run_to_exit(service: Service, timeout: float = 180) -> tuple[int, str]:
    """Start the service, wait for it to exit; its exit code and the log's last lines."""
    process = service.start()
    try:
        code = process.wait(timeout=timeout)
    finally:
        process.kill()
    return code, service.log.read_text(errors="replace")[-2000:]


@pytest.mark.emulator
def test_postgresql_initial_snapshot_meets_the_stream_and_a_subset_stream_reads_only_its_columns(
    new_database, tmp_path: Path
) -> None:
    database = new_database("postgresql", accounts=500)
    load_existing_rows(database, accounts=500, transfers=300, all_types=200, seed=7)
    workload, stop_workload, committed = background_workload(database, 600, 10, 7)
    changelog = tmp_path / "changelog"
    service = service_in(
        tmp_path,
        database.database_id,
        None,
        INGEST_SNAPSHOT_MODE="initial",
        INGEST_SNAPSHOT_CHUNK_ROWS="128",
    )
    process = service.start()
    with killed_on_failure(service, stop_workload, workload):
        wait_until_streaming(service, process, timeout=120)
    read_at, expected = stop_once_landed(process, changelog, committed)
    rows = snapshot_rows(changelog)
    for table in KEYS:
        landed = landed_keys(rows, table)
        assert landed == spanner_keys(database, table, read_at, "postgresql"), table
    assert_change_log_invariants(changelog, expected)

    # A stream on one column of one table: only that table, its key and that column.
    subset = tmp_path / "subset"
    only = Service(
        database.database_id,
        subset,
        tmp_path / "subset.log",
        None,
        SPANNER_CHANGE_STREAM="account_balances",
        INGEST_SNAPSHOT_MODE="initial_only",
    )
    code, log = run_to_exit(only)
    assert code == 0, log
    rows = snapshot_rows(subset)
    assert {r["table_name"] for r in rows} == {"accounts"}
    assert len(rows) == 500
    assert all(set(json.loads(r["new_values"])) == {"balance"} for r in rows)
    assert all(set(json.loads(r["keys"])) == {"account_id"} for r in rows)
    final = latest_checkpoint(str(subset))
    assert final is not None and final.consistent and final.snapshot is not None
    code, log = run_to_exit(only)
    assert code == 0 and len(snapshot_rows(subset)) == 500, "a finished snapshot is not taken again"


@pytest.mark.emulator
def test_a_snapshot_out_of_the_version_retention_stops_with_one_line_and_lands_nothing(
    new_database, tmp_path: Path
) -> None:
    database = new_database("googlesql", accounts=10)
    two_hours_ago = time.time_ns() - 2 * 3600 * NANOS_PER_SECOND
    changelog = tmp_path / "changelog"
    service = service_in(
        tmp_path,
        database.database_id,
        two_hours_ago,
        INGEST_SNAPSHOT_MODE="initial",
    )
    result = subprocess.run(
        service.command(), env=service.env, capture_output=True, text=True, timeout=120
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-2000:]
    # Two hours ago this database did not exist: the first refusal names the cause no setting
    # can fix (a new job's T0 past the version retention is refused by the same rule as a
    # resumed one, below, and tests/test_snapshot_rules.py).
    assert "is before change stream all_changes can be read" in errors[0], errors[0]
    assert not changelog.exists(), "a refused start lands nothing"

    # A job whose snapshot began two hours ago (its first commit, as a killed job leaves it).
    job_id = f"{database.database_id}.all_changes"
    sink = DeltaChangeLogSink(str(changelog), job_id, "an-earlier-process")
    sink.continue_after(None)
    sink.start_job(two_hours_ago, SnapshotProgress.begin(two_hours_ago - 1, ["accounts"]))
    before = DeltaTable(str(changelog)).version()
    service.env.pop("INGEST_START_TIMESTAMP")
    service.env["INGEST_LEASE_S"] = "2"
    result = subprocess.run(
        service.command(), env=service.env, capture_output=True, text=True, timeout=120
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-2000:]
    assert "version_retention_period" in errors[0] and "new job" in errors[0]
    assert DeltaTable(str(changelog)).version() == before, "nothing landed, nothing lost"

    # A new job whose snapshot is expected to take longer than Spanner keeps versions.
    slow = Service(
        database.database_id,
        tmp_path / "slow",
        tmp_path / "slow.log",
        None,
        INGEST_SNAPSHOT_MODE="initial",
        INGEST_SNAPSHOT_ROWS_PER_S="0.001",
    )
    result = subprocess.run(
        slow.command(), env=slow.env, capture_output=True, text=True, timeout=120
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-2000:]
    for figure in ("at 0.001 rows/s", "keeps versions for 1.0 h"):
        assert figure in errors[0], errors[0]
    assert "change stream keeps changes for" in errors[0], errors[0]
    assert not (tmp_path / "slow").exists(), "a refused start lands nothing"


def test_keys_holding_null_resume_each_read_just_after_the_last_key(new_database: Any) -> None:
    """Issue 24's class on the snapshot's side: a key with NULL components (Spanner sorts NULL
    first) is given back to ``KeyRange.start_open`` from its wire encoding. One row per read, so
    every read starts after such a key: each row once, none skipped."""
    database = new_database(accounts=0)
    apply_ddl(
        database,
        "CREATE TABLE ck (a INT64, s STRING(8), b BYTES(8), d DATE NOT NULL, v INT64) "
        "PRIMARY KEY (a, s, b, d)",
    )
    keys = list(
        itertools.product(
            (None, -1, 1), (None, "", "x"), (None, b"\x00"), (dt.date(1, 1, 1), dt.date(2026, 1, 1))
        )
    )
    rows = [
        (a, s, None if b is None else base64.b64encode(b), d, n)
        for n, (a, s, b, d) in enumerate(keys)
    ]
    with database.batch() as batch:
        batch.insert("ck", ["a", "s", "b", "d", "v"], rows)
    column_types = tuple(
        ColumnType(name, {"code": code}, name != "v", n)
        for n, (name, code) in enumerate(
            [("a", "INT64"), ("s", "STRING"), ("b", "BYTES"), ("d", "DATE"), ("v", "INT64")], 1
        )
    )
    read_at = from_datetime(batch.committed)
    chunks = list(
        read_table(database, "ck", column_types, read_at, None, chunk_rows=1, range_rows=1)
    )
    read = [(json.loads(k), json.loads(v)["v"]) for chunk in chunks for k, v in chunk.rows]
    expected = [
        (
            {
                "a": None if a is None else str(a),
                "s": s,
                "b": None if b is None else base64.b64encode(b).decode(),
                "d": d.isoformat(),
            },
            str(n),
        )
        for n, (a, s, b, d) in enumerate(keys)
    ]
    assert Counter(map(canonical_json, read)) == Counter(map(canonical_json, expected))
    assert len(chunks) == len(keys) + 1 and chunks[-1].done


@pytest.mark.emulator
@pytest.mark.parametrize("dialect", ["googlesql", "postgresql"])
def test_key_ranges_cut_at_sampled_keys_read_every_row_once(
    new_database: Any, dialect: str
) -> None:
    """The Spark source's ranges on a real table: keys sampled at T0 (in key order, whatever the
    columns' order and directions), ranges cut at them, each range read from after its start to
    its end: every row once, in key order within each range, none outside."""
    database = new_database(dialect, accounts=0)
    if dialect == "postgresql":
        ddl = (
            "CREATE TABLE ranged (v bigint, b bytea, s varchar NOT NULL, a bigint, "
            "PRIMARY KEY (a, s, b))"
        )
    else:
        ddl = (
            "CREATE TABLE ranged (v INT64, b BYTES(8), s STRING(8) NOT NULL, a INT64) "
            "PRIMARY KEY (a DESC, s, b)"
        )
    apply_ddl(database, ddl)
    nulls = dialect == "googlesql"  # a PostgreSQL primary key holds no NULL
    rows = [
        (
            n,
            None if nulls and n % 7 == 0 else base64.b64encode(bytes([n % 256])),
            f"s{n % 13}",
            None if nulls and n % 50 == 0 else n % 17,
        )
        for n in range(1500)
    ]
    unique = list({(a, s, b): (v, b, s, a) for v, b, s, a in rows}.values())
    with database.batch() as batch:
        batch.insert("ranged", ["v", "b", "s", "a"], unique)
    read_at = from_datetime(batch.committed)
    column_types = tuple(
        ColumnType(name, {"code": code}, name != "v", n)
        for n, (name, code) in enumerate(
            [("v", "INT64"), ("b", "BYTES"), ("s", "STRING"), ("a", "INT64")], 1
        )
    )
    sample = sample_keys(database, "ranged", column_types[1:], read_at, 40, dialect == "postgresql")
    assert len(sample) == 40
    ranges = key_ranges(sample, 8)
    assert len(ranges) == 8
    whole = [
        k
        for c in read_table(database, "ranged", column_types, read_at, None, 100)
        for k, _ in c.rows
    ]
    pieces = [
        [
            k
            for c in read_table(
                database, "ranged", column_types, read_at, r.start_after, 100, end_key=r.end
            )
            for k, _ in c.rows
        ]
        for r in ranges
    ]
    assert [k for piece in pieces for k in piece] == whole
    assert len(whole) == len(unique) and all(pieces)
    assert sample == sample_keys(
        database, "ranged", column_types[1:], read_at, 40, dialect == "postgresql"
    ), "the same table at the same timestamp samples the same keys"
