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

from deltalake import DeltaTable
from google.cloud.spanner_v1.database import Database

from ingest.changestream.config import ReaderConfig
from ingest.changestream.query import ChangeStreamQuery, Dialect, detect_dialect
from ingest.contract.changelog import newest_checkpoint
from ingest.model.timestamps import Nanos, parse_rfc3339, to_rfc3339
from ingest.service.audit import changelog_digests, compare, stream_digests
from runtime.logs import make_logger

PRODUCT_DROPPED = "product dropped it"
EMULATOR_OMITTED = "live query never sent it, re-read has it"
UNEXPLAINED = "never sent, not even on re-read"
NO_RECORD_LOG = "not known: the reader logged no record_received (not at debug)"
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


@dataclass(frozen=True, slots=True)
class ChangeLogAudit:
    """A change log read against a fresh bounded read of its job's window, from the job's start
    to the change log's W: everything in it must have landed exactly once."""

    window: str
    omissions: tuple[Omission, ...]
    """Transactions the change log lacks, each classified."""
    other_differences: tuple[str, ...]
    """Transactions landed twice, in part or altered: always the product's."""

    @property
    def only_emulator_omissions(self) -> bool:
        """Whether the change log lost something and the emulator's live query explains all of
        it: the one case in which an emulator test may run again."""
        return (
            bool(self.omissions)
            and not self.other_differences
            and all(o.emulator_omitted for o in self.omissions)
        )

    @property
    def whole(self) -> bool:
        return not self.omissions and not self.other_differences

    def __str__(self) -> str:
        said = [str(o) for o in self.omissions] + list(self.other_differences)
        return f"{self.window}: " + ("; ".join(said) if said else "the change log is whole")


def only_the_emulator_lost(audits: Sequence[ChangeLogAudit | str]) -> bool:
    """Whether a failed test may run again: every change log of it was audited (a string says
    why one was not), none shows a loss of the product's, and one lacks what the emulator's live
    query omitted."""
    taken = [audit for audit in audits if isinstance(audit, ChangeLogAudit)]
    return (
        len(taken) == len(audits)
        and all(audit.whole or audit.only_emulator_omissions for audit in taken)
        and any(audit.only_emulator_omissions for audit in taken)
    )


def audit_changelog(
    database: Database,
    stream: str,
    changelog_uri: str,
    events: Iterable[Mapping[str, Any]],
    stop: threading.Event | None = None,
) -> ChangeLogAudit | None:
    """The change log against a re-read of its window, with what the reader logged at debug
    (``events``) telling an emulator omission from the product's loss; None when the change log
    holds no checkpoint with a job start, or its W has not reached the start yet. ``stop`` set
    ends the re-read early: the audit then raises rather than report what it did not read."""
    newest = newest_checkpoint(DeltaTable(changelog_uri))
    if newest is None or newest[1].job_start is None:
        return None
    start, end = newest[1].job_start, newest[1].resume_point.low_watermark
    if end < start:
        return None
    config = ReaderConfig(start_timestamp=start, end_timestamp=end, heartbeat_ms=1000)
    source = ChangeStreamQuery(database, stream, detect_dialect(database), 1000)
    stop = stop or threading.Event()
    read = stream_digests(source, config, make_logger(io.StringIO()), stop)
    if stop.is_set():
        raise TimeoutError("the re-read was stopped before the window's end")
    report = compare(
        start, end, read.by_transaction, changelog_digests(changelog_uri, start, end).by_transaction
    )
    missing = [parse_rfc3339(d.key[0]) for d in report.differences if d.kind == "missing"]
    reread = {timestamp for timestamp, _ in read.by_transaction}
    events = list(events)
    if any(event.get("event") == "record_received" for event in events):
        omissions = classify(missing, events, reread)
    else:
        omissions = [Omission(to_rfc3339(t), NO_RECORD_LOG) for t in sorted(missing)]
    return ChangeLogAudit(
        report.summary(),
        tuple(omissions),
        tuple(str(d) for d in report.differences if d.kind != "missing"),
    )
