"""Read a change-log table version by version from its Delta log, and check the invariants."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.parquet as pq
from pyarrow import fs as pafs

from emulator.workload import CommittedTransaction
from ingest.contract.changelog import (
    CHECKPOINT_KEY,
    SCHEMA_ROW,
    SNAPSHOT_ROW,
    Checkpoint,
    from_json,
)
from ingest.model.timestamps import parse_rfc3339, to_rfc3339
from ingest.service.audit import NOT_TRANSACTIONS
from pipeline.catalog import scan
from runtime.storage import arrow_filesystem


@dataclass
class Version:
    number: int
    operation: str
    checkpoint: Checkpoint | None
    rows: list[dict]


def read_versions(table: Path | str) -> list[Version]:
    """Every version of the table at a local path or an object store URI, read from its log."""
    filesystem, root = arrow_filesystem(str(table))
    selector = pafs.FileSelector(f"{root}/_delta_log", allow_not_found=True)
    log_files = sorted(
        info.path for info in filesystem.get_file_info(selector) if info.path.endswith(".json")
    )
    versions = []
    for log_file in log_files:
        with filesystem.open_input_stream(log_file) as stream:
            text = stream.read().decode()
        actions = [json.loads(line) for line in text.splitlines() if line]
        info = next(a["commitInfo"] for a in actions if "commitInfo" in a)
        checkpoint = info.get(CHECKPOINT_KEY)
        rows: list[dict] = []
        for action in actions:
            add = action.get("add")
            if add and add.get("dataChange", True):
                data = f"{root}/{unquote(add['path'])}"
                rows.extend(pq.read_table(data, filesystem=filesystem).to_pylist())
        versions.append(
            Version(
                int(log_file.rsplit("/", 1)[1].removesuffix(".json")),
                info.get("operation", ""),
                from_json(checkpoint) if checkpoint else None,
                rows,
            )
        )
    return versions


def late_landings(table: Path | str) -> list[str]:
    """Transactions landed at or below an earlier version's low watermark: that version's cut
    claimed them before they were in the change log, so a job that read up to it missed them
    (what a comparison made later, once they had landed, cannot show)."""
    said: dict[str, str] = {}
    passed = None
    for version in read_versions(table):
        if version.checkpoint is None:
            continue  # not the sink's landing: a rewrite (a user's DELETE) re-adds older rows
        for row in version.rows:
            stamp = parse_rfc3339(row["commit_timestamp_text"])
            if row["mod_type"] in NOT_TRANSACTIONS or passed is None or stamp > passed:
                continue
            said.setdefault(
                row["server_transaction_id"],
                f"late {row['commit_timestamp_text']} transaction {row['server_transaction_id']}: "
                f"in version {version.number}, at or below an earlier version's W "
                f"{to_rfc3339(passed)}",
            )
        watermark = version.checkpoint.resume_point.low_watermark
        passed = watermark if passed is None else max(passed, watermark)
    return list(said.values())


def job_versions(appends: list[Version]) -> list[int | None]:
    """The job version each append's checkpoint carries (None: it carries none)."""
    return [v.checkpoint.version if v.checkpoint else None for v in appends]


def describe_job_versions(appends: list[Version]) -> str:
    """Where the job's versions leave 1, 2, 3, ...: each Delta version from the first wrong one
    on, with the job version, owner and commit time its checkpoint carries (at most twenty)."""
    wrong = next(
        (i for i, v in enumerate(appends) if v.checkpoint is None or v.checkpoint.version != i + 1),
        len(appends),
    )
    said = [
        f"Delta {v.number}: "
        + (
            f"job v{v.checkpoint.version} by {v.checkpoint.owner} at {v.checkpoint.committed_at}"
            if v.checkpoint
            else "no checkpoint"
        )
        for v in appends[max(0, wrong - 3) : wrong + 17]
    ]
    return f"{len(appends)} appends, first wrong at #{wrong + 1}; " + "; ".join(said)


