"""The classification a missing transaction gets before an emulator test may rerun."""

from __future__ import annotations

from emulator.omissions import EMULATOR_OMITTED, PRODUCT_DROPPED, UNEXPLAINED, classify
from ingest.model.timestamps import to_rfc3339

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
