"""The pipeline on real Spark and Delta, over change logs landed by the real ingest sink:
mirrors, replays, source-driven evolution, the open-source evolution bug, the checkpoint lock."""

from __future__ import annotations

import base64
import datetime
import functools
import json
import os
import re
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow
import pytest
from deltalake import DeltaTable, write_deltalake
from structlog.testing import CapturingLogger

from ingest.delta import changelog as changelog_rows
from ingest.model.records import ColumnType
from ingest.model.timestamps import parse_rfc3339
from pipeline import batch_writer, deployment, job
from pipeline import catalog as pipeline_catalog
from pipeline.catalog import discover_shapes, scan
from pipeline.class_archive import reuse_archive
from pipeline.columns import mirror_uri
from pipeline.config import PipelineConfig
from pipeline.files_gone import files_gone_line
from pipeline.job import run_pipeline
from pipeline.landing import write_batch
from pipeline.merges import commit_once
from pipeline.metrics import PipelineMetrics
from pipeline.mirror import ensure_mirror, merge_into_mirror
from pipeline.processor import output_schema
from pipeline.restarts import PYTHON_WORKER_LATE, PipelineFailed, restart_reason
from pipeline.shapes import TableShape
from pipeline.state.checkpoint import CheckpointInUse, CheckpointLock, checkpoint_id
from pipeline.state.registry import SchemaRegistry
from runtime.jvm import CLASS_ARCHIVE
from runtime.logs import null_logger
from runtime.storage import jars_dir
from tests.background_builds import CLASS_ARCHIVE_BUILD, wait_for_build
from tests.builders import ACCOUNTS, START, ChangeLog
from tests.pipeline_runs import configure, image_of, mirror_rows, processed_three_ways, run

EMAIL = ColumnType("email", {"code": "STRING"}, False, 4)
BRANCHES = (
    ColumnType("code", {"code": "STRING"}, True, 1),
    ColumnType("city", {"code": "STRING"}, False, 2),
)
LAYOUT_2 = Path(__file__).parent / "fixtures" / "layout2"
LAYOUT_3 = Path(__file__).parent / "fixtures" / "layout3"
EVENTS = (
    ColumnType("event_id", {"code": "INT64"}, True, 1),
    ColumnType("at", {"code": "TIMESTAMP"}, False, 2),
    ColumnType("note", {"code": "STRING"}, False, 3),
)


def seed(changelog: ChangeLog) -> None:
    changelog.commit(
        ("accounts", "INSERT", {"account_id": "1"}, {"owner": "ann", "balance": "100"}),
        ("accounts", "INSERT", {"account_id": "2"}, {"owner": "bob", "balance": "50"}),
    )
    changelog.commit(
        ("accounts", "UPDATE", {"account_id": "1"}, {"owner": "ann", "balance": "90"}),
        ("accounts", "UPDATE", {"account_id": "2"}, {"owner": "bob", "balance": "60"}),
    )
    changelog.land()
    changelog.commit(("accounts", "DELETE", {"account_id": "2"}, {}))
    changelog.commit(("accounts", "INSERT", {"account_id": "3"}, {"owner": "cy", "balance": "7"}))
    changelog.land()


def test_the_session_s_jvm_compiles_with_c1_only_and_maps_the_class_archive(spark) -> None:
    """What bench/RESULTS.md measured ("The JVM's compiler", "Spark's classes shared") is what
    a session gets: C1 only with a full-size code cache, and the archive ``make jars`` made
    mapped into the driver (a JVM that refused it, its jars changed, would run without it),
    Delta's classes loaded by the JVM's own class loader, so the archive holds them too."""
    jvm = spark._jvm
    diagnostics = jvm.java.lang.management.ManagementFactory.getPlatformMXBean(
        jvm.java.lang.Class.forName("com.sun.management.HotSpotDiagnosticMXBean")
    )
    assert diagnostics.getVMOption("TieredStopAtLevel").getValue() == "1"
    code_cache = diagnostics.getVMOption("ReservedCodeCacheSize").getValue()
    assert int(code_cache) == 240 << 20, "C1 alone would leave the client VM's 48 MB"
    archive = jars_dir().resolve() / CLASS_ARCHIVE
    assert diagnostics.getVMOption("SharedArchiveFile").getValue() == str(archive)
    assert diagnostics.getVMOption("UseSharedSpaces").getValue() == "true"
    pid = jvm.java.lang.ProcessHandle.current().pid()
    assert str(archive) in Path(f"/proc/{pid}/maps").read_text(), "the archive is not mapped"
    delta = jvm.java.lang.Class.forName("io.delta.tables.DeltaTable").getClassLoader()
    assert delta.equals(jvm.java.lang.ClassLoader.getSystemClassLoader()), str(delta)


def test_an_archive_made_elsewhere_is_taken_only_where_its_jars_are_the_same_files(
    tmp_path: Path,
) -> None:
    """``make`` links one archive made in its cache into every clone (``reuse_archive``): taken
    where the clone's jars are hard links of those it was made with; refused, nothing linked,
    where one jar is a copy with the same time (a driver would run without it, silently)."""
    wait_for_build(CLASS_ARCHIVE_BUILD)
    made = jars_dir().resolve()
    for name in ("linked", "copied"):
        (tmp_path / name).mkdir()
        for jar in made.glob("*.jar"):
            os.link(jar, tmp_path / name / jar.name)
    delta = next(made.glob("io.delta_delta-spark_*.jar"))
    (tmp_path / "copied" / delta.name).unlink()
    shutil.copy2(delta, tmp_path / "copied" / delta.name)
    assert reuse_archive(made, tmp_path / "linked") is None
    assert (tmp_path / "linked" / CLASS_ARCHIVE).samefile(made / CLASS_ARCHIVE)
    refused = reuse_archive(made, tmp_path / "copied")
    assert refused is not None and "mismatch" in refused, refused
    assert not (tmp_path / "copied" / CLASS_ARCHIVE).exists()


def test_the_session_s_python_workers_import_the_installed_compiled_pyspark(spark) -> None:
    """Spark's zips of PySpark's sources, first on a worker's path, made every worker compile
    the modules it imported again (``runtime.python_daemon``): a worker imports the installed
    package, and no zip or jar of Spark's is left on its path."""
    import pyspark

    def where(_: object) -> tuple[str, list[str]]:
        import os
        import sys

        import pyspark as worker_pyspark

        zipped = [p for p in sys.path if p.endswith((".zip", ".jar")) and os.path.exists(p)]
        return str(worker_pyspark.__file__), zipped

    [(module, zipped)] = spark.sparkContext.parallelize([0], 1).map(where).collect()
    assert module == pyspark.__file__
    assert zipped == []


