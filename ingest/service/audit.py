"""``python -m ingest audit``: a closed past window of the change stream, read again, against
the change log, transaction by transaction.

The stream side is read with bounded catch-up queries (an end timestamp in the past: the path
that agreed exactly with an independent reader) and turned into change-log rows by the sink's own
``to_arrow``, so both sides are compared as the same text. Each transaction is reduced to its row
count and an order-independent digest of its rows (the sum of their SHA-256 values): memory grows
with transactions, not rows, and a missing, duplicated or altered row shows as a difference. The
report names commit timestamps, transaction ids and row counts, never values.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.dataset as ds
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError
from structlog.typing import FilteringBoundLogger as Logger

from ingest.changestream.config import ReaderConfig
from ingest.changestream.query import ChangeStreamQuery
from ingest.changestream.reader import ChangeStreamReader
from ingest.contract.changelog import (
    SCHEMA_ROW,
    SNAPSHOT_DELETE,
    SNAPSHOT_ROW,
    UTC_MICROS,
    newest_checkpoint,
)
from ingest.delta.changelog import to_arrow
from ingest.model.encoding import canonical_json
from ingest.model.resume import Release
from ingest.model.timestamps import Nanos, to_rfc3339
from runtime.errors import BadInput

COMPARED = (
    "commit_timestamp_text",
    "server_transaction_id",
    "record_sequence",
    "mod_index",
    "table_name",
    "mod_type",
    "value_capture_type",
    "keys",
    "new_values",
    "old_values",
    "column_types",
    "number_of_records_in_transaction",
    "number_of_partitions_in_transaction",
    "transaction_tag",
    "is_system_transaction",
)
"""Every change-log column a change record determines (``commit_timestamp`` and
``commit_date`` are derived from ``commit_timestamp_text``)."""
NOT_TRANSACTIONS = (SCHEMA_ROW, SNAPSHOT_ROW, SNAPSHOT_DELETE)
DIGEST_MODULUS = 2**256
DIFFERENCE_KINDS = ("missing", "extra", "differing")
TransactionKey = tuple[str, str]
"""(commit timestamp as RFC 3339 text, server transaction id)"""


class AuditWindowError(BadInput, ValueError):
    """A window the change log cannot be audited on (not landed yet, no change log)."""


@dataclass(slots=True)
class Digest:
    rows: int = 0
    value: int = 0

    def add(self, row: Iterable[object]) -> None:
        text = canonical_json(list(row)).encode()
        self.rows += 1
        self.value = (self.value + int.from_bytes(hashlib.sha256(text).digest())) % DIGEST_MODULUS


@dataclass(slots=True)
class Digests:
    """Per transaction, what its change-log rows add up to."""

    by_transaction: dict[TransactionKey, Digest] = field(default_factory=dict)

    def add_rows(self, table: pa.Table) -> None:
        columns = [table.column(name).to_pylist() for name in COMPARED]
        for row in zip(*columns, strict=True):
            key = (str(row[0]), str(row[1]))
            self.by_transaction.setdefault(key, Digest()).add(row)


@dataclass(frozen=True, slots=True)
class Difference:
    key: TransactionKey
    kind: str
    """One of DIFFERENCE_KINDS: missing (read from the stream, not in the change log), extra
    (in the change log, not in the stream) or differing (rows missing, doubled or altered)."""
    stream_rows: int
    changelog_rows: int

    def __str__(self) -> str:
        timestamp, transaction_id = self.key
        return (
            f"{self.kind} {timestamp} transaction {transaction_id}: stream {self.stream_rows} "
            f"rows, change log {self.changelog_rows}"
        )


@dataclass(frozen=True, slots=True)
class AuditReport:
    start: Nanos
    end: Nanos
    stream_transactions: int
    changelog_transactions: int
    differences: tuple[Difference, ...]

    def summary(self) -> str:
        kinds = {k: sum(d.kind == k for d in self.differences) for k in DIFFERENCE_KINDS}
        return (
            f"audit {to_rfc3339(self.start)} to {to_rfc3339(self.end)}: stream "
            f"{self.stream_transactions} transactions, change log {self.changelog_transactions}; "
            + ", ".join(f"{count} {kind}" for kind, count in kinds.items())
        )


def compare(
    start: Nanos,
    end: Nanos,
    stream: Mapping[TransactionKey, Digest],
    changelog: Mapping[TransactionKey, Digest],
) -> AuditReport:
    differences = []
    for key in sorted(stream.keys() | changelog.keys()):
        read, landed = stream.get(key), changelog.get(key)
        if read == landed:
            continue
        kind = "missing" if landed is None else "extra" if read is None else "differing"
        differences.append(
            Difference(key, kind, read.rows if read else 0, landed.rows if landed else 0)
        )
    return AuditReport(start, end, len(stream), len(changelog), tuple(differences))


def newest_watermark(changelog_uri: str) -> Nanos:
    """The low watermark of the change log's newest checkpoint, whichever job wrote it."""
    try:
        table = DeltaTable(changelog_uri)
    except (TableNotFoundError, OSError) as error:
        raise AuditWindowError(f"no change log at {changelog_uri}: {error}") from None
    newest = newest_checkpoint(table)
    if newest is None:
        raise AuditWindowError(f"the change log at {changelog_uri} holds no checkpoint")
    return newest[1].resume_point.low_watermark


