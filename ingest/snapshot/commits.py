"""What a snapshot needs of the change log's writer, and nothing more: the snapshot package
never sees the Delta sink that implements it (``ingest.delta.sink.DeltaChangeLogSink``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ingest.model.snapshot import SnapshotChunk, SnapshotProgress


class SnapshotCommits(Protocol):
    def commit_snapshot(
        self, chunks: Sequence[SnapshotChunk], progress: SnapshotProgress
    ) -> object:
        """Land rows of the initial snapshot with the progress they reach, in one commit."""
        ...

    @property
    def table_snapshot(self) -> SnapshotProgress | None:
        """The on-demand snapshot the commits carry, if one runs."""
        ...

    def track_table_snapshot(self, progress: SnapshotProgress | None) -> None:
        """The on-demand snapshot's progress the next commits carry (None: none runs)."""
        ...
