"""The pipeline on real Spark and Delta, over change logs landed by the real ingest sink:
mirrors, replays, source-driven evolution, the open-source evolution bug, the checkpoint lock."""

from __future__ import annotations

import base64
import threading
from pathlib import Path

import pytest
from deltalake import write_deltalake

from ingest import changelog as changelog_rows
from ingest.logs import null_logger
from ingest.records import ColumnType
from pipeline import job
from pipeline.checkpoint import CheckpointInUse, CheckpointLock
from pipeline.config import PipelineConfig
from pipeline.job import PipelineFailed, run_pipeline, spark_settings
from pipeline.mirror import read_mirror
from pipeline.session import build_session
from pipeline.state_schema import SchemaRegistry
from tests.changelog_builder import ACCOUNTS, ChangeLog

EMAIL = ColumnType("email", {"code": "STRING"}, False, 4)


@pytest.fixture(scope="module")
def spark():
    session = build_session(
        "pipeline-tests", extra=spark_settings(PipelineConfig()), shuffle_partitions=2
    )
    yield session
    session.stop()


def configure(tmp_path: Path, **overrides: object) -> PipelineConfig:
    settings = dict(
        changelog_uri=str(tmp_path / "changelog"),
        mirror_root=str(tmp_path / "mirrors"),
        checkpoint_uri=str(tmp_path / "checkpoint"),
        trigger="available-now",
        max_restarts=3,
    )
    settings.update(overrides)
    return PipelineConfig(**settings)  # type: ignore[arg-type]


def run(spark, config: PipelineConfig) -> job.JobStats:
    return run_pipeline(config, null_logger(), threading.Event(), lambda: spark)


def mirror_rows(spark, config: PipelineConfig, table: str = "accounts") -> dict[int, dict]:
    rows = read_mirror(spark, config.mirror_root, table).collect()
    return {row["account_id"]: row.asDict() for row in rows}


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


def test_mirrors_follow_the_change_log_and_replays_change_nothing(spark, tmp_path: Path) -> None:
    config = configure(tmp_path)
    changelog = ChangeLog(config.changelog_uri)
    seed(changelog)
    run(spark, config)
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
    stats = run(spark, config)
    assert stats.batches >= 1
    assert mirror_rows(spark, config) == {
        **expected,
        2: {"account_id": 2, "owner": "bo", "balance": 1},
    }


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
    real = job.write_batch

    def flaky(changes, batch_id, *args, **kwargs):
        if not failures:
            failures.append(batch_id)
            raise RuntimeError("injected failure of the first batch after the evolution")
        return real(changes, batch_id, *args, **kwargs)

    monkeypatch.setattr(job, "write_batch", flaky)
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
    assert "email" in history[1].schemas["row_accounts"].fieldNames()


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
    assert history[-1].schemas["row_accounts"]["owner"].dataType.simpleString() == "binary"
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
