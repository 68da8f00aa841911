"""The change-log contract (docs/design.md, contract 1), shared by the ingest's sink and the
pipeline, and nothing else of either: the table's schema and row kinds (one row per mod; one
snapshot row per row of a captured table at T0 or at an on-demand snapshot's T1: ``mod_type``
SNAPSHOT, no transaction id; one SNAPSHOT_DELETE row per key an on-demand snapshot did not find;
one schema row per table whose watched columns changed: ``mod_type`` SCHEMA, no transaction id),
``column_types`` text both ways, and the checkpoint each commit carries under ``CHECKPOINT_KEY``.
Imports only ``ingest.model``."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from ingest.model.encoding import canonical_json, column_type_from_dict, column_type_to_dict
from ingest.model.records import ColumnType, sequence_key
from ingest.model.resume import ResumablePartition, ResumablePartitions, ResumePoint
from ingest.model.snapshot import Key, PartProgress, SnapshotProgress, TableProgress
from ingest.model.timestamps import Nanos, parse_rfc3339, to_rfc3339

if TYPE_CHECKING:
    from deltalake import DeltaTable

CHECKPOINT_KEY = "spanner_cdc_checkpoint"
"""Key of the checkpoint in each commit's commit info."""
UTC_MICROS = pa.timestamp("us", tz="UTC")

SCHEMA = pa.schema(
    [
        ("commit_timestamp", UTC_MICROS),
        # Spark timestamps stop at microseconds; the text keeps every digit Spanner sent.
        ("commit_timestamp_text", pa.string()),
        ("server_transaction_id", pa.string()),
        ("record_sequence", pa.string()),
        ("mod_index", pa.int32()),
        ("table_name", pa.string()),
        ("mod_type", pa.string()),
        ("value_capture_type", pa.string()),
        ("keys", pa.string()),
        ("new_values", pa.string()),
        ("old_values", pa.string()),
        ("column_types", pa.string()),
        ("number_of_records_in_transaction", pa.int32()),
        ("number_of_partitions_in_transaction", pa.int32()),
        ("transaction_tag", pa.string()),
        ("is_system_transaction", pa.bool_()),
        ("commit_date", pa.date32()),
    ]
)
PARTITION_COLUMNS = ["commit_date"]
SCHEMA_ROW = "SCHEMA"
"""``mod_type`` of a schema row: the table's watched columns at its ``commit_timestamp`` (the
time they were read, at the commit's low watermark). Its ``server_transaction_id`` and ``keys``
are empty, so it counts as no transaction and as no row of the table."""
SNAPSHOT_ROW = "SNAPSHOT"
"""``mod_type`` of a snapshot row: one row of a captured table as read at T0 (its
``commit_timestamp``), every captured column listed (``value_capture_type`` NEW_ROW), an empty
``server_transaction_id``. It sorts before every change of the stream, which starts after T0;
readers tell it from an INSERT as Debezium's readers tell ``op = r`` from ``op = c``.

An on-demand snapshot of some tables lands the same rows at its own read timestamp T1, a low
watermark the change log had reached when it was asked for, interleaved with later changes: a
reader applies a row only if it is newer than what it applied for that key."""
SNAPSHOT_DELETE = "SNAPSHOT_DELETE"
"""``mod_type`` of a key the change log held alive before T1 that an on-demand snapshot at T1 did
not find (deleted while the stream did not capture the table): a delete at T1, no values, no
transaction id."""
DELETE = "DELETE"
"""``mod_type`` of a stream delete, as Spanner names it."""
DELETES = (DELETE, SNAPSHOT_DELETE)


Position = tuple[str, str, tuple[int, str], int]
"""A row's place in the change log's total order: (``commit_timestamp_text``,
``server_transaction_id``, ``record_sequence`` by length then text, ``mod_index``)."""


def position(row: Any) -> Position:
    """The change log's total order of one row (a mapping or a Spark row), comparable across
    rows, state and processors."""
    return (
        row["commit_timestamp_text"],
        row["server_transaction_id"],
        sequence_key(row["record_sequence"]),
        row["mod_index"],
    )


def in_total_order(rows: pa.Table, first: Sequence[str] = ()) -> pa.Table:
    """Change-log rows sorted by the columns ``first``, then in the total order (``position``,
    as Arrow sorts it: a record sequence by length, then text)."""
    width = "_record_sequence_width"
    keyed = rows.append_column(width, pc.utf8_length(rows["record_sequence"]))
    order = [*first, "commit_timestamp_text", "server_transaction_id", width]
    order += ["record_sequence", "mod_index"]
    return rows.take(pc.sort_indices(keyed, sort_keys=[(name, "ascending") for name in order]))


def column_types_json(column_types: Iterable[ColumnType]) -> str:
    """A row's ``column_types`` text."""
    return canonical_json([column_type_to_dict(c) for c in column_types])