def changelog_digests(changelog_uri: str, start: Nanos, end: Nanos) -> Digests:
    """The change log's transactions committed in [start, end], read batch by batch.

    Only the timestamp bound is pushed into the scan: a string predicate there (``isin`` on
    ``mod_type``) failed on files whose statistics pyarrow reads as ``string_view``; the exact
    window and the row kinds are filtered in memory.
    """
    dataset = DeltaTable(changelog_uri).to_pyarrow_dataset()
    micros = ds.field("commit_timestamp")
    window = (micros >= pa.scalar(start // 1000, UTC_MICROS)) & (
        micros <= pa.scalar(end // 1000, UTC_MICROS)
    )
    first, last = to_rfc3339(start), to_rfc3339(end)
    digests = Digests()
    for batch in dataset.to_batches(columns=list(COMPARED), filter=window, use_threads=False):
        texts = batch.column("commit_timestamp_text").to_pylist()
        kinds = batch.column("mod_type").to_pylist()
        inside = [
            first <= text <= last and kind not in NOT_TRANSACTIONS
            for text, kind in zip(texts, kinds, strict=True)
        ]
        digests.add_rows(pa.Table.from_batches([batch]).filter(pa.array(inside)))
    return digests


def stream_digests(
    source: ChangeStreamQuery, config: ReaderConfig, log: Logger, stop: threading.Event
) -> Digests:
    """The stream's transactions up to ``config.end_timestamp``, as the sink would land them."""
    digests = Digests()

    def collect(release: Release) -> None:
        if release.transactions:
            digests.add_rows(to_arrow(release.transactions))

    ChangeStreamReader(source, config, log).run(collect, stop)
    return digests


def audit(
    changelog_uri: str,
    watermark: Nanos,
    source: ChangeStreamQuery,
    config: ReaderConfig,
    log: Logger,
    stop: threading.Event,
) -> AuditReport:
    """Refuses a window the change log has not landed whole: its end must be at or below its
    low watermark (``newest_watermark``)."""
    start, end = config.start_timestamp, config.end_timestamp
    assert end is not None, "an audit window is closed"
    if end > watermark:
        raise AuditWindowError(
            f"the window ends at {to_rfc3339(end)}, after the change log's low watermark "
            f"{to_rfc3339(watermark)}: audit a window the change log has landed"
        )
    landed = changelog_digests(changelog_uri, start, end)
    read = stream_digests(source, config, log, stop)
    return compare(start, end, read.by_transaction, landed.by_transaction)
