"""The batch log: where each micro-batch left the mirrors and histories, in Spanner's time.

``<mirror_root>/_cdc_batches`` is a Delta table with a row per batch, appended after the batch's
MERGEs with the batch's ``txn`` (a replayed batch appends nothing): the batch id and state
generation, the last change-log version it applied whole and that version's low watermark W,
whether the mirrors then equal Spanner at W (the batch ended at a version's end, and that version
is a consistent cut: no snapshot under way), and the Delta version of every mirror and history
at that moment. A read as of a Spanner time takes the newest consistent batch at or before it
and reads every table at the version recorded there: one W for all (``pipeline.as_of``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import pyarrow as pa

from pipeline.merges import JOB_COMMIT_KEY, Logger, commit_once, commit_properties, holds_batch
from runtime.storage import delta_storage_options, delta_write_mode

BATCH_LOG = "_cdc_batches"
COMPACT_EVERY = 500
"""Batches between compactions of the log's small files (one per batch)."""
SCHEMA = pa.schema(
    [
        pa.field("batch_id", pa.int64()),
        pa.field("generation", pa.int64()),
        pa.field("changelog_version", pa.int64()),
        pa.field("watermark_text", pa.string()),
        pa.field("consistent", pa.bool_()),
        pa.field("changelog_start_text", pa.string()),
        pa.field("mirror_versions", pa.string()),
        pa.field("history_versions", pa.string()),
    ]
)


@dataclass(frozen=True, slots=True)
class AppliedBatch:
    batch_id: int
    generation: int
    changelog_version: int
    """The last change-log version the batch applied whole (-1: none yet)."""
    watermark_text: str | None
    """That version's low watermark W (RFC 3339, nine digits)."""
    consistent: bool
    """Whether every mirror then equals its Spanner table read at exactly W."""
    changelog_start_text: str | None
    """Where the change log's history begins: its initial snapshot's T0 or, without one, its
    stream's start. A history holds every row from there."""
    mirror_versions: dict[str, int] = field(default_factory=dict)
    history_versions: dict[str, int] = field(default_factory=dict)


def log_uri(mirror_root: str) -> str:
    return f"{mirror_root.rstrip('/')}/{BATCH_LOG}"


def commit_metadata(watermark_text: str | None, batch_id: int) -> dict[str, str]:
    """What each mirror and history commit of a batch records beside its ``txn``: the job's mark
    (``pipeline.foreign_commits``) with the batch's W."""
    return {JOB_COMMIT_KEY: json.dumps({"watermark": watermark_text, "batch_id": batch_id})}


def record(mirror_root: str, applied: AppliedBatch, app_id: str, log: Logger) -> None:
    """Append the batch's row, once."""
    uri = log_uri(mirror_root)
    commit_once(BATCH_LOG, lambda: _append(uri, applied, app_id), applied.batch_id, log)
    if applied.batch_id % COMPACT_EVERY == COMPACT_EVERY - 1:
        commit_once(f"{BATCH_LOG} compaction", lambda: _compact(uri), applied.batch_id, log)


def _append(uri: str, applied: AppliedBatch, app_id: str) -> None:
    from deltalake import DeltaTable, write_deltalake
    from deltalake.exceptions import TableNotFoundError

    options = delta_storage_options(uri)
    try:
        if holds_batch(DeltaTable(uri, storage_options=options), app_id, applied.batch_id):
            return
        creates_table = False
    except TableNotFoundError:
        creates_table = True
    row = {
        "batch_id": applied.batch_id,
        "generation": applied.generation,
        "changelog_version": applied.changelog_version,
        "watermark_text": applied.watermark_text,
        "consistent": applied.consistent,
        "changelog_start_text": applied.changelog_start_text,
        "mirror_versions": json.dumps(applied.mirror_versions, sort_keys=True),
        "history_versions": json.dumps(applied.history_versions, sort_keys=True),
    }
    write_deltalake(
        uri,
        pa.Table.from_pylist([row], schema=SCHEMA),
        mode=delta_write_mode(creates_table),
        storage_options=options,
        commit_properties=commit_properties(app_id, applied.batch_id, None, creates_table),
    )


def _compact(uri: str) -> None:
    """The log's small files into one (a compaction a lost answer left done does nothing)."""
    from deltalake import DeltaTable

    table = DeltaTable(uri, storage_options=delta_storage_options(uri))
    table.optimize.compact()
    table.create_checkpoint()


def read(mirror_root: str) -> list[AppliedBatch]:
    """Every batch recorded, oldest first: by the change-log version each applied whole, which
    never goes back within one batch log (a rebased generation starts at the mirrors' cut),
    then by generation and batch. Not by generation first: a rebase after the checkpoint was
    lost numbers its generation from 1 again, below the generations it follows."""
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    uri = log_uri(mirror_root)
    try:
        table = DeltaTable(uri, storage_options=delta_storage_options(uri))
    except TableNotFoundError:
        return []
    rows = table.to_pyarrow_dataset().to_table(use_threads=False).to_pylist()
    applied = [_from_row(row) for row in rows]
    return sorted(applied, key=_landing_order)


def consistent(mirror_root: str) -> list[AppliedBatch]:
    """The batches after which the mirrors equal Spanner at their W, oldest first."""
    return [b for b in read(mirror_root) if b.consistent and b.watermark_text]


def _landing_order(batch: AppliedBatch) -> tuple[int, str, int, int]:
    return (batch.changelog_version, batch.watermark_text or "", batch.generation, batch.batch_id)


def _from_row(row: Mapping[str, object]) -> AppliedBatch:
    return AppliedBatch(
        batch_id=int(str(row["batch_id"])),
        generation=int(str(row["generation"])),
        changelog_version=int(str(row["changelog_version"])),
        watermark_text=None if row["watermark_text"] is None else str(row["watermark_text"]),
        consistent=bool(row["consistent"]),
        changelog_start_text=(
            None if row["changelog_start_text"] is None else str(row["changelog_start_text"])
        ),
        mirror_versions=json.loads(str(row["mirror_versions"])),
        history_versions=json.loads(str(row["history_versions"])),
    )
