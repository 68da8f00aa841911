"""The checkpoint stored in each Delta commit: where to resume, and who wrote it."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ingest.partitions import PartitionCheckpoint, PartitionsCheckpoint
from ingest.reader import ResumePoint
from ingest.timestamps import Nanos, parse_rfc3339, to_rfc3339

FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class Checkpoint:
    job_id: str
    version: int
    """The application transaction version of the commit that carries this checkpoint."""
    owner: str
    """The process that wrote it (a fresh id per process start): the writer lease."""
    committed_at: Nanos
    resume_point: ResumePoint
    job_start: Nanos | None = None
    """Where the job's stream started, fixed by its first commit and carried by every later one.
    None in checkpoints written before the start was recorded."""


def to_json(checkpoint: Checkpoint) -> str:
    point = checkpoint.resume_point
    return json.dumps(
        {
            "format": FORMAT_VERSION,
            "job_id": checkpoint.job_id,
            "version": checkpoint.version,
            "owner": checkpoint.owner,
            "committed_at": to_rfc3339(checkpoint.committed_at),
            "low_watermark": to_rfc3339(point.low_watermark),
            "partitions": [
                {
                    "token": p.token,
                    "start_timestamp": to_rfc3339(p.start_timestamp),
                    "parent_tokens": list(p.parent_tokens),
                }
                for p in point.partitions.partitions
            ],
            "finished_parents": list(point.partitions.finished_parents),
            **(
                {"job_start": to_rfc3339(checkpoint.job_start)}
                if checkpoint.job_start is not None
                else {}
            ),
        },
        sort_keys=True,
        separators=(",", ":"),
    )


def from_json(text: str) -> Checkpoint:
    data = json.loads(text)
    if data.get("format") != FORMAT_VERSION:
        raise ValueError(f"unsupported checkpoint format {data.get('format')!r}")
    partitions = PartitionsCheckpoint(
        tuple(
            PartitionCheckpoint(
                p["token"], parse_rfc3339(p["start_timestamp"]), tuple(p["parent_tokens"])
            )
            for p in data["partitions"]
        ),
        tuple(data["finished_parents"]),
    )
    return Checkpoint(
        job_id=data["job_id"],
        version=data["version"],
        owner=data["owner"],
        committed_at=parse_rfc3339(data["committed_at"]),
        resume_point=ResumePoint(parse_rfc3339(data["low_watermark"]), partitions),
        job_start=parse_rfc3339(data["job_start"]) if "job_start" in data else None,
    )
