"""Checks of the histories, reads as of a time and the example processors against Spanner itself
(read at each commit timestamp, or at random times), for the end-to-end test."""

from __future__ import annotations

import base64
import datetime as dt
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from deltalake import DeltaTable
from google.protobuf import timestamp_pb2

from emulator.verify import TableComparison, canonical, compare_table
from ingest.contract.changelog import SCHEMA_ROW, SNAPSHOT_ROW
from ingest.model.timestamps import NANOS_PER_SECOND, parse_rfc3339, to_rfc3339
from pipeline import batch_log
from pipeline.as_of import history_as_of, mirrors_as_of
from pipeline.catalog import scan
from pipeline.history import Histories
from pipeline.shapes import TableShape
from tests.recompute import Commit, running_balance, status_durations

HISTORY_COLUMNS = {
    "accounts": ("*",),
    "transfers": ("from_account_id", "transfer_id", "to_account_id", "amount"),
    "all_types": ("id", "variant", "col_string"),
}
"""What the recomputations read: every column of an account (any change of its row is one the
running balance reports), the rest as the examples use them."""
KEY_COLUMNS = {"accounts": 1, "transfers": 2, "all_types": 2}
BALANCE_FIELDS = (
    "account_id",
    "commit_timestamp_text",
    "balance",
    "transfers_24h",
    "amount_in_24h",
    "amount_out_24h",
)
STATUS_FIELDS = (
    "id",
    "variant",
    "status",
    "entered_text",
    "left_text",
    "seconds",
    "total_seconds_in_status",
    "period",
)


