"""The Spark source (``python -m ingest spark-run``) against the emulator with partition churn:
the same change log as the service, exactly once through kills of its driver."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

from tests.checks import start_after_setup
from tests.delta_checks import assert_change_log_invariants
from tests.processes import SparkSource, background_workload, wait_until_landed


def test_the_spark_source_lands_every_transaction_once_whole_and_in_order_through_driver_kills(
    new_database, tmp_path: Path
) -> None:
    seed = int(os.environ.get("CRASH_TEST_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    database = new_database("googlesql")
    table = tmp_path / "changelog"
    source = SparkSource(
        database.database_id,
        table,
        tmp_path / "spark-checkpoint",
        tmp_path / "spark-source.log",
        start_after_setup(),
    )
    thread, _, committed = background_workload(database, seconds=30, rate=20, seed=seed)
    kills = 0
    while kills < 2:
        batches = source.count("spark_batch")
        process = source.start()
        try:
            source.wait_for("spark_batch", batches + 2, timeout=180, process=process)
            time.sleep(rng.uniform(0, 3.0))
        finally:
            os.killpg(process.pid, signal.SIGKILL)  # the driver and its JVM
            process.wait()
        kills += 1
    thread.join()
    final = source.start()
    try:
        wait_until_landed(table, len(committed), timeout=180)
        final.send_signal(signal.SIGTERM)
        assert final.wait(timeout=60) == 0
    finally:
        if final.poll() is None:
            os.killpg(final.pid, signal.SIGKILL)
    versions = assert_change_log_invariants(table, committed)
    landed = [e for e in source.events() if e["event"] == "spark_batch"]
    assert any(b["cut_lowered"] for b in landed), "churn never lowered a batch's cut"
    assert len({v.checkpoint.owner for v in versions if v.checkpoint}) == 1
