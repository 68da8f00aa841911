"""History tables and reads as of a Spanner time, on real Spark and Delta, over change logs
landed by the real ingest sink: a random history of one table (inserts, updates, deletes, a
key deleted and inserted again, a column added, a STRING column turned BYTES and back),
followed batch by batch, merged both ways, run again; read back at random times against a model
of the table, with the functions and with ``python -m pipeline as-of``."""

from __future__ import annotations

import base64
import itertools
import json
import os
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from ingest.model.records import ColumnType
from ingest.model.timestamps import to_rfc3339
from pipeline import batch_log
from pipeline.as_of import (
    NotAvailableAsOf,
    history_as_of,
    mirrors_as_of,
    spark_history_as_of,
    spark_mirrors_as_of,
)
from pipeline.columns import mirror_uri
from pipeline.history import HISTORY_SINCE, Histories, ensure_history
from pipeline.mirror import ensure_mirror
from pipeline.shapes import TableShape
from runtime.logs import null_logger
from tests.builders import ACCOUNTS, START, ChangeLog
from tests.pipeline_runs import configure, run, spark  # noqa: F401

EMAIL = ColumnType("email", {"code": "STRING"}, False, 4)
OWNER_BYTES = ColumnType("owner", {"code": "BYTES"}, False, 2)

Row = dict[str, Any]


class Model:
    """The table as Spanner holds it, after each transaction."""

    def __init__(self) -> None:
        self.rows: dict[int, Row] = {}
        self.timeline: list[tuple[int, dict[int, Row]]] = [(START - 1, {})]

    def apply(self, when: int, mods: list[tuple[str, int, Row]]) -> None:
        for mod_type, key, values in mods:
            if mod_type == "DELETE":
                del self.rows[key]
            else:
                self.rows[key] = {**self.rows.get(key, {"account_id": key}), **values}
        self.timeline.append((when, {k: dict(v) for k, v in self.rows.items()}))

    def at(self, when: int) -> dict[int, Row]:
        return [rows for stamp, rows in self.timeline if stamp <= when][-1]


def comparable(row: Row) -> Row:
    """A row as both sides can show it: text and bytes alike, absent columns NULL."""
    shown = {"email": None, **row}
    if isinstance(shown.get("owner"), str):
        shown["owner"] = shown["owner"].encode()
    if isinstance(shown.get("owner"), bytearray):
        shown["owner"] = bytes(shown["owner"])
    return shown


def as_rows(table: Any) -> dict[int, Row]:
    return {r["account_id"]: comparable(r) for r in table.to_pylist()}


def write_history(rng: random.Random, changelog: ChangeLog, model: Model, stage: int) -> None:
    """One stage of random transactions, landed in two versions."""
    for _ in range(2):
        for _ in range(rng.randint(3, 6)):
            mods: list[tuple[str, int, Row]] = []
            touched: set[int] = set()
            for _ in range(rng.randint(1, 3)):
                key = rng.randint(1, 12)
                if key in touched:
                    continue
                touched.add(key)
                balance = rng.randint(0, 999)
                if key in model.rows and rng.random() < 0.3:
                    mods.append(("DELETE", key, {}))
                elif key in model.rows:
                    mods.append(("UPDATE", key, {"balance": balance}))
                else:
                    owner = f"o{key}-{stage}"
                    values: Row = {"owner": owner, "balance": balance}
                    if stage >= 1:
                        values["email"] = f"{key}@s{stage}"
                    mods.append(("INSERT", key, values))
            if not mods:
                continue
            transaction = changelog.commit(*[wire(m, stage) for m in mods])
            model.apply(transaction.commit_timestamp, mods)
        changelog.land()


def wire(mod: tuple[str, int, Row], stage: int) -> tuple[str, str, Row, Row]:
    """A model mod as the change log carries it (INT64 as text, BYTES as base64)."""
    mod_type, key, values = mod
    sent: Row = {}
    for name, value in values.items():
        if name == "owner" and stage == 2:
            sent[name] = base64.b64encode(value.encode()).decode()
        elif name == "balance":
            sent[name] = str(value)
        else:
            sent[name] = value
    return ("accounts", mod_type, {"account_id": str(key)}, sent)


