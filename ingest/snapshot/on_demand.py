"""On-demand snapshots of some tables while the stream runs (``POST /snapshot`` on the health
port, or ``python -m ingest snapshot-table``).

For a table added to the change stream later, or a mirror that must be rebuilt. The request is
recorded in the next commit, whose low watermark W becomes the snapshot's read timestamp T1:
everything committed up to T1 has landed, and every change after T1 lands after it. The tables
are read at exactly T1 by a bounded pool of readers, and each commit of the stream takes the
chunks that are ready, with the progress in its checkpoint, so a kill -9 resumes from the last
landed key. Snapshot rows sort at T1 and apply only over older changes of their key. With a
table's last chunk the keys the change log holds alive but the snapshot did not find land as
deletes at T1, so the table's mirror afterwards equals Spanner at W.

A key the stream deleted after T1, before the snapshot reached it, has its image at T1 left out:
landed after the delete, it would bring the row back wherever the delete is no longer
remembered (the pipeline's tombstones expire). So correctness does not depend on how long the
snapshot takes. Memory: the keys of the snapshotted tables deleted while it runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from ingest.contract.changelog import DELETE
from ingest.model.encoding import canonical_json
from ingest.model.records import Transaction, WatchedColumns
from ingest.model.snapshot import SnapshotChunk, SnapshotProgress
from ingest.model.timestamps import Nanos, to_rfc3339
from ingest.snapshot.commits import SnapshotCommits
from ingest.snapshot.initial import AbsentKeys, ReadTable, SnapshotReaders
from ingest.snapshot.reach import SnapshotOutOfReach, check_reachable, report
from runtime.logs import Logger

DeletedAfter = Callable[[str, Nanos], set[str]]
"""(table, T1) → keys the change log has deleted after T1 (``absent_keys.deleted_after``)."""


@dataclass
class _Request:
    tables: tuple[str, ...]
    answered: threading.Event = field(default_factory=threading.Event)
    status: int = 0
    body: dict[str, object] = field(default_factory=dict)

    def answer(self, status: int, body: dict[str, object]) -> None:
        self.status, self.body = status, body
        self.answered.set()


class TableSnapshots:
    """The running on-demand snapshot, driven by the batcher around each of its commits."""

    def __init__(
        self,
        sink: SnapshotCommits,
        read_table: ReadTable,
        watched_columns: Callable[[Nanos], WatchedColumns],
        absent_keys: AbsentKeys,
        deleted_after: DeletedAfter,
        version_retention: Callable[[], Nanos],
        workers: int,
        log: Logger,
        stop: threading.Event,
        wall_clock: Callable[[], Nanos] = time.time_ns,
        monotonic: Callable[[], float] = time.monotonic,
        progress_interval_s: float = 10.0,
    ) -> None:
        self._sink = sink
        self._read_table = read_table
        self._watched_columns = watched_columns
        self._absent_keys = absent_keys
        self._deleted_after = deleted_after
        self._deleted_since: dict[str, set[str]] = {}
        """Per table being read, the keys the stream deleted after T1."""
        self._left_out = 0
        self._version_retention = version_retention
        self._workers = workers
        self._log = log
        self._stop = stop
        self._wall_clock = wall_clock
        self._monotonic = monotonic
        self._progress_interval_s = progress_interval_s
        self._lock = threading.Lock()
        self._request: _Request | None = None
        self._recording: _Request | None = None
        self._columns: WatchedColumns = {}
        self._readers: SnapshotReaders | None = None
        self._deleted = 0
        self._started = self._last_report = monotonic()
        self._rows_before = 0

    @property
    def running(self) -> SnapshotProgress | None:
        return self._sink.table_snapshot

    def resume(self) -> None:
        """Go on with a snapshot the previous process did not finish, from its landed keys;
        abandoned once its T1 is older than the database keeps versions."""
        progress = self.running
        if progress is None:
            return
        if progress.complete:
            self._sink.track_table_snapshot(None)
            return
        try:
            deadline = check_reachable(
                progress.read_timestamp, self._wall_clock(), self._version_retention()
            )
        except SnapshotOutOfReach as error:
            self._abandon(progress, error)
            return
        watched = self._watched_columns(progress.read_timestamp)
        self._start(progress, watched, "table_snapshot_resumed", deadline)
        self._deleted_since = {
            t.table: self._deleted_after(t.table, progress.read_timestamp)
            for t in progress.tables
            if not t.done
        }

    def request(
        self, tables: Iterable[str], timeout_s: float = 60.0
    ) -> tuple[int, dict[str, object]]:
        """Ask for a snapshot of ``tables``; answered once the commit that records it has
        landed (202 with T1), or refused (400 unknown table, 409 one is running)."""
        names = tuple(sorted(set(tables)))
        if not names:
            return 400, {"error": "name at least one table (?table=name)"}
        with self._lock:
            running = self.running
            if self._request is not None or self._recording is not None or running is not None:
                return 409, {
                    "error": "a table snapshot is running; ask again once it is done",
                    "tables": running.table_names if running else None,
                }
            request = self._request = _Request(names)
        if not request.answered.wait(timeout_s):
            return 504, {
                "error": "not recorded yet: the stream has not committed since the "
                "request; it runs once the next commit lands"
            }
        return request.status, request.body

    def backfill(self, tables: Sequence[str]) -> bool:
        """Ask, without waiting, for a snapshot of ``tables`` recorded by the commit about to be
        made (columns Spanner filled without change records: ``WatchedColumnsPoll``); False
        while another one is asked for or runs."""
        with self._lock:
            if self._request is not None or self._recording is not None or self.running:
                return False
            self._request = _Request(tuple(sorted(set(tables))))
        return True

    def recorded(self) -> tuple[str, ...]:
        """The tables whose snapshot the commit about to be made records (after
        ``before_commit``); () when it records none."""
        return () if self._recording is None else self._recording.tables

    def due(self) -> bool:
        """Whether the batcher should commit now for the snapshot's sake."""
        return self._request is not None or (self._readers is not None and self._readers.ready())

    def before_commit(
        self, low_watermark: Nanos, transactions: Sequence[Transaction]
    ) -> tuple[list[SnapshotChunk], bool]:
        """The chunks this commit lands with ``transactions``, and whether it must be made even
        with nothing else to land (it records a request or carries chunks)."""
        with self._lock:
            request, self._request = self._request, None
        recording = request is not None and self._begin(request, low_watermark)
        progress = self.running
        if self._readers is None or progress is None:
            return [], recording
        try:
            chunks = self._readers.get(timeout=0)
        except Exception as error:  # a table dropped meanwhile, retries spent: the stream goes on
            self._abandon(progress, error)
            return [], True
        self._note_deletes(transactions)
        landed = []
        for chunk in chunks:
            deleted_since = self._deleted_since.get(chunk.table, set())
            if chunk.done:
                found = [k for c in chunks if c.table == chunk.table for k, _ in c.rows]
                # A key deleted after T1 may have been read at T1 and left out: not absent.
                found += deleted_since
                deleted = self._absent_keys(chunk.table, progress.read_timestamp, found)
                chunk = replace(chunk, deleted_keys=tuple(deleted))
                self._deleted += len(deleted)
            kept = [row for row in chunk.rows if row[0] not in deleted_since]
            self._left_out += len(chunk.rows) - len(kept)
            chunk = replace(chunk, rows=kept)
            if chunk.done:
                self._deleted_since.pop(chunk.table, None)
            progress = progress.advanced(chunk)
            landed.append(chunk)
        self._sink.track_table_snapshot(progress)
        return landed, recording or bool(landed)

    def _note_deletes(self, transactions: Sequence[Transaction]) -> None:
        for transaction in transactions:
            for record in transaction.records:
                keys = self._deleted_since.get(record.table_name)
                if keys is not None and record.mod_type == DELETE:
                    keys.update(canonical_json(mod.keys) for mod in record.mods)

    def after_commit(self) -> None:
        """Answer a request the commit recorded and start its readers; finish a snapshot whose
        last table the commit landed."""
        progress = self.running
        request, self._recording = self._recording, None
        if request is not None and progress is not None:
            self._start(progress, self._columns, "table_snapshot_started", None)
            request.answer(
                202,
                {
                    "read_timestamp": to_rfc3339(progress.read_timestamp),
                    "tables": list(request.tables),
                },
            )
        if progress is None or self._readers is None:
            return
        now = self._monotonic()
        if progress.complete or now - self._last_report >= self._progress_interval_s:
            self._last_report = now
            report(
                self._log,
                "table_snapshot_progress",
                progress,
                progress.rows - self._rows_before,
                now - self._started,
            )
        if progress.complete:
            self._log.info(
                "table_snapshot_done",
                read_timestamp=to_rfc3339(progress.read_timestamp),
                tables=progress.table_names,
                rows=progress.rows,
                deleted=self._deleted,
                left_out_deleted_after=self._left_out,
            )
            self.close()
            self._sink.track_table_snapshot(None)

    def close(self) -> None:
        if self._readers is not None:
            self._readers.close()
            self._readers = None

    def _abandon(self, progress: SnapshotProgress, error: Exception) -> None:
        """An on-demand snapshot that cannot finish must not stop the stream (a restart would
        meet the same error forever): the next commit records that none runs. Its landed rows
        are images at T1 and stay; the tables can be asked for again."""
        self._log.error(
            "table_snapshot_abandoned",
            read_timestamp=to_rfc3339(progress.read_timestamp),
            tables=progress.table_names,
            rows=progress.rows,
            cause=f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}",
        )
        self.close()
        self._sink.track_table_snapshot(None)

    def _begin(self, request: _Request, low_watermark: Nanos) -> bool:
        """T1 = the low watermark of the commit about to record the request."""
        try:
            watched = self._watched_columns(low_watermark)
        except Exception as error:  # answered, not fatal: the stream goes on
            request.answer(503, {"error": f"captured tables unreadable: {type(error).__name__}"})
            return False
        unknown = [t for t in request.tables if t not in watched]
        if unknown:
            request.answer(
                400,
                {
                    "error": "not captured by the change stream",
                    "tables": unknown,
                    "captured": sorted(watched),
                },
            )
            return False
        self._columns = {t: watched[t] for t in request.tables}
        self._sink.track_table_snapshot(SnapshotProgress.begin(low_watermark, list(request.tables)))
        self._recording = request
        return True

    def _start(
        self,
        progress: SnapshotProgress,
        watched: WatchedColumns,
        event: str,
        deadline: Nanos | None,
    ) -> None:
        self._columns = {t: watched[t] for t in progress.table_names}
        self._deleted_since = {t.table: set() for t in progress.tables if not t.done}
        self._deleted = self._left_out = 0
        self._started = self._last_report = self._monotonic()
        self._rows_before = progress.rows
        self._readers = SnapshotReaders(
            progress, self._columns, self._read_table, self._workers, self._stop
        )
        self._log.info(
            event,
            read_timestamp=to_rfc3339(progress.read_timestamp),
            tables=progress.table_names,
            rows=progress.rows,
            **({"deadline": to_rfc3339(deadline)} if deadline is not None else {}),
        )
