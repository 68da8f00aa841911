"""The Spark source (``python -m ingest spark-run``) against the emulator with partition churn:
the same change log as the service, exactly once through kills of its driver."""

from __future__ import annotations

import itertools
import os
import random
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from pyspark.errors import StreamingQueryException

from emulator.processes import kill_tree
from emulator.server import free_port
from emulator.spark_cluster import StandaloneCluster
from emulator.verify import latest_checkpoint
from ingest.changestream.opening import StreamAddress, open_stream
from ingest.delta.landing import ChangeLogLanding, WatchedColumnsPoll
from ingest.delta.sink import DeltaChangeLogSink
from ingest.model.resume import start_point
from ingest.model.snapshot import SnapshotProgress
from ingest.model.timestamps import to_rfc3339
from ingest.rules.batches import share_of
from ingest.sparksource.landing import BatchLanding
from ingest.sparksource.run import owner_of, start_query, wave_reader
from ingest.sparksource.source import SourceOptions
from runtime.logs import null_logger
from tests.builders import captured_logger
from tests.checks import (
    ACCOUNTS,
    assert_mirrors_equal,
    compare_at_watermark,
    crash_seed,
    hundred_thousand_rows,
    start_after_setup,
)
from tests.delta_checks import assert_change_log_invariants, read_versions
from tests.object_stores import minio
from tests.processes import (
    Pipeline,
    Service,
    SparkSource,
    background_workload,
    wait_until_landed,
)
from tests.scrapes import scrape_until, value
from tests.test_snapshot import KEYS, landed_keys, snapshot_rows, spanner_keys

JOB = "spark-source-test"
NO_WATCH = WatchedColumnsPoll(None, 10.0, null_logger())


