"""The pipeline on a Spark standalone cluster (a master and two workers on loopback, state,
checkpoint and mirrors on a path they share): the processor, its RocksDB state and the MERGE run
in executors, other JVMs than the driver's. A worker is killed with kill -9 while a micro-batch
runs and is replaced; the mirrors must still equal Spanner at the change log's watermark."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from emulator.server import free_port
from emulator.spark_cluster import StandaloneCluster
from tests.checks import (
    accounts_written_after_start,
    assert_mirrors_equal,
    assert_mirrors_hold,
    compare_at_watermark,
    crash_seed,
)
from tests.processes import (
    BANKING_TABLES,
    Pipeline,
    Service,
    background_workload,
    wait_until_landed,
)
from tests.scrapes import scrape_until, value

SPARK_MERGE_ABOVE = 200


@pytest.mark.emulator
def test_mirrors_equal_spanner_on_a_standalone_cluster_that_loses_a_worker(
    new_database, tmp_path: Path
) -> None:
    seed, rng = crash_seed()
    database, start = accounts_written_after_start(new_database)
    changelog = tmp_path / "changelog"
    cluster = StandaloneCluster(tmp_path / "spark")
    metrics_port = free_port()
    ingest = Service(database.database_id, changelog, tmp_path / "ingest.log", start)
    pipeline = Pipeline(
        changelog,
        tmp_path,
        tmp_path / "pipeline.log",
        PIPELINE_MASTER=cluster.master_url,
        PIPELINE_METRICS_PORT=str(metrics_port),
        # the first (catch-up) batch MERGEs through Spark on the executors, later small ones
        # through delta-rs on the driver
        PIPELINE_LOCAL_MERGE_MAX_ROWS=str(SPARK_MERGE_ABOVE),
        SPARK_LOCAL_IP="127.0.0.1",
    )
    cluster.start(workers=2)
    ingest_process = ingest.start()
    running = pipeline.start()
    # Writes until the lost worker's batch has landed (a first batch takes minutes here).
    workload, stop_workload, committed = background_workload(database, 900, 5, seed)
    try:
        # The job has met both tables (one restart) and merges the workload's changes.
        scrape_until(
            metrics_port,
            lambda s: (value(s, "pipeline_rows_merged_total", table="transfers") or 0) > 0,
            timeout=400,
        )
        first_workers = cluster.alive_worker_ids()
        workers = [w for w in cluster.processes[1:] if cluster.executor_pids(w)]
        assert len(workers) == 2, "both workers must run an executor of the job"
        time.sleep(rng.uniform(0, 3))
        scrape_until(
            metrics_port,
            lambda s: (value(s, "pipeline_batch_running_seconds") or 0) > 0,
            timeout=300,
        )
        landed_before = pipeline.count("pipeline_batch")
        assert workload.is_alive(), "the workload must still write while the batch runs"
        cluster.kill_worker(rng.choice(workers))
        replacement = cluster.start_worker()
        cluster.wait_for_a_worker_besides(first_workers)
        pipeline.wait_for("pipeline_batch", landed_before + 1, timeout=400, process=running)
        killed_batch = [e for e in pipeline.events() if e["event"] == "pipeline_batch"][
            landed_before
        ]
        assert killed_batch["rows"], f"seed {seed}: the batch in progress carried no rows"
        assert "Lost executor" in pipeline.log.read_text(errors="replace"), f"seed {seed}"
        stop_workload.set()
        workload.join()
        wait_until_landed(
            changelog, len(committed) + 1, timeout=120, service=ingest, committed=committed
        )  # + the seed
        deadline = time.monotonic() + 300
        while not cluster.executor_pids(replacement):
            assert time.monotonic() < deadline, "the job never got an executor on the new worker"
            time.sleep(0.5)
        ingest_process.send_signal(signal.SIGTERM)
        assert ingest_process.wait(timeout=20) == 0
        running.send_signal(signal.SIGUSR1)  # drain: process what the change log holds, exit
        assert running.wait(timeout=400) == 0, pipeline.log.read_text()[-3000:]
    finally:
        stop_workload.set()
        for process in (ingest_process, running):
            process.kill()
        cluster.stop()
    _, comparisons = compare_at_watermark(database, str(changelog), str(tmp_path / "mirrors"))
    assert_mirrors_equal(comparisons, f"seed {seed}")
    batches = [e for e in pipeline.events() if e["event"] == "pipeline_batch"]
    assert any(sum(e["rows"].values()) > SPARK_MERGE_ABOVE for e in batches), "no Spark MERGE"
    assert len(committed) >= 300
    assert_mirrors_hold(comparisons, BANKING_TABLES)
