"""Turns: which partitions are read at once, and what each query of a turn reads (contract 2).

At most ``max_concurrent`` partitions are read at once. Partitions waiting for a turn get one
lowest watermark first: the lowest holds the low watermark back the longest. Over the memory
budget only partitions at or below the low watermark get one; the others would only wait in it.
While partitions wait, a turn reads its partition up to what has settled and hands it back, and
a tailing turn hands its partition back at its next record; otherwise a turn tails its partition
in windows. So threads, sockets and buffers stay bounded with any number of partitions and the
low watermark still advances.

Pure and single-threaded: the threaded reader applies these rules, and so can a reader without
threads.
"""

from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass

from ingest.model.timestamps import Nanos


class Outcome(enum.Enum):
    """How a turn's query ended."""

    FINISHED = "finished"
    """The partition sent its last record, or reached the reader's end timestamp."""
    WINDOW_CLOSED = "window closed"
    """The query reached its end timestamp, the partition living on."""
    HANDED_BACK = "handed back"
    """The turn stopped reading so that a partition waiting for a turn gets one."""


class Turns:
    """Who is in a turn and who waits for one; a heap of waiting partitions by watermark."""

    def __init__(self, max_concurrent: int) -> None:
        self.max_concurrent = max_concurrent
        self.started = 0
        """Turns granted so far."""
        self.cycling = False
        """More partitions live than turns: they take turns (as of ``cycling_changed``)."""
        self._waiting: list[tuple[Nanos, str]] = []
        self._in_turn: set[str] = set()

    @property
    def in_turn(self) -> int:
        return len(self._in_turn)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def wait(self, token: str, watermark: Nanos) -> None:
        """A partition ready to be read (new, or its turn handed back) waits for a turn."""
        heapq.heappush(self._waiting, (watermark, token))

    def ended(self, token: str) -> None:
        """Its turn ended: the partition finished, failed or was handed back."""
        self._in_turn.discard(token)

    def handed_back(self, token: str, watermark: Nanos) -> None:
        self.ended(token)
        self.wait(token, watermark)

    def grant(self, limit: Nanos | None) -> list[str]:
        """Free turns to waiting partitions, lowest watermark first; with a ``limit`` (over the
        memory budget: the low watermark) only to partitions at or below it."""
        granted = []
        while len(self._in_turn) < self.max_concurrent and self.wanted(limit):
            _, token = heapq.heappop(self._waiting)
            self._in_turn.add(token)
            self.started += 1
            granted.append(token)
        return granted

    def wanted(self, limit: Nanos | None) -> bool:
        """A partition that may have a turn waits for one: reading turns should hand theirs
        back."""
        return bool(self._waiting) and (limit is None or self._waiting[0][0] <= limit)

    def cycling_changed(self) -> bool:
        """Whether partitions started or stopped taking turns since the last call."""
        cycling = len(self._in_turn) + len(self._waiting) > self.max_concurrent
        changed = cycling != self.cycling
        self.cycling = cycling
        return changed


@dataclass(frozen=True, slots=True)
class QueryPlan:
    start: Nanos
    end: Nanos
    settled: Nanos
    """What had settled when the query began: a clean close proves its end only up to here."""
    catching_up: bool
    """Partitions wait for a turn: the query reads up to what has settled, then hands back."""


def wait_to_settle(query_start: Nanos, now: Nanos, margin: Nanos, turn_wanted: bool) -> Nanos:
    """How long a turn waits before its query: while others wait for a turn, a partition
    fresher than what has settled waits until there is something to catch up on, rather than
    tail until its next heartbeat (every waiting partition is fresher still). 0: query now."""
    if turn_wanted and now - margin <= query_start:
        return query_start - now + margin + 1
    return 0


def plan_query(
    query_start: Nanos,
    now: Nanos,
    margin: Nanos,
    window: Nanos,
    end_timestamp: Nanos | None,
    turn_wanted: bool,
) -> QueryPlan:
    """One bounded query: up to what has settled while partitions wait for a turn, else a
    tailing window; never past the reader's end timestamp."""
    settled = now - margin
    catching_up = turn_wanted and query_start < settled
    window_end = settled if catching_up else max(now, query_start) + window
    end = window_end if end_timestamp is None else min(end_timestamp, window_end)
    return QueryPlan(query_start, end, settled, catching_up)


def hands_back(
    plan: QueryPlan, ended: bool, turn_wanted: bool, watermark: Nanos, before: Nanos
) -> bool:
    """A tailing turn hands its partition back at a record that moved it on, once a partition
    waits for a turn; a catching-up one reads to its end first."""
    return not (plan.catching_up or ended) and turn_wanted and watermark > before


@dataclass(frozen=True, slots=True)
class Closed:
    """What a query that closed cleanly (no error, not handed back) leaves behind."""

    proven: Nanos | None
    """The partition's watermark the close proves, when it moves it on (applied as a
    heartbeat at it)."""
    outcome: Outcome | None
    """None: the partition closed before its last record without progress, an error."""
    wait: Nanos = 0
    """Before the next query: its end passed but had not settled when the query began."""


def after_clean_close(
    plan: QueryPlan,
    watermark: Nanos,
    ended: bool,
    before: Nanos,
    now: Nanos,
    margin: Nanos,
    end_timestamp: Nanos | None,
) -> Closed:
    """A clean close delivered every record up to its end, as a heartbeat at it would; trusted
    only up to what had settled when the query began (a catching-up query: all of it; such a
    query often returns no record at all)."""
    proven = None
    if not ended and watermark < min(plan.end, plan.settled):
        proven = watermark = min(plan.end, plan.settled)
    if ended or (end_timestamp is not None and watermark >= end_timestamp):
        return Closed(proven, Outcome.FINISHED)
    if watermark > before:
        return Closed(proven, Outcome.WINDOW_CLOSED)
    if plan.end <= now:
        return Closed(proven, Outcome.WINDOW_CLOSED, plan.end + margin - now)
    return Closed(proven, None)