@pytest.mark.emulator
def test_on_a_standalone_cluster_the_driver_and_an_executor_killed_lose_nothing(
    new_database, tmp_path: Path
) -> None:
    """The Spark source on a loopback standalone cluster (two workers of one core) against the
    emulator churning partitions every 5 to 10 s, writes all along. The snapshot of 100,000 rows
    over 3 tables read in key ranges by the executors, its driver killed -9 mid-snapshot and
    restarted: no range done at the kill is read again (counted), every row at T0 lands once.
    Then kill -9 of an executor while batches run, then of the driver (its JVM with it),
    restarts; every committed transaction once, whole, in order. Then the pipeline on the same
    cluster (its processor, RocksDB state and MERGE in the executors) loses a worker to kill -9
    mid-batch; its mirrors equal Spanner at the change log's W."""
    seed, rng = crash_seed()
    database = new_database("googlesql", accounts=ACCOUNTS, existing=hundred_thousand_rows(seed))
    table = tmp_path / "changelog"
    cluster = StandaloneCluster(tmp_path / "spark")
    metrics_port = free_port()
    source = SparkSource(
        database.database_id,
        table,
        tmp_path / "spark-checkpoint",
        tmp_path / "spark-source.log",
        None,
        master=cluster.master_url,
        SPARK_LOCAL_IP="127.0.0.1",
        INGEST_SNAPSHOT_MODE="initial",
        INGEST_SNAPSHOT_CHUNK_ROWS="1000",
        INGEST_SPARK_SNAPSHOT_TASK_MB="1",  # a range's progress committed every MiB or so
        INGEST_HEALTH_PORT=str(metrics_port),
    )
    pipeline_metrics_port = free_port()
    pipeline = Pipeline(
        table,
        tmp_path,
        tmp_path / "pipeline.log",
        PIPELINE_TRIGGER="available-now",
        PIPELINE_MASTER=cluster.master_url,
        PIPELINE_METRICS_PORT=str(pipeline_metrics_port),
        PIPELINE_LOCAL_MERGE_MAX_ROWS="0",  # every MERGE by delta-spark, on the executors
        SPARK_LOCAL_IP="127.0.0.1",
    )
    cluster.start(workers=2)
    workload, stop_workload, committed = background_workload(database, 600, 10, seed)
    driver = source.start()
    try:
        source.wait_for("snapshot_part_landed", 2, timeout=300, process=driver)
        time.sleep(rng.uniform(0, 1.0))
        kill_tree(driver)
        driver.wait()
        at_kill = latest_checkpoint(str(table))
        assert at_kill is not None and at_kill.snapshot is not None
        assert not at_kill.snapshot.complete, f"seed {seed}: the snapshot ended before the kill"
        done_at_kill = {
            (t.table, index)
            for t in at_kill.snapshot.tables
            for index, part in enumerate(t.parts)
            if part.done
        }
        lives = source.count("snapshot_started")
        driver = source.start()
        source.wait_for("spark_batch", 3, timeout=300, process=driver)
        events = source.events()
        starts = [i for i, e in enumerate(events) if e["event"] == "snapshot_started"]
        assert len(starts) > lives, "the restarted driver did not go on with the snapshot"
        read_again = [
            e
            for e in events[starts[lives] :]
            if e["event"] == "snapshot_part_started" and (e["table"], e["part"]) in done_at_kill
        ]
        print(
            f"snapshot ranges done at the kill: {len(done_at_kill)}; "
            f"read again after it: {len(read_again)}"
        )
        assert not read_again, f"seed {seed}: ranges done at the kill read again: {read_again}"
        workers = [w for w in cluster.processes[1:] if cluster.executor_pids(w)]
        assert workers, "no executor of the source on the cluster"
        time.sleep(rng.uniform(0, 1.5))
        landed = source.count("spark_batch")
        os.kill(cluster.executor_pids(rng.choice(workers))[0], signal.SIGKILL)
        source.wait_for("spark_batch", landed + 3, timeout=300, process=driver)
        assert "Lost executor" in source.log.read_text(errors="replace"), f"seed {seed}"
        time.sleep(rng.uniform(0, 1.5))
        kill_tree(driver)  # mid-batch: batches run back to back
        driver.wait()
        restarts = source.count("spark_source_started")
        driver = source.start()
        source.wait_for("spark_source_started", restarts + 1, timeout=300, process=driver)
        source.wait_for("spark_batch", source.count("spark_batch") + 3, 300, driver)
        scraped = scrape_until(
            metrics_port,
            lambda s: (
                (value(s, "ingest_transactions_landed_total") or 0) > 0
                and (value(s, "ingest_spark_batch_duration_seconds_count") or 0) > 0
            ),
            timeout=120,
            process=driver,
        )
        assert (value(scraped, "ingest_partition_queries_total") or 0) > 0
        assert value(scraped, "ingest_watermark_lag_seconds") is not None
        stop_workload.set()
        workload.join()
        read_at = at_kill.snapshot.read_timestamp
        after_t0 = [c for c in committed if c.commit_timestamp > read_at]
        wait_until_landed(table, len(after_t0), timeout=300)
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=90) == 0
        running = pipeline.start()
        _lose_a_worker_mid_batch(cluster, pipeline, running, pipeline_metrics_port, rng)
        assert running.wait(timeout=600) == 0, pipeline.log.read_text()[-3000:]
    finally:
        stop_workload.set()
        if driver.poll() is None:
            kill_tree(driver)
        cluster.stop()
    rows = snapshot_rows(table)
    assert {r["commit_timestamp_text"] for r in rows} == {to_rfc3339(read_at)}
    for name in KEYS:
        keys = landed_keys(rows, name)
        assert max(keys.values()) == 1, f"seed {seed}: a {name} row landed twice"
        assert keys == spanner_keys(database, name, read_at, "googlesql"), f"seed {seed}"
    assert len(rows) >= 100_000  # issue 28: a snapshot of 100k rows or more over 3 tables
    assert_change_log_invariants(table, after_t0)
    _, comparisons = compare_at_watermark(database, str(table), str(tmp_path / "mirrors"))
    assert_mirrors_equal(comparisons, f"seed {seed}")
    batches = [e for e in source.events() if e["event"] == "spark_batch"]
    assert any(b["partitions"] > 2 for b in batches), "no task followed a partition's child"
    assert len(after_t0) >= 100 and all(c.mirror_rows > 0 for c in comparisons), comparisons


def _lose_a_worker_mid_batch(
    cluster: StandaloneCluster,
    pipeline: Pipeline,
    running: subprocess.Popen[bytes],
    metrics_port: int,
    rng: random.Random,
) -> None:
    """kill -9 of a worker running an executor of the pipeline while a batch runs, and a new
    worker in its place; the batch in progress must land (with rows) all the same."""
    scrape_until(
        metrics_port,
        lambda s: (value(s, "pipeline_batch_running_seconds") or 0) > 0,
        timeout=400,
        process=running,
    )
    landed_before = pipeline.count("pipeline_batch")
    workers = [w for w in cluster.processes[1:] if cluster.executor_pids(w)]
    assert workers, "no executor of the pipeline on the cluster"
    known = cluster.alive_worker_ids()
    time.sleep(rng.uniform(0, 2))
    cluster.kill_worker(rng.choice(workers))
    cluster.start_worker()
    cluster.wait_for_a_worker_besides(known)
    pipeline.wait_for("pipeline_batch", landed_before + 1, timeout=400, process=running)
    killed = [e for e in pipeline.events() if e["event"] == "pipeline_batch"][landed_before]
    assert killed["rows"] and killed["merged_on"] == "spark", killed
    assert "Lost executor" in pipeline.log.read_text(errors="replace")