def parse_column_types(column_types_json: str) -> list[ColumnType]:
    """A row's ``column_types`` text as record types."""
    return [column_type_from_dict(c) for c in json.loads(column_types_json)]


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
    snapshot: SnapshotProgress | None = None
    """The initial snapshot's progress, carried by every commit of a job that took one. Until it
    is complete, the change log is no consistent cut: its W is not reached."""
    table_snapshot: SnapshotProgress | None = None
    """An on-demand snapshot of some tables at T1, carried by every commit from the one that
    records the request to the one that completes it."""
    lease_released: bool = False
    """The writer's last commit before a clean stop: the next process takes over at once."""

    @property
    def consistent(self) -> bool:
        """Whether every captured table equals Spanner at W once this commit is applied."""
        return all(s is None or s.complete for s in (self.snapshot, self.table_snapshot))


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
            **(
                {"snapshot": _snapshot_json(checkpoint.snapshot)}
                if checkpoint.snapshot is not None
                else {}
            ),
            **(
                {"table_snapshot": _snapshot_json(checkpoint.table_snapshot)}
                if checkpoint.table_snapshot is not None
                else {}
            ),
            **({"lease_released": True} if checkpoint.lease_released else {}),
        },
        sort_keys=True,
        separators=(",", ":"),
    )


def from_json(text: str) -> Checkpoint:
    data = json.loads(text)
    if data.get("format") != FORMAT_VERSION:
        raise ValueError(f"unsupported checkpoint format {data.get('format')!r}")
    partitions = ResumablePartitions(
        tuple(
            ResumablePartition(
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
        snapshot=_snapshot_from_json(data["snapshot"]) if "snapshot" in data else None,
        table_snapshot=(
            _snapshot_from_json(data["table_snapshot"]) if "table_snapshot" in data else None
        ),
        lease_released=bool(data.get("lease_released", False)),
    )


def _snapshot_json(progress: SnapshotProgress) -> dict[str, Any]:
    return {
        "read_timestamp": to_rfc3339(progress.read_timestamp),
        "complete": progress.complete,
        "rows": progress.rows,
        "tables": [
            {
                "table": t.table,
                "rows": t.rows,
                "done": t.done,
                **(
                    {"after_key": list(t.after_key)}
                    if t.after_key is not None and not t.done
                    else {}
                ),
                **({"parts": [_part_json(p) for p in t.parts]} if t.parts else {}),
            }
            for t in progress.tables
        ],
    }


def _part_json(part: PartProgress) -> dict[str, Any]:
    return {
        "start_after": key_to_json(part.start_after),
        "end": key_to_json(part.end),
        "rows": part.rows,
        "after_key": key_to_json(part.after_key),
        "done": part.done,
    }


def key_to_json(key: Key | None) -> list[Any] | None:
    """A wire-encoded key as JSON holds it (a list); None stays None."""
    return list(key) if key is not None else None


def key_from_json(data: list[Any] | None) -> Key | None:
    return tuple(data) if data is not None else None


def _snapshot_from_json(data: dict[str, Any]) -> SnapshotProgress:
    return SnapshotProgress(
        parse_rfc3339(data["read_timestamp"]),
        tuple(
            TableProgress(
                t["table"],
                t["rows"],
                tuple(t["after_key"]) if "after_key" in t else None,
                t["done"],
                tuple(
                    PartProgress(
                        key_from_json(p["start_after"]),
                        key_from_json(p["end"]),
                        p["rows"],
                        key_from_json(p["after_key"]),
                        p["done"],
                    )
                    for p in t.get("parts", ())
                ),
            )
            for t in data["tables"]
        ),
    )


def checkpoints_newest_first(
    table: DeltaTable, pages: Sequence[int | None] = (8, None)
) -> Iterator[tuple[int, Checkpoint]]:
    """Each commit's checkpoint with its table version, whichever job wrote it, the newest
    first; the history read in growing ``pages`` of commits (None: all of it), each commit once.
    The one wanted is nearly always among the newest, and reading the whole history costs what
    the log's length does (31 ms of CPU at 300 versions, a test polling five times a second)."""
    below: int | None = None  # the oldest version read so far
    for limit in pages:
        commits = table.history(limit)
        for commit in commits:
            version = int(commit["version"])
            if below is not None and version >= below:
                continue
            below, text = version, commit.get(CHECKPOINT_KEY)
            if text is not None:
                yield version, from_json(text)
        if limit is None or len(commits) < limit:
            return


def newest_checkpoint(table: DeltaTable) -> tuple[int, Checkpoint] | None:
    """The newest commit carrying a checkpoint: its table version and checkpoint; None when no
    commit carries one."""
    return next(checkpoints_newest_first(table), None)
