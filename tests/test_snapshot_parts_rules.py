"""The parallel snapshot's rules without I/O: key ranges cut at a sample hold every key once, and a
snapshot read in ranges by several tasks lands every row once through crashes at any commit,
never reading a finished range again (fake tables, tasks and sink; the Spark test runs the real
ones)."""

from __future__ import annotations

import bisect
import itertools
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.contract.changelog import Checkpoint, from_json, to_json
from ingest.model.resume import start_point
from ingest.model.snapshot import Key, PartProgress, SnapshotChunk, SnapshotProgress
from ingest.model.timestamps import parse_rfc3339
from ingest.rules.snapshot_parts import PartToRead, key_ranges, parts_wanted
from ingest.snapshot.parts import PartRead, PartSettings, read_parts, split_tables

T0 = parse_rfc3339("2026-11-25T10:00:00.123456789Z")


def contains(part: PartProgress, key: int) -> bool:
    after = part.start_after[0] if part.start_after is not None else None
    end = part.end[0] if part.end is not None else None
    return (after is None or key > after) and (end is None or key <= end)


@given(
    keys=st.lists(st.integers(-1000, 1000), unique=True, max_size=200).map(sorted),
    sample_every=st.integers(1, 5),
    parts=st.integers(1, 40),
)
def test_key_ranges_cut_at_a_sample_hold_every_key_once(
    keys: list[int], sample_every: int, parts: int
) -> None:
    sample: list[Key] = [(k,) for k in keys[::sample_every]]
    ranges = key_ranges(sample, parts)
    assert 1 <= len(ranges) <= parts
    assert ranges[0].start_after is None and ranges[-1].end is None
    for key in [*keys, -2000, 2000]:
        assert sum(contains(r, key) for r in ranges) == 1
    assert all(a.end == b.start_after for a, b in itertools.pairwise(ranges))


def test_a_table_is_cut_by_size_into_one_range_per_task_at_least_and_never_too_small() -> None:
    assert parts_wanted(0, 4, 64, 100_000) == 1
    assert parts_wanted(19_999, 4, 64, 100_000) == 1
    assert parts_wanted(25_000, 4, 64, 100_000) == 2
    assert parts_wanted(200_000, 4, 64, 100_000) == 4
    assert parts_wanted(1_000_000, 4, 64, 100_000) == 10
    assert parts_wanted(10**9, 4, 64, 100_000) == 64


class Crash(Exception):
    pass


@dataclass
class Tables:
    """Tables of integer keys; records every read of a range and every landed row."""

    rows: dict[str, list[int]]
    budget: int
    reads: list[tuple[str, int, bool]] = field(default_factory=list)
    """(table, range, whether the range was done in the last commit) per read started."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, table: str) -> int:
        return len(self.rows[table])

    def sample(self, table: str, size: int) -> list[Key]:
        keys = self.rows[table]
        step = max(1, len(keys) // max(1, size))
        return [(k,) for k in keys[::step]]

    def read(self, sink: FakeSink, part: PartToRead) -> PartRead:
        with self.lock:
            landed = sink.progress.table(part.table).parts[part.index] if sink.progress else None
            self.reads.append((part.table, part.index, bool(landed and landed.done)))
        keys = self.rows[part.table]
        after = part.part.resume_after
        first = 0 if after is None else bisect.bisect_right(keys, after[0])
        end = part.part.end
        last = len(keys) if end is None else bisect.bisect_right(keys, end[0])
        chosen = keys[first : min(last, first + self.budget)]
        done = first + len(chosen) >= last
        return PartRead(
            part.table,
            part.index,
            len(chosen),
            (chosen[-1],) if chosen else None,
            done,
            tuple((part.table, k) for k in chosen),
        )


@dataclass
class FakeSink:
    crash_at: int | None = None
    commits: int = 0
    landed: list[object] = field(default_factory=list)
    progress: SnapshotProgress | None = None

    def commit(self, progress: SnapshotProgress, files: Sequence[object] = ()) -> None:
        if self.crash_at is not None and self.commits == self.crash_at:
            raise Crash
        self.commits += 1
        checkpoint = Checkpoint("job", self.commits, "o", T0, start_point(T0 + 1), T0 + 1, progress)
        stored = from_json(to_json(checkpoint)).snapshot
        assert stored == progress
        self.progress = stored
        self.landed.extend(files)

    def commit_parts(self, reads: Sequence[PartRead], progress: SnapshotProgress) -> None:
        self.commit(progress, [f for r in reads for f in r.files])


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 120), min_size=1, max_size=3),
    most_parts=st.integers(1, 6),
    tasks=st.integers(1, 3),
    budget=st.integers(1, 50),
    crashes=st.lists(st.integers(0, 8), max_size=4),
)
def test_every_row_lands_once_and_no_finished_range_is_read_again(
    sizes: list[int], most_parts: int, tasks: int, budget: int, crashes: list[int]
) -> None:
    tables = Tables({f"t{i}": list(range(0, 3 * n, 3)) for i, n in enumerate(sizes)}, budget)
    part_settings = PartSettings(tasks, most_parts, part_rows=5, progress_interval_s=0)
    sink = FakeSink()
    log = structlog.get_logger()
    for crash in [*crashes, None]:
        sink.crash_at = None if crash is None else sink.commits + crash
        progress = sink.progress or SnapshotProgress.begin(T0, list(tables.rows))
        try:
            progress = split_tables(
                progress, tables.count, tables.sample, part_settings, sink.commit, log
            )
            progress = read_parts(
                progress,
                lambda part: tables.read(sink, part),
                sink,
                part_settings,
                log,
                threading.Event(),
            )
        except Crash:
            continue
        assert progress.complete
    assert sink.progress is not None and sink.progress.complete
    expected = [(t, k) for t, keys in tables.rows.items() for k in keys]
    assert Counter(sink.landed) == Counter(expected)
    assert not [r for r in tables.reads if r[2]], "a finished range was read again"
    assert sink.progress.rows == len(expected)


def test_a_table_the_service_began_goes_on_as_one_range_from_its_landed_key() -> None:
    progress = SnapshotProgress.begin(T0, ["a"])

    progress = progress.advanced(SnapshotChunk("a", (), [("k", "{}")], (7,), done=False))
    sink = FakeSink()
    split = split_tables(
        progress,
        lambda _: pytest.fail("not counted"),
        lambda *_: pytest.fail("not sampled"),
        PartSettings(2, 8),
        sink.commit,
        structlog.get_logger(),
    )
    assert split.table("a").parts == (PartProgress((7,), None),)
    assert split.table("a").rows == 1 and sink.commits == 1


def test_a_failed_read_stops_the_snapshot_with_its_error_and_keeps_what_landed() -> None:
    progress = SnapshotProgress.begin(T0, ["a"]).split(
        "a", (PartProgress(None, (5,)), PartProgress((5,), None))
    )
    sink = FakeSink()

    def read(part: PartToRead) -> PartRead:
        if part.index == 1:
            raise RuntimeError("task failed 4 times")
        return PartRead("a", 0, 3, (5,), True, ("x",))

    with pytest.raises(RuntimeError, match="task failed"):
        read_parts(
            progress, read, sink, PartSettings(1, 2), structlog.get_logger(), threading.Event()
        )
    assert sink.progress is not None and sink.progress.table("a").parts[0].done
