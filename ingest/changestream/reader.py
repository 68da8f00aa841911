"""The change stream reader: partition queries in worker threads, one coordinator.

Workers only run queries and put what they read on one queue. The coordinator alone owns the
partition tracker and the transaction assembler, so their rules stay single-threaded and are the
same code the property tests drive. Data flows one way: query → tracker/assembler → release.

At most ``max_concurrent_partitions`` partitions are read at once, each in a turn on its own
worker thread. While every live partition has a turn, a turn tails its partition in windows of
``query_window_s``. Once more partitions live than turns, partitions take turns lowest watermark
first: a turn reads its partition up to what has settled (a query ending ``settle_margin_s``
before now) and hands it back, and a tailing turn hands its partition back at its next record.
So threads, sockets and buffers stay bounded with any number of partitions, and the low
watermark still advances, at the cost of one round of turns and the margin in latency.
"""

from __future__ import annotations

import collections
import enum
import heapq
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import structlog
from tenacity import RetryCallState, Retrying, retry_if_exception, wait_exponential_jitter

from ingest.changestream.retries import RetryPolicy, StreamEndedEarly, is_transient
from ingest.model.records import ChangeRecord, DataChangeRecord, HeartbeatRecord
from ingest.model.timestamps import NANOS_PER_SECOND, Nanos, to_rfc3339
from ingest.rules.coordinator import Coordinator
from ingest.rules.partitions import (
    INITIAL_PARTITION,
    ends_partition,
    resume_timestamp,
    watermark_after,
)
from ingest.rules.resume import Release, ResumePoint

Logger = structlog.typing.FilteringBoundLogger
EVENT_QUEUE_SIZE = 512
"""Records in flight between workers and the coordinator; memory ≈ budget + this many records."""


class ChangeStreamSource(Protocol):
    """What the reader needs of the DAO: one query of one partition."""

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
    """A running partition that sent no record for this many heartbeat intervals, while another
    sent some, is stuck: it is logged and its query started again."""
    retry: RetryPolicy = field(default_factory=RetryPolicy)


class PartitionQueryFailed(RuntimeError):
    """A partition query failed permanently, or kept failing past the retry policy."""


@dataclass(frozen=True, slots=True)
class _QueryStarted:
    token: str
    generation: int
    start: Nanos


@dataclass(frozen=True, slots=True)
class _RecordRead:
    token: str
    generation: int
    record: ChangeRecord


@dataclass(frozen=True, slots=True)
class _StreamEnded:
    token: str
    generation: int


@dataclass(frozen=True, slots=True)
class _TurnEnded:
    """The worker handed its partition back, unfinished, for another turn."""

    token: str
    generation: int


@dataclass(frozen=True, slots=True)
class _StreamFailed:
    token: str
    generation: int
    error: BaseException


_Event = _QueryStarted | _RecordRead | _StreamEnded | _TurnEnded | _StreamFailed


class _Outcome(enum.Enum):
    FINISHED = "finished"
    """The partition sent its last record, or reached the reader's end timestamp."""
    WINDOW_CLOSED = "window closed"
    """The query reached its end timestamp, the partition living on."""
    HANDED_BACK = "handed back"
    """The turn stopped reading so that a partition waiting for a turn gets one."""


class BackpressureGate:
    """Pauses partitions that run ahead of the low watermark while the buffer is over budget.

    The partition holding the low watermark never waits, so the watermark keeps advancing and
    releases what is buffered: backpressure without deadlock. A paused turn is handed back
    instead when a partition waits for a turn: the one holding the low watermark may be it.
    """

    def __init__(self, turn_wanted: threading.Event) -> None:
        self._turn_wanted = turn_wanted
        self._condition = threading.Condition()
        self._over_budget = False
        self._low_watermark: Nanos | None = None

    def update(self, over_budget: bool, low_watermark: Nanos | None) -> None:
        with self._condition:
            self._over_budget = over_budget
            self._low_watermark = low_watermark
            self._condition.notify_all()

    def wait_turn(self, partition_watermark: Nanos, stop: threading.Event) -> bool:
        """Wait while the partition must; True when it should hand its turn back instead."""
        with self._condition:
            while (
                self._over_budget
                and self._low_watermark is not None
                and partition_watermark > self._low_watermark
                and not stop.is_set()
            ):
                if self._turn_wanted.is_set():
                    return True
                self._condition.wait(0.1)
            return False


