"""The change stream reader: partition queries in worker threads, one coordinator.

Workers (``worker.py``) only run queries and put what they read on one queue. The coordinator
alone owns the partition tracker and the transaction assembler, so their rules stay
single-threaded and are the same code the property tests drive. Data flows one way: query →
tracker/assembler → release. Which partitions are read at once and what each query reads are
the turns of ``rules.turns``; a silent stream is found by ``rules.watchdog``. This module keeps
the threads, the queue and the wiring.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable

from ingest.changestream.config import ChangeStreamSource, ReaderConfig
from ingest.changestream.worker import (
    Clocks,
    Event,
    Progress,
    QueryStarted,
    RecordRead,
    StreamEnded,
    TurnEnded,
    Workers,
)
from ingest.model.resume import Release, ResumePoint
from ingest.model.timestamps import NANOS_PER_SECOND, Nanos, to_rfc3339
from ingest.rules.coordinator import Coordinator
from ingest.rules.turns import Turns
from ingest.rules.watchdog import Watchdog
from runtime.errors import ReportedError
from runtime.logs import Logger

EVENT_QUEUE_SIZE = 512
"""Records in flight between workers and the coordinator; memory ≈ budget + this many records."""


class PartitionQueryFailed(ReportedError, RuntimeError):
    """A partition query failed permanently, or kept failing past the retry policy."""


class ChangeStreamReader:
    def __init__(
        self,
        source: ChangeStreamSource,
        config: ReaderConfig,
        log: Logger,
        wall_clock: Callable[[], Nanos] = time.time_ns,
        sleep: Callable[[float], None] = time.sleep,
        resume_from: ResumePoint | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._log = log
        self._wall_clock = wall_clock
        self._events: queue.Queue[Event] = queue.Queue(maxsize=EVENT_QUEUE_SIZE)
        self.coordinator = Coordinator(
            config.start_timestamp, config.end_timestamp, log, resume_from
        )
        self.tracker = self.coordinator.tracker
        self.assembler = self.coordinator.assembler
        self.turns = Turns(config.max_concurrent_partitions)
        self.watchdog = Watchdog(
            config.heartbeat_ms / 1000, config.stuck_after_heartbeats, monotonic
        )
        self._generations: dict[str, int] = {}
        """The worker generation each running partition's events must carry; a restarted
        partition's old worker stops at its next record and its events are dropped."""
        self._workers = Workers(
            source,
            config,
            log,
            self._emit,
            Clocks(wall_clock, monotonic, sleep),
            self._generations.get,
            self._count_retry,
        )
        self._records_read = 0
        self._retries: collections.Counter[str] = collections.Counter()
        self._retries_lock = threading.Lock()
        self._running: dict[str, Progress] = {}
        """The progress of each partition's current worker, read by the watchdog."""

    def run(
        self,
        on_release: Callable[[Release], None],
        stop: threading.Event,
        on_tick: Callable[[], None] | None = None,
    ) -> None:
        """Read until stopped, or until every partition reached the end timestamp.

        ``on_tick`` runs on the coordinator every loop (about every 50 ms), for time-based work.
        """
        next_stats = time.monotonic() + self._config.stats_interval_s
        stats_window = (time.monotonic(), 0)
        try:
            while not stop.is_set():
                self._start_turns()
                self._drain_events()
                self._release(on_release)
                self._restart_stuck_partitions()
                if on_tick is not None:
                    on_tick()
                if self.tracker.all_finished:
                    break
                if time.monotonic() >= next_stats:
                    stats_window = self._log_stats(stats_window)
                    next_stats = time.monotonic() + self._config.stats_interval_s
        finally:
            self._workers.stop.set()
            self._workers.gate.update(False, None)

    @property
    def records_read(self) -> int:
        return self._records_read

    def retries_by_cause(self) -> dict[str, int]:
        """Partition queries retried, by exception type (read from other threads: a copy)."""
        with self._retries_lock:
            return dict(self._retries)

    def _over_budget(self) -> bool:
        return self.assembler.buffered_bytes > self._config.memory_budget_bytes

    def _start_turns(self) -> None:
        for partition in self.tracker.take_ready():
            self._generations[partition.token] = 0
            self.turns.wait(partition.token, partition.watermark)
        limit = self.coordinator.low_watermark() if self._over_budget() else None
        for token in self.turns.grant(limit):
            partition = self.tracker.partition(token)
            self._start_worker(token, partition.start_timestamp, partition.watermark)
        if self.turns.wanted(limit):
            self._workers.turn_wanted.set()
        else:
            self._workers.turn_wanted.clear()
        if self.turns.cycling_changed():
            self._log.info(
                "partition_turns_cycling" if self.turns.cycling else "partition_turns_steady",
                max_concurrent_partitions=self.turns.max_concurrent,
                live_partitions=self.turns.in_turn + self.turns.waiting,
            )

    def _start_worker(self, token: str, start: Nanos, watermark: Nanos) -> None:
        progress = self._running[token] = Progress(watermark=watermark)
        self._workers.start(token, start, progress, self._generations[token])

    def _restart_stuck_partitions(self) -> None:
        waiting = ((token, progress.waiting_since) for token, progress in self._running.items())
        for token, seconds in self.watchdog.stuck(waiting):
            partition = self.tracker.partition(token)
            self._log.warning(
                "partition_stuck",
                partition_token=token,
                silent_seconds=round(seconds, 3),
                behind_seconds=round(
                    (self._wall_clock() - partition.watermark) / NANOS_PER_SECOND, 3
                ),
                restarts_without_progress=self.watchdog.restarts_in_a_row(token),
                resume_timestamp=to_rfc3339(partition.resume_timestamp),
            )
            self._generations[token] += 1
            self._start_worker(token, partition.start_timestamp, partition.watermark)

    def _count_retry(self, error: BaseException | None) -> None:
        with self._retries_lock:
            self._retries[type(error).__name__] += 1

    def _drain_events(self) -> None:
        try:
            event = self._events.get(timeout=0.05)
        except queue.Empty:
            return
        for _ in range(10_000):
            self._apply(event)
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return

    def _apply(self, event: Event) -> None:
        if event.generation != self._generations.get(event.token):
            return  # a restarted partition's old worker
        if isinstance(event, RecordRead):
            self._records_read += 1
            partition = self.tracker.partition(event.token)
            before = partition.watermark
            self.coordinator.record_read(event.token, event.record)
            if partition.watermark > before:
                self.watchdog.moved(event.token)
            if self._over_budget():
                self._workers.gate.update(True, self.assembler.released_watermark)
        elif isinstance(event, QueryStarted):
            self.coordinator.query_started(event.token, event.start)
        elif isinstance(event, TurnEnded):
            self._running.pop(event.token, None)
            self.turns.handed_back(event.token, self.tracker.partition(event.token).watermark)
        elif isinstance(event, StreamEnded):
            self.turns.ended(event.token)
            self.coordinator.stream_ended(event.token)
            self.watchdog.moved(event.token)
            self._running.pop(event.token, None)
            self._generations.pop(event.token, None)
        else:
            self.turns.ended(event.token)
            self._log.error(
                "partition_query_failed",
                partition_token=event.token,
                error=f"{type(event.error).__name__}: {event.error}",
            )
            raise PartitionQueryFailed(
                f"partition {event.token or '(initial)'} failed: {event.error}"
            ) from event.error

    def _release(self, on_release: Callable[[Release], None]) -> None:
        release = self.coordinator.release()
        if release is not None:
            on_release(release)
        self._workers.gate.update(self._over_budget(), self.coordinator.low_watermark())

    def _log_stats(self, window: tuple[float, int]) -> tuple[float, int]:
        started, records_then = window
        now = time.monotonic()
        low_watermark = self.assembler.released_watermark
        self._log.info(
            "reader_stats",
            records_per_second=round((self._records_read - records_then) / (now - started), 1),
            low_watermark=to_rfc3339(low_watermark),
            watermark_lag_seconds=round((self._wall_clock() - low_watermark) / NANOS_PER_SECOND, 3),
            open_transactions=self.assembler.open_transactions,
            buffered_bytes=self.assembler.buffered_bytes,
            active_partitions=self.tracker.live_count,
            partitions_in_turn=self.turns.in_turn,
            partitions_waiting_for_turn=self.turns.waiting,
            turns_started=self.turns.started,
            duplicates_dropped=self.assembler.stats.duplicates_dropped,
            stuck_partitions=self.watchdog.stuck_partitions,
        )
        return now, self._records_read

    def _emit(self, event: Event) -> None:
        """Queue an event for the coordinator; give up once the reader stopped, so no worker is
        left blocked on a full queue nobody drains."""
        while not self._workers.stop.is_set():
            try:
                self._events.put(event, timeout=0.1)
                return
            except queue.Full:
                continue
