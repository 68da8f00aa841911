"""Whether every mirror table equals its Spanner table at a change-log watermark.

The product's end-to-end promise, checked: once the pipeline has processed the change log up to
version v, each mirror equals the Spanner table read at exactly W(v), the low watermark that
version's commit records (docs/design.md, consistent cut). Used by the end-to-end test and by ``make
run``; it reads Delta with deltalake and Spanner with a stale read, no Spark.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import pyarrow.parquet as pq
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError
from google.cloud.spanner_v1.database import Database
from google.protobuf import timestamp_pb2

from ingest.contract.changelog import Checkpoint, newest_checkpoint
from ingest.model.timestamps import NANOS_PER_SECOND, Nanos
from ingest.model.values import float32
from pipeline.catalog import scan
from pipeline.columns import mirror_uri
from pipeline.shapes import TableShape
from pipeline.values import numeric
from runtime.storage import is_local

Key = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Watermark:
    version: int
    low_watermark: Nanos


@dataclass(frozen=True, slots=True)
class TableComparison:
    table: str
    spanner_rows: int
    mirror_rows: int
    missing: list[Key] = field(default_factory=list)
    """Keys Spanner holds at W that the mirror lacks."""
    extra: list[Key] = field(default_factory=list)
    """Keys the mirror holds that Spanner did not at W."""
    different: list[tuple[Key, str, Any, Any]] = field(default_factory=list)
    """Keys whose values differ: the first differing column, its Spanner and mirror values."""

    @property
    def equal(self) -> bool:
        return not (self.missing or self.extra or self.different)

    def describe(self) -> str:
        if self.equal:
            return f"{self.table}: {self.mirror_rows} rows equal"
        parts = [
            f"{label} {len(keys)} (first {keys[0]!r})"
            for label, keys in (
                ("missing", self.missing),
                ("extra", self.extra),
                ("different", self.different),
            )
            if keys
        ]
        return f"{self.table}: spanner {self.spanner_rows} rows, mirror {self.mirror_rows}; " + (
            ", ".join(parts)
        )


def changelog_watermark(changelog_uri: str, version: int | None = None) -> Watermark | None:
    """The low watermark recorded by the newest landing commit at or before ``version`` that is a
    consistent cut: None while the job's initial snapshot is incomplete."""
    newest = newest_checkpoint(DeltaTable(changelog_uri, version=version))
    if newest is None or not newest[1].consistent:
        return None
    return Watermark(newest[0], newest[1].resume_point.low_watermark)


def latest_checkpoint(changelog_uri: str) -> Checkpoint | None:
    """The newest commit's checkpoint; None before the first commit."""
    try:
        newest = newest_checkpoint(DeltaTable(changelog_uri))
    except TableNotFoundError:
        return None
    return newest[1] if newest else None


def consistent_past(changelog_uri: str, timestamp: Nanos) -> bool:
    """Whether the change log is a consistent cut (any snapshot complete) at or after
    ``timestamp``; False before its first commit."""
    try:
        watermark = changelog_watermark(changelog_uri)
    except TableNotFoundError:
        return False
    return watermark is not None and watermark.low_watermark >= timestamp


def landed_transactions(changelog_uri: str) -> int:
    """Distinct transactions in the change log (0 before its first commit; schema rows have
    no transaction id)."""
    return LandedTransactions(changelog_uri)()


class LandedTransactions:
    """``landed_transactions`` of one change log, counted again at each call from the data
    files added since the last: a test polls a growing change log every half second, and
    reading all of its files at each poll cost 0.4 CPU-s at 300 versions (building the Arrow
    dataset alone 0.25 s). A compaction's removed files leave with their ids, which its new
    file brings back. Tables on object stores, and with deletion vectors, are read whole."""

    def __init__(self, changelog_uri: str) -> None:
        self.uri = changelog_uri
        self._ids: dict[str, frozenset[str]] = {}

    def __call__(self) -> int:
        try:
            table = DeltaTable(self.uri)
        except TableNotFoundError:
            return 0
        if not is_local(self.uri) or "deletionVectors" in (table.protocol().reader_features or []):
            ids = scan(table, ["server_transaction_id"]).column(0).to_pylist()
            return len(set(ids) - {""})
        known = self._ids
        self._ids = {f: known[f] if f in known else _transaction_ids(f) for f in table.file_uris()}
        return len(frozenset[str]().union(*self._ids.values()) - {""})


def _transaction_ids(data_file: str) -> frozenset[str]:
    ids = pq.read_table(data_file, columns=["server_transaction_id"]).column(0)
    return frozenset(ids.to_pylist())


