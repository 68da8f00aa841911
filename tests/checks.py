"""Compare what a reader printed with what the workload committed; read the reader's event log."""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from google.api_core.exceptions import FailedPrecondition
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential_jitter

from emulator.bootstrap import seed_accounts
from emulator.verify import TableComparison, changelog_watermark, compare_mirrors
from emulator.workload import CommittedTransaction, load_existing_rows
from ingest.model.timestamps import NANOS_PER_SECOND, parse_rfc3339, to_rfc3339
from ingest.model.values import decode_row
from pipeline.catalog import discover_shapes
from pipeline.shapes import TableShape

TIMESTAMP_COLUMNS = {"updated_at", "created_at", "col_timestamp"}


ACCOUNTS = 40_000
"""The accounts of the snapshot tests' existing database (``hundred_thousand_rows``)."""


def hundred_thousand_rows(seed: int) -> Callable[[Any], int]:
    """The snapshot tests' existing rows over three tables (with ``ACCOUNTS`` accounts), for
    ``new_database(existing=...)``: written before the change streams exist, as in a database a
    user starts capturing. all_types rows cost the pipeline most (every type): few of them."""
    return lambda database: load_existing_rows(
        database, ACCOUNTS, transfers=55_000, all_types=5_000, seed=seed
    )


def crash_seed() -> tuple[int, random.Random]:
    """The seed of a test's random kills and pauses, and its generator: ``CRASH_TEST_SEED``
    replays the run a failure names."""
    seed = int(os.environ.get("CRASH_TEST_SEED", time.time_ns() % 100_000))
    print(f"CRASH_TEST_SEED={seed}")  # in a failure's captured output, to replay the run
    return seed, random.Random(seed)


def emulator_timestamp(nanos: int) -> int:
    """The emulator's change stream writes TIMESTAMP column values without their fraction.

    The stored value keeps all nine digits (tests read it back); production change streams send
    them too, which the scripted server test covers.
    """
    return nanos - nanos % NANOS_PER_SECOND


def start_after_setup(margin_seconds: float = 0.2) -> int:
    """A start timestamp past every commit made so far.

    The emulator's commit timestamps run up to a few milliseconds ahead of the client's clock,
    so a start taken right after the bootstrap commit could still see that commit.
    """
    start = time.time_ns() + int(margin_seconds * NANOS_PER_SECOND)
    time.sleep(margin_seconds * 1.5)
    return start


def read_json_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def decoded_mods(transaction: dict[str, Any]) -> list[tuple[str, str, dict, dict]]:
    mods = []
    for record in transaction["records"]:
        types = {c["name"]: c["type"] for c in record["column_types"]}
        for mod in record["mods"]:
            keys = decode_row(types, mod["keys"])
            values = decode_row(types, mod["new_values"])
            mods.append((record["table_name"], record["mod_type"], keys, values))
    return mods


def describe_stamps(stamps: Counter[int], committed: list[CommittedTransaction]) -> list[str]:
    """Where each missing commit sits in the workload, to tell a lost tail from a lost middle."""
    order = sorted(t.commit_timestamp for t in committed)
    return [
        f"{to_rfc3339(stamp)} (#{order.index(stamp) + 1} of {len(order)})"
        for stamp in sorted(stamps)
    ]


def assert_matches_committed(
    printed: list[dict[str, Any]],
    committed: list[CommittedTransaction],
    truncated_timestamps: bool = True,
) -> None:
    """Every committed transaction once, whole, with every written value; nothing else."""
    stamps = [parse_rfc3339(t["commit_timestamp"]) for t in printed]
    assert stamps == sorted(stamps), "transactions out of commit timestamp order"
    for transaction in printed:
        sequences = [r["record_sequence"] for r in transaction["records"]]
        assert sequences == sorted(sequences, key=lambda s: (len(s), s))
        assert len(sequences) == transaction["number_of_records_in_transaction"]
    ids = Counter(t["server_transaction_id"] for t in printed)
    assert max(ids.values(), default=1) == 1, "a transaction was printed twice"

    by_timestamp: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for transaction, stamp in zip(printed, stamps, strict=True):
        by_timestamp[stamp].append(transaction)
    expected_stamps = Counter(t.commit_timestamp for t in committed)
    missing = expected_stamps - Counter(stamps)
    extra = Counter(stamps) - expected_stamps
    assert not missing and not extra, (
        f"printed {len(printed)} transactions, committed {len(committed)}; "
        f"missing {describe_stamps(missing, committed)}; extra {sorted(extra)}"
    )
    for written_transaction in committed:
        [candidate] = by_timestamp[written_transaction.commit_timestamp]
        got = decoded_mods(candidate)
        assert len(got) == len(written_transaction.mods), (written_transaction, got)
        for written in written_transaction.mods:
            matches = [
                values
                for table, mod_type, keys, values in got
                if (table, mod_type, keys) == (written.table, written.mod_type, written.keys)
            ]
            assert len(matches) == 1, (written, got)
            for column, value in written.values.items():
                expected = value
                if truncated_timestamps and column in TIMESTAMP_COLUMNS and value is not None:
                    expected = emulator_timestamp(value)
                assert matches[0][column] == expected, (column, written, matches[0])


