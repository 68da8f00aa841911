"""The flush policy between the reader and the sink: when released transactions, checkpoints and
schema rows are committed."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ingest.delta.landing import ChangeLogLanding
from ingest.model.records import Transaction, WatchedColumns
from ingest.model.resume import Release, ResumePoint
from ingest.model.snapshot import SnapshotChunk
from ingest.model.timestamps import Nanos


class Riders(Protocol):
    """Work that rides on the stream's commits (an on-demand table snapshot)."""

    def due(self) -> bool: ...

    def backfill(self, tables: Sequence[str]) -> bool: ...

    def recorded(self) -> tuple[str, ...]: ...

    def before_commit(
        self, low_watermark: Nanos, transactions: Sequence[Transaction]
    ) -> tuple[list[SnapshotChunk], bool]: ...

    def after_commit(self) -> None: ...


@dataclass
class Batcher:
    """Flush policy: commit released transactions within ``flush_latency`` or ``max_rows``;
    with nothing to land, still commit the checkpoint every ``checkpoint_interval`` so a restart
    never re-reads more than that much of the stream (and the writer lease stays fresh).

    Once the landing's watched-columns poll is due, the next commit that is due anyway reads the
    watched columns at its own low watermark; tables whose columns differ from what this process
    landed last get schema rows in that commit. Schema rows never force a commit of their own: a new
    job's first data commit stays one flush latency after its start commit, and a drop reaches the
    change log within the poll's interval plus ``checkpoint_interval``.
    """

    landing: ChangeLogLanding
    flush_latency_s: float
    max_rows: int
    checkpoint_interval_s: float
    monotonic: Callable[[], float] = time.monotonic
    riders: Riders | None = None
    on_commit: Callable[[list[Transaction], Nanos], None] | None = None
    """Told of each commit's transactions and low watermark (the service's metrics)."""
    pending: list[Transaction] = field(default_factory=list)
    pending_rows: int = 0
    pending_since: float | None = None
    resume_point: ResumePoint | None = None
    committed_watermark: Nanos | None = None
    last_commit_at: float = 0.0
    commits: int = 0

    def on_release(self, release: Release) -> None:
        self.resume_point = release.resume_point
        if release.transactions:
            if self.pending_since is None:
                self.pending_since = self.monotonic()
            self.pending.extend(release.transactions)
            self.pending_rows += sum(t.mod_count for t in release.transactions)
        if self.pending_rows >= self.max_rows:
            self.flush()

    def on_tick(self) -> None:
        now = self.monotonic()
        batch_due = (
            self.pending_since is not None and now - self.pending_since >= self.flush_latency_s
        )
        checkpoint_due = now - self.last_commit_at >= self.checkpoint_interval_s
        riders_due = self.riders is not None and self.riders.due()
        if batch_due or checkpoint_due or riders_due:
            self.flush(self._watched_changes(now))

    def _watched_changes(self, now: float) -> WatchedColumns:
        point = self.resume_point
        if point is None:
            return {}
        return self.landing.watched.changes(point.low_watermark, now)

    def flush(self, watched: WatchedColumns | None = None) -> None:
        point = self.resume_point
        if point is None:
            return
        riders = self.riders
        gained = (
            self.landing.watched.gained_columns(watched or {}, point.low_watermark)
            if riders is not None
            else ()
        )
        asked = bool(gained) and riders is not None and riders.backfill(gained)
        if gained and not asked:
            watched = self._held_back(watched or {}, gained, "a table snapshot runs")
        chunks, riders_due = (
            riders.before_commit(point.low_watermark, self.pending) if riders else ([], False)
        )
        if asked and riders is not None:
            if riders.recorded() == gained:
                self.landing.log.info("column_backfill_recorded", tables=list(gained))
            else:
                watched = self._held_back(watched or {}, gained, "the request was not recorded")
        if (
            not self.pending
            and not watched
            and not riders_due
            and point.low_watermark == self.committed_watermark
        ):
            return
        result = self.landing.sink.commit(self.pending, point, watched, snapshot=chunks)
        if self.riders is not None:
            self.riders.after_commit()
        if self.on_commit is not None:
            self.on_commit(self.pending, point.low_watermark)
        snapshot_rows = sum(len(c.rows) + len(c.deleted_keys) for c in chunks)
        self.landing.landed(result, watched or {}, point.low_watermark, snapshot_rows)
        self.pending, self.pending_rows, self.pending_since = [], 0, None
        self.landed(point.low_watermark)

    def _held_back(
        self, watched: WatchedColumns, gained: tuple[str, ...], why: str
    ) -> WatchedColumns:
        """The schema rows of tables that gained a column land with the snapshot that reads
        them again, never before it: held back, the next poll finds them again (a crash between
        the two would leave the column's values unread for good)."""
        self.landing.log.warning("column_backfill_waiting", tables=list(gained), reason=why)
        return {t: c for t, c in watched.items() if t not in gained}

    def landed(self, low_watermark: Nanos) -> None:
        """A commit up to ``low_watermark`` landed: the next checkpoint-only commit is due one
        interval from now."""
        self.committed_watermark = low_watermark
        self.last_commit_at = self.monotonic()
        self.commits += 1
