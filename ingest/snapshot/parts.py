"""Runs a snapshot as key ranges read in parallel by whatever runs a range's read (a Spark task),
with one committer: the calling thread.

Each table's ranges are fixed by one commit before any is read (``rules.snapshot_parts``). Then at
most ``tasks`` reads run at once; a read covers a range from just after its last landed key until
the range ends or the read has written its budget, and hands back what it wrote. The committer
lands each finished read with the range's new progress in one commit and starts the range's next
read (or the next range). A kill at any moment loses at most the reads in flight: their files are
in no commit, and their ranges are read again from their landed keys. A range once done is never
read again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Protocol

from ingest.model.snapshot import (
    Key,
    PartProgress,
    SnapshotChunk,
    SnapshotProgress,
    TableProgress,
)
from ingest.model.timestamps import Nanos
from ingest.rules.snapshot_parts import (
    SAMPLE_PER_PART,
    PartToRead,
    key_ranges,
    parts_to_read,
    parts_wanted,
    tables_to_split,
)
from ingest.snapshot.initial import reading_again
from ingest.snapshot.reach import ProgressReports
from runtime.logs import Logger


def _land_reads(
    reads: list[PartRead], progress: SnapshotProgress, sink: PartCommits, log: Logger
) -> SnapshotProgress:
    """Finished reads committed together with the progress they make."""
    for read in reads:
        progress = progress.part_advanced(
            read.table, read.index, read.rows, read.last_key, read.done
        )
    sink.commit_parts(reads, progress)
    for read in reads:
        log.info(
            "snapshot_part_landed",
            table=read.table,
            part=read.index,
            rows=read.rows,
            files=len(read.files),
            done=read.done,
        )
    return progress


@dataclass(frozen=True, slots=True)
class PartRead:
    """What one read of a range landed in files, not committed yet."""

    table: str
    index: int
    rows: int
    last_key: Key | None
    done: bool
    files: tuple[object, ...]
    """Whatever the committer commits (``SnapshotFile`` for Spark tasks)."""


ReadPart = Callable[[PartToRead], PartRead]
ReadRange = Callable[[Key | None, Key | None], Iterator[SnapshotChunk]]
"""(after key, end key) → the range's chunks in key order at T0, the last one done
(``reader.read_table`` of one table)."""
SampleKeys = Callable[[str, int], list[Key]]
"""(table, how many) → keys sampled at T0, in key order."""
CountRows = Callable[[str], int]


class PartCommits(Protocol):
    def commit_parts(self, reads: Sequence[PartRead], progress: SnapshotProgress) -> object:
        """Land what ``reads`` wrote with the progress they reach, in one commit (with a
        table's last range, whatever else the table's completion lands)."""
        ...


@dataclass(frozen=True, slots=True)
class PartSettings:
    tasks: int
    """Ranges read at once."""
    most_parts: int
    """Key ranges a large table is cut into."""
    part_rows: int = 100_000
    """Rows per range a table is cut into (``rules.snapshot_parts.parts_wanted``)."""
    progress_interval_s: float = 10.0
    expected_rows: int | None = None
    """The tables' rows at T0 (counted at start), for the projected end; None: not counted."""
    deadline: Nanos | None = None
    """By when the snapshot must be done (T0 plus what Spanner keeps)."""


def split_tables(
    progress: SnapshotProgress,
    count_rows: CountRows,
    sample_keys: SampleKeys,
    settings: PartSettings,
    commit: Callable[[SnapshotProgress], object],
    log: Logger,
) -> SnapshotProgress:
    """Fix the key ranges of every table not split yet, in one commit; a table read in part by
    the service (a landed key, no ranges) goes on as one range from that key."""
    tables = tables_to_split(progress)
    if not tables:
        return progress
    for name in tables:
        table = progress.table(name)
        ranges = _ranges(table, count_rows, sample_keys, settings)
        progress = progress.split(name, ranges)
        log.info("snapshot_table_split", table=name, parts=len(ranges))
    commit(progress)
    return progress


def _ranges(
    table: TableProgress, count_rows: CountRows, sample_keys: SampleKeys, settings: PartSettings
) -> tuple[PartProgress, ...]:
    if table.after_key is not None:
        return (PartProgress(table.after_key, None),)
    parts = parts_wanted(
        count_rows(table.table), settings.tasks, settings.most_parts, settings.part_rows
    )
    if parts == 1:
        return key_ranges([], 1)
    return key_ranges(sample_keys(table.table, parts * SAMPLE_PER_PART), parts)


def read_parts(
    progress: SnapshotProgress,
    read_part: ReadPart,
    sink: PartCommits,
    settings: PartSettings,
    log: Logger,
    stop: threading.Event,
    monotonic: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], Nanos] = time.time_ns,
) -> SnapshotProgress:
    """Read every range not done; the progress reached (complete unless stopped). A read's
    error stops the snapshot (Spark has retried its task); what landed stays. With each
    progress report, a rate that would end the snapshot past its deadline is an error event
    (``snapshot_outliving_retention``)."""
    reports = ProgressReports.of(settings, progress, log, monotonic, wall_clock)
    waiting = parts_to_read(progress)
    pool = ThreadPoolExecutor(settings.tasks, thread_name_prefix="snapshot-part")
    running: dict[Future[PartRead], PartToRead] = {}
    try:
        while (waiting or running) and not stop.is_set():
            while waiting and len(running) < settings.tasks:
                part = waiting.pop(0)
                log.info(
                    "snapshot_part_started",
                    table=part.table,
                    part=part.index,
                    rows_landed=part.part.rows,
                )
                running[pool.submit(read_part, part)] = part
            finished, _ = wait(list(running), timeout=0.2, return_when=FIRST_COMPLETED)
            if not finished:
                continue
            reads = [future.result() for future in finished]
            for future in finished:
                del running[future]
            progress = _land_reads(reads, progress, sink, log)
            waiting[:0] = [
                PartToRead(read.table, read.index, progress.table(read.table).parts[read.index])
                for read in reads
                if not read.done
            ][::-1]
            reports.after_commit(progress)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return progress


@dataclass(frozen=True, slots=True)
class RangeRead:
    rows: int
    last_key: Key | None
    done: bool


def read_range(
    read: ReadRange,
    part: PartProgress,
    write: Callable[[SnapshotChunk], None],
    budget_bytes: int,
) -> RangeRead:
    """What one task does: the range from just after its landed key, chunk by chunk into
    ``write``, until it ends or ``budget_bytes`` of rows are written (then the driver commits
    and starts the next read). A transient error reads again from the last chunk written, so
    nothing is written twice."""
    after, rows, size = part.resume_after, 0, 0
    for attempt in reading_again():
        with attempt:
            for chunk in read(after, part.end):
                write(chunk)
                rows += len(chunk.rows)
                size += sum(len(keys) + len(values) for keys, values in chunk.rows)
                after = chunk.last_key if chunk.last_key is not None else after
                if chunk.done:
                    return RangeRead(rows, after, True)
                if size >= budget_bytes:
                    return RangeRead(rows, after, False)
    raise RuntimeError("a range read ended without its last chunk")
