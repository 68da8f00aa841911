"""The coordinator step: what happens to each event of a partition query, and when whole
transactions are released. Single-threaded and free of I/O: the threaded reader feeds it from
its queue, the property tests from simulated topologies, so both run the same rules."""

from __future__ import annotations

import structlog

from ingest.model.records import ChangeRecord, DataChangeRecord
from ingest.model.resume import Release, ResumePoint
from ingest.model.timestamps import Nanos
from ingest.rules.assembler import TransactionAssembler
from ingest.rules.partitions import PartitionTracker


class Coordinator:
    def __init__(
        self,
        start_timestamp: Nanos,
        end_timestamp: Nanos | None,
        log: structlog.typing.FilteringBoundLogger | None = None,
        resume_from: ResumePoint | None = None,
    ) -> None:
        """A new job starts from the initial query; a resumed one from its resume point."""
        self.end_timestamp = end_timestamp
        self.tracker = PartitionTracker(start_timestamp, end_timestamp, log)
        released = start_timestamp - 1
        if resume_from is None:
            self.tracker.add_initial()
        else:
            self.tracker.restore(resume_from.partitions, resume_from.low_watermark)
            released = resume_from.low_watermark
            if self.tracker.all_finished:
                self.tracker.add_initial()
        self.assembler = TransactionAssembler(released, log)

    def query_started(self, token: str, start: Nanos) -> None:
        self.tracker.mark_running(token, start)

    def record_read(self, token: str, record: ChangeRecord) -> None:
        self.tracker.on_record(token, record)
        if isinstance(record, DataChangeRecord):
            self.assembler.add(record)

    def stream_ended(self, token: str) -> None:
        self.tracker.on_stream_end(token)

    def low_watermark(self) -> Nanos | None:
        """The tracker's low watermark; the end timestamp once every partition finished."""
        low = self.tracker.low_watermark()
        return self.end_timestamp if low is None and self.end_timestamp is not None else low

    def release(self) -> Release | None:
        """The transactions the low watermark passed since the last release, with the resume
        point to store once they have landed; None when it has not moved."""
        low = self.low_watermark()
        if low is None or low <= self.assembler.released_watermark:
            return None
        transactions = self.assembler.release(low)
        return Release(transactions, low, ResumePoint(low, self.tracker.resumable(low)))