@pytest.mark.parametrize("local_merge_max_rows", [50_000, 0], ids=["delta-rs", "spark"])
def test_history_and_mirrors_read_as_of_any_time_equal_the_table_then(
    spark,  # noqa: F811
    tmp_path: Path,
    local_merge_max_rows: int,
) -> None:
    rng = random.Random(30 + local_merge_max_rows)
    config = configure(
        tmp_path,
        history_tables="*",
        history_root=str(tmp_path / "history"),
        local_merge_max_rows=local_merge_max_rows,
    )
    changelog = ChangeLog(config.changelog_uri)
    model = Model()
    for stage in range(4):
        if stage == 1:
            changelog.columns["accounts"] = (*ACCOUNTS, EMAIL)
        if stage == 2:
            changelog.columns["accounts"] = (ACCOUNTS[0], OWNER_BYTES, ACCOUNTS[2], EMAIL)
        if stage == 3:
            changelog.columns["accounts"] = (*ACCOUNTS, EMAIL)
        write_history(rng, changelog, model, stage)
        run(spark, config)
    assert run(spark, config).batches == 0, "nothing new: a run again changes nothing"

    histories = Histories(config.history_root, frozenset({"*"}))
    landed = batch_log.read(config.mirror_root)
    assert landed and all(b.consistent for b in landed)
    end = max(stamp for stamp, _ in model.timeline)
    commits = [stamp for stamp, _ in model.timeline[1:]]
    times = rng.sample(commits, 10) + [c - 1 for c in rng.sample(commits, 10)]
    times += [rng.randint(START, end) for _ in range(30)]
    for when in sorted(times):
        at = to_rfc3339(when)
        exact = history_as_of(histories, config.mirror_root, at)
        assert as_rows(exact.tables["accounts"]) == {
            k: comparable(v) for k, v in model.at(when).items()
        }, at
        if at < str(landed[0].watermark_text):
            with pytest.raises(NotAvailableAsOf, match="no consistent batch at or before"):
                mirrors_as_of(config.mirror_root, at)
            continue
        batched = mirrors_as_of(config.mirror_root, at)
        watermark = batched.consistent_at
        assert watermark <= at
        assert as_rows(batched.tables["accounts"]) == {
            k: comparable(v) for k, v in model.at(_nanos(watermark)).items()
        }, (at, watermark)

    at = to_rfc3339(rng.choice(commits[len(commits) // 2 :]))
    with_spark = spark_history_as_of(spark, histories, config.mirror_root, at)
    assert {
        r["account_id"]: comparable(r.asDict()) for r in with_spark.tables["accounts"].collect()
    } == as_rows(history_as_of(histories, config.mirror_root, at).tables["accounts"])
    with_spark = spark_mirrors_as_of(spark, config.mirror_root, at)
    assert {
        r["account_id"]: comparable(r.asDict()) for r in with_spark.tables["accounts"].collect()
    } == as_rows(mirrors_as_of(config.mirror_root, at).tables["accounts"])

    history = DeltaTable(histories.uri("accounts")).to_pyarrow_table().to_pylist()
    current = [r for r in history if r["_is_current"]]
    assert sorted(r["account_id"] for r in current) == sorted(model.rows)
    assert all(r["_valid_to"] is None for r in current)
    per_key: dict[int, list[Row]] = {}
    for row in history:
        per_key.setdefault(row["account_id"], []).append(row)
    for versions in per_key.values():
        versions.sort(key=lambda r: r["_valid_from_text"])
        for older, newer in itertools.pairwise(versions):
            assert older["_valid_to_text"] is not None
            assert older["_valid_to_text"] <= newer["_valid_from_text"]

    with pytest.raises(NotAvailableAsOf, match="after the newest consistent batch"):
        history_as_of(histories, config.mirror_root, to_rfc3339(end + 10**12))
    with pytest.raises(NotAvailableAsOf, match="before the change log begins"):
        history_as_of(histories, config.mirror_root, to_rfc3339(START - 10**9))

    check_the_command_line(config, histories, at, tmp_path / "as-of", to_rfc3339(end + 10**12))


def as_of_command(config: Any, *arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", "as-of", *arguments],
        env={
            **os.environ,
            "PIPELINE_MIRROR_ROOT": config.mirror_root,
            "PIPELINE_HISTORY_ROOT": config.history_root,
            "PIPELINE_HISTORY_TABLES": config.history_tables,
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def check_the_command_line(
    config: Any, histories: Histories, at: str, output: Path, too_late: str
) -> None:
    """``python -m pipeline as-of``: JSON lines, or Delta tables, equal to the function's
    answer; a time the tables do not hold is one error line and exit 2."""
    for source, expected in (
        ("history", history_as_of(histories, config.mirror_root, at)),
        ("mirrors", mirrors_as_of(config.mirror_root, at)),
    ):
        printed = as_of_command(config, at, "--source", source)
        assert printed.returncode == 0, printed.stderr
        lines = [json.loads(line) for line in printed.stdout.splitlines()]
        assert {line["table"] for line in lines} == {"accounts"}
        rows = {r["row"]["account_id"]: r["row"] for r in lines}
        wanted = expected.tables["accounts"].to_pylist()
        assert set(rows) == {r["account_id"] for r in wanted}, source
        for row in wanted:
            shown = rows[row["account_id"]]
            assert shown["balance"] == row["balance"], source
            owner = row["owner"]
            owner = base64.b64encode(owner).decode() if isinstance(owner, bytes) else owner
            assert shown["owner"] == owner, source
        summary = printed.stderr.strip().splitlines()[-1]
        assert summary.startswith(f"ok: {source} as of {at}, consistent at "), summary

        written = as_of_command(config, at, "--source", source, "--output", str(output / source))
        assert written.returncode == 0, written.stderr
        landed = DeltaTable(str(output / source / "accounts")).to_pyarrow_table()
        assert as_rows(landed) == as_rows(expected.tables["accounts"]), source

    refused = as_of_command(config, too_late)
    assert refused.returncode == 2, refused.stderr
    [line] = refused.stderr.strip().splitlines()
    assert line.startswith("error: ") and "after the newest consistent batch" in line, line


def _nanos(text: str) -> int:
    from ingest.model.timestamps import parse_rfc3339

    return parse_rfc3339(text)


def column(name: str, code: str, number: int, element: str | None = None) -> ColumnType:
    kind: dict[str, Any] = {"code": code}
    if element is not None:
        kind["array_element_type"] = {"code": element}
    return ColumnType(name, kind, number == 1, number)


EVERY_TYPE = (
    column("account_id", "INT64", 1),
    column("ts", "TIMESTAMP", 2),
    column("day", "DATE", 3),
    column("ratio", "FLOAT64", 4),
    column("ratio32", "FLOAT32", 5),
    column("amount", "NUMERIC", 6),
    column("raw", "BYTES", 7),
    column("owner", "STRING", 8),
    column("doc", "JSON", 9),
    column("flag", "BOOL", 10),
    column("stamps", "ARRAY", 11, "TIMESTAMP"),
    column("ratios", "ARRAY", 12, "FLOAT64"),
)
ROWS: dict[str, dict[str, Any]] = {
    "1": {
        "ts": "2026-01-02T03:04:05.123456Z",
        "day": "2026-01-02",
        "ratio": "NaN",
        "ratio32": 0.1,
        "amount": "1.5",
        "raw": base64.b64encode(b"\x00\xff").decode(),
        "owner": "ann",
        "doc": '{"a":[1,null]}',
        "flag": True,
        "stamps": ["2026-01-02T03:04:05Z", None],
        "ratios": ["NaN", 0.5, None],
    },
    "2": {
        "ts": "0001-01-01T00:00:00Z",
        "day": "0001-01-01",
        "ratio": "-Infinity",
        "ratio32": 3.4028234663852886e38,
        "amount": "-99999999999999999999999999999.999999999",
        "stamps": ["9999-12-31T23:59:59.999999Z"],
    },
    "3": {"ts": "9999-12-31T23:59:59.999999Z", "day": "9999-12-31"},
}


def test_a_change_that_leaves_the_row_as_it_was_adds_no_history_version(
    spark,  # noqa: F811
    tmp_path: Path,
) -> None:
    """An update writing a row's own values again, as its key's first change of a batch, once
    added a version identical to the one before (a timestamp read back from state compared
    unequal to the change's), and a NaN never equals itself."""
    config = configure(tmp_path, history_tables="*", history_root=str(tmp_path / "history"))
    changelog = ChangeLog(
        config.changelog_uri, columns={"accounts": EVERY_TYPE}, value_capture_type="NEW_ROW"
    )
    changelog.commit(*[("accounts", "INSERT", {"account_id": k}, v) for k, v in ROWS.items()])
    changelog.land()
    run(spark, config)
    changelog.commit(*[("accounts", "UPDATE", {"account_id": k}, v) for k, v in ROWS.items()])
    changelog.commit(("accounts", "UPDATE", {"account_id": "3"}, {**ROWS["3"], "flag": False}))
    changelog.land()
    run(spark, config)

    uri = Histories(config.history_root, frozenset({"*"})).uri("accounts")
    versions: dict[int, int] = {}
    for row in DeltaTable(uri).to_pyarrow_table().to_pylist():
        versions[row["account_id"]] = versions.get(row["account_id"], 0) + 1
    assert versions == {1: 1, 2: 1, 3: 2}


class UntouchedSpark:
    """A Spark session that fails the test when anything is asked of it."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"Spark was asked for {name!r}")


def test_a_history_added_later_begins_with_its_mirror_and_one_beside_an_empty_mirror_reads_none(
    spark,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A history added to a job whose mirror holds rows begins with them, each a current version
    valid from its last change, and records from when it holds the table. Beside an empty mirror
    (every new job's) it is made without a Spark job: reading the empty mirror through Spark cost
    seconds of each start."""
    config = configure(tmp_path)
    changelog = ChangeLog(config.changelog_uri)
    changelog.commit(*[wire(("INSERT", k, {"owner": f"o{k}", "balance": k}), 0) for k in (1, 2)])
    changelog.commit(wire(("UPDATE", 2, {"balance": 20}), 0))
    changelog.land()
    run(spark, config)
    with_history = replace(config, history_tables="*", history_root=str(tmp_path / "history"))
    run(spark, with_history)

    mirror = DeltaTable(mirror_uri(config.mirror_root, "accounts")).to_pyarrow_table().to_pylist()
    history = DeltaTable(Histories(with_history.history_root, frozenset({"*"})).uri("accounts"))
    versions = history.to_pyarrow_table().to_pylist()
    assert sorted((r["account_id"], r["balance"]) for r in versions) == [(1, 1), (2, 20)]
    assert all(r["_is_current"] and r["_valid_to_text"] is None for r in versions)
    last_change = {r["account_id"]: r["_cdc_last_applied"]["commit_timestamp_text"] for r in mirror}
    assert {r["account_id"]: r["_valid_from_text"] for r in versions} == last_change
    assert history.metadata().configuration.get(HISTORY_SINCE)

    empty_mirror = str(tmp_path / "empty" / "mirror")
    shape = TableShape("accounts", ACCOUNTS)
    untouched: Any = UntouchedSpark()
    ensure_mirror(untouched, empty_mirror, shape, null_logger())
    made = str(tmp_path / "empty" / "history")
    ensure_history(untouched, made, shape, empty_mirror, lambda: "", null_logger())
    assert DeltaTable(made).to_pyarrow_table().num_rows == 0