def check_state_schema(env: dict[str, str], processors: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", "check-state-schema"],
        env={**env, "PIPELINE_PROCESSORS": processors},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def statuses_as_bytes(database: Any) -> None:
    """Some ``all_types`` rows given a new status once ``col_string`` is BYTES (the client
    sends BYTES as base64)."""
    with database.snapshot() as snapshot:
        keys = list(snapshot.execute_sql("SELECT id, variant FROM all_types ORDER BY id LIMIT 5"))
    assert keys, "the workload wrote no all_types row"
    with database.batch() as batch:
        batch.update(
            "all_types",
            ["id", "variant", "col_string"],
            [
                (row_id, variant, base64.b64encode(f"bytes-{row_id}".encode()))
                for row_id, variant in keys
            ],
        )


def commit_times(changelog: str) -> list[str]:
    """Every transaction's commit timestamp in the change log."""
    rows = scan(DeltaTable(changelog), ["commit_timestamp_text", "mod_type"]).to_pylist()
    kinds = (SCHEMA_ROW, SNAPSHOT_ROW)
    return sorted({r["commit_timestamp_text"] for r in rows if r["mod_type"] not in kinds})


def spanner_history(database: Any, changelog: str, shapes: dict[str, TableShape]) -> list[Commit]:
    """The captured tables' columns the examples read, from Spanner at each commit timestamp;
    a column a table did not have yet is NULL, so adding it changes no row."""
    commits = []
    for text in commit_times(changelog):
        nanos = parse_rfc3339(text)
        tables: dict[str, dict[tuple, dict[str, Any]]] = {}
        with database.snapshot(read_timestamp=_stamp(nanos), multi_use=True) as snapshot:
            for table, columns in HISTORY_COLUMNS.items():
                results = snapshot.execute_sql(f"SELECT {', '.join(columns)} FROM {table}")
                rows = list(results)
                names = [field.name for field in results.fields]
                every = [c.name for c in shapes[table].columns] if columns == ("*",) else names
                keyed = {}
                for row in rows:
                    values = {**dict.fromkeys(every), **dict(zip(names, row, strict=True))}
                    if isinstance(values.get("col_string"), bytes):
                        values["col_string"] = base64.b64decode(values["col_string"])
                    keyed[tuple(values[c] for c in names[: KEY_COLUMNS[table]])] = values
                tables[table] = keyed
        at = dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(microseconds=nanos // 1000)
        commits.append(Commit(at, text, tables))
    return commits


def assert_examples_equal_recomputed(root: Path, commits: list[Commit], context: str) -> None:
    for name, fields, expected in (
        ("running_balance", BALANCE_FIELDS, running_balance(commits, first_is_snapshot=False)),
        ("status_durations", STATUS_FIELDS, status_durations(commits)),
    ):
        landed = DeltaTable(str(root / name)).to_pyarrow_table().to_pylist()
        got = sorted((tuple(r[f] for f in fields) for r in landed), key=repr)
        wanted = sorted((tuple(r[f] for f in fields) for r in expected), key=repr)
        missing = [r for r in wanted if r not in got]
        extra = [r for r in got if r not in wanted]
        assert got == wanted, (
            f"{context}: {name}: {len(got)} rows, {len(wanted)} expected; "
            f"missing {missing[:3]}, extra {extra[:3]}"
        )
        assert wanted, f"{context}: {name} has nothing to compare"


def assert_reads_as_of_equal_spanner(
    database: Any,
    changelog: str,
    root: Path,
    shapes: dict[str, TableShape],
    rng: random.Random,
    context: str,
    times: int = 50,
) -> None:
    """At ``times`` random T from the change log's first commit to the newest consistent W:
    the histories as of T equal Spanner read at T; the mirrors as of T equal Spanner at the W
    they name."""
    mirror_root = str(root / "mirrors")
    histories = Histories(str(root / "history"), frozenset({"*"}))
    landed = batch_log.consistent(mirror_root)
    assert landed, f"{context}: no consistent batch recorded"
    first = parse_rfc3339(commit_times(changelog)[0])
    last = parse_rfc3339(str(landed[-1].watermark_text))
    chosen = sorted(rng.randint(first, last) for _ in range(times))
    for nanos in chosen:
        at = to_rfc3339(nanos)
        exact = history_as_of(histories, mirror_root, at)
        _assert_equal(database, shapes, exact.tables, nanos, f"{context}: history as of {at}")
        if at < str(landed[0].watermark_text):
            continue
        batched = mirrors_as_of(mirror_root, at)
        watermark = parse_rfc3339(batched.consistent_at)
        assert watermark <= nanos
        where = f"{context}: mirrors as of {at} (W {batched.consistent_at})"
        _assert_equal(database, shapes, batched.tables, watermark, where)


def _assert_equal(
    database: Any, shapes: dict[str, TableShape], tables: dict[str, Any], nanos: int, where: str
) -> None:
    comparisons: list[TableComparison] = []
    for table, shape in sorted(shapes.items()):
        read = _spanner_at(database, shape, nanos)
        rows = tables[table].to_pylist() if table in tables else []
        ours = _keyed(shape, [_canonical_row(shape, row, False) for row in rows])
        comparisons.append(compare_table(shape, read, ours))
    assert all(c.equal for c in comparisons), f"{where}: " + "; ".join(
        c.describe() for c in comparisons
    )


def _spanner_at(database: Any, shape: TableShape, nanos: int) -> dict[tuple, dict[str, Any]]:
    """The table at that time, every column it then had; a column it did not have is NULL."""
    with database.snapshot(read_timestamp=_stamp(nanos)) as snapshot:
        results = snapshot.execute_sql(f"SELECT * FROM `{shape.name}`")
        rows = list(results)
        names = [field.name for field in results.fields]
    return _keyed(
        shape,
        [_canonical_row(shape, dict(zip(names, row, strict=True)), True) for row in rows],
    )


def _canonical_row(shape: TableShape, row: dict[str, Any], spanner: bool) -> dict[str, Any]:
    return {
        c.name: canonical(c.type, row.get(c.name), spanner, timestamp_digits=0)
        for c in shape.columns
    }


def _keyed(shape: TableShape, rows: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    keys = [c.name for c in shape.key_columns]
    return {tuple(row[k] for k in keys): row for row in rows}


def _stamp(nanos: int) -> timestamp_pb2.Timestamp:
    seconds, fraction = divmod(nanos, NANOS_PER_SECOND)
    return timestamp_pb2.Timestamp(seconds=seconds, nanos=fraction)
