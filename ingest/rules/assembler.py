"""Whole transactions from data change records that arrive from any partition, in any order.

Records are buffered by server_transaction_id until ``number_of_records_in_transaction`` distinct
record sequences have arrived, then held until the low watermark passes the commit timestamp, and
released in (commit_timestamp, server_transaction_id) order. Duplicates from retried queries are
dropped here: a record at or below the released watermark, or a record sequence seen already.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import structlog

from ingest.model.records import DataChangeRecord, Transaction, sequence_key
from ingest.model.timestamps import Nanos, to_rfc3339
from runtime.errors import ReportedError
from runtime.logs import null_logger

_RECORD_OVERHEAD_BYTES = 512


class IncompleteTransactionError(ReportedError, RuntimeError):
    """The low watermark passed a transaction whose records have not all arrived."""


class InconsistentTransactionError(ReportedError, RuntimeError):
    """Records of one server_transaction_id disagree on commit timestamp or record count."""


def estimate_size(record: DataChangeRecord) -> int:
    """Approximate bytes held for a record: enough to bound memory, cheap enough per record."""
    size = _RECORD_OVERHEAD_BYTES + 64 * len(record.column_types)
    for mod in record.mods:
        size += len(repr(mod.keys)) + len(repr(mod.new_values)) + len(repr(mod.old_values))
    return size


@dataclass(slots=True)
class _PendingTransaction:
    commit_timestamp: Nanos
    server_transaction_id: str
    expected_records: int
    records: dict[str, DataChangeRecord] = field(default_factory=dict)
    size_bytes: int = 0

    def build(self) -> Transaction:
        ordered = sorted(self.records.values(), key=lambda r: sequence_key(r.record_sequence))
        return Transaction(self.commit_timestamp, self.server_transaction_id, tuple(ordered))


@dataclass(slots=True)
class AssemblerStats:
    duplicates_dropped: int = 0
    transactions_released: int = 0


class TransactionAssembler:
    def __init__(
        self,
        released_watermark: Nanos,
        log: structlog.typing.FilteringBoundLogger | None = None,
    ) -> None:
        self._released_watermark = released_watermark
        self._log = log or null_logger()
        self._pending: dict[str, _PendingTransaction] = {}
        self._complete: list[tuple[Nanos, str, _PendingTransaction]] = []
        self._complete_ids: set[str] = set()
        self._buffered_bytes = 0
        self.stats = AssemblerStats()

    @property
    def released_watermark(self) -> Nanos:
        return self._released_watermark

    @property
    def buffered_bytes(self) -> int:
        return self._buffered_bytes

    @property
    def open_transactions(self) -> int:
        return len(self._pending) + len(self._complete)

    def add(self, record: DataChangeRecord) -> None:
        if record.commit_timestamp <= self._released_watermark:
            self.stats.duplicates_dropped += 1
            return
        pending = self._pending.get(record.server_transaction_id)
        if pending is None:
            if record.server_transaction_id in self._complete_ids:
                self.stats.duplicates_dropped += 1
                return
            pending = _PendingTransaction(
                record.commit_timestamp,
                record.server_transaction_id,
                record.number_of_records_in_transaction,
            )
            self._pending[record.server_transaction_id] = pending
        self._check_consistent(pending, record)
        if record.record_sequence in pending.records:
            self.stats.duplicates_dropped += 1
            return
        size = estimate_size(record)
        pending.records[record.record_sequence] = record
        pending.size_bytes += size
        self._buffered_bytes += size
        if len(pending.records) == pending.expected_records:
            del self._pending[record.server_transaction_id]
            self._complete_ids.add(record.server_transaction_id)
            heapq.heappush(
                self._complete, (pending.commit_timestamp, pending.server_transaction_id, pending)
            )

    def release(self, low_watermark: Nanos) -> list[Transaction]:
        """Every complete transaction with commit timestamp ≤ low_watermark, in commit order."""
        if low_watermark <= self._released_watermark:
            return []
        behind = [p for p in self._pending.values() if p.commit_timestamp <= low_watermark]
        if behind:
            oldest = min(behind, key=lambda p: (p.commit_timestamp, p.server_transaction_id))
            self._log.error(
                "incomplete_transaction_behind_watermark",
                server_transaction_id=oldest.server_transaction_id,
                commit_timestamp=to_rfc3339(oldest.commit_timestamp),
                records_received=len(oldest.records),
                number_of_records_in_transaction=oldest.expected_records,
                low_watermark=to_rfc3339(low_watermark),
                incomplete_transactions=len(behind),
            )
            raise IncompleteTransactionError(
                f"transaction {oldest.server_transaction_id} at "
                f"{to_rfc3339(oldest.commit_timestamp)} has {len(oldest.records)} of "
                f"{oldest.expected_records} records but the low watermark is "
                f"{to_rfc3339(low_watermark)}"
            )
        released = []
        while self._complete and self._complete[0][0] <= low_watermark:
            _, _, pending = heapq.heappop(self._complete)
            self._complete_ids.discard(pending.server_transaction_id)
            self._buffered_bytes -= pending.size_bytes
            released.append(pending.build())
        self._released_watermark = low_watermark
        self.stats.transactions_released += len(released)
        return released

    @staticmethod
    def _check_consistent(pending: _PendingTransaction, record: DataChangeRecord) -> None:
        if (
            record.commit_timestamp != pending.commit_timestamp
            or record.number_of_records_in_transaction != pending.expected_records
        ):
            raise InconsistentTransactionError(
                f"record {record.record_sequence} of transaction {record.server_transaction_id} "
                f"says commit {to_rfc3339(record.commit_timestamp)} with "
                f"{record.number_of_records_in_transaction} records; earlier records said "
                f"{to_rfc3339(pending.commit_timestamp)} with {pending.expected_records}"
            )
