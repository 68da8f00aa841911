"""Where a job resumes, and what the reader hands the sink at each low watermark."""

from __future__ import annotations

from dataclasses import dataclass

from ingest.model.records import Transaction
from ingest.model.timestamps import Nanos
from ingest.rules.partitions import ResumablePartitions


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
