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
    )
