"""The whole product on the real emulator: ingest service → change log → pipeline → mirrors.

The promise checked: after the pipeline has processed the change log up to version v, every
mirror table equals its Spanner table read at exactly W(v), through a Spanner ADD COLUMN mid-run
and a kill -9 of the pipeline.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from emulator.bootstrap import seed_accounts
from pipeline.catalog import discover_shapes
from pipeline.mirror import mirror_uri
from pipeline.verify import changelog_watermark, compare_mirrors, mirror_rows
from tests.checks import start_after_setup
from tests.processes import Pipeline, Service, background_workload, wait_until_landed

ALL_KINDS = dict(transfer_weight=0.6, all_types_weight=0.3, cleanup_weight=0.1)


def name_accounts(database, accounts: range) -> None:
    def apply(transaction) -> None:
        transaction.execute_update(
            "UPDATE accounts SET nickname = CONCAT('nick-', CAST(account_id AS STRING)) "
            f"WHERE account_id >= {accounts.start} AND account_id < {accounts.stop}"
        )

    database.run_in_transaction(apply)


@pytest.mark.emulator
def test_mirrors_equal_spanner_at_the_watermark_through_add_column_and_kill_9(
    new_database, tmp_path: Path
) -> None:
    seed = int(os.environ.get("CRASH_TEST_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    database = new_database("googlesql", accounts=0)
    start = start_after_setup()
    seed_accounts(database, accounts=100, initial_balance=1000)
    changelog = tmp_path / "changelog"
    ingest = Service(database.database_id, changelog, tmp_path / "ingest.log", start)
    pipeline = Pipeline(changelog, tmp_path, tmp_path / "pipeline.log")
    ingest_process = ingest.start()
    running = pipeline.start()
    try:
        pipeline.wait_for("pipeline_batch", 1, timeout=120, process=running)
        workload, _, committed = background_workload(database, 45, 10, seed, **ALL_KINDS)
        time.sleep(rng.uniform(2, 6))
        database.update_ddl(["ALTER TABLE accounts ADD COLUMN nickname STRING(MAX)"]).result(120)
        name_accounts(database, range(0, 10))
        pipeline.wait_for(
            "pipeline_query_started",
            1,
            timeout=180,
            process=running,
            where=lambda e: "nickname" in e["guarded_fields"].get("row_accounts", ()),
        )
        batches = pipeline.count("pipeline_batch")
        pipeline.wait_for("pipeline_batch", batches + 1, timeout=120, process=running)
        time.sleep(rng.uniform(0, 3))
        running.kill()
        running.wait()
        starts = pipeline.count("pipeline_query_started")
        running = pipeline.start()
        pipeline.wait_for("pipeline_query_started", starts + 1, timeout=120, process=running)
        name_accounts(database, range(10, 20))
        workload.join()
        wait_until_landed(changelog, committed, timeout=120)
        ingest_process.send_signal(signal.SIGTERM)
        assert ingest_process.wait(timeout=20) == 0
        running.send_signal(signal.SIGTERM)
        assert running.wait(timeout=60) == 0, pipeline.log.read_text()[-3000:]
        catch_up = pipeline.start("--trigger", "available-now")
        assert catch_up.wait(timeout=300) == 0, pipeline.log.read_text()[-3000:]
    finally:
        for process in (ingest_process, running):
            process.kill()
    watermark = changelog_watermark(str(changelog))
    assert watermark is not None
    shapes = discover_shapes(str(changelog))
    assert set(shapes) == {"accounts", "transfers", "all_types"}, f"seed {seed}"
    assert shapes["accounts"].column("nickname") is not None, f"seed {seed}"
    comparisons = compare_mirrors(
        database, str(tmp_path / "mirrors"), shapes, watermark.low_watermark, timestamp_digits=0
    )
    assert all(c.equal for c in comparisons), (
        f"seed {seed}: " + "; ".join(c.describe() for c in comparisons)
    )
    accounts = mirror_rows(mirror_uri(str(tmp_path / "mirrors"), "accounts"), shapes["accounts"], 0)
    named = {key for key, row in accounts.items() if row["nickname"] is not None}
    assert {(i,) for i in range(20)} <= named, f"seed {seed}: named accounts {sorted(named)}"
    assert len(committed) >= 300 and comparisons[0].mirror_rows > 0
    restarts = [e for e in pipeline.events() if e["event"] == "pipeline_query_restarting"]
    assert any(e["reason"] == "SOURCE_SCHEMA_CHANGED" for e in restarts), restarts
