"""What the reader is configured with, and what it needs of the DAO."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from ingest.changestream.retries import RetryPolicy
from ingest.model.records import ChangeRecord
from ingest.model.timestamps import Nanos


class ChangeStreamSource(Protocol):
    """One query of one partition."""

    def read(
        self, partition_token: str | None, start: Nanos, end: Nanos | None
    ) -> Iterator[ChangeRecord]: ...


@dataclass(frozen=True, slots=True)
class ReaderConfig:
    start_timestamp: Nanos
    end_timestamp: Nanos | None = None
    heartbeat_ms: int = 1000
    max_concurrent_partitions: int = 512
    """Partitions read at once (worker threads, open queries); more live partitions take turns."""
    memory_budget_bytes: int = 256 * 1024 * 1024
    stats_interval_s: float = 10.0
    query_window_s: float = 120.0
    """Every partition query ends at most this long after it starts (wall clock), then runs again
    from its resume timestamp: Spanner bounds MUTABLE_KEY_RANGE queries to 30 minutes, and an
    unbounded query holds its session and stream forever. Beam uses 2 minutes."""
    settle_margin_s: float = 1.0
    """A query that closes cleanly proves its end only where that end was this old when the
    query began: a source may make a record visible after its commit timestamp has passed (a
    commit in flight, clocks apart), and a catching-up query ends this long before now. Real
    Spanner closes a query only once its end is safe; the emulator was not shown to."""
    stuck_after_heartbeats: int = 10
    """A running partition whose query sent no record for this many heartbeat intervals is
    stuck: it is logged and its query started again (``rules.watchdog``)."""
    retry: RetryPolicy = field(default_factory=RetryPolicy)
