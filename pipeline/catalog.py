"""What the change log says about the captured tables, read with deltalake (no Spark needed).

The compatibility check runs before Spark starts, so the table shapes it needs come from here.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError

from pipeline.types import TableShape, merge_shapes


def scan(table: DeltaTable, columns: list[str] | None = None) -> pa.Table:
    """A Delta table's rows, read on the calling thread.

    A scan on Arrow's thread pool can abort the interpreter at exit ("terminate called without an
    active exception", delta-rs #2184): here 4 of 10 runs of ``to_pandas()`` did, none of 30 of
    this.
    """
    return table.to_pyarrow_dataset().to_table(columns=columns, use_threads=False)


def discover_shapes(changelog_uri: str) -> dict[str, TableShape]:
    """Every table in the change log with the union of its columns, newest types winning."""
    try:
        table = DeltaTable(changelog_uri)
    except TableNotFoundError:
        return {}
    scanned = scan(table, ["table_name", "column_types", "commit_timestamp_text"])
    if scanned.num_rows == 0:
        return {}
    grouped = scanned.group_by(["table_name", "column_types"]).aggregate(
        [("commit_timestamp_text", "min")]
    )
    order = pc.sort_indices(grouped, sort_keys=[("commit_timestamp_text_min", "ascending")])
    grouped = grouped.take(order)
    names, column_types = grouped["table_name"].to_pylist(), grouped["column_types"].to_pylist()
    return merge_shapes(list(zip(names, column_types, strict=True)))