def test_a_python_worker_that_started_late_restarts_the_query_a_bounded_number_of_times(
    tmp_path: Path,
) -> None:
    """Seen under make test-under-load: the query failed with Spark's "Python worker failed to
    connect back", which ended the job although nothing had committed."""
    config = configure(tmp_path, max_restarts=2)
    late = RuntimeError(f"[STREAM_FAILED] terminated with exception: {PYTHON_WORKER_LATE}.")
    assert restart_reason(late, 1, config) == PYTHON_WORKER_LATE
    with pytest.raises(PipelineFailed, match=PYTHON_WORKER_LATE):
        restart_reason(late, 2, config)
    with pytest.raises(PipelineFailed, match="something else"):
        restart_reason(RuntimeError("something else"), 0, config)


def test_a_change_log_holding_only_a_new_jobs_empty_first_version_is_waited_on(
    tmp_path: Path,
) -> None:
    config = configure(tmp_path)
    changelog = ChangeLog(config.changelog_uri)
    assert changelog.sink.latest_checkpoint() is not None

    def no_spark() -> None:
        raise AssertionError("Spark started with nothing to process")

    stats = run_pipeline(config, null_logger(), threading.Event(), no_spark)
    assert stats.batches == 0
    assert not (tmp_path / "mirrors").exists()


def test_metrics_follow_what_spark_reports_and_the_mirrors_received(spark, tmp_path: Path) -> None:
    """Spark's query listener feeds batches, durations, rows read and state rows; the batch
    function feeds rows merged and the newest commit applied; the job loop the deployment."""
    config = configure(tmp_path, trigger="continuous", trigger_interval_s=0.2)
    changelog = ChangeLog(config.changelog_uri)
    seed(changelog)
    landed = DeltaTable(config.changelog_uri).to_pyarrow_table(columns=["commit_timestamp_text"])
    newest = max(landed.column("commit_timestamp_text").to_pylist())
    metrics = PipelineMetrics()
    value = metrics.registry.get_sample_value
    stop, ended = threading.Event(), threading.Event()
    result: dict[str, batch_writer.JobStats] = {}

    def follow() -> None:
        try:
            result["stats"] = run_pipeline(
                config, null_logger(), stop, lambda: spark, metrics=metrics
            )
        finally:
            ended.set()

    thread = threading.Thread(target=follow)
    thread.start()
    try:
        deadline = time.monotonic() + 180
        while value("pipeline_input_rows_total") != landed.num_rows and not ended.is_set():
            assert time.monotonic() < deadline, f"rows read: {value('pipeline_input_rows_total')}"
            time.sleep(0.1)
        assert value("pipeline_query_running") == 1
    finally:
        stop.set()
        thread.join()
    stats = result["stats"]
    assert value("pipeline_query_running") == 0
    assert value("pipeline_batches_total") == stats.batches >= 1
    assert value("pipeline_batch_duration_seconds_count") == stats.batches
    assert (value("pipeline_batch_duration_seconds_sum") or 0) > 0
    assert value("pipeline_rows_merged_total", {"table": "accounts"}) == stats.rows_merged >= 3
    assert value("pipeline_state_rows") == 3  # keys 1 and 3, and key 2's tombstone
    assert value("pipeline_changelog_files_outstanding") == 0
    assert (
        value("pipeline_state_deployment")
        == SchemaRegistry(config.checkpoint_uri).history()[-1].number
    )
    assert value("pipeline_newest_commit_applied_seconds") == parse_rfc3339(newest) / 1e9
    assert (value("pipeline_freshness_lag_seconds") or 0) > 0
    assert value("pipeline_query_restarts_total", {"reason": "SOURCE_SCHEMA_CHANGED"}) is None
    assert value("pipeline_batch_running_seconds") == 0


def test_a_batch_in_progress_shows_how_long_it_has_run() -> None:
    now = [100.0]
    metrics = PipelineMetrics(monotonic=lambda: now[0])
    running = functools.partial(metrics.registry.get_sample_value, "pipeline_batch_running_seconds")
    with pytest.raises(RuntimeError), metrics.batch_running():
        now[0] += 42
        assert running() == 42
        raise RuntimeError("the batch failed")
    assert running() == 0


def test_mirrors_follow_the_change_log_and_replays_change_nothing(spark, tmp_path: Path) -> None:
    """Also what state costs, counted by RocksDB itself (Spark's rocksdbGetCount, which counts a
    read of Spark's own before each write): a new job's first batch reads no key (its store
    starts empty); a later one reads each key it changes."""
    config = configure(tmp_path)
    changelog = ChangeLog(config.changelog_uri)
    seed(changelog)
    metrics = PipelineMetrics()

    def state_store(operation: str) -> float:
        sample = metrics.registry.get_sample_value(
            "pipeline_state_store_operations_total", {"operation": operation}
        )
        return sample or 0.0

    run_pipeline(config, null_logger(), threading.Event(), lambda: spark, metrics=metrics)
    first = state_store("read"), state_store("write")
    # Spark's own reads only: one before each write, and one for the tombstone's TTL
    assert first[1] >= 3 and first[0] == first[1] + 1, first
    expected = {
        1: {"account_id": 1, "owner": "ann", "balance": 90},
        3: {"account_id": 3, "owner": "cy", "balance": 7},
    }
    assert mirror_rows(spark, config) == expected

    # The same rows again (a replayed change-log version), then a new change for key 2.
    write_deltalake(
        config.changelog_uri,
        changelog_rows.to_arrow(changelog.landed[0] + changelog.landed[1]),
        mode="append",
    )
    changelog.commit(("accounts", "INSERT", {"account_id": "2"}, {"owner": "bo", "balance": "1"}))
    changelog.land()
    stats = run_pipeline(config, null_logger(), threading.Event(), lambda: spark, metrics=metrics)
    assert stats.batches >= 1
    assert mirror_rows(spark, config) == {
        **expected,
        2: {"account_id": 2, "owner": "bo", "balance": 1},
    }
    reads, writes = state_store("read") - first[0], state_store("write") - first[1]
    assert reads > writes >= 1, (reads, writes)  # the replayed keys are read, not written


@pytest.mark.parametrize("replayed_by", ["driver", "spark"])
def test_a_batch_the_mirror_holds_is_skipped_whichever_way_merges_it_again(
    spark, tmp_path: Path, replayed_by: str
) -> None:
    """A crash between the MERGE and Spark's checkpoint commit replays the batch: the mirror's
    application transaction must skip it, whether delta-rs or delta-spark merged it first."""
    config = configure(tmp_path)
    seed(ChangeLog(config.changelog_uri))
    stats = run(spark, config)
    uri = mirror_uri(config.mirror_root, "accounts")
    app_id = f"{config.job_id}:{checkpoint_id(config.checkpoint_uri)}"
    last_batch = DeltaTable(uri).transaction_version(app_id)
    assert last_batch is not None and last_batch == stats.batches - 1
    shapes = discover_shapes(config.changelog_uri)
    changed = spark.createDataFrame(
        [("accounts", '{"account_id":"1"}', "UPSERT", "2030-01-01T00:00:00Z", (1, "zed", 5), None)],
        output_schema(shapes),
    )
    limit = 1000 if replayed_by == "driver" else 0
    before = mirror_rows(spark, config)
    version = DeltaTable(uri).version()
    write_batch(changed, last_batch, shapes, config.mirror_root, app_id, null_logger(), limit)
    assert DeltaTable(uri).version() == version
    assert mirror_rows(spark, config) == before

    write_batch(changed, last_batch + 1, shapes, config.mirror_root, app_id, null_logger(), limit)
    assert mirror_rows(spark, config)[1] == {"account_id": 1, "owner": "zed", "balance": 5}
    assert DeltaTable(uri).transaction_version(app_id) == last_batch + 1