def compare_mirrors(
    database: Database,
    mirror_root: str,
    shapes: dict[str, TableShape],
    read_timestamp: Nanos,
    timestamp_digits: int = 6,
) -> list[TableComparison]:
    """Each captured table, read at exactly ``read_timestamp``, against its mirror.

    TIMESTAMP values compare at ``timestamp_digits`` fractional digits: 6 (Spark keeps
    microseconds) on Spanner, 0 on the emulator, whose change stream drops the fraction
    (emulator/NOTES.md).
    """
    return [
        compare_table(
            shape,
            spanner_rows(database, shape, read_timestamp, timestamp_digits),
            mirror_rows(mirror_uri(mirror_root, table), shape, timestamp_digits),
        )
        for table, shape in sorted(shapes.items())
    ]


def compare_table(
    shape: TableShape, spanner: dict[Key, dict[str, Any]], mirror: dict[Key, dict[str, Any]]
) -> TableComparison:
    different = []
    for key in sorted(spanner.keys() & mirror.keys(), key=repr):
        column = next(
            (name for name, value in spanner[key].items() if mirror[key].get(name) != value), None
        )
        if column is not None:
            different.append((key, column, spanner[key][column], mirror[key].get(column)))
    return TableComparison(
        shape.name,
        len(spanner),
        len(mirror),
        missing=sorted(spanner.keys() - mirror.keys(), key=repr),
        extra=sorted(mirror.keys() - spanner.keys(), key=repr),
        different=different,
    )


def spanner_rows(
    database: Database, shape: TableShape, read_timestamp: Nanos, timestamp_digits: int = 6
) -> dict[Key, dict[str, Any]]:
    """The table at that time; a dropped column is NULL, as in its mirror."""
    seconds, nanos = divmod(read_timestamp, NANOS_PER_SECOND)
    at = timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos)
    names = [c.name for c in shape.columns if shape.dropped_since(c.name) is None]
    types = {c.name: c.type for c in shape.columns}
    gone = dict.fromkeys(c.name for c in shape.columns if c.name not in names)
    columns = ", ".join(f"`{name}`" for name in names)
    with database.snapshot(read_timestamp=at) as snapshot:
        rows = list(snapshot.execute_sql(f"SELECT {columns} FROM `{shape.name}`"))
    return _keyed(
        shape,
        (
            {
                **{
                    name: canonical(types[name], value, True, timestamp_digits)
                    for name, value in zip(names, row, strict=True)
                },
                **gone,
            }
            for row in rows
        ),
    )


def mirror_rows(
    uri: str, shape: TableShape, timestamp_digits: int = 6
) -> dict[Key, dict[str, Any]]:
    types = {c.name: c.type for c in shape.columns}
    try:
        rows = scan(DeltaTable(uri)).to_pylist()
    except TableNotFoundError:
        rows = []
    return _keyed(
        shape,
        (
            {name: canonical(types[name], row.get(name), False, timestamp_digits) for name in types}
            for row in rows
        ),
    )


def _keyed(shape: TableShape, rows: Iterable[dict[str, Any]]) -> dict[Key, dict[str, Any]]:
    keys = [c.name for c in shape.key_columns]
    return {tuple(row[k] for k in keys): row for row in rows}


def canonical(
    spanner_type: dict[str, Any], value: Any, spanner: bool, timestamp_digits: int = 6
) -> Any:
    """One form for a value read from Spanner (client types) and from a mirror (Arrow types)."""
    if value is None:
        return None
    code = spanner_type.get("code")
    if code == "ARRAY":
        element = spanner_type.get("array_element_type") or {}
        return tuple(canonical(element, v, spanner, timestamp_digits) for v in value)
    if code == "BYTES":
        if isinstance(value, str):  # read as of a time before the column turned BYTES
            return value.encode()
        return base64.b64decode(value) if spanner else bytes(value)
    if code == "TIMESTAMP":
        unit = 10 ** (6 - timestamp_digits)
        moment = value.astimezone(dt.UTC)
        return moment.replace(microsecond=moment.microsecond // unit * unit).isoformat(
            timespec="microseconds"
        )
    if spanner_type.get("type_annotation") == "PG_NUMERIC":
        return str(Decimal(str(value)).normalize())
    if code == "NUMERIC":
        return numeric(value)
    if code == "JSON":
        text = value.serialize() if spanner and hasattr(value, "serialize") else value
        parsed = json.loads(text) if isinstance(text, str) else text
        return json.dumps(parsed, sort_keys=True)
    if code == "FLOAT32":
        return float32(value)
    return value
