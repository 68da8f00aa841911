"""The classification a missing transaction gets before an emulator test may rerun."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from deltalake import DeltaTable

from emulator.omissions import (
    EMULATOR_OMITTED,
    NO_RECORD_LOG,
    PRODUCT_DROPPED,
    UNEXPLAINED,
    ChangeLogAudit,
    Omission,
    audit_changelog,
    classify,
    only_the_emulator_lost,
)
from emulator.verify import landed_transactions
from ingest.delta.sink import DeltaChangeLogSink
from ingest.model.records import Transaction
from ingest.model.resume import ResumablePartitions, ResumePoint
from ingest.model.timestamps import from_datetime, to_rfc3339
from tests.builders import record
from tests.delta_checks import late_landings
from tests.processes import service_in, wait_until

T = 1_764_000_000_000_000_000


def test_each_missing_transaction_is_classified_from_what_the_client_received() -> None:
    received, omitted, proven_past, lost = T, T + 1_000, T + 2_000, T + 3_000
    events = [
        {"event": "record_received", "commit_timestamp": to_rfc3339(received)},
        {"event": "record_received", "commit_timestamp": to_rfc3339(T + 5_000)},
        {
            "event": "query_end_proven",
            "query_start_timestamp": to_rfc3339(T + 1_500),
            "end_timestamp": to_rfc3339(T + 2_500),
        },
    ]
    reread = {to_rfc3339(t) for t in (received, omitted, proven_past, T + 5_000)}
    omissions = classify([lost, omitted, received, proven_past], events, reread)
    assert [(o.commit_timestamp, o.verdict, o.passed_by) for o in omissions] == [
        (to_rfc3339(received), PRODUCT_DROPPED, ""),
        (to_rfc3339(omitted), EMULATOR_OMITTED, "a record or heartbeat"),
        (to_rfc3339(proven_past), EMULATOR_OMITTED, "a query's clean close"),
        (to_rfc3339(lost), UNEXPLAINED, ""),
    ]
    assert [o.emulator_omitted for o in omissions] == [False, True, True, False]


def test_a_failed_test_runs_again_only_when_the_emulator_alone_lost_something() -> None:
    omitted = Omission("t1", EMULATOR_OMITTED, "a record or heartbeat")
    whole = ChangeLogAudit("w", (), ())
    lost = ChangeLogAudit("w", (omitted,), ())
    assert only_the_emulator_lost([lost, whole])
    assert not only_the_emulator_lost([whole]), "nothing lost: the failure is the test's own"
    assert not only_the_emulator_lost([])
    for product in (
        ChangeLogAudit("w", (omitted, Omission("t2", PRODUCT_DROPPED)), ()),
        ChangeLogAudit("w", (omitted, Omission("t2", UNEXPLAINED)), ()),
        ChangeLogAudit("w", (omitted, Omission("t2", NO_RECORD_LOG)), ()),
        ChangeLogAudit("w", (omitted,), ("differing t3 transaction x",)),
    ):
        assert not only_the_emulator_lost([product]), str(product)
    other = ChangeLogAudit("w", (), ("extra t4 transaction y",))
    assert not only_the_emulator_lost([lost, other]), "another change log shows the product's"
    assert not only_the_emulator_lost([lost, "not audited: the re-read took over 300 s"])


@pytest.mark.emulator
def test_a_failed_test_s_audit_names_a_lost_transaction_and_who_lost_it(
    new_database, tmp_path: Path
) -> None:
    """What a failed emulator test's audit finds (tests/conftest.py): a transaction taken out of
    a landed change log is missing; the reader having logged it makes it the product's loss,
    its line removed makes it the emulator's omission (the one case that runs a test again),
    and a log without the record lines tells neither."""
    database = new_database("googlesql", accounts=0)
    changelog = tmp_path / "changelog"
    service = service_in(tmp_path, database.database_id, None)
    process = service.start()
    try:
        service.wait_for("ingest_started", 1, timeout=120, process=process)
        committed = []
        for number in range(4):
            with database.batch() as batch:
                batch.insert(
                    "accounts", ["account_id", "owner", "balance"], [(number, "o", number)]
                )
            committed.append(to_rfc3339(from_datetime(batch.committed)))
        wait_until(lambda: landed_transactions(str(changelog)) == 4, 120, "not landed", process)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    assert late_landings(changelog) == [], "a service's own landings are never behind a cut"
    lost = committed[2]
    table = DeltaTable(str(changelog))
    table.alter.set_table_properties({"delta.appendOnly": "false"})
    DeltaTable(str(changelog)).delete(f"commit_timestamp_text = '{lost}'")
    events = service.events()
    assert any(e["event"] == "record_received" for e in events), "the service logs at debug"
    received = audit_changelog(database, "all_changes", str(changelog), events)
    assert received is not None
    assert [(o.commit_timestamp, o.verdict) for o in received.omissions] == [
        (lost, PRODUCT_DROPPED)
    ], str(received)
    assert not received.other_differences and not received.only_emulator_omissions
    never_sent = [e for e in events if e.get("commit_timestamp") != lost]
    omitted = audit_changelog(database, "all_changes", str(changelog), never_sent)
    assert omitted is not None and omitted.only_emulator_omissions, str(omitted)
    assert [o.commit_timestamp for o in omitted.omissions] == [lost]
    unlogged = [e for e in events if e["event"] != "record_received"]
    unknown = audit_changelog(database, "all_changes", str(changelog), unlogged)
    assert unknown is not None and [o.verdict for o in unknown.omissions] == [NO_RECORD_LOG]
    assert not unknown.only_emulator_omissions


def test_a_transaction_landed_behind_an_earlier_cut_is_named_late(tmp_path: Path) -> None:
    """What a comparison made after the fact cannot show: a version whose W passed a
    transaction that only a later version landed (a job that read up to it missed it)."""
    sink = DeltaChangeLogSink(str(tmp_path / "changelog"), "job", "owner")
    sink.continue_after(None)
    early, late = T + 1_000, T + 2_000

    def land(stamp: int, txid: str, watermark: int) -> None:
        transaction = Transaction(stamp, txid, (record(stamp, txid, 1, 1),))
        sink.commit([transaction], ResumePoint(watermark, ResumablePartitions((), ())))

    land(early, "first", late + 1_000)
    assert late_landings(tmp_path / "changelog") == []
    land(late, "behind", late + 2_000)
    [said] = late_landings(tmp_path / "changelog")
    assert said.startswith(f"late {to_rfc3339(late)} transaction behind: in version 1"), said
