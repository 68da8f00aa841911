"""The on-demand table snapshot on the real emulator: a table the stream stopped capturing for a
while (rows deleted, changed and added behind its back) is snapshotted again while the service
runs and writes go on, and its mirror comes back to Spanner at W, rows deleted in the gap
included."""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable
from google.cloud import spanner

from emulator.server import free_port
from emulator.verify import consistent_past
from emulator.workload import load_existing_rows
from ingest.contract.changelog import SNAPSHOT_DELETE, SNAPSHOT_ROW
from ingest.delta.absent_keys import absent_keys
from ingest.model.encoding import canonical_json
from ingest.model.timestamps import parse_rfc3339
from tests.checks import apply_ddl, compare_at_watermark
from tests.processes import INGEST_STOP_S, Pipeline, background_workload, service_in


def snapshot_table(port: int, table: str, token_file: Path) -> subprocess.CompletedProcess[str]:
    """``python -m ingest snapshot-table`` as an operator runs it."""
    url = f"http://127.0.0.1:{port}"
    command = ["snapshot-table", "--table", table, "--url", url, "--token-file", str(token_file)]
    return subprocess.run(
        [sys.executable, "-m", "ingest", *command],
        capture_output=True,
        text=True,
        timeout=120,
    )


def existing_transfer_keys(database, count: int) -> list[tuple[int, str]]:
    """Keys of rows loaded before the job started (the workload never touches them)."""
    with database.snapshot() as snapshot:
        rows = snapshot.execute_sql(
            "SELECT from_account_id, transfer_id FROM transfers ORDER BY transfer_id LIMIT @n",
            params={"n": count},
            param_types={"n": spanner.param_types.INT64},
        )
        return [(row[0], row[1]) for row in rows]


def last_transfer_keys(database, count: int) -> list[tuple[int, str]]:
    """The keys a snapshot of transfers reads last (primary-key order)."""
    with database.snapshot() as snapshot:
        rows = snapshot.execute_sql(
            "SELECT from_account_id, transfer_id FROM transfers "
            "ORDER BY from_account_id DESC, transfer_id DESC LIMIT @n",
            params={"n": count},
            param_types={"n": spanner.param_types.INT64},
        )
        return [(row[0], row[1]) for row in rows]


def spanner_keys(database) -> list[str]:
    """transfers' keys now, spelled as the change log spells them."""
    with database.snapshot() as snapshot:
        rows = snapshot.execute_sql("SELECT from_account_id, transfer_id FROM transfers")
        return [canonical_json({"from_account_id": str(a), "transfer_id": t}) for a, t in rows]


def wait_for_watermark(changelog: Path, at_least: int, timeout: float) -> None:
    """Until the change log is a consistent cut at or after ``at_least``."""
    deadline = time.monotonic() + timeout
    while not consistent_past(str(changelog), at_least):
        assert time.monotonic() < deadline, f"no consistent cut at {at_least} in {timeout} s"
        time.sleep(0.5)


def mirror_and_compare(pipeline: Pipeline, changelog: Path, database, root: Path):
    catch_up = pipeline.start("--trigger", "available-now")
    assert catch_up.wait(timeout=600) == 0, pipeline.log.read_text()[-3000:]
    _, comparisons = compare_at_watermark(database, str(changelog), str(root / "mirrors"))
    return {c.table: c for c in comparisons}


