"""The change-log contract (docs/design.md, contract 1), shared by the sink and the pipeline: the
table's rows, as an Arrow table (one row per mod; one snapshot row per row of a captured table at
T0 or at an on-demand snapshot's T1: ``mod_type`` SNAPSHOT, no transaction id; one SNAPSHOT_DELETE
row per key an on-demand snapshot did not find; one schema row per table whose watched columns
changed: ``mod_type`` SCHEMA, no transaction id), and the checkpoint each commit carries under
``CHECKPOINT_KEY``."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from ingest.model.encoding import canonical_json
from ingest.model.records import ColumnType, Transaction
from ingest.model.snapshot import SnapshotChunk, SnapshotProgress, TableProgress
from ingest.model.timestamps import NANOS_PER_SECOND, Nanos, parse_rfc3339, to_rfc3339
from ingest.rules.partitions import ResumablePartition, ResumablePartitions
from ingest.rules.resume import ResumePoint

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


def _column_types_json(column_types: Iterable[ColumnType]) -> str:
    return canonical_json(
        [
            {
                "name": c.name,
                "type": c.type,
                "is_primary_key": c.is_primary_key,
                "ordinal_position": c.ordinal_position,
            }
            for c in column_types
        ]
    )


def _date(timestamp: Nanos) -> dt.date:
    return dt.date(1970, 1, 1) + dt.timedelta(days=timestamp // (86400 * NANOS_PER_SECOND))


def to_arrow(
    transactions: Iterable[Transaction],
    watched: Mapping[str, tuple[ColumnType, ...]] | None = None,
    watched_at: Nanos = 0,
    snapshot: Iterable[SnapshotChunk] = (),
    snapshot_at: Nanos = 0,
) -> pa.Table:
    """Snapshot rows read at ``snapshot_at`` (and the deletes of keys a snapshot did not find),
    rows of whole transactions, then schema rows of ``watched`` read at ``watched_at``."""
    columns: dict[str, list[Any]] = {name: [] for name in SCHEMA.names}
    for chunk in snapshot:
        _append_snapshot_rows(columns, chunk, snapshot_at)
    for transaction in transactions:
        micros = transaction.commit_timestamp // 1000
        text = to_rfc3339(transaction.commit_timestamp)
        date = _date(transaction.commit_timestamp)
        for record in transaction.records:
            column_types = _column_types_json(record.column_types)
            for index, mod in enumerate(record.mods):
                columns["commit_timestamp"].append(micros)
                columns["commit_timestamp_text"].append(text)
                columns["server_transaction_id"].append(record.server_transaction_id)
                columns["record_sequence"].append(record.record_sequence)
                columns["mod_index"].append(index)
                columns["table_name"].append(record.table_name)
                columns["mod_type"].append(record.mod_type)
                columns["value_capture_type"].append(record.value_capture_type)
                columns["keys"].append(canonical_json(mod.keys))
                columns["new_values"].append(canonical_json(mod.new_values))
                columns["old_values"].append(canonical_json(mod.old_values))
                columns["column_types"].append(column_types)
                columns["number_of_records_in_transaction"].append(
                    record.number_of_records_in_transaction
                )
                columns["number_of_partitions_in_transaction"].append(
                    record.number_of_partitions_in_transaction
                )
                columns["transaction_tag"].append(record.transaction_tag)
                columns["is_system_transaction"].append(record.is_system_transaction)
                columns["commit_date"].append(date)
    for table, watched_columns in sorted((watched or {}).items()):
        row = {
            "commit_timestamp": watched_at // 1000,
            "commit_timestamp_text": to_rfc3339(watched_at),
            "server_transaction_id": "",
            "record_sequence": "",
            "mod_index": 0,
            "table_name": table,
            "mod_type": SCHEMA_ROW,
            "value_capture_type": None,
            "keys": "",
            "new_values": "{}",
            "old_values": "{}",
            "column_types": _column_types_json(watched_columns),
            "number_of_records_in_transaction": 0,
            "number_of_partitions_in_transaction": 0,
            "transaction_tag": "",
            "is_system_transaction": False,
            "commit_date": _date(watched_at),
        }
        for name, value in row.items():
            columns[name].append(value)
    return pa.Table.from_pydict(columns, schema=SCHEMA)


def _append_snapshot_rows(columns: dict[str, list[Any]], chunk: SnapshotChunk, at: Nanos) -> None:
    constant = {
        "commit_timestamp": at // 1000,
        "commit_timestamp_text": to_rfc3339(at),
        "server_transaction_id": "",
        "record_sequence": "",
        "mod_index": 0,
        "table_name": chunk.table,
        "old_values": "{}",
        "column_types": _column_types_json(chunk.column_types),
        "number_of_records_in_transaction": 0,
        "number_of_partitions_in_transaction": 0,
        "transaction_tag": "",
        "is_system_transaction": False,
        "commit_date": _date(at),
    }
    rows: list[tuple[str, str, str, str | None]] = [
        (keys, values, SNAPSHOT_ROW, "NEW_ROW") for keys, values in chunk.rows
    ]
    rows += [(keys, "{}", SNAPSHOT_DELETE, None) for keys in chunk.deleted_keys]
    for name, value in constant.items():
        columns[name].extend([value] * len(rows))
    for keys, values, mod_type, capture in rows:
        columns["keys"].append(keys)
        columns["new_values"].append(values)
        columns["mod_type"].append(mod_type)
        columns["value_capture_type"].append(capture)


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
            }
            for t in progress.tables
        ],
    }


def _snapshot_from_json(data: dict[str, Any]) -> SnapshotProgress:
    return SnapshotProgress(
        parse_rfc3339(data["read_timestamp"]),
        tuple(
            TableProgress(
                t["table"],
                t["rows"],
                tuple(t["after_key"]) if "after_key" in t else None,
                t["done"],
            )
            for t in data["tables"]
        ),
    )


def newest_checkpoint(table: DeltaTable) -> tuple[int, Checkpoint] | None:
    """The newest commit carrying a checkpoint, whichever job wrote it: its table version and
    checkpoint; None when no commit carries one."""
    for commit in table.history():
        text = commit.get(CHECKPOINT_KEY)
        if text is not None:
            return int(commit["version"]), from_json(text)
    return None
