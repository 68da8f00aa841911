"""The Delta sink without Spanner: exactly once, fencing, checkpoints, maintenance, Spark reads."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from deltalake import DeltaTable

from emulator.verify import LandedTransactions, landed_transactions
from ingest.contract.changelog import (
    CHECKPOINT_KEY,
    checkpoints_newest_first,
    from_json,
    newest_checkpoint,
)
from ingest.delta.sink import DeltaChangeLogSink, Maintenance, WriterFenced
from ingest.delta.snapshot_files import SnapshotFileWriter, read_keys
from ingest.model.records import ColumnType, Mod, Transaction
from ingest.model.resume import ResumablePartition, ResumablePartitions, ResumePoint
from ingest.model.snapshot import PartProgress, SnapshotChunk, SnapshotProgress
from ingest.model.timestamps import parse_rfc3339, to_rfc3339
from tests.builders import record
from tests.delta_checks import read_versions
from tests.simulation import build_topology

COMMIT = parse_rfc3339("2026-11-22T10:00:00.123456789Z")


def transactions(count: int, base: int = COMMIT) -> list[Transaction]:
    result = []
    for n in range(count):
        records = tuple(
            record(
                base + n * 1000, f"tx{base}-{n}", seq, 2, mods=(Mod({"k": str(n)}, {"v": seq}, {}),)
            )
            for seq in range(2)
        )
        result.append(Transaction(base + n * 1000, f"tx{base}-{n}", records))
    return result


def point(watermark: int) -> ResumePoint:
    return ResumePoint(
        watermark,
        ResumablePartitions((ResumablePartition("p1", COMMIT - 10, ("p0",)),), ("p0",)),
    )


def test_checkpoint_round_trips_and_replays_are_skipped(tmp_path: Path) -> None:
    uri = str(tmp_path / "t")
    sink = DeltaChangeLogSink(uri, "job", "owner-a")
    sink.continue_after(sink.latest_checkpoint())
    batch = transactions(3)
    first = sink.commit(batch, point(COMMIT + 5000))
    assert (first.version, first.rows, first.replayed) == (1, 6, False)
    latest = sink.latest_checkpoint()
    assert latest is not None and latest.resume_point == point(COMMIT + 5000)

    again = DeltaChangeLogSink(uri, "job", "owner-a")
    again.continue_after(None)  # as if the process had not seen its own commit land
    assert again.commit(batch, point(COMMIT + 5000)).replayed
    assert DeltaTable(uri).to_pyarrow_table().num_rows == 6


def test_a_second_writer_is_fenced(tmp_path: Path) -> None:
    uri = str(tmp_path / "t")
    first = DeltaChangeLogSink(uri, "job", "owner-a")
    second = DeltaChangeLogSink(uri, "job", "owner-b")
    first.continue_after(None)
    second.continue_after(None)
    first.commit(transactions(1), point(COMMIT + 1))
    with pytest.raises(WriterFenced, match="committed by another process"):
        second.commit(transactions(1, COMMIT + 10**6), point(COMMIT + 10**6 + 1))
    first.commit(transactions(1, COMMIT + 2 * 10**6), point(COMMIT + 2 * 10**6 + 1))
    assert DeltaTable(uri).transaction_version("job") == 2


def test_a_writer_that_looked_before_the_table_was_created_is_fenced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two writers of one job race to create the change log: the second looks, finds no table,
    and the first creates it before the second writes. The second's creating write must fail
    and look again, not append the job's version 1 a second time (seen in the racing test of
    tests/test_object_store.py about once in seven runs on a local path)."""
    uri = str(tmp_path / "t")
    first = DeltaChangeLogSink(uri, "job", "owner-a")
    second = DeltaChangeLogSink(uri, "job", "owner-b")
    first.continue_after(None)
    second.continue_after(None)
    look = second.table

    def first_creates_it_after_the_look() -> DeltaTable | None:
        found = look()
        if found is None:
            first.commit(transactions(1), point(COMMIT + 1))
        return found

    monkeypatch.setattr(second, "table", first_creates_it_after_the_look)
    with pytest.raises(WriterFenced, match="committed by another process"):
        second.commit(transactions(1, COMMIT + 10**6), point(COMMIT + 10**6 + 1))
    versions = read_versions(tmp_path / "t")
    assert len(versions) == 1, [(v.operation, v.rows) for v in versions]
    assert DeltaTable(uri).transaction_version("job") == 1


def land_commits(uri: str, maintenance: Maintenance, commits: int) -> DeltaChangeLogSink:
    """A sink that landed ``commits`` commits of two transactions each, maintaining as told."""
    sink = DeltaChangeLogSink(uri, "job", "owner", maintenance=maintenance)
    sink.continue_after(None)
    for n in range(commits):
        base = COMMIT + n * 10**6
        sink.commit(transactions(2, base), point(base + 5000))
    return sink