@pytest.mark.emulator
def test_a_table_snapshotted_on_demand_comes_back_to_spanner_while_writes_go_on(
    new_database, tmp_path: Path
) -> None:
    database = new_database("googlesql", accounts=300)
    load_existing_rows(database, accounts=300, transfers=1500, all_types=0, seed=11)
    apply_ddl(database, "CREATE CHANGE STREAM mirrored FOR ALL")
    changelog = tmp_path / "changelog"
    port = free_port()
    token = tmp_path / "control-token"
    token.write_text(secrets.token_urlsafe(24) + "\n")
    service = service_in(
        tmp_path,
        database.database_id,
        None,
        SPANNER_CHANGE_STREAM="mirrored",
        INGEST_SNAPSHOT_MODE="initial",
        INGEST_SNAPSHOT_CHUNK_ROWS="250",
        INGEST_HEALTH_PORT=str(port),
        INGEST_CONTROL_TOKEN_FILE=str(token),
    )
    # Tombstones forgotten within a second, in batches of a few change-log files: a snapshot row
    # landing after its key's delete must not bring the row back.
    pipeline = Pipeline(
        changelog,
        tmp_path,
        tmp_path / "pipeline.log",
        PIPELINE_TOMBSTONE_TTL_S="1",
        PIPELINE_MAX_FILES_PER_TRIGGER="4",
    )
    weights = dict(transfer_weight=1.0, all_types_weight=0.0, cleanup_weight=0.5)
    workload, stop_workload, committed = background_workload(database, 600, 10, 11, weights=weights)
    process = service.start()
    try:
        service.wait_for("ingest_started", 1, timeout=120, process=process)

        # transfers leaves the stream; behind its back rows are deleted, changed and added
        apply_ddl(database, "ALTER CHANGE STREAM mirrored SET FOR accounts")
        gone = existing_transfer_keys(database, 40)
        with database.batch() as batch:
            batch.delete("transfers", spanner.KeySet(keys=[list(k) for k in gone[:30]]))
            batch.update(
                "transfers",
                ["from_account_id", "transfer_id", "amount"],
                [[k[0], k[1], 999_999] for k in gone[30:]],
            )
        apply_ddl(database, "ALTER CHANGE STREAM mirrored SET FOR ALL")
        back = time.time_ns()
        wait_for_watermark(changelog, back, timeout=120)
        behind = absent_keys(DeltaTable(str(changelog)), "transfers", back, spanner_keys(database))
        assert len(behind) >= 30, "the change log holds rows Spanner deleted in the gap"

        stranger = tmp_path / "stranger-token"
        stranger.write_text("not-the-token")
        unauthenticated = snapshot_table(port, "transfers", stranger)
        assert unauthenticated.returncode == 2 and "(401)" in unauthenticated.stderr
        asked = snapshot_table(port, "transfers", token)
        assert asked.returncode == 0, asked.stderr
        answer = json.loads(asked.stdout)
        t1 = parse_rfc3339(answer["read_timestamp"])
        assert answer["tables"] == ["transfers"] and t1 >= back
        # The keys the snapshot reaches last, deleted after T1, likely before their chunk lands.
        last_read = last_transfer_keys(database, 20)
        with database.batch() as batch:
            batch.delete("transfers", spanner.KeySet(keys=[list(k) for k in last_read]))
        service.wait_for("table_snapshot_done", 1, timeout=180, process=process)
        refused = snapshot_table(port, "no_such_table", token)
        assert refused.returncode == 2 and "not captured" in refused.stderr, refused.stderr
        stop_workload.set()
        workload.join()
        wait_for_watermark(changelog, max(t.commit_timestamp for t in committed), timeout=120)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=INGEST_STOP_S) == 0
    finally:
        stop_workload.set()
        workload.join()
        process.kill()

    rows = (
        DeltaTable(str(changelog))
        .to_pyarrow_dataset()
        .to_table(
            columns=["keys", "mod_type", "commit_timestamp_text"],
            filter=(pc.field("table_name") == "transfers")
            & pc.field("mod_type").isin([SNAPSHOT_ROW, SNAPSHOT_DELETE]),
        )
        .to_pylist()
    )
    again = [r for r in rows if r["commit_timestamp_text"] == answer["read_timestamp"]]
    deleted = {
        json.loads(r["keys"])["transfer_id"] for r in again if r["mod_type"] == SNAPSHOT_DELETE
    }
    assert {k[1] for k in gone[:30]} <= deleted, "rows deleted in the gap land as deletes at T1"
    mirrors = mirror_and_compare(pipeline, changelog, database, tmp_path)
    assert all(c.equal for c in mirrors.values()), "; ".join(c.describe() for c in mirrors.values())