def assert_change_log_invariants(
    table: Path | str,
    committed: list[CommittedTransaction],
    start_balance_total: int | None = None,
    unlisted: int = 0,
) -> list[Version]:
    """Exactly once, whole transactions per version, consistent cuts, commit order.

    ``unlisted``: transactions committed besides ``committed`` (a test's seed), each expected
    once too."""
    versions = read_versions(table)
    appends = [v for v in versions if v.operation == "WRITE"]
    assert job_versions(appends) == list(range(1, len(appends) + 1)), (
        "application transaction versions must be 1, 2, 3, ... with no gap or repeat: "
        + describe_job_versions(appends)
    )

    seen_in: dict[str, int] = {}
    previous_watermark = None
    previous_max = None
    balance_delta = 0
    data_rows: list[dict] = []
    for version in appends:
        assert version.checkpoint is not None
        watermark = version.checkpoint.resume_point.low_watermark
        schema_rows = [r for r in version.rows if r["mod_type"] == SCHEMA_ROW]
        assert len({r["table_name"] for r in schema_rows}) == len(schema_rows)
        for row in schema_rows:
            assert (row["commit_timestamp_text"], row["server_transaction_id"], row["keys"]) == (
                to_rfc3339(watermark),
                "",
                "",
            ), "a schema row is read at its version's low watermark and is no transaction"
        for row in (r for r in version.rows if r["mod_type"] == SNAPSHOT_ROW):
            assert version.checkpoint.snapshot is not None
            assert (row["commit_timestamp_text"], row["server_transaction_id"]) == (
                to_rfc3339(version.checkpoint.snapshot.read_timestamp),
                "",
            ), "a snapshot row is read at T0 and is no transaction"
            assert previous_max is None, "a snapshot row after a change"
        version_rows = [r for r in version.rows if r["mod_type"] not in (SCHEMA_ROW, SNAPSHOT_ROW)]
        data_rows += version_rows
        stamps = [parse_rfc3339(r["commit_timestamp_text"]) for r in version_rows]
        for row, stamp in zip(version_rows, stamps, strict=True):
            tx = row["server_transaction_id"]
            assert seen_in.setdefault(tx, version.number) == version.number, (
                f"transaction {tx} spans versions {seen_in[tx]} and {version.number}"
            )
            assert stamp <= watermark
            if previous_watermark is not None:
                assert stamp > previous_watermark, "row at or below the previous cut"
        if stamps and previous_max is not None:
            assert min(stamps) > previous_max, "versions out of commit order"
        if stamps:
            previous_max = max(stamps)
        previous_watermark = watermark
        for row in version_rows:
            if row["table_name"] == "accounts" and row["mod_type"] == "UPDATE":
                new, old = json.loads(row["new_values"]), json.loads(row["old_values"])
                balance_delta += int(new["balance"]) - int(old["balance"])
        assert balance_delta == 0, f"version {version.number} is not a consistent cut"

    rows = data_rows
    by_transaction: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_transaction[row["server_transaction_id"]].append(row)
    for tx, tx_rows in by_transaction.items():
        keys = Counter((r["record_sequence"], r["mod_index"]) for r in tx_rows)
        assert max(keys.values()) == 1, f"duplicate rows in transaction {tx}"
        records = {r["record_sequence"] for r in tx_rows}
        assert len(records) == tx_rows[0]["number_of_records_in_transaction"], tx
    landed = Counter(
        parse_rfc3339(rows[0]["commit_timestamp_text"]) for rows in by_transaction.values()
    )
    expected = Counter(t.commit_timestamp for t in committed)
    missing = expected - landed
    extra = landed - expected
    assert not missing and len(extra) == unlisted and set(extra.values()) <= {1}, (
        f"missing {len(missing)}, extra {len(extra)} (of {unlisted} expected)"
    )
    mods = Counter(parse_rfc3339(r["commit_timestamp_text"]) for r in rows)
    for transaction in committed:
        assert mods[transaction.commit_timestamp] == len(transaction.mods), transaction
    return versions


def table_rows(table: Path) -> pa.Table:
    from deltalake import DeltaTable

    return scan(DeltaTable(str(table)))