@pytest.mark.parametrize(
    "maintenance, conflict",
    [
        ("properties", "MetadataChangedException"),
        ("deletion_vectors", None),  # delta-spark commits over delta-rs's protocol upgrade
        ("optimize", "ConcurrentAppendException"),
    ],
)
def test_a_spark_merge_that_meets_a_user_s_maintenance_is_retried(
    spark, tmp_path: Path, maintenance: str, conflict: str | None
) -> None:
    """Seed 001's conflicts, raised for real: a user's ALTER, protocol upgrade or OPTIMIZE (by
    delta-rs) commits while delta-spark's MERGE of a batch runs (from inside the MERGE's own
    read of its source). A conflicting commit is retried; the mirror holds the batch once."""
    config = configure(tmp_path)
    seed(ChangeLog(config.changelog_uri))
    run(spark, config)
    uri = mirror_uri(config.mirror_root, "accounts")
    DeltaTable(uri).optimize.compact()
    for key in (7, 8):  # two files for OPTIMIZE to compact, one read by the MERGE
        one = DeltaTable(uri).to_pyarrow_table().slice(0, 1)
        keyed = one.set_column(0, "account_id", pyarrow.array([key], one.schema.field(0).type))
        write_deltalake(uri, keyed, mode="append")
    shapes = discover_shapes(config.changelog_uri)
    row = ("accounts", '{"account_id":"1"}', "UPSERT", "2030-01-01T00:00:00Z", (1, "zed", 5), None)
    changed = spark.createDataFrame([row], output_schema(shapes))
    evaluations = tmp_path / "evaluations"
    changed = changed.withColumn(
        "table_name",
        _maintained_on_second_read(uri, maintenance, str(evaluations))(changed["table_name"]),
    )
    log = CapturingLogger()
    merge = functools.partial(
        merge_into_mirror, spark, uri, shapes["accounts"], changed, "user-maintenance", 50
    )
    commit_once("accounts", merge, 50, log)
    retries = [call.kwargs for call in log.calls if call.args == ("batch_commit_retry",)]
    if conflict is None:
        assert not retries, log.calls
    else:
        assert retries and retries[0]["conflict"] == conflict, log.calls
    assert mirror_rows(spark, config)[1] == {"account_id": 1, "owner": "zed", "balance": 5}
    assert DeltaTable(uri).transaction_version("user-maintenance") == 50
    merges = [c for c in DeltaTable(uri).history(4) if c["operation"] == "MERGE"]
    assert len(merges) == 1


def test_a_commit_whose_store_request_failed_is_tried_again_and_other_errors_are_not() -> None:
    """delta-rs raises ``OSError`` for a store request that timed out (seen on S3 through the
    faulty proxy: the PUT of a mirror's log file, whose answer was held past the 5 s timeout);
    the batch is tried again (its commit finds a landed batch), anything else ends it."""
    attempts: list[str] = []

    def flaky() -> int:
        attempts.append("flaky")
        if len(attempts) == 1:
            raise OSError("Generic S3 error: Error performing PUT ... operation timed out")
        return 7

    log = CapturingLogger()
    assert commit_once("accounts", flaky, 3, log) == 7
    retries = [call.kwargs for call in log.calls if call.args == ("batch_commit_retry",)]
    assert len(attempts) == 2 and len(retries) == 1 and retries[0]["conflict"] is None

    def broken() -> int:
        attempts.append("broken")
        raise ValueError("not a store error")

    with pytest.raises(ValueError):
        commit_once("accounts", broken, 3, log)
    assert attempts.count("broken") == 1


