"""A partition's turn on a worker thread: bounded queries with retries, their records sent to
the coordinator as events. Workers keep no rule of their own: what a query reads and when a turn
ends come from ``rules.turns``; what a record means, from the coordinator."""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass

from tenacity import RetryCallState, Retrying, retry_if_exception, wait_exponential_jitter

from ingest.changestream.backpressure import BackpressureGate
from ingest.changestream.config import ChangeStreamSource, ReaderConfig
from ingest.changestream.retries import StreamEndedEarly, is_transient
from ingest.model.records import ChangeRecord, DataChangeRecord, HeartbeatRecord
from ingest.model.timestamps import NANOS_PER_SECOND, Nanos, to_rfc3339
from ingest.rules import turns
from ingest.rules.partitions import (
    INITIAL_PARTITION,
    ends_partition,
    resume_timestamp,
    watermark_after,
)
from runtime.logs import Logger


@dataclass(frozen=True, slots=True)
class QueryStarted:
    token: str
    generation: int
    start: Nanos


@dataclass(frozen=True, slots=True)
class RecordRead:
    token: str
    generation: int
    record: ChangeRecord


@dataclass(frozen=True, slots=True)
class StreamEnded:
    token: str
    generation: int


@dataclass(frozen=True, slots=True)
class TurnEnded:
    """The worker handed its partition back, unfinished, for another turn."""

    token: str
    generation: int


@dataclass(frozen=True, slots=True)
class StreamFailed:
    token: str
    generation: int
    error: BaseException


Event = QueryStarted | RecordRead | StreamEnded | TurnEnded | StreamFailed


@dataclass(slots=True)
class Progress:
    """A worker's view of its partition, used to resume after a failure."""

    watermark: Nanos
    ended: bool = False
    """Its last record arrived (``partitions.ends_partition``)."""
    failures_without_progress: int = 0
    waiting_since: float | None = None
    """Since when (monotonic) the worker has waited on the source for its next record; None
    while it does anything else. The watchdog's measure of silence, taken where it is."""


class Workers:
    """What every turn shares: the source, the clocks, the coordinator's signals."""

    def __init__(
        self,
        source: ChangeStreamSource,
        config: ReaderConfig,
        log: Logger,
        emit: Callable[[Event], None],
        clocks: Clocks,
        generation_of: Callable[[str], int | None],
        on_retry: Callable[[BaseException | None], None],
    ) -> None:
        self.source = source
        self.config = config
        self.log = log
        self.emit = emit
        self.clocks = clocks
        self._generation_of = generation_of
        self.stop = threading.Event()
        self.turn_wanted = threading.Event()
        """Set while a partition waits for a turn: reading turns hand theirs back."""
        self.gate = BackpressureGate(self.turn_wanted)
        self._on_retry = on_retry

    def start(self, token: str, start: Nanos, progress: Progress, generation: int) -> None:
        threading.Thread(
            target=self._turn,
            args=(token, start, progress, generation),
            name=f"partition-{token[:12] or 'initial'}",
            daemon=True,
        ).start()

    def _turn(self, token: str, start: Nanos, progress: Progress, generation: int) -> None:
        """Query the partition until it finishes, or until its turn is wanted."""
        watermark = progress.watermark

        def stopped() -> bool:
            return self.stop.is_set() or self._generation_of(token) != generation

        policy = self.config.retry
        retrying = Retrying(
            retry=retry_if_exception(is_transient),
            wait=wait_exponential_jitter(
                multiplier=policy.initial_backoff_s, max=policy.max_backoff_s
            ),
            stop=lambda _: progress.failures_without_progress >= policy.max_failures or stopped(),
            before_sleep=lambda state: self._retried(token, state, start, progress.watermark),
            sleep=self.clocks.sleep,
            reraise=True,
        )
        outcome = turns.Outcome.WINDOW_CLOSED
        query = _Query(self, token, generation, start, progress, stopped)
        try:
            while outcome is turns.Outcome.WINDOW_CLOSED and not stopped():
                if self.turn_wanted.is_set() and progress.watermark > watermark:
                    outcome = turns.Outcome.HANDED_BACK
                    break
                for attempt in retrying:
                    with attempt:
                        outcome = query.once()
        except BaseException as error:
            if not stopped():
                self.emit(StreamFailed(token, generation, error))
            return
        if stopped():
            return
        if outcome is turns.Outcome.FINISHED:
            self.emit(StreamEnded(token, generation))
        else:
            self.emit(TurnEnded(token, generation))

    def _retried(self, token: str, state: RetryCallState, start: Nanos, watermark: Nanos) -> None:
        error = state.outcome.exception() if state.outcome else None
        self._on_retry(error)
        self.log.warning(
            "partition_query_retry",
            partition_token=token,
            attempt=state.attempt_number,
            cause=repr(error),
            resume_timestamp=to_rfc3339(resume_timestamp(start, watermark)),
        )


