"""What the reader is configured with, and what it needs of the DAO."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from ingest.changestream.retries import RetryPolicy
from ingest.model.records import ChangeRecord
from ingest.model.timestamps import Nanos

SETTLE_MARGIN_S = 1.0
STUCK_AFTER_HEARTBEATS = 10


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
    settle_margin_s: float = SETTLE_MARGIN_S
    """A query that closes cleanly proves its end only where that end was this old when the
    query began: a source may make a record visible after its commit timestamp has passed (a
    commit in flight, clocks apart), and a catching-up query ends this long before now. Real
    Spanner closes a query only once its end is safe; the emulator was not shown to."""
    stuck_after_heartbeats: int = STUCK_AFTER_HEARTBEATS
    """A running partition whose query sent no record for this many heartbeat intervals is
    stuck: it is logged and its query started again (``rules.watchdog``)."""
    retry: RetryPolicy = field(default_factory=RetryPolicy)


class ReaderOptions(Protocol):
    """The reader's options as operators set them (the service's config, ``tail``'s flags)."""

    @property
    def heartbeat_ms(self) -> int: ...
    @property
    def max_concurrent_partitions(self) -> int: ...
    @property
    def memory_budget_mb(self) -> int: ...
    @property
    def stats_interval_s(self) -> float: ...
    @property
    def query_window_s(self) -> float: ...
    @property
    def settle_margin_s(self) -> float: ...
    @property
    def stuck_after_heartbeats(self) -> int: ...


def reader_config(options: ReaderOptions, start: Nanos, end: Nanos | None = None) -> ReaderConfig:
    return ReaderConfig(
        start_timestamp=start,
        end_timestamp=end,
        heartbeat_ms=options.heartbeat_ms,
        max_concurrent_partitions=options.max_concurrent_partitions,
        memory_budget_bytes=options.memory_budget_mb * 1024 * 1024,
        stats_interval_s=options.stats_interval_s,
        query_window_s=options.query_window_s,
        settle_margin_s=options.settle_margin_s,
        stuck_after_heartbeats=options.stuck_after_heartbeats,
    )