def test_maintenance_never_changes_what_was_landed(tmp_path: Path) -> None:
    uri = str(tmp_path / "t")
    sink = land_commits(uri, Maintenance(3, 5), 12)
    table = DeltaTable(uri)
    assert table.transaction_version("job") == 12
    assert table.to_pyarrow_table().num_rows == 12 * 2 * 2
    operations = [v.operation for v in read_versions(tmp_path / "t")]
    assert "OPTIMIZE" in operations
    assert list((tmp_path / "t" / "_delta_log").glob("*.checkpoint.parquet"))
    latest = sink.latest_checkpoint()
    assert latest is not None and latest.version == 12


def test_checkpoints_read_newest_first_in_pages_are_the_whole_history_s(tmp_path: Path) -> None:
    """The sink's replay check and ``newest_checkpoint`` read the history in growing pages; over
    commits with and without checkpoints (the maintenance's), every page size yields each
    checkpoint once, newest first, as one read of the whole history does."""
    uri = str(tmp_path / "t")
    land_commits(uri, Maintenance(3, 5), 12)
    table = DeltaTable(uri)
    whole = [
        (int(c["version"]), from_json(c[CHECKPOINT_KEY]))
        for c in table.history()
        if CHECKPOINT_KEY in c
    ]
    assert [checkpoint.version for _, checkpoint in whole] == list(range(12, 0, -1))
    assert len(whole) < len(table.history())  # the maintenance's commits carry none
    for pages in ((1, 2, 5, None), (1, 50, None), (8, None), (None,)):
        assert list(checkpoints_newest_first(table, pages)) == whole, pages
    newest_four = list(checkpoints_newest_first(table, (3, 4)))  # no page of the whole history
    assert newest_four and newest_four == whole[: len(newest_four)]
    assert all(version >= table.version() - 3 for version, _ in newest_four)
    assert newest_checkpoint(table) == whole[0]


def test_the_tests_count_of_landed_transactions_read_by_new_files_follows_compactions(
    tmp_path: Path,
) -> None:
    """The tests' waits count landed transactions from each poll's new files only
    (``emulator.verify.LandedTransactions``); through the sink's compactions the count is a
    whole read's."""
    uri = str(tmp_path / "t")
    count = LandedTransactions(uri)
    assert count() == 0
    sink = DeltaChangeLogSink(uri, "job", "owner", maintenance=Maintenance(3, 5))
    sink.continue_after(None)
    for n in range(12):
        base = COMMIT + n * 10**6
        sink.commit(transactions(2, base), point(base + 5000))
        assert count() == landed_transactions(uri) == 2 * (n + 1)
    assert "OPTIMIZE" in [v.operation for v in read_versions(tmp_path / "t")]


@pytest.fixture(scope="module")
def spark():
    from tests.pipeline_runs import build_test_session

    session = build_test_session("sink-test", shuffle_partitions=2)
    yield session
    session.stop()


def test_spark_reads_the_change_log_table(tmp_path: Path, spark) -> None:
    uri = str(tmp_path / "t")
    sink = DeltaChangeLogSink(uri, "job", "owner")
    sink.continue_after(None)
    sink.commit(transactions(3), point(COMMIT + 5000))
    simulated = build_topology(random.Random(1), events=4, transactions=20).expected()
    sink.commit(simulated, point(COMMIT + 10**9))
    frame = spark.read.format("delta").load(uri)
    assert frame.count() == 3 * 2 + sum(t.mod_count for t in simulated)
    types = dict(frame.dtypes)
    assert types["commit_timestamp"] == "timestamp" and types["commit_date"] == "date"
    texts = {r[0] for r in frame.select("commit_timestamp_text").collect()}
    assert "2026-11-22T10:00:00.123456789Z" in texts
    first_cut = spark.read.format("delta").option("versionAsOf", 0).load(uri)
    assert first_cut.count() == 6