class CrashingLanding:
    """The landing, failing the query (as a driver dying would) before or after landing the
    ``at``-th batch of this run: Spark has written that batch's offsets, not its commit."""

    def __init__(self, landing: BatchLanding, at: int, after_landing: bool) -> None:
        self.landing, self.at, self.after_landing, self.seen = landing, at, after_landing, 0

    def __call__(self, frame: Any, batch_id: int) -> None:
        self.seen += 1
        if self.seen == self.at and not self.after_landing:
            raise RuntimeError("driver died before landing")
        self.landing(frame, batch_id)
        if self.seen == self.at:
            raise RuntimeError("driver died after landing")


def test_a_batch_spark_replays_lands_once_and_admission_control_bounds_batches(
    spanner_emulator: str, new_database, spark, tmp_path: Path
) -> None:
    """In-process on the PostgreSQL dialect: the query fails after landing a batch, then before
    landing one; each restart replays that batch from Spark's offset log, and the change log
    holds every transaction once. Batches hold at most about the records limit."""
    database = new_database("postgresql")
    table, checkpoint, owner = tmp_path / "changelog", tmp_path / "checkpoint", "spark-test"
    sink = DeltaChangeLogSink(str(table), JOB, owner)
    sink.continue_after(None)
    sink.start_job(start_after_setup())
    opened = open_stream(
        StreamAddress("local-project", "local-instance", database.database_id, "all_changes")
    )
    options = SourceOptions(
        "local-project",
        "local-instance",
        database.database_id,
        "all_changes",
        opened.dialect.value,
        opened.info.mutable_key_range,
        str(table),
        JOB,
        heartbeat_ms=1000,
        max_batch_span_s=5,
        max_records_per_batch=40,
    )
    thread, _, committed = background_workload(database, seconds=15, rate=20, seed=7)
    log, events = captured_logger()
    runs = [
        CrashingLanding(
            BatchLanding(
                ChangeLogLanding(DeltaChangeLogSink(str(table), JOB, owner), NO_WATCH, log),
                read_wave=wave_reader(spark, options),
            ),
            at,
            after,
        )
        for at, after in ((3, True), (2, False))
    ]
    for run in runs:
        query = start_query(spark, options, run, str(checkpoint), 0.5)
        with pytest.raises(StreamingQueryException, match="driver died"):
            query.awaitTermination(180)
    outcomes = [e["outcome"] for e in events if e["event"] == "spark_batch"]
    assert outcomes[3] == "replayed", outcomes
    final = BatchLanding(
        ChangeLogLanding(DeltaChangeLogSink(str(table), JOB, owner), NO_WATCH, log),
        read_wave=wave_reader(spark, options),
    )
    query = start_query(spark, options, final, str(checkpoint), 0.5)
    try:
        thread.join()
        wait_until_landed(table, len(committed), timeout=180)
    finally:
        query.stop()
    assert_change_log_invariants(table, committed)
    batches = [e for e in events if e["event"] == "spark_batch"]
    # unbounded, a catch-up batch reads 5 s of the workload: about 200 records. A read stops at
    # its share once its watermark passed its start: it may pass the share by the records at its
    # start timestamp (at most the transactions committed then) and one more.
    at_one_timestamp = Counter[int]()
    for transaction in committed:
        at_one_timestamp[transaction.commit_timestamp] += len(transaction.mods)
    over = max(at_one_timestamp.values()) + 1
    for b in batches:
        assert b["records_read"] <= b["partitions"] * (share_of(40, b["partitions"]) + over), b


