"""``python -m ingest audit`` (issue 25): a past window read again against the change log.

The comparison itself without I/O, then the command against a change log landed by the real
service on the emulator: it agrees, and it names a transaction deleted from a copy of the log
and a row doubled in it, by commit timestamp and transaction id, with exit 3.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable, write_deltalake

from ingest.contract.changelog import PARTITION_COLUMNS
from ingest.model.timestamps import to_rfc3339
from ingest.service.audit import Difference, Digests, compare
from tests.builders import ChangeLog
from tests.checks import start_after_setup
from tests.processes import background_workload, service_in, wait_until_landed


def test_missing_extra_and_altered_rows_are_named_and_equal_windows_agree(tmp_path: Path) -> None:
    changelog = ChangeLog(str(tmp_path / "changelog"))
    for n in range(3):
        changelog.commit(("accounts", "INSERT", {"account_id": str(n)}, {"owner": "a"}))
    changelog.land()
    rows = DeltaTable(changelog.uri).to_pyarrow_table()
    rows = rows.filter(pc.invert(pc.equal(rows.column("mod_type"), "SCHEMA")))
    landed, read = Digests(), Digests()
    landed.add_rows(rows)
    read.add_rows(rows)
    assert compare(0, 1, read.by_transaction, landed.by_transaction).differences == ()

    ids = rows.column("server_transaction_id").to_pylist()
    without_first = rows.filter(pc.not_equal(rows.column("server_transaction_id"), ids[0]))
    doubled = pa.concat_tables([without_first, without_first.slice(0, 1)])
    altered = Digests()
    altered.add_rows(doubled)
    report = compare(0, 1, read.by_transaction, altered.by_transaction)
    kinds = {d.key[1]: (d.kind, d.stream_rows, d.changelog_rows) for d in report.differences}
    assert kinds == {ids[0]: ("missing", 1, 0), ids[1]: ("differing", 1, 2)}
    assert "3 transactions, change log 2; 1 missing, 0 extra, 1 differing" in report.summary()
    extra = compare(0, 1, altered.by_transaction, read.by_transaction).differences
    assert [d.kind for d in extra] == ["extra", "differing"]
    assert str(Difference(("2026-01-01T00:00:00Z", "tx"), "missing", 2, 0)) == (
        "missing 2026-01-01T00:00:00Z transaction tx: stream 2 rows, change log 0"
    )


@pytest.mark.emulator
def test_audit_agrees_with_the_service_and_names_what_a_damaged_copy_lost(
    new_database, tmp_path: Path
) -> None:
    database = new_database("googlesql")
    table = tmp_path / "changelog"
    service = service_in(tmp_path, database.database_id, start_after_setup())
    process = service.start()
    try:
        thread, _, committed = background_workload(database, seconds=6, rate=10, seed=3)
        thread.join()
        wait_until_landed(table, len(committed), timeout=120, service=service, committed=committed)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    start = to_rfc3339(min(t.commit_timestamp for t in committed))

    def audit(changelog: Path, *extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "ingest",
                "audit",
                "--database",
                database.database_id,
                "--changelog",
                str(changelog),
                "--start-timestamp",
                start,
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=180,
            env=service.env,
        )

    agreed = audit(table)
    assert agreed.returncode == 0, agreed.stdout + agreed.stderr[-3000:]
    [summary] = agreed.stdout.splitlines()
    assert f"stream {len(committed)} transactions, change log {len(committed)}; 0 missing" in (
        summary
    )

    damaged = tmp_path / "damaged"
    shutil.copytree(table, damaged)
    lost, doubled = committed[len(committed) // 2], committed[-1]
    lost_id = _transaction_id(damaged, lost.commit_timestamp)
    doubled_id = _transaction_id(damaged, doubled.commit_timestamp)
    copy = DeltaTable(str(damaged))
    copy.alter.set_table_properties({"delta.appendOnly": "false"})  # the change log is append-only
    copy.delete(f"server_transaction_id = '{lost_id}'")
    rows = DeltaTable(str(damaged)).to_pyarrow_table()
    again = rows.filter(pc.equal(rows.column("server_transaction_id"), doubled_id)).slice(0, 1)
    write_deltalake(str(damaged), again, mode="append", partition_by=PARTITION_COLUMNS)
    found = audit(damaged)
    assert found.returncode == 3, found.stdout + found.stderr[-3000:]
    lines = found.stdout.splitlines()
    assert "1 missing, 0 extra, 1 differing" in lines[0], lines
    assert sorted(lines[1:]) == sorted(
        [
            f"missing {to_rfc3339(lost.commit_timestamp)} transaction {lost_id}: stream "
            f"{_rows(table, lost_id)} rows, change log 0",
            f"differing {to_rfc3339(doubled.commit_timestamp)} transaction {doubled_id}: stream "
            f"{_rows(table, doubled_id)} rows, change log {_rows(table, doubled_id) + 1}",
        ]
    )

    beyond = audit(table, "--end-timestamp", "now")
    assert beyond.returncode == 2, beyond.stdout + beyond.stderr[-3000:]
    assert beyond.stderr.startswith("error: the window ends at"), beyond.stderr


def _transaction_id(changelog: Path, commit_timestamp: int) -> str:
    rows = DeltaTable(str(changelog)).to_pyarrow_table(
        columns=["commit_timestamp_text", "server_transaction_id"]
    )
    text = to_rfc3339(commit_timestamp)
    ids = {
        i
        for t, i in zip(rows.column(0).to_pylist(), rows.column(1).to_pylist(), strict=True)
        if t == text
    }
    [transaction_id] = ids
    return transaction_id


def _rows(changelog: Path, transaction_id: str) -> int:
    rows = DeltaTable(str(changelog)).to_pyarrow_table(columns=["server_transaction_id"])
    return int(pc.sum(pc.equal(rows.column(0), transaction_id)).as_py())