@dataclass(frozen=True, slots=True)
class Clocks:
    wall: Callable[[], Nanos]
    monotonic: Callable[[], float]
    sleep: Callable[[float], None]


class _Query:
    """The queries of one turn, each bounded by ``rules.turns.plan_query``."""

    def __init__(
        self,
        workers: Workers,
        token: str,
        generation: int,
        start: Nanos,
        progress: Progress,
        stopped: Callable[[], bool],
    ) -> None:
        self._workers = workers
        self.config = workers.config
        self._token = token
        self._generation = generation
        self._start = start
        self._progress = progress
        self._stopped = stopped

    def once(self) -> turns.Outcome:
        """One bounded query; counts failures without progress for the retry policy."""
        before = self._progress.watermark
        try:
            outcome = self._read(before)
        except BaseException:
            progress = self._progress
            made_progress = progress.watermark > before
            progress.failures_without_progress = (
                1 if made_progress else progress.failures_without_progress + 1
            )
            raise
        self._progress.failures_without_progress = 0
        return outcome

    def _read(self, before: Nanos) -> turns.Outcome:
        workers, progress, token = self._workers, self._progress, self._token
        margin = int(self.config.settle_margin_s * NANOS_PER_SECOND)
        query_start = resume_timestamp(self._start, progress.watermark)
        now = workers.clocks.wall()
        while (
            pause := turns.wait_to_settle(query_start, now, margin, workers.turn_wanted.is_set())
        ) and not self._stopped():
            workers.stop.wait(pause / NANOS_PER_SECOND)
            now = workers.clocks.wall()
        workers.emit(QueryStarted(token, self._generation, query_start))
        plan = turns.plan_query(
            query_start,
            now,
            margin,
            int(self.config.query_window_s * NANOS_PER_SECOND),
            self.config.end_timestamp,
            workers.turn_wanted.is_set(),
        )
        records = workers.source.read(
            None if token == INITIAL_PARTITION else token, plan.start, plan.end
        )
        try:
            for record in _listened(records, progress, workers.clocks.monotonic):
                if self._stopped():
                    return turns.Outcome.FINISHED
                if workers.gate.wait_turn(progress.watermark, workers.stop):
                    return turns.Outcome.HANDED_BACK
                self._apply(record)
                wanted = workers.turn_wanted.is_set()
                if turns.hands_back(plan, progress.ended, wanted, progress.watermark, before):
                    return turns.Outcome.HANDED_BACK
        finally:
            if isinstance(records, Generator):
                records.close()  # a turn handed back cancels its query at once
        if self._stopped():
            return turns.Outcome.FINISHED
        return self._closed(plan, before, margin)

    def _apply(self, record: ChangeRecord) -> None:
        progress = self._progress
        if isinstance(record, DataChangeRecord):
            self._workers.log.debug(
                "record_received",
                partition_token=self._token,
                commit_timestamp=to_rfc3339(record.commit_timestamp),
                server_transaction_id=record.server_transaction_id,
                record_sequence=record.record_sequence,
            )
        progress.watermark = max(progress.watermark, watermark_after(record))
        progress.ended = progress.ended or ends_partition(self._token, record)
        self._workers.emit(RecordRead(self._token, self._generation, record))

    def _closed(self, plan: turns.QueryPlan, before: Nanos, margin: Nanos) -> turns.Outcome:
        workers, progress = self._workers, self._progress
        closed = turns.after_clean_close(
            plan,
            progress.watermark,
            progress.ended,
            before,
            workers.clocks.wall(),
            margin,
            self.config.end_timestamp,
        )
        if closed.proven is not None:
            progress.watermark = closed.proven
            workers.emit(RecordRead(self._token, self._generation, HeartbeatRecord(closed.proven)))
            workers.log.debug(
                "query_end_proven",
                partition_token=self._token,
                query_start_timestamp=to_rfc3339(plan.start),
                end_timestamp=to_rfc3339(closed.proven),
            )
        if closed.outcome is None:
            raise StreamEndedEarly(
                f"partition {self._token or '(initial)'} closed without its last record or progress"
            )
        if closed.wait:
            workers.stop.wait(closed.wait / NANOS_PER_SECOND)
        return closed.outcome


def _listened(
    records: Iterator[ChangeRecord], progress: Progress, monotonic: Callable[[], float]
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
