"""Where a fresh query starts reading the change log (``pipeline.stream_start``), on change logs
the real sink landed and then changed the ways users and the sink's maintenance change them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from pipeline.stream_start import ChangeLogCommits, fresh_start, read_log, start_of
from tests.builders import ChangeLog


def landed(uri: str, versions: int) -> ChangeLog:
    changelog = ChangeLog(uri)
    for key in range(versions):
        changelog.commit(("accounts", "INSERT", {"account_id": str(key)}, {"owner": "x"}))
        changelog.land()
    return changelog


def test_a_change_log_of_appends_only_is_read_from_version_0(tmp_path: Path) -> None:
    uri = str(tmp_path / "changelog")
    landed(uri, 3)
    start = fresh_start(uri, str(tmp_path / "checkpoint"))
    assert start.version == 0, start.reason
    assert read_log(uri).operations[-1][1:] in {("WRITE", "ErrorIfExists"), ("CREATE TABLE", None)}


def _compacted(uri: str) -> None:
    DeltaTable(uri).optimize.compact()


def _vacuumed(uri: str) -> None:
    DeltaTable(uri).optimize.compact()
    DeltaTable(uri).vacuum(0, dry_run=False, enforce_retention_duration=False)


def _properties_set(uri: str) -> None:
    """The change log is append-only (no delete, no overwrite); its properties may change."""
    DeltaTable(uri).alter.set_table_properties({"delta.logRetentionDuration": "interval 60 days"})


def _log_checkpointed(uri: str) -> None:
    DeltaTable(uri).create_checkpoint()


def _schema_grown(uri: str) -> None:
    rows = DeltaTable(uri).to_pyarrow_table().slice(0, 1)
    grown = rows.append_column("extra", pa.array(["x"]))
    write_deltalake(uri, grown, mode="append", schema_mode="merge")


def _first_commit_gone(uri: str) -> None:
    (Path(uri) / "_delta_log" / f"{0:020}.json").unlink()


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (_compacted, "other commits than appends: ('OPTIMIZE'"),
        (_vacuumed, "other commits than appends"),
        (_properties_set, "other commits than appends: ('SET TBLPROPERTIES'"),
        (_log_checkpointed, "has a log checkpoint"),
        (_schema_grown, "schema changed since version 0"),
        (_first_commit_gone, "first commits are gone"),
    ],
)
def test_any_other_history_reads_the_initial_snapshot(
    tmp_path: Path, change: Callable[[str], None], reason: str
) -> None:
    uri = str(tmp_path / "changelog")
    landed(uri, 3)
    change(uri)
    start = fresh_start(uri, str(tmp_path / "checkpoint"))
    assert start.version is None and reason in start.reason, start


def test_a_query_with_offsets_is_left_to_spark_s_checkpoint(tmp_path: Path) -> None:
    uri, checkpoint = str(tmp_path / "changelog"), tmp_path / "checkpoint"
    landed(uri, 2)
    (checkpoint / "offsets").mkdir(parents=True)
    (checkpoint / "offsets" / "0").write_text("v1\n")
    start = fresh_start(uri, str(checkpoint))
    assert start.version is None and "offsets" in start.reason


def test_the_rule_needs_every_version_from_0_in_the_files_and_the_history() -> None:
    appends = tuple((v, "WRITE", "Append") for v in range(3))
    every = frozenset({0, 1, 2})
    assert start_of(ChangeLogCommits(2, every, False, appends, False)).version == 0
    assert start_of(ChangeLogCommits(2, every - {0}, False, appends, False)).version is None
    assert start_of(ChangeLogCommits(2, every, False, appends[1:], False)).version is None
