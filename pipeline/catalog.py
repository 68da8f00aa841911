"""What the change log says about the captured tables, read with deltalake (no Spark needed).

The compatibility check runs before Spark starts, so the table shapes it needs come from here.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError

from ingest.contract.changelog import CHECKPOINT_KEY, SCHEMA_ROW, Checkpoint, from_json
from ingest.model.timestamps import parse_rfc3339
from pipeline.shapes import EVERY_COLUMN_CAPTURES, Interval, Label, Source, TableShape, merge_shapes
from runtime.storage import arrow_filesystem


def scan(table: DeltaTable, columns: list[str] | None = None) -> pa.Table:
    """A Delta table's rows, read on the calling thread.

    A scan on Arrow's thread pool can abort the interpreter at exit ("terminate called without an
    active exception", delta-rs #2184): here 4 of 10 runs of ``to_pandas()`` did, none of 30 of
    this. A table with deletion vectors (a user turned them on, then Spark wrote some) is read by
    delta-rs's query engine, which applies them; its Arrow dataset refuses the table.
    """
    if "deletionVectors" in (table.protocol().reader_features or []):
        return _query_all(table, columns)
    return table.to_pyarrow_dataset().to_table(columns=columns, use_threads=False)


def _query_all(table: DeltaTable, columns: list[str] | None) -> pa.Table:
    names = ", ".join('"' + c.replace('"', '""') + '"' for c in columns) if columns else "*"
    return query(table, "t", f"SELECT {names} FROM t")


def query(table: DeltaTable, name: str, sql: str) -> pa.Table:
    """``sql`` over ``table`` registered as ``name``, by delta-rs's query engine (which applies
    deletion vectors), with its view types as the plain Arrow types a Delta read gives."""
    from deltalake import QueryBuilder

    reader = QueryBuilder().register(name, table).execute(sql)
    rows = pa.RecordBatchReader.from_stream(reader).read_all()
    return rows.cast(pa.schema([pa.field(f.name, _plain(f.type)) for f in rows.schema]))


def _plain(data_type: pa.DataType) -> pa.DataType:
    if pa.types.is_string_view(data_type):
        return pa.string()
    if pa.types.is_binary_view(data_type):
        return pa.binary()
    if pa.types.is_list(data_type) or pa.types.is_large_list(data_type):
        return pa.list_(_plain(data_type.value_type))
    return data_type


def discover_shapes(changelog_uri: str) -> dict[str, TableShape]:
    """Every table in the change log with the union of its columns, each with the type of its
    newest appearance (a type can come back: STRING → BYTES → STRING), its generations and its
    drops."""
    try:
        table = DeltaTable(changelog_uri)
    except TableNotFoundError:
        return {}
    scanned = scan(
        table,
        ["table_name", "column_types", "commit_timestamp_text", "value_capture_type", "mod_type"],
    )
    if scanned.num_rows == 0:
        return {}
    schema = pc.equal(scanned["mod_type"], SCHEMA_ROW)
    every = pc.or_(
        schema,
        pc.and_(
            pc.is_in(scanned["value_capture_type"], pa.array(EVERY_COLUMN_CAPTURES)),
            pc.not_equal(scanned["mod_type"], "DELETE"),
        ),
    )
    scanned = scanned.append_column("every_column", pc.fill_null(every, False))
    scanned = scanned.append_column("schema", schema)
    grouped = scanned.group_by(
        ["table_name", "column_types", "every_column", "schema"], use_threads=False
    ).aggregate([("commit_timestamp_text", "min"), ("commit_timestamp_text", "max")])
    intervals = [
        Interval(table_name, column_types, first, last, every_column, schema_rows)
        for table_name, column_types, every_column, schema_rows, first, last in zip(
            grouped["table_name"].to_pylist(),
            grouped["column_types"].to_pylist(),
            grouped["every_column"].to_pylist(),
            grouped["schema"].to_pylist(),
            grouped["commit_timestamp_text_min"].to_pylist(),
            grouped["commit_timestamp_text_max"].to_pylist(),
            strict=True,
        )
    ]
    return merge_shapes(intervals, functools.partial(_runs_from_rows, scanned))


def _runs_from_rows(
    scanned: pa.Table, table: str, column: str, labels: dict[Source, Label]
) -> list[tuple[str, Label]]:
    """A column's (since, label) runs read row by row, for a column list that came back (so the
    per-list intervals overlap)."""
    rows = scanned.filter(pc.equal(scanned["table_name"], table)).sort_by("commit_timestamp_text")
    distinct: list[Label] = []
    for label in labels.values():
        if label not in distinct:
            distinct.append(label)
    per_row = np.full(rows.num_rows, -1, dtype=np.int64)
    for (text, every_column, schema), label in labels.items():
        mask = pc.and_(
            pc.and_(
                pc.equal(rows["column_types"], text),
                pc.equal(rows["every_column"], every_column),
            ),
            pc.equal(rows["schema"], schema),
        )
        per_row[mask.to_numpy(zero_copy_only=False)] = distinct.index(label)
    kept = np.flatnonzero(per_row >= 0)
    if kept.size == 0:
        return []
    per_row = per_row[kept]
    starts = np.concatenate([[0], np.flatnonzero(per_row[1:] != per_row[:-1]) + 1])
    stamps = rows["commit_timestamp_text"].take(pa.array(kept[starts])).to_pylist()
    return [(stamp, distinct[int(per_row[i])]) for stamp, i in zip(stamps, starts, strict=True)]


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


def checkpoint_at(changelog_uri: str, version: int) -> Checkpoint | None:
    """The change-log checkpoint version ``version`` carries (its commit info), read from that
    one log file; None when it carries none or the file is gone (Delta's log cleanup)."""
    filesystem, root = arrow_filesystem(changelog_uri)
    try:
        with filesystem.open_input_stream(f"{root}/_delta_log/{version:020d}.json") as stream:
            lines = stream.read().decode().splitlines()
    except FileNotFoundError:
        return None
    for line in lines:
        info = json.loads(line).get("commitInfo") if line.strip() else None
        if info and CHECKPOINT_KEY in info:
            return from_json(info[CHECKPOINT_KEY])
    return None