@pytest.mark.parametrize("landed", [False, True])
def test_a_mirror_whose_creation_lost_the_store_s_answer_is_looked_at_again(
    landed: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's error on a mirror's creating put (seen on S3 through the faulty proxy: the
    job stopped at its start with a traceback): the put either did not land or landed with its
    answer lost; either way the job looks again and goes on with one mirror."""
    uri = str(tmp_path / "accounts")
    create = DeltaTable.create
    attempts: list[int] = []

    def flaky(*args: Any, **kwargs: Any) -> Any:
        attempts.append(1)
        if len(attempts) == 1:
            if landed:
                create(*args, **kwargs)
            raise OSError("Generic S3 error: Error performing PUT ... operation timed out")
        return create(*args, **kwargs)

    monkeypatch.setattr(DeltaTable, "create", flaky)
    ensure_mirror(None, uri, TableShape("accounts", ACCOUNTS), null_logger())  # type: ignore[arg-type]
    assert len(attempts) == (1 if landed else 2)
    table = DeltaTable(uri)
    assert table.version() == 0
    assert {f.name for f in table.schema().fields} >= {c.name for c in ACCOUNTS}


def _maintained_on_second_read(uri: str, maintenance: str, evaluations: str) -> Any:
    """A UDF passing its value through that runs the user's maintenance once, at the second
    evaluation of the batch (the first is the key list read before the MERGE takes its
    snapshot, the second the MERGE's own read)."""
    from pyspark.sql import functions as F

    def passing(value: str) -> str:
        import os

        from deltalake import DeltaTable as Table

        with open(evaluations, "a") as counter:
            counter.write(".")
        if os.path.getsize(evaluations) == 2:
            table = Table(uri)
            if maintenance == "properties":
                table.alter.set_table_properties({"delta.enableChangeDataFeed": "true"})
            elif maintenance == "deletion_vectors":
                table.alter.set_table_properties({"delta.enableDeletionVectors": "true"})
            else:
                table.optimize.compact()
        return value

    return F.udf(passing, "string")


def test_a_change_log_vacuumed_under_a_stopped_job_stops_it_with_one_line(
    spark, tmp_path: Path
) -> None:
    """Versions the job has not read, compacted by the ingest and vacuumed with no retention:
    their files are gone, and the job says so and how to recover instead of Spark's error."""
    config = configure(tmp_path)
    changelog = ChangeLog(config.changelog_uri)
    seed(changelog)
    run(spark, config)
    for key in range(10, 14):
        changelog.commit(("accounts", "INSERT", {"account_id": str(key)}, {"owner": "x"}))
        changelog.land()
    table = DeltaTable(config.changelog_uri)
    table.optimize.compact()
    table.vacuum(0, dry_run=False, enforce_retention_duration=False)
    with pytest.raises(PipelineFailed, match=r"^CHANGELOG_FILES_REMOVED: a data file of "):
        run(spark, config)


def test_a_fresh_job_reads_the_commits_from_version_0_or_after_compaction_the_snapshot(
    spark, tmp_path: Path
) -> None:
    """Version 0 is read only while the change log holds nothing but appends; once compacted and
    vacuumed its first files are gone, and a new job reads Delta's initial snapshot instead."""
    config = configure(tmp_path)
    changelog = ChangeLog(config.changelog_uri)
    seed(changelog)
    expected = {
        1: {"account_id": 1, "owner": "ann", "balance": 90},
        3: {"account_id": 3, "owner": "cy", "balance": 7},
    }

    def fresh_job(name: str) -> dict[str, Any]:
        log = CapturingLogger()
        fresh = replace(
            config, checkpoint_uri=str(tmp_path / name), mirror_root=str(tmp_path / name / "m")
        )
        run_pipeline(fresh, log, threading.Event(), lambda: spark)
        assert mirror_rows(spark, fresh) == expected
        (start,) = [c.kwargs for c in log.calls if c.args == ("pipeline_stream_start",)]
        return start

    assert fresh_job("appends")["starting_version"] == 0
    DeltaTable(config.changelog_uri).optimize.compact()
    DeltaTable(config.changelog_uri).vacuum(0, dry_run=False, enforce_retention_duration=False)
    start = fresh_job("compacted")
    assert start["starting_version"] is None and "OPTIMIZE" in start["reason"], start


@pytest.mark.parametrize("local_merge_max_rows", [50_000, 0], ids=["delta-rs", "spark"])
def test_a_mirror_file_deleted_behind_the_job_stops_it_with_one_line_naming_the_mirror(
    spark, tmp_path: Path, local_merge_max_rows: int
) -> None:
    """A data file the mirror's log lists, deleted (as delta-spark's VACUUM FULL of retention 0
    did beside the job, pipeline/NOTES.md): each MERGE path stops the job with a line naming the
    mirror and the rebuild, instead of the store's error."""
    config = configure(tmp_path, local_merge_max_rows=local_merge_max_rows)
    changelog = ChangeLog(config.changelog_uri)
    seed(changelog)
    run(spark, config)
    accounts = mirror_uri(config.mirror_root, "accounts")
    for file in DeltaTable(accounts).file_uris():
        Path(file.removeprefix("file://")).unlink()
    changelog.commit(("accounts", "UPDATE", {"account_id": "1"}, {"owner": "x"}))
    changelog.land()
    with pytest.raises(PipelineFailed, match=r"^MIRROR_FILES_REMOVED: mirror accounts lists "):
        run(spark, config)


def test_a_missing_file_is_told_by_the_table_it_lies_in() -> None:
    """Spark names a missing file by its URI (s3a:// for s3://), delta-rs on S3 by its key in
    the bucket, and a failed query's text names the change log besides: the file decides."""
    config = PipelineConfig(
        changelog_uri="s3://b/cdc/changelog",
        mirror_root="s3://b/cdc/mirrors",
        history_root="s3://b/cdc/history",
    )
    spark_history = (
        "[FAILED_READ_FILE.FILE_NOT_EXIST] Encountered error while reading file "
        "s3a://b/cdc/history/accounts/part-1.parquet. File does not exist. It is possible ...\n"
        "=== Streaming Query ===\nDeltaSource[s3a://b/cdc/changelog]"
    )
    line = files_gone_line(spark_history, config)
    assert line and line.startswith("MIRROR_FILES_REMOVED: history accounts lists "), line
    delta_rs = "Generic error: Object at location cdc/mirrors/transfers/part-2.parquet not found"
    line = files_gone_line(delta_rs, config)
    assert line and line.startswith("MIRROR_FILES_REMOVED: mirror transfers lists "), line
    assert "(part-2.parquet;" in line
    changelog = spark_history.replace("history/accounts", "changelog")
    line = files_gone_line(changelog, config)
    assert line and line.startswith("CHANGELOG_FILES_REMOVED: a data file of "), line
    assert files_gone_line("DeltaSource[s3a://b/cdc/changelog] failed", config) is None


def test_a_batch_of_wide_rows_goes_to_spark_however_few_they_are(spark, tmp_path: Path) -> None:
    """The driver collects a batch only when it is small in bytes as well as rows."""
    config = configure(tmp_path)
    seed(ChangeLog(config.changelog_uri))
    run(spark, config)
    shapes = discover_shapes(config.changelog_uri)
    app_id = f"{config.job_id}:{checkpoint_id(config.checkpoint_uri)}"
    wide = "w" * 200_000

    def batch(key: int) -> Any:
        row = ("accounts", f'{{"account_id":"{key}"}}', "UPSERT", "2030-01-01T00:00:00Z")
        return spark.createDataFrame([(*row, (key, wide, key), None)], output_schema(shapes))

    def write(batch_id: int, key: int, max_bytes: int) -> bool:
        result = write_batch(
            batch(key), batch_id, shapes, config.mirror_root, app_id, null_logger(), 1000, max_bytes
        )
        return result.merged_on_driver

    assert write(100, 7, 1024 * 1024), "one row of 200 kB fits 1 MiB"
    assert not write(101, 8, 100_000), "one row of 200 kB does not fit 100 kB"
    rows = mirror_rows(spark, config)
    assert rows[7]["owner"] == wide and rows[8]["owner"] == wide


def test_a_drain_turns_a_continuous_run_into_one_that_ends(spark, tmp_path: Path) -> None:
    """SIGUSR1's path: the running query stops, and the job processes what the change log
    holds, then returns (a drained query that kept the continuous trigger never ended)."""
    config = configure(tmp_path, trigger="continuous")
    seed(ChangeLog(config.changelog_uri))
    drain, stop = threading.Event(), threading.Event()
    drain.set()
    finished: list[batch_writer.JobStats] = []
    runner = threading.Thread(
        target=lambda: finished.append(
            run_pipeline(config, null_logger(), stop, lambda: spark, drain)
        )
    )
    runner.start()
    runner.join(timeout=240)
    stop.set()
    runner.join()
    assert finished and finished[0].batches >= 1, "the drained run never ended"
    assert mirror_rows(spark, config)[1]["balance"] == 90


def test_a_drain_of_a_running_query_ends_it_once_the_mirrors_hold_the_change_log(
    spark, tmp_path: Path
) -> None:
    """SIGUSR1 while the query runs: no second query, the run returns once the mirrors hold
    every version the change log had when the drain was asked."""
    config = configure(tmp_path, trigger="continuous", trigger_interval_s=0.2)
    changelog = ChangeLog(config.changelog_uri)
    seed(changelog)
    metrics, log = PipelineMetrics(), CapturingLogger()
    drain, stop = threading.Event(), threading.Event()
    finished: list[batch_writer.JobStats] = []
    runner = threading.Thread(
        target=lambda: finished.append(
            run_pipeline(config, log, stop, lambda: spark, drain, metrics)
        )
    )
    runner.start()
    try:
        deadline = time.monotonic() + 240
        while not metrics.registry.get_sample_value("pipeline_batches_total"):
            assert runner.is_alive() and time.monotonic() < deadline, "no first batch"
            time.sleep(0.1)
        for key in range(10, 14):
            changelog.commit(("accounts", "INSERT", {"account_id": str(key)}, {"owner": "x"}))
            changelog.land()
        drain.set()
        runner.join(timeout=240)
    finally:
        stop.set()
        runner.join()
    assert finished, "the drained run never ended"
    events = [call.args[0] for call in log.calls]
    assert events.count("pipeline_query_started") == 1, events
    assert "pipeline_draining" in events
    assert set(mirror_rows(spark, config)) == {1, 3, 10, 11, 12, 13}


@pytest.mark.parametrize("local_merge_max_rows", [1000, 0])
def test_a_null_key_is_one_mirror_row_whichever_way_merges_it(
    spark, tmp_path: Path, local_merge_max_rows: int
) -> None:
    """Spanner key columns may hold NULL: the NULL-keyed row is updated and deleted in place,
    never inserted a second time."""
    config = configure(tmp_path, local_merge_max_rows=local_merge_max_rows)
    changelog = ChangeLog(config.changelog_uri)
    null_key = {"account_id": None}
    changelog.commit(("accounts", "INSERT", null_key, {"owner": "nil", "balance": "1"}))
    changelog.commit(("accounts", "INSERT", {"account_id": "5"}, {"owner": "eve", "balance": "5"}))
    changelog.land()
    run(spark, config)
    changelog.commit(("accounts", "UPDATE", null_key, {"owner": "nul", "balance": "2"}))
    changelog.land()
    run(spark, config)
    assert mirror_rows(spark, config) == {
        None: {"account_id": None, "owner": "nul", "balance": 2},
        5: {"account_id": 5, "owner": "eve", "balance": 5},
    }
    assert scan(DeltaTable(mirror_uri(config.mirror_root, "accounts"))).num_rows == 2
    changelog.commit(("accounts", "DELETE", null_key, {}))
    changelog.land()
    run(spark, config)
    assert list(mirror_rows(spark, config)) == [5]


def add_email_column(changelog: ChangeLog) -> None:
    changelog.columns["accounts"] = (*ACCOUNTS, EMAIL)
    changelog.commit(("accounts", "UPDATE", {"account_id": "1"}, {"email": "ann@example.com"}))
    changelog.commit(
        ("accounts", "INSERT", {"account_id": "4"}, {"owner": "di", "balance": "4", "email": "d@x"})
    )
    changelog.land()


def fail_first_merge(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The first batch after the evolution fails in the sink, as a crash or conflict would."""
    failures: list[int] = []
    real = batch_writer.write_batch

    def flaky(changes, batch_id, *args, **kwargs):
        if not failures:
            failures.append(batch_id)
            raise RuntimeError("injected failure of the first batch after the evolution")
        return real(changes, batch_id, *args, **kwargs)

    monkeypatch.setattr(batch_writer, "write_batch", flaky)
    return failures


def test_a_new_spanner_column_evolves_state_and_mirror_even_if_the_next_batch_fails(
    spark, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = configure(tmp_path)
    changelog = ChangeLog(config.changelog_uri)
    seed(changelog)
    run(spark, config)
    add_email_column(changelog)

    # First start: the query meets the new column and stops; the job evolves and restarts.
    # Then the first batch after the evolution fails, and the job runs it again.
    failures = fail_first_merge(monkeypatch)
    with pytest.raises(PipelineFailed, match="injected failure"):
        run(spark, config)
    assert failures
    monkeypatch.undo()
    stats = run(spark, config)
    assert stats.restarts == 0
    rows = mirror_rows(spark, config)
    # Key 1's update carried only the email: owner and balance come from the carried state.
    assert rows[1] == {"account_id": 1, "owner": "ann", "balance": 90, "email": "ann@example.com"}
    assert rows[4] == {"account_id": 4, "owner": "di", "balance": 4, "email": "d@x"}
    assert rows[3]["email"] is None
    history = SchemaRegistry(config.checkpoint_uri).history()
    assert [d.number for d in history] == [1, 2]
    assert "email" in image_of(history[1].schemas["entry_accounts"]).fieldNames()


def test_without_the_guard_the_open_source_bug_loses_the_new_field(
    spark, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reproduces the bug: with the failed batch's schema files left in place, the restarted
    query stores the added field as None; the processor's read-back check stops it."""
    config = configure(tmp_path, max_restarts=1)
    changelog = ChangeLog(config.changelog_uri)
    seed(changelog)
    run(spark, config)
    add_email_column(changelog)
    fail_first_merge(monkeypatch)
    with pytest.raises(PipelineFailed, match="injected failure"):
        run(spark, config)
    monkeypatch.undo()
    monkeypatch.setattr(job, "roll_back_uncommitted_batch", lambda uri: [])
    with pytest.raises(PipelineFailed, match="STATE_ROUNDTRIP_MISMATCH"):
        run(spark, config)
    monkeypatch.undo()
    run(spark, config)  # with the guard back, the same checkpoint recovers
    assert mirror_rows(spark, config)[1]["email"] == "ann@example.com"


def test_a_string_column_turned_bytes_widens_state_and_rewrites_the_mirror(
    spark, tmp_path: Path
) -> None:
    config = configure(tmp_path)
    changelog = ChangeLog(config.changelog_uri)
    seed(changelog)
    run(spark, config)
    changelog.columns["accounts"] = (
        ACCOUNTS[0],
        ColumnType("owner", {"code": "BYTES"}, False, 2),
        ACCOUNTS[2],
    )
    raw = base64.b64encode(b"\x00zed").decode()
    changelog.commit(("accounts", "UPDATE", {"account_id": "3"}, {"balance": "8"}))
    changelog.commit(("accounts", "INSERT", {"account_id": "5"}, {"owner": raw, "balance": "5"}))
    changelog.land()
    run(spark, config)
    history = SchemaRegistry(config.checkpoint_uri).history()
    image = image_of(history[-1].schemas["entry_accounts"])
    assert image["owner"].dataType.simpleString() == "binary"
    rows = mirror_rows(spark, config)
    assert rows[5]["owner"] == bytearray(b"\x00zed")
    assert rows[3] == {"account_id": 3, "owner": bytearray(b"cy"), "balance": 8}
    assert rows[1]["owner"] == bytearray(b"ann")


def test_a_second_job_on_the_same_checkpoint_fails_fast(tmp_path: Path) -> None:
    first = CheckpointLock(str(tmp_path / "checkpoint"), 60, "pipeline v1")
    first.acquire()
    try:
        with pytest.raises(CheckpointInUse, match=r"in use by pipeline v1 .* only one job version"):
            CheckpointLock(str(tmp_path / "checkpoint"), 60, "pipeline v2").acquire()
    finally:
        first.release()
    CheckpointLock(str(tmp_path / "checkpoint"), 60, "pipeline v2").acquire()


ARRAY_ELEMENTS = {
    "INT64": ["1", None, "-9223372036854775808"],
    "FLOAT64": [1.5, None, "NaN", "-Infinity"],
    "FLOAT32": [0.25, None],
    "BOOL": [True, None, False],
    "STRING": ["a", None, "ü✓", ""],
    "BYTES": [base64.b64encode(b"\x00\xff").decode(), None],
    "DATE": ["0001-01-01", None, "9999-12-31"],
    "TIMESTAMP": ["0001-01-01T00:00:00Z", None, "9999-12-31T23:59:59.999999Z"],
    "NUMERIC": ["-99999999999999999999999999999.999999999", None],
    "JSON": ['{"a":[1,null]}', None],
}
PG_NUMERIC = {"code": "NUMERIC", "type_annotation": "PG_NUMERIC"}
EDGES = (
    ACCOUNTS[0],
    ColumnType("valid_from", {"code": "TIMESTAMP"}, False, 2),
    ColumnType("valid_to", {"code": "TIMESTAMP"}, False, 3),
    ColumnType("born", {"code": "DATE"}, False, 4),
    ColumnType("pg_amount", PG_NUMERIC, False, 5),
    ColumnType("pg_document", {"code": "JSON", "type_annotation": "PG_JSONB"}, False, 6),
    ColumnType("a_pg_numeric", {"code": "ARRAY", "array_element_type": PG_NUMERIC}, False, 7),
    *(
        ColumnType(
            f"a_{code.lower()}",
            {"code": "ARRAY", "array_element_type": {"code": code}},
            False,
            8 + n,
        )
        for n, code in enumerate(ARRAY_ELEMENTS)
    ),
)


def test_null_array_elements_and_every_timestamp_reach_a_mirror_both_readers_open(
    spark, tmp_path: Path
) -> None:
    """A NULL array element once failed every batch (Spark's Avro state refuses it), and
    timestamps outside 1677 to 2262 made mirrors unreadable by deltalake (Parquet INT96)."""
    from pipeline.catalog import scan

    config = configure(tmp_path)
    changelog = ChangeLog(config.changelog_uri, columns={"accounts": EDGES})
    arrays = {f"a_{code.lower()}": values for code, values in ARRAY_ELEMENTS.items()}
    changelog.commit(
        (
            "accounts",
            "INSERT",
            {"account_id": "1"},
            {
                "valid_from": "0001-01-01T00:00:00Z",
                "valid_to": "9999-12-31T23:59:59.999999Z",
                "born": "0001-01-01",
                "pg_amount": "NaN",
                "pg_document": '{"b": [1, null], "a": "ü"}',
                "a_pg_numeric": ["NaN", None, "1e400", "-0.000000000001"],
                **arrays,
            },
        ),
        (
            "accounts",
            "INSERT",
            {"account_id": "2"},
            {"pg_amount": "1e400", "a_pg_numeric": [], **{name: [] for name in arrays}},
        ),
        (
            "accounts",
            "INSERT",
            {"account_id": "3"},
            {"born": "9999-12-31", "a_pg_numeric": None, **dict.fromkeys(arrays)},
        ),
    )
    changelog.land()
    run(spark, config)

    uri = f"{config.mirror_root}/accounts"
    by_deltalake = {r["account_id"]: r for r in scan(DeltaTable(uri)).to_pylist()}
    by_spark = {
        r["account_id"]: r for r in spark.read.format("delta").load(uri).toArrow().to_pylist()
    }
    assert repr(by_spark) == repr(by_deltalake)  # repr: NaN equals itself
    first, second, third = by_deltalake[1], by_deltalake[2], by_deltalake[3]
    assert (first["valid_from"].year, first["valid_to"].year) == (1, 9999)
    assert first["valid_to"].microsecond == 999999
    assert (first["born"].year, third["born"].year) == (1, 9999)
    assert (first["pg_amount"], second["pg_amount"]) == ("NaN", "1e400")
    assert json.loads(first["pg_document"]) == {"a": "ü", "b": [1, None]}
    assert third["pg_document"] is None
    assert first["a_pg_numeric"] == ["NaN", None, "1e400", "-0.000000000001"]
    assert (second["a_pg_numeric"], third["a_pg_numeric"]) == ([], None)
    assert first["a_int64"] == [1, None, -(2**63)]
    assert first["a_float64"][:2] == [1.5, None] and first["a_float64"][3] == float("-inf")
    assert first["a_float64"][2] != first["a_float64"][2]  # NaN
    assert first["a_string"] == ["a", None, "ü✓", ""]
    assert first["a_bytes"] == [b"\x00\xff", None]
    assert [d and d.year for d in first["a_date"]] == [1, None, 9999]
    assert [t and t.year for t in first["a_timestamp"]] == [1, None, 9999]
    assert first["a_json"] == ['{"a":[1,null]}', None]
    assert all(second[name] == [] for name in arrays)
    assert all(third[name] is None for name in arrays)


RATIO_FLOAT64 = ColumnType("ratio", {"code": "FLOAT64"}, False, 4)
RATIO_FLOAT32 = ColumnType("ratio", {"code": "FLOAT32"}, False, 5)


def land_ratio_history(changelog: ChangeLog, stage: int) -> None:
    """Stage 0: ratio is FLOAT64; 1: dropped and added again as FLOAT32 (Spanner: a new,
    empty column); 2: back to FLOAT64 the same way."""
    if stage == 0:
        changelog.columns["accounts"] = (*ACCOUNTS, RATIO_FLOAT64)
        changelog.commit(
            (
                "accounts",
                "INSERT",
                {"account_id": "1"},
                {"owner": "a", "balance": "1", "ratio": 1.5},
            ),
            (
                "accounts",
                "INSERT",
                {"account_id": "2"},
                {"owner": "b", "balance": "2", "ratio": 2.5},
            ),
        )
    elif stage == 1:
        changelog.columns["accounts"] = (*ACCOUNTS, RATIO_FLOAT32)
        changelog.commit(
            (
                "accounts",
                "INSERT",
                {"account_id": "3"},
                {"owner": "c", "balance": "3", "ratio": 0.25},
            ),
            ("accounts", "UPDATE", {"account_id": "1"}, {"balance": "10"}),
        )
    else:
        changelog.columns["accounts"] = (*ACCOUNTS, RATIO_FLOAT64)
        changelog.commit(("accounts", "UPDATE", {"account_id": "2"}, {"ratio": 7.0}))
    changelog.land()


def test_a_column_dropped_and_added_again_with_another_type_is_a_new_generation(
    spark, tmp_path: Path
) -> None:
    """Spanner accepts DROP COLUMN ratio, ADD COLUMN ratio FLOAT32 (it was FLOAT64): a new column
    sharing a name, not a narrowing. It must never stop the job, behind or replayed, and a type
    that comes back under the same column list is told apart by its rows' commit timestamps."""
    three = processed_three_ways(
        spark,
        tmp_path / "three",
        [functools.partial(land_ratio_history, stage=n) for n in range(3)],
    )
    assert (
        three
        == [
            {
                1: {"account_id": 1, "owner": "a", "balance": 10, "ratio": None},
                2: {"account_id": 2, "owner": "b", "balance": 2, "ratio": 7.0},
                3: {"account_id": 3, "owner": "c", "balance": 3, "ratio": None},
            }
        ]
        * 3
    )
    fields = SchemaRegistry(str(tmp_path / "three" / "following" / "checkpoint")).latest()
    assert fields is not None
    assert [
        (f.name, f.dataType.simpleString())
        for f in image_of(fields.schemas["entry_accounts"]).fields[3:]
    ] == [("ratio", "double"), ("ratio__g2", "float"), ("ratio__g3", "double")]


def test_a_schema_row_showing_a_drop_restarts_a_running_job_and_nulls_the_column(
    spark, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A NEW_VALUES change log: updates list changed columns only, so only the schema row the
    ingest service lands shows ``owner`` dropped. A job planned before it landed meets it in a
    batch, restarts, learns the drop and renews the mirror column."""
    config = configure(tmp_path)
    changelog = ChangeLog(config.changelog_uri, value_capture_type="NEW_VALUES")
    seed(changelog)
    run(spark, config)
    planned_before = discover_shapes(config.changelog_uri)
    without_owner = (ACCOUNTS[0], ACCOUNTS[2])
    changelog.columns["accounts"] = without_owner
    changelog.commit(("accounts", "UPDATE", {"account_id": "3"}, {"balance": "8"}))
    changelog.land(watched={"accounts": without_owner})
    plans = iter([planned_before])
    real = pipeline_catalog.discover_shapes
    monkeypatch.setattr(deployment, "discover_shapes", lambda uri: next(plans, None) or real(uri))
    stats = run(spark, config)
    assert stats.restarts == 1
    assert mirror_rows(spark, config) == {
        1: {"account_id": 1, "owner": None, "balance": 90},
        3: {"account_id": 3, "owner": None, "balance": 8},
    }


def test_a_row_that_cannot_be_applied_stops_the_job_with_one_line_and_no_value(
    spark, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    config = configure(tmp_path)
    changelog = ChangeLog(config.changelog_uri)
    seed(changelog)
    run(spark, config)
    # No value Spanner sends should do this; a future type quirk could.
    changelog.commit(("accounts", "UPDATE", {"account_id": "1"}, {"balance": "not-a-number"}))
    changelog.land()
    version = DeltaTable(config.changelog_uri).version()
    with pytest.raises(PipelineFailed) as caught:
        run(spark, config)
    message = str(caught.value)
    assert message.startswith("ROW_NOT_APPLICABLE: table 'accounts', key sha256:"), message
    assert "column 'balance' (INT64): ValueError" in message
    assert f"(change-log version {version})" in message
    assert "not-a-number" not in message and "account_id" not in message
    assert "\n" not in message
    logged = capfd.readouterr()
    assert "not-a-number" not in logged.out + logged.err, "a row value reached the logs"
    assert mirror_rows(spark, config)[1]["balance"] == 90  # what had landed is untouched


class RestartingQuery:
    """A query that fails with a restart marker after landing ``batches`` batches."""

    def __init__(self, stats: batch_writer.JobStats, batches: int) -> None:
        stats.batches += batches

    def awaitTermination(self, timeout: float) -> bool:
        from pyspark.errors import StreamingQueryException

        raise StreamingQueryException(message="SOURCE_SCHEMA_CHANGED: table 'accounts'")

    def stop(self) -> None:
        pass


class NoSpark:
    """A session stand-in for a job whose queries are stand-ins too: it only takes listeners."""

    class streams:
        listeners: list[object] = []

        @classmethod
        def addListener(cls, listener: object) -> None:
            cls.listeners.append(listener)

        @classmethod
        def removeListener(cls, listener: object) -> None:
            cls.listeners.remove(listener)


@pytest.mark.parametrize(
    ("batches_between", "gives_up_after"),
    [([1, 1, 1, 1, 1, 1, 1], None), ([1, 0, 0, 0], 3), ([0, 0, 1, 0, 0, 0], 5)],
)
def test_max_restarts_counts_restarts_without_a_batch_between_them(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    batches_between: list[int],
    gives_up_after: int | None,
) -> None:
    """A long-running job meets many schema changes: only restarts in a row, with no batch
    landed between them, count against max_restarts (2 here)."""
    config = configure(tmp_path, max_restarts=2, trigger="continuous")
    seed(ChangeLog(config.changelog_uri))
    stop = threading.Event()
    starts = iter(batches_between)

    def start_query(spark, config, plan, stats, log, metrics, generation, lease):
        batches = next(starts, None)
        if batches is None:
            stop.set()
            batches = 0
        return RestartingQuery(stats, batches)

    monkeypatch.setattr(job, "start_query", start_query)
    monkeypatch.setattr(job, "ensure_mirror", lambda *args: None)
    monkeypatch.setattr(job, "roll_back_uncommitted_batch", lambda uri: [])
    if gives_up_after is None:
        metrics = PipelineMetrics()
        stats = run_pipeline(config, null_logger(), stop, NoSpark, metrics=metrics)
        assert stats.restarts >= len(batches_between)
        restarts = {"reason": "SOURCE_SCHEMA_CHANGED"}
        assert metrics.registry.get_sample_value("pipeline_query_restarts_total", restarts) == (
            stats.restarts
        )
        assert NoSpark.streams.listeners == []
    else:
        with pytest.raises(PipelineFailed, match="SOURCE_SCHEMA_CHANGED"):
            run_pipeline(config, null_logger(), stop, NoSpark)
        assert next(starts, "exhausted") == [*batches_between, "exhausted"][gives_up_after]


def layout_2_checkpoint(tmp_path: Path, fixture: Path = LAYOUT_2) -> PipelineConfig:
    """A copy of an older version's change log, checkpoint and mirrors
    (tests/fixtures/make_layout*_checkpoint.py). Spark's state metadata names its schema files by
    absolute path: the copy's are rewritten, and their checksums dropped."""
    shutil.copytree(fixture, tmp_path, dirs_exist_ok=True)
    for path in (tmp_path / "checkpoint/state/0/_metadata/v2").iterdir():
        if path.name.startswith("."):
            path.unlink()
        else:
            moved = re.sub(
                r'file:[^"]*?/checkpoint/', f"file:{tmp_path}/checkpoint/", path.read_text()
            )
            path.write_text(moved)
    return configure(tmp_path)


def test_a_layout_2_checkpoint_moves_into_entries_key_by_key(spark, tmp_path: Path) -> None:
    """Keys of a checkpoint written before one state value per key are read from layout 2's
    variables, with their positions (replayed older rows stay ignored, deleted keys stay
    deleted) and images (NEW_VALUES updates keep the other columns), then move to their entry."""
    config = layout_2_checkpoint(tmp_path)
    kept = {
        1: {"account_id": 1, "owner": "ann", "balance": 90, "email": None},
        3: {"account_id": 3, "owner": "cy", "balance": 7, "email": None},
        4: {"account_id": 4, "owner": "di", "balance": 4, "email": "d@x"},
    }
    assert mirror_rows(spark, config) == kept
    inserts = DeltaTable(config.changelog_uri).to_pyarrow_table(
        filters=[("mod_type", "=", "INSERT")]
    )
    assert inserts.num_rows == 6

    write_deltalake(config.changelog_uri, inserts, mode="append")
    run(spark, config)
    assert mirror_rows(spark, config) == kept
    history = SchemaRegistry(config.checkpoint_uri).history()
    assert [d.layout for d in history] == [2, 2, 4]
    assert {"row_accounts", "row_branches", "last_applied", "change_stats"} <= set(
        history[-1].schemas
    )
    assert history[-1].schemas["row_accounts"] == history[1].schemas["row_accounts"]

    changelog = ChangeLog(
        config.changelog_uri,
        columns={"accounts": (*ACCOUNTS, EMAIL), "branches": BRANCHES},
        clock=START + 10**12,
        value_capture_type="NEW_VALUES",
    )
    changelog.commit(
        ("accounts", "UPDATE", {"account_id": "1"}, {"balance": "11"}),
        ("accounts", "UPDATE", {"account_id": "4"}, {"balance": "44"}),
        ("branches", "UPDATE", {"code": "ber"}, {"city": "Bern"}),
    )
    changelog.land()
    run(spark, config)
    moved = {
        **kept,
        1: {"account_id": 1, "owner": "ann", "balance": 11, "email": None},
        4: {"account_id": 4, "owner": "di", "balance": 44, "email": "d@x"},
    }
    assert mirror_rows(spark, config) == moved
    assert mirror_rows(spark, config, "branches", "code") == {
        "ber": {"code": "ber", "city": "Bern"},
        "osl": {"code": "osl", "city": "Oslo"},
    }
    legacy = spark.read.format("statestore").option("stateVarName", "row_accounts")
    assert sorted(r.key.keys for r in legacy.load(config.checkpoint_uri).collect()) == [
        '{"account_id":"3"}'
    ]

    write_deltalake(config.changelog_uri, inserts, mode="append")
    changelog.commit(("accounts", "UPDATE", {"account_id": "1"}, {"owner": "anna"}))
    changelog.land()
    run(spark, config)
    assert mirror_rows(spark, config) == {
        **moved,
        1: {"account_id": 1, "owner": "anna", "balance": 11, "email": None},
    }


def test_a_layout_3_checkpoint_keeps_timestamps_and_any_year_reads_back(spark, tmp_path: Path):
    """Layout 4 keeps TIMESTAMP in state as epoch microseconds: a layout-3 entry (Spark's
    timestamp, the same Avro long) evolves in place and keeps its values, and Spanner's first
    and last instants read back from state (PySpark's timestamp read failed within a day of
    them: "year 0 is out of range", and every restart failed the same way)."""
    config = layout_2_checkpoint(tmp_path, LAYOUT_3)
    changelog = ChangeLog(
        config.changelog_uri,
        columns={"events": EVENTS},
        clock=START + 10**12,
        value_capture_type="NEW_VALUES",
    )
    changelog.commit(
        ("events", "UPDATE", {"event_id": "1"}, {"note": "a2"}),
        ("events", "UPDATE", {"event_id": "2"}, {"at": "0001-01-01T00:00:00Z"}),
        ("events", "INSERT", {"event_id": "4"}, {"at": "9999-12-31T23:59:59.999999Z"}),
    )
    changelog.land()
    run(spark, config)
    changelog.commit(
        ("events", "UPDATE", {"event_id": "2"}, {"note": "b2"}),
        ("events", "UPDATE", {"event_id": "4"}, {"note": "d2"}),
    )
    changelog.land()
    run(spark, config)

    rows = {
        r["event_id"]: (r["at"], r["note"])
        for r in scan(DeltaTable(mirror_uri(config.mirror_root, "events"))).to_pylist()
    }
    utc = datetime.UTC
    assert rows == {
        1: (datetime.datetime(2026, 11, 22, 10, 11, 12, 123456, tzinfo=utc), "a2"),
        2: (datetime.datetime(1, 1, 1, tzinfo=utc), "b2"),
        4: (datetime.datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=utc), "d2"),
    }
    history = SchemaRegistry(config.checkpoint_uri).history()
    assert [d.layout for d in history] == [3, 4]


def test_spanner_s_first_and_last_instants_on_hosts_east_and_west_of_utc(tmp_path: Path) -> None:
    """``python -m pipeline run`` at UTC, then on a host at UTC+14, then at UTC-12: keys written
    at years 1 and 9999 are changed in each later run (their state read back) and every mirror
    value stays exact (PySpark read a state timestamp through the local time zone: "year 0 is out of
    range" at UTC and west of it, "year 10000" east of it)."""
    from tests.processes import Pipeline

    config = configure(tmp_path)
    changelog = ChangeLog(
        config.changelog_uri, columns={"events": EVENTS}, value_capture_type="NEW_VALUES"
    )
    first, last = "0001-01-01T00:00:00Z", "9999-12-31T23:59:59.999999Z"
    changelog.commit(
        ("events", "INSERT", {"event_id": "1"}, {"at": first, "note": "a"}),
        ("events", "INSERT", {"event_id": "2"}, {"at": last, "note": "b"}),
    )
    changelog.land()
    pipeline = Pipeline(config.changelog_uri, tmp_path, tmp_path / "pipeline.log")
    for zone, stage in (("Etc/UTC", ""), ("Etc/GMT-14", "a2"), ("Etc/GMT+12", "a3")):
        if stage:  # both keys read back from state, then written again
            changelog.commit(
                ("events", "UPDATE", {"event_id": "1"}, {"note": stage}),
                ("events", "UPDATE", {"event_id": "2"}, {"note": stage}),
            )
            changelog.land()
        pipeline.env["TZ"] = zone
        ran = pipeline.start("--trigger", "available-now")
        assert ran.wait(timeout=600) == 0, pipeline.log.read_text()[-3000:]
    rows = {
        r["event_id"]: (r["at"], r["note"])
        for r in scan(DeltaTable(mirror_uri(str(tmp_path / "mirrors"), "events"))).to_pylist()
    }
    utc = datetime.UTC
    assert rows == {
        1: (datetime.datetime(1, 1, 1, tzinfo=utc), "a3"),
        2: (datetime.datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=utc), "a3"),
    }
