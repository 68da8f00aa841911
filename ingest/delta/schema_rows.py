"""The watched columns the change log last landed for each table (its newest schema rows): what a
restarted process compares the columns it reads with, so a column added while no process ran is
found too."""

from __future__ import annotations

import pyarrow.compute as pc
from deltalake import DeltaTable

from ingest.contract.changelog import SCHEMA_ROW, parse_column_types
from ingest.model.records import WatchedColumns


def landed_watched_columns(table: DeltaTable | None) -> WatchedColumns:
    """Each table's columns as listed by its newest schema row; {} for a new change log.
    Reads the schema rows only (a filter on ``mod_type``), as the pipeline's start reads the
    change log's column lists."""
    if table is None:
        return {}
    rows = table.to_pyarrow_dataset().to_table(
        columns=["table_name", "column_types", "commit_timestamp_text"],
        filter=pc.field("mod_type") == SCHEMA_ROW,
        use_threads=False,
    )
    newest: dict[str, tuple[str, str]] = {}
    for name, types, at in zip(
        rows["table_name"].to_pylist(),
        rows["column_types"].to_pylist(),
        rows["commit_timestamp_text"].to_pylist(),
        strict=True,
    ):
        if name not in newest or at > newest[name][0]:
            newest[name] = (at, types)
    return {
        name: tuple(sorted(parse_column_types(types), key=lambda c: c.ordinal_position))
        for name, (_, types) in newest.items()
    }
