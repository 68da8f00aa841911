"""Committed transactions missing from a live read, classified by what the client received.

The reader logs every data change record the client handed it (``record_received``, debug) and
every end a query's clean close proved (``query_end_proven``). A missing transaction is then:

- dropped by the product: the client handed the reader one of its records;
- omitted by the emulator: no record of it reached the client, and the window read again with
  bounded catch-up queries (the path that agreed exactly with an independent reader) returns it;
- unexplained: neither the live read nor the re-read has it.

Only an emulator omission excuses a test's rerun (``tests/test_emulator_reader.py``);
``bench/live_audit.py`` counts all three.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from google.cloud.spanner_v1.database import Database

from ingest.changestream.config import ReaderConfig
from ingest.changestream.query import ChangeStreamQuery, Dialect
from ingest.model.timestamps import Nanos, parse_rfc3339, to_rfc3339
from ingest.service.audit import stream_digests
from runtime.logs import make_logger

PRODUCT_DROPPED = "product dropped it"
EMULATOR_OMITTED = "live query never sent it, re-read has it"
UNEXPLAINED = "never sent, not even on re-read"
REPORT_PROPERTY = "emulator_omission"
"""A test's report property naming one classified missing transaction; the suite's summary
counts them (tests/conftest.py)."""


@dataclass(frozen=True, slots=True)
class Omission:
    commit_timestamp: str
    verdict: str
    passed_by: str = ""
    """For an emulator omission: what moved the partition past it, a query's clean close or a
    record or heartbeat."""

    @property
    def emulator_omitted(self) -> bool:
        return self.verdict == EMULATOR_OMITTED

    def __str__(self) -> str:
        how = f" (passed by {self.passed_by})" if self.passed_by else ""
        return f"{self.commit_timestamp}: {self.verdict}{how}"


def reread_commits(
    database: Database, stream: str, dialect: Dialect, start: Nanos, end: Nanos
) -> set[str]:
    """Commit timestamps (RFC 3339) of the stream's transactions in [start, end], read again."""
    config = ReaderConfig(start_timestamp=start, end_timestamp=end, heartbeat_ms=1000)
    source = ChangeStreamQuery(database, stream, dialect, 1000)
    digests = stream_digests(source, config, make_logger(io.StringIO()), threading.Event())
    return {timestamp for timestamp, _ in digests.by_transaction}


def returned_by_reread(
    database: Database, stream: str, dialect: Dialect, missing: Sequence[str]
) -> list[str]:
    """Which of ``missing`` (commit timestamps as RFC 3339, in order) a fresh bounded read of
    the stream over them returns: one the re-read lacks is not in the emulator's stream."""
    first, last = parse_rfc3339(missing[0]), parse_rfc3339(missing[-1])
    reread = reread_commits(database, stream, dialect, first, last)
    return [text for text in missing if text in reread]


def classify(
    missing: Iterable[Nanos], events: Iterable[Mapping[str, Any]], reread: set[str]
) -> list[Omission]:
    """``events``: the reader's logged events at debug level; ``reread``: what a re-read of the
    window returned (``reread_commits``)."""
    received: set[str] = set()
    proven: list[tuple[Nanos, Nanos]] = []
    for event in events:
        if event.get("event") == "record_received":
            received.add(str(event["commit_timestamp"]))
        elif event.get("event") == "query_end_proven":
            start = parse_rfc3339(event["query_start_timestamp"])
            proven.append((start, parse_rfc3339(event["end_timestamp"])))
    omissions = []
    for timestamp in sorted(missing):
        text = to_rfc3339(timestamp)
        if text in received:
            omissions.append(Omission(text, PRODUCT_DROPPED))
        elif text in reread:
            by_close = any(start <= timestamp <= end for start, end in proven)
            how = "a query's clean close" if by_close else "a record or heartbeat"
            omissions.append(Omission(text, EMULATOR_OMITTED, how))
        else:
            omissions.append(Omission(text, UNEXPLAINED))
    return omissions
