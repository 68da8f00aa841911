"""Parquet files of snapshot rows written straight into the change log's folder by the task that
read them, in the table's layout (``commit_date=…/part-….parquet``), for the driver to commit.

A file is no part of the table until a commit adds it, so a task that dies, or whose driver dies
before committing, leaves only files no version references (``VACUUM`` removes them). Each chunk
is one row group: a task holds one chunk and the open file's footer, whatever the table's size.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake.transaction import AddAction

from ingest.contract.changelog import PARTITION_COLUMNS
from ingest.delta.changelog import to_arrow
from ingest.model.snapshot import SnapshotChunk
from ingest.model.timestamps import Nanos
from runtime.storage import arrow_filesystem


@dataclass(frozen=True, slots=True)
class SnapshotFile:
    """A written file as the driver commits it (paths relative to the table's root)."""

    path: str
    size: int
    rows: int
    partition: str
    """``commit_date``'s value (every row of a snapshot has T0's date)."""
    modified_ms: int

    def add_action(self) -> AddAction:
        return AddAction(
            self.path,
            self.size,
            {PARTITION_COLUMNS[0]: self.partition},
            self.modified_ms,
            True,
            json.dumps({"numRecords": self.rows}),
        )

    def to_json(self) -> str:
        return json.dumps(
            [self.path, self.size, self.rows, self.partition, self.modified_ms],
            separators=(",", ":"),
        )

    @staticmethod
    def from_json(text: str) -> SnapshotFile:
        path, size, rows, partition, modified = json.loads(text)
        return SnapshotFile(path, size, rows, partition, modified)


class SnapshotFileWriter:
    """Rows of snapshot chunks into files of about ``target_bytes`` each (as encoded)."""

    def __init__(self, table_uri: str, read_timestamp: Nanos, target_bytes: int) -> None:
        self._fs, self._root = arrow_filesystem(table_uri)
        self._read_timestamp = read_timestamp
        self._target_bytes = target_bytes
        self._writer: pq.ParquetWriter | None = None
        self._sink: pa.NativeFile | None = None
        self._path = ""
        self._partition = ""
        self._rows = 0
        self._written: list[SnapshotFile] = []

    def write(self, chunks: Iterable[SnapshotChunk]) -> None:
        rows = to_arrow([], snapshot=chunks, snapshot_at=self._read_timestamp)
        if rows.num_rows == 0:
            return
        dates = rows[PARTITION_COLUMNS[0]].unique()
        if len(dates) != 1:
            raise ValueError("snapshot rows of one read timestamp have one commit date")
        partition = dates[0].as_py().isoformat()
        data = rows.drop_columns(PARTITION_COLUMNS)
        if self._writer is None:
            self._open(partition, data.schema)
        assert self._writer is not None and self._sink is not None
        self._writer.write_table(data, row_group_size=max(1, data.num_rows))
        self._rows += data.num_rows
        if self._sink.tell() >= self._target_bytes:
            self._close()

    def close(self) -> list[SnapshotFile]:
        """Every file written, closed."""
        self._close()
        return list(self._written)

    def _open(self, partition: str, schema: pa.Schema) -> None:
        self._partition = partition
        self._path = f"{PARTITION_COLUMNS[0]}={partition}/part-snapshot-{uuid.uuid4()}.parquet"
        self._fs.create_dir(f"{self._root}/{PARTITION_COLUMNS[0]}={partition}", recursive=True)
        self._sink = self._fs.open_output_stream(f"{self._root}/{self._path}")
        self._writer = pq.ParquetWriter(self._sink, schema, compression="snappy")
        self._rows = 0

    def _close(self) -> None:
        if self._writer is None or self._sink is None:
            return
        self._writer.close()
        try:
            self._sink.close()
        except OSError:
            if not self._landed_whole():
                raise
        self._writer = self._sink = None
        info = self._fs.get_file_info(f"{self._root}/{self._path}")
        self._written.append(
            SnapshotFile(
                self._path,
                int(info.size or 0),
                self._rows,
                self._partition,
                int(time.time() * 1000),
            )
        )

    def _landed_whole(self) -> bool:
        """Whether the file is in the store with every row written, though its close failed: on
        S3 the answer to a large file's last request (completing its upload) can be lost after
        the store acted on it, and the retried request then finds no upload to complete."""
        try:
            with self._fs.open_input_file(f"{self._root}/{self._path}") as source:
                return bool(pq.read_metadata(source).num_rows == self._rows)
        except OSError:
            return False


def read_keys(table_uri: str, files: Iterable[SnapshotFile]) -> list[str]:
    """The ``keys`` of written files' rows (an uncommitted range's, to tell what it found)."""
    fs, root = arrow_filesystem(table_uri)
    keys: list[str] = []
    for written in files:
        with fs.open_input_file(f"{root}/{written.path}") as source:
            keys += pq.read_table(source, columns=["keys"])["keys"].to_pylist()
    return keys
