"""What the change log says about the captured tables, read with deltalake (no Spark needed).

The compatibility check runs before Spark starts, so the table shapes it needs come from here.
"""

from __future__ import annotations

import functools

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError
from pyspark.sql import types as T

from ingest.checkpoint import from_json
from ingest.sink import CHECKPOINT_KEY
from ingest.timestamps import parse_rfc3339
from pipeline.types import TableShape, merge_shapes


def scan(table: DeltaTable, columns: list[str] | None = None) -> pa.Table:
    """A Delta table's rows, read on the calling thread.

    A scan on Arrow's thread pool can abort the interpreter at exit ("terminate called without an
    active exception", delta-rs #2184): here 4 of 10 runs of ``to_pandas()`` did, none of 30 of
    this.
    """
    return table.to_pyarrow_dataset().to_table(columns=columns, use_threads=False)


def discover_shapes(changelog_uri: str) -> dict[str, TableShape]:
    """Every table in the change log with the union of its columns, each with the type of its
    newest appearance (a type can come back: STRING → BYTES → STRING) and its generations."""
    try:
        table = DeltaTable(changelog_uri)
    except TableNotFoundError:
        return {}
    scanned = scan(table, ["table_name", "column_types", "commit_timestamp_text"])
    if scanned.num_rows == 0:
        return {}
    grouped = scanned.group_by(["table_name", "column_types"]).aggregate(
        [("commit_timestamp_text", "min"), ("commit_timestamp_text", "max")]
    )
    intervals = list(
        zip(
            grouped["table_name"].to_pylist(),
            grouped["column_types"].to_pylist(),
            grouped["commit_timestamp_text_min"].to_pylist(),
            grouped["commit_timestamp_text_max"].to_pylist(),
            strict=True,
        )
    )
    return merge_shapes(intervals, functools.partial(_type_runs_from_rows, scanned))


def _type_runs_from_rows(
    scanned: pa.Table, table: str, column: str, kinds: dict[str, T.DataType]
) -> list[tuple[str, T.DataType]]:
    """A column's (since, state type) runs read row by row, for a type that came back under a
    column list it had before (so the per-list intervals overlap)."""
    texts = pa.array(list(kinds))
    mask = pc.and_(pc.equal(scanned["table_name"], table), pc.is_in(scanned["column_types"], texts))
    rows = scanned.filter(mask).sort_by("commit_timestamp_text")
    kind_names = [kind.simpleString() for kind in kinds.values()]
    labels = np.array([kind_names.index(k) for k in kind_names], dtype=np.int64)
    per_row = labels[pc.index_in(rows["column_types"], texts).to_numpy(zero_copy_only=False)]
    starts = np.concatenate([[0], np.flatnonzero(per_row[1:] != per_row[:-1]) + 1])
    stamps = rows["commit_timestamp_text"].to_pylist()
    types = list(kinds.values())
    return [(stamps[i], types[int(per_row[i])]) for i in starts]


def version_holding(changelog_uri: str, commit_timestamp_text: str) -> int | None:
    """The change-log (Delta) version that landed a commit: the first whose checkpoint's low
    watermark is at or past it (each version holds the commits above the previous one's)."""
    commit = parse_rfc3339(commit_timestamp_text)
    holding = None
    for entry in DeltaTable(changelog_uri).history():
        text = entry.get(CHECKPOINT_KEY)
        if text is not None and from_json(text).resume_point.low_watermark >= commit:
            holding = int(entry["version"])
    return holding
