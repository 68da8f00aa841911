"""How a table is cut into key ranges read in parallel, and which ranges are left to read.

The ranges are cut at keys sampled from the table at T0 and read back in key order, then fixed in
the checkpoint before any of them is read: a later driver reads the same ranges, so a range whose
rows have landed is never read again, and a range cut short by a crash is read on from its last
landed key. Pure: keys are compared by whoever orders the sample (Spanner), never here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ingest.model.snapshot import Key, PartProgress, SnapshotProgress

SAMPLE_PER_PART = 32
"""Sampled keys per range: the ranges' sizes vary by about 1/sqrt(32) of a range."""


SMALLEST_PART_ROWS = 10_000
"""No table is cut into ranges smaller than this: starting a range's read costs a Spark job."""


def parts_wanted(rows: int, tasks: int, most_parts: int, part_rows: int) -> int:
    """How many ranges a table of ``rows`` rows is read in: one per ``part_rows`` rows, at least
    one per task while ranges keep ``SMALLEST_PART_ROWS`` rows (so a table alone keeps every
    task busy), at most ``most_parts``."""
    by_size = rows // max(1, part_rows)
    for_tasks = min(tasks, rows // SMALLEST_PART_ROWS)
    return max(1, min(most_parts, max(by_size, for_tasks)))


def key_ranges(ordered_sample: Sequence[Key], parts: int) -> tuple[PartProgress, ...]:
    """``parts`` ranges (fewer when the sample is smaller) that together hold every key once:
    cut at evenly spaced keys of a sample already in key order; the first starts at the table's
    first key and the last ends at its last."""
    if parts < 1:
        raise ValueError("one range at least")
    count = max(1, min(parts, len(ordered_sample)))
    cuts: list[Key] = []
    for index in range(1, count):
        cut = ordered_sample[index * len(ordered_sample) // count - 1]
        if not cuts or cuts[-1] != cut:
            cuts.append(cut)
    bounds: list[Key | None] = [None, *cuts, None]
    return tuple(PartProgress(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1))


@dataclass(frozen=True, slots=True)
class PartToRead:
    table: str
    index: int
    part: PartProgress


def parts_to_read(progress: SnapshotProgress) -> list[PartToRead]:
    """The ranges not done, table by table in key order (a table not split yet has none)."""
    return [
        PartToRead(table.table, index, part)
        for table in progress.tables
        for index, part in enumerate(table.parts)
        if not part.done
    ]


def tables_to_split(progress: SnapshotProgress) -> list[str]:
    """Tables not done whose ranges are not fixed yet. A table the service began reading whole
    (a landed key, no ranges) is read on as one range from that key."""
    return [t.table for t in progress.tables if not t.done and not t.parts]
