"""Runs a snapshot: a bounded pool of table readers feeding one committer.

Each worker streams one table at T0 in key order and hands chunks to a bounded queue, so the
product holds at most ``workers + queue`` chunks whatever the tables' sizes. The committer (the
calling thread, the job's only writer) lands every chunk with the progress it reaches in one Delta
commit. A kill at any moment leaves the table at a committed progress; the next process reads each
table again from just after its last landed key.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from google.api_core import exceptions as api_exceptions
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from ingest.changestream.retries import is_transient
from ingest.model.records import ColumnType, WatchedColumns
from ingest.model.snapshot import Key, SnapshotChunk, SnapshotProgress
from ingest.model.timestamps import Nanos
from ingest.snapshot.commits import SnapshotCommits
from ingest.snapshot.reach import ProgressReports
from runtime.logs import Logger

ReadTable = Callable[[str, tuple[ColumnType, ...], Nanos, Key | None], Iterator[SnapshotChunk]]
"""(table, columns, T0, after key) → the table's chunks in key order, the last one done."""
AbsentKeys = Callable[[str, Nanos, Iterable[str]], list[str]]
"""(table, T, keys read but not landed yet) → keys alive in the change log before T that the
snapshot did not find (``ingest.delta.absent_keys``)."""


@dataclass(frozen=True, slots=True)
class SnapshotSettings:
    workers: int = 4
    progress_interval_s: float = 10.0
    expected_rows: int | None = None
    """The tables' rows at T0 (counted at start), for the projected end; None: not counted."""
    deadline: Nanos | None = None
    """By when the snapshot must be done (T0 plus what Spanner keeps)."""


class _Stopped(Exception):
    pass


_LOST_TRANSACTION = ("Transaction not found", "Invalid transaction ID")


def worth_reading_again(error: BaseException) -> bool:
    """Transient errors, and a read whose single-use transaction the server lost: the emulator
    answers concurrent reads on one multiplexed session (the client's default) with NOT_FOUND
    "Transaction not found" or INVALID_ARGUMENT "Invalid transaction ID" (emulator/NOTES.md). A
    table is read again from its last key handed over, at the same timestamp, so nothing is lost
    or doubled."""
    return is_transient(error) or (
        isinstance(error, (api_exceptions.NotFound, api_exceptions.InvalidArgument))
        and any(text in str(error) for text in _LOST_TRANSACTION)
    )


def reading_again() -> Retrying:
    """A table's read retried from the last key handed over (``worth_reading_again``)."""
    return Retrying(
        retry=retry_if_exception(worth_reading_again),
        wait=wait_exponential_jitter(multiplier=0.1, max=10),
        stop=stop_after_attempt(8),
        reraise=True,
    )


class SnapshotReaders:
    """A bounded pool of table readers at one timestamp feeding one bounded queue.

    Each table is read from just after its last landed key; a transient error is retried from
    the last key handed over, any other error is handed to the committer (the initial snapshot
    stops the job, an on-demand one is abandoned).
    """

    def __init__(
        self,
        progress: SnapshotProgress,
        columns: WatchedColumns,
        read_table: ReadTable,
        workers: int,
        stop: threading.Event,
    ) -> None:
        self._chunks: queue.Queue[SnapshotChunk | BaseException] = queue.Queue(maxsize=workers)
        self._stop = stop
        self._halt = threading.Event()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="snapshot")
        for table in (t for t in progress.tables if not t.done):
            self._pool.submit(
                self._read,
                read_table,
                table.table,
                columns[table.table],
                progress.read_timestamp,
                table.after_key,
            )

    def _put(self, item: SnapshotChunk | BaseException) -> None:
        while not (self._stop.is_set() or self._halt.is_set()):
            try:
                self._chunks.put(item, timeout=0.2)
                return
            except queue.Full:
                continue
        raise _Stopped

    def _read(
        self,
        read_table: ReadTable,
        table: str,
        columns: tuple[ColumnType, ...],
        read_timestamp: Nanos,
        after: Key | None,
    ) -> None:
        try:
            for attempt in reading_again():
                with attempt:
                    for chunk in read_table(table, columns, read_timestamp, after):
                        self._put(chunk)
                        after = chunk.last_key if chunk.last_key is not None else after
        except _Stopped:
            return
        except BaseException as error:  # handed to the committer, which decides
            try:
                self._put(error)
            except _Stopped:
                return

    def ready(self) -> bool:
        return not self._chunks.empty()

    def get(self, timeout: float) -> list[SnapshotChunk]:
        """The chunks ready now, waiting up to ``timeout`` for the first; a reader's error is
        raised here, in the committer."""
        try:
            batch = [
                self._chunks.get(timeout=timeout) if timeout > 0 else self._chunks.get_nowait()
            ]
        except queue.Empty:
            return []
        batch += _drain(self._chunks)
        errors = [b for b in batch if isinstance(b, BaseException)]
        if errors:
            raise errors[0]
        return [b for b in batch if isinstance(b, SnapshotChunk)]

    def close(self) -> None:
        self._halt.set()
        self._pool.shutdown(wait=True)


def run_snapshot(
    sink: SnapshotCommits,
    progress: SnapshotProgress,
    columns: WatchedColumns,
    read_table: ReadTable,
    settings: SnapshotSettings,
    log: Logger,
    stop: threading.Event,
    on_tick: Callable[[], None] = lambda: None,
    on_commit: Callable[[], None] = lambda: None,
    monotonic: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], Nanos] = time.time_ns,
    absent_keys: AbsentKeys | None = None,
) -> SnapshotProgress:
    """Land every table not done yet; the progress reached (complete unless stopped). On a
    change log that already holds the tables' rows (an earlier job's, or its abandoned
    snapshot's), ``absent_keys`` names the keys alive before T0 that the snapshot did not find:
    they land as deletes at T0 with the table's last chunk, so no row of an earlier job outlives
    the new one's snapshot. With
    each progress report, a rate that would end the snapshot past its deadline is an error
    event (``snapshot_outliving_retention``) while there is still time to act."""
    reports = ProgressReports.of(settings, progress, log, monotonic, wall_clock)
    readers = SnapshotReaders(progress, columns, read_table, settings.workers, stop)
    try:
        while not progress.complete and not stop.is_set():
            on_tick()
            landed = readers.get(timeout=0.2)
            if not landed:
                continue
            if absent_keys is not None:
                landed = [_with_absent_keys(c, landed, progress, absent_keys) for c in landed]
            for chunk in landed:
                progress = progress.advanced(chunk)
            sink.commit_snapshot(landed, progress)
            on_commit()
            reports.after_commit(progress)
    finally:
        readers.close()
    return progress


def _with_absent_keys(
    chunk: SnapshotChunk,
    chunks: list[SnapshotChunk],
    progress: SnapshotProgress,
    absent_keys: AbsentKeys,
) -> SnapshotChunk:
    if not chunk.done:
        return chunk
    found = [k for c in chunks if c.table == chunk.table for k, _ in c.rows]
    deleted = absent_keys(chunk.table, progress.read_timestamp, found)
    return replace(chunk, deleted_keys=tuple(deleted))


def _drain(
    chunks: queue.Queue[SnapshotChunk | BaseException],
) -> list[SnapshotChunk | BaseException]:
    drained: list[SnapshotChunk | BaseException] = []
    while True:
        try:
            drained.append(chunks.get_nowait())
        except queue.Empty:
            return drained
