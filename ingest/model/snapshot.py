"""Snapshots as plain values: what one chunk holds and how far each table has landed.

A snapshot reads every captured table at exactly one timestamp T0 (the job's start minus one
nanosecond, so the stream holds every change after T0 and none at or before it), in primary-key
order. The progress a commit carries names, per table, the last key landed: a restarted job reads
each table again from just after that key, so no row is lost or landed twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum

from ingest.model.records import ColumnType, JsonValue
from ingest.model.timestamps import Nanos


class SnapshotMode(Enum):
    """Named as users know them from Debezium's ``snapshot.mode``."""

    INITIAL = "initial"
    """A new job snapshots its captured tables at T0, then streams from T0."""
    NEVER = "never"
    """A new job streams from its start; rows that exist before it never reach the mirrors."""
    INITIAL_ONLY = "initial_only"
    """Snapshot and stop; a later run of the job streams from T0."""


Key = tuple[JsonValue, ...]
"""A primary key as Spanner's wire encoding writes it (INT64 and BYTES as text, …), in key
order: given back to a read as is, it binds to exactly the key it came from."""


@dataclass(frozen=True, slots=True)
class PartProgress:
    """A key range of a table read by one task at a time (the Spark source's snapshot): fixed
    in the checkpoint when the table's reading starts, so a new driver reads the same ranges and
    never a finished one again."""

    start_after: Key | None
    """The range's first key is the one after this (None: the table's first key)."""
    end: Key | None
    """The range's last key, included (None: the table's last key)."""
    rows: int = 0
    after_key: Key | None = None
    """The last key landed; None: nothing landed yet."""
    done: bool = False

    @property
    def resume_after(self) -> Key | None:
        """Where the next read of the range starts (just after this key)."""
        return self.after_key if self.after_key is not None else self.start_after

    def advanced(self, rows: int, last_key: Key | None, done: bool) -> PartProgress:
        return replace(
            self,
            rows=self.rows + rows,
            after_key=last_key if last_key is not None else self.after_key,
            done=done,
        )


@dataclass(frozen=True, slots=True)
class TableProgress:
    table: str
    rows: int = 0
    after_key: Key | None = None
    """The last key landed; None: nothing landed yet (or the table is read in ``parts``)."""
    done: bool = False
    parts: tuple[PartProgress, ...] = ()
    """The table's key ranges when it is read in parallel tasks; empty: read whole, in order."""


@dataclass(frozen=True, slots=True)
class SnapshotProgress:
    read_timestamp: Nanos
    """T0: every table is read at exactly this timestamp."""
    tables: tuple[TableProgress, ...]

    @staticmethod
    def begin(read_timestamp: Nanos, tables: list[str]) -> SnapshotProgress:
        return SnapshotProgress(read_timestamp, tuple(TableProgress(t) for t in sorted(tables)))

    @property
    def table_names(self) -> list[str]:
        return [t.table for t in self.tables]

    @property
    def complete(self) -> bool:
        return all(t.done for t in self.tables)

    @property
    def rows(self) -> int:
        return sum(t.rows for t in self.tables)

    def advanced(self, chunk: SnapshotChunk) -> SnapshotProgress:
        """The progress once ``chunk`` has landed."""
        tables = tuple(
            replace(
                t,
                rows=t.rows + len(chunk.rows),
                after_key=chunk.last_key if chunk.last_key is not None else t.after_key,
                done=chunk.done,
            )
            if t.table == chunk.table
            else t
            for t in self.tables
        )
        return replace(self, tables=tables)

    def table(self, name: str) -> TableProgress:
        return next(t for t in self.tables if t.table == name)

    def split(self, table: str, parts: tuple[PartProgress, ...]) -> SnapshotProgress:
        """The progress once ``table``'s key ranges are fixed (nothing of it landed yet)."""
        if not parts:
            raise ValueError("a table is split into one key range at least")
        return self._replaced(table, lambda t: replace(t, parts=parts))

    def part_advanced(
        self, table: str, index: int, rows: int, last_key: Key | None, done: bool
    ) -> SnapshotProgress:
        """The progress once rows of part ``index`` up to ``last_key`` have landed; the table is
        done with its last part."""

        def advance(progress: TableProgress) -> TableProgress:
            parts = list(progress.parts)
            parts[index] = parts[index].advanced(rows, last_key, done)
            return replace(
                progress,
                rows=progress.rows + rows,
                parts=tuple(parts),
                done=all(p.done for p in parts),
            )

        return self._replaced(table, advance)

    def _replaced(
        self, table: str, change: Callable[[TableProgress], TableProgress]
    ) -> SnapshotProgress:
        if table not in self.table_names:
            raise KeyError(f"table {table} is not in the snapshot")
        return replace(
            self, tables=tuple(change(t) if t.table == table else t for t in self.tables)
        )


@dataclass(frozen=True, slots=True)
class SnapshotChunk:
    """Consecutive rows of one table in key order, each as (keys JSON, new values JSON)."""

    table: str
    column_types: tuple[ColumnType, ...]
    rows: list[tuple[str, str]]
    last_key: Key | None
    done: bool
    """The table's last rows: nothing follows ``last_key``."""
    deleted_keys: tuple[str, ...] = ()
    """Keys JSON the change log holds alive that this table snapshot did not find: landed with
    the done chunk of an on-demand snapshot, as deletes at its read timestamp."""