def test_spark_takes_each_version_s_protocol_and_metadata_from_a_checksum_that_validates(
    tmp_path: Path, spark
) -> None:
    """Every version the sink makes, compactions among them, has a checksum; delta-spark loads
    it instead of running a job for the protocol and metadata, and its own state reconstruction
    of each version agrees with it field by field (it stops a Spark writer on a mismatch)."""
    uri = str(tmp_path / "t")
    land_commits(uri, Maintenance(3, 4), 9)
    latest = DeltaTable(uri).version()
    checksums = sorted(p.name for p in (tmp_path / "t" / "_delta_log").glob("*.crc"))
    assert checksums == [f"{v:020d}.crc" for v in range(latest + 1)]
    assert "OPTIMIZE" in [v.operation for v in read_versions(tmp_path / "t")]
    delta_log = spark._jvm.org.apache.spark.sql.delta.DeltaLog.forTable(spark._jsparkSession, uri)
    defaults = [getattr(delta_log, f"getSnapshotAt$default${n}")() for n in (2, 3, 4)]
    for version in range(latest + 1):
        snapshot = delta_log.getSnapshotAt(version, *defaults)
        assert snapshot.checksumOpt().isDefined(), version
        assert snapshot.validateChecksum(getattr(snapshot, "validateChecksum$default$1")()), version
    assert spark.read.format("delta").load(uri).count() == 9 * 2 * 2


def test_a_new_job_records_its_start_before_reading_and_every_commit_carries_it(
    tmp_path: Path,
) -> None:
    uri = str(tmp_path / "t")
    sink = DeltaChangeLogSink(uri, "job", "owner-a")
    sink.continue_after(sink.latest_checkpoint())
    started = sink.start_job(COMMIT)
    assert (started.version, started.rows, started.delta_version) == (1, 0, 0)
    first = sink.latest_checkpoint()
    assert first is not None and first.job_start == COMMIT
    assert first.resume_point == ResumePoint(COMMIT - 1, ResumablePartitions((), ()))

    restarted = DeltaChangeLogSink(uri, "job", "owner-b")
    restarted.continue_after(restarted.latest_checkpoint())
    restarted.commit(transactions(2), point(COMMIT + 5000))
    latest = restarted.latest_checkpoint()
    assert latest is not None and (latest.version, latest.job_start) == (2, COMMIT)
    assert DeltaTable(uri).to_pyarrow_table().num_rows == 4


def test_a_configured_start_that_disagrees_with_the_recorded_one_is_detected(
    tmp_path: Path,
) -> None:
    from ingest.delta.lease import start_moved

    sink = DeltaChangeLogSink(str(tmp_path / "t"), "job", "owner")
    sink.continue_after(None)
    sink.start_job(COMMIT)
    recorded = sink.latest_checkpoint()
    assert recorded is not None
    assert not start_moved(None, recorded)
    assert not start_moved(COMMIT, recorded)
    assert start_moved(COMMIT + 1, recorded)


def test_snapshot_files_written_by_tasks_land_only_with_their_commit(tmp_path: Path) -> None:
    """Tasks write Parquet into the table's folder; the driver's commit adds them with the
    progress they reach, fenced like any commit; a file no commit adds is no part of the
    table."""
    uri = str(tmp_path / "t")
    t0 = COMMIT - 1
    sink = DeltaChangeLogSink(uri, "job", "owner-a")
    sink.continue_after(None)
    progress = SnapshotProgress.begin(t0, ["a"]).split("a", (PartProgress(None, None),))
    sink.start_job(COMMIT, progress)
    columns = (ColumnType("k", {"code": "INT64"}, True, 1),)
    rows = [(f'{{"k":"{n}"}}', f'{{"v":{n}}}') for n in range(25)]
    writer = SnapshotFileWriter(uri, t0, target_bytes=1)
    for start in range(0, 25, 10):
        writer.write([SnapshotChunk("a", columns, rows[start : start + 10], None, False)])
    files = writer.close()
    assert [f.rows for f in files] == [10, 10, 5]
    orphan = SnapshotFileWriter(uri, t0, target_bytes=1 << 20)
    orphan.write([SnapshotChunk("a", columns, rows[:3], None, False)])
    orphan.close()

    done = progress.part_advanced("a", 0, 25, ("24",), True)
    landed = sink.commit_snapshot_files([f.add_action() for f in files], 25, done)
    assert (landed.version, landed.rows) == (2, 25)
    table = DeltaTable(uri).to_pyarrow_table()
    assert sorted(table["keys"].to_pylist()) == sorted(k for k, _ in rows)
    assert set(table["mod_type"].to_pylist()) == {"SNAPSHOT"}
    assert set(table["commit_timestamp_text"].to_pylist()) == {to_rfc3339(t0)}
    assert read_keys(uri, files) == [k for k, _ in rows]
    checkpoint = sink.latest_checkpoint()
    assert checkpoint is not None and checkpoint.snapshot == done and checkpoint.consistent

    other = DeltaChangeLogSink(uri, "job", "owner-b")
    other.continue_after(None)
    with pytest.raises(WriterFenced):
        other.commit_snapshot_files([files[0].add_action()], 10, done)
    assert DeltaTable(uri).to_pyarrow_table().num_rows == 25