@dataclass(slots=True)
class _Progress:
    """A worker's view of its partition, used to resume after a failure."""

    watermark: Nanos
    ended: bool = False
    """Its last record arrived (``partitions.ends_partition``)."""
    failures_without_progress: int = 0
    waiting_since: float | None = None
    """Since when (monotonic) the worker has waited on the source for its next record; None
    while it does anything else (applies a record, waits for backpressure or for its end to
    settle, backs off). The watchdog's measure of silence, taken where the silence is."""


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
        self._source = source
        self._config = config
        self._log = log
        self._wall_clock = wall_clock
        self._sleep = sleep
        self._events: queue.Queue[_Event] = queue.Queue(maxsize=EVENT_QUEUE_SIZE)
        self._turn_wanted = threading.Event()
        """Set while a partition waits for a turn: reading turns hand theirs back."""
        self._gate = BackpressureGate(self._turn_wanted)
        self._workers_stop = threading.Event()
        self.coordinator = Coordinator(
            config.start_timestamp, config.end_timestamp, log, resume_from
        )
        self.tracker = self.coordinator.tracker
        self.assembler = self.coordinator.assembler
        self._records_read = 0
        self._turns_started = 0
        self._retries: collections.Counter[str] = collections.Counter()
        self._retries_lock = threading.Lock()
        self._stuck_restarts_total = 0
        self._monotonic = monotonic
        self._generations: dict[str, int] = {}
        """The worker generation each running partition's events must carry; a restarted
        partition's old worker stops at its next record and its events are dropped."""
        self._in_turn: set[str] = set()
        self._waiting: list[tuple[Nanos, str]] = []
        """Partitions waiting for a turn, a heap by watermark: the lowest holds the low
        watermark back the longest."""
        self._cycling = False
        self._running: dict[str, _Progress] = {}
        """The progress of each partition's current worker, read by the watchdog."""
        self._stuck_restarts: dict[str, int] = {}
        self._next_stuck_check = 0.0

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
            self._workers_stop.set()
            self._gate.update(False, None)

    # -- coordinator -----------------------------------------------------------------------

    def _start_turns(self) -> None:
        """Give free turns to waiting partitions, lowest watermark first. Over the memory budget
        only partitions at the low watermark get one: the others would only wait in it."""
        for partition in self.tracker.take_ready():
            self._generations[partition.token] = 0
            heapq.heappush(self._waiting, (partition.watermark, partition.token))
        free = self._config.max_concurrent_partitions - len(self._in_turn)
        limit: Nanos | None = None
        if self.assembler.buffered_bytes > self._config.memory_budget_bytes:
            limit = self.coordinator.low_watermark()

        def one_is_due() -> bool:
            return bool(self._waiting) and (limit is None or self._waiting[0][0] <= limit)

        while free > 0 and one_is_due():
            _, token = heapq.heappop(self._waiting)
            partition = self.tracker.partition(token)
            self._in_turn.add(token)
            self._turns_started += 1
            free -= 1
            self._start_worker(token, partition.start_timestamp, partition.watermark)
        if one_is_due():
            self._turn_wanted.set()
        else:
            self._turn_wanted.clear()
        live = len(self._in_turn) + len(self._waiting)
        cycling = live > self._config.max_concurrent_partitions
        if cycling != self._cycling:
            self._log.info(
                "partition_turns_cycling" if cycling else "partition_turns_steady",
                max_concurrent_partitions=self._config.max_concurrent_partitions,
                live_partitions=live,
            )
            self._cycling = cycling

    def _start_worker(self, token: str, start: Nanos, watermark: Nanos) -> None:
        progress = self._running[token] = _Progress(watermark=watermark)
        threading.Thread(
            target=self._read_partition,
            args=(token, start, progress, self._generations[token]),
            name=f"partition-{token[:12] or 'initial'}",
            daemon=True,
        ).start()

    def _restart_stuck_partitions(self) -> None:
        """Debezium's stuck-partition watchdog: Spanner can leave a partition's stream open and
        silent. A partition whose worker has waited on its stream for ``stuck_after_heartbeats``
        heartbeat intervals without a record (Spanner sends a heartbeat every interval) is
        stuck, whatever the others do: alone, or holding the low watermark over the budget."""
        now = self._monotonic()
        heartbeat_s = self._config.heartbeat_ms / 1000
        if now < self._next_stuck_check:
            return
        self._next_stuck_check = now + heartbeat_s / 2
        limit = self._config.stuck_after_heartbeats * heartbeat_s
        silent = {
            token: now - progress.waiting_since
            for token, progress in self._running.items()
            if progress.waiting_since is not None and now - progress.waiting_since > limit
        }
        for token, seconds in silent.items():
            partition = self.tracker.partition(token)
            restarts = self._stuck_restarts[token] = self._stuck_restarts.get(token, 0) + 1
            self._stuck_restarts_total += 1
            self._log.warning(
                "partition_stuck",
                partition_token=token,
                silent_seconds=round(seconds, 3),
                behind_seconds=round(
                    (self._wall_clock() - partition.watermark) / NANOS_PER_SECOND, 3
                ),
                restarts_without_progress=restarts,
                resume_timestamp=to_rfc3339(partition.resume_timestamp),
            )
            self._generations[token] += 1
            self._start_worker(token, partition.start_timestamp, partition.watermark)

    def _retried(self, token: str, state: RetryCallState, start: Nanos, watermark: Nanos) -> None:
        error = state.outcome.exception() if state.outcome else None
        with self._retries_lock:
            self._retries[type(error).__name__] += 1
        self._log.warning(
            "partition_query_retry",
            partition_token=token,
            attempt=state.attempt_number,
            cause=repr(error),
            resume_timestamp=to_rfc3339(resume_timestamp(start, watermark)),
        )

    def retries_by_cause(self) -> dict[str, int]:
        """Partition queries retried, by exception type (read from other threads: a copy)."""
        with self._retries_lock:
            return dict(self._retries)

    @property
    def records_read(self) -> int:
        return self._records_read

    @property
    def partitions_in_turn(self) -> int:
        return len(self._in_turn)

    @property
    def partitions_waiting_for_turn(self) -> int:
        return len(self._waiting)

    @property
    def stuck_partitions(self) -> int:
        return len(self._stuck_restarts)

    @property
    def stuck_restarts_total(self) -> int:
        return self._stuck_restarts_total

    @property
    def stuck_restarts(self) -> int:
        """The most restarts in a row of one stuck partition that did not move it on (read by
        the health server's thread: a copy, taken at once)."""
        return max(tuple(self._stuck_restarts.values()), default=0)

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

    def _apply(self, event: _Event) -> None:
        if event.generation != self._generations.get(event.token):
            return  # a restarted partition's old worker
        if isinstance(event, _TurnEnded | _StreamEnded | _StreamFailed):
            self._in_turn.discard(event.token)
        if isinstance(event, _RecordRead):
            self._records_read += 1
            partition = self.tracker.partition(event.token)
            before = partition.watermark
            self.coordinator.record_read(event.token, event.record)
            if partition.watermark > before:
                self._stuck_restarts.pop(event.token, None)
            if self.assembler.buffered_bytes > self._config.memory_budget_bytes:
                self._gate.update(True, self.assembler.released_watermark)
        elif isinstance(event, _QueryStarted):
            self.coordinator.query_started(event.token, event.start)
        elif isinstance(event, _TurnEnded):
            self._running.pop(event.token, None)
            partition = self.tracker.partition(event.token)
            heapq.heappush(self._waiting, (partition.watermark, event.token))
        elif isinstance(event, _StreamEnded):
            self.coordinator.stream_ended(event.token)
            for running in (self._running, self._stuck_restarts, self._generations):
                running.pop(event.token, None)
        else:
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
        low_watermark = self.coordinator.low_watermark()
        over_budget = self.assembler.buffered_bytes > self._config.memory_budget_bytes
        self._gate.update(over_budget, low_watermark)

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
            partitions_in_turn=self.partitions_in_turn,
            partitions_waiting_for_turn=self.partitions_waiting_for_turn,
            turns_started=self._turns_started,
            duplicates_dropped=self.assembler.stats.duplicates_dropped,
            stuck_partitions=self.stuck_partitions,
        )
        return now, self._records_read

    # -- workers ---------------------------------------------------------------------------

    def _emit(self, event: _Event) -> None:
        """Queue an event for the coordinator; give up once the reader stopped, so no worker is
        left blocked on a full queue nobody drains."""
        while not self._workers_stop.is_set():
            try:
                self._events.put(event, timeout=0.1)
                return
            except queue.Full:
                continue

    def _read_partition(
        self, token: str, start: Nanos, progress: _Progress, generation: int
    ) -> None:
        """One turn: query the partition until it finishes, or until its turn is wanted."""
        watermark = progress.watermark

        def stopped() -> bool:
            return self._workers_stop.is_set() or self._generations.get(token) != generation

        policy = self._config.retry
        retrying = Retrying(
            retry=retry_if_exception(is_transient),
            wait=wait_exponential_jitter(
                multiplier=policy.initial_backoff_s, max=policy.max_backoff_s
            ),
            stop=lambda _: progress.failures_without_progress >= policy.max_failures or stopped(),
            before_sleep=lambda state: self._retried(token, state, start, progress.watermark),
            sleep=self._sleep,
            reraise=True,
        )
        outcome = _Outcome.WINDOW_CLOSED
        try:
            while outcome is _Outcome.WINDOW_CLOSED and not stopped():
                if self._turn_wanted.is_set() and progress.watermark > watermark:
                    outcome = _Outcome.HANDED_BACK
                    break
                for attempt in retrying:
                    with attempt:
                        outcome = self._query_once(token, generation, start, progress, stopped)
        except BaseException as error:
            if not stopped():
                self._emit(_StreamFailed(token, generation, error))
            return
        if stopped():
            return
        if outcome is _Outcome.FINISHED:
            self._emit(_StreamEnded(token, generation))
        else:
            self._emit(_TurnEnded(token, generation))

    def _query_once(
        self,
        token: str,
        generation: int,
        start: Nanos,
        progress: _Progress,
        stopped: Callable[[], bool],
    ) -> _Outcome:
        """One bounded query of the partition. While partitions wait for a turn it reads up to
        what has settled, else it tails for a window; either way it may hand the turn back
        mid-stream."""
        query_start = resume_timestamp(start, progress.watermark)
        watermark_before = progress.watermark
        margin = int(self._config.settle_margin_s * NANOS_PER_SECOND)
        began = self._wall_clock()
        while self._turn_wanted.is_set() and began - margin <= query_start and not stopped():
            # Fresher than what has settled while others wait for a turn: wait until there is
            # something to catch up on, rather than tail a partition until its next heartbeat
            # (every waiting partition is fresher still: turns go lowest watermark first).
            self._workers_stop.wait((query_start - began + margin) / NANOS_PER_SECOND)
            began = self._wall_clock()
        self._emit(_QueryStarted(token, generation, query_start))
        settled = began - margin
        catching_up = self._turn_wanted.is_set() and query_start < settled
        window = int(self._config.query_window_s * NANOS_PER_SECOND)
        window_end = settled if catching_up else max(began, query_start) + window
        final = self._config.end_timestamp
        end = window_end if final is None else min(final, window_end)
        try:
            records = self._source.read(
                None if token == INITIAL_PARTITION else token, query_start, end
            )
            try:
                for record in _listened(records, progress, self._monotonic):
                    if isinstance(record, DataChangeRecord):
                        self._log.debug(
                            "record_received",
                            partition_token=token,
                            commit_timestamp=to_rfc3339(record.commit_timestamp),
                            server_transaction_id=record.server_transaction_id,
                            record_sequence=record.record_sequence,
                        )
                    if stopped():
                        return _Outcome.FINISHED
                    if self._gate.wait_turn(progress.watermark, self._workers_stop):
                        return _Outcome.HANDED_BACK
                    progress.watermark = max(progress.watermark, watermark_after(record))
                    progress.ended = progress.ended or ends_partition(token, record)
                    self._emit(_RecordRead(token, generation, record))
                    if (
                        not (catching_up or progress.ended)
                        and self._turn_wanted.is_set()
                        and progress.watermark > watermark_before
                    ):
                        return _Outcome.HANDED_BACK
            finally:
                if isinstance(records, Generator):
                    records.close()  # a turn handed back cancels its query at once
            if stopped():
                return _Outcome.FINISHED
            proven = min(end, settled)
            if not progress.ended and progress.watermark < proven:
                # A clean close delivered every record up to its end, as a heartbeat at it
                # would; trusted only up to what had settled when the query began (a
                # catching-up query: all of it; such a query often returns no record at all).
                progress.watermark = proven
                self._emit(_RecordRead(token, generation, HeartbeatRecord(proven)))
                self._log.debug(
                    "query_end_proven",
                    partition_token=token,
                    query_start_timestamp=to_rfc3339(query_start),
                    end_timestamp=to_rfc3339(proven),
                )
            now = self._wall_clock()
            if progress.ended or (final is not None and progress.watermark >= final):
                outcome = _Outcome.FINISHED
            elif progress.watermark > watermark_before:
                outcome = _Outcome.WINDOW_CLOSED
            elif end < now:
                # Its end passed but had not settled when the query began: query again once
                # it has, and that query proves it.
                self._workers_stop.wait((end + margin - now) / NANOS_PER_SECOND)
                outcome = _Outcome.WINDOW_CLOSED
            else:
                raise StreamEndedEarly(
                    f"partition {token or '(initial)'} closed without its last record or progress"
                )
        except BaseException:
            made_progress = progress.watermark > watermark_before
            progress.failures_without_progress = (
                1 if made_progress else progress.failures_without_progress + 1
            )
            raise
        progress.failures_without_progress = 0
        return outcome


def _listened(
    records: Iterator[ChangeRecord], progress: _Progress, monotonic: Callable[[], float]
) -> Iterator[ChangeRecord]:
    """``records``, keeping ``progress.waiting_since`` while the worker waits for the next."""
    iterator = iter(records)
    while True:
        progress.waiting_since = monotonic()
        try:
            record = next(iterator)
        except StopIteration:
            return
        finally:
            progress.waiting_since = None
        yield record