def test_a_change_log_handed_from_the_service_to_the_spark_source_and_back(
    new_database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Service, Spark source, a second driver on the same Spark checkpoint, service: each stops
    cleanly (its lease released) while the workload runs, the next continues from the newest
    checkpoint, and the change log passes the same checks as one writer's. The second driver,
    started by mistake while the first runs, stands by with one line and writes nothing until
    the first hands the lease over. The change log and the Spark checkpoint are on S3 (MinIO):
    the driver's session reaches its checkpoint through S3A."""
    database = new_database("googlesql")
    with minio(tmp_path) as store:
        for name, value in store.environment().items():
            monkeypatch.setenv(name, value)
        table, checkpoint = store.uri("changelog"), store.uri("spark-checkpoint")
        _hand_over(database, table, checkpoint, tmp_path)


def _hand_over(database: Any, table: str, checkpoint: str, tmp_path: Path) -> None:
    start = start_after_setup()
    service = Service(database.database_id, table, tmp_path / "ingest.log", start)
    drivers = [
        SparkSource(
            database.database_id,
            table,
            checkpoint,
            tmp_path / f"spark-source-{n}.log",
            start,
            # a driver renews its lease with each batch: longer than a batch on a loaded machine
            INGEST_LEASE_S="30",
        )
        for n in (1, 2)
    ]
    thread, _, committed = background_workload(database, seconds=40, rate=20, seed=11)
    turns = [(service, "delta_commit"), (drivers[0], "spark_batch"), (service, "delta_commit")]
    for writer, event in turns:
        landed = writer.count(event)
        process = writer.start()
        try:
            writer.wait_for(event, landed + 3, timeout=180, process=process)
            if writer is drivers[0]:
                process = second_driver_takes_over(drivers, process)
            if (writer, event) == turns[-1]:
                thread.join()
                wait_until_landed(
                    table, len(committed), timeout=180, service=service, committed=committed
                )
            os.killpg(process.pid, signal.SIGTERM)  # the group, as tini -g sends it
            assert process.wait(timeout=90) == 0
        finally:
            if process.poll() is None:
                kill_tree(process)
    versions = assert_change_log_invariants(table, committed)
    owners = [v.checkpoint.owner for v in versions if v.checkpoint]
    handovers = [o for o, n in itertools.pairwise(owners) if o != n]
    assert len(handovers) == 3, f"writers in turn: {handovers}"
    spark_owners = {o for o in owners if o.startswith(owner_of(checkpoint, ""))}
    assert len(spark_owners) == 2, owners


def second_driver_takes_over(drivers: list[SparkSource], first: Any) -> Any:
    """Start a second driver on the first one's Spark checkpoint: it stands by and lands
    nothing while the first lands batches; once the first stops cleanly, it takes over."""
    second = drivers[1].start()
    try:
        drivers[1].wait_for("standby_waiting_for_lease", 1, timeout=120, process=second)
        batches = drivers[0].count("spark_batch")
        drivers[0].wait_for("spark_batch", batches + 2, timeout=180, process=first)
        assert drivers[1].count("spark_batch") == drivers[1].count("delta_commit") == 0
        os.killpg(first.pid, signal.SIGTERM)
        assert first.wait(timeout=90) == 0
        drivers[1].wait_for("writer_lease_released_by_previous_owner", 1, 60, second)
        drivers[1].wait_for("spark_batch", 3, timeout=180, process=second)
    except BaseException:
        kill_tree(second)
        raise
    return second


def test_the_spark_source_refuses_a_job_with_an_unfinished_on_demand_snapshot(
    new_database, tmp_path: Path
) -> None:
    """It would carry the snapshot's progress forward without ever finishing it: one error line,
    exit 2, the lease handed back, nothing else landed."""
    database = new_database("googlesql")
    table, start = tmp_path / "changelog", start_after_setup()
    sink = DeltaChangeLogSink(str(table), f"{database.database_id}.all_changes", "service")
    sink.continue_after(None)
    sink.start_job(start)
    sink.track_table_snapshot(SnapshotProgress.begin(start, ["accounts"]))
    sink.commit([], start_point(start), lease_released=True)
    source = SparkSource(
        database.database_id, table, tmp_path / "checkpoint", tmp_path / "spark.log", start
    )
    process = source.start()
    assert process.wait(timeout=120) == 2
    errors = [line for line in source.log.read_text().splitlines() if line.startswith("error:")]
    assert errors == [
        "error: an on-demand snapshot of accounts is unfinished: the Spark source does not run "
        "it; let `python -m ingest run` finish it first"
    ]
    versions = read_versions(table)
    assert versions[-1].checkpoint is not None and versions[-1].checkpoint.lease_released
    assert not any(v.rows for v in versions)
