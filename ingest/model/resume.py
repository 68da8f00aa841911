"""Where a job resumes, and what a reader hands the sink at each low watermark: plain values
that the reader's rules produce, the sink lands and the change log's checkpoint records."""

from __future__ import annotations

from dataclasses import dataclass

from ingest.model.records import Transaction
from ingest.model.timestamps import Nanos


@dataclass(frozen=True, slots=True)
class ResumablePartition:
    """What resumes a partition after a restart: it is queried again from max(start, W + 1)."""

    token: str
    start_timestamp: Nanos
    parent_tokens: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ResumablePartitions:
    """Partitions to query again, and the finished parents they still wait for.

    A parent that is neither here nor finished has not been discovered yet (its own parent is
    still running): its children must keep waiting for it.
    """

    partitions: tuple[ResumablePartition, ...]
    finished_parents: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where a previous run stopped: everything at or below low_watermark has landed."""

    low_watermark: Nanos
    partitions: ResumablePartitions


@dataclass(frozen=True, slots=True)
class Release:
    """Whole transactions with commit timestamp in (previous low watermark, low_watermark],
    and the resume point once they have landed."""

    transactions: list[Transaction]
    low_watermark: Nanos
    resume_point: ResumePoint


def start_point(start: Nanos) -> ResumePoint:
    """Where a new job starting at ``start`` resumes: just below it, no partition known yet."""
    return ResumePoint(start - 1, ResumablePartitions((), ()))
