"""The snapshot's rules without I/O: progress, its place in the checkpoint, and exactly once
through crashes at any commit (fake tables and sink; the emulator test runs the real ones)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.contract.changelog import Checkpoint, from_json, to_json
from ingest.model.records import ColumnType
from ingest.model.resume import start_point
from ingest.model.snapshot import Key, SnapshotChunk, SnapshotProgress
from ingest.model.timestamps import NANOS_PER_SECOND, parse_rfc3339
from ingest.snapshot.initial import SnapshotSettings, run_snapshot
from ingest.snapshot.reach import (
    Retention,
    SnapshotOutOfReach,
    check_fits_retention,
    check_reachable,
)
from tests.builders import captured_logger

T0 = parse_rfc3339("2026-11-23T10:00:00.123456789Z")
ID = ColumnType("id", {"code": "INT64"}, True, 1)


class Crash(Exception):
    pass


@dataclass
class FakeSink:
    crash_at: int | None = None
    commits: list[tuple[list[SnapshotChunk], SnapshotProgress]] = field(default_factory=list)

    def commit_snapshot(self, chunks: list[SnapshotChunk], progress: SnapshotProgress) -> None:
        if self.crash_at is not None and len(self.commits) == self.crash_at:
            raise Crash
        self.commits.append((list(chunks), progress))


def reader(tables: dict[str, int], chunk_rows: int):
    def read(
        table: str, columns, read_timestamp: int, after: Key | None
    ) -> Iterator[SnapshotChunk]:
        assert read_timestamp == T0
        first = 0 if after is None else int(after[0]) + 1
        rows: list[tuple[str, str]] = []
        last: Key | None = after
        for number in range(first, tables[table]):
            rows.append((f'{{"id":"{number}"}}', "{}"))
            last = (str(number),)
            if len(rows) == chunk_rows:
                yield SnapshotChunk(table, (ID,), rows, last, done=False)
                rows = []
        yield SnapshotChunk(table, (ID,), rows, last, done=True)

    return read


def landed(sink: FakeSink) -> list[tuple[str, str]]:
    return [(c.table, keys) for chunks, _ in sink.commits for c in chunks for keys, _ in c.rows]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=4),
    chunk_rows=st.integers(1, 7),
    workers=st.integers(1, 3),
    crashes=st.lists(st.integers(0, 6), max_size=4),
)
def test_every_row_lands_once_through_crashes_at_any_commit(
    sizes: list[int], chunk_rows: int, workers: int, crashes: list[int]
) -> None:
    tables = {f"t{n}": size for n, size in enumerate(sizes)}
    progress = SnapshotProgress.begin(T0, list(tables))
    read = reader(tables, chunk_rows)
    rows: list[tuple[str, str]] = []
    for crash_at in [*crashes, None]:
        sink = FakeSink(crash_at)
        with contextlib.suppress(Crash):
            progress = run_snapshot(
                sink,  # type: ignore[arg-type]
                progress,
                {t: (ID,) for t in tables},
                read,
                SnapshotSettings(workers=workers),
                structlog.get_logger(),
                threading.Event(),
            )
        rows += landed(sink)
        if sink.commits:
            progress = sink.commits[-1][1]
        if progress.complete:
            break
    expected = [(t, f'{{"id":"{n}"}}') for t, size in tables.items() for n in range(size)]
    assert progress.complete
    assert sorted(rows) == sorted(expected), "each row once, none lost"
    assert {t.table: t.rows for t in progress.tables} == tables


def test_a_failing_table_read_stops_the_snapshot_with_its_error() -> None:
    def read(
        table: str, columns, read_timestamp: int, after: Key | None
    ) -> Iterator[SnapshotChunk]:
        if table == "bad":
            raise PermissionError("no read permission on table bad")
        yield SnapshotChunk(table, (ID,), [], None, done=True)

    with pytest.raises(PermissionError, match="bad"):
        run_snapshot(
            FakeSink(),  # type: ignore[arg-type]
            SnapshotProgress.begin(T0, ["bad", "good"]),
            {"bad": (ID,), "good": (ID,)},
            read,
            SnapshotSettings(workers=2),
            structlog.get_logger(),
            threading.Event(),
        )


def test_the_checkpoint_carries_the_snapshot_and_says_when_w_is_consistent() -> None:
    progress = SnapshotProgress.begin(T0, ["b", "a"])
    chunk = SnapshotChunk("a", (ID,), [('{"id":"1"}', "{}")], ("1",), done=False)
    progress = progress.advanced(chunk)
    checkpoint = Checkpoint("job", 2, "owner", T0, start_point(T0 + 1), T0 + 1, progress)
    again = from_json(to_json(checkpoint))
    assert again == checkpoint
    assert not again.consistent
    assert [t.table for t in progress.tables] == ["a", "b"]
    done = progress.advanced(SnapshotChunk("a", (ID,), [], ("1",), done=True)).advanced(
        SnapshotChunk("b", (ID,), [], None, done=True)
    )
    assert from_json(to_json(Checkpoint("job", 3, "o", T0, start_point(T0 + 1), T0 + 1, done)))
    assert Checkpoint("job", 3, "o", T0, start_point(T0 + 1), T0 + 1, done).consistent
    assert done.rows == 1


def test_a_snapshot_older_than_the_version_retention_is_refused() -> None:
    hour = 3600 * NANOS_PER_SECOND
    assert check_reachable(T0, T0 + hour - 1, hour) == T0 + hour
    with pytest.raises(SnapshotOutOfReach, match="version_retention_period"):
        check_reachable(T0, T0 + hour, hour)


def test_a_snapshot_expected_to_outlive_retention_is_refused_naming_both_figures() -> None:
    hour = 3600 * NANOS_PER_SECOND
    day = 24 * hour
    fits = Retention(version_retention=7 * day, stream_retention=day)
    assert check_fits_retention(T0, 36_000_000, 20_000, fits) == T0 + hour // 2
    with pytest.raises(SnapshotOutOfReach) as refused:
        check_fits_retention(T0, 144_000_000, 20_000, Retention(hour, day))
    line = str(refused.value)
    assert "\n" not in line
    for figure in ("144,000,000 rows", "2.0 h", "20,000 rows/s", "versions for 1.0 h", "4.0 h"):
        assert figure in line, figure
    assert "change stream keeps changes for 24.0 h" in line and "version_retention_period" in line
    with pytest.raises(SnapshotOutOfReach, match=r"change stream keeps changes for 20\.0 min"):
        check_fits_retention(T0, 36_000_000, 20_000, Retention(7 * day, hour // 3))  # 30 min


def test_a_rate_that_ends_past_the_deadline_is_an_error_while_the_snapshot_runs() -> None:
    tables = {"t0": 30}
    log, events = captured_logger()
    clock = iter(range(0, 10**6))
    settings = SnapshotSettings(
        workers=1, progress_interval_s=0, expected_rows=1_000_000, deadline=T0 + NANOS_PER_SECOND
    )
    run_snapshot(
        FakeSink(),  # type: ignore[arg-type]
        SnapshotProgress.begin(T0, list(tables)),
        {"t0": (ID,)},
        reader(tables, 10),
        settings,
        log,
        threading.Event(),
        monotonic=lambda: float(next(clock)),
        wall_clock=lambda: T0,
    )
    warned = [e for e in events if e["event"] == "snapshot_outliving_retention"]
    assert warned and warned[0]["log_level"] == "error" and warned[0]["expected_rows"] == 1_000_000
