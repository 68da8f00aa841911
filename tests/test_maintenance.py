"""Users' maintenance of the mirrors and a history while the pipeline runs, on the real emulator.

From delta-rs and from another Spark session, as a data platform's jobs do: OPTIMIZE (with and
without Z-order), VACUUM with no retention (Spark's LITE), SET TBLPROPERTIES (the change data
feed, deletion vectors) on a mirror and a history, between and during the job's batches. The
job goes on (its conflicts retried) and the mirrors equal Spanner at W. Then a RESTORE of a
mirror to an old version: the next start refuses with one line naming it; a RESTORE to the job's
newest commit, as that line says, lets the job go on, and the mirrors equal Spanner again.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from pipeline.columns import mirror_uri
from pipeline.foreign_commits import TABLE_CHANGED_BEHIND_JOB
from tests.checks import (
    SEED_TRANSACTIONS,
    accounts_written_after_start,
    assert_mirrors_equal,
    compare_at_watermark,
)
from tests.pipeline_runs import build_test_session
from tests.processes import (
    BANKING,
    Pipeline,
    background_workload,
    service_in,
    wait_until,
    wait_until_landed,
)

SEED = 41


@pytest.mark.emulator
def test_maintenance_from_spark_and_delta_rs_while_the_job_runs_and_a_restore_refused(
    new_database, tmp_path: Path
) -> None:
    database, start = accounts_written_after_start(new_database)
    changelog = tmp_path / "changelog"
    mirrors = str(tmp_path / "mirrors")
    accounts, transfers = mirror_uri(mirrors, "accounts"), mirror_uri(mirrors, "transfers")
    history = str(tmp_path / "history" / "accounts")
    service = service_in(tmp_path, database.database_id, start)
    pipeline = Pipeline(
        changelog,
        tmp_path,
        tmp_path / "pipeline.log",
        PIPELINE_HISTORY_TABLES="accounts",
        PIPELINE_HISTORY_ROOT=str(tmp_path / "history"),
    )
    ingest, job = service.start(), pipeline.start()
    spark, stop = None, None
    try:
        pipeline.wait_for("pipeline_batch", 1, timeout=300, process=job)
        workload, stop, committed = background_workload(database, 900, 5, SEED, weights=BANKING)
        spark = build_test_session("maintenance", shuffle_partitions=2)
        spark.conf.set("spark.databricks.delta.retentionDurationCheck.enabled", "false")
        # A platform's maintenance job sized for small tables on two cores: VACUUM lists files
        # in 10,000 tasks by default, which took a minute of CPU here.
        spark.conf.set("spark.sql.sources.parallelPartitionDiscovery.parallelism", "2")

        def next_batch_with_rows() -> None:
            batches = _batches_with_rows(pipeline)
            wait_until(lambda: _batches_with_rows(pipeline) > batches, 300, "a batch", job)

        for operation in _maintenance(spark, accounts, transfers, history):
            operation()
            next_batch_with_rows()
        stop.set()
        workload.join()
        # the seed's transactions too: a drain before the workload's last had landed left it out
        # of the mirrors, which the comparison at the change log's later W then missed
        seeded = SEED_TRANSACTIONS + len(committed)
        wait_until_landed(changelog, seeded, timeout=120, service=service)
        job.send_signal(signal.SIGUSR1)  # drain: what the change log holds, then exit
        assert job.wait(timeout=300) == 0, pipeline.log.read_text()[-3000:]
        _, comparisons = compare_at_watermark(database, str(changelog), mirrors)
        assert_mirrors_equal(comparisons, "after maintenance")
        job_version = DeltaTable(accounts).version()
        older = job_version - 3  # after the VACUUM: its files are all there
        spark.sql(f"RESTORE TABLE delta.`{accounts}` TO VERSION AS OF {older}")
        _transfer(database)
        wait_until_landed(changelog, seeded + 1, timeout=120, service=service)
        refused = pipeline.start("--trigger", "available-now")
        assert refused.wait(timeout=300) != 0
        line = _error_line(pipeline)
        assert f"{TABLE_CHANGED_BEHIND_JOB}: mirror accounts: RESTORE to version {older}" in line
        assert f"RESTORE the table to version {job_version}" in line, line
        spark.sql(f"RESTORE TABLE delta.`{accounts}` TO VERSION AS OF {job_version}")
        _catch_up(pipeline)
    finally:
        if stop is not None:
            stop.set()
        for process in (ingest, job):
            process.kill()
        if spark is not None:
            spark.stop()
    _, comparisons = compare_at_watermark(database, str(changelog), mirrors)
    assert_mirrors_equal(comparisons, "after the restore")
    operations = [c["operation"] for c in DeltaTable(accounts).history()]
    assert {"OPTIMIZE", "VACUUM END", "SET TBLPROPERTIES", "RESTORE"} <= set(operations)


def _maintenance(spark: Any, accounts: str, transfers: str, history: str) -> list[Any]:
    """Each operation, as a call; the job must land a batch with rows after each."""
    vacuumed = "spark.databricks.delta.vacuum.logging.enabled"
    spark.conf.set(vacuumed, "true")
    return [
        lambda: DeltaTable(accounts).optimize.compact(),
        lambda: DeltaTable(accounts).optimize.z_order(["account_id"]),
        lambda: DeltaTable(accounts).vacuum(0, dry_run=False, enforce_retention_duration=False),
        lambda: DeltaTable(accounts).alter.set_table_properties(
            {"delta.enableChangeDataFeed": "true"}
        ),
        lambda: spark.sql(f"OPTIMIZE delta.`{transfers}` ZORDER BY (transfer_id)"),
        lambda: spark.sql(
            f"ALTER TABLE delta.`{accounts}` SET TBLPROPERTIES ('delta.enableDeletionVectors' = "
            "'true')"
        ),
        lambda: spark.sql(f"OPTIMIZE delta.`{history}`"),
        # LITE: a FULL VACUUM of retention 0 can delete a file the job just committed
        # (docs/operations.md, pipeline/NOTES.md)
        lambda: spark.sql(f"VACUUM delta.`{transfers}` RETAIN 0 HOURS LITE"),
        lambda: DeltaTable(history).alter.set_table_properties(
            {"delta.logRetentionDuration": "interval 7 days"}
        ),
    ]


def _batches_with_rows(pipeline: Pipeline) -> int:
    return sum(e["event"] == "pipeline_batch" and bool(e["rows"]) for e in pipeline.events())


def _catch_up(pipeline: Pipeline) -> None:
    """A run to the change log's end (``available-now``): it must end with exit 0."""
    run = pipeline.start("--trigger", "available-now")
    assert run.wait(timeout=300) == 0, pipeline.log.read_text()[-3000:]


def _transfer(database: Any) -> None:
    """One more change to accounts, so the next run has a batch for the restored mirror."""
    with database.batch() as batch:
        batch.update("accounts", ["account_id", "balance"], [(0, 123_456)])


def _error_line(pipeline: Pipeline) -> str:
    """The run's one ``error:`` line (the log holds every run's lines)."""
    lines = [line for line in pipeline.log.read_text().splitlines() if line.startswith("error:")]
    assert len(lines) == 1, lines
    return lines[0]
