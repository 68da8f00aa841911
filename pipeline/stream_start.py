"""Where a query with no offsets yet starts reading the change log: its first commit, or Delta's
initial snapshot of it.

Both give the same rows when every commit since the change log's creation is there and only ever
appended rows: no compaction, delete, vacuum, property or schema change. Reading the commits from
version 0 then skips the Spark job that plans the initial snapshot, about 3 s and 5 CPU-s of a
fresh query's first batch (pipeline/NOTES.md, "The change log read from version 0"). While the
log has no checkpoint file, the snapshot reads those same commit files anyway, so version 0
never reads more; after it, or on any other history, the query reads the snapshot as before.
A vacuum (Spark logs none by default) deletes only files a commit removed, and on this
append-only table only a compaction (``OPTIMIZE``, Z-order) removes any, in a commit the
history shows."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pyarrow import fs as pafs

from pipeline.state.checkpoint import planned_batches
from runtime.storage import arrow_filesystem, delta_storage_options

APPENDS = {("WRITE", "Append"), ("WRITE", "ErrorIfExists"), ("CREATE TABLE", None)}
"""The operations that only add rows: the sink's appends, the commit that created the table and
the snapshot parts' files (``create_write_transaction`` in mode append)."""
COMMIT_FILE = re.compile(r"^(\d{20})\.json$")
LOG_CHECKPOINT_FILE = re.compile(r"^\d{20}\.checkpoint(\.\d+\.\d+)?(\.[0-9a-f-]+)?\.parquet$")


@dataclass(frozen=True)
class ChangeLogCommits:
    """What the change log's ``_delta_log`` says, as far as the rule needs it."""

    newest: int
    commit_files: frozenset[int]
    log_checkpointed: bool
    operations: tuple[tuple[int, str, str | None], ...]
    """(version, operation, write mode) of each commit delta-rs reports."""
    schema_changed: bool


@dataclass(frozen=True)
class StreamStart:
    version: int | None
    """``startingVersion`` for Spark; None reads Delta's initial snapshot."""
    reason: str


def start_of(log: ChangeLogCommits) -> StreamStart:
    """The rule: version 0 only for a log whose every commit since creation is kept, appends."""
    every_version = set(range(log.newest + 1))
    if log.log_checkpointed:
        return StreamStart(None, "the change log has a log checkpoint")
    if log.commit_files != every_version:
        return StreamStart(None, "the change log's first commits are gone")
    if {version for version, _, _ in log.operations} != every_version:
        return StreamStart(None, "the change log's history is incomplete")
    others = sorted({(op, mode) for _, op, mode in log.operations} - APPENDS, key=str)
    if others:
        return StreamStart(None, f"the change log holds other commits than appends: {others[0]}")
    if log.schema_changed:
        return StreamStart(None, "the change log's schema changed since version 0")
    return StreamStart(0, "the change log holds only appends since version 0")


def fresh_start(changelog_uri: str, checkpoint_uri: str) -> StreamStart:
    """Where the query of ``checkpoint_uri`` starts; Spark ignores it once offsets exist."""
    if planned_batches(checkpoint_uri):
        return StreamStart(None, "the query resumes from its checkpoint's offsets")
    return start_of(read_log(changelog_uri))


def read_log(changelog_uri: str) -> ChangeLogCommits:
    """One listing of ``_delta_log``, delta-rs's history, and version 0's schema when it is kept."""
    from deltalake import DeltaTable

    options = delta_storage_options(changelog_uri)
    table = DeltaTable(changelog_uri, storage_options=options)
    filesystem, root = arrow_filesystem(changelog_uri)
    names = [
        info.base_name
        for info in filesystem.get_file_info(pafs.FileSelector(f"{root.rstrip('/')}/_delta_log"))
    ]
    commit_files = frozenset(_commit_versions(names))
    schema_changed = (
        0 not in commit_files
        or DeltaTable(changelog_uri, version=0, storage_options=options).schema() != table.schema()
    )
    return ChangeLogCommits(
        newest=table.version(),
        commit_files=commit_files,
        log_checkpointed=any(LOG_CHECKPOINT_FILE.match(name) for name in names),
        operations=tuple(_operations(table.history())),
        schema_changed=schema_changed,
    )


def _commit_versions(names: Iterable[str]) -> Iterable[int]:
    for name in names:
        found = COMMIT_FILE.match(name)
        if found:
            yield int(found.group(1))


def _operations(history: Iterable[Mapping[str, Any]]) -> Iterable[tuple[int, str, str | None]]:
    for commit in history:
        parameters = commit.get("operationParameters") or {}
        yield int(commit["version"]), str(commit.get("operation")), parameters.get("mode")