def assert_partition_lineage(log_lines: list[dict[str, Any]]) -> dict[str, int]:
    """From the reader's own event log: one first query per partition, merges after all parents.

    Returns counts of splits (a parent with ≥ 2 children) and merges (a child with ≥ 2 parents).
    """
    parents: dict[str, list[str]] = {}
    finished_at: dict[str, int] = {}
    first_run_at: dict[str, int] = {}
    splits = 0
    for position, event in enumerate(log_lines):
        name, token = event.get("event"), str(event.get("partition_token"))
        if name == "partition_created":
            assert token not in parents, f"partition {token} created twice"
            parents[token] = event["parent_partition_tokens"]
        elif name == "partition_running" and event["attempt"] == 1:
            assert token not in first_run_at, f"partition {token} queried twice"
            first_run_at[token] = position
        elif name == "partition_finished":
            finished_at[token] = position
            splits += len(event["child_partition_tokens"]) >= 2
    for token, position in first_run_at.items():
        for parent in parents[token]:
            assert parent in finished_at and finished_at[parent] < position, (
                f"partition {token} started before its parent {parent} finished"
            )
    merges = sum(len(p) >= 2 for p in parents.values())
    return {"splits": splits, "merges": merges, "partitions": len(first_run_at)}


def apply_ddl(database: Any, *statements: str) -> None:
    """The emulator refuses DDL while a read-write transaction runs ("concurrent schema change
    operation or read-write transaction"): try again until it takes."""
    for attempt in Retrying(
        retry=retry_if_exception_type(FailedPrecondition),
        wait=wait_exponential_jitter(multiplier=0.1, max=2),
        stop=stop_after_delay(60),
        reraise=True,
    ):
        with attempt:
            database.update_ddl(list(statements)).result(120)


def compare_at_watermark(
    database: Any, changelog: str, mirror_root: str, tables: Collection[str] | None = None
) -> tuple[dict[str, TableShape], list[TableComparison]]:
    """Each mirror (of ``tables``, or all) against its Spanner table read at exactly the change
    log's W; TIMESTAMPs at whole seconds (the emulator's change stream drops their fraction)."""
    watermark = changelog_watermark(changelog)
    assert watermark is not None, "the change log holds no consistent cut"
    shapes = {t: s for t, s in discover_shapes(changelog).items() if tables is None or t in tables}
    comparisons = compare_mirrors(
        database, mirror_root, shapes, watermark.low_watermark, timestamp_digits=0
    )
    return shapes, comparisons


def assert_mirrors_equal(comparisons: list[TableComparison], context: str = "") -> None:
    assert all(c.equal for c in comparisons), f"{context}: " + "; ".join(
        c.describe() for c in comparisons
    )


def assert_mirrors_hold(comparisons: list[TableComparison], written: Collection[str]) -> None:
    """Not a vacuous comparison: each table the test wrote was compared and its mirror holds
    rows (a captured table nobody wrote has an empty mirror, as Spanner holds it)."""
    rows = {c.table: c.mirror_rows for c in comparisons}
    assert all(rows.get(table, 0) > 0 for table in written), (written, comparisons)


SEED_TRANSACTIONS = 1
"""What ``accounts_written_after_start`` puts in the change log before any workload: a wait for
the workload's transactions to land counts these too, or it ends one transaction early."""


def accounts_written_after_start(new_database: Any) -> tuple[Any, int]:
    """A banking database whose 100 accounts are inserted after the returned job start (in
    ``SEED_TRANSACTIONS`` transactions), so the change log carries every row the workload then
    updates."""
    database = new_database("googlesql", accounts=0)
    start = start_after_setup()
    seed_accounts(database, accounts=100, initial_balance=1000)
    return database, start
