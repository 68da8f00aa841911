"""Shared test builders: data change records, and change-log tables built without Spanner (typed
mods landed through the real ingest sink)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

import structlog
from structlog.testing import LogCapture

from ingest.delta.sink import DeltaChangeLogSink
from ingest.model.records import ColumnType, DataChangeRecord, Mod, Transaction
from ingest.model.resume import ResumablePartitions, ResumePoint
from ingest.model.timestamps import parse_rfc3339

START = parse_rfc3339("2026-11-22T10:00:00.000000001Z")
ACCOUNTS = (
    ColumnType("account_id", {"code": "INT64"}, True, 1),
    ColumnType("owner", {"code": "STRING"}, False, 2),
    ColumnType("balance", {"code": "INT64"}, False, 3),
)


@dataclass
class ChangeLog:
    """Appends transactions to a change-log table, one Delta version per ``land`` call."""

    uri: str
    columns: dict[str, tuple[ColumnType, ...]] = field(
        default_factory=lambda: {"accounts": ACCOUNTS}
    )
    clock: int = START
    value_capture_type: str = "NEW_ROW_AND_OLD_VALUES"
    pending: list[Transaction] = field(default_factory=list)
    landed: list[list[Transaction]] = field(default_factory=list)
    _ids: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.sink = DeltaChangeLogSink(self.uri, "test-ingest", "owner")
        checkpoint = self.sink.latest_checkpoint()
        self.sink.continue_after(checkpoint)
        if checkpoint is None:
            self.sink.start_job(START)

    def commit(self, *mods: tuple[Any, ...]) -> Transaction:
        """One transaction of (table, mod_type, keys, new_values[, old_values]) mods, one record
        per mod."""
        self.clock += 1_000_123
        tid = f"tx-{next(self._ids):06d}"
        records = tuple(
            DataChangeRecord(
                commit_timestamp=self.clock,
                record_sequence=f"{n:08d}",
                server_transaction_id=tid,
                is_last_record_in_transaction_in_partition=n == len(mods) - 1,
                table_name=table,
                column_types=self.columns[table],
                mods=(Mod(mod[2], mod[3], mod[4] if len(mod) > 4 else {}),),
                mod_type=mod_type,
                value_capture_type=self.value_capture_type,
                number_of_records_in_transaction=len(mods),
                number_of_partitions_in_transaction=1,
                transaction_tag="",
                is_system_transaction=False,
            )
            for n, mod in enumerate(mods)
            for table, mod_type in [mod[:2]]
        )
        transaction = Transaction(self.clock, tid, records)
        self.pending.append(transaction)
        return transaction

    def land(self, watched: dict[str, tuple[ColumnType, ...]] | None = None) -> int:
        """Commit what is pending as one Delta version; its low watermark is the clock, just
        past the pending transactions when ``watched`` columns land as schema rows with them."""
        if watched:
            self.clock += 1
        result = self.sink.commit(
            self.pending, ResumePoint(self.clock, ResumablePartitions((), ())), watched
        )
        self.landed.append(self.pending)
        self.pending = []
        return result.version


def record(ts: int, txid: str, seq: int, count: int, **overrides: object) -> DataChangeRecord:
    fields = dict(
        commit_timestamp=ts,
        record_sequence=f"{seq:08d}",
        server_transaction_id=txid,
        is_last_record_in_transaction_in_partition=False,
        table_name="t",
        column_types=(ColumnType("k", {"code": "INT64"}, True, 1),),
        mods=(Mod({"k": str(seq)}, {"v": "x" * 100}, {}),),
        mod_type="INSERT",
        value_capture_type="NEW_ROW_AND_OLD_VALUES",
        number_of_records_in_transaction=count,
        number_of_partitions_in_transaction=1,
        transaction_tag="",
        is_system_transaction=False,
    )
    fields.update(overrides)
    return DataChangeRecord(**fields)  # type: ignore[arg-type]


def captured_logger() -> tuple[
    structlog.typing.FilteringBoundLogger, list[MutableMapping[str, Any]]
]:
    """A logger whose events are kept as dicts (structlog's ``LogCapture``), for assertions."""
    capture = LogCapture()
    logger = structlog.wrap_logger(
        structlog.ReturnLogger(),
        processors=[structlog.processors.add_log_level, capture],
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
    )
    return logger, capture.entries
